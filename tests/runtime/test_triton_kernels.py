"""The Triton provider's kernels on CPU, under Triton's interpreter (skipped without Triton).

The interpreter computes in numpy float32 with exact ``rsqrt`` / ``exp`` and IEEE division, and
(``triton_kernels`` fixture) rounds casts as the GPU does; the kernels round where the spec
rounds, so here they give the spec's bytes exactly. On the GPU, approximate ``rsqrt`` / ``exp``
may move a value by one FP8 step: tests/runtime/test_ops_gpu.py checks that contract.
"""

from __future__ import annotations

import types
import zlib

import pytest
import torch

from fxrewrite.runtime.ops import quant
from fxrewrite.runtime.providers import OpDef
from samples import EPS, op_args, rand  # this folder

TRITON_OPS = [op for op in quant.DEFS if any(k.provider == "triton" for k in op.kernels)]
NORM_OPS = [op for op in TRITON_OPS if op.name.startswith(("rms", "fused"))]


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def as_tuple(out: object) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)  # type: ignore[return-value]


def check_of(op: OpDef) -> object:
    return next(k for k in op.kernels if k.provider == "triton").check


def assert_same_bytes(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    for g, w in zip(got, want):
        g, w = (g.view(torch.uint8), w.view(torch.uint8)) if g.dtype == quant.FP8_DTYPE else (g, w)
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(1, 64), (5, 33), (2, 3, 128), (4, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", TRITON_OPS, ids=lambda op: op.name)
def test_kernel_gives_the_spec_bytes(
    triton_kernels: types.ModuleType, gen: torch.Generator, op: OpDef, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    if op not in NORM_OPS:
        shape = (*shape[:-1], 2 * shape[-1])  # [..., 2d]
    args = op_args(op, shape, gen, dtype)
    assert check_of(op)(*args) is None  # type: ignore[operator]
    assert_same_bytes(as_tuple(getattr(triton_kernels, op.name)(*args)), as_tuple(op.reference(*args)))


@pytest.mark.parametrize("op", NORM_OPS, ids=lambda op: op.name)
def test_norm_reads_strided_rows(triton_kernels: types.ModuleType, gen: torch.Generator, op: OpDef) -> None:
    """Rows sliced out of a wider tensor (e.g. a fused projection's output) are read in place."""
    args = op_args(op, (3, 64), gen)
    for i in (0, 1) if "add" in op.name else (0,):
        args[i] = rand(gen, 3, 96)[:, 16:80]
    assert not args[0].is_contiguous() and check_of(op)(*args) is None  # type: ignore[operator]
    assert_same_bytes(as_tuple(getattr(triton_kernels, op.name)(*args)), as_tuple(op.reference(*args)))


@pytest.mark.parametrize("op", [op for op in TRITON_OPS if "dynamic" in op.name], ids=lambda op: op.name)
def test_zero_rows_get_the_floor_scale(triton_kernels: types.ModuleType, gen: torch.Generator, op: OpDef) -> None:
    """Padding tokens (zero rows) give q = 0 and s = 1e-12 / 448, never 0 or NaN."""
    args = op_args(op, (3, 64), gen)
    for i in (0, 1) if "add" in op.name else (0,):
        args[i] = torch.zeros_like(args[i])
    q, s = as_tuple(getattr(triton_kernels, op.name)(*args))[:2]
    assert torch.equal(q.float(), torch.zeros_like(q, dtype=torch.float32))
    assert torch.equal(s, torch.full_like(s, quant.SCALE_FLOOR))


def test_static_scale_saturates(triton_kernels: types.ModuleType, gen: torch.Generator) -> None:
    x, w = rand(gen, 4, 64), torch.ones(64, dtype=torch.bfloat16)
    q = triton_kernels.rms_norm_quant_fp8(x, w, EPS, torch.tensor([1e-4]))
    assert q.float().abs().max() == quant.FP8_MAX and not q.float().isnan().any()
    q = triton_kernels.silu_and_mul_quant_fp8(rand(gen, 3, 2 * 2000) * 4, torch.tensor([1e-4]))
    assert q.float().abs().max() == quant.FP8_MAX and not q.float().isnan().any()


def test_checks_refuse_what_the_kernels_cannot_serve(gen: torch.Generator) -> None:
    """No Triton needed: the checks live in the op module."""
    norm, static_silu, silu = (
        quant.DEFS[quant.OPS.index(name)]
        for name in ("rms_norm_dynamic_quant_fp8", "silu_and_mul_quant_fp8", "silu_and_mul_dynamic_quant_fp8")
    )
    x, w = rand(gen, 2, 64), rand(gen, 64)
    assert check_of(norm)(x.float(), w.float(), EPS) == "dtype float32 not bf16/fp16"  # type: ignore[operator]
    wide = quant.TRITON_MAX_ROW + 8
    reason = f"row of {wide} values exceeds one Triton program ({quant.TRITON_MAX_ROW})"
    assert check_of(norm)(rand(gen, 1, wide), rand(gen, wide), EPS) == reason  # type: ignore[operator]
    assert check_of(silu)(rand(gen, 1, 2 * wide)) == reason  # type: ignore[operator]
    assert check_of(static_silu)(rand(gen, 1, 2 * wide), torch.tensor([0.02])) is None  # type: ignore[operator]
    assert check_of(silu)(rand(gen, 4, 2 * 64)[:, :64]) == "input not contiguous"  # type: ignore[operator]
    assert "is not one float32" in check_of(static_silu)(x, torch.tensor([0.02, 0.03]))  # type: ignore[operator]
