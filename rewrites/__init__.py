"""The rule library (installed as ``fxrewrite.rewrites``): which subgraphs become which fused op.

Families export plain lists; :data:`PIPELINE` states, as data, the order in which the backend
runs them (``fxrewrite.backend.pipeline`` adds canonicalize first, the user's rules after the
last rule group, cleanup last). Nothing registers itself at import time.
"""

from fxrewrite import cse
from fxrewrite.passes import GraphPass, RuleGroup, Step
from fxrewrite.rewrites import (activation, async_tp, attention_quant, collective, layernorm, linear, linear_fused,
                                linear_rotary, merge, moe, norm, norm_hand_off, norm_variants, quant, quant_act_mul,
                                quant_block,
                                quant_nvfp4, rotary, rotary_tables, sequence_parallel)

PIPELINE: tuple[Step, ...] = (
    # a pure call repeated on the same inputs computed once (the quantization of one normed value
    # that each of q/k/v writes): first, so that the siblings below read one input and a norm
    # feeds one quantization
    GraphPass("cse", cse.cse_pass),
    # one GEMM for linears that read the same input (Config.merge_siblings)
    GraphPass("merge_siblings", merge.merge_sibling_linears, switch="merge_siblings"),
    # router + experts -> fxr.moe: before the activation rules, which would take the experts' SiLU-and-mul
    GraphPass("fuse_moe", moe.fuse_moe, fusion=True),
    # a rotation ends in an add (x * cos + rotate(x) * sin): before the add + norm rules, which would
    # take it for a residual add where a per-head norm follows the rotation (rotary, then QK norm)
    RuleGroup("fuse_rotary", rotary.RULES),
    # all-reduce + add + norm (tensor parallel): before the other norms, or the add + norm rules would take its sites
    RuleGroup("fuse_collective", quant_block.COLLECTIVE_RULES + quant_nvfp4.COLLECTIVE_RULES + collective.RULES),
    # the fused all-reduce sites, chained through the residual, sharded by the row count
    # (Config.sequence_parallel_min_tokens; None, the default: no such pass): right after the rules that made them
    GraphPass("sequence_parallel", sequence_parallel.shard_sequence, switch="sequence_parallel_min_tokens",
              options=("sequence_parallel_min_tokens", "capture_sizes", "mode")),
    # static FP8 quant of an attention output -> the engine's declared twin of the attention op
    # (Config.attention_quant): before the other quant rules, which would report its quantizer
    # as a near miss of theirs
    GraphPass("fuse_attention_quant", attention_quant.fuse_attention_quant,
              options=("attention_quant", "splitting_ops"), fusion=True),
    RuleGroup("fuse_norm_quant", quant.NORM_RULES + quant_block.NORM_RULES + quant_nvfp4.NORM_RULES),  # FP8, block FP8, NVFP4
    # add + norm before plain norm (the lists' order); LayerNorm first: the RMSNorm rules would
    # take a LayerNorm's second half (an RMSNorm of the centered input); gated norms before plain
    # norms (each holds a plain norm)
    RuleGroup("fuse_norm", layernorm.RULES + norm_variants.RULES + norm.RULES),
    RuleGroup("fuse_activation", activation.RULES),
    # FP8, block FP8 and NVFP4 quantization of fused activations: of one [.., 2d] row, of act_mul's two operands
    RuleGroup("fuse_activation_quant", quant.ACTIVATION_RULES + quant_block.ACTIVATION_RULES + quant_nvfp4.ACTIVATION_RULES
              + quant_act_mul.RULES),
    # a quantization left (none of the rules above fused it into what produced its input: an
    # attention output, o_proj's input) -> the quantizer alone, one kernel: last of the quant
    # rules, or it would take their sites; block before per token (a group is quantized as a
    # row: the per-token pattern lies inside the block one)
    RuleGroup("fuse_quant", quant_block.ALONE_RULES + quant.ALONE_RULES + quant_nvfp4.ALONE_RULES),
    # the GEMMs take in the small ops around them (graphs replayed as CUDA graphs, as select_gemm):
    # first the residual add of an add + norm into the GEMM that produces the addend (epilogue),
    # then every norm read only by a GEMM into that GEMM (prologue); before select_gemm, which
    # takes the linears left
    # (Config.gemm_fusion, off by default: slower on the H100 until tuned)
    RuleGroup("fuse_gemm_residual", linear_fused.RESIDUAL_RULES, modes=("piecewise", "full"), switch="gemm_fusion"),
    RuleGroup("fuse_gemm_norm", linear_fused.NORM_RULES, modes=("piecewise", "full"), switch="gemm_fusion"),
    # fxr.linear picks a decode-size GEMM by the rows of each call. Run eagerly (mode "none"),
    # each linear would pay the custom op's Python dispatch on the host, which replays do not
    # pay (not measured: extra_rules=linear.RULES opts in). Last: after every rule whose
    # pattern holds a linear.
    RuleGroup("select_gemm", linear.RULES, modes=("piecewise", "full")),
    # the GEMMs on either side of each sequence-parallel site fused with its collectives
    # (Config.async_tp): after select_gemm, so that below the threshold the ops call the GEMMs it chose
    GraphPass("async_tp", async_tp.fuse_async_tp, switch="async_tp",
              options=("capture_sizes", "mode", "async_tp_overlap_min_tokens")),
    # the cos/sin tables of the rotations fuse_rotary found, evaluated once (a no-op without them)
    GraphPass("fold_rotary", rotary_tables.fold_rotary_tables, options=("max_positions",)),
    # a folded rotation of q and k read straight from a qkv GEMM that took its norm -> that GEMM's
    # epilogue (a no-op outside the CUDA-graph modes: fuse_gemm_norm made no such GEMM)
    GraphPass("fuse_gemm_rotary", linear_rotary.fuse_gemm_rotary, switch="gemm_fusion", fusion=True),
    # each norm GEMM reading a sum an add-GEMM made takes that GEMM's hand-off (s * g and the
    # sums of squares by slot) and loses its k loop's squares: last, after the rotation took its GEMM
    GraphPass("hand_off_norms", norm_hand_off.hand_off_norms, switch="gemm_fusion", fusion=True),
    # the same in a static FP8 layer, with gemm_fusion: the add + norm + quantization between two
    # FP8 GEMMs -> the producing GEMM's hand-off and the reading GEMMs' quantizing prologues
    # (Config.fp8_norm_prologue, off: slower on the H100 at the 8B shape)
    GraphPass("hand_off_norm_quant", norm_hand_off.hand_off_norm_quants, options=("mode", "gemm_fusion"),
              switch="fp8_norm_prologue", fusion=True),
)

__all__ = ["PIPELINE", "activation", "async_tp", "attention_quant", "collective", "layernorm", "linear", "linear_fused",
           "linear_rotary", "merge", "moe", "norm", "norm_hand_off", "norm_variants", "quant", "quant_act_mul", "quant_block", "quant_nvfp4",
           "rotary", "rotary_tables", "sequence_parallel"]
