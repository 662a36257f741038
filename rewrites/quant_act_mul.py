"""FP8 (static, per token, block) and NVFP4 quantization of ``fxr.act_mul`` (the gated activation
of two tensors, formed by ``rewrites/activation.py``) fused into one op.

Where gate and up come from two GEMMs (two static-FP8 linears, each with its own weight scale,
are not merged into one GEMM) the activation is ``fxr.act_mul(gate, up, act)``, not
``fxr.silu_and_mul`` of one row, and its quantization (the down projection's input) is
``rewrites/quant.py``'s, ``quant_block.py``'s or ``quant_nvfp4.py``'s quantizer of it::

    # before                                              # after
    h = torch.ops.fxr.act_mul(gate, up, "silu")           q = torch.ops.fxr.act_mul_quant_fp8(gate, up, scale, "silu")
    q = (h.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)

Patterns are those quantizers applied to ``fxr.act_mul`` as the activation rules write it, the
activation a scalar wildcard: ``act_mul(a, b, act)``, or ``act_mul(a, b, act, False)`` where the
model wrote ``up * act(gate)`` (one rule per order, made by one factory; the fused op has no order:
the product's values are the same, its layout the op's own). The guards are the quantizers' own
(``quant.scale_guard``, ``quant_block``'s group check, ``quant_nvfp4.nvfp4_guard``). They run with
the other activation + quant rules, after ``fuse_activation`` formed ``act_mul``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.rewrites.quant import scale_guard
from fxrewrite.rewrites.quant_block import GROUP
from fxrewrite.rewrites.quant_nvfp4 import BLOCK_SCALAR, nvfp4_guard
from fxrewrite.rule import Bindings, Rule, Scalar
from fxrewrite.runtime.ops.quant import quant_fp8_per_token, quant_fp8_static
from fxrewrite.runtime.ops.quant_block import check_group, quant_fp8_block
from fxrewrite.runtime.ops.quant_nvfp4 import quant_e2m1_blocks

ACTIVATION = {"activation": Scalar(str)}


def order(act_first: bool) -> tuple[bool, ...]:
    """``fxr.act_mul``'s trailing arguments as the activation rules write them: none for
    ``act(a) * b``, ``False`` for ``b * act(a)``."""
    return () if act_first else (False,)


def act_mul_group_guard(b: Bindings) -> bool | str:
    """The group divides the quantized dim: the operands' last dim."""
    return check_group(b["a"].shape[-1], b["group"]) or True


def act_mul_quant(act_first: bool) -> tuple[Callable, Callable]:
    """quant_static(fxr.act_mul(a, b, act[, False]), scale) -> fxr.act_mul_quant_fp8(a, b, scale, act)"""
    flags = order(act_first)

    def pattern(a, b, activation, scale):
        return quant_fp8_static(torch.ops.fxr.act_mul(a, b, activation, *flags), scale)

    def replacement(a, b, activation, scale):
        return torch.ops.fxr.act_mul_quant_fp8(a, b, scale, activation)

    return pattern, replacement


def act_mul_dynamic_quant(act_first: bool) -> tuple[Callable, Callable]:
    """quant_per_token(fxr.act_mul(a, b, act[, False])) -> fxr.act_mul_dynamic_quant_fp8(a, b, act) (q, scales)"""
    flags = order(act_first)

    def pattern(a, b, activation):
        return quant_fp8_per_token(torch.ops.fxr.act_mul(a, b, activation, *flags))

    def replacement(a, b, activation):
        out = torch.ops.fxr.act_mul_dynamic_quant_fp8(a, b, activation)
        return out[0], out[1]

    return pattern, replacement


def act_mul_block_quant(act_first: bool) -> tuple[Callable, Callable]:
    """quant_block(fxr.act_mul(a, b, act[, False]), G) -> fxr.act_mul_block_quant_fp8(a, b, G, act) (q, scales)"""
    flags = order(act_first)

    def pattern(a, b, activation, group):
        return quant_fp8_block(torch.ops.fxr.act_mul(a, b, activation, *flags), group)

    def replacement(a, b, activation, group):
        out = torch.ops.fxr.act_mul_block_quant_fp8(a, b, group, activation)
        return out[0], out[1]

    return pattern, replacement


def act_mul_nvfp4(act_first: bool) -> tuple[Callable, Callable]:
    """quant_nvfp4(fxr.act_mul(a, b, act[, False])) -> fxr.act_mul_quant_nvfp4(a, b, global_scale, act) (values, scales)"""
    flags = order(act_first)

    def pattern(a, b, activation, global_scale, block):
        return quant_e2m1_blocks(torch.ops.fxr.act_mul(a, b, activation, *flags), global_scale, block)

    def replacement(a, b, activation, global_scale):
        out = torch.ops.fxr.act_mul_quant_nvfp4(a, b, global_scale, activation)
        return out[0], out[1]

    return pattern, replacement


def both_orders(name: str, make: Callable[[bool], tuple[Callable, Callable]], guard: Callable[[Bindings], bool | str] | None,
                scalars: dict[str, Scalar]) -> list[Rule]:  # fmt: skip
    """The rule for ``act(a) * b`` and its twin for ``b * act(a)``, under one name (one fusion,
    whichever order the model wrote)."""
    return [Rule(name, *make(act_first), guard, scalars) for act_first in (True, False)]


# quant_static(fxr.act_mul(a, b, act)) -> fxr.act_mul_quant_fp8(a, b, scale, act); the b * act(a) twin likewise
ACT_MUL_QUANT = both_orders("act_mul_quant_fp8", act_mul_quant, scale_guard, ACTIVATION)
# quant_per_token(fxr.act_mul(a, b, act)) -> fxr.act_mul_dynamic_quant_fp8(a, b, act)
ACT_MUL_DYNAMIC_QUANT = both_orders("act_mul_dynamic_quant_fp8", act_mul_dynamic_quant, None, ACTIVATION)
# quant_block(fxr.act_mul(a, b, act), G) -> fxr.act_mul_block_quant_fp8(a, b, G, act)
ACT_MUL_BLOCK_QUANT = both_orders("act_mul_block_quant_fp8", act_mul_block_quant, act_mul_group_guard,
                                  {**ACTIVATION, **GROUP})  # fmt: skip
# quant_nvfp4(fxr.act_mul(a, b, act)) -> fxr.act_mul_quant_nvfp4(a, b, global_scale, act)
ACT_MUL_NVFP4 = both_orders("act_mul_quant_nvfp4", act_mul_nvfp4, nvfp4_guard, {**ACTIVATION, **BLOCK_SCALAR})

# After the activation rules (they form act_mul), with the other activation + quant rules.
RULES: list[Rule] = ACT_MUL_DYNAMIC_QUANT + ACT_MUL_QUANT + ACT_MUL_BLOCK_QUANT + ACT_MUL_NVFP4
