"""RMSNorm rules: plain, after a residual add, and Gemma's ``(1 + w)`` form.

Patterns are written the way HF model code writes them; canonicalization makes them cover the
other spellings (``x * x`` for ``pow(2)``, ``torch.mean(h, dim=-1, keepdim=True)``, weight on
either side of the product, eps as a literal or as ``.item()`` of a lifted placeholder).

Where the weight meets the normed value is the one choice model code makes that changes the
result: Llama rounds to the input dtype, then scales (``w * h.to(dtype)``); OLMo2, gpt-oss and
others scale in float32 and round once (``(w * h).to(dtype)``, also spelled ``(w.float() * h)``
or ``(h * w.float()).type_as(x)``, which canonicalize to it). Each order has its rule, and the
op computes exactly that order (``fxr.rms_norm(..., cast_last=True)``); in float32 the two are
one computation and the first rule takes it.

Without a weight (``(h * rsqrt(..)).type_as(x)``: nanochat, the weightless QK norms) the op takes
``weight=None``, alone or after a residual add. DeepSeek-V4 rounds the scale itself to the input
dtype and multiplies there (``x * rsqrt(..).to(x.dtype)``): another computation in bf16,
``fxr.rms_norm(..., round_scale=True)``. Gated norms and the L2 norm: ``rewrites/norm_variants.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.meta import dim_key, same_sizes
from fxrewrite.rule import Bindings, InPlace, Rule, Scalar

EPS = Scalar(float, lambda v: 0.0 < v < 0.1)
DTYPE = Scalar(torch.dtype)
WILDCARDS = {"eps": EPS, "dtype": DTYPE}


def normed(x, eps):
    h = x.to(torch.float32)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def cast_back_guard(b: Bindings) -> bool | str:
    """The norm casts back to the input's dtype, a floating one."""
    x = b["x"]
    if b["dtype"] != x.dtype:
        return f"casts back to {b['dtype']}, input is {x.dtype}"
    if not x.dtype.is_floating_point:
        return f"input dtype {x.dtype} is not floating point"
    return True


def float32_guard(b: Bindings) -> bool | str:
    """``x`` is float32 (a norm of ``h = x.float()`` left in float32 binds ``h``). A rule with it
    comes after its cast-back twin: tried first, it would take the float32 product inside a norm
    that is cast back after it, leaving the cast."""
    return True if b["x"].dtype == torch.float32 else f"input dtype {b['x'].dtype} is not float32"


def norm_guard(b: Bindings) -> bool | str:
    """:func:`cast_back_guard`, and the weight spans the normalized dim."""
    x, w = b["x"], b["weight"]
    if (why := cast_back_guard(b)) is not True:
        return why
    if w.dim() != 1 or dim_key(w.shape[0]) != dim_key(x.shape[-1]):
        return f"weight shape {tuple(w.shape)} != normalized dim {tuple(x.shape[-1:])}"
    return True


def cast_last_guard(b: Bindings) -> bool | str:
    """:func:`norm_guard`, and the product runs in float32: a float64 weight would run it in
    float64, which the op does not."""
    w = b["weight"]
    if not w.dtype.is_floating_point or w.element_size() > 4:
        return f"weight dtype {w.dtype}: the product would not run in float32"
    return norm_guard(b)


def add_cast_last_guard(b: Bindings) -> bool | str:
    return add_norm_guard(b) if (why := cast_last_guard(b)) is True else why


def residual_guard(b: Bindings) -> bool | str:
    """The residual is of the input's dtype and shape (the fused op adds without broadcasting)."""
    if b["x"].dtype != b["residual"].dtype or not same_sizes(b["x"], b["residual"]):
        return f"residual {b['residual'].dtype}{tuple(b['residual'].shape)} != input {b['x'].dtype}{tuple(b['x'].shape)}"
    return True


def add_norm_guard(b: Bindings) -> bool | str:
    return norm_guard(b) if (why := residual_guard(b)) is True else why


def add_unweighted_guard(b: Bindings) -> bool | str:
    return cast_back_guard(b) if (why := residual_guard(b)) is True else why


# x.float() * rsqrt(mean(x^2) + eps), cast back, times weight -> fxr.rms_norm(x, weight, eps)
def rms_norm_pattern(x, weight, eps, dtype):
    return weight * normed(x, eps).to(dtype)


def rms_norm_replacement(x, weight, eps):
    return torch.ops.fxr.rms_norm(x, weight, eps)


# s = x + residual; norm(s); both used -> fxr.fused_add_rms_norm(x, residual, weight, eps)
def add_rms_norm_pattern(x, residual, weight, eps, dtype):
    s = x + residual
    return weight * normed(s, eps).to(dtype), s


