"""Gated activations on a merged gate/up tensor: SiLU-and-mul, GELU-and-mul.

``chunk(2, -1)``, ``split(d, -1)`` and ``x[..., :d]`` / ``x[..., d:]`` all canonicalize to two
slices, so one pattern per activation covers them; ``up * act(gate)`` is the same product. The
two halves may sit anywhere in a wider row, gate first: a block whose attention and MLP read the
same norm output gets q, k, v, gate and up merged into one GEMM, and its gate starts past q/k/v.

    # before (gate/up inside [q | k | v | gate | up])   # after
    gate = y[..., 768:1280]                             h = torch.ops.fxr.silu_and_mul(y[..., 768:1792])
    up = y[..., 1280:1792]
    h = F.silu(gate) * up

After them, ``act(a) * b`` of any two tensors of one shape (not the halves of one row:
a Mamba mixer's output gate, a recurrent block's GELU branch, a per-layer input gate) becomes
``fxr.act_mul``, one elementwise pass where eager writes the activation out and reads it back
(two float dtypes too: the activation in the gate's, the product in the promoted one):

    # before                                            # after
    y = scan_output * F.silu(gate)                      y = torch.ops.fxr.act_mul(gate, scan_output, "silu", False)
    y = F.silu(gate) * up                               y = torch.ops.fxr.act_mul(gate, up, "silu", True)

The product's operand order is an argument of the op: eager gives the product the layout of its
first operand where the two differ ([B, D, L] scan output times a gate chunked off a transposed
projection), and the op gives the same. A broadcast operand ([T, 1], [D]) is left as written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite import meta
from fxrewrite.rule import COMPLETE, NOT_A_SITE, Bindings, Rule, Scalar, all_of

BOUNDS = {name: Scalar(int) for name in ("a", "b", "e")}


def halves_guard(b: Bindings) -> bool | str:
    """``x[..., a:b]`` and ``x[..., b:e]`` are two equal, adjacent, non-empty halves of a row."""
    last = b["x"].shape[-1]
    start, mid, end = b["a"], b["b"], min(b["e"], last)
    if not 0 <= start < mid < end:
        return f"slices [{start}:{mid}] and [{mid}:{b['e']}] of the last dim are not in order"
    if mid - start != end - mid:
        return f"gate [{start}:{mid}] and up [{mid}:{end}] differ in width (last dim {last})"
    return True


# silu(x[..., a:b]) * x[..., b:e] -> fxr.silu_and_mul(x[..., a:e])  (the slice goes when it is all of x)
def silu_and_mul_pattern(x, a, b, e):
    return F.silu(x[..., a:b]) * x[..., b:e]


def silu_and_mul_replacement(x, a, e):
    return torch.ops.fxr.silu_and_mul(x[..., a:e])


# gelu(x[..., a:b]) * x[..., b:e] -> fxr.gelu_and_mul(x[..., a:e])  (erf form)
def gelu_and_mul_pattern(x, a, b, e):
    return F.gelu(x[..., a:b]) * x[..., b:e]


def gelu_and_mul_replacement(x, a, e):
    return torch.ops.fxr.gelu_and_mul(x[..., a:e])


# gelu(x[..., a:b], approximate="tanh") * x[..., b:e] -> fxr.gelu_and_mul(x[..., a:e], "tanh")
def gelu_tanh_and_mul_pattern(x, a, b, e):
    return F.gelu(x[..., a:b], approximate="tanh") * x[..., b:e]


def gelu_tanh_and_mul_replacement(x, a, e):
    return torch.ops.fxr.gelu_and_mul(x[..., a:e], "tanh")


SILU_AND_MUL = Rule("silu_and_mul", silu_and_mul_pattern, silu_and_mul_replacement, halves_guard, BOUNDS)

GELU_AND_MUL = Rule("gelu_and_mul", gelu_and_mul_pattern, gelu_and_mul_replacement, halves_guard, BOUNDS)
GELU_TANH_AND_MUL = Rule(
    "gelu_tanh_and_mul", gelu_tanh_and_mul_pattern, gelu_tanh_and_mul_replacement, halves_guard, BOUNDS
)



def same_operands(b: Bindings) -> bool | str:
    """``a`` and ``b`` of one shape (no broadcasting), both floating point: of two float dtypes
    the product is the promoted one, computed as eager computes it (a bf16 gate times a float32
    scan output)."""
    x, y = b["a"], b["b"]
    if not meta.sizes_match(x, y):
        return f"operand shapes {tuple(x.shape)} and {tuple(y.shape)} differ (broadcast)"
    if not (x.dtype.is_floating_point and y.dtype.is_floating_point):
        return f"operand dtypes {x.dtype} and {y.dtype}: not both floating point"
    return True


def act_first(b: Bindings) -> bool | str:
    """The graph's product reads the activation first (``act(a) * b``)."""
    return b.anchor is None or b.anchor.args[0] is not b.node("b") or NOT_A_SITE


