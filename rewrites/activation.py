"""Gated activations on a merged gate/up tensor: SiLU-and-mul, GELU-and-mul.

``chunk(2, -1)``, ``split(d, -1)`` and ``x[..., :d]`` / ``x[..., d:]`` all canonicalize to two
slices, so one pattern per activation covers them; ``up * act(gate)`` is the same product. The
two halves may sit anywhere in a wider row, gate first: a block whose attention and MLP read the
same norm output gets q, k, v, gate and up merged into one GEMM, and its gate starts past q/k/v.

    # before (gate/up inside [q | k | v | gate | up])   # after
    gate = y[..., 768:1280]                             h = torch.ops.fxr.silu_and_mul(y[..., 768:1792])
    up = y[..., 1280:1792]
    h = F.silu(gate) * up
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.rule import Bindings, Rule, Scalar

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

RULES: list[Rule] = [SILU_AND_MUL, GELU_AND_MUL, GELU_TANH_AND_MUL]
