"""GPU tests of the NVFP4 ops (runtime/ops/quant_nvfp4.py) and their Triton kernel, compiled.

Run on the GPU machine:
    python3 -m pytest -q tests/runtime/test_quant_nvfp4_gpu.py -m gpu

- The quantizer alone (the kernel with nothing before it) gives the spec's bytes, values and
  scales, on every input: the same bits as ``quant_nvfp4`` run by torch on the GPU and on the CPU.
- Each fused op, served by the ``triton`` provider: the bytes it quantized are the spec's bytes
  of the value it computed before the quantizer (read back through ``y_out``), bit for bit;
  that value is the reference's within the dtype's rounding (the norm's summation order and
  approximate ``rsqrt`` / ``exp`` differ on the GPU), so the outputs are within one e2m1 step
  and one e4m3 scale step of the reference's (``nvfp4_mismatch``); the residual sum bit for bit.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch
from helpers.gpu import force, fresh_counts, gen  # noqa: F401  (fresh_counts, gen: pytest fixtures of this module)

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import quant_nvfp4 as nv
from fxrewrite.runtime.ops.activation import gelu_and_mul_reference, silu_and_mul_reference
from fxrewrite.runtime.ops.norm import rms_norm_reference
from fxrewrite.runtime.providers import OpDef
from test_quant_nvfp4_ops import FUSED, GRID, MIDPOINTS, ONE, same_bytes, with_six  # this folder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
# (tokens, hidden): hidden 4096 over token counts, then other multiples of 16 (a gated activation's
# x is [tokens, 2 * hidden])
SHAPES = [(1, 4096), (7, 4096), (64, 4096), (513, 4096), (4096, 4096), (3, 48), (5, 3424), (2, 5120)]


@pytest.fixture(scope="module")
def kernels() -> types.ModuleType:
    module = providers.library(nv.TRITON_MODULE)
    if module is None:
        pytest.skip(f"{nv.TRITON_MODULE} is not importable: {providers._REGISTRY.import_errors.get(nv.TRITON_MODULE)}")
    return module


def rows(tokens: int, width: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random rows of magnitudes from 1e-4 to 30 (scales from underflow to saturation at g = 300);
    row 0 zero when tokens > 1 (a CUDA graph's padding row)."""
    scale = torch.logspace(-4, 1.5, tokens, device="cuda").unsqueeze(-1)
    t = (torch.randn(tokens, width, device="cuda", generator=gen) * scale).to(dtype)
    if tokens > 1:
        t[0] = 0
    return t


