"""The FP8 decode GEMMs with the norm between them: its quantization in the reading GEMM's
prologue, its whole-row work in the epilogue of the GEMM that makes the rows (issue 30, item 5).

A static FP8 layer (per-tensor scales: ``fxr.linear_fp8``) runs, per residual add::

    s_o = fxr.linear_fp8(a, w_o, s_a, s_wo, bf16)                    # o_proj (or down_proj)
    q, s = fxr.fused_add_rms_norm_quant_fp8(s_o, r, g, eps, s_q)     # add, norm, quantize: a kernel
    y = fxr.linear_fp8(q, w, s_q, s_w, bf16)                         # the next GEMM reads e4m3

Under ``Config.gemm_fusion`` with ``Config.fp8_norm_prologue`` (pass ``hand_off_norm_quant``,
rewrites/norm_hand_off.py; off by default: not faster on the H100 at 8B, bench/RESULTS.md) the
middle kernel is gone::

    s, sg, parts = fxr.linear_fp8_add_rms_parts(a, w_o, s_a, s_wo, bf16, r, g)
    y = fxr.rms_norm_quant_linear_fp8(sg, parts, eps, s_q, w, s_w, bf16)

The first GEMM adds the residual in its epilogue and hands off what the norm needs of whole rows
(``s * g`` and each row's sums of squares by slot, as ``fxr.linear_add_rms_parts`` does); the
second computes each row's ``rsqrt(mean(s^2) + eps)`` from the slots before its k loop and
quantizes every A tile as it loads it: ``e4m3(clamp(round(sg * scale) * (1 / s_q)))`` (the
spec divides by ``s_q``: the two differ by at most a float32 ulp before the e4m3 rounding),
widened to float16 for the MMA like any e4m3 tile, with ``s_q * s_w`` in the epilogue
(runtime/triton_gemm.py, ``QUANT_A``). ``fxr.rms_norm_quant_linear_fp8_silu_and_mul_quant`` is the MLP's gate_up with its
activation and the activation's quantization after (``fxr.linear_fp8_silu_and_mul_quant``).

Rounding against the spec (the unfused ops): the sum is rounded once (the spec rounds the GEMM's
output, then the sum), and the norm's output is ``round(round(s * g) * scale)`` where the spec
rounds ``round(s * scale) * g``: the bf16 hand-off's two roundings (runtime/ops/linear_fused.py).
A value that lands next to a rounding boundary of e4m3 may quantize to the neighbouring step.
Above ``SKINNY_ROWS`` rows each op runs the ops it replaces (cuBLASLt, the hand-off's row kernel,
the norm and quantization in torch): ``Config.gemm_fusion_max_tokens`` keeps prefill off them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops.linear import (FP8, PART, fp8_gated_output_check, fp8_skinny_check, gate_up_rows,
                                          linear_fp8_reference, linear_fp8_silu_and_mul_quant_reference)
from fxrewrite.runtime.ops.linear_fused import (always, gemm_kernel, hand_off, hand_off_check, hand_off_rows, normed,
                                                parts_check)
from fxrewrite.runtime.ops.quant import quant_fp8_static
from fxrewrite.runtime.providers import Kernel, OpDef

# --------------------------------------------------------------------------- references (the spec)


def linear_fp8_add_rms_parts_reference(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                                       residual: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``s = linear_fp8(x, w, scale_a, scale_b, out_dtype) + residual`` and the next norm's
    hand-off ``(s, s * norm_weight, parts)`` (``fxr.linear_add_rms_parts``'s)."""
    return hand_off(linear_fp8_reference(x, w, scale_a, scale_b, out_dtype) + residual, norm_weight)


def quantized_norm(x: Tensor, parts: Tensor, eps: float, scale: Tensor) -> Tensor:
    """``quant_fp8_static(rms_norm(s, g, eps), scale)`` from the hand-off ``x = s * g``, ``parts``."""
    return quant_fp8_static(normed(x, None, eps, parts=parts), scale)


