"""Rotary embedding on real transformers families, tiny configs (``bench/coverage.py``'s
``build``), CPU, ``fullgraph=True``: every rotation becomes ``fxr.rotary_embedding`` with its
tables folded, none is left as ``fxr.apply_rotary`` or unfused, no near miss about the fold, and
the outputs equal eager.

The spellings they cover: HF ``rotate_half`` (Llama-like, Qwen3 and OLMo2 after per-head norms),
partial rotary of halves (Phi, StableLM, Persimmon, Qwen3-Next, GPT-NeoX) and of pairs (GLM,
GPT-J, CodeGen), pairs over the whole head (Cohere), RoFormer's sinusoidal table read at an
``arange`` made in the graph with ``stack(...).reshape_as(x)``, Phi-MoE's ``inv_freq`` made in
``forward``, Qwen3.5's multimodal sections of one text position row written in place, and the
complex form of Llama 4 (rotation, then QK norm) and DeepSeek-V2. GPT-J, CodeGen and DeepSeek-V2
are built from explicit tiny configs (the coverage shrinker does not build them).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.families import family_param, in_turn
from helpers.rewrites import BF16, F32, compile_modes, fused, reasons

from fxrewrite import models
from fxrewrite.testing import Compiled, compile_once

BENCH = Path(__file__).resolve().parents[2] / "bench"


@functools.cache
def coverage() -> Any:
    """``bench/coverage.py`` (a script, not a package) as a module."""
    spec = importlib.util.spec_from_file_location("coverage_script", BENCH / "coverage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def explicit(family: str) -> Any:
    """Tiny configs for the families the shrinker does not build (rotary dim past the head)."""
    import transformers as tf

    if family == "deepseek_v2":
        return tf.DeepseekV2Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=16, head_dim=16, n_group=1, topk_group=1, use_cache=False)  # fmt: skip
    cls = {"gptj": tf.GPTJConfig, "codegen": tf.CodeGenConfig}[family]
    return cls(vocab_size=256, n_positions=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, use_cache=False)


def build(family: str) -> torch.nn.Module:
    if family in HYBRID:  # the attention layer alone: the linear-attention layer has no rotation
        return coverage().build(family, kinds=("full_attention",))[0]
    if family not in EXPLICIT:
        return coverage().build(family)[0]
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    torch.manual_seed(0)
    cls = getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
    return cls._from_config(explicit(family), attn_implementation="eager").eval()


EXPLICIT = ("gptj", "codegen", "deepseek_v2")
# built with their attention layer only (the shrinker's tiny configs keep one layer of each kind;
# the linear-attention layer took half of each compile: bench/RESULTS.md, twelfth session)
HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# family -> fused rotary_embedding ops (one per layer that rotates; the tiny configs keep one
# layer of each kind: one attention layer in the hybrid Qwen3-Next / Qwen3.5, one RoPE layer in
# Llama 4 and Cohere 2)
ROTARIES = {
    "roformer": 2, "phimoe": 2, "qwen3_5_text": 1, "qwen3_5_moe_text": 1, "qwen3_next": 1, "stablelm": 2,
    "persimmon": 2, "phi": 2, "glm": 2, "glm4": 2, "cohere": 2, "cohere2": 1, "llama4_text": 1, "qwen3": 2,
    "olmo2": 2, "gpt_neox": 2, "gptj": 2, "codegen": 2, "deepseek_v2": 2,
}  # fmt: skip
# Where the fold is new: bf16 (floats lifted, as plain torch.compile leaves them) and static shapes
# beside float32 dynamic; the default run takes the three in turn (helpers.families.in_turn).
CHANGED = ("roformer", "phimoe", "qwen3_5_text", "llama4_text", "deepseek_v2")
PAIRS = ((F32, True, "f32-dynamic"), (BF16, "lifted", "bf16-lifted"), (F32, False, "f32-static"))
CASES = [family_param(f, F32, True, id=f"{f}-f32-dynamic") for f in ROTARIES if f not in CHANGED] + [
    family_param(f, dtype, dynamic, id=f"{f}-{name}", marks=in_turn(i, j, len(CHANGED), len(PAIRS)))
    for i, f in enumerate(CHANGED)
    for j, (dtype, dynamic, name) in enumerate(PAIRS)
]  # fmt: skip
TOLERANCE = {F32: 1e-5, BF16: 2e-2}  # max relative error against eager


@functools.cache
def compiled(family: str, dtype: torch.dtype, dynamic: bool | str) -> Compiled:
    model = build(family).to(dtype)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    return compile_once(model, ids, **compile_modes(dynamic))


@pytest.mark.parametrize(("family", "dtype", "dynamic"), CASES)
def test_every_rotation_folds(family: str, dtype: torch.dtype, dynamic: bool | str) -> None:
    r = compiled(family, dtype, dynamic)
    ops = fused(r.counts())
    assert ops.get("rotary_embedding") == ROTARIES[family] and "apply_rotary" not in ops, ops
    assert reasons(r, "rotary_embedding") == []
    left = [s for g in r.backend.graphs for s in coverage().candidates(g) if s["kind"] == "rotary"]
    assert left == [], "a rotation left unfused"


@pytest.mark.parametrize(("family", "dtype", "dynamic"), CASES)
def test_compiled_equals_eager(family: str, dtype: torch.dtype, dynamic: bool | str) -> None:
    r = compiled(family, dtype, dynamic)
    out, ref = models.hidden_states(r.output), models.hidden_states(r.eager)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    rel = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert rel < TOLERANCE[dtype], f"max relative error {rel:.3g}"
