"""NVFP4 quantization fused with RMSNorm, add + RMSNorm and SiLU / GELU-and-mul, and alone
(``fxr.quant_nvfp4``, whose reference is :func:`quant_nvfp4` itself: one kernel for its ~25 torch ops).

NVFP4 (the input format of Blackwell's FP4 tensor cores): values in e2m1 (sign, 2 exponent
bits, 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), one float8_e4m3fn scale per block
of 16 consecutive values along the last dim, and one float32 global scale for the tensor (set
offline, usually ``448 * 6 / amax`` of calibration data). :func:`quant_nvfp4` is the spec,
written as model code writes it in torch, and every op here is a norm or activation reference
followed by it:

    # before                                              # after
    y = rms_norm(x, w, eps)                               q, s = torch.ops.fxr.rms_norm_quant_nvfp4(x, w, eps, g)
    q, s = quant_nvfp4(y, g)  # ~25 torch ops

The recipe is vLLM's NVFP4 reference quantization (and the rounding of the CUDA kernels it
checks): per block ``s = (g * (amax * (1 / 6))).clamp(-448, 448)`` rounded to e4m3 (that is the
stored scale, ``g`` times the block's real scale), each value multiplied by
``1 / (s * (1 / g))`` (0 for a zero scale), clamped to [-6, 6] and rounded to the nearest e2m1
value, ties to even (the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
3.5 -> 4, 5 -> 4). A value ``v`` dequantizes as ``e2m1 * s / g``.

Layout of the outputs, for x of shape [..., H] (H a multiple of 16):

- values: uint8 [..., H / 2], two 4-bit codes a byte, element ``2i`` in the low nibble and
  ``2i + 1`` in the high one (the order of PTX ``cvt.rn.satfinite.e2m1x2.f32`` as vLLM's and
  flashinfer's kernels use it, of their unpacking references, and of torch's
  ``float4_e2m1fn_x2``, which this buffer may be viewed as). A code is ``sign << 3 | index``,
  ``index`` the position of the magnitude in the list above; the sign bit is set for values
  below zero, so a negative value that rounds to zero is ``0x8`` (negative zero), as the
  hardware conversion gives it; a zero input gives ``0x0``.
- scales: float8_e4m3fn [..., H / 16], plain row-major: block ``j`` of a row at column ``j``.
  Blackwell's block-scaled GEMMs (CUTLASS, cuBLASLt, flashinfer ``mm_fp4``) read the scales in a
  swizzled layout instead (rows padded to 128 and scale columns to 4, each 128 x 4 tile stored as
  [32, 4, 4]); that swizzle belongs to the provider that feeds such a GEMM (flashinfer's
  ``fp4_quantize(..., is_sf_swizzled_layout=True)`` writes it from the quantization kernel),
  or to the rule that fuses the GEMM: the spec keeps the layout a reader can index.

CUDA: our Triton kernel (``fxrewrite.runtime.triton_nvfp4``; one launch per call), bit exact with
the spec wherever its input to the quantizer is (IEEE divisions, comparisons against the grid's
midpoints, e4m3 rounded to nearest even). flashinfer 0.7.2's ``fp4_quantize`` is not a provider:
it builds a JIT module at its first call (nvcc on the serving machine; an sm90 module exists, its
fused ``rmsnorm_fp4quant`` needs sm100), it takes reciprocals with ``rcp.approx`` where the spec
divides (not bit exact), and it writes the swizzled layout by default; on sm90 it would serve
the quantization alone, a second launch after the norm. The GEMMs that consume NVFP4 need Blackwell;
:func:`dequant_nvfp4` is the reference for tests and a dequantizing reference GEMM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops.activation import GELU_APPROXIMATIONS, gelu_and_mul_reference, silu_and_mul_reference
from fxrewrite.runtime.ops.norm import add_then_norm, fake_sum, rms_norm_reference
from fxrewrite.runtime.providers import Kernel, OpDef

BLOCK = 16  # values per e4m3 scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code 0..7 (bit 3: sign)
E2M1_MAX = 6.0
SCALE_DTYPE = torch.float8_e4m3fn
SCALE_MAX = 448.0
TRITON_MODULE = "fxrewrite.runtime.triton_nvfp4"


# --------------------------------------------------------------------------- the quantizer (the spec)


def quant_nvfp4(y: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor]:
    """``y`` [..., H] (H a multiple of 16), ``global_scale`` one float32 element ->
    (values uint8 [..., H / 2], scales float8_e4m3fn [..., H / 16]); the module docstring has
    the format, :func:`quant_e2m1_blocks` the code."""
    return quant_e2m1_blocks(y, global_scale, 16)


def quant_e2m1_blocks(y: Tensor, global_scale: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """The NVFP4 recipe with blocks of ``block`` values (NVFP4 is 16: :func:`quant_nvfp4`; the
    rules bind the size and refuse others). Literals stay inline: a Python float global would be
    lifted into the graph. The e2m1 grid has steps of 0.5 below 2, 1 below 4 and 2 up to 6, and
    ``torch.round`` rounds ties to even, so ``round(a / step)`` plus the code of the step's first
    value is the nearest code, ties to the even one; the sign is bit 3 of the code; two codes
    make a byte, ``code[2i] + 16 * code[2i + 1]``."""
    blocks = y.float().unflatten(-1, (-1, block))
    amax = blocks.abs().amax(-1)
    scales = (global_scale * (amax * (1 / 6))).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    t = scales.float() * (1.0 / global_scale)
    v = (blocks * torch.unsqueeze(torch.where(t == 0, 0.0, 1.0 / t), -1)).clamp(-6.0, 6.0)
    a = v.abs()
    code = torch.where(a < 2, torch.round(a * 2), torch.where(a < 4, torch.round(a) + 2, torch.round(a / 2) + 4))
    code = code + (v < 0) * 8
    packed = (code[..., 0::2] + code[..., 1::2] * 16).flatten(-2).to(torch.uint8)
    return packed, scales


def codes_nvfp4(packed: Tensor) -> Tensor:
    """The 4-bit codes of ``packed`` [..., H / 2] in element order (low nibble first), int64 [..., H]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()


