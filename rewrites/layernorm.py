"""LayerNorm rules: the library call, LayerNorm written out, and the residual add before it.

Model code writes LayerNorm in more ways than one pattern per way could list: the library call
(``nn.LayerNorm``, ``F.layer_norm``, ``torch.layer_norm``: one form after canonicalization) or
the computation by hand (the variance as the mean of squared deviations, the deviation written
once or twice, or ``var(unbiased=False)``); weight and bias present or not; in float32 with the
cast back to the input dtype before the weight (DeBERTa's order) or after it (Cohere's); a
residual add before it whose sum is read later (pre-norm) or not (post-norm). So the rules are
steps, each a pattern over model code or over the op an earlier step produced, in the order
:data:`RULES` lists them::

    # Cohere, bf16                                       # after each step
    h = x.to(torch.float32)
    m = h.mean(-1, keepdim=True)
    v = (h - m).pow(2).mean(-1, keepdim=True)
    y = (h - m) * torch.rsqrt(v + eps)                   y = fxr.layer_norm(h, None, None, eps)     layer_norm_mean_sq
    y = w.to(torch.float32) * y                          y = fxr.layer_norm(h, w, None, eps, False) layer_norm_weight
    y = y.to(x.dtype)                                    y = fxr.layer_norm(x, w, None, eps)        layer_norm_cast

and ``fxr.layer_norm(x + r, ...)`` becomes ``fxr.fused_add_layer_norm(x, r, ...)`` (in place where
the matcher proves it safe). Each step computes exactly what it replaces (the op's
``cast_last`` flag says where the rounding to the input dtype falls: see
``runtime/ops/layernorm.py``), so a step that does not apply leaves a correct, partly fused graph:
its near miss says why where the structure matched and a check refused it.

The rules run before the RMSNorm rules (``rewrites/__init__.py``): a LayerNorm's second half
is an RMSNorm of the centered input, which they would otherwise take.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite import meta
from fxrewrite.meta import dim_key, same_sizes
from fxrewrite.rewrites.norm import DTYPE, EPS
from fxrewrite.rule import COMPLETE, NOT_A_SITE, Bindings, InPlace, Rule, Scalar, all_of
from fxrewrite.runtime.ops.layernorm import out_dtype

HALF = (torch.bfloat16, torch.float16)
CAST_LAST = Scalar(bool)
AFFINE = ("weight", "bias")  # optional: absent as None
# A step that extends the op an earlier step fused reports only complete matches a check refused.
EXTENDS = COMPLETE


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _vector(b: Bindings, name: str, x: torch.Tensor) -> str | None:
    """None when ``b[name]`` is absent or a floating ``[hidden]`` vector of ``x``'s last dim;
    :data:`NOT_A_SITE` for an operand of ``x``'s own shape (a gate, the next residual add)."""
    t = b[name]
    if t is None:
        return None
    if t.dim() > 1 and same_sizes(t, x):
        return NOT_A_SITE
    if not t.dtype.is_floating_point:
        return f"{name} dtype {_short(t.dtype)} is not floating point"
    if t.dim() != 1 or dim_key(t.shape[0]) != dim_key(x.shape[-1]):
        return f"{name} shape {tuple(t.shape)} != normalized dim {tuple(x.shape[-1:])}"
    return None


def _affine(b: Bindings) -> str | None:
    """Each of weight and bias the pattern binds: absent or a ``[hidden]`` vector."""
    x = b["x"]
    return next((why for name in AFFINE if name in b and (why := _vector(b, name, x))), None)


# -- the library call --------------------------------------------------------------------------


# F.layer_norm(x, (n,), weight?, bias?, eps) -> fxr.layer_norm(x, weight, bias, eps)
def layer_norm_pattern(x, shape, weight, bias, eps):
    return torch.ops.aten.layer_norm.default(x, shape, weight, bias, eps, True)


def layer_norm_replacement(x, weight, bias, eps):
    return torch.ops.fxr.layer_norm(x, weight, bias, eps, True)


def layer_norm_guard(b: Bindings) -> bool | str:
    """One normalized dim, the last; floating input; weight and bias ``[hidden]`` vectors."""
    x, shape = b["x"], b["shape"]
    if not x.dtype.is_floating_point:
        return f"input dtype {_short(x.dtype)} is not floating point"
    if not isinstance(shape, (list, tuple)):
        return f"normalized shape `{getattr(shape, 'name', shape)}` is not a list of sizes"
    sizes = [meta.value(d) if isinstance(d, fx.Node) else d for d in shape]  # symbolic sizes are nodes
    if len(sizes) != 1:
        return f"normalizes over {len(sizes)} dims {sizes}: the op normalizes the last"
    if dim_key(sizes[0]) != dim_key(x.shape[-1]):
        return f"normalized shape {sizes} != last dim {x.shape[-1]}"
    return _affine(b) or True


