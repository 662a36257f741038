"""Linears become ``fxr.linear``, which picks the GEMM by the number of rows at run time.

    %y = aten.linear(%x, %w, %b)      ->      %y = fxr.linear(%x, %w, %b)

``nn.Linear``, ``F.linear`` and the merged projections of ``merge_siblings`` all canonicalize to
``aten.linear``; a missing bias is bound as ``None``, so one rule without and one with a bias
cover them. The op serves every dtype and shape (:mod:`fxrewrite.runtime.ops.linear`): the rule
runs last, after every rule whose pattern holds a linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.rule import Bindings, Rule


def matrix_weight(b: Bindings) -> bool | str:
    """``F.linear`` also takes a 1-D weight (a dot product); the op's kernels take matrices."""
    return True if b["w"].dim() == 2 else f"weight is {b['w'].dim()}-D, not a matrix"


# linear(x, w) -> fxr.linear(x, w)
def linear_pattern(x, w):
    return F.linear(x, w)


def linear_replacement(x, w):
    return torch.ops.fxr.linear(x, w)


# linear(x, w, b) -> fxr.linear(x, w, b)
def linear_bias_pattern(x, w, b):
    return F.linear(x, w, b)


def linear_bias_replacement(x, w, b):
    return torch.ops.fxr.linear(x, w, b)


LINEAR = Rule("linear", linear_pattern, linear_replacement, matrix_weight)
LINEAR_BIAS = Rule("linear_bias", linear_bias_pattern, linear_bias_replacement, matrix_weight)

RULES: list[Rule] = [LINEAR, LINEAR_BIAS]
