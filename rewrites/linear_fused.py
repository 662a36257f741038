"""The decode step's norms and residual adds moved into the GEMMs around them.

After ``fuse_norm`` a pre-norm decoder layer reads, per residual add::

    %o = aten.linear(%attn, %w_o)                          # o_proj (or down_proj)
    %n, %s = fxr.fused_add_rms_norm_(%o, %r, %g, eps)      # r += o; n = norm(r)
    %y = aten.linear(%n, %w_qkv)                           # the next GEMM (gate_up: + silu_and_mul)

Two passes make that two kernels at decode sizes instead of three. ``fuse_gemm_residual`` splits
the add from the norm and gives it to the GEMM that produces the addend (its epilogue); then
``fuse_gemm_norm`` gives every RMSNorm read only by a GEMM to that GEMM (its prologue: the row's
sum of squares in the k loop, the norm weight on the A tiles, the per-row scale at the end)::

    %s = fxr.linear_add_(%attn, %w_o, %r)                  # r += attn @ w_o.T
    %y = fxr.rms_norm_linear(%s, %g, eps, %w_qkv)          # (or rms_norm_linear_silu_and_mul)

The add goes in place (``linear_add_``) where the matcher proves the residual dead after the
match (always, where ``fuse_norm`` chose the in-place add + norm), else into a new tensor. Both
passes run where ``select_gemm`` runs (graphs replayed as CUDA graphs) and before it: the plain
linears left are its. Above ``SKINNY_ROWS`` rows each op runs the kernels it replaces
(:mod:`fxrewrite.runtime.ops.linear_fused`). The norm patterns name the spellings the norm rules
produce: ``fxr.rms_norm(x, g, eps)`` (``g`` may be None) and its ``cast_last`` form
``fxr.rms_norm(x, g, eps, True)``; the add + norm patterns read the functional and the in-place
op, the GEMM's output as either operand of the sum. A norm whose output has other readers, a GEMM with a bias before the add, a sum of other
dtypes or shapes stay as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.meta import dim_key
from fxrewrite.rewrites.norm import EPS
from fxrewrite.rewrites.linear import gate_up_weight, matrix_weight
from fxrewrite.rule import COMPLETE, Bindings, InPlace, Rule

SCALARS = {"eps": EPS}


def residual_guard(b: Bindings) -> bool | str:
    """The GEMM's output and the residual are one dtype and shape (the epilogue adds without
    promoting or broadcasting), the weight a matrix."""
    x, w, r = b["x"], b["w"], b["residual"]
    if (why := matrix_weight(b)) is not True:
        return why
    if not x.dtype == w.dtype == r.dtype:
        return f"input {x.dtype}, weight {w.dtype}, residual {r.dtype} differ"
    out = (*x.shape[:-1], w.shape[0])
    if r.dim() != len(out) or any(dim_key(a) != dim_key(c) for a, c in zip(r.shape, out)):
        return f"residual shape {tuple(r.shape)} != the linear's output {out}"
    return True


# fused_add_rms_norm(linear(x, w), residual, g, eps) -> s = linear_add(x, w, residual); rms_norm(s, g, eps)
def add_norm_pattern(x, w, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm(F.linear(x, w), residual, weight, eps)
    return out[0], out[1]


# the in-place add + norm: the same, its residual dead after it
def add_norm_inplace_pattern(x, w, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm_(F.linear(x, w), residual, weight, eps)
    return out[0], out[1]


def add_norm_replacement(x, w, residual, weight, eps):
    s = torch.ops.fxr.linear_add(x, w, residual)
    return torch.ops.fxr.rms_norm(s, weight, eps), s


def add_norm_inplace(x, w, residual, weight, eps):
    s = torch.ops.fxr.linear_add_(x, w, residual)
    return torch.ops.fxr.rms_norm(s, weight, eps), s


# the cast_last order (the weight multiplies in float32): fused_add_rms_norm(..., eps, True) -> the same, rms_norm(s, g, eps, True)
def add_norm_cast_last_pattern(x, w, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm(F.linear(x, w), residual, weight, eps, True)
    return out[0], out[1]


def add_norm_cast_last_inplace_pattern(x, w, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm_(F.linear(x, w), residual, weight, eps, True)
    return out[0], out[1]


def add_norm_cast_last_replacement(x, w, residual, weight, eps):
    s = torch.ops.fxr.linear_add(x, w, residual)
    return torch.ops.fxr.rms_norm(s, weight, eps, True), s


def add_norm_cast_last_inplace(x, w, residual, weight, eps):
    s = torch.ops.fxr.linear_add_(x, w, residual)
    return torch.ops.fxr.rms_norm(s, weight, eps, True), s


# the sum commutes: the GEMM's output may be the op's second operand (``residual + o_proj(a)``, as
# transformers writes it) -> the same; the in-place op overwrote both operands, the first now takes the sum
def add_norm_swapped_pattern(x, w, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm(residual, F.linear(x, w), weight, eps)
    return out[0], out[1]


def add_norm_swapped_inplace_pattern(x, w, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm_(residual, F.linear(x, w), weight, eps)
    return out[0], out[1]


def add_norm_cast_last_swapped_pattern(x, w, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm(residual, F.linear(x, w), weight, eps, True)
    return out[0], out[1]


def add_norm_cast_last_swapped_inplace_pattern(x, w, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm_(residual, F.linear(x, w), weight, eps, True)
    return out[0], out[1]


# linear(rms_norm(x, g, eps), w, b) -> fxr.rms_norm_linear(x, g, eps, w, b)  (g, b: tensors or None)
def norm_linear_pattern(x, weight, eps, w, b):
    return F.linear(torch.ops.fxr.rms_norm(x, weight, eps), w, b)


def norm_linear_replacement(x, weight, eps, w, b):
    return torch.ops.fxr.rms_norm_linear(x, weight, eps, w, b)


# linear(rms_norm(x, g, eps, True), w, b) -> fxr.rms_norm_linear(x, g, eps, w, b, True)
def norm_cast_last_linear_pattern(x, weight, eps, w, b):
    return F.linear(torch.ops.fxr.rms_norm(x, weight, eps, True), w, b)


def norm_cast_last_linear_replacement(x, weight, eps, w, b):
    return torch.ops.fxr.rms_norm_linear(x, weight, eps, w, b, True)


# silu_and_mul(linear(rms_norm(x, g, eps), w, b)) -> fxr.rms_norm_linear_silu_and_mul(x, g, eps, w, b)
def norm_gated_pattern(x, weight, eps, w, b):
    return torch.ops.fxr.silu_and_mul(F.linear(torch.ops.fxr.rms_norm(x, weight, eps), w, b))


def norm_gated_replacement(x, weight, eps, w, b):
    return torch.ops.fxr.rms_norm_linear_silu_and_mul(x, weight, eps, w, b)


# silu_and_mul(linear(rms_norm(x, g, eps, True), w, b)) -> fxr.rms_norm_linear_silu_and_mul(x, g, eps, w, b, True)
def norm_cast_last_gated_pattern(x, weight, eps, w, b):
    return torch.ops.fxr.silu_and_mul(F.linear(torch.ops.fxr.rms_norm(x, weight, eps, True), w, b))


def norm_cast_last_gated_replacement(x, weight, eps, w, b):
    return torch.ops.fxr.rms_norm_linear_silu_and_mul(x, weight, eps, w, b, True)


def _add_rule(name: str, pattern: object, replacement: object, inplace: object) -> Rule:
    # extends an op another rule fused: only a complete match a check refused is a near miss
    return Rule(name, pattern, replacement, residual_guard, SCALARS, inplace=InPlace(inplace, ("residual",)),
                optional=("weight",), near_miss_min=COMPLETE)  # type: ignore[arg-type]


def _norm_rule(name: str, pattern: object, replacement: object, guard: object) -> Rule:
    return Rule(name, pattern, replacement, guard, SCALARS, optional=("weight", "b"),
                near_miss_min=COMPLETE)  # type: ignore[arg-type]


RESIDUAL_RULES: list[Rule] = [
    _add_rule("linear_add_rms_norm", add_norm_pattern, add_norm_replacement, add_norm_inplace),
    _add_rule("linear_add_rms_norm_inplace", add_norm_inplace_pattern, add_norm_replacement, add_norm_inplace),
    _add_rule("linear_add_rms_norm_cast_last", add_norm_cast_last_pattern, add_norm_cast_last_replacement,
              add_norm_cast_last_inplace),
    _add_rule("linear_add_rms_norm_cast_last_inplace", add_norm_cast_last_inplace_pattern,
              add_norm_cast_last_replacement, add_norm_cast_last_inplace),
    _add_rule("linear_add_rms_norm_swapped", add_norm_swapped_pattern, add_norm_replacement, add_norm_inplace),
    _add_rule("linear_add_rms_norm_swapped_inplace", add_norm_swapped_inplace_pattern, add_norm_replacement,
              add_norm_inplace),
    _add_rule("linear_add_rms_norm_cast_last_swapped", add_norm_cast_last_swapped_pattern,
              add_norm_cast_last_replacement, add_norm_cast_last_inplace),
    _add_rule("linear_add_rms_norm_cast_last_swapped_inplace", add_norm_cast_last_swapped_inplace_pattern,
              add_norm_cast_last_replacement, add_norm_cast_last_inplace),
]  # fmt: skip
"""``fuse_gemm_residual``: the residual add of an add + RMSNorm into the GEMM that produces its addend."""

# the gated rules first: a plain rule would take their linears. The norm weight and the bias
# bind a tensor or None (a linear without bias is aten.linear(x, w, None) once canonicalized).
NORM_RULES: list[Rule] = [
    _norm_rule("rms_norm_linear_silu_and_mul", norm_gated_pattern, norm_gated_replacement, gate_up_weight),
    _norm_rule("rms_norm_cast_last_linear_silu_and_mul", norm_cast_last_gated_pattern,
               norm_cast_last_gated_replacement, gate_up_weight),
    _norm_rule("rms_norm_linear", norm_linear_pattern, norm_linear_replacement, matrix_weight),
    _norm_rule("rms_norm_cast_last_linear", norm_cast_last_linear_pattern, norm_cast_last_linear_replacement,
               matrix_weight),
]  # fmt: skip
"""``fuse_gemm_norm``: an RMSNorm read only by one GEMM into that GEMM."""
