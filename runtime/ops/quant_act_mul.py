"""FP8 (static, per token, block) and NVFP4 quantization fused with ``fxr.act_mul``: the gated
activation of two tensors (gate and up from two GEMMs: two FP8 linears, each with its own
per-tensor weight scale, cannot be merged into one GEMM), where ``runtime/ops/quant.py``,
``quant_block.py`` and ``quant_nvfp4.py`` take the halves of one [..., 2d] tensor.

    # before                                                # after
    h = torch.ops.fxr.act_mul(gate, up, "silu")            q = torch.ops.fxr.act_mul_quant_fp8(gate, up, scale, "silu")
    q = (h.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)

Each op's reference is the composition its rule matches: :func:`act_mul_reference` (the
activation in ``a``'s dtype, the product in the promoted one; the operands' order in the
product does not change a value), then the quantizer of its module, the outputs contiguous
(the quantized values and scales bit for bit those of the unfused code; eager's layout of the
product, which the fused op does not keep, only ever differs for operands of other strides).
``activation``: "silu", "gelu" (erf) or "gelu_tanh", as ``fxr.act_mul`` names them.

CUDA: the Triton kernels of the [..., 2d] ops, each given the up operand as a second pointer at
its own row stride (for the [..., 2d] ops that pointer is the same row ``d`` columns in): one
launch, the quantization bit for bit the spec's of the values the kernel computes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops.activation import ACT_MUL_ACTIVATIONS, act_mul_reference
from fxrewrite.runtime.ops.quant import FP8_CAPABILITY, FP8_DTYPE, check_scale, quant_fp8_per_token, quant_fp8_static
from fxrewrite.runtime.ops.quant_block import TRITON_MODULE as BLOCK_MODULE
from fxrewrite.runtime.ops.quant_block import block_outputs, check_group, quant_fp8_block
from fxrewrite.runtime.ops.quant_nvfp4 import BLOCK, SCALE_DTYPE, check_global_scale, quant_nvfp4
from fxrewrite.runtime.ops.quant_nvfp4 import TRITON_MODULE as NVFP4_MODULE
from fxrewrite.runtime.providers import OpDef

# --------------------------------------------------------------------------- references (the spec)


def act_mul_quant_fp8_reference(a: Tensor, b: Tensor, scale: Tensor, activation: str = "silu") -> Tensor:
    """``quant_fp8_static(act_mul_reference(a, b, activation), scale)``: fp8 of ``a``'s shape."""
    return quant_fp8_static(act_mul_reference(a, b, activation), scale).contiguous()


def act_mul_dynamic_quant_fp8_reference(a: Tensor, b: Tensor, activation: str = "silu") -> tuple[Tensor, Tensor]:
    """``(q, s) = quant_fp8_per_token(act_mul_reference(a, b, activation))``: s [..., 1] float32."""
    q, s = quant_fp8_per_token(act_mul_reference(a, b, activation))
    return q.contiguous(), s.contiguous()


def act_mul_block_quant_fp8_reference(a: Tensor, b: Tensor, group: int, activation: str = "silu") -> tuple[Tensor, Tensor]:
    """``quant_fp8_block(act_mul_reference(a, b, activation), group)``: s [..., d / group] float32."""
    q, s = quant_fp8_block(act_mul_reference(a, b, activation), group)
    return q.contiguous(), s.contiguous()


def act_mul_quant_nvfp4_reference(a: Tensor, b: Tensor, global_scale: Tensor,
                                  activation: str = "silu") -> tuple[Tensor, Tensor]:  # fmt: skip
    """``quant_nvfp4(act_mul_reference(a, b, activation), global_scale)``: [..., d / 2], [..., d / 16]."""
    q, s = quant_nvfp4(act_mul_reference(a, b, activation), global_scale)
    return q.contiguous(), s.contiguous()


# --------------------------------------------------------------------------- fake impls


