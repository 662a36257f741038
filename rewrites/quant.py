"""FP8 quantization fused into the op that produces its input.

The quantization is spelled as ``runtime/ops/quant.py`` specifies it (and as model code writes
it): static per-tensor ``(y.float() / scale).clamp(-448, 448).to(float8_e4m3fn)``, or dynamic
per token with ``scale = amax(|y|, -1).clamp(min=1e-12) / 448``. Patterns are composed from the
norm and activation patterns themselves, so every spelling those cover is covered here. Each norm
rule has a cast-last twin: the norm in torch.rms_norm's order (``(w * normed).to(dtype)``,
``rewrites/norm.py``'s cast-last rules), fused into the same op with ``cast_last=True``.

Norm + quant rules run before the plain norm rules (they contain them); activation + quant
rules run after SiLU-and-mul fused and match on ``fxr.silu_and_mul``: the static one through
``torch.fx.subgraph_rewriter`` (no wildcards are needed on top of a fused op), then through the
node-walking matcher for the spellings exact matching misses (lifted 448, elided ``.float()``).
"""

from __future__ import annotations

import torch

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.rewrites.norm import (
    WILDCARDS, add_cast_last_guard, add_norm_guard, add_rms_norm_cast_last_pattern, add_rms_norm_pattern,
    cast_last_guard, norm_guard, rms_norm_cast_last_pattern, rms_norm_pattern,
)  # fmt: skip
from fxrewrite.rule import Bindings, Rule, all_of
from fxrewrite.runtime.ops.quant import quant_fp8_per_token, quant_fp8_static


def scale_guard(b: Bindings) -> bool | str:
    """A static scale is one float32 number."""
    s = b["scale"]
    if s.numel() != 1 or s.dtype != torch.float32:
        return f"scale must be one float32 element, got {s.dtype}{tuple(s.shape)}"
    return True


norm_scale_guard = all_of(scale_guard, norm_guard)
add_norm_scale_guard = all_of(scale_guard, add_norm_guard)
cast_last_scale_guard = all_of(scale_guard, cast_last_guard)
add_cast_last_scale_guard = all_of(scale_guard, add_cast_last_guard)


# quant_static(norm(x)) -> fxr.rms_norm_quant_fp8(x, weight, eps, scale)
def rms_norm_quant_pattern(x, weight, eps, dtype, scale):
    return quant_fp8_static(rms_norm_pattern(x, weight, eps, dtype), scale)


def rms_norm_quant_replacement(x, weight, eps, scale):
    return torch.ops.fxr.rms_norm_quant_fp8(x, weight, eps, scale)


# quant_per_token(norm(x)) -> fxr.rms_norm_dynamic_quant_fp8(x, weight, eps)
def rms_norm_dynamic_quant_pattern(x, weight, eps, dtype):
    return quant_fp8_per_token(rms_norm_pattern(x, weight, eps, dtype))


def rms_norm_dynamic_quant_replacement(x, weight, eps):
    out = torch.ops.fxr.rms_norm_dynamic_quant_fp8(x, weight, eps)
    return out[0], out[1]


# s = x + residual; quant_static(norm(s)) -> fxr.fused_add_rms_norm_quant_fp8 (q, s)
def add_rms_norm_quant_pattern(x, residual, weight, eps, dtype, scale):
    y, s = add_rms_norm_pattern(x, residual, weight, eps, dtype)
    return quant_fp8_static(y, scale), s


def add_rms_norm_quant_replacement(x, residual, weight, eps, scale):
    out = torch.ops.fxr.fused_add_rms_norm_quant_fp8(x, residual, weight, eps, scale)
    return out[0], out[1]


# s = x + residual; quant_per_token(norm(s)) -> fxr.fused_add_rms_norm_dynamic_quant_fp8 (q, scale, s)
def add_rms_norm_dynamic_quant_pattern(x, residual, weight, eps, dtype):
    y, s = add_rms_norm_pattern(x, residual, weight, eps, dtype)
    q, scale = quant_fp8_per_token(y)
    return q, scale, s


