"""bench/bench_moe.py on a machine without CUDA: the shapes it times, a clear exit, and on a tiny
layer on CPU that what it times agrees (HF's block, fxr.moe's reference) and its floor counts
the experts hit."""

from __future__ import annotations

import pytest
import torch

import bench_moe

TINY = bench_moe.Shape("mixtral", hidden=32, experts=8, top_k=2, width=16)
TINY_MANY = bench_moe.Shape("qwen3_moe", hidden=32, experts=16, top_k=4, width=8)


def test_the_shapes_are_the_issues() -> None:
    assert bench_moe.SHAPES["mixtral-8x7b"] == bench_moe.Shape("mixtral", 4096, 8, 2, 14336)
    assert bench_moe.SHAPES["128-experts"] == bench_moe.Shape("qwen3_moe", 2048, 128, 8, 768)
    assert bench_moe.TOKENS == (1, 8, 64, 512, 4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU exit")
@pytest.mark.parametrize("argv", [[], ["--quick"]])
def test_without_cuda_it_says_so(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_moe.main(argv) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_an_unknown_shape_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_moe.main(["--shapes", "mixtral-8x22b"])
    assert "unknown shape 'mixtral-8x22b'" in capsys.readouterr().err


@pytest.mark.parametrize("shape", [TINY, TINY_MANY], ids=["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_the_block_and_the_fused_call_agree_with_the_reference(shape: bench_moe.Shape, experts: str) -> None:
    """On CPU fxr.moe runs its reference; the HF block, in either experts implementation the
    bench times, must agree with it (the check the bench applies on the GPU)."""
    torch.manual_seed(0)
    (block,) = bench_moe.hf_blocks(shape, torch.device("cpu"))
    bench_moe.set_experts_implementation(block.experts.config, experts)
    x = torch.randn(12, shape.hidden).to(bench_moe.DTYPE)
    keep = ~bench_moe.routing(block, x, shape)[1]
    with torch.no_grad():
        want = bench_moe.reference_call(block, x, shape)
        assert bench_moe.check(bench_moe.fused_call(block, x, shape), want, keep) == "ok"
        assert bench_moe.check(bench_moe.hf_call(block, x), want, keep) == "ok"


def test_the_check_names_what_disagrees() -> None:
    """Negative twin: a wrong output is reported with its error, tied tokens left out."""
    want = torch.zeros(4, 8, dtype=bench_moe.DTYPE)
    got = want.clone()
    got[1, 2] = 1.0
    assert bench_moe.check(got, want, torch.tensor([True, True, True, True])) == "max abs err 1, 1 of 32 outside"
    assert bench_moe.check(got, want, torch.tensor([True, False, True, True])) == "ok"


def test_the_floor_counts_the_experts_the_tokens_pick() -> None:
    torch.manual_seed(0)
    (block,) = bench_moe.hf_blocks(TINY, torch.device("cpu"))
    x = torch.randn(1, TINY.hidden).to(bench_moe.DTYPE)
    ids, tie = bench_moe.routing(block, x, TINY)
    moved, hit = bench_moe.floor_bytes(block, x, TINY)
    assert hit == 2 == len(set(ids[0].tolist())) and not tie.any()
    router, experts, io = 8 * 32 * 2, 2 * 3 * 32 * 16 * 2, 2 * 32 * 2
    assert moved == router + experts + io


def test_a_tie_at_the_kth_place_is_flagged() -> None:
    """Two experts share the second-largest logit: which one top-2 picks is up to each
    implementation, so the bench leaves the token out of its checks."""
    (block,) = bench_moe.hf_blocks(TINY, torch.device("cpu"))
    block.gate.weight.zero_()
    block.gate.weight[0, 0], block.gate.weight[1, 0], block.gate.weight[2, 0] = 2.0, 1.0, 1.0
    x = torch.zeros(2, TINY.hidden, dtype=bench_moe.DTYPE)
    x[0, 0] = 1.0  # logits 2, 1, 1, 0...: a tie between experts 1 and 2 for the second place
    x[1, 1] = 1.0  # all logits 0: eight-way tie
    assert bench_moe.routing(block, x, TINY)[1].tolist() == [True, True]
    x[0, 0] = -1.0  # logits -2, -1, -1, 0 ...: the top two are among the five zeros: a tie still
    x[1, 1] = 0.0
    x[1, 0] = 3.0  # logits 6, 3, 3: experts 0, then a tie between 1 and 2
    assert bench_moe.routing(block, x, TINY)[1].tolist() == [True, True]
    block.gate.weight[2, 0] = 0.5  # logits 6, 3, 1.5: no tie for token 1
    assert bench_moe.routing(block, x, TINY)[1].tolist() == [True, False]


def test_a_row_checks_and_times_every_way(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The bench's plumbing on CPU: wall-clock timers stand in for CUDA graphs and events, the
    eager block for Inductor; every way is checked against the reference and timed."""
    import time

    def wall_ms(fn: object, reps: int) -> float:
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        return 1e3 * (time.perf_counter() - start)

    monkeypatch.setattr(bench_moe, "graph_ms", wall_ms)
    monkeypatch.setattr(bench_moe, "alone_ms", wall_ms)
    torch.manual_seed(0)
    blocks = bench_moe.hf_blocks(TINY, torch.device("cpu"), 2)
    row = bench_moe.measure("tiny", TINY, blocks, 5, 1, 1e9, bench_moe.hf_call, None)
    assert row.checks == dict.fromkeys(("fxr.moe", "HF eager", "Inductor", "HF loop"), "ok")
    assert all(t is not None and t > 0 for t in row.times.values()) and set(row.times) == set(row.checks)
    assert 2 <= row.hit <= 8 and row.ties == 0
    assert row.floor_ms == pytest.approx((8 * 32 * 2 + row.hit * 3 * 32 * 16 * 2 + 2 * 5 * 32 * 2) / 1e9 * 1e3)
    cells = row.cells()
    assert len(cells) == len(bench_moe.HEADER) and cells[:2] == ["tiny", "5"] and cells[-2:] == ["ok", "0"]
    assert capsys.readouterr().out.strip() == "| " + " | ".join(cells) + " |"
    assert blocks[0].experts.config is blocks[1].experts.config  # one config: one set of guards
    assert blocks[0].experts.config._experts_implementation == "grouped_mm"  # restored after the loop
