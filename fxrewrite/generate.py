"""Greedy generation with a static KV cache: one loop for an eager model and a compiled one, so
that their tokens and step times compare like for like.

    model, tokenizer = models.load_smollm2()
    ids = models.chat_ids(tokenizer, "What is the capital of France?")
    eager = greedy(model, ids, tokens=32, cache=static_cache(model, 256))
    compiled = fxrewrite.Backend().compile(copy.deepcopy(model))
    fused = greedy(compiled, ids, tokens=32, cache=static_cache(compiled, 256))
    first_difference(eager.tokens, fused.tokens)     # None: the same 32 tokens

Why this loop, and not ``model.generate`` on a model whose forward is compiled: ``generate``
makes a ``DynamicCache``, whose keys and values grow by ``torch.cat`` every step. Dynamo then
compiles a prefill graph and one decode graph whose cache length is symbolic (no recompile per
step), but that graph's shapes change every step, so a CUDA-graph runner cannot capture it.
A ``transformers.StaticCache`` keeps the shapes fixed: the decode step is one graph of one shape
(``[1, 1]`` ids, caches of ``max_len`` slots written in place with ``index_copy_``), compiled once
and, in modes piecewise and full, captured once. Given a ``StaticCache``, ``generate`` would
itself wrap the forward in ``torch.compile`` with Inductor unless told not to, and its
per-step bookkeeping (logits processors, stopping criteria) would be timed with the model; this
loop is the few lines a serving engine's own loop reduces to. The cache is allocated up front
(``early_initialization``), outside the compiled region, where transformers marks its tensors as
static addresses: a CUDA-graph runner reads them in place instead of copying them in and out.

The same cache object serves every call of :func:`greedy` (it is reset in place): a new cache
would be a new object for Dynamo's guards.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxrewrite.backend import Backend


@dataclasses.dataclass
class Generation:
    """What :func:`greedy` produced: the new tokens (the prompt excluded) and how long each call
    took, in ms. ``prefill_ms``: the call on the prompt (the first one compiles); ``step_ms``: each
    decode step after it (the first of them compiles the decode graph)."""

    tokens: list[int]
    prefill_ms: float
    step_ms: list[float]

    def median_step_ms(self, skip: int = 1) -> float:
        """The median decode step, leaving out the first ``skip`` steps (compilation, capture)."""
        steps = self.step_ms[skip:] or self.step_ms
        return statistics.median(steps) if steps else float("nan")


def _base(model: Any) -> torch.nn.Module:
    """The module under a ``torch.compile`` wrapper."""
    return getattr(model, "_orig_mod", model)


def cache_inputs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword arguments of a forward over ``cache`` besides the ids: the cache, by the name
    the model's forward takes it (``cache`` from transformers 5.24 on, where ``past_key_values`` is
    deprecated; ``past_key_values`` before), ``use_cache`` and an attention mask over every cache
    slot, all ones (causality hides the slots not yet written).

    The mask's shape never changes, so no step recompiles (it is marked static: under
    ``dynamic=True`` its length would be one more symbol). Passing it keeps transformers building
    the causal mask as part of the graph in every version: 5.19 without one reads the cache's
    tensor length in a Python ``if`` (a StaticCache prefill shortcut), a data-dependent branch
    Dynamo refuses under ``fullgraph=True``."""
    params = inspect.signature(_base(model).forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    keys = getattr(cache.layers[0], "keys", None)
    if keys is None:
        raise ValueError("the cache is not allocated yet: make it with fxrewrite.generate.static_cache "
                         "(StaticCache.early_initialization: its tensors exist before the compiled call)")  # fmt: skip
    slots = max(layer.max_cache_len for layer in cache.layers)  # sliding layers read a window of it
    mask = torch.ones(keys.shape[0], slots, dtype=torch.long, device=keys.device)
    torch._dynamo.mark_static(mask)
    return {name: cache, "use_cache": True, "attention_mask": mask}


def static_cache(model: Any, max_len: int, batch: int = 1) -> Any:
    """A ``transformers.StaticCache`` of ``max_len`` positions for ``model`` (a causal LM or its
    compiled wrapper), allocated now in the model's dtype and device."""
    import transformers as tf

    base = _base(model)
    cfg = base.config.get_text_config(decoder=True)
    param = next(base.parameters())
    cache = tf.StaticCache(config=cfg, max_cache_len=max_len)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    cache.early_initialization(batch, kv_heads, head_dim, param.dtype, param.device)
    return cache


class _Clock:
    """Per-call times in ms: CUDA events around each call on a GPU (read once at the end), the
    host clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Times between consecutive marks, in ms."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def greedy(
    model: Callable[..., Any], input_ids: torch.Tensor, tokens: int, cache: Any, eos_token_id: int | None = None
) -> Generation:
    """Greedy decoding of ``tokens`` new tokens after ``input_ids`` ([1, T]) with ``cache`` (from
    :func:`static_cache`; reset first). Stops early after ``eos_token_id`` when given (that
    reads each token on the host, as any loop that stops must)."""
    if tokens < 1:
        raise ValueError(f"tokens must be at least 1, got {tokens}")
    capacity = min(layer.max_cache_len for layer in cache.layers)
    if input_ids.shape[-1] + tokens > capacity:
        raise ValueError(f"prompt ({input_ids.shape[-1]} tokens) + {tokens} new tokens do not fit the cache "
                         f"({capacity} positions)")  # fmt: skip
    cache.reset()
    kw = cache_inputs(model, cache)
    clock = _Clock(input_ids.device)
    out: list[torch.Tensor] = []
    with torch.no_grad():
        ids = input_ids
        for _ in range(tokens):
            clock.mark()
            ids = model(input_ids=ids, **kw).logits[:, -1:].argmax(-1)
            out.append(ids)
            if eos_token_id is not None and int(ids) == eos_token_id:
                break
        clock.mark()
    spans = clock.spans()
    return Generation(torch.cat(out, dim=1)[0].tolist(), spans[0], spans[1:])


def compile_for_generation(model: torch.nn.Module, mode: str = "none", **fields: Any) -> tuple[Any, Any]:
    """``(compiled, backend)``: ``Backend(mode=mode, **fields).compile(copy.deepcopy(model))`` (a
    copy: merging sibling linears re-lays the weights of the module it compiles).

    In modes piecewise and full only the decode step is captured (``capture_sizes=(1,)``) and
    inputs are not padded (``pad_inputs=False``); the prefill graph runs its pieces eagerly, with
    its fusions. Padding a prompt with zero rows would be wrong here: a ``StaticCache`` layer
    advances its own length by the token count it is called with (``cumulative_length.add_(n)``),
    so the padded rows would count as tokens and every later position would be off (on a CPU,
    ``index_copy_`` then runs out of the cache)."""
    if mode != "none":
        fields = {"capture_sizes": (1,), "max_capture_size": 1, "pad_inputs": False, **fields}
    backend = Backend(mode=mode, **fields)
    return backend.compile(copy.deepcopy(model)), backend


def logits(model: Callable[..., Any], input_ids: torch.Tensor) -> torch.Tensor:
    """The logits of one forward over ``input_ids`` ([1, T]) without a cache, as float32 [T, vocab]:
    what compares a model in two precisions position by position."""
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits[0].float()


def windows(input_ids: torch.Tensor, count: int, stride: int) -> list[torch.Tensor]:
    """``count`` slices of ``input_ids`` ([1, T]) of one width, starting ``stride`` tokens apart:
    one text read at several offsets. Every position and attention sum of a window differs from the
    next one's, so each window draws a low-precision model's rounding error afresh (what
    :func:`logit_error` averages over)."""
    width = input_ids.shape[-1] - stride * (count - 1)
    if count < 1 or stride < 1 or width < 1:
        raise ValueError(f"{count} windows {stride} tokens apart do not fit {input_ids.shape[-1]} tokens")
    return [input_ids[:, k * stride : k * stride + width] for k in range(count)]


def logit_error(model: Callable[..., Any], texts: Sequence[torch.Tensor], references: Sequence[torch.Tensor]) -> float:
    """Mean |logits - reference| over every position of every text (``references``: another model's
    :func:`logits` of each, say the float32 model's).

    Why several texts (:func:`windows`): in bf16 any change of rounding anywhere, even one GEMM
    output in 10^4 rounded the other way, redraws the rounding error of every later layer, so the
    error of one ~300-token text moves by about 5 % (one standard deviation, SmolLM2-135M) between
    two computations of equal precision, such as eager at one and at two CPU threads; the mean
    over n texts moves about sqrt(n) times less (``tests/fxrewrite/test_smollm2.py``)."""
    if len(texts) != len(references) or not texts:
        raise ValueError(f"{len(texts)} texts for {len(references)} references")
    errors = [(logits(model, ids) - ref).abs().mean().item() for ids, ref in zip(texts, references)]
    weights = [ids.shape[-1] for ids in texts]  # a mean over positions, whatever the widths
    return sum(e * w for e, w in zip(errors, weights)) / sum(weights)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where the token lists differ (a shorter list differs where it ends), or
    None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
