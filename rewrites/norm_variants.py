"""Norm variants: the L2 norm by a sum, and RMSNorm with a gate.

L2: ``x * rsqrt(sum(x^2) + eps)`` over the last dim, in float32 (the linear-attention layers'
q/k normalization; ``x / sqrt(..)`` canonicalizes to it), becomes ``fxr.l2_norm``.

Gated RMSNorm, in the orders model code writes it:

    # norm, weight, gate (Qwen3-Next, Qwen3.5, OLMo-hybrid)   # after
    h = w * norm(x.float()).to(dtype)                          y = torch.ops.fxr.rms_norm_gated(x, z, w, eps)
    y = (h * F.silu(z.float())).to(dtype)

    # the same scaled in float32 (w.float() * norm), a sigmoid gate (Kimi-linear)
    y = ((w * norm(x.float())) * torch.sigmoid(z.float())).to(dtype)   -> rms_norm_gated(x, z, w, eps, None, False, "sigmoid", True)

    # gate first, norm over groups of the row (Mamba2: Bamba, GraniteMoE-hybrid, Nemotron-H)
    h = x.float() * F.silu(z.float())
    g = h.view(*lead, n // G, G)                               y = torch.ops.fxr.rms_norm_gated(x, z, w, eps, G, True)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    y = w * g.view(*lead, n).to(dtype)

    # gate first, norm over the whole row, no reshapes (Mamba2's norm in transformers 5.17)
    h = x.float() * F.silu(z.float())                          y = torch.ops.fxr.rms_norm_gated(x, z, w, eps, None, True)
    y = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

The reshapes of the grouped form bind their size lists whole (``Scalar(list)``), whichever
canonical spelling the graph has (the split into groups is ``aten.unflatten(h, -1, [-1, G])``,
the join ``aten.flatten(g, -2, -1)``, one group of the whole row a reshape to ``[..., 1, n]``:
the matcher reads each as the reshape's sizes, ``canonicalize_shape.reshape_sizes``); the guard
checks that they split the last dim into groups and join it back, and the replacement reads the
group size from the list. These rules run before the plain RMSNorm rules, which would take the
norm inside each and leave the gate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite import meta
from fxrewrite.canonicalize import RESHAPE
from fxrewrite.meta import dim_key, same_sizes
from fxrewrite.rewrites.norm import (
    DTYPE, EPS, cast_back_guard, cast_last_guard, float32_guard, norm_guard, normed,
)  # fmt: skip
from fxrewrite.rule import Bindings, Rule, Scalar

SIZES = Scalar(list)
GATED = {"eps": EPS, "dtype": DTYPE}  # the L2 norm's wildcards too
GROUPED = {**GATED, "groups": SIZES, "ungroups": SIZES}


# x.float() * rsqrt(sum(x^2) + eps), cast back -> fxr.l2_norm(x, eps)
def l2_norm_pattern(x, eps, dtype):
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + eps)).to(dtype)


def l2_norm_replacement(x, eps):
    return torch.ops.fxr.l2_norm(x, eps)


# x * rsqrt(sum(x^2) + eps) of a float32 x, left in float32 (x the upcast of a narrower input) -> fxr.l2_norm(x, eps)
def l2_norm_float32_pattern(x, eps):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


# ------------------------------------------------------------------------------- gated RMSNorm


def gate_guard(b: Bindings) -> bool | str:
    """The gate is of the input's shape (no broadcasting)."""
    if not same_sizes(b["gate"], b["x"]):
        return f"gate shape {tuple(b['gate'].shape)} != input shape {tuple(b['x'].shape)}"
    return True


def gated_guard(b: Bindings) -> bool | str:
    return norm_guard(b) if (why := gate_guard(b)) is True else why


def gated_cast_last_guard(b: Bindings) -> bool | str:
    return cast_last_guard(b) if (why := gate_guard(b)) is True else why


def _sizes(values: list) -> list:
    """A reshape's size list as comparable keys: ints, symbolic expressions of size nodes and
    of SymInts (a flatten's or unflatten's sizes read from its input's shape)."""
    return [dim_key(meta.value(v) if isinstance(v, torch.fx.Node) else v) for v in values]


