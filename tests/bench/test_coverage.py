"""The coverage sweep's plumbing (bench/coverage.py, bench/shrink.py), on CPU.

* the shrinker: sizes derived from others stay consistent (MLA, SSM, rotary), one layer of each
  kind is kept, a family builds and runs at the tiny shape, a multimodal wrapper whose text
  decoder has its own entry is ``no build`` and names that entry;
* the candidate detector on hand-written graphs: a norm, a gated activation, a rotate_half and a
  top-k router are counted as captured and gone once rewritten; a near look-alike of each is not
  counted at all;
* a few families through ``run_family``, covering the status kinds.

The asserts are on what cannot change by accident (a status kind, the candidate kinds present),
not on how many sites are left unfused today: fusions are being added.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import shrink
import torch
import torch.nn.functional as F
from helpers.families import family_param
from helpers.rewrites import LlamaRMSNorm

F32 = (torch.float32,)


def _load_coverage():  # noqa: ANN202 - a module
    """bench/coverage.py, loaded by path: a ``coverage`` package (coverage.py, pytest-cov's) may own the name."""
    path = Path(__file__).resolve().parents[2] / "bench" / "coverage.py"
    spec = importlib.util.spec_from_file_location("fxrewrite_bench_coverage", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


coverage = _load_coverage()


# --- the shrinker ------------------------------------------------------------------------------


def test_latent_attention_sizes_follow_the_rotary_part() -> None:
    cfg = shrink.shrunk_config("deepseek_v3")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size) == (64, 4, 256)
    assert cfg.head_dim == cfg.qk_rope_head_dim == 8
    assert cfg.qk_head_dim == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    # 61 layers, the first 3 dense: one dense and one MoE layer
    assert (cfg.num_hidden_layers, cfg.first_k_dense_replace) == (2, 1)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (8, 2)


def test_state_space_heads_fill_the_inner_width() -> None:
    cfg = shrink.shrunk_config("mamba2")
    assert cfg.num_heads * cfg.head_dim == cfg.expand * cfg.hidden_size
    assert cfg.num_heads % cfg.n_groups == 0


def test_rotary_dim_is_the_same_share_of_the_head() -> None:
    cfg = shrink.shrunk_config("gptj")  # 64 of 256 rotate
    assert cfg.rotary_dim * 4 == cfg.n_embd // cfg.n_head


def test_one_layer_of_each_kind_is_kept() -> None:
    cfg = shrink.shrunk_config("gemma3_text")  # 5 sliding layers to 1 full
    assert sorted(set(cfg.layer_types)) == ["full_attention", "sliding_attention"]
    assert cfg.num_hidden_layers == len(cfg.layer_types) == 2


def test_per_layer_overrides_follow_the_kept_layers_at_scale() -> None:
    cfg = shrink.shrunk_config("gemma4_text")  # full-attention layers: heads twice as wide
    full = cfg.layer_types.index("full_attention")
    assert shrink._overrides(cfg) == {full: {"head_dim": 2 * shrink._fields(cfg)["head_dim"]}}


def test_weights_tied_across_a_kind_keep_two_of_it() -> None:
    model, _ = coverage.build("zamba")  # one shared transformer, tied across the hybrid layers
    assert model.config.layers_block_type.count("hybrid") == 2


def test_a_family_builds_and_runs_at_the_tiny_shape() -> None:
    model, attention = coverage.build("llama")
    assert attention == "sdpa" and not model.training
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (1, coverage.TOKENS))).logits
    assert logits.shape == (1, coverage.TOKENS, 256) and torch.isfinite(logits).all()


def test_a_multimodal_model_with_its_text_decoder_listed_is_no_build() -> None:
    row = coverage.run_family("gemma3", F32)
    assert row["status"] == "no build"
    assert "'gemma3_text'" in row["error"], row["error"]


def test_a_multimodal_model_without_its_text_decoder_listed_builds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    monkeypatch.delitem(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "gemma3_text")
    model, _ = coverage.build("gemma3")
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.hidden_size == 64


def test_a_draft_model_is_no_build() -> None:
    row = coverage.run_family("gemma4_assistant", F32)
    assert row["status"] == "no build" and "shared_kv_states" in row["error"], row


def test_a_multimodal_config_builds_the_text_model_its_class_takes() -> None:
    model, _ = coverage.build("llama4")  # Llama4ForCausalLM takes Llama4Config's text config
    assert type(model.config).__name__ == "Llama4TextConfig"


# --- the candidate detector --------------------------------------------------------------------


class GatedMLP(torch.nn.Module):
    def __init__(self, hidden: int = 32, width: int = 64, scalar_gate: bool = False) -> None:
        super().__init__()
        self.gate, self.up = torch.nn.Linear(hidden, width, bias=False), torch.nn.Linear(hidden, width, bias=False)
        self.down = torch.nn.Linear(width, hidden, bias=False)
        self.scalar_gate = scalar_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scalar_gate:  # not gated: SiLU times a number
            return self.down(F.silu(self.gate(x)) * 0.5)
        return self.down(F.silu(self.gate(x)) * self.up(x))