def _static_fake(a: Tensor, b: Tensor, scale: Tensor, activation: str = "silu") -> Tensor:
    return a.new_empty(a.shape, dtype=FP8_DTYPE)


def _dynamic_fake(a: Tensor, b: Tensor, activation: str = "silu") -> tuple[Tensor, Tensor]:
    return a.new_empty(a.shape, dtype=FP8_DTYPE), a.new_empty((*a.shape[:-1], 1), dtype=torch.float32)


def _block_fake(a: Tensor, b: Tensor, group: int, activation: str = "silu") -> tuple[Tensor, Tensor]:
    return block_outputs(a, group)


def _nvfp4_fake(a: Tensor, b: Tensor, global_scale: Tensor, activation: str = "silu") -> tuple[Tensor, Tensor]:
    lead, d = a.shape[:-1], a.shape[-1]
    return a.new_empty((*lead, d // 2), dtype=torch.uint8), a.new_empty((*lead, d // BLOCK), dtype=SCALE_DTYPE)


# --------------------------------------------------------------------------- kernel constraints


def check_operands(a: Tensor, b: Tensor, activation: str) -> str | None:
    """What every kernel here takes: a known activation; ``a`` and ``b`` of one shape and one
    16- or 32-bit float dtype (of two, the product is the promoted one: the reference serves),
    on one device, each rows at one stride with the last dim contiguous."""
    if activation not in ACT_MUL_ACTIVATIONS:
        return f"activation {activation!r}"
    return constraints.check_rows_at_one_stride(a, b) or constraints.check_same_device(a, b)


def _static_check(a: Tensor, b: Tensor, scale: Tensor, activation: str = "silu") -> str | None:
    return check_operands(a, b, activation) or check_scale(a, scale)


def _dynamic_check(a: Tensor, b: Tensor, activation: str = "silu") -> str | None:
    return check_operands(a, b, activation) or constraints.check_triton_row(a.shape[-1])


def _block_check(a: Tensor, b: Tensor, group: int, activation: str = "silu") -> str | None:
    return check_operands(a, b, activation) or check_group(a.shape[-1], group, power_of_two=True)


def _nvfp4_check(a: Tensor, b: Tensor, global_scale: Tensor, activation: str = "silu") -> str | None:
    reason = check_operands(a, b, activation)
    if reason is None and a.shape[-1] % BLOCK:
        reason = f"{a.shape[-1]} values a row, not a multiple of {BLOCK}"
    return reason or check_global_scale(a, global_scale)


# --------------------------------------------------------------------------- the ops

# One kernel each (Triton); no library has an activation of two operands (sgl-kernel 0.4.6 and
# flashinfer 0.7.2 take one [..., 2d] tensor). NVFP4's e4m3 scales convert in hardware from Ada on, as FP8.
DEFS: tuple[OpDef, ...] = (
    OpDef("act_mul_quant_fp8", act_mul_quant_fp8_reference, _static_fake,
          (providers.triton_kernel("act_mul_quant_fp8", _static_check, FP8_CAPABILITY),)),
    OpDef("act_mul_dynamic_quant_fp8", act_mul_dynamic_quant_fp8_reference, _dynamic_fake,
          (providers.triton_kernel("act_mul_dynamic_quant_fp8", _dynamic_check, FP8_CAPABILITY),)),
    OpDef("act_mul_block_quant_fp8", act_mul_block_quant_fp8_reference, _block_fake,
          (providers.triton_kernel("act_mul_block_quant_fp8", _block_check, FP8_CAPABILITY, module=BLOCK_MODULE),)),
    OpDef("act_mul_quant_nvfp4", act_mul_quant_nvfp4_reference, _nvfp4_fake,
          (providers.triton_kernel("act_mul_quant_nvfp4", _nvfp4_check, FP8_CAPABILITY, module=NVFP4_MODULE),)),
)  # fmt: skip
OPS: tuple[str, ...] = providers.define_all(DEFS)
