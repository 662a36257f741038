"""Block-wise FP8: per-token groups of ``group`` (128 in DeepSeek-V3 and the FP8 releases of Qwen3
and others) along the last dim, float8_e4m3fn values, one float32 scale per group, fused with
RMSNorm, add + RMSNorm, SiLU-and-mul and GELU-and-mul (all-reduce + add + RMSNorm + block FP8:
``runtime/ops/collective.py``), and alone (``fxr.block_quant_fp8``, whose reference is
:func:`quant_fp8_block` itself: the input of ``o_proj``, an attention output, in one kernel).

The quantizer, :func:`quant_fp8_block`, is written as model code writes it (vLLM's native
``QuantFP8`` group path, the torch fallbacks of the fine-grained FP8 integrations), with the
floor and bound of ``runtime/ops/quant.py``'s per-token quantizer (``scale = max(amax, 1e-12) /
448``; a group is quantized as a row is there)::

    # before                                                  # after
    y = rms_norm(x, w, eps)                                   q, s = torch.ops.fxr.rms_norm_block_quant_fp8(x, w, eps, 128)
    g = y.float().unflatten(-1, (-1, 128))                    # q: fp8 [..., H], s: float32 [..., H / 128]
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).flatten(-2)
    s = s.flatten(-2)

Scale layout: row-major ``[..., H / group]`` float32, contiguous: the spec's, and what every op
here returns. A block-scaled GEMM that wants the scales column-major (DeepGEMM's TMA-aligned
``[H / 128, round_up(T, 4)]``) transposes them itself; no op here writes that layout.

Bit for bit: every kernel quantizes exactly as the spec (``max(amax, 1e-12)`` and ``/ 448`` in
float32, then ``y / s`` as an IEEE division, clamp, round to nearest even), so its FP8 bytes and
scales equal :func:`quant_fp8_block` of the values it quantizes. Those values (the normed or
activated row, rounded to the input dtype where the unfused code rounds it) equal the
reference's where the row reductions agree: the Triton kernels compute the same float32 steps
in the same order, and differ only in the order of the sum of squares (a norm) and in the
implementations of ``rsqrt``, ``exp``, ``erf`` (tests: ``tests/runtime/test_quant_block_ops.py``).

Kernels considered and not used: flashinfer 0.7.2's ``norm.fused_add_rmsnorm_fp8_block_quant``
computes another quantizer (read in ``include/flashinfer/norm.cuh``): amax floor 1e-4, values
multiplied by ``448 / amax`` (not divided by the scale), and ``x * rsqrt * w`` rounded once where
the spec rounds the normed value first; its scales are column-major. It can never equal the spec
bit for bit. sgl-kernel 0.4.6's per-token-group quantization (``sgl_per_token_group_quant_8bit_v2``)
requires its amax floor to be 1e-10 (it checks ``|eps - 1e-10| < 1e-13`` on the device, seen on
an H200, 2026-11-26), where the spec's is 1e-12: it cannot serve the spec either.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops.activation import (
    GELU_APPROXIMATIONS,
    gelu_and_mul_reference,
    silu_and_mul_reference,
)
from fxrewrite.runtime.ops.norm import add_then_norm, fake_sum, rms_norm_reference
from fxrewrite.runtime.ops.quant import AMAX_FLOOR, FP8_CAPABILITY, FP8_DTYPE, FP8_MAX
from fxrewrite.runtime.providers import Kernel, OpDef

GROUP = 128
"""The group of DeepSeek-V3's and Qwen3-FP8's activations (the ops take any group)."""

TRITON_MODULE = "fxrewrite.runtime.triton_quant_block"

# --------------------------------------------------------------------------- the quantizer (the spec)


def quant_fp8_block(y: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor]:
    """Dynamic per token and group of ``group`` along the last dim; returns ``(q, s)``, ``q`` FP8
    of ``y``'s shape, ``s`` float32 ``[..., H / group]``:

    ``g = y.float().unflatten(-1, (-1, group)); s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0;
    q = (g / s).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(-2); s = s.flatten(-2)``
    """
    g = y.float().unflatten(-1, (-1, group))
    s = g.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2), s.flatten(-2)


def dequant_fp8_block(q: Tensor, s: Tensor) -> Tensor:
    """float32 ``q * s``, each scale over its group (what a block-scaled GEMM reads)."""
    group = q.shape[-1] // s.shape[-1]
    return (q.float().unflatten(-1, (-1, group)) * s.unsqueeze(-1)).flatten(-2)


# --------------------------------------------------------------------------- references (the spec)


def rms_norm_block_quant_fp8_reference(
    x: Tensor, weight: Tensor, eps: float, group: int, cast_last: bool = False
) -> tuple[Tensor, Tensor]:
    """``(q, s) = quant_fp8_block(rms_norm_reference(x, weight, eps, cast_last), group)`` (``cast_last``:
    the weight applied in float32 and rounded once, ``torch.rms_norm``'s order)."""
    return quant_fp8_block(rms_norm_reference(x, weight, eps, cast_last), group)


def fused_add_rms_norm_block_quant_fp8_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group: int, cast_last: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(q, s, sum)``: ``sum = x + residual;
    q, s = rms_norm_block_quant_fp8_reference(sum, weight, eps, group, cast_last)``."""
    norm = functools.partial(rms_norm_block_quant_fp8_reference, group=group, cast_last=cast_last)
    (q, s), total = add_then_norm(norm, x, residual, weight, eps)
    return q, s, total


def silu_and_mul_block_quant_fp8_reference(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """``quant_fp8_block(silu_and_mul_reference(x), group)``: [..., 2d] -> fp8 [..., d], [..., d / group]."""
    return quant_fp8_block(silu_and_mul_reference(x), group)


def gelu_and_mul_block_quant_fp8_reference(x: Tensor, group: int, approximate: str = "none") -> tuple[Tensor, Tensor]:
    """``quant_fp8_block(gelu_and_mul_reference(x, approximate), group)``."""
    return quant_fp8_block(gelu_and_mul_reference(x, approximate), group)


# --------------------------------------------------------------------------- fake impls


def block_outputs(y: Tensor, group: int, shape: tuple[int, ...] | None = None) -> tuple[Tensor, Tensor]:
    """Empty ``(q, s)`` for a value of ``shape`` (default ``y``'s) quantized in groups of ``group``."""
    shape = tuple(y.shape) if shape is None else shape
    q = y.new_empty(shape, dtype=FP8_DTYPE)
    return q, y.new_empty((*shape[:-1], shape[-1] // group), dtype=torch.float32)


def _half_shape(x: Tensor) -> tuple[int, ...]:
    return (*x.shape[:-1], x.shape[-1] // 2)


def _norm_fake(x: Tensor, weight: Tensor, eps: float, group: int, cast_last: bool = False) -> tuple[Tensor, Tensor]:
    return block_outputs(x, group)


def _fused_add_fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float, group: int,
                    cast_last: bool = False) -> tuple[Tensor, ...]:  # fmt: skip
    total = fake_sum(x, residual)
    return (*block_outputs(total, group), total)


def _silu_fake(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    return block_outputs(x, group, _half_shape(x))


def _gelu_fake(x: Tensor, group: int, approximate: str = "none") -> tuple[Tensor, Tensor]:
    return block_outputs(x, group, _half_shape(x))


def _quant_fake(y: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor]:
    return block_outputs(y, group)


# --------------------------------------------------------------------------- kernel constraints


def check_group(d: int, group: int, *, power_of_two: bool = False) -> str | None:
    """``group`` divides the quantized dim ``d`` (and, for a Triton program's tile, is a power of two)."""
    if group <= 0 or d % group:
        return f"group {group} does not divide the quantized dim {d}"
    if power_of_two and group & (group - 1):
        return f"group {group} is not a power of two"
    return None


def _triton_rows(x: Tensor, *others: Tensor) -> str | None:
    """Our Triton kernels: 16- or 32-bit floats, one device, contiguous non-empty rows."""
    for t in (x, *others):
        if reason := constraints.check_float(t):
            return reason
        if not t.is_contiguous():
            return "input not contiguous"
    if x.numel() == 0:
        return "empty input"
    return constraints.check_same_device(x, *others)


def _triton_norm_check(x: Tensor, weight: Tensor, eps: float, group: int, cast_last: bool = False,
                       residual: Tensor | None = None) -> str | None:  # fmt: skip
    others = (residual,) if residual is not None else ()
    if weight.dtype != x.dtype or weight.shape != x.shape[-1:]:
        return f"weight {weight.dtype}{tuple(weight.shape)} is not a [{x.shape[-1]}] vector of the input dtype"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return f"residual {residual.dtype}{tuple(residual.shape)} differs from the input"
    return (_triton_rows(x, weight, *others) or constraints.check_triton_row(x.shape[-1])
            or check_group(x.shape[-1], group, power_of_two=True))  # fmt: skip


def _triton_fused_add_check(x: Tensor, residual: Tensor, weight: Tensor, eps: float, group: int,
                            cast_last: bool = False) -> str | None:  # fmt: skip
    return _triton_norm_check(x, weight, eps, group, cast_last, residual)


def _triton_quant_check(y: Tensor, group: int = GROUP) -> str | None:
    """The quantizer alone: contiguous rows of any width (a program takes some of a row's groups)."""
    return _triton_rows(y) or check_group(y.shape[-1] if y.dim() else 0, group, power_of_two=True)


def _triton_act_check(x: Tensor, group: int, approximate: str = "none") -> str | None:
    if approximate not in GELU_APPROXIMATIONS:
        return f"approximate={approximate!r}"
    if x.dim() == 0 or x.shape[-1] % 2:
        return f"last dim of {tuple(x.shape)} is not even"
    return _triton_rows(x) or check_group(x.shape[-1] // 2, group, power_of_two=True)


# --------------------------------------------------------------------------- kernels


def _triton(op: str, check: object) -> Kernel:
    return providers.triton_kernel(op, check, FP8_CAPABILITY, module=TRITON_MODULE)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the ops

# Triton: one kernel, bit for bit the spec's quantizer; the torch reference where it cannot serve.
DEFS: tuple[OpDef, ...] = (
    OpDef(
        "rms_norm_block_quant_fp8",
        rms_norm_block_quant_fp8_reference,
        _norm_fake,
        (
            _triton("rms_norm_block_quant_fp8", _triton_norm_check),
        ),
    ),
    OpDef(
        "fused_add_rms_norm_block_quant_fp8",
        fused_add_rms_norm_block_quant_fp8_reference,
        _fused_add_fake,
        (
            _triton("fused_add_rms_norm_block_quant_fp8", _triton_fused_add_check),
        ),
    ),
    OpDef(
        "silu_and_mul_block_quant_fp8",
        silu_and_mul_block_quant_fp8_reference,
        _silu_fake,
        (
            _triton("silu_and_mul_block_quant_fp8", _triton_act_check),
        ),
    ),
    OpDef(
        "gelu_and_mul_block_quant_fp8",
        gelu_and_mul_block_quant_fp8_reference,
        _gelu_fake,
        (_triton("gelu_and_mul_block_quant_fp8", _triton_act_check),),
    ),
    # the quantizer of a value no norm or activation produced (an attention output)
    OpDef("block_quant_fp8", quant_fp8_block, _quant_fake, (_triton("block_quant_fp8", _triton_quant_check),)),
)
OPS: tuple[str, ...] = providers.define_all(DEFS)
