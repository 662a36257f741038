"""``fxr::linear``: ``F.linear`` served by the fastest GEMM for its number of rows.

At decode sizes a linear reads its whole weight to produce a few rows: the step's time is the
weight's bytes over the memory bandwidth, and what counts is how close a kernel comes to it.
cuBLAS picks split-K kernels there, two launches for some shapes, and reads the 8B-shaped
Llama's weights at 1.14x the copy floor at 8 rows on the H100 (bench/RESULTS.md, eighth run).
Up to ``TALL_ROWS`` rows the ``triton`` provider streams the weight once in one launch (tiles of
16, 32 or 64 rows); above, cuBLAS serves (the label ``cublas``: torch's own GEMM, not a
fallback).

    # before (nn.Linear, F.linear, merged projections)     # after
    y = aten.linear(x, w, b)                                y = torch.ops.fxr.linear(x, w, b)

``fxr::linear_silu_and_mul(x, w, bias=None)`` is ``silu_and_mul(linear(x, w, bias))``: an MLP's
merged gate and up projection ([2d, k] weight) with its activation. Up to ``TALL_ROWS`` rows
the Triton kernel applies SiLU-and-mul before it stores, one launch instead of two; above,
cuBLAS and then ``fxr.silu_and_mul`` (whichever library serves it).

    h = torch.ops.fxr.silu_and_mul(torch.ops.fxr.linear(x, w))   ->   h = torch.ops.fxr.linear_silu_and_mul(x, w)

``fxr::linear_fp8(x, w, scale_a, scale_b, out_dtype)`` is an FP8 linear with per-tensor scales,
``torch._scaled_mm(x, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)`` (x [..., k]
and w [n, k] in float8_e4m3fn, the scales one float32 element each): what static FP8 checkpoints
run. Up to ``SKINNY_ROWS`` rows the Triton kernel streams the FP8 weight once (half the bytes of
bf16; 0.98x cuBLASLt's time over the 8B step's GEMMs on the H100, bench/RESULTS.md); above, cuBLASLt.

``fxr::linear_fp8_silu_and_mul_quant(x, w, scale_a, scale_b, out_dtype, scale)`` is an FP8 MLP's
merged gate and up projection with its activation and the down projection's input quantization,
``silu_and_mul_quant_fp8(linear_fp8(x, w, scale_a, scale_b, out_dtype), scale)``: up to
``SKINNY_ROWS`` rows one Triton kernel stores the e4m3 input of the down projection (one launch
instead of two); above, cuBLASLt and ``fxr.silu_and_mul_quant_fp8``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops.activation import silu_and_mul_reference
from fxrewrite.runtime.ops.quant import silu_and_mul_quant_fp8_reference
from fxrewrite.runtime.providers import Kernel, OpDef

SKINNY_ROWS = 16
"""Most rows the Triton kernel takes with a fusion around its GEMM (one tile of ``tl.dot``)."""

TALL_ROWS = 64
"""Most rows the plain and gated Triton GEMMs take (tiles of 16, 32 or 64 rows); more go to cuBLAS."""

PART = 32
"""Columns per slot of a norm hand-off's sums of squares (``fxr.linear_add_rms_parts``): the
Triton kernel's smallest block of output columns, so each program fills whole slots."""