def make_args(op: OpDef, tokens: int, hidden: int, dtype: torch.dtype, gen: torch.Generator,
              cast_last: bool = False) -> list[object]:  # fmt: skip
    width = 2 * hidden if op.name.endswith("and_mul_quant_nvfp4") else hidden
    values = {
        "x": lambda: rows(tokens, width, dtype, gen),
        "residual": lambda: rows(tokens, width, dtype, gen),
        "weight": lambda: (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(dtype),
        "eps": lambda: EPS,
        "global_scale": lambda: torch.tensor([300.0], device="cuda"),
        "approximate": lambda: "tanh",
        "cast_last": lambda: cast_last,
    }
    return [values[name]() for name in inspect.signature(op.reference).parameters]


@pytest.mark.parametrize(("tokens", "hidden"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantizer_kernel_is_the_spec_bit_for_bit(kernels: types.ModuleType, dtype: torch.dtype, tokens: int,
                                                  hidden: int, gen: torch.Generator) -> None:  # fmt: skip
    y = rows(tokens, hidden, dtype, gen)
    for g in (300.0, 1.0, 1e5):
        scale = torch.tensor([g], device="cuda")
        got = kernels.quant_nvfp4(y, scale)
        same_bytes(got, nv.quant_nvfp4(y, scale))
        same_bytes(tuple(t.cpu() for t in got), nv.quant_nvfp4(y.cpu(), scale.cpu()))


def test_quantizer_kernel_on_hand_made_values(kernels: types.ModuleType) -> None:
    """The grid, every midpoint and its float32 neighbours, negatives, zeros, a block too small
    for any scale, a global scale that saturates the block scales."""
    ties = torch.tensor(MIDPOINTS)
    values = torch.cat([GRID, ties, torch.nextafter(ties, torch.zeros(())), torch.nextafter(ties, torch.full((), 7.0))])
    y = torch.cat([with_six(torch.cat([values, -values])), torch.zeros(1, 16), torch.full((1, 16), -1e-30)])
    for g in (ONE, torch.tensor([1e3])):
        same_bytes(tuple(t.cpu() for t in kernels.quant_nvfp4(y.cuda(), g.cuda())), nv.quant_nvfp4(y, g))


def global_scale(op: OpDef, args: list[object]) -> torch.Tensor:
    return args[list(inspect.signature(op.reference).parameters).index("global_scale")]  # type: ignore[return-value]


def intermediate(op: OpDef, args: list[object]) -> torch.Tensor:
    """The reference's value before the quantizer."""
    x = args[0]
    if op.name == "rms_norm_quant_nvfp4":
        return rms_norm_reference(x, args[1], EPS, args[-1])
    if op.name == "fused_add_rms_norm_quant_nvfp4":
        return rms_norm_reference(x + args[1], args[2], EPS, args[-1])
    if op.name == "silu_and_mul_quant_nvfp4":
        return silu_and_mul_reference(x)
    return gelu_and_mul_reference(x, args[2])


@pytest.mark.parametrize("cast_last", [False, True], ids=["round-then-scale", "scale-then-round"])
@pytest.mark.parametrize(("tokens", "hidden"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FUSED, ids=lambda op: op.name)
def test_fused_op_served_by_triton(kernels: types.ModuleType, op: OpDef, dtype: torch.dtype, tokens: int,
                                   hidden: int, gen: torch.Generator, cast_last: bool) -> None:  # fmt: skip
    """The norms in either order of weight and rounding (``cast_last``: torch.rms_norm's)."""
    if cast_last and "rms_norm" not in op.name:
        pytest.skip("no norm")
    force("triton")
    args = make_args(op, tokens, hidden, dtype, gen, cast_last)
    got = getattr(torch.ops.fxr, op.name)(*args)
    assert providers.served()[op.name] == {"fallbacks": {}, "triton": 1}
    want = op.reference(*args)
    g = global_scale(op, args)
    y = torch.empty_like(intermediate(op, args))
    again = getattr(kernels, op.name)(*args, y_out=y)
    same_bytes(again, got)  # the launcher as the op called it, deterministic
    same_bytes(got[:2], nv.quant_nvfp4(y, g))  # the quantizer: the spec's bits of what it quantized
    torch.testing.assert_close(y.float(), intermediate(op, args).float(), rtol=TOL[dtype], atol=TOL[dtype])
    assert (problem := nv.nvfp4_mismatch(got[:2], want[:2], g)) is None, problem
    if len(got) == 3:
        same_bytes(got[2:], want[2:])  # the residual sum


@pytest.mark.parametrize("op", FUSED, ids=lambda op: op.name)
def test_call_the_kernel_refuses_falls_back_with_its_reason(kernels: types.ModuleType, op: OpDef,
                                                            gen: torch.Generator) -> None:  # fmt: skip
    force("triton")
    args = make_args(op, 4, 64, torch.bfloat16, gen)
    i = list(inspect.signature(op.reference).parameters).index("global_scale")
    args[i] = args[i].to(torch.bfloat16)  # a bf16 global scale
    got = getattr(torch.ops.fxr, op.name)(*args)
    same_bytes(got, op.reference(*args))
    entry = providers.served()[op.name]
    assert entry["torch"] == 1 and any("is not one float32" in why for why in entry["fallbacks"]), entry
