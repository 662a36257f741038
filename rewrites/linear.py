"""Linears become ``fxr.linear``, which picks the GEMM by the number of rows at run time; a
linear whose only reader is SiLU-and-mul (an MLP's merged gate and up projection, after
``fuse_activation``) becomes ``fxr.linear_silu_and_mul``, one kernel at decode sizes.

    %y = aten.linear(%x, %w, %b)      ->      %y = fxr.linear(%x, %w, %b)
    %h = fxr.silu_and_mul(%y)         ->      %h = fxr.linear_silu_and_mul(%x, %w, %b)

``nn.Linear``, ``F.linear`` and the merged projections of ``merge_siblings`` all canonicalize to
``aten.linear``; a missing bias is bound as ``None``, so one rule without and one with a bias
cover them. The op serves every dtype and shape (:mod:`fxrewrite.runtime.ops.linear`): the rule
runs last, after every rule whose pattern holds a linear.

An FP8 linear with per-tensor scales (static FP8 checkpoints: the input quantized with a
calibrated scale, the weight stored in e4m3) becomes ``fxr.linear_fp8``, picked by rows likewise:

    %y = torch._scaled_mm(%xq, %w.t(), scale_a=%sa, scale_b=%sb, out_dtype=bf16)
        ->  %y = fxr.linear_fp8(%xq, %w, %sa, %sb, bf16)

An FP8 MLP's merged gate and up projection read only by SiLU-and-mul and the down projection's
static quantization (``fuse_activation_quant`` made that one op) becomes one op, one kernel at
decode sizes:

    %h = fxr.silu_and_mul_quant_fp8(torch._scaled_mm(%xq, %w.t(), ...), %s)
        ->  %h = fxr.linear_fp8_silu_and_mul_quant(%xq, %w, %sa, %sb, bf16, %s)

Row-wise or block-wise scales, other FP8 formats and a ``_scaled_mm`` with a bias or a result
scale are other recipes: they do not match, or the guard refuses them with the reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.rule import Bindings, Rule, Scalar


def matrix_weight(b: Bindings) -> bool | str:
    """``F.linear`` also takes a 1-D weight (a dot product); the op's kernels take matrices."""
    return True if b["w"].dim() == 2 else f"weight is {b['w'].dim()}-D, not a matrix"


def gate_up_weight(b: Bindings) -> bool | str:
    """A matrix whose rows split into gate and up halves (SiLU-and-mul halves the linear's
    output; an odd width is refused by ``fuse_activation`` already, this keeps the rule sound
    on its own)."""
    ok = matrix_weight(b)
    if ok is not True:
        return ok
    return True if b["w"].shape[0] % 2 == 0 else f"weight has {b['w'].shape[0]} rows, not gate and up halves"


# linear(x, w) -> fxr.linear(x, w)
def linear_pattern(x, w):
    return F.linear(x, w)


def linear_replacement(x, w):
    return torch.ops.fxr.linear(x, w)


# linear(x, w, b) -> fxr.linear(x, w, b)
def linear_bias_pattern(x, w, b):
    return F.linear(x, w, b)


def linear_bias_replacement(x, w, b):
    return torch.ops.fxr.linear(x, w, b)


# silu_and_mul(linear(x, w)) -> fxr.linear_silu_and_mul(x, w)
def linear_silu_and_mul_pattern(x, w):
    return torch.ops.fxr.silu_and_mul(F.linear(x, w))


def linear_silu_and_mul_replacement(x, w):
    return torch.ops.fxr.linear_silu_and_mul(x, w)


# silu_and_mul(linear(x, w, b)) -> fxr.linear_silu_and_mul(x, w, b)
def linear_bias_silu_and_mul_pattern(x, w, b):
    return torch.ops.fxr.silu_and_mul(F.linear(x, w, b))


def linear_bias_silu_and_mul_replacement(x, w, b):
    return torch.ops.fxr.linear_silu_and_mul(x, w, b)


# _scaled_mm(xq, w.t(), sa, sb, out_dtype) -> fxr.linear_fp8(xq, w, sa, sb, out_dtype)
def linear_fp8_pattern(x, w, sa, sb, dtype):
    return torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=dtype)


def linear_fp8_replacement(x, w, sa, sb, dtype):
    return torch.ops.fxr.linear_fp8(x, w, sa, sb, dtype)


def fp8_per_tensor(b: Bindings) -> bool | str:
    """What ``fxr.linear_fp8`` serves (``linear.fp8_operands``)."""
    from fxrewrite.runtime.ops.linear import fp8_operands

    return fp8_operands(b["x"], b["w"], b["sa"], b["sb"], b["dtype"]) or True


# silu_and_mul_quant_fp8(_scaled_mm(xq, w.t(), sa, sb, out_dtype), s) -> fxr.linear_fp8_silu_and_mul_quant(...)
def linear_fp8_silu_and_mul_quant_pattern(x, w, sa, sb, dtype, scale):
    y = torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=dtype)
    return torch.ops.fxr.silu_and_mul_quant_fp8(y, scale)


def linear_fp8_silu_and_mul_quant_replacement(x, w, sa, sb, dtype, scale):
    return torch.ops.fxr.linear_fp8_silu_and_mul_quant(x, w, sa, sb, dtype, scale)


def fp8_gate_up(b: Bindings) -> bool | str:
    """:func:`fp8_per_tensor`, and a weight of gate and up halves."""
    ok = fp8_per_tensor(b)
    if ok is not True:
        return ok
    return True if b["w"].shape[0] % 2 == 0 else f"weight has {b['w'].shape[0]} rows, not gate and up halves"


LINEAR = Rule("linear", linear_pattern, linear_replacement, matrix_weight)
LINEAR_FP8 = Rule("linear_fp8", linear_fp8_pattern, linear_fp8_replacement, fp8_per_tensor,
                  scalars={"dtype": Scalar()})  # fmt: skip
LINEAR_FP8_SILU_AND_MUL_QUANT = Rule("linear_fp8_silu_and_mul_quant", linear_fp8_silu_and_mul_quant_pattern,
                                     linear_fp8_silu_and_mul_quant_replacement, fp8_gate_up,
                                     scalars={"dtype": Scalar()})  # fmt: skip
LINEAR_BIAS = Rule("linear_bias", linear_bias_pattern, linear_bias_replacement, matrix_weight)
LINEAR_SILU_AND_MUL = Rule("linear_silu_and_mul", linear_silu_and_mul_pattern, linear_silu_and_mul_replacement,
                           gate_up_weight)  # fmt: skip
LINEAR_BIAS_SILU_AND_MUL = Rule("linear_bias_silu_and_mul", linear_bias_silu_and_mul_pattern,
                                linear_bias_silu_and_mul_replacement, gate_up_weight)  # fmt: skip

# the gated rules first: a plain linear rule would take their linears
RULES: list[Rule] = [LINEAR_SILU_AND_MUL, LINEAR_BIAS_SILU_AND_MUL, LINEAR, LINEAR_BIAS, LINEAR_FP8_SILU_AND_MUL_QUANT,
                     LINEAR_FP8]
