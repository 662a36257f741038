"""The quantizers alone: ``fxr.dynamic_quant_fp8`` (per token), ``fxr.block_quant_fp8`` (per
token and group), ``fxr.quant_nvfp4``, for a value no norm or activation produced (the
attention output before ``o_proj``).

Each op's reference is the spec function itself, and its Triton kernel is the fused ops' kernel
with nothing before the quantizer (``_rms_norm_quant_kernel`` with ``NORM=False``,
``_block_quant_kernel`` in ``QUANT_ONLY``, ``_nvfp4_kernel`` with ``PRE=0``): its input is the
spec's, and its quantizer the spec's steps, so its bytes and scales are the spec's, bit for bit,
interpreted here (GPU rounding of casts: the ``triton_*`` fixtures) and compiled on the GPU
(marked ``gpu``). Fake shapes and opcheck: tests/runtime/test_ops.py, for every op.
"""

from __future__ import annotations

import types

import pytest
import torch

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import quant, quant_block, quant_nvfp4

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
NVFP4_SCALE = torch.tensor([300.0])  # blocks of amax above 9 saturate their e4m3 scale
# op -> (the spec, the Triton module's fixture, the op's arguments after y)
OPS = {
    "dynamic_quant_fp8": (quant.quant_fp8_per_token, "triton_kernels", ()),
    "block_quant_fp8": (quant_block.quant_fp8_block, "triton_quant_block", (128,)),
    "quant_nvfp4": (quant_nvfp4.quant_nvfp4, "triton_nvfp4", (NVFP4_SCALE,)),
}
DEFS = {op.name: op for op in quant.DEFS + quant_block.DEFS + quant_nvfp4.DEFS if op.name in OPS}