# -- written out: (h - mean) * rsqrt(variance + eps) ---------------------------------------------


# (h - m) * rsqrt(mean((h - m)^2) + eps), the deviation written twice -> fxr.layer_norm(h, None, None, eps)
def mean_sq_pattern(x, eps):
    m = x.mean(-1, keepdim=True)
    return (x - m) * torch.rsqrt((x - m).pow(2).mean(-1, keepdim=True) + eps)


# d = h - mean(h); d * rsqrt(mean(d^2) + eps) -> fxr.layer_norm(h, None, None, eps)
def mean_sq_once_pattern(x, eps):
    d = x - x.mean(-1, keepdim=True)
    return d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps)


# (h - mean(h)) * rsqrt(h.var(-1, unbiased=False) + eps) -> fxr.layer_norm(h, None, None, eps)
def var_pattern(x, eps):
    return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True, correction=0) + eps)


def written_replacement(x, eps):
    return torch.ops.fxr.layer_norm(x, None, None, eps, True)


def written_guard(b: Bindings) -> bool | str:
    """Computed in float32 (or float64), as the op computes it."""
    x = b["x"]
    if not x.dtype.is_floating_point or x.element_size() < 4:
        return f"computed in {_short(x.dtype)}: the op computes in float32 and rounds once"
    return True


# -- steps over the fused op ---------------------------------------------------------------------


def wide(b: Bindings) -> bool | str:
    """The norm computed in float32 (or float64): a weight or bias step before the cast back.
    Its twin after the cast (``*_rounded``) takes the half inputs: each site is one rule's."""
    return True if b["x"].dtype not in HALF else NOT_A_SITE


def rounded(b: Bindings) -> bool | str:
    """The norm rounded to a half dtype: the step after the cast back."""
    return True if b["x"].dtype in HALF else NOT_A_SITE


def affine_guard(b: Bindings) -> bool | str:
    return _affine(b) or True


# fxr.layer_norm(x, None, None, eps) * weight -> fxr.layer_norm(x, weight, None, eps, False): rounded
# to x's dtype (a no-op in float32), then scaled, as the graph computes it
def weight_pattern(x, weight, eps, cast_last):
    return torch.ops.fxr.layer_norm(x, None, None, eps, cast_last) * weight


def weight_replacement(x, weight, eps):
    return torch.ops.fxr.layer_norm(x, weight, None, eps, False)


# fxr.layer_norm(x, weight?, None, eps) + bias -> fxr.layer_norm(x, weight, bias, eps, False)
def bias_pattern(x, weight, bias, eps, cast_last):
    return torch.ops.fxr.layer_norm(x, weight, None, eps, cast_last) + bias


def bias_replacement(x, weight, bias, eps):
    return torch.ops.fxr.layer_norm(x, weight, bias, eps, False)


def rounded_bias_guard(b: Bindings) -> bool | str:
    """Not after a weight applied before the rounding to the half dtype (the op rounds once
    after both, or before both)."""
    if b["cast_last"] and b["weight"] is not None:
        return f"scaled in float32 before the rounding to {_short(b['x'].dtype)}, shifted after it"
    return True


# fxr.layer_norm(x.float(), weight?, bias?, eps).to(x.dtype) -> fxr.layer_norm(x, weight, bias, eps):
# computed in float32, rounded once
def cast_pattern(x, weight, bias, eps, cast_last, dtype):
    return torch.ops.fxr.layer_norm(x.to(torch.float32), weight, bias, eps, cast_last).to(dtype)


def cast_replacement(x, weight, bias, eps):
    return torch.ops.fxr.layer_norm(x, weight, bias, eps, True)


def cast_guard(b: Bindings) -> bool | str:
    """A half input, cast back to its own dtype (in float32 the casts are elided: nothing to do)."""
    x = b["x"]
    if x.dtype not in HALF:
        return f"input {_short(x.dtype)}: no cast to take in"
    if b["dtype"] != x.dtype:
        return f"casts back to {_short(b['dtype'])}, input is {_short(x.dtype)}"
    return True


# s = x + residual; fxr.layer_norm(s, weight?, bias?, eps); both used -> fxr.fused_add_layer_norm(x, residual, ...)
def add_layer_norm_pattern(x, residual, weight, bias, eps, cast_last):
    s = x + residual
    return torch.ops.fxr.layer_norm(s, weight, bias, eps, cast_last), s


