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

A dynamic per-token quantization of anything else (an attention output, a GEMM's output, an
input) is ``fxr.dynamic_quant_fp8`` alone: one kernel for the five to seven torch kernels of its
code. That rule runs last of the quant rules (``fuse_quant``), after every rule that fuses a
quantization into what precedes it, so it takes only the quantizations they left::

    # before                                                 # after
    a = attention(q, k, v).view(T, H * d)                    a = attention(q, k, v).view(T, H * d)
    f = a.float()                                            q, s = torch.ops.fxr.dynamic_quant_fp8(a)
    s = f.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    q = (f / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

A static per-tensor quantization alone stays as written: one elementwise chain (cast, divide,
clamp, cast), no reduction, which a fused kernel would not make shorter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite import meta
from fxrewrite.canonicalize import DIV
from fxrewrite.rewrites.norm import (
    WILDCARDS, add_cast_last_guard, add_norm_guard, cast_flag, cast_last_guard, norm_guard, norm_patterns,
)  # fmt: skip
from fxrewrite.rule import Bindings, Rule, all_of
from fxrewrite.runtime.ops.quant import quant_fp8_per_token, quant_fp8_static


def scale_guard(b: Bindings) -> bool | str:
    """A static scale is one float32 number."""
    s = b["scale"]
    if s.numel() != 1 or s.dtype != torch.float32:
        return f"scale must be one float32 element, got {s.dtype}{tuple(s.shape)}"
    return True


def other_scales(g: fx.Node, outside: list[fx.Node], inside: set[fx.Node]) -> str | None:
    """Why a static norm + quant does not fuse where the normed value ``g`` is also quantized
    with other scales (q, k and v projections each with its own input scale): one fused op
    writes one quantized value, with one scale. None where the other readers are something else."""
    ours = [u for u in g.users if u in inside and u.target is DIV and u.args[0] is g]
    if not ours:
        return None
    others = [u for u in outside if u.target is DIV and u.args[0] is g and u.args[1] is not ours[0].args[1]]
    if not others or len(others) != len(outside):
        return None
    names = " and ".join(_module_name(u) for u in others)
    verb = "quantize" if len(others) > 1 else "quantizes"
    mine = _module_name(ours[0])
    return f"one quantized value per scale: {names} {verb} the normed value with other scales than {mine}"


def _module_name(n: fx.Node) -> str:
    """The last part of the module path of ``n`` (``k_proj``), else its node name."""
    return (meta.module_path(n) or n.name).rsplit(".", 1)[-1]


norm_scale_guard = all_of(scale_guard, norm_guard)
add_norm_scale_guard = all_of(scale_guard, add_norm_guard)
cast_last_scale_guard = all_of(scale_guard, cast_last_guard)
add_cast_last_scale_guard = all_of(scale_guard, add_cast_last_guard)


# Each norm + quant rule is made for either order of the norm's weight and rounding
# (rewrites/norm.py's ``norm_patterns``): Llama's ``weight * normed.to(dtype)`` and torch.rms_norm's
# ``(weight * normed).to(dtype)``, the op then called with ``cast_last=True`` (``flags``).


def rms_norm_quant(cast_last: bool) -> tuple[Callable, Callable]:
    """quant_static(norm(x)) -> fxr.rms_norm_quant_fp8(x, weight, eps, scale[, True])"""
    norm, flags = norm_patterns(cast_last)[0], cast_flag(cast_last)

    def pattern(x, weight, eps, dtype, scale):
        return quant_fp8_static(norm(x, weight, eps, dtype), scale)

    def replacement(x, weight, eps, scale):
        return torch.ops.fxr.rms_norm_quant_fp8(x, weight, eps, scale, *flags)

    return pattern, replacement


def rms_norm_dynamic_quant(cast_last: bool) -> tuple[Callable, Callable]:
    """quant_per_token(norm(x)) -> fxr.rms_norm_dynamic_quant_fp8(x, weight, eps[, True]) (q, scales)"""
    norm, flags = norm_patterns(cast_last)[0], cast_flag(cast_last)

    def pattern(x, weight, eps, dtype):
        return quant_fp8_per_token(norm(x, weight, eps, dtype))

    def replacement(x, weight, eps):
        out = torch.ops.fxr.rms_norm_dynamic_quant_fp8(x, weight, eps, *flags)
        return out[0], out[1]

    return pattern, replacement


def add_rms_norm_quant(cast_last: bool) -> tuple[Callable, Callable]:
    """s = x + residual; quant_static(norm(s)) -> fxr.fused_add_rms_norm_quant_fp8(.., scale[, True]) (q, s)"""
    add_norm, flags = norm_patterns(cast_last)[1], cast_flag(cast_last)

    def pattern(x, residual, weight, eps, dtype, scale):
        y, s = add_norm(x, residual, weight, eps, dtype)
        return quant_fp8_static(y, scale), s

    def replacement(x, residual, weight, eps, scale):
        out = torch.ops.fxr.fused_add_rms_norm_quant_fp8(x, residual, weight, eps, scale, *flags)
        return out[0], out[1]

    return pattern, replacement


def add_rms_norm_dynamic_quant(cast_last: bool) -> tuple[Callable, Callable]:
    """s = x + residual; quant_per_token(norm(s)) -> fxr.fused_add_rms_norm_dynamic_quant_fp8(..[, True]) (q, scales, s)"""
    add_norm, flags = norm_patterns(cast_last)[1], cast_flag(cast_last)

    def pattern(x, residual, weight, eps, dtype):
        y, s = add_norm(x, residual, weight, eps, dtype)
        q, scale = quant_fp8_per_token(y)
        return q, scale, s

    def replacement(x, residual, weight, eps):
        out = torch.ops.fxr.fused_add_rms_norm_dynamic_quant_fp8(x, residual, weight, eps, *flags)
        return out[0], out[1], out[2]

    return pattern, replacement


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


# quant_per_token(y) -> fxr.dynamic_quant_fp8(y)  (q, scales): y produced by anything the rules before left
def dynamic_quant_pattern(y):
    return quant_fp8_per_token(y)


def dynamic_quant_replacement(y):
    out = torch.ops.fxr.dynamic_quant_fp8(y)
    return out[0], out[1]


def rows_guard(b: Bindings) -> bool | str:
    """A quantized value with a last dim (its rows: per token, per group): not a 0-d tensor."""
    return True if b["y"].dim() >= 1 else "a 0-d value has no rows to quantize"


# quant_static(norm(x)) -> fxr.rms_norm_quant_fp8(x, weight, eps, scale); cast-last twin: (.., scale, True)
RMS_NORM_QUANT = Rule("rms_norm_quant_fp8", *rms_norm_quant(False), norm_scale_guard, WILDCARDS,
                      explain_shared=other_scales)
RMS_NORM_CAST_LAST_QUANT = Rule(
    "rms_norm_cast_last_quant_fp8", *rms_norm_quant(True), cast_last_scale_guard, WILDCARDS, explain_shared=other_scales
)
# quant_per_token(norm(x)) -> fxr.rms_norm_dynamic_quant_fp8(x, weight, eps); cast-last twin: (.., True)
RMS_NORM_DYNAMIC_QUANT = Rule("rms_norm_dynamic_quant_fp8", *rms_norm_dynamic_quant(False), norm_guard, WILDCARDS)
RMS_NORM_CAST_LAST_DYNAMIC_QUANT = Rule(
    "rms_norm_cast_last_dynamic_quant_fp8", *rms_norm_dynamic_quant(True), cast_last_guard, WILDCARDS
)
# s = x + residual; quant_static(norm(s)) -> fxr.fused_add_rms_norm_quant_fp8 (q, s); cast-last twin
ADD_RMS_NORM_QUANT = Rule(
    "add_rms_norm_quant_fp8", *add_rms_norm_quant(False), add_norm_scale_guard, WILDCARDS, explain_shared=other_scales
)
ADD_RMS_NORM_CAST_LAST_QUANT = Rule(
    "add_rms_norm_cast_last_quant_fp8", *add_rms_norm_quant(True), add_cast_last_scale_guard, WILDCARDS,
    explain_shared=other_scales,
)
# s = x + residual; quant_per_token(norm(s)) -> fxr.fused_add_rms_norm_dynamic_quant_fp8 (q, scales, s); cast-last twin
ADD_RMS_NORM_DYNAMIC_QUANT = Rule(
    "add_rms_norm_dynamic_quant_fp8", *add_rms_norm_dynamic_quant(False), add_norm_guard, WILDCARDS
)
ADD_RMS_NORM_CAST_LAST_DYNAMIC_QUANT = Rule(
    "add_rms_norm_cast_last_dynamic_quant_fp8", *add_rms_norm_dynamic_quant(True), add_cast_last_guard, WILDCARDS
)
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
# quant_per_token(y) -> fxr.dynamic_quant_fp8(y): the quantizer alone
DYNAMIC_QUANT = Rule("dynamic_quant_fp8", dynamic_quant_pattern, dynamic_quant_replacement, rows_guard)

# Before the norm rules (add + norm variants first, as there). Each cast-last twin after its
# rule: in float32 the two orders are one computation, and the first takes it.
NORM_RULES: list[Rule] = [
    ADD_RMS_NORM_DYNAMIC_QUANT, ADD_RMS_NORM_CAST_LAST_DYNAMIC_QUANT, ADD_RMS_NORM_QUANT, ADD_RMS_NORM_CAST_LAST_QUANT,
    RMS_NORM_DYNAMIC_QUANT, RMS_NORM_CAST_LAST_DYNAMIC_QUANT, RMS_NORM_QUANT, RMS_NORM_CAST_LAST_QUANT,
]  # fmt: skip
# After the activation rules.
ACTIVATION_RULES: list[Rule] = [SILU_AND_MUL_QUANT, SILU_AND_MUL_QUANT_WALK, SILU_AND_MUL_DYNAMIC_QUANT]
# Last of the quant rules (``fuse_quant``): the quantizations no rule fused into their producer.
ALONE_RULES: list[Rule] = [DYNAMIC_QUANT]