def rows(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Rows of magnitudes 1e-3 .. 1e2 (NVFP4 scales from tiny to saturated; a float16 row of 1e2
    stays finite), row 0 zero (a CUDA graph's padding row: the floor scale)."""
    lead = int(torch.tensor(shape[:-1]).prod())
    y = torch.randn(lead, shape[-1], generator=torch.Generator().manual_seed(lead * shape[-1]))
    y = y * torch.logspace(-3, 2, lead).unsqueeze(-1)
    y[0] = 0
    return y.view(shape).to(dtype).to(device)


def args_of(name: str, y: torch.Tensor) -> tuple[object, ...]:
    return (y, *(a.to(y.device) if isinstance(a, torch.Tensor) else a for a in OPS[name][2]))


def same_bits(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = (t.cpu().view(torch.uint8) if t.dtype.itemsize == 1 else t.cpu() for t in (g, w))
        assert torch.equal(g, w), f"output {i}: {int((g != w).sum())} of {g.numel()} differ"


def triton_check(name: str) -> object:
    return next(k for k in DEFS[name].kernels if k.provider == "triton").check


@pytest.mark.parametrize("name", list(OPS))
def test_the_reference_is_the_spec(name: str) -> None:
    """The op's reference is the spec function (no copy of it), and the op on CPU gives its bits."""
    spec = OPS[name][0]
    assert DEFS[name].reference is spec
    args = args_of(name, rows((3, 256), BF16))
    same_bits(getattr(torch.ops.fxr, name)(*args), spec(*args))


@pytest.mark.parametrize("shape", [(1, 256), (2, 3, 384)])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("name", list(OPS))
def test_kernel_gives_the_spec_bytes(request: pytest.FixtureRequest, name: str, dtype: torch.dtype,
                                     shape: tuple[int, ...]) -> None:  # fmt: skip
    kernels: types.ModuleType = request.getfixturevalue(OPS[name][1])
    args = args_of(name, rows(shape, dtype))
    assert triton_check(name)(*args) is None  # type: ignore[operator]
    same_bits(getattr(kernels, name)(*args), OPS[name][0](*args))


@pytest.mark.parametrize("name", ["dynamic_quant_fp8", "quant_nvfp4"])
def test_kernel_reads_rows_at_a_stride(request: pytest.FixtureRequest, name: str) -> None:
    """Rows sliced out of a wider tensor (a merged projection's output) are read in place."""
    kernels: types.ModuleType = request.getfixturevalue(OPS[name][1])
    args = args_of(name, rows((4, 512), BF16)[:, 128:384])
    assert not args[0].is_contiguous() and triton_check(name)(*args) is None  # type: ignore[operator,union-attr]
    same_bits(getattr(kernels, name)(*args), OPS[name][0](*args))


def test_block_kernel_spreads_a_row_over_programs(triton_quant_block: types.ModuleType) -> None:
    """No reduction over the row: a wide row takes several programs of ``ACT_BLOCK`` columns,
    each its own groups (a norm's row is one program); groups of 64 too."""
    y = rows((3, 2 * triton_quant_block.ACT_BLOCK + 256), BF16)
    for group in (128, 64):
        same_bits(triton_quant_block.block_quant_fp8(y, group), quant_block.quant_fp8_block(y, group))


def test_checks_refuse_what_the_kernels_cannot_serve() -> None:
    y = torch.randn(4, 256, dtype=BF16)
    per_token, block, nvfp4 = (triton_check(name) for name in OPS)
    assert per_token(y.to(torch.int32)) == "dtype int32 is not a float of 16 or 32 bits"  # type: ignore[operator]
    assert per_token(y.t()) == "last dim not contiguous"  # type: ignore[operator]
    wide = quant.TRITON_MAX_ROW + 8
    too_wide = f"row of {wide} values exceeds one Triton program ({quant.TRITON_MAX_ROW})"
    assert per_token(torch.empty(1, wide)) == too_wide  # type: ignore[operator]
    assert block(y[:, :128], 128) == "input not contiguous"  # type: ignore[operator]
    assert block(y, 96) == "group 96 does not divide the quantized dim 256"  # type: ignore[operator]
    assert block(torch.randn(4, 384, dtype=BF16), 384) == "group 384 is not a power of two"  # type: ignore[operator]
    assert block(torch.empty(1, 4 * quant.TRITON_MAX_ROW, dtype=BF16), 128) is None  # type: ignore[operator]
    assert nvfp4(y[:, :40], NVFP4_SCALE) == "40 values a row, not a multiple of 16"  # type: ignore[operator]
    bf16_scale = "global scale (1,) torch.bfloat16 is not one float32"
    assert nvfp4(y, NVFP4_SCALE.to(BF16)) == bf16_scale  # type: ignore[operator]


def test_per_token_kernel_without_its_norm_compiles_for_hopper() -> None:
    """``NORM=False`` built for sm90 by this Triton's front end and NVIDIA backend (what the
    interpreter lets through, the GPU's compiler may refuse): no weight read, IEEE divisions, the
    saturating e4m3 convert."""
    import re

    from helpers.triton import compile_for_hopper

    pytest.importorskip(providers.TRITON_MODULE, reason="triton is not installed")
    ptx = compile_for_hopper(
        providers.TRITON_MODULE, "_rms_norm_quant_kernel",
        {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "sum_ptr": "*bf16", "q_ptr": "*fp8e4nv",
         "s_ptr": "*fp32", "scale_ptr": "*fp32", "x_stride": "i32", "r_stride": "i32", "n": "i32", "eps": "fp32"},
        {"BLOCK": 4096, "HAS_RESIDUAL": False, "DYNAMIC": True, "CAST_LAST": False, "NORM": False})  # fmt: skip
    ops = set(re.findall(r"\b(div\.rn\.f32|div\.full\.f32|div\.approx\.f32|rsqrt\.approx\.f32|"
                         r"cvt\.rn\.satfinite\.e4m3x2\.f32)", ptx))  # fmt: skip
    assert ops == {"div.rn.f32", "cvt.rn.satfinite.e4m3x2.f32"}, ops  # no rsqrt: the norm is compiled out


# -- GPU: each op through torch.ops.fxr, compiled ----------------------------------------------


@pytest.mark.parametrize("shape", [(1, 4096), (8, 4096), (33, 7168), (512, 4096), (2, 3, 5120)])
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_op_is_served_by_triton_and_is_the_spec_bit_for_bit(name: str, dtype: torch.dtype,
                                                                shape: tuple[int, ...]) -> None:  # fmt: skip
    """Served by Triton (no fallback), and its bytes and scales those of the spec run on the CPU
    on the same values: the quantizer's input is the spec's, every step of it IEEE."""
    providers.reset_counts()
    args = args_of(name, rows(shape, dtype, "cuda"))
    got = getattr(torch.ops.fxr, name)(*args)
    assert providers.served()[name] == {"triton": 1, "fallbacks": {}}, providers.served()
    same_bits(got, OPS[name][0](*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)))
