"""Fused custom ops in namespace ``fxr``; ``import fxrewrite.runtime.ops`` registers them all.

One module per family; each op is an :class:`~fxrewrite.runtime.providers.OpDef` (reference =
spec and CPU impl, fake impl, CUDA kernels chosen by the providers) registered with
:func:`~fxrewrite.runtime.providers.define_op`: ``norm`` (RMSNorm, Gemma, add + norm, in-place
twins), ``layernorm`` (LayerNorm, add + LayerNorm, in-place twin), ``norm_variants`` (L2 norm, gated RMSNorm), ``activation`` (SiLU/GELU and mul of one [..., 2d] tensor, and ``act_mul`` of two operands), ``quant`` (FP8 static and per-token variants), ``quant_block`` (block-wise FP8: per-token groups of 128), ``quant_nvfp4`` (NVFP4 after a norm or activation), ``quant_act_mul`` (FP8, block FP8, NVFP4 of ``act_mul``'s two operands),
``rotary`` (RoPE: the rotation with the model's tables, and the cache-indexed kernels' op),
``collective`` (all-reduce + add + RMSNorm, + FP8, block FP8 or NVFP4, for tensor parallelism), ``sequence_parallel``
(its reduce-scatter / all-gather form by the row count), ``async_tp`` (its GEMMs fused with
those collectives), ``linear``
(``F.linear`` with a decode-size GEMM), ``linear_fused`` (that GEMM with an RMSNorm before it or
a residual add after it), ``linear_fp8_fused`` (the FP8 GEMMs with the norm's hand-off and its
quantization in the reading GEMM), ``linear_block_fp8`` (the GEMM of block-FP8 activations and
weights), ``moe`` (a mixture-of-experts block: routing, experts,
weighted sum), ``moe_route`` (its router alone: scores, biased and group-limited top-k).
``DEFS`` holds every definition, ``OPS`` every op name.
"""

from fxrewrite.runtime.ops import (activation, async_tp, collective, layernorm, linear, linear_block_fp8, linear_fp8_fused,
                                   linear_fused, moe, moe_route, norm, norm_variants, quant, quant_act_mul, quant_block, quant_nvfp4,
                                   rotary, sequence_parallel)
from fxrewrite.runtime.providers import OpDef

DEFS: tuple[OpDef, ...] = (
    norm.DEFS + norm_variants.DEFS + layernorm.DEFS + activation.DEFS + quant.DEFS + quant_block.DEFS + quant_nvfp4.DEFS
    + quant_act_mul.DEFS + rotary.DEFS + collective.DEFS + sequence_parallel.DEFS + async_tp.DEFS + linear.DEFS
    + linear_fused.DEFS + linear_fp8_fused.DEFS + linear_block_fp8.DEFS + moe.DEFS + moe_route.DEFS
)
OPS: tuple[str, ...] = tuple(op.name for op in DEFS)

__all__ = ["DEFS", "OPS", "activation", "async_tp", "collective", "layernorm", "linear", "linear_block_fp8",
           "linear_fp8_fused", "linear_fused",
           "moe", "moe_route", "norm", "norm_variants", "quant", "quant_act_mul", "quant_block", "quant_nvfp4", "rotary",
           "sequence_parallel"]
