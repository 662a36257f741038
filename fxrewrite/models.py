"""Built-in models for the CLI, tests and benchmarks: HF transformers decoders at tiny widths with
random weights (no download). Needs ``transformers`` (the ``test`` extra)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma")


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
    }


def _model_classes() -> dict[str, Any]:
    import transformers as tf

    return {
        "llama": tf.LlamaModel,
        "mistral": tf.MistralModel,
        "qwen2": tf.Qwen2Model,
        "qwen3": tf.Qwen3Model,
        "gemma": tf.GemmaModel,
    }


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
) -> torch.nn.Module:
    """A ``transformers`` decoder (no LM head) of ``family`` with random weights, in eval mode."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model {family!r}; choose from {', '.join(FAMILIES)}")
    cfg = _configs()[family](
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=vocab,
        max_position_embeddings=256,
        use_cache=False,
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