class AbsMeanNorm(torch.nn.Module):
    """Scaled by the mean absolute value: no rsqrt, no norm op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.abs().mean(-1, keepdim=True) + 1e-6)


class Rope(torch.nn.Module):
    """HF's rotate_half rotation with tables from ``inv_freq``; ``negate=False`` swaps the halves
    without the negation (not a rotation)."""

    def __init__(self, head_dim: int = 16, negate: bool = True) -> None:
        super().__init__()
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.head_dim, self.negate = head_dim, negate

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, H * D]
        b, t, _ = x.shape
        q = x.view(b, t, -1, self.head_dim).transpose(1, 2)
        freqs = torch.arange(t, device=x.device)[None, :, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        x1, x2 = q[..., : self.head_dim // 2], q[..., self.head_dim // 2 :]
        rotated = torch.cat((-x2, x1) if self.negate else (x2, x1), dim=-1)
        return (q * cos + rotated * sin).transpose(1, 2).reshape(b, t, -1)


class MoE(torch.nn.Module):
    """Softmax router, top-k renormalized, experts stacked [E, 2I, H] / [E, H, I] as transformers'
    batched_mm runs them; ``top1_by_max`` routes by ``max`` instead (no top-k)."""

    def __init__(self, hidden: int = 32, width: int = 16, count: int = 8, top_k: int = 2,
                 top1_by_max: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.router = torch.nn.Parameter(torch.randn(count, hidden) * 0.5)
        self.gate_up = torch.nn.Parameter(torch.randn(count, 2 * width, hidden) * hidden**-0.5)
        self.down = torch.nn.Parameter(torch.randn(count, hidden, width) * width**-0.5)
        self.top_k, self.top1_by_max = top_k, top1_by_max

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H]
        scores = F.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float)
        if self.top1_by_max:
            weights, ids = scores.max(dim=-1, keepdim=True)
        else:
            weights, ids = torch.topk(scores, self.top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        k, flat = ids.shape[-1], ids.reshape(-1)
        gate_up = torch.bmm(self.gate_up[flat], x.repeat_interleave(k, dim=0).unsqueeze(-1)).squeeze(-1)
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.bmm(self.down[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (out * weights.to(x.dtype).reshape(-1, 1)).view(-1, k, out.shape[-1]).sum(dim=1)


CASES = {
    "norm": (lambda: LlamaRMSNorm(32), lambda: AbsMeanNorm(), (1, 8, 32)),
    "gated_act": (lambda: GatedMLP(), lambda: GatedMLP(scalar_gate=True), (1, 8, 32)),
    "rotary": (lambda: Rope(), lambda: Rope(negate=False), (1, 8, 64)),
    "router": (lambda: MoE(), lambda: MoE(top1_by_max=True), (8, 32)),
}


def _sites(model: torch.nn.Module, shape: tuple[int, ...]) -> dict:
    x = torch.randn(shape)
    with torch.no_grad():
        ref = model(x)
    row = coverage.run_dtype(model, x, ref, torch.float32)
    assert row["ok"] and row["numerics_ok"] and not row["pass_errors"], row
    return row


@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_candidate_is_counted_and_gone_once_fused(kind: str) -> None:
    positive, _, shape = CASES[kind]
    row = _sites(positive(), shape)
    assert row["candidates"].get(kind, 0) >= 1, row["candidates"]
    assert row["unfused"].get(kind, 0) == 0, row["left"]


@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_look_alike_is_not_a_candidate(kind: str) -> None:
    _, negative, shape = CASES[kind]
    row = _sites(negative(), shape)
    assert row["candidates"].get(kind, 0) == 0, row["candidates"]


class KeyIndexer(torch.nn.Module):
    """A sparse-attention indexer: each query keeps its top-k keys by score (a top-k over the
    key positions, dynamic, not over a fixed number of experts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, H]
        scores = x @ x.transpose(-1, -2)
        keep = scores.topk(min(4, scores.shape[-1]), dim=-1).indices
        return torch.gather(scores, -1, keep).sum(-1, keepdim=True) * x


def test_a_top_k_over_keys_is_not_a_router() -> None:
    row = _sites(KeyIndexer(), (1, 8, 32))
    assert row["candidates"].get("router", 0) == 0, row["candidates"]
    row = _sites(MoE(), (8, 32))  # its twin: over a fixed number of experts
    assert row["candidates"].get("router", 0) == 1, row["candidates"]


# --- families through the sweep ----------------------------------------------------------------

# A dense and a GPT-2 style decoder, a MoE and a recurrent model (RecurrentGemma: RG-LRU blocks
# beside local attention): each runs and matches eager. The state-space models (Mamba,
# Falcon-Mamba, Mamba-2) take 25-35 s each here, most of it Dynamo tracing their scans: the full
# sweep runs them.
# (``fxrewrite fails`` marks a regression; ``no build`` and wrappers are covered above.)
SUBSET = ("llama", "gpt2", "qwen3_moe", "recurrent_gemma")


@pytest.mark.slow
@pytest.mark.parametrize("family", [family_param(f) for f in SUBSET])
def test_representative_families_run_through_the_sweep(family: str) -> None:
    row = coverage.run_family(family, F32)
    assert row["status"] in ("fused", "partial"), row.get("error") or row["dtypes"]
    [f32] = row["dtypes"]
    assert f32["numerics_ok"] and f32["candidates"].get("norm", 0) >= 2
    if family == "qwen3_moe":
        assert f32["candidates"].get("router", 0) >= 1


def test_a_site_whose_match_was_rejected_is_explained_by_the_rejection() -> None:
    """Verification refused the match at the site's reader (a size with no hint): that is why it
    is left unfused; a rejection elsewhere explains nothing."""
    from fxrewrite.report import Rejected

    site = {"kind": "gated_act", "node": "silu_3", "module": "mlp.act_fn", "source": "activations.py:103"}
    refused = Rejected("act_mul", "mul_59", "modeling.py:64", "verify: cannot check this site: size u2 + 2 has no hint")
    why = coverage._explained(site, [], [refused], {"mul_59"})
    assert why == "act_mul rejected: verify: cannot check this site: size u2 + 2 has no hint"
    assert coverage._explained(site, [], [refused], {"mul_60"}) is None