def add_layer_norm_replacement(x, residual, weight, bias, eps, cast_last):
    out = torch.ops.fxr.fused_add_layer_norm(x, residual, weight, bias, eps, cast_last)
    return out[0], out[1]


# The Triton kernel overwrites x with the norm and residual with the sum; used where the matcher
# proves both dead after the match and neither an input nor a view.
def add_layer_norm_inplace(x, residual, weight, bias, eps, cast_last):
    out = torch.ops.fxr.fused_add_layer_norm_(x, residual, weight, bias, eps, cast_last)
    return out[0], out[1]


def add_layer_norm_guard(b: Bindings) -> bool | str:
    """``x`` and ``residual`` of one dtype and shape, and a normed value of that dtype (the in-place
    kernel writes it over ``x``)."""
    x, r = b["x"], b["residual"]
    if x.dtype != r.dtype or not same_sizes(x, r):
        return f"residual {_short(r.dtype)}{tuple(r.shape)} != input {_short(x.dtype)}{tuple(x.shape)}"
    if (dtype := out_dtype(x, b["weight"], b["bias"], b["cast_last"])) != x.dtype:
        return f"the normed value is {_short(dtype)}, the input {_short(x.dtype)}"
    return True


WRITTEN = {"eps": EPS}
OVER_OP = {"eps": Scalar(float), "cast_last": CAST_LAST}

LAYER_NORM = Rule("layer_norm", layer_norm_pattern, layer_norm_replacement, layer_norm_guard,
                  {"eps": Scalar(float), "shape": Scalar()}, optional=AFFINE)  # fmt: skip
LAYER_NORM_MEAN_SQ = Rule("layer_norm_mean_sq", mean_sq_pattern, written_replacement, written_guard, WRITTEN)
LAYER_NORM_MEAN_SQ_ONCE = Rule("layer_norm_mean_sq_once", mean_sq_once_pattern, written_replacement, written_guard,
                               WRITTEN)  # fmt: skip
LAYER_NORM_VAR = Rule("layer_norm_var", var_pattern, written_replacement, written_guard, WRITTEN)
LAYER_NORM_WEIGHT = Rule("layer_norm_weight", weight_pattern, weight_replacement, all_of(wide, affine_guard), OVER_OP,
                         near_miss_min=EXTENDS)  # fmt: skip
LAYER_NORM_BIAS = Rule("layer_norm_bias", bias_pattern, bias_replacement, all_of(wide, affine_guard), OVER_OP,
                       optional=("weight",), near_miss_min=EXTENDS)  # fmt: skip
LAYER_NORM_WEIGHT_ROUNDED = Rule("layer_norm_weight_rounded", weight_pattern, weight_replacement,
                                 all_of(rounded, affine_guard), OVER_OP, near_miss_min=EXTENDS)  # fmt: skip
LAYER_NORM_BIAS_ROUNDED = Rule("layer_norm_bias_rounded", bias_pattern, bias_replacement,
                               all_of(rounded, rounded_bias_guard, affine_guard), OVER_OP, optional=("weight",),
                               near_miss_min=EXTENDS)  # fmt: skip
# No near misses at all: in float32 every site matches with both casts elided, and the guard
# turns it down; where it turns a half site down, the norm is fused and one cast is left.
LAYER_NORM_CAST = Rule("layer_norm_cast", cast_pattern, cast_replacement, cast_guard, {**OVER_OP, "dtype": DTYPE},
                       optional=AFFINE, near_miss_min=float("inf"))  # fmt: skip
ADD_LAYER_NORM = Rule(
    "add_layer_norm", add_layer_norm_pattern, add_layer_norm_replacement, add_layer_norm_guard, OVER_OP,
    inplace=InPlace(add_layer_norm_inplace, ("x", "residual")), optional=AFFINE, near_miss_min=EXTENDS,
)  # fmt: skip

# Weight and bias are taken in before the cast back (Cohere scales in float32, then rounds) and
# after it (DeBERTa rounds, then scales): one pair of steps each side of the cast. The add last:
# it extends the op whatever the steps before made of it.
RULES: list[Rule] = [
    LAYER_NORM, LAYER_NORM_MEAN_SQ, LAYER_NORM_MEAN_SQ_ONCE, LAYER_NORM_VAR,
    LAYER_NORM_WEIGHT, LAYER_NORM_BIAS, LAYER_NORM_CAST, LAYER_NORM_WEIGHT_ROUNDED, LAYER_NORM_BIAS_ROUNDED,
    ADD_LAYER_NORM,
]  # fmt: skip