def rms_norm_quant_linear_fp8_reference(x: Tensor, parts: Tensor, eps: float, scale: Tensor, w: Tensor,
                                        scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:  # fmt: skip
    """``linear_fp8(quantized_norm(x, parts, eps, scale), w, scale, scale_b, out_dtype)``: the
    norm of a hand-off (``x = s * g``), quantized with the GEMM's input scale, then the GEMM."""
    return linear_fp8_reference(quantized_norm(x, parts, eps, scale), w, scale, scale_b, out_dtype)


def rms_norm_quant_linear_fp8_silu_and_mul_quant_reference(x: Tensor, parts: Tensor, eps: float, scale: Tensor,
                                                           w: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                                                           out_scale: Tensor) -> Tensor:  # fmt: skip
    """The same into ``linear_fp8_silu_and_mul_quant``: w [2d, k] (gate, then up) -> e4m3 [..., d]."""
    q = quantized_norm(x, parts, eps, scale)
    return linear_fp8_silu_and_mul_quant_reference(q, w, scale, scale_b, out_dtype, out_scale)


# --------------------------------------------------------------------------- fake impls


def _hand_off_fake(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype, residual: Tensor,
                   norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    out = (*x.shape[:-1], w.shape[0])
    return (x.new_empty(out, dtype=out_dtype), x.new_empty(out, dtype=out_dtype),
            x.new_empty((*out[:-1], -(-w.shape[0] // PART)), dtype=torch.float32))  # fmt: skip


def _reader_fake(x: Tensor, parts: Tensor, eps: float, scale: Tensor, w: Tensor, scale_b: Tensor,
                 out_dtype: torch.dtype) -> Tensor:  # fmt: skip
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype)


def _gated_reader_fake(x: Tensor, parts: Tensor, eps: float, scale: Tensor, w: Tensor, scale_b: Tensor,
                       out_dtype: torch.dtype, out_scale: Tensor) -> Tensor:  # fmt: skip
    return x.new_empty((*x.shape[:-1], gate_up_rows(w)), dtype=FP8)


# --------------------------------------------------------------------------- the Triton kernel's constraints


def _hand_off_check(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype, residual: Tensor,
                    norm_weight: Tensor) -> str | None:  # fmt: skip
    """``fxr.linear_fp8``'s kernel, and a residual and norm weight of the output's dtype."""
    return fp8_skinny_check(x, w, scale_a, scale_b, out_dtype) or hand_off_check(x, w, residual, norm_weight, out_dtype)


def _reader_check(x: Tensor, parts: Tensor, eps: float, scale: Tensor, w: Tensor, scale_b: Tensor,
                  out_dtype: torch.dtype) -> str | None:  # fmt: skip
    """A bf16/fp16 hand-off ``x`` with its slots, an e4m3 weight: ``fxr.linear_fp8``'s kernel
    otherwise (the input scale is ``scale``)."""
    return (constraints.check_half(x) or fp8_skinny_check(x, w, scale, scale_b, out_dtype, x_dtype=x.dtype)
            or parts_check(x, parts))  # fmt: skip


def _gated_reader_check(x: Tensor, parts: Tensor, eps: float, scale: Tensor, w: Tensor, scale_b: Tensor,
                        out_dtype: torch.dtype, out_scale: Tensor) -> str | None:  # fmt: skip
    """:func:`_reader_check`, gate and up rows, one float32 output scale."""
    return _reader_check(x, parts, eps, scale, w, scale_b, out_dtype) or fp8_gated_output_check(x, w, out_scale)


# --------------------------------------------------------------------------- above SKINNY_ROWS rows


def _cublaslt_hand_off(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                       residual: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """cuBLASLt, the add, then the hand-off's row kernel."""
    return hand_off_rows(linear_fp8_reference(x, w, scale_a, scale_b, out_dtype) + residual, norm_weight)


DEFS: tuple[OpDef, ...] = (
    OpDef("linear_fp8_add_rms_parts", linear_fp8_add_rms_parts_reference, _hand_off_fake,
          (gemm_kernel("linear_fp8_add_rms_parts", _hand_off_check),
           Kernel("torch", _cublaslt_hand_off, always, label="cublaslt+add+hand_off"))),
    OpDef("rms_norm_quant_linear_fp8", rms_norm_quant_linear_fp8_reference, _reader_fake,
          (gemm_kernel("rms_norm_quant_linear_fp8", _reader_check),
           Kernel("torch", rms_norm_quant_linear_fp8_reference, always, label="norm+quant+cublaslt"))),
    OpDef("rms_norm_quant_linear_fp8_silu_and_mul_quant", rms_norm_quant_linear_fp8_silu_and_mul_quant_reference,
          _gated_reader_fake,
          (gemm_kernel("rms_norm_quant_linear_fp8_silu_and_mul_quant", _gated_reader_check),
           Kernel("torch", rms_norm_quant_linear_fp8_silu_and_mul_quant_reference, always,
                  label="norm+quant+cublaslt+silu_and_mul_quant"))),
)  # fmt: skip
OPS: tuple[str, ...] = providers.define_all(DEFS)