def unpack_nvfp4(packed: Tensor) -> Tensor:
    """The e2m1 values of ``packed`` [..., H / 2] as float32 [..., H] (no scales applied)."""
    codes = codes_nvfp4(packed)
    table = torch.tensor(E2M1, device=packed.device)
    mag = table[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def dequant_nvfp4(packed: Tensor, scales: Tensor, global_scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``e2m1 * scale / global_scale`` per value: [..., H] in ``dtype`` (float32 arithmetic)."""
    values = unpack_nvfp4(packed).unflatten(-1, (-1, BLOCK))
    real = scales.float() / global_scale.float()
    return (values * real.unsqueeze(-1)).flatten(-2).to(dtype)


def _signed_index(packed: Tensor) -> Tensor:
    """Each value's position on the signed grid, -7..7 (both zeros 0)."""
    codes = codes_nvfp4(packed)
    return torch.where(codes >= 8, -(codes & 7), codes)


def nvfp4_mismatch(got: tuple[Tensor, Tensor], want: tuple[Tensor, Tensor], global_scale: Tensor) -> str | None:
    """None when a kernel's (values, scales) are as good as the spec's on inputs that differ by
    roundings before the quantizer (an approximate ``rsqrt`` or ``exp``, another summation order):
    every scale within one e4m3 step of the spec's; in a block of the spec's scale, every value
    at most one grid position from the spec's; in a block whose scale moved a step, every
    dequantized value within one e2m1 step (at the larger magnitude) of the spec's. For kernels
    that are bit exact given the same input, tests compare bytes instead."""
    from fxrewrite.runtime.ops.quant import fp8_mismatch  # the e4m3 neighbours

    if (problem := fp8_mismatch(got[1], want[1])) is not None:
        return f"scales: {problem}"
    g = global_scale.float()
    same = (got[1].view(torch.uint8) == want[1].view(torch.uint8)).repeat_interleave(BLOCK, dim=-1)
    unit = (torch.maximum(got[1].float(), want[1].float()) / g).repeat_interleave(BLOCK, dim=-1)
    a, b = dequant_nvfp4(*got, g), dequant_nvfp4(*want, g)
    mag = torch.maximum(a.abs(), b.abs()) / torch.where(unit == 0, 1.0, unit)
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0)) * unit
    near = torch.where(same, (_signed_index(got[0]) - _signed_index(want[0])).abs() <= 1, (a - b).abs() <= step * 1.001)
    if not bool(near.all()):
        return f"{int((~near).sum())} of {near.numel()} values more than one e2m1 step off"
    return None


