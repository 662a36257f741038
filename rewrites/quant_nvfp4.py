"""NVFP4 quantization fused into the op that produces its input.

The quantization is spelled as ``runtime/ops/quant_nvfp4.py`` specifies it (vLLM's NVFP4
reference recipe, written as torch code): blocks of 16 values along the last dim, an e4m3 scale
per block from its amax, a float32 global scale, the values rounded to e2m1 and packed two a
byte. Patterns are composed from the norm, all-reduce + add + norm (tensor parallel) patterns and
the fused activations, so every spelling those cover is covered here::

    # before                                                 # after
    y = weight * normed(x, eps).to(dtype)                    q, s = fxr.rms_norm_quant_nvfp4(x, weight, eps, g)
    blocks = y.float().unflatten(-1, (-1, 16))               # (values uint8 [.., H/2], scales e4m3 [.., H/16])
    ... (amax, e4m3 scale, e2m1 rounding, packing)

The block size is a wildcard (``quant_e2m1_blocks`` is the spec with the size a parameter) bound by
the guard: 16, NVFP4's; a block of 32 (MXFP4's size, whose scales are powers of two) is refused
with that reason. Norm rules run before the plain norm rules (they contain them); activation rules
after SiLU / GELU-and-mul fused, on ``fxr.silu_and_mul`` / ``fxr.gelu_and_mul``. The quantizer of
anything else (an attention output) is ``fxr.quant_nvfp4(y, g)`` alone, in ``fuse_quant``, the
last quant group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.rewrites.collective import (
    COLLECTIVE_WILDCARDS, REQUIRES, all_reduce_add_rms_norm_pattern, all_reduce_norm_guard,
)  # fmt: skip
from fxrewrite.rewrites.norm import (
    WILDCARDS, add_cast_last_guard, add_norm_guard, cast_flag, cast_last_guard, norm_guard, norm_patterns,
)  # fmt: skip
from fxrewrite.rule import Bindings, Rule, Scalar, all_of
from fxrewrite.runtime.ops.quant_nvfp4 import BLOCK, quant_e2m1_blocks


def nvfp4_guard(b: Bindings) -> bool | str:
    """Blocks of 16 values; the global scale is one float32 number."""
    if b["block"] != BLOCK:
        return f"blocks of {b['block']} values: NVFP4 scales blocks of {BLOCK}"
    g = b["global_scale"]
    if g.numel() != 1 or g.dtype != torch.float32:
        return f"global scale must be one float32 element, got {g.dtype}{tuple(g.shape)}"
    return True


BLOCK_SCALAR = {"block": Scalar(int)}
SCALARS = {**WILDCARDS, **BLOCK_SCALAR}


# The norm rules are made for either order of the norm's weight and rounding (rewrites/norm.py's
# ``norm_patterns``; torch.rms_norm's order calls the op with ``cast_last=True``).


def rms_norm_nvfp4(cast_last: bool) -> tuple[Callable, Callable]:
    """quant_nvfp4(norm(x)) -> fxr.rms_norm_quant_nvfp4(x, weight, eps, global_scale[, True]) (values, scales)"""
    norm, flags = norm_patterns(cast_last)[0], cast_flag(cast_last)

    def pattern(x, weight, eps, dtype, global_scale, block):
        return quant_e2m1_blocks(norm(x, weight, eps, dtype), global_scale, block)

    def replacement(x, weight, eps, global_scale):
        out = torch.ops.fxr.rms_norm_quant_nvfp4(x, weight, eps, global_scale, *flags)
        return out[0], out[1]

    return pattern, replacement


def add_rms_norm_nvfp4(cast_last: bool) -> tuple[Callable, Callable]:
    """s = x + residual; quant_nvfp4(norm(s)) -> fxr.fused_add_rms_norm_quant_nvfp4(..[, True]) (values, scales, s)"""
    add_norm, flags = norm_patterns(cast_last)[1], cast_flag(cast_last)

    def pattern(x, residual, weight, eps, dtype, global_scale, block):
        y, s = add_norm(x, residual, weight, eps, dtype)
        q, scales = quant_e2m1_blocks(y, global_scale, block)
        return q, scales, s

    def replacement(x, residual, weight, eps, global_scale):
        out = torch.ops.fxr.fused_add_rms_norm_quant_nvfp4(x, residual, weight, eps, global_scale, *flags)
        return out[0], out[1], out[2]

    return pattern, replacement


# s = all_reduce(x) + residual; quant_nvfp4(norm(s)) -> fxr.all_reduce_add_rms_norm_quant_nvfp4 (values, scales, s)
def all_reduce_add_rms_norm_nvfp4_pattern(x, residual, weight, eps, dtype, global_scale, block, group_name):
    y, s = all_reduce_add_rms_norm_pattern(x, residual, weight, eps, dtype, group_name)
    q, scales = quant_e2m1_blocks(y, global_scale, block)
    return q, scales, s


def all_reduce_add_rms_norm_nvfp4_replacement(x, residual, weight, eps, global_scale, group_name):
    out = torch.ops.fxr.all_reduce_add_rms_norm_quant_nvfp4(x, residual, weight, eps, global_scale, group_name)
    return out[0], out[1], out[2]


# quant_nvfp4(fxr.silu_and_mul(x)) -> fxr.silu_and_mul_quant_nvfp4(x, global_scale)
def silu_and_mul_nvfp4_pattern(x, global_scale, block):
    return quant_e2m1_blocks(torch.ops.fxr.silu_and_mul(x), global_scale, block)


def silu_and_mul_nvfp4_replacement(x, global_scale):
    out = torch.ops.fxr.silu_and_mul_quant_nvfp4(x, global_scale)
    return out[0], out[1]


# quant_nvfp4(fxr.gelu_and_mul(x)) -> fxr.gelu_and_mul_quant_nvfp4(x, global_scale)  (erf form)
def gelu_and_mul_nvfp4_pattern(x, global_scale, block):
    return quant_e2m1_blocks(torch.ops.fxr.gelu_and_mul(x), global_scale, block)


def gelu_and_mul_nvfp4_replacement(x, global_scale):
    out = torch.ops.fxr.gelu_and_mul_quant_nvfp4(x, global_scale)
    return out[0], out[1]


# quant_nvfp4(fxr.gelu_and_mul(x, approximate)) -> fxr.gelu_and_mul_quant_nvfp4(x, global_scale, approximate)
def gelu_approx_and_mul_nvfp4_pattern(x, global_scale, approximate, block):
    return quant_e2m1_blocks(torch.ops.fxr.gelu_and_mul(x, approximate), global_scale, block)


def gelu_approx_and_mul_nvfp4_replacement(x, global_scale, approximate):
    out = torch.ops.fxr.gelu_and_mul_quant_nvfp4(x, global_scale, approximate)
    return out[0], out[1]


# quant_nvfp4(y) -> fxr.quant_nvfp4(y, global_scale): y produced by anything the rules before left
def quant_nvfp4_pattern(y, global_scale, block):
    return quant_e2m1_blocks(y, global_scale, block)


def quant_nvfp4_replacement(y, global_scale):
    out = torch.ops.fxr.quant_nvfp4(y, global_scale)
    return out[0], out[1]


# quant_nvfp4(norm(x)) -> fxr.rms_norm_quant_nvfp4(x, weight, eps, g); cast-last twin: (.., g, True)
RMS_NORM_NVFP4 = Rule(
    "rms_norm_quant_nvfp4", *rms_norm_nvfp4(False), all_of(nvfp4_guard, norm_guard), SCALARS
)
RMS_NORM_CAST_LAST_NVFP4 = Rule(
    "rms_norm_cast_last_quant_nvfp4", *rms_norm_nvfp4(True), all_of(nvfp4_guard, cast_last_guard), SCALARS
)
# s = x + residual; quant_nvfp4(norm(s)) -> fxr.fused_add_rms_norm_quant_nvfp4 (values, scales, s); cast-last twin
ADD_RMS_NORM_NVFP4 = Rule(
    "add_rms_norm_quant_nvfp4", *add_rms_norm_nvfp4(False), all_of(nvfp4_guard, add_norm_guard), SCALARS
)
ADD_RMS_NORM_CAST_LAST_NVFP4 = Rule(
    "add_rms_norm_cast_last_quant_nvfp4", *add_rms_norm_nvfp4(True), all_of(nvfp4_guard, add_cast_last_guard), SCALARS
)
ALL_REDUCE_ADD_RMS_NORM_NVFP4 = Rule(
    "all_reduce_add_rms_norm_quant_nvfp4", all_reduce_add_rms_norm_nvfp4_pattern,
    all_reduce_add_rms_norm_nvfp4_replacement, all_of(nvfp4_guard, all_reduce_norm_guard),
    {**COLLECTIVE_WILDCARDS, **BLOCK_SCALAR}, requires=REQUIRES,
)  # fmt: skip
SILU_AND_MUL_NVFP4 = Rule(
    "silu_and_mul_quant_nvfp4", silu_and_mul_nvfp4_pattern, silu_and_mul_nvfp4_replacement, nvfp4_guard, BLOCK_SCALAR
)
# fxr.gelu_and_mul as the activation rules write it: (x) for the erf form, (x, "tanh") for the other
GELU_AND_MUL_NVFP4 = Rule(
    "gelu_and_mul_quant_nvfp4", gelu_and_mul_nvfp4_pattern, gelu_and_mul_nvfp4_replacement, nvfp4_guard, BLOCK_SCALAR
)
GELU_APPROX_AND_MUL_NVFP4 = Rule(
    "gelu_and_mul_quant_nvfp4", gelu_approx_and_mul_nvfp4_pattern, gelu_approx_and_mul_nvfp4_replacement, nvfp4_guard,
    {**BLOCK_SCALAR, "approximate": Scalar(str)},
)  # fmt: skip
# quant_nvfp4(y) -> fxr.quant_nvfp4(y, global_scale): the quantizer alone
QUANT_NVFP4 = Rule("quant_nvfp4", quant_nvfp4_pattern, quant_nvfp4_replacement, nvfp4_guard, BLOCK_SCALAR)

# Before the all-reduce rules (it contains the plain one).
COLLECTIVE_RULES: list[Rule] = [ALL_REDUCE_ADD_RMS_NORM_NVFP4]
# Before the norm rules (add + norm first, as there); each cast-last twin after its rule (in
# float32 the two orders are one computation, and the first takes it).
NORM_RULES: list[Rule] = [ADD_RMS_NORM_NVFP4, ADD_RMS_NORM_CAST_LAST_NVFP4, RMS_NORM_NVFP4, RMS_NORM_CAST_LAST_NVFP4]
# After the activation rules.
ACTIVATION_RULES: list[Rule] = [SILU_AND_MUL_NVFP4, GELU_AND_MUL_NVFP4, GELU_APPROX_AND_MUL_NVFP4]
# Last of the quant rules (``fuse_quant``): the quantizations no rule fused into their producer.
ALONE_RULES: list[Rule] = [QUANT_NVFP4]
