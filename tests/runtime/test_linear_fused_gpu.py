"""The GEMMs with a norm prologue or a residual epilogue on the GPU, in their default provider
order, at the 8B layer's shapes: the Triton kernel up to 16 rows, what they replace above (the
norm op and cuBLAS; cuBLAS's addmm), errors against float32 no larger than the unfused bf16 code's,
and the kernels built ahead being the ones launched. (Every op against its reference under each
forced provider: tests/runtime/test_ops_gpu.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.gpu import fresh_counts, gen  # noqa: F401  (pytest fixtures of this module)

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import linear, linear_fused

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16 = torch.bfloat16
EPS = 1e-5
# (op, output columns n, weight rows, k): the 8B layer's qkv (with its norm, and rotating q and k),
# gate_up, o and down projections
CASES = [("rms_norm_linear", 6144, 6144, 4096), ("rms_norm_linear_rotary", 6144, 6144, 4096),
         ("rms_norm_linear_silu_and_mul", 14336, 28672, 4096), ("linear_add", 4096, 4096, 4096),
         ("linear_add_", 4096, 4096, 14336)]  # fmt: skip
HEAD, KV = 128, 1024  # the 8B layer's head size and k (and v) columns


def args_of(op: str, rows: int, n: int, w_rows: int, k: int, gen: torch.Generator, dtype: torch.dtype) -> list[Any]:
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(w_rows, k, device="cuda", generator=gen) * k**-0.5).to(dtype)
    if op == "rms_norm_linear_rotary":  # heads of 128, positions up to 4096 (the 8B model's rope_theta)
        g = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(dtype)
        freqs = 500000.0 ** (-torch.arange(HEAD // 2, device="cuda") / (HEAD // 2))
        angles = torch.arange(4096, device="cuda")[:, None] * freqs[None, :]
        cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
        positions = torch.randint(0, 4096, (rows,), device="cuda", generator=gen)
        return [x, g, EPS, w, None, False, positions, cache, n - KV]
    if op.startswith("rms_norm"):
        g = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(dtype)
        return [x, g, EPS, w]
    return [x, w, torch.randn(rows, n, device="cuda", generator=gen).to(dtype)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


def run(op: str, args: list[Any]) -> torch.Tensor:
    out = getattr(torch.ops.fxr, op)(*args)
    return args[2] if op.endswith("_") else out


@pytest.mark.parametrize("rows", [1, 8, 16, 17, 512])
@pytest.mark.parametrize(("op", "n", "w_rows", "k"), CASES, ids=[c[0] for c in CASES])
def test_triton_at_decode_sizes_then_what_the_op_replaces(op: str, n: int, w_rows: int, k: int, rows: int,
                                                          gen: torch.Generator) -> None:  # fmt: skip
    if providers.library(linear.TRITON_GEMM) is None:
        pytest.skip("triton is not importable here")
    definition = next(d for d in linear_fused.DEFS if d.name == op)
    spec_of = linear_fused.linear_add_reference if op == "linear_add_" else definition.reference  # its value
    args = args_of(op, rows, n, w_rows, k, gen, BF16)
    exact = spec_of(*[a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args])
    spec = spec_of(*args)
    got = run(op, args)
    label = "triton" if rows <= 16 else next(k.name for k in definition.kernels if k.provider != "triton")
    assert providers.served()[op] == {"fallbacks": {}, label: 1}
    # the fused kernel rounds fewer intermediates than the unfused code: no further from float32
    assert rel_err(got, exact) <= 1.05 * rel_err(spec, exact) + 1e-3, (rel_err(got, exact), rel_err(spec, exact))


def test_fused_kernels_built_ahead_are_the_ones_launched(gen: torch.Generator) -> None:
    """``providers.prebuild`` on fake tensors builds one kernel per fusion; the calls then build
    nothing more."""
    if providers.library(linear.TRITON_GEMM) is None:
        pytest.skip("triton is not importable here")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxrewrite.runtime import triton_gemm

    k = 4128  # not a multiple of any BK: builds no other test makes
    real = {op: args_of(op, 8, n, w_rows, k, gen, BF16) for op, n, w_rows, _ in CASES}
    with FakeTensorMode() as mode:
        fake = {op: [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args] for op, args in real.items()}
    note = providers.prebuild([(getattr(torch.ops.fxr, op).default, tuple(args), {}) for op, args in fake.items()])
    assert note is not None and note.startswith("4 kernels built ahead"), note  # linear_add(_): one build
    cache = triton_gemm._skinny_linear_kernel.device_caches[torch.cuda.current_device()][0]
    built = len(cache)
    for op, args in real.items():
        run(op, args)
    assert len(cache) == built


@pytest.mark.parametrize("rows", [1, 8, 16, 17, 512])
@pytest.mark.parametrize("reader", ["rms_norm_linear", "rms_norm_linear_silu_and_mul", "rms_norm_linear_rotary"])
def test_the_hand_off_and_its_readers(reader: str, rows: int, gen: torch.Generator) -> None:
    """o_proj's GEMM with the add and the next norm's hand-off, then a norm GEMM reading it, at
    the 8B layer's shapes: no further from the float32 norm-and-GEMM of the sum than the unfused
    bf16 ops; the Triton kernels up to 16 rows, cuBLAS and torch's ops above."""
    if providers.library(linear.TRITON_GEMM) is None:
        pytest.skip("triton is not importable here")
    _, n, w_rows, k = next(c for c in CASES if c[0] == reader)
    args = args_of(reader, rows, n, w_rows, k, gen, BF16)
    a = torch.randn(rows, 4096, device="cuda", generator=gen).to(BF16)
    w_o = (torch.randn(4096, 4096, device="cuda", generator=gen) * 4096**-0.5).to(BF16)
    s, sg, parts = torch.ops.fxr.linear_add_rms_parts(a, w_o, args[0], args[1])
    got = getattr(torch.ops.fxr, reader)(sg, None, *args[2:], parts=parts)
    spec_of = next(d for d in linear_fused.DEFS if d.name == reader).reference
    exact = spec_of(s.float(), *[t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float32
                                  else t for t in args[1:]])  # fmt: skip
    spec = spec_of(s, *args[1:])
    label = "triton" if rows <= 16 else "cublas_addmm+hand_off"
    assert providers.served()["linear_add_rms_parts"] == {"fallbacks": {}, label: 1}
    assert providers.served()[reader]["fallbacks"] == {}
    assert rel_err(got, exact) <= 1.05 * rel_err(spec, exact) + 1e-3, (rel_err(got, exact), rel_err(spec, exact))
