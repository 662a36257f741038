"""Tensor-parallel rules: the all-reduce that ends a row-parallel linear, fused with the residual
add and RMSNorm (and static FP8 quantization) that follow it.

Dynamo records ``torch.distributed._functional_collectives.all_reduce(x, "sum", group)`` as two
ops, which the patterns spell the same way (the group as its name, a scalar wildcard)::

    %all_reduce = _c10d_functional.all_reduce.default(%o_proj, 'sum', '0')
    %wait       = _c10d_functional.wait_tensor.default(%all_reduce)
    %add        = aten.add.Tensor(%wait, %residual)                 ->  %ar = fxr.all_reduce_add_rms_norm(
    ... rms_norm(%add) ...                                                   %o_proj, %residual, %w, %eps, '0')

Patterns are composed from the add + norm (+ quant) patterns of ``rewrites/norm.py`` and
``rewrites/quant.py``, so every spelling those cover is covered here. The reduced value must
feed the add alone (a second reader would need it materialized: no match), the reduction must
be a sum, and the norm weight must have the input's dtype (the fused kernel reads it as such).
These rules run before the norm rules (``fuse_collective`` is the first fusion pass), which
would otherwise claim the add + norm and leave the all-reduce alone.
"""

from __future__ import annotations

import torch

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.rewrites.norm import WILDCARDS, add_norm_guard, add_rms_norm_pattern
from fxrewrite.rewrites.quant import add_norm_scale_guard
from fxrewrite.rule import Bindings, Rule, Scalar, all_of
from fxrewrite.runtime.ops.collective import all_reduce_sum
from fxrewrite.runtime.ops.quant import quant_fp8_static

COLLECTIVE_WILDCARDS = {**WILDCARDS, "group_name": Scalar(str)}


def _same_weight_dtype(b: Bindings) -> bool | str:
    if b["weight"].dtype != b["x"].dtype:
        return f"norm weight {b['weight'].dtype} != input {b['x'].dtype} (the fused kernel reads it as the input dtype)"
    return True


# add + norm's guard (+ the scale's), and the weight in the input's dtype
all_reduce_norm_guard = all_of(add_norm_guard, _same_weight_dtype)
all_reduce_norm_scale_guard = all_of(add_norm_scale_guard, _same_weight_dtype)


# s = all_reduce(x) + residual; norm(s) -> fxr.all_reduce_add_rms_norm(x, residual, weight, eps, group_name)
def all_reduce_add_rms_norm_pattern(x, residual, weight, eps, dtype, group_name):
    return add_rms_norm_pattern(all_reduce_sum(x, group_name), residual, weight, eps, dtype)


def all_reduce_add_rms_norm_replacement(x, residual, weight, eps, group_name):
    out = torch.ops.fxr.all_reduce_add_rms_norm(x, residual, weight, eps, group_name)
    return out[0], out[1]


# s = all_reduce(x) + residual; quant_static(norm(s)) -> fxr.all_reduce_add_rms_norm_quant_fp8 (q, s)
def all_reduce_add_rms_norm_quant_pattern(x, residual, weight, eps, dtype, scale, group_name):
    y, s = all_reduce_add_rms_norm_pattern(x, residual, weight, eps, dtype, group_name)
    return quant_fp8_static(y, scale), s


def all_reduce_add_rms_norm_quant_replacement(x, residual, weight, eps, scale, group_name):
    out = torch.ops.fxr.all_reduce_add_rms_norm_quant_fp8(x, residual, weight, eps, scale, group_name)
    return out[0], out[1]


# Tried only on graphs with an all-reduce: elsewhere every add + norm would be a near miss.
REQUIRES = (torch.ops._c10d_functional.all_reduce.default,)
ALL_REDUCE_ADD_RMS_NORM = Rule(
    "all_reduce_add_rms_norm", all_reduce_add_rms_norm_pattern, all_reduce_add_rms_norm_replacement,
    all_reduce_norm_guard, COLLECTIVE_WILDCARDS, requires=REQUIRES,
)  # fmt: skip
ALL_REDUCE_ADD_RMS_NORM_QUANT = Rule(
    "all_reduce_add_rms_norm_quant_fp8", all_reduce_add_rms_norm_quant_pattern,
    all_reduce_add_rms_norm_quant_replacement, all_reduce_norm_scale_guard, COLLECTIVE_WILDCARDS, requires=REQUIRES,
)  # fmt: skip

# The quantized form first: it contains the plain one.
RULES: list[Rule] = [ALL_REDUCE_ADD_RMS_NORM_QUANT, ALL_REDUCE_ADD_RMS_NORM]
