"""Gated activations on a merged gate/up tensor: SiLU-and-mul, GELU-and-mul.

``chunk(2, -1)``, ``split(d, -1)`` and ``x[..., :d]`` / ``x[..., d:]`` all canonicalize to two
slices, so one pattern per activation covers them; ``up * act(gate)`` is the same product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.rule import Bindings, Rule, Scalar

HALF = {"d": Scalar(int, lambda v: v > 0)}


def halves_guard(b: Bindings) -> bool | str:
    """The two slices are exactly the two halves of the last dim."""
    last = b["x"].shape[-1]
    if last != 2 * b["d"]:
        return f"slices at {b['d']} do not halve the last dim {last}"
    return True


# silu(x[..., :d]) * x[..., d:] -> fxr.silu_and_mul(x)
def silu_and_mul_pattern(x, d):
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul_replacement(x):
    return torch.ops.fxr.silu_and_mul(x)


# gelu(x[..., :d]) * x[..., d:] -> fxr.gelu_and_mul(x)  (erf form)
def gelu_and_mul_pattern(x, d):
    return F.gelu(x[..., :d]) * x[..., d:]


def gelu_and_mul_replacement(x):
    return torch.ops.fxr.gelu_and_mul(x)


# gelu(x[..., :d], approximate="tanh") * x[..., d:] -> fxr.gelu_and_mul(x, "tanh")
def gelu_tanh_and_mul_pattern(x, d):
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def gelu_tanh_and_mul_replacement(x):
    return torch.ops.fxr.gelu_and_mul(x, "tanh")


SILU_AND_MUL = Rule("silu_and_mul", silu_and_mul_pattern, silu_and_mul_replacement, halves_guard, HALF)

GELU_AND_MUL = Rule("gelu_and_mul", gelu_and_mul_pattern, gelu_and_mul_replacement, halves_guard, HALF)
GELU_TANH_AND_MUL = Rule(
    "gelu_tanh_and_mul", gelu_tanh_and_mul_pattern, gelu_tanh_and_mul_replacement, halves_guard, HALF
)

RULES: list[Rule] = [SILU_AND_MUL, GELU_AND_MUL, GELU_TANH_AND_MUL]
