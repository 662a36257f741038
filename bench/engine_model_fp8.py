"""The engine model (``bench/engine_model.py``) as a block-FP8 checkpoint runs it: DeepSeek-V3's
and Qwen3-FP8's format, every linear of the decoder layers in FP8.

- Weights: quantized offline per 128 x 128 block (float8_e4m3fn values, one float32 scale per
  block, ``scale = max(amax, 1e-12) / 448``: :func:`quant_weight_block`).
- Activations: quantized by the model code at each linear's input, per token and group of 128
  (``quant_fp8_block``, as a block-FP8 linear's forward does), so a decoder layer holds four
  quantizations: after the input norm (or add + norm), after attention, after the
  post-attention add + norm, after SiLU-and-mul. The rewriter fuses three of them into the op
  that produces their input (``fxr.rms_norm_block_quant_fp8`` / ``fused_add_rms_norm_block_quant_fp8``,
  ``fxr.silu_and_mul_block_quant_fp8``); the one after attention stays (attention + FP8 is
  another rule's).
- GEMM (``gemm=``): ``"fp8"`` (default), ``fxr.linear_block_fp8`` on the FP8 values and both
  scales: FP8 tensor cores on Ada / Hopper (our Triton kernel; cuBLASLt's block-scaled GEMM on
  Hopper), the dequantizing float32 reference elsewhere (``runtime/ops/linear_block_fp8.py``);
  ``"dequant"``, the dequantizing reference said plainly: the activation dequantized (``q * s``
  per group) and multiplied with the weight dequantized once at conversion, in the model's
  dtype, on every device (bf16 GEMM times plus the dequantization).

    # before (per linear)                                  # after the rewriter (norm + quant)
    y = rms_norm(x, w, eps)                                q, s = torch.ops.fxr.rms_norm_block_quant_fp8(x, w, eps, 128)
    q, s = quant_fp8_block(y, 128)                         out = fxr.linear_block_fp8(q, s, w_q, w_s, dtype)
    out = fxr.linear_block_fp8(q, s, w_q, w_s, dtype)

    model = to_block_fp8(build_model(tiny_fp8()))   # every nn.Linear of the layers converted
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine_model import EngineLlama, ModelConfig, tiny
from fxrewrite.runtime.ops.linear_block_fp8 import dequant_weight_block, quant_weight_block
from fxrewrite.runtime.ops.quant_block import GROUP, dequant_fp8_block, quant_fp8_block

__all__ = ["BlockFp8Linear", "dequant_weight_block", "expected_fusions", "quant_weight_block", "tiny_fp8", "to_block_fp8"]

BLOCK = GROUP  # weights: 128 x 128 blocks; activations: groups of 128 along the hidden dim
GEMMS = ("fp8", "dequant")


def tiny_fp8(**overrides: object) -> ModelConfig:
    """:func:`engine_model.tiny` widened so every linear's input and output dims are multiples of 128."""
    return dataclasses.replace(tiny(hidden_size=256, intermediate_size=256, head_dim=64), **overrides)


class BlockFp8Linear(nn.Module):
    """A linear of a block-FP8 checkpoint: the weight in FP8 with per-tile scales, as a checkpoint
    holds them; the input quantized per token and group of 128 in the forward, as model code
    does; the GEMM ``fxr.linear_block_fp8`` (``gemm="fp8"``) or the dequantizing reference
    (``gemm="dequant"``: the weight dequantized once, here)."""

    def __init__(self, linear: nn.Linear, gemm: str = "fp8") -> None:
        super().__init__()
        assert linear.bias is None, "the engine model's linears have no bias"
        assert gemm in GEMMS, f"gemm {gemm!r} is not one of {GEMMS}"
        self.gemm = gemm
        q, s = quant_weight_block(linear.weight.detach())
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_scale", s)
        if gemm == "dequant":
            self.register_buffer("weight", dequant_weight_block(q, s).to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = quant_fp8_block(x, BLOCK)
        if self.gemm == "fp8":
            return torch.ops.fxr.linear_block_fp8(q, s, self.weight_q, self.weight_scale, x.dtype)
        return F.linear(dequant_fp8_block(q, s).to(x.dtype), self.weight)


LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def to_block_fp8(model: EngineLlama, gemm: str = "fp8") -> EngineLlama:
    """Convert ``model`` (the plain one) in place: each decoder layer's four linears become
    :class:`BlockFp8Linear` (their weights quantized now; ``gemm`` as there). Returns ``model``."""
    assert not model.fused, "convert the plain model; the rewriter fuses it"
    for layer in model.layers:
        for path in LINEARS:
            parent_name, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            setattr(parent, name, BlockFp8Linear(getattr(parent, name), gemm))
    return model


def expected_fusions(cfg: ModelConfig) -> dict[str, int]:
    """The block-FP8 ops the rewriter should leave in the model's graph: per layer, the quantized
    input norm (a plain norm in the first layer, add + norm after), the post-attention add + norm
    and SiLU-and-mul; the final norm feeds no linear (no LM head)."""
    return {
        "rms_norm_block_quant_fp8": 1,
        "fused_add_rms_norm_block_quant_fp8": 2 * cfg.num_layers - 1,
        "silu_and_mul_block_quant_fp8": cfg.num_layers,
    }