# --------------------------------------------------------------------------- references (the spec)


def rms_norm_quant_nvfp4_reference(
    x: Tensor, weight: Tensor, eps: float, global_scale: Tensor, cast_last: bool = False
) -> tuple[Tensor, Tensor]:
    """``quant_nvfp4(rms_norm_reference(x, weight, eps, cast_last), global_scale)`` (``cast_last``:
    the weight applied in float32 and rounded once, ``torch.rms_norm``'s order)."""
    return quant_nvfp4(rms_norm_reference(x, weight, eps, cast_last), global_scale)


def fused_add_rms_norm_quant_nvfp4_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, global_scale: Tensor, cast_last: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(q, s, sum)``: ``sum = x + residual; q, s = rms_norm_quant_nvfp4_reference(sum, ...)``."""
    norm = functools.partial(rms_norm_quant_nvfp4_reference, global_scale=global_scale, cast_last=cast_last)
    (q, s), total = add_then_norm(norm, x, residual, weight, eps)
    return q, s, total


def silu_and_mul_quant_nvfp4_reference(x: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor]:
    """``quant_nvfp4(silu_and_mul_reference(x), global_scale)``: [..., 2d] -> [..., d / 2], [..., d / 16]."""
    return quant_nvfp4(silu_and_mul_reference(x), global_scale)


def gelu_and_mul_quant_nvfp4_reference(
    x: Tensor, global_scale: Tensor, approximate: str = "none"
) -> tuple[Tensor, Tensor]:
    """``quant_nvfp4(gelu_and_mul_reference(x, approximate), global_scale)``."""
    return quant_nvfp4(gelu_and_mul_reference(x, approximate), global_scale)


# --------------------------------------------------------------------------- fake impls


def _quantized(x: Tensor, width: int) -> tuple[Tensor, Tensor]:
    lead = x.shape[:-1]
    return x.new_empty((*lead, width // 2), dtype=torch.uint8), x.new_empty((*lead, width // BLOCK), dtype=SCALE_DTYPE)


def _norm_fake(x: Tensor, weight: Tensor, eps: float, global_scale: Tensor, cast_last: bool = False) -> tuple[Tensor, Tensor]:
    return _quantized(x, x.shape[-1])


def _fused_add_fake(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, global_scale: Tensor, cast_last: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    total = fake_sum(x, residual)
    return (*_quantized(total, total.shape[-1]), total)


def _silu_fake(x: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor]:
    return _quantized(x, x.shape[-1] // 2)


def _gelu_fake(x: Tensor, global_scale: Tensor, approximate: str = "none") -> tuple[Tensor, Tensor]:
    return _quantized(x, x.shape[-1] // 2)


def _quant_fake(y: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor]:
    return _quantized(y, y.shape[-1])


# --------------------------------------------------------------------------- kernel constraints


def check_global_scale(x: Tensor, global_scale: Tensor) -> str | None:
    """One float32 element on the input's device (the kernel reads it in place)."""
    if global_scale.numel() != 1 or global_scale.dtype != torch.float32:
        return f"global scale {tuple(global_scale.shape)} {global_scale.dtype} is not one float32"
    return constraints.check_same_device(x, global_scale)


