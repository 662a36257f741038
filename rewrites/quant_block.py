"""Block-wise FP8 (per-token groups along the last dim) fused into the op that produces its input.

The quantization is spelled as ``runtime/ops/quant_block.py`` specifies it, and as model code
writes it (vLLM's native group path, the fine-grained FP8 integrations' torch fallbacks):

    # before                                                   # after
    y = rms_norm(x, w, eps)                                    q, s = torch.ops.fxr.rms_norm_block_quant_fp8(x, w, eps, 128)
    g = y.float().view(*lead, H // 128, 128)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(*lead, H)
    s = s.view(*lead, H // 128)

Canonicalization turns the split into groups (``view``, ``reshape``, ``unflatten``) into
``aten.unflatten(y, -1, [-1, G])`` and the joins back into ``aten.flatten(.., -2, -1)``, so the
pattern (:func:`quant_fp8_block` itself) binds the group ``G`` as a scalar wildcard, whatever
the spelling; the op takes it. Not covered: padding to a multiple of the group (``F.pad`` before
the split, for a hidden size the group does not divide), groups that take strided columns
(``unflatten(-1, (G, -1))`` then a transpose), a scale left ``[..., H / G, 1]`` or squeezed
(``squeeze(-1)``: not canonicalized to a flatten), a single group of the whole row (its reshape
to ``[..., 1, H]`` is not an unflatten into groups).

Patterns are composed from the norm, activation and collective patterns, so every spelling those
cover is covered here; the rules run in the groups of ``rewrites/quant.py``'s (before the norm
rules, after the activation rules; the all-reduce one before ``collective.RULES``). The quantizer
of anything else (o_proj's input: an attention output) is ``fxr.block_quant_fp8(y, G)`` alone, in
``fuse_quant``, the last quant group, before the per-token rule (a group is quantized as a row
is: the per-token pattern lies inside this one).
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
from fxrewrite.runtime.ops.quant_block import check_group, quant_fp8_block

GROUP = {"group": Scalar(int, lambda v: v > 0)}


def group_guard(b: Bindings) -> bool | str:
    """The group divides the quantized dim: the norm's input's last dim."""
    return check_group(b["x"].shape[-1], b["group"]) or True


def quant_group_guard(b: Bindings) -> bool | str:
    """The group divides the quantized dim: the value's last dim."""
    return check_group(b["y"].shape[-1] if b["y"].dim() else 0, b["group"]) or True