def groups_guard(b: Bindings) -> bool | str:
    """:func:`gated_guard`, and the reshapes view ``x``'s ``[..., n]`` as ``[..., n / G, G]``
    and back (leading dims kept; one ``-1`` allowed where a size is implied)."""
    if (why := gated_guard(b)) is not True:
        return why
    x = b["x"]
    n, lead = x.shape[-1], [dim_key(d) for d in x.shape[:-1]]
    groups, ungroups = _sizes(b["groups"]), _sizes(b["ungroups"])
    if not isinstance(n, int):
        return f"normalized dim {n} is symbolic"
    size = groups[-1] if groups else None
    if not (isinstance(size, int) and size > 0 and n % size == 0):
        return f"group size {size} does not divide the normalized dim {n}"
    if groups[:-2] != lead or groups[-2] not in (n // size, -1):
        return f"reshape to {groups} does not split the last dim of {tuple(x.shape)} into groups"
    if ungroups[:-1] != lead or ungroups[-1] not in (n, -1):
        return f"reshape to {ungroups} does not join the groups back into {tuple(x.shape)}"
    return True


# norm, weight, silu gate: (w * norm(x).to(dtype) * silu(gate.float())).to(dtype) -> fxr.rms_norm_gated(x, gate, weight, eps)
def rms_norm_gated_pattern(x, gate, weight, eps, dtype):
    y = weight * normed(x, eps).to(dtype)
    return (y * F.silu(gate.to(torch.float32))).to(dtype)


def rms_norm_gated_replacement(x, gate, weight, eps):
    return torch.ops.fxr.rms_norm_gated(x, gate, weight, eps)


# the same with a sigmoid gate -> fxr.rms_norm_gated(x, gate, weight, eps, None, False, "sigmoid")
def rms_norm_gated_sigmoid_pattern(x, gate, weight, eps, dtype):
    y = weight * normed(x, eps).to(dtype)
    return (y * torch.sigmoid(gate.to(torch.float32))).to(dtype)


def rms_norm_gated_sigmoid_replacement(x, gate, weight, eps):
    return torch.ops.fxr.rms_norm_gated(x, gate, weight, eps, None, False, "sigmoid")


# scaled in float32: (w * norm(x) * silu(gate.float())).to(dtype) -> fxr.rms_norm_gated(x, gate, weight, eps, None, False, "silu", True)
def rms_norm_gated_cast_last_pattern(x, gate, weight, eps, dtype):
    return (weight * normed(x, eps) * F.silu(gate.to(torch.float32))).to(dtype)


def rms_norm_gated_cast_last_replacement(x, gate, weight, eps):
    return torch.ops.fxr.rms_norm_gated(x, gate, weight, eps, None, False, "silu", True)


# the same with a sigmoid gate -> fxr.rms_norm_gated(x, gate, weight, eps, None, False, "sigmoid", True)
def rms_norm_gated_sigmoid_cast_last_pattern(x, gate, weight, eps, dtype):
    return (weight * normed(x, eps) * torch.sigmoid(gate.to(torch.float32))).to(dtype)


def rms_norm_gated_sigmoid_cast_last_replacement(x, gate, weight, eps):
    return torch.ops.fxr.rms_norm_gated(x, gate, weight, eps, None, False, "sigmoid", True)


def gated_first(x, gate):
    """The gate applied before the norm, in float32."""
    return x.to(torch.float32) * F.silu(gate.to(torch.float32))


# gate first, norm over groups: w * group_norm(x.float() * silu(gate.float())).to(dtype)
#   -> fxr.rms_norm_gated(x, gate, weight, eps, G, True)
def rms_norm_gated_groups_pattern(x, gate, weight, eps, dtype, groups, ungroups):
    h = RESHAPE(gated_first(x, gate), groups)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * RESHAPE(h, ungroups).to(dtype)


def rms_norm_gated_groups_replacement(x, gate, weight, eps, groups):
    return torch.ops.fxr.rms_norm_gated(x, gate, weight, eps, groups[-1], True)


# gate first, norm over the whole row (no reshapes): w * norm(x.float() * silu(gate.float())).to(dtype)
#   -> fxr.rms_norm_gated(x, gate, weight, eps, None, True)
def rms_norm_gated_first_pattern(x, gate, weight, eps, dtype):
    h = gated_first(x, gate)
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def rms_norm_gated_first_replacement(x, gate, weight, eps):
    return torch.ops.fxr.rms_norm_gated(x, gate, weight, eps, None, True)


RMS_NORM_GATED_FIRST = Rule(
    "rms_norm_gated_first", rms_norm_gated_first_pattern, rms_norm_gated_first_replacement, gated_guard, GATED
)
RMS_NORM_GATED = Rule("rms_norm_gated", rms_norm_gated_pattern, rms_norm_gated_replacement, gated_guard, GATED)
RMS_NORM_GATED_SIGMOID = Rule(
    "rms_norm_gated_sigmoid", rms_norm_gated_sigmoid_pattern, rms_norm_gated_sigmoid_replacement, gated_guard, GATED
)
RMS_NORM_GATED_CAST_LAST = Rule(
    "rms_norm_gated_cast_last", rms_norm_gated_cast_last_pattern, rms_norm_gated_cast_last_replacement,
    gated_cast_last_guard, GATED,
)  # fmt: skip
RMS_NORM_GATED_SIGMOID_CAST_LAST = Rule(
    "rms_norm_gated_sigmoid_cast_last", rms_norm_gated_sigmoid_cast_last_pattern,
    rms_norm_gated_sigmoid_cast_last_replacement, gated_cast_last_guard, GATED,
)  # fmt: skip
RMS_NORM_GATED_GROUPS = Rule(
    "rms_norm_gated_groups", rms_norm_gated_groups_pattern, rms_norm_gated_groups_replacement, groups_guard, GROUPED
)
L2_NORM = Rule("l2_norm", l2_norm_pattern, l2_norm_replacement, cast_back_guard, GATED)
L2_NORM_FLOAT32 = Rule("l2_norm_float32", l2_norm_float32_pattern, l2_norm_replacement, float32_guard, {"eps": EPS})

# Before rewrites/norm.py's rules (the pipeline's fuse_norm runs these first): each gated pattern
# holds a plain RMSNorm. In float32 (casts elided) the rounding orders are one computation: the
# first of each pair takes it.
RULES: list[Rule] = [
    RMS_NORM_GATED_GROUPS, RMS_NORM_GATED_FIRST, RMS_NORM_GATED, RMS_NORM_GATED_SIGMOID, RMS_NORM_GATED_CAST_LAST,
    RMS_NORM_GATED_SIGMOID_CAST_LAST, L2_NORM, L2_NORM_FLOAT32,
]  # fmt: skip