def _check_rows(x: Tensor, width: int, others: tuple[Tensor, ...] = ()) -> str | None:
    """What the kernel needs of ``x`` (and equally shaped ``others``): rows at one stride
    (:func:`constraints.check_rows_at_one_stride`), ``width`` output values a row (a multiple of
    16; at most one program's row for the norms)."""
    reason = constraints.check_rows_at_one_stride(x, *others)
    if reason is None and width % BLOCK:
        reason = f"{width} values a row, not a multiple of {BLOCK}"
    return reason


def _triton_norm_check(x: Tensor, weight: Tensor, eps: float, global_scale: Tensor, cast_last: bool = False) -> str | None:
    return _triton_fused_add_check(x, None, weight, eps, global_scale)


def _triton_fused_add_check(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, global_scale: Tensor, cast_last: bool = False
) -> str | None:
    reason = _check_rows(x, x.shape[-1] if x.dim() else 0, () if residual is None else (residual,))
    reason = reason or constraints.check_triton_row(x.shape[-1]) or check_global_scale(x, global_scale)
    if reason is None and (weight.dtype != x.dtype or weight.shape != x.shape[-1:] or weight.stride(0) != 1):
        reason = f"weight {weight.dtype}{tuple(weight.shape)} is not a contiguous [{x.shape[-1]}] {x.dtype} vector"
    return reason or constraints.check_same_device(x, weight)


def _triton_act_check(x: Tensor, global_scale: Tensor, approximate: str = "none") -> str | None:
    if approximate not in GELU_APPROXIMATIONS:
        return f"approximate={approximate!r}"
    if x.dim() and x.shape[-1] % 2:
        return f"odd last dim {x.shape[-1]}"
    return _check_rows(x, x.shape[-1] // 2 if x.dim() else 0) or check_global_scale(x, global_scale)


def _triton_quant_check(y: Tensor, global_scale: Tensor) -> str | None:
    """The quantizer alone: rows of any width (programs of columns) at one stride."""
    return _check_rows(y, y.shape[-1] if y.dim() else 0) or check_global_scale(y, global_scale)


def _triton_kernel(op: str, check: Callable[..., str | None]) -> Kernel:
    # e4m3 conversion in hardware (cvt.rn.satfinite.e4m3x2): Ada / Hopper and newer, as FP8
    return providers.triton_kernel(op, check, (8, 9), module=TRITON_MODULE)


# --------------------------------------------------------------------------- the ops

DEFS: tuple[OpDef, ...] = (
    OpDef("rms_norm_quant_nvfp4", rms_norm_quant_nvfp4_reference, _norm_fake,
          (_triton_kernel("rms_norm_quant_nvfp4", _triton_norm_check),)),
    OpDef("fused_add_rms_norm_quant_nvfp4", fused_add_rms_norm_quant_nvfp4_reference, _fused_add_fake,
          (_triton_kernel("fused_add_rms_norm_quant_nvfp4", _triton_fused_add_check),)),
    OpDef("silu_and_mul_quant_nvfp4", silu_and_mul_quant_nvfp4_reference, _silu_fake,
          (_triton_kernel("silu_and_mul_quant_nvfp4", _triton_act_check),)),
    OpDef("gelu_and_mul_quant_nvfp4", gelu_and_mul_quant_nvfp4_reference, _gelu_fake,
          (_triton_kernel("gelu_and_mul_quant_nvfp4", _triton_act_check),)),
    # the quantizer of a value no norm or activation produced (an attention output)
    OpDef("quant_nvfp4", quant_nvfp4, _quant_fake, (_triton_kernel("quant_nvfp4", _triton_quant_check),)),
)  # fmt: skip
OPS: tuple[str, ...] = providers.define_all(DEFS)
