"""The engine model (``bench/engine_model.py``) as a block-FP8 checkpoint runs it: DeepSeek-V3's
and Qwen3-FP8's format, every linear of the decoder layers in FP8.

- Weights: quantized offline per 128 x 128 block (float8_e4m3fn values, one float32 scale per
  block, ``scale = max(amax, 1e-12) / 448``: :func:`quant_weight_block`).
- Activations: quantized by the model code at each linear's input, per token and group of 128
  (``quant_fp8_block``, as a block-FP8 linear's forward does), so a decoder layer holds four
  quantizations: after the input norm (or add + norm), after attention, after the
  post-attention add + norm, after SiLU-and-mul. The rewriter fuses three of them into the op
  that produces their input (``fxr.rms_norm_block_quant_fp8`` / ``fused_add_rms_norm_block_quant_fp8``,
  ``fxr.silu_and_mul_block_quant_fp8``); the one after attention (the engine's attention op
  has no twin that quantizes its output per group) becomes the quantizer alone,
  ``fxr.block_quant_fp8``: one kernel where its torch code is six.
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

:class:`BlockFp8Linear` lives in ``bench/fp8_linears.py``: it takes any ``nn.Linear`` (a
transformers model's too), its bias added after the GEMM.
"""

from __future__ import annotations

import dataclasses

from engine_model import EngineLlama, ModelConfig, tiny
from fp8_linears import BLOCK, GEMMS, BlockFp8Linear, replace_linears
from fxrewrite.runtime.ops.linear_block_fp8 import dequant_weight_block, quant_weight_block

__all__ = ["BLOCK", "GEMMS", "BlockFp8Linear", "dequant_weight_block", "expected_fusions", "quant_weight_block",
           "tiny_fp8", "to_block_fp8"]


def tiny_fp8(**overrides: object) -> ModelConfig:
    """:func:`engine_model.tiny` widened so every linear's input and output dims are multiples of 128."""
    return dataclasses.replace(tiny(hidden_size=256, intermediate_size=256, head_dim=64), **overrides)


def to_block_fp8(model: EngineLlama, gemm: str = "fp8") -> EngineLlama:
    """Convert ``model`` (the plain one) in place: each decoder layer's four linears become
    :class:`BlockFp8Linear` (their weights quantized now; ``gemm`` as there). Returns ``model``."""
    assert not model.fused, "convert the plain model; the rewriter fuses it"
    replace_linears(model.layers, lambda _name, linear: BlockFp8Linear(linear, gemm))
    return model


def expected_fusions(cfg: ModelConfig) -> dict[str, int]:
    """The block-FP8 ops the rewriter should leave in the model's graph: per layer, the quantized
    input norm (a plain norm in the first layer, add + norm after), the post-attention add + norm
    and SiLU-and-mul, and the attention output's quantization alone; the final norm feeds no
    linear (no LM head)."""
    return {
        "rms_norm_block_quant_fp8": 1,
        "fused_add_rms_norm_block_quant_fp8": 2 * cfg.num_layers - 1,
        "silu_and_mul_block_quant_fp8": cfg.num_layers,
        "block_quant_fp8": cfg.num_layers,
    }
