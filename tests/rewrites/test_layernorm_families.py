"""The LayerNorm rules on real model code: HF transformers families that normalize with
LayerNorm, tiny configs with random weights, CPU, ``fullgraph=True``.

Per family the exact fused-op counts as a function of the layer count L, output against eager,
and no near miss of a LayerNorm rule. Cases: float32 with L = 2 under dynamic=True, bf16 with
L = 1 under dynamic=True with the floats lifted to graph inputs (as plain torch.compile leaves
them); the default run takes them in turn, one per family (``helpers.families.in_turn``).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from helpers.families import family_param, in_turn
from helpers.rewrites import BF16, F32, compile_modes, fused

from fxrewrite.testing import Compiled, compile_once

tf = pytest.importorskip("transformers")

HIDDEN, HEADS, VOCAB = 64, 4, 128
# family -> (model class, config class, config fields at layer count L)
FAMILIES: dict[str, tuple[str, str, Any]] = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", lambda L: {"n_embd": HIDDEN, "n_layer": L, "n_head": HEADS}),
    # parallel residual: input and post-attention norms both read the layer's input
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", lambda L: {"num_hidden_layers": L}),
    # one norm read by attention and MLP in parallel
    "falcon": ("FalconForCausalLM", "FalconConfig", lambda L: {"num_hidden_layers": L, "num_kv_heads": HEADS}),
    # two norms of one sum (ln_attn, ln_mlp)
    "falcon_new": ("FalconForCausalLM", "FalconConfig", lambda L: {
        "num_hidden_layers": L, "num_kv_heads": 2, "new_decoder_architecture": True, "num_ln_in_parallel_attn": 2}),
    # per-head q/k LayerNorm over [B, T, H, D]
    "phi": ("PhiForCausalLM", "PhiConfig", lambda L: {"num_hidden_layers": L, "qk_layernorm": True}),
    # LayerNorm written out, weight scaled in float32 before the cast back
    "cohere": ("CohereForCausalLM", "CohereConfig", lambda L: {"num_hidden_layers": L}),
    # F.layer_norm(x.float(), shape, None, None).to(dtype): no weight, no bias
    "olmo": ("OlmoForCausalLM", "OlmoConfig", lambda L: {"num_hidden_layers": L}),
    # a norm of the word embeddings; residual adds before both norms of a layer
    "bloom": ("BloomForCausalLM", "BloomConfig", lambda L: {"n_layer": L, "n_head": HEADS}),
    # post-norm: LayerNorm(h + input), the sum read by nothing else
    "bert": ("BertLMHeadModel", "BertConfig", lambda L: {"num_hidden_layers": L, "is_decoder": True}),
}  # fmt: skip
# family -> fused op -> (count per layer, count once per model)
TABLE: dict[str, dict[str, tuple[int, int]]] = {
    "gpt2": {"layer_norm": (0, 1), "fused_add_layer_norm_": (2, 0)},
    "gpt_neox": {"layer_norm": (1, 1), "fused_add_layer_norm_": (1, 0)},
    "falcon": {"layer_norm": (0, 1), "fused_add_layer_norm_": (1, 0)},
    "falcon_new": {"layer_norm": (1, 1), "fused_add_layer_norm_": (1, 0)},
    "phi": {"layer_norm": (2, 1), "fused_add_layer_norm_": (1, 0)},
    "cohere": {"layer_norm": (0, 1), "fused_add_layer_norm_": (1, 0)},
    "olmo": {"layer_norm": (0, 1), "fused_add_layer_norm_": (2, 0)},
    "bloom": {"layer_norm": (0, 2), "fused_add_layer_norm_": (2, 0)},
    "bert": {"layer_norm": (0, 1), "fused_add_layer_norm_": (2, 1)},
}
PAIRS = ((2, F32, True, "f32-dynamic"), (1, BF16, "lifted", "bf16-lifted"))
CASES = [  # the default run takes the pairs in turn (helpers.families.in_turn)
    family_param(family, layers, dtype, dynamic, id=f"{family}-L{layers}-{name}", cls=FAMILIES[family][0],
                 marks=in_turn(i, j, len(FAMILIES), len(PAIRS)))
    for i, family in enumerate(FAMILIES)
    for j, (layers, dtype, dynamic, name) in enumerate(PAIRS)
]  # fmt: skip


def build(family: str, layers: int, dtype: torch.dtype) -> torch.nn.Module:
    model_cls, config_cls, fields = FAMILIES[family]
    sizes = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "intermediate_size": 2 * HIDDEN, "vocab_size": VOCAB,
             "max_position_embeddings": 64, "n_positions": 64, "use_cache": False}  # fmt: skip
    cfg = getattr(tf, config_cls)(**{k: v for k, v in sizes.items() if k in getattr(tf, config_cls)().to_dict()},
                                  **fields(layers))  # fmt: skip
    torch.manual_seed(0)
    model = getattr(tf, model_cls)._from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # weights and biases of the norms away from 1 and 0
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


@functools.cache
def compiled(family: str, layers: int, dtype: torch.dtype, dynamic: bool | str) -> Compiled:
    model = build(family, layers, dtype)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    return compile_once(model, ids, **compile_modes(dynamic))


def logits(out: Any) -> torch.Tensor:
    return out.logits.float()


@pytest.mark.parametrize(("family", "layers", "dtype", "dynamic"), CASES)
def test_layer_norm_counts_are_exact(family: str, layers: int, dtype: torch.dtype, dynamic: bool | str) -> None:
    r = compiled(family, layers, dtype, dynamic)
    assert len(r.backend.graphs) == 1
    want = {op: per * layers + once for op, (per, once) in TABLE[family].items()}
    got = {op: n for op, n in fused(r.counts()).items() if "layer_norm" in op}
    assert got == want
    left = r.counts()
    assert left["aten.layer_norm"] == 0 and left["aten.var"] == 0
    assert [m for m in r.report.near_misses if "layer_norm" in m.rule] == []


@pytest.mark.parametrize(("family", "layers", "dtype", "dynamic"), CASES)
def test_output_matches_eager(family: str, layers: int, dtype: torch.dtype, dynamic: bool | str) -> None:
    r = compiled(family, layers, dtype, dynamic)
    got, want = logits(r.output), logits(r.eager)
    tol = 1e-5 if dtype == F32 else 2e-2
    assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