def linear_reference(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, bias)``: x [..., k], w [n, k], bias [n] -> [..., n]."""
    return F.linear(x, w, bias)


def gate_up_rows(w: Tensor) -> int:
    if w.dim() != 2 or w.shape[0] % 2:
        raise ValueError(f"linear_silu_and_mul: the weight must be [2d, k] (gate rows, then up rows), got {tuple(w.shape)}")
    return w.shape[0] // 2


def linear_silu_and_mul_reference(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """``silu_and_mul(F.linear(x, w, bias))``: w [2d, k] (gate rows, then up rows) -> [..., d]."""
    gate_up_rows(w)
    return silu_and_mul_reference(F.linear(x, w, bias))


FP8 = torch.float8_e4m3fn


def linear_fp8_reference(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``torch._scaled_mm(x, w.t(), scale_a, scale_b, out_dtype=out_dtype)`` over x's rows:
    x [..., k], w [n, k] in float8_e4m3fn, per-tensor float32 scales -> [..., n] in ``out_dtype``."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch._scaled_mm(rows, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _linear_fp8_fake(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype)


def fp8_operands(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                 x_dtype: torch.dtype = FP8) -> str | None:  # fmt: skip
    """What ``fxr.linear_fp8`` serves (its rule's guard): e4m3 operands, a 2-D weight of x's
    width, per-tensor float32 scales (one element each; row- or block-wise scales are other
    recipes), a floating output. ``x_dtype``: x's, where a kernel quantizes x itself."""
    if x.dtype != x_dtype or w.dtype != FP8:
        return f"operands {x.dtype} x {w.dtype}, not float8_e4m3fn"
    if w.dim() != 2 or x.dim() == 0 or x.shape[-1] != w.shape[-1]:
        return f"shapes {tuple(x.shape)} x {tuple(w.shape)}"
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.numel() != 1 or s.dtype != torch.float32:
            return f"{name} is {tuple(s.shape)} {s.dtype}: not one float32 scale per tensor"
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"output dtype {out_dtype}"
    return None


def fp8_skinny_check(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                     x_dtype: torch.dtype = FP8) -> str | None:  # fmt: skip
    """The Triton kernel of ``linear_fp8``: :func:`fp8_operands`, at most ``SKINNY_ROWS`` rows, a
    weight with unit stride along k."""
    reason = fp8_operands(x, w, scale_a, scale_b, out_dtype, x_dtype)
    if reason:
        return reason
    rows = x.numel() // max(x.shape[-1], 1)
    if not 0 < rows <= SKINNY_ROWS:
        return f"{rows} rows: cuBLASLt serves outside 1..{SKINNY_ROWS}"
    if w.numel() == 0 or w.stride(-1) != 1:
        return "empty weight, or no unit stride along k"
    return constraints.check_same_device(x, w, scale_a, scale_b)


def linear_fp8_silu_and_mul_quant_reference(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor,
                                            out_dtype: torch.dtype, scale: Tensor) -> Tensor:  # fmt: skip
    """``silu_and_mul_quant_fp8(linear_fp8(x, w, scale_a, scale_b, out_dtype), scale)``: w [2d, k]
    (gate rows, then up rows) -> e4m3 [..., d]."""
    gate_up_rows(w)
    return silu_and_mul_quant_fp8_reference(linear_fp8_reference(x, w, scale_a, scale_b, out_dtype), scale)


def _linear_fp8_silu_and_mul_quant_fake(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                                        scale: Tensor) -> Tensor:  # fmt: skip
    return x.new_empty((*x.shape[:-1], gate_up_rows(w)), dtype=FP8)


def fp8_gated_check(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                    scale: Tensor) -> str | None:  # fmt: skip
    """The Triton kernel of ``linear_fp8_silu_and_mul_quant``: :func:`fp8_skinny_check`, an even
    number of weight rows (gate, then up), one float32 output scale."""
    return fp8_skinny_check(x, w, scale_a, scale_b, out_dtype) or fp8_gated_output_check(x, w, scale)


def fp8_gated_output_check(x: Tensor, w: Tensor, scale: Tensor) -> str | None:
    """A gated FP8 kernel's weight and output: gate then up rows (even), one float32 scale."""
    if w.shape[0] % 2:
        return f"odd weight rows {w.shape[0]}"
    if scale.numel() != 1 or scale.dtype != torch.float32:
        return f"output scale is {tuple(scale.shape)} {scale.dtype}: not one float32 scale"
    return constraints.check_same_device(x, scale)


def _cublaslt_silu_and_mul_quant(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                                 scale: Tensor) -> Tensor:  # fmt: skip
    return torch.ops.fxr.silu_and_mul_quant_fp8.default(linear_fp8_reference(x, w, scale_a, scale_b, out_dtype), scale)


def _linear_fake(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _linear_silu_and_mul_fake(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], gate_up_rows(w)))