def add_rms_norm_replacement(x, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm(x, residual, weight, eps)
    return out[0], out[1]


# the add in float32, as vLLM writes it: s = x.float() + residual.float(); norm(s); the new residual
# is s cast back -> fxr.fused_add_rms_norm(x, residual, weight, eps). In float32 every cast is a
# no-op and this is add_rms_norm's pattern, which comes first and takes those sites.
def add_rms_norm_f32_sum_pattern(x, residual, weight, eps, dtype):
    s = x.to(torch.float32) + residual.to(torch.float32)
    return weight * normed(s, eps).to(dtype), s.to(dtype)


# (weight * norm(x.float())).to(dtype): scaled in float32, rounded once -> fxr.rms_norm(x, weight, eps, True)
def rms_norm_cast_last_pattern(x, weight, eps, dtype):
    return (weight * normed(x, eps)).to(dtype)


def rms_norm_cast_last_replacement(x, weight, eps):
    return torch.ops.fxr.rms_norm(x, weight, eps, True)


# s = x + residual; (weight * norm(s)).to(dtype); both used -> fxr.fused_add_rms_norm(x, residual, weight, eps, True)
def add_rms_norm_cast_last_pattern(x, residual, weight, eps, dtype):
    s = x + residual
    return (weight * normed(s, eps)).to(dtype), s


def add_rms_norm_cast_last_replacement(x, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm(x, residual, weight, eps, True)
    return out[0], out[1]


def norm_patterns(cast_last: bool) -> tuple[Callable, Callable]:
    """(norm, add + norm) patterns in one order of the weight and the rounding: Llama's
    (``cast_last=False``) or torch.rms_norm's (``True``): what the rules that extend a norm (a
    quantization after it) are made from, once per order."""
    if cast_last:
        return rms_norm_cast_last_pattern, add_rms_norm_cast_last_pattern
    return rms_norm_pattern, add_rms_norm_pattern


def cast_flag(cast_last: bool) -> tuple[bool, ...]:
    """The ops' trailing ``cast_last`` argument as a replacement passes it: only when set, so the
    graphs of the Llama order read as they did before the flag."""
    return (True,) if cast_last else ()


# x.float() * rsqrt(mean(x^2) + eps), cast back, no weight -> fxr.rms_norm(x, None, eps)
def rms_norm_unweighted_pattern(x, eps, dtype):
    return normed(x, eps).to(dtype)


def rms_norm_unweighted_replacement(x, eps):
    return torch.ops.fxr.rms_norm(x, None, eps)


# x * rsqrt(mean(x^2) + eps) of a float32 x, left in float32 (no cast back to a narrower input's
# dtype: x is then the upcast) -> fxr.rms_norm(x, None, eps)
def rms_norm_float32_pattern(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# s = x + residual; norm(s) without weight; both used -> fxr.fused_add_rms_norm(x, residual, None, eps)
def add_rms_norm_unweighted_pattern(x, residual, eps, dtype):
    s = x + residual
    return normed(s, eps).to(dtype), s


def add_rms_norm_unweighted_replacement(x, residual, eps):
    out = torch.ops.fxr.fused_add_rms_norm(x, residual, None, eps)
    return out[0], out[1]


def add_rms_norm_unweighted_inplace(x, residual, eps):
    out = torch.ops.fxr.fused_add_rms_norm_(x, residual, None, eps)
    return out[0], out[1]


# x * rsqrt(mean(x.float()^2) + eps).to(dtype): the scale rounded first, the product in x's
# dtype (DeepSeek-V4) -> fxr.rms_norm(x, None, eps, False, True). In float32 the casts are no-ops
# and this is the unweighted pattern, which comes first.
def rms_norm_rounded_scale_pattern(x, eps, dtype):
    h = x.to(torch.float32)
    return x * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps).to(dtype)


def rms_norm_rounded_scale_replacement(x, eps):
    return torch.ops.fxr.rms_norm(x, None, eps, False, True)


# Gemma: norm(x.float()) * (1 + w.float()), cast back -> fxr.gemma_rms_norm(x, weight, eps)
def gemma_rms_norm_pattern(x, weight, eps, dtype):
    return (normed(x, eps) * (1.0 + weight.to(torch.float32))).to(dtype)


def gemma_rms_norm_replacement(x, weight, eps):
    return torch.ops.fxr.gemma_rms_norm(x, weight, eps)


# s = x + residual; gemma_norm(s); both used -> fxr.gemma_fused_add_rms_norm(x, residual, weight, eps)
def gemma_add_rms_norm_pattern(x, residual, weight, eps, dtype):
    s = x + residual
    return (normed(s, eps) * (1.0 + weight.to(torch.float32))).to(dtype), s


# Gemma's, with the add in float32 -> fxr.gemma_fused_add_rms_norm(x, residual, weight, eps)
def gemma_add_rms_norm_f32_sum_pattern(x, residual, weight, eps, dtype):
    s = x.to(torch.float32) + residual.to(torch.float32)
    return (normed(s, eps) * (1.0 + weight.to(torch.float32))).to(dtype), s.to(dtype)


def gemma_add_rms_norm_replacement(x, residual, weight, eps):
    out = torch.ops.fxr.gemma_fused_add_rms_norm(x, residual, weight, eps)
    return out[0], out[1]


# The in-place kernels (sgl-kernel, flashinfer) overwrite x with the norm and residual with the
# sum; used where the matcher proves both dead after the match and neither an input nor a view.
def add_rms_norm_inplace(x, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm_(x, residual, weight, eps)
    return out[0], out[1]


def add_rms_norm_cast_last_inplace(x, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm_(x, residual, weight, eps, True)
    return out[0], out[1]


def gemma_add_rms_norm_inplace(x, residual, weight, eps):
    out = torch.ops.fxr.gemma_fused_add_rms_norm_(x, residual, weight, eps)
    return out[0], out[1]


OVERWRITES = ("x", "residual")
RMS_NORM = Rule("rms_norm", rms_norm_pattern, rms_norm_replacement, norm_guard, WILDCARDS)
ADD_RMS_NORM = Rule(
    "add_rms_norm", add_rms_norm_pattern, add_rms_norm_replacement, add_norm_guard, WILDCARDS,
    inplace=InPlace(add_rms_norm_inplace, OVERWRITES),
)  # fmt: skip

ADD_RMS_NORM_F32_SUM = Rule(
    "add_rms_norm_f32_sum", add_rms_norm_f32_sum_pattern, add_rms_norm_replacement, add_norm_guard, WILDCARDS,
    inplace=InPlace(add_rms_norm_inplace, OVERWRITES),
)  # fmt: skip
RMS_NORM_CAST_LAST = Rule(
    "rms_norm_cast_last", rms_norm_cast_last_pattern, rms_norm_cast_last_replacement, cast_last_guard, WILDCARDS
)
ADD_RMS_NORM_CAST_LAST = Rule(
    "add_rms_norm_cast_last", add_rms_norm_cast_last_pattern, add_rms_norm_cast_last_replacement,
    add_cast_last_guard, WILDCARDS, inplace=InPlace(add_rms_norm_cast_last_inplace, OVERWRITES),
)  # fmt: skip

GEMMA_RMS_NORM = Rule("gemma_rms_norm", gemma_rms_norm_pattern, gemma_rms_norm_replacement, norm_guard, WILDCARDS)
GEMMA_ADD_RMS_NORM = Rule(
    "gemma_add_rms_norm", gemma_add_rms_norm_pattern, gemma_add_rms_norm_replacement, add_norm_guard, WILDCARDS,
    inplace=InPlace(gemma_add_rms_norm_inplace, OVERWRITES),
)  # fmt: skip

GEMMA_ADD_RMS_NORM_F32_SUM = Rule(
    "gemma_add_rms_norm_f32_sum", gemma_add_rms_norm_f32_sum_pattern, gemma_add_rms_norm_replacement,
    add_norm_guard, WILDCARDS, inplace=InPlace(gemma_add_rms_norm_inplace, OVERWRITES),
)  # fmt: skip

NO_WEIGHT = {"eps": EPS, "dtype": DTYPE}
RMS_NORM_UNWEIGHTED = Rule(
    "rms_norm_unweighted", rms_norm_unweighted_pattern, rms_norm_unweighted_replacement, cast_back_guard, NO_WEIGHT
)
# The bare norm's walk reaches its `rsqrt` at 2 of 5 operations: past it, the site is a product
# with a reciprocal root, norm-shaped, and why the rest differs (an eps clamped with `maximum`, a
# scale that is not the normed input) is worth a near miss below the config's 0.5.
NORM_SHAPED = 0.4
RMS_NORM_FLOAT32 = Rule(
    "rms_norm_float32", rms_norm_float32_pattern, rms_norm_unweighted_replacement, float32_guard, {"eps": EPS},
    near_miss_min=NORM_SHAPED,
)
ADD_RMS_NORM_UNWEIGHTED = Rule(
    "add_rms_norm_unweighted", add_rms_norm_unweighted_pattern, add_rms_norm_unweighted_replacement,
    add_unweighted_guard, NO_WEIGHT, inplace=InPlace(add_rms_norm_unweighted_inplace, OVERWRITES),
)  # fmt: skip
RMS_NORM_ROUNDED_SCALE = Rule(
    "rms_norm_rounded_scale", rms_norm_rounded_scale_pattern, rms_norm_rounded_scale_replacement, cast_back_guard,
    NO_WEIGHT,
)  # fmt: skip

# add + norm first: it contains the plain norm, which would otherwise claim its sites. Gemma
# before plain: in float32 (casts elided) the plain pattern also matches Gemma's norm, binding
# `1 + w` as its weight; the Gemma op computes that in float32 in one kernel. Weighted before
# unweighted: the unweighted pattern is the inside of every weighted one (in float32 it would
# take their norms and leave the weight's product).
RULES: list[Rule] = [
    GEMMA_ADD_RMS_NORM, GEMMA_ADD_RMS_NORM_F32_SUM, ADD_RMS_NORM, ADD_RMS_NORM_F32_SUM, ADD_RMS_NORM_CAST_LAST,
    ADD_RMS_NORM_UNWEIGHTED, GEMMA_RMS_NORM, RMS_NORM, RMS_NORM_CAST_LAST, RMS_NORM_UNWEIGHTED,
    RMS_NORM_ROUNDED_SCALE, RMS_NORM_FLOAT32,
]  # fmt: skip
