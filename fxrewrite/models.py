"""Built-in models for the CLI, tests and benchmarks: HF transformers decoders at tiny widths with
random weights (no download). Needs ``transformers`` (the ``test`` extra)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "olmo2", "phi3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "olmoe")
"""Mixture-of-experts decoders: Mixtral (renormalized top-k), Qwen2-MoE (a shared expert beside
the routed ones), OLMoE (top-k weights as the softmax gives them)."""
MODELS = FAMILIES + MOE_FAMILIES
# Config fields a family needs at these tiny widths (token ids inside the vocabulary).
_EXTRA: dict[str, dict[str, Any]] = {"phi3": {"pad_token_id": 0}, "olmo2": {"eos_token_id": 0}, "olmoe": {"eos_token_id": 0}}


def _configs() -> dict[str, Callable[..., Any]]:
    try:
        import transformers as tf
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("built-in models need transformers: pip install 'fxrewrite[test]'") from e
    return {
        "llama": tf.LlamaConfig,
        "mistral": tf.MistralConfig,
        "qwen2": tf.Qwen2Config,
        "qwen3": tf.Qwen3Config,
        "gemma": tf.GemmaConfig,
        "olmo2": tf.Olmo2Config,  # RMSNorm scaled in float32, rounded once; post-norms; q/k norms
        "phi3": tf.Phi3Config,  # q/k/v and gate/up already merged in the checkpoint's layout
        "mixtral": tf.MixtralConfig,
        "qwen2_moe": tf.Qwen2MoeConfig,
        "olmoe": tf.OlmoeConfig,
    }


def _model_classes() -> dict[str, Any]:
    import transformers as tf

    return {
        "llama": tf.LlamaModel,
        "mistral": tf.MistralModel,
        "qwen2": tf.Qwen2Model,
        "qwen3": tf.Qwen3Model,
        "gemma": tf.GemmaModel,
        "olmo2": tf.Olmo2Model,
        "phi3": tf.Phi3Model,
        "mixtral": tf.MixtralModel,
        "qwen2_moe": tf.Qwen2MoeModel,
        "olmoe": tf.OlmoeModel,
    }


def _moe_options(family: str, hidden: int, intermediate: int, experts: int, top_k: int,
                 experts_implementation: str | None) -> dict[str, Any]:  # fmt: skip
    """The config fields of an MoE family: ``experts`` experts of width ``intermediate``, each
    token routed to ``top_k``; Qwen2-MoE adds a shared expert of twice that width."""
    if family not in MOE_FAMILIES:
        return {}
    options: dict[str, Any] = {"num_experts_per_tok": top_k, "experts_implementation": experts_implementation}
    if family == "mixtral":
        return {**options, "num_local_experts": experts}
    if family == "qwen2_moe":
        options.update(moe_intermediate_size=intermediate, shared_expert_intermediate_size=2 * intermediate,
                       decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    return {**options, "num_experts": experts}


def build(
    family: str,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 128,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    experts: int = 8,
    top_k: int = 2,
    experts_implementation: str | None = None,
) -> torch.nn.Module:
    """A ``transformers`` decoder (no LM head) of ``family`` with random weights, in eval mode.
    MoE families (:data:`MOE_FAMILIES`): ``experts`` experts of width ``intermediate`` (default
    ``hidden // 2``), ``top_k`` per token, run by ``experts_implementation`` (transformers'
    default when None: ``grouped_mm``)."""
    if family not in MODELS:
        raise ValueError(f"unknown model {family!r}; choose from {', '.join(MODELS)}")
    moe = family in MOE_FAMILIES
    intermediate = intermediate or (hidden // 2 if moe else 2 * hidden)
    cfg = _configs()[family](
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=vocab,
        max_position_embeddings=256,
        use_cache=False,
        **_moe_options(family, hidden, intermediate, experts, top_k, experts_implementation),
        **_EXTRA.get(family, {}),
    )
    torch.manual_seed(seed)
    model = _model_classes()[family](cfg).eval().to(dtype)
    return model


def example_inputs(model: torch.nn.Module, tokens: int = 8, batch: int = 1, seed: int = 1) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    return (torch.randint(0, vocab, (batch, tokens), generator=g),)


def hidden_states(out: Any) -> torch.Tensor:
    """The last hidden state of a transformers model output (or the tensor itself)."""
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state