def skinny_check(x: Tensor, w: Tensor, bias: Tensor | None = None, most: int = SKINNY_ROWS) -> str | None:
    """The Triton kernel: bf16/fp16 throughout, a 2-D weight with unit stride along k, at most
    ``most`` rows (``SKINNY_ROWS`` with a fusion around the GEMM), a contiguous bias."""
    reason = constraints.check_half(x, w, *([bias] if bias is not None else []))
    if reason:
        return reason
    if w.dim() != 2 or x.dim() == 0 or x.shape[-1] != w.shape[-1]:
        return f"shapes {tuple(x.shape)} x {tuple(w.shape)}"
    if w.numel() == 0:
        return "empty weight"
    rows = x.numel() // max(x.shape[-1], 1)
    if not 0 < rows <= most:
        return f"{rows} rows: cuBLAS serves outside 1..{most}"
    if w.stride(-1) != 1:
        return "weight has no unit stride along k"
    if bias is not None and (bias.dim() != 1 or not bias.is_contiguous()):
        return "bias not a contiguous vector"
    return constraints.check_same_device(x, w, *([bias] if bias is not None else []))


def gated_check(x: Tensor, w: Tensor, bias: Tensor | None = None, most: int = SKINNY_ROWS) -> str | None:
    """The Triton kernel of ``linear_silu_and_mul``: what :func:`skinny_check` asks, and an even
    number of weight rows (gate, then up)."""
    return skinny_check(x, w, bias, most) or (f"odd weight rows {w.shape[0]}" if w.shape[0] % 2 else None)


def _tall_check(x: Tensor, w: Tensor, bias: Tensor | None = None) -> str | None:
    return skinny_check(x, w, bias, TALL_ROWS)


def _tall_gated_check(x: Tensor, w: Tensor, bias: Tensor | None = None) -> str | None:
    return gated_check(x, w, bias, TALL_ROWS)


def _cublas(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    return F.linear(x, w, bias)


def _cublas_silu_and_mul(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    return torch.ops.fxr.silu_and_mul.default(F.linear(x, w, bias))


def _always(*args: object) -> None:
    return None


TRITON_GEMM = "fxrewrite.runtime.triton_gemm"
"""The ``triton`` provider's decode-size GEMM and its fusions (imports Triton at the top)."""
TRITON_ROWS = "fxrewrite.runtime.triton_rows"
"""The norm hand-off's row kernels around cuBLAS, above ``SKINNY_ROWS`` rows."""

KERNELS = (
    providers.triton_kernel("linear", _tall_check, prepare=True, module=TRITON_GEMM),
    Kernel("torch", _cublas, _always, label="cublas"),
)
GATED_KERNELS = (
    providers.triton_kernel("linear_silu_and_mul", _tall_gated_check, prepare=True, module=TRITON_GEMM),
    Kernel("torch", _cublas_silu_and_mul, _always, label="cublas+silu_and_mul"),
)

FP8_KERNELS = (
    providers.triton_kernel("linear_fp8", fp8_skinny_check, prepare=True, module=TRITON_GEMM),
    Kernel("torch", linear_fp8_reference, _always, label="cublaslt"),
)

FP8_GATED_KERNELS = (
    providers.triton_kernel("linear_fp8_silu_and_mul_quant", fp8_gated_check, prepare=True, module=TRITON_GEMM),
    Kernel("torch", _cublaslt_silu_and_mul_quant, _always, label="cublaslt+silu_and_mul_quant_fp8"),
)

DEFS: tuple[OpDef, ...] = (
    OpDef("linear", linear_reference, _linear_fake, KERNELS),
    OpDef("linear_fp8", linear_fp8_reference, _linear_fp8_fake, FP8_KERNELS),
    OpDef("linear_fp8_silu_and_mul_quant", linear_fp8_silu_and_mul_quant_reference,
          _linear_fp8_silu_and_mul_quant_fake, FP8_GATED_KERNELS),
    OpDef("linear_silu_and_mul", linear_silu_and_mul_reference, _linear_silu_and_mul_fake, GATED_KERNELS),
)
OPS: tuple[str, ...] = providers.define_all(DEFS)