def add_rms_norm_dynamic_quant_replacement(x, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm_dynamic_quant_fp8(x, residual, weight, eps)
    return out[0], out[1], out[2]


# The norm in torch.rms_norm's order, (weight * normed(x)).to(dtype), then the quantization: the
# same ops with cast_last=True (rewrites/norm.py's cast-last rules, quantized).


# quant_static((w * norm(x)).to(dtype)) -> fxr.rms_norm_quant_fp8(x, weight, eps, scale, True)
def rms_norm_cast_last_quant_pattern(x, weight, eps, dtype, scale):
    return quant_fp8_static(rms_norm_cast_last_pattern(x, weight, eps, dtype), scale)


def rms_norm_cast_last_quant_replacement(x, weight, eps, scale):
    return torch.ops.fxr.rms_norm_quant_fp8(x, weight, eps, scale, True)


# quant_per_token((w * norm(x)).to(dtype)) -> fxr.rms_norm_dynamic_quant_fp8(x, weight, eps, True)
def rms_norm_cast_last_dynamic_quant_pattern(x, weight, eps, dtype):
    return quant_fp8_per_token(rms_norm_cast_last_pattern(x, weight, eps, dtype))


def rms_norm_cast_last_dynamic_quant_replacement(x, weight, eps):
    out = torch.ops.fxr.rms_norm_dynamic_quant_fp8(x, weight, eps, True)
    return out[0], out[1]


# s = x + residual; quant_static((w * norm(s)).to(dtype)) -> fxr.fused_add_rms_norm_quant_fp8(.., scale, True)
def add_rms_norm_cast_last_quant_pattern(x, residual, weight, eps, dtype, scale):
    y, s = add_rms_norm_cast_last_pattern(x, residual, weight, eps, dtype)
    return quant_fp8_static(y, scale), s


def add_rms_norm_cast_last_quant_replacement(x, residual, weight, eps, scale):
    out = torch.ops.fxr.fused_add_rms_norm_quant_fp8(x, residual, weight, eps, scale, True)
    return out[0], out[1]


# s = x + residual; quant_per_token((w * norm(s)).to(dtype)) -> fxr.fused_add_rms_norm_dynamic_quant_fp8(.., True)
def add_rms_norm_cast_last_dynamic_quant_pattern(x, residual, weight, eps, dtype):
    y, s = add_rms_norm_cast_last_pattern(x, residual, weight, eps, dtype)
    q, scale = quant_fp8_per_token(y)
    return q, scale, s


def add_rms_norm_cast_last_dynamic_quant_replacement(x, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm_dynamic_quant_fp8(x, residual, weight, eps, True)
    return out[0], out[1], out[2]


# quant_static(fxr.silu_and_mul(x)) -> fxr.silu_and_mul_quant_fp8(x, scale)
def silu_and_mul_quant_pattern(x, scale):
    return quant_fp8_static(torch.ops.fxr.silu_and_mul(x), scale)


def silu_and_mul_quant_replacement(x, scale):
    return torch.ops.fxr.silu_and_mul_quant_fp8(x, scale)


# quant_per_token(fxr.silu_and_mul(x)) -> fxr.silu_and_mul_dynamic_quant_fp8(x)
def silu_and_mul_dynamic_quant_pattern(x):
    return quant_fp8_per_token(torch.ops.fxr.silu_and_mul(x))


def silu_and_mul_dynamic_quant_replacement(x):
    out = torch.ops.fxr.silu_and_mul_dynamic_quant_fp8(x)
    return out[0], out[1]


RMS_NORM_QUANT = Rule("rms_norm_quant_fp8", rms_norm_quant_pattern, rms_norm_quant_replacement, norm_scale_guard, WILDCARDS)
RMS_NORM_DYNAMIC_QUANT = Rule(
    "rms_norm_dynamic_quant_fp8", rms_norm_dynamic_quant_pattern, rms_norm_dynamic_quant_replacement, norm_guard, WILDCARDS
)
ADD_RMS_NORM_QUANT = Rule(
    "add_rms_norm_quant_fp8", add_rms_norm_quant_pattern, add_rms_norm_quant_replacement, add_norm_scale_guard, WILDCARDS
)
ADD_RMS_NORM_DYNAMIC_QUANT = Rule(
    "add_rms_norm_dynamic_quant_fp8",
    add_rms_norm_dynamic_quant_pattern,
    add_rms_norm_dynamic_quant_replacement,
    add_norm_guard,
    WILDCARDS,
)
RMS_NORM_CAST_LAST_QUANT = Rule(
    "rms_norm_cast_last_quant_fp8", rms_norm_cast_last_quant_pattern, rms_norm_cast_last_quant_replacement,
    cast_last_scale_guard, WILDCARDS,
)  # fmt: skip
RMS_NORM_CAST_LAST_DYNAMIC_QUANT = Rule(
    "rms_norm_cast_last_dynamic_quant_fp8", rms_norm_cast_last_dynamic_quant_pattern,
    rms_norm_cast_last_dynamic_quant_replacement, cast_last_guard, WILDCARDS,
)  # fmt: skip
ADD_RMS_NORM_CAST_LAST_QUANT = Rule(
    "add_rms_norm_cast_last_quant_fp8", add_rms_norm_cast_last_quant_pattern,
    add_rms_norm_cast_last_quant_replacement, add_cast_last_scale_guard, WILDCARDS,
)  # fmt: skip
ADD_RMS_NORM_CAST_LAST_DYNAMIC_QUANT = Rule(
    "add_rms_norm_cast_last_dynamic_quant_fp8", add_rms_norm_cast_last_dynamic_quant_pattern,
    add_rms_norm_cast_last_dynamic_quant_replacement, add_cast_last_guard, WILDCARDS,
)  # fmt: skip
SILU_AND_MUL_QUANT = Rule(
    "silu_and_mul_quant_fp8", silu_and_mul_quant_pattern, silu_and_mul_quant_replacement, scale_guard,
    via="subgraph_rewriter",
)  # fmt: skip
# The same rule through the node-walking matcher, for the spellings exact structural matching
# misses: the bound 448 read from a Python float (``FP8_MAX`` in ``quant_fp8_static`` itself),
# which Dynamo lifts under dynamic=True (``-item``, ``item`` where literals were), and a float32
# activation, whose ``.float()`` the graph no longer has.
SILU_AND_MUL_QUANT_WALK = Rule(
    "silu_and_mul_quant_fp8", silu_and_mul_quant_pattern, silu_and_mul_quant_replacement, scale_guard
)
SILU_AND_MUL_DYNAMIC_QUANT = Rule(
    "silu_and_mul_dynamic_quant_fp8", silu_and_mul_dynamic_quant_pattern, silu_and_mul_dynamic_quant_replacement
)

# Before the norm rules (add + norm variants first, as there). Each cast-last twin after its
# rule: in float32 the two orders are one computation, and the first takes it.
NORM_RULES: list[Rule] = [
    ADD_RMS_NORM_DYNAMIC_QUANT, ADD_RMS_NORM_CAST_LAST_DYNAMIC_QUANT, ADD_RMS_NORM_QUANT, ADD_RMS_NORM_CAST_LAST_QUANT,
    RMS_NORM_DYNAMIC_QUANT, RMS_NORM_CAST_LAST_DYNAMIC_QUANT, RMS_NORM_QUANT, RMS_NORM_CAST_LAST_QUANT,
]  # fmt: skip
# After the activation rules.
ACTIVATION_RULES: list[Rule] = [SILU_AND_MUL_QUANT, SILU_AND_MUL_QUANT_WALK, SILU_AND_MUL_DYNAMIC_QUANT]
