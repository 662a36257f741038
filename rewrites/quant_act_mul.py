"""FP8 (static, per token, block) and NVFP4 quantization of ``fxr.act_mul`` (the gated activation
of two tensors, formed by ``rewrites/activation.py``) fused into one op.

Where gate and up come from two GEMMs (two static-FP8 linears, each with its own weight scale,
are not merged into one GEMM) the activation is ``fxr.act_mul(gate, up, act)``, not
``fxr.silu_and_mul`` of one row, and its quantization (the down projection's input) is
``rewrites/quant.py``'s, ``quant_block.py``'s or ``quant_nvfp4.py``'s quantizer of it::

    # before                                              # after
    h = torch.ops.fxr.act_mul(gate, up, "silu")           q = torch.ops.fxr.act_mul_quant_fp8(gate, up, scale, "silu")
    q = (h.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)

Patterns are those quantizers applied to ``fxr.act_mul(a, b, act, act_first)`` as the activation
rules write it, the activation and the operand order scalar wildcards (``act_first`` is False
where the model wrote ``up * act(gate)``; the fused op has no order: the product's values are the
same, the output's layout is the op's own). The guards are the quantizers' own
(``quant.scale_guard``, ``quant_block``'s group check, ``quant_nvfp4.nvfp4_guard``). They run with
the other activation + quant rules, after ``fuse_activation`` formed ``act_mul``.
"""

from __future__ import annotations

import torch

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.rewrites.quant import scale_guard
from fxrewrite.rewrites.quant_block import GROUP
from fxrewrite.rewrites.quant_nvfp4 import BLOCK_SCALAR, nvfp4_guard
from fxrewrite.rule import Bindings, Rule, Scalar
from fxrewrite.runtime.ops.quant import quant_fp8_per_token, quant_fp8_static
from fxrewrite.runtime.ops.quant_block import check_group, quant_fp8_block
from fxrewrite.runtime.ops.quant_nvfp4 import quant_e2m1_blocks

# act_mul's activation and operand order (its values do not depend on the order: the fused op has none)
ACT_MUL = {"activation": Scalar(str), "act_first": Scalar(bool)}


def act_mul_group_guard(b: Bindings) -> bool | str:
    """The group divides the quantized dim: the operands' last dim."""
    return check_group(b["a"].shape[-1], b["group"]) or True


# quant_static(fxr.act_mul(a, b, act, first)) -> fxr.act_mul_quant_fp8(a, b, scale, act)
def act_mul_quant_pattern(a, b, activation, act_first, scale):
    return quant_fp8_static(torch.ops.fxr.act_mul(a, b, activation, act_first), scale)


def act_mul_quant_replacement(a, b, activation, scale):
    return torch.ops.fxr.act_mul_quant_fp8(a, b, scale, activation)


# quant_per_token(fxr.act_mul(a, b, act, first)) -> fxr.act_mul_dynamic_quant_fp8(a, b, act)  (q, scales)
def act_mul_dynamic_quant_pattern(a, b, activation, act_first):
    return quant_fp8_per_token(torch.ops.fxr.act_mul(a, b, activation, act_first))


def act_mul_dynamic_quant_replacement(a, b, activation):
    out = torch.ops.fxr.act_mul_dynamic_quant_fp8(a, b, activation)
    return out[0], out[1]


# quant_block(fxr.act_mul(a, b, act, first), G) -> fxr.act_mul_block_quant_fp8(a, b, G, act)  (q, scales)
def act_mul_block_quant_pattern(a, b, activation, act_first, group):
    return quant_fp8_block(torch.ops.fxr.act_mul(a, b, activation, act_first), group)


def act_mul_block_quant_replacement(a, b, activation, group):
    out = torch.ops.fxr.act_mul_block_quant_fp8(a, b, group, activation)
    return out[0], out[1]


# quant_nvfp4(fxr.act_mul(a, b, act, first)) -> fxr.act_mul_quant_nvfp4(a, b, global_scale, act)  (values, scales)
def act_mul_nvfp4_pattern(a, b, activation, act_first, global_scale, block):
    return quant_e2m1_blocks(torch.ops.fxr.act_mul(a, b, activation, act_first), global_scale, block)


def act_mul_nvfp4_replacement(a, b, activation, global_scale):
    out = torch.ops.fxr.act_mul_quant_nvfp4(a, b, global_scale, activation)
    return out[0], out[1]


ACT_MUL_QUANT = Rule("act_mul_quant_fp8", act_mul_quant_pattern, act_mul_quant_replacement, scale_guard, ACT_MUL)
ACT_MUL_DYNAMIC_QUANT = Rule(
    "act_mul_dynamic_quant_fp8", act_mul_dynamic_quant_pattern, act_mul_dynamic_quant_replacement, None, ACT_MUL
)
ACT_MUL_BLOCK_QUANT = Rule(
    "act_mul_block_quant_fp8", act_mul_block_quant_pattern, act_mul_block_quant_replacement, act_mul_group_guard,
    {**ACT_MUL, **GROUP},
)  # fmt: skip
ACT_MUL_NVFP4 = Rule(
    "act_mul_quant_nvfp4", act_mul_nvfp4_pattern, act_mul_nvfp4_replacement, nvfp4_guard, {**ACT_MUL, **BLOCK_SCALAR}
)

# After the activation rules (they form act_mul), with the other activation + quant rules.
RULES: list[Rule] = [ACT_MUL_DYNAMIC_QUANT, ACT_MUL_QUANT, ACT_MUL_BLOCK_QUANT, ACT_MUL_NVFP4]