def act_second(b: Bindings) -> bool | str:
    """The graph's product reads the activation second (``b * act(a)``)."""
    return b.anchor is not None and b.anchor.args[0] is b.node("b") or NOT_A_SITE


# silu(a) * b -> fxr.act_mul(a, b, "silu", True)  (a, b: one shape, floats; after the one-tensor rules; the
# order spelled out, as in the twin, so that a rule on top of act_mul binds it with one pattern)
def silu_mul_pattern(a, b):
    return F.silu(a) * b


def silu_mul_replacement(a, b):
    return torch.ops.fxr.act_mul(a, b, "silu", True)


# b * silu(a) -> fxr.act_mul(a, b, "silu", False)  (the product's layout follows b's, as eager's does)
def silu_mul_reversed_replacement(a, b):
    return torch.ops.fxr.act_mul(a, b, "silu", False)


# gelu(a) * b -> fxr.act_mul(a, b, "gelu", True)  (erf form)
def gelu_mul_pattern(a, b):
    return F.gelu(a) * b


def gelu_mul_replacement(a, b):
    return torch.ops.fxr.act_mul(a, b, "gelu", True)


# b * gelu(a) -> fxr.act_mul(a, b, "gelu", False)
def gelu_mul_reversed_replacement(a, b):
    return torch.ops.fxr.act_mul(a, b, "gelu", False)


# gelu(a, approximate="tanh") * b -> fxr.act_mul(a, b, "gelu_tanh", True)
def gelu_tanh_mul_pattern(a, b):
    return F.gelu(a, approximate="tanh") * b


def gelu_tanh_mul_replacement(a, b):
    return torch.ops.fxr.act_mul(a, b, "gelu_tanh", True)


# b * gelu(a, approximate="tanh") -> fxr.act_mul(a, b, "gelu_tanh", False)
def gelu_tanh_mul_reversed_replacement(a, b):
    return torch.ops.fxr.act_mul(a, b, "gelu_tanh", False)


# One rule per operand order (commutative matching takes both; the guard reads the graph's). The
# act-first rule reports the near misses of either order, only where the structure matched and a
# check refused (operands checked before the order; a product that merely reads some other
# value is no near miss of a two-op pattern); its twin reports none.
FIRST, SECOND = all_of(same_operands, act_first), all_of(same_operands, act_second)
SILENT = 2.0  # a near_miss_min above any progress
SILU_MUL = Rule("silu_mul", silu_mul_pattern, silu_mul_replacement, FIRST, near_miss_min=COMPLETE)
SILU_MUL_REVERSED = Rule("silu_mul_reversed", silu_mul_pattern, silu_mul_reversed_replacement, SECOND, near_miss_min=SILENT)
GELU_MUL = Rule("gelu_mul", gelu_mul_pattern, gelu_mul_replacement, FIRST, near_miss_min=COMPLETE)
GELU_MUL_REVERSED = Rule("gelu_mul_reversed", gelu_mul_pattern, gelu_mul_reversed_replacement, SECOND, near_miss_min=SILENT)
GELU_TANH_MUL = Rule("gelu_tanh_mul", gelu_tanh_mul_pattern, gelu_tanh_mul_replacement, FIRST, near_miss_min=COMPLETE)
GELU_TANH_MUL_REVERSED = Rule(
    "gelu_tanh_mul_reversed", gelu_tanh_mul_pattern, gelu_tanh_mul_reversed_replacement, SECOND, near_miss_min=SILENT
)

ONE_TENSOR_RULES: list[Rule] = [SILU_AND_MUL, GELU_AND_MUL, GELU_TANH_AND_MUL]
TWO_TENSOR_RULES: list[Rule] = [SILU_MUL, SILU_MUL_REVERSED, GELU_MUL, GELU_MUL_REVERSED, GELU_TANH_MUL,
                                GELU_TANH_MUL_REVERSED]  # fmt: skip
# The halves of one row first: act_mul would take them too, as two operands.
RULES: list[Rule] = ONE_TENSOR_RULES + TWO_TENSOR_RULES