def act_group_guard(b: Bindings) -> bool | str:
    """The group divides the quantized dim: half the gated activation's input."""
    return check_group(b["x"].shape[-1] // 2, b["group"]) or True


norm_group_guard = all_of(norm_guard, group_guard)
add_norm_group_guard = all_of(add_norm_guard, group_guard)
all_reduce_group_guard = all_of(all_reduce_norm_guard, group_guard)
cast_last_group_guard = all_of(cast_last_guard, group_guard)
add_cast_last_group_guard = all_of(add_cast_last_guard, group_guard)


# The norm rules are made for either order of the norm's weight and rounding (rewrites/norm.py's
# ``norm_patterns``; torch.rms_norm's order calls the op with ``cast_last=True``).


def rms_norm_block_quant(cast_last: bool) -> tuple[Callable, Callable]:
    """quant_block(norm(x), G) -> fxr.rms_norm_block_quant_fp8(x, weight, eps, G[, True])  (q, scales)"""
    norm, flags = norm_patterns(cast_last)[0], cast_flag(cast_last)

    def pattern(x, weight, eps, dtype, group):
        return quant_fp8_block(norm(x, weight, eps, dtype), group)

    def replacement(x, weight, eps, group):
        out = torch.ops.fxr.rms_norm_block_quant_fp8(x, weight, eps, group, *flags)
        return out[0], out[1]

    return pattern, replacement


def add_rms_norm_block_quant(cast_last: bool) -> tuple[Callable, Callable]:
    """s = x + residual; quant_block(norm(s), G) -> fxr.fused_add_rms_norm_block_quant_fp8(.., G[, True]) (q, scales, s)"""
    add_norm, flags = norm_patterns(cast_last)[1], cast_flag(cast_last)

    def pattern(x, residual, weight, eps, dtype, group):
        y, s = add_norm(x, residual, weight, eps, dtype)
        q, scales = quant_fp8_block(y, group)
        return q, scales, s

    def replacement(x, residual, weight, eps, group):
        out = torch.ops.fxr.fused_add_rms_norm_block_quant_fp8(x, residual, weight, eps, group, *flags)
        return out[0], out[1], out[2]

    return pattern, replacement


# s = all_reduce(x) + residual; quant_block(norm(s), G) -> fxr.all_reduce_add_rms_norm_block_quant_fp8 (q, scales, s)
def all_reduce_add_rms_norm_block_quant_pattern(x, residual, weight, eps, dtype, group, group_name):
    y, s = all_reduce_add_rms_norm_pattern(x, residual, weight, eps, dtype, group_name)
    q, scales = quant_fp8_block(y, group)
    return q, scales, s


def all_reduce_add_rms_norm_block_quant_replacement(x, residual, weight, eps, group, group_name):
    out = torch.ops.fxr.all_reduce_add_rms_norm_block_quant_fp8(x, residual, weight, eps, group, group_name)
    return out[0], out[1], out[2]


# quant_block(fxr.silu_and_mul(x), G) -> fxr.silu_and_mul_block_quant_fp8(x, G)
def silu_and_mul_block_quant_pattern(x, group):
    return quant_fp8_block(torch.ops.fxr.silu_and_mul(x), group)


def silu_and_mul_block_quant_replacement(x, group):
    out = torch.ops.fxr.silu_and_mul_block_quant_fp8(x, group)
    return out[0], out[1]


# quant_block(fxr.gelu_and_mul(x), G) -> fxr.gelu_and_mul_block_quant_fp8(x, G)  (erf)
def gelu_and_mul_block_quant_pattern(x, group):
    return quant_fp8_block(torch.ops.fxr.gelu_and_mul(x), group)


def gelu_and_mul_block_quant_replacement(x, group):
    out = torch.ops.fxr.gelu_and_mul_block_quant_fp8(x, group)
    return out[0], out[1]


# quant_block(fxr.gelu_and_mul(x, "tanh"), G) -> fxr.gelu_and_mul_block_quant_fp8(x, G, "tanh")
def gelu_tanh_and_mul_block_quant_pattern(x, group):
    return quant_fp8_block(torch.ops.fxr.gelu_and_mul(x, "tanh"), group)


def gelu_tanh_and_mul_block_quant_replacement(x, group):
    out = torch.ops.fxr.gelu_and_mul_block_quant_fp8(x, group, "tanh")
    return out[0], out[1]


# quant_block(y, G) -> fxr.block_quant_fp8(y, G)  (q, scales): y produced by anything the rules before left
def block_quant_pattern(y, group):
    return quant_fp8_block(y, group)


def block_quant_replacement(y, group):
    out = torch.ops.fxr.block_quant_fp8(y, group)
    return out[0], out[1]


NORM = {**WILDCARDS, **GROUP}
# quant_block(norm(x), G) -> fxr.rms_norm_block_quant_fp8(x, weight, eps, G); cast-last twin: (.., G, True)
RMS_NORM_BLOCK_QUANT = Rule("rms_norm_block_quant_fp8", *rms_norm_block_quant(False), norm_group_guard, NORM)
RMS_NORM_CAST_LAST_BLOCK_QUANT = Rule(
    "rms_norm_cast_last_block_quant_fp8", *rms_norm_block_quant(True), cast_last_group_guard, NORM
)
# s = x + residual; quant_block(norm(s), G) -> fxr.fused_add_rms_norm_block_quant_fp8 (q, scales, s); cast-last twin
ADD_RMS_NORM_BLOCK_QUANT = Rule(
    "add_rms_norm_block_quant_fp8", *add_rms_norm_block_quant(False), add_norm_group_guard, NORM
)
ADD_RMS_NORM_CAST_LAST_BLOCK_QUANT = Rule(
    "add_rms_norm_cast_last_block_quant_fp8", *add_rms_norm_block_quant(True), add_cast_last_group_guard, NORM
)
ALL_REDUCE_ADD_RMS_NORM_BLOCK_QUANT = Rule(
    "all_reduce_add_rms_norm_block_quant_fp8", all_reduce_add_rms_norm_block_quant_pattern,
    all_reduce_add_rms_norm_block_quant_replacement, all_reduce_group_guard, {**COLLECTIVE_WILDCARDS, **GROUP},
    requires=REQUIRES,
)  # fmt: skip
SILU_AND_MUL_BLOCK_QUANT = Rule(
    "silu_and_mul_block_quant_fp8", silu_and_mul_block_quant_pattern, silu_and_mul_block_quant_replacement,
    act_group_guard, GROUP,
)  # fmt: skip
GELU_AND_MUL_BLOCK_QUANT = Rule(
    "gelu_and_mul_block_quant_fp8", gelu_and_mul_block_quant_pattern, gelu_and_mul_block_quant_replacement,
    act_group_guard, GROUP,
)  # fmt: skip
GELU_TANH_AND_MUL_BLOCK_QUANT = Rule(
    "gelu_tanh_and_mul_block_quant_fp8", gelu_tanh_and_mul_block_quant_pattern,
    gelu_tanh_and_mul_block_quant_replacement, act_group_guard, GROUP,
)  # fmt: skip
# quant_block(y, G) -> fxr.block_quant_fp8(y, G): the quantizer alone
BLOCK_QUANT = Rule("block_quant_fp8", block_quant_pattern, block_quant_replacement, quant_group_guard, GROUP)

# Before the all-reduce rules (it contains the plain one).
COLLECTIVE_RULES: list[Rule] = [ALL_REDUCE_ADD_RMS_NORM_BLOCK_QUANT]
# Before the norm rules, add + norm first (as there); each cast-last twin after its rule (in
# float32 the two orders are one computation, and the first takes it).
NORM_RULES: list[Rule] = [ADD_RMS_NORM_BLOCK_QUANT, ADD_RMS_NORM_CAST_LAST_BLOCK_QUANT, RMS_NORM_BLOCK_QUANT,
                          RMS_NORM_CAST_LAST_BLOCK_QUANT]  # fmt: skip
# After the activation rules.
ACTIVATION_RULES: list[Rule] = [SILU_AND_MUL_BLOCK_QUANT, GELU_AND_MUL_BLOCK_QUANT, GELU_TANH_AND_MUL_BLOCK_QUANT]
# Last of the quant rules (``fuse_quant``), before quant.ALONE_RULES (per token: inside this pattern).
ALONE_RULES: list[Rule] = [BLOCK_QUANT]
