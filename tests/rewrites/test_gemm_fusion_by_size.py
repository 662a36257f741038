"""``Config.gemm_fusion_max_tokens``: the decode token counts replay the graph with the GEMM
fusions, the larger ones a second rewrite without them (fxrewrite/runtime/by_size.py).

On CPU the runner emulates its graphs with the same dispatch, so which rewrite served a call is
in each runner's counters; the fused ops run their references, so outputs match eager tightly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.rewrites import BF16, F32, fused
from test_linear_fused import FUSED, IDS, Decoder

import fxrewrite
from fxrewrite import precompile
from fxrewrite.runtime.by_size import BySize
from fxrewrite.runtime.cudagraph import Runner
from fxrewrite.testing import assert_close, op_counts

SIZES = (2, 4, 8, 16, 32)
# the same decoder without gemm_fusion: norms and adds of their own, every linear fxr.linear
PLAIN = {"fused_add_rms_norm_": 4, "rms_norm": 1, "linear": 6, "linear_silu_and_mul": 2}


def compiled(dtype: torch.dtype = F32, dynamic: bool = True, **kw: Any) -> tuple[Decoder, Any, fxrewrite.Backend]:
    """The decoder and its step compiled (at the first call: :func:`run`)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Decoder(dtype=dtype).eval()
    options = {"mode": "full", "gemm_fusion": True, "capture_sizes": SIZES, "progress": False, "cache": False, **kw}
    backend = fxrewrite.Backend(**options)
    return model, backend.compile(model, dynamic=dynamic), backend


def run(model: Decoder, step: Any, n: int) -> None:
    ids = torch.randint(0, 32, (n,))
    with torch.no_grad():
        assert_close(step(ids), model(ids))


@pytest.mark.parametrize("mode", ["full", "piecewise"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_decode_counts_replay_the_fused_graph_and_the_others_a_plain_one(mode: str, dtype: torch.dtype) -> None:
    model, step, backend = compiled(dtype, mode=mode)
    for n in (5, 20, 3, 40):  # fused (8), plain (32), fused (4), beyond the largest size: plain, eagerly
        run(model, step, n)
    (runner,) = backend.runners
    assert isinstance(runner, BySize) and runner.bound == 16
    small, large = runner.graphs
    assert small is backend.graphs[0]
    assert fused(op_counts(small)) == FUSED
    assert fused(op_counts(large)) == PLAIN
    s, l = runner.small.stats(), runner.large.stats()
    assert (s["capture_sizes"], l["capture_sizes"]) == ([2, 4, 8, 16], [32])
    assert (s["replays"], s["eager_calls"]) == (2, 0)
    assert (l["replays"], l["eager_calls"], l["eager_reasons"]) == (1, 1, {"beyond_max": 1})
    g = backend.report.graphs[0]
    assert g.serves == "1-16 tokens"
    assert [v.serves for v in g.variants] == ["17+ tokens, gemm_fusion off"]
    assert g.variants[0].fused_ops == PLAIN and g.fused_ops == FUSED
    assert backend.report.fused_ops() == FUSED  # what the report counts: the graph as configured
    backend.refresh_runtime()
    totals = g.runtime
    assert (totals["replays"], totals["eager_calls"], totals["calls"]) == (3, 1, 4)
    assert [v["tokens"] for v in totals["variants"]] == ["1-16", "17+"]
    table = backend.report.table()
    assert "graph 0, rewritten again for 17+ tokens, gemm_fusion off" in table and "of 17+ tokens: " in table
    assert backend.report.to_dict()["variants"][0]["fused_ops"] == PLAIN


def test_static_inputs_are_those_of_the_runner_that_serves_the_count() -> None:
    model, step, backend = compiled()
    run(model, step, 5)
    runner = backend.runners[0]
    assert runner.runner_for(16) is runner.small and runner.runner_for(17) is runner.large
    assert runner.runner_for(None) is runner.large
    (ids,) = [t for t in runner.static_inputs(5) if t is not None]
    (big,) = [t for t in runner.static_inputs(20) if t is not None]
    assert ids.shape == (8,) and big.shape == (32,)


@pytest.mark.parametrize("options", [
    {"gemm_fusion_max_tokens": None},  # gemm_fusion at every size
    {"capture_sizes": (2, 4, 8, 16)},  # every size on the fused side
    {"gemm_fusion_max_tokens": 1},  # none on it: gemm_fusion serves no size, off
    {"gemm_fusion": False},
], ids=["every-size", "all-small", "all-large", "off"])  # fmt: skip
def test_one_rewrite_where_one_side_serves_every_size(options: dict[str, Any]) -> None:
    model, step, backend = compiled(**options)
    run(model, step, 5)
    run(model, step, 20)
    (runner,) = backend.runners
    assert isinstance(runner, Runner) and not backend.report.graphs[0].variants
    on = options.get("gemm_fusion", True) and options.get("gemm_fusion_max_tokens", 16) != 1
    assert fused(op_counts(backend.graphs[0])) == (FUSED if on else PLAIN)


def test_a_graph_of_static_shapes_is_rewritten_once() -> None:
    """No token count to choose a rewrite by: the graph as configured, for its one shape."""
    model, step, backend = compiled(dynamic=False)
    run(model, step, 5)
    (runner,) = backend.runners
    assert isinstance(runner, Runner) and not backend.report.graphs[0].variants
    assert fused(op_counts(backend.graphs[0])) == FUSED


def test_the_compile_cache_serves_both_rewrites(tmp_path: Path) -> None:
    model, step, first = compiled(cache=True, cache_dir=str(tmp_path))
    run(model, step, 5)
    model, step, second = compiled(cache=True, cache_dir=str(tmp_path))
    run(model, step, 20)
    run(model, step, 5)
    assert len(list((tmp_path / "graphs").glob("*/*.json"))) == 2
    assert (first.report.cache["stored"], second.report.cache["hits"]) == (2, 2)
    assert second.runners[0].large.stats()["replays"] == 1
    assert second.report.graphs[0].variants[0].fused_ops == PLAIN
    assert fused(op_counts(second.runners[0].large.gm)) == PLAIN


def test_dumps_name_the_second_rewrite(tmp_path: Path) -> None:
    run(*compiled(dump_dir=str(tmp_path))[:2], 5)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.startswith("00.") for n in names) and any(n.startswith("g0.large.00.") for n in names)
    assert [n for n in names if "fuse_gemm_norm" in n] == ["13.fuse_gemm_norm.after.py", "13.fuse_gemm_norm.before.py"]


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="gemm_fusion_max_tokens=0"):
        fxrewrite.Backend(mode="full", gemm_fusion=True, gemm_fusion_max_tokens=0)


@pytest.mark.skipif(precompile.SerializableCallable is object, reason="torch without AOT precompile")
def test_a_precompiled_artifact_keeps_one_rewrite_and_says_so() -> None:
    """An artifact holds one graph: the fused one serves every size, and the report says why."""
    torch._dynamo.reset()
    model = Decoder().eval()
    backend = fxrewrite.Backend(mode="full", gemm_fusion=True, capture_sizes=SIZES, progress=False, cache=False)
    step = backend.aot_compile(model, (IDS,))
    run(model, step, 20)
    assert not backend.report.graphs[0].variants
    assert fused(op_counts(backend.graphs[0])) == FUSED
    assert any("aot_compile keeps one rewrite" in n for n in backend.report.graphs[0].notes)


def test_a_token_range_above_the_bound_gets_the_plain_rewrite_only() -> None:
    """Dynamo compiled the token count for 20 and more: no capture size it serves is a decode
    size, so gemm_fusion serves nothing and the one rewrite is without it."""
    torch._dynamo.reset()
    model = Decoder().eval()
    backend = fxrewrite.Backend(mode="full", gemm_fusion=True, capture_sizes=SIZES, progress=False, cache=False)
    step = backend.compile(model, dynamic=None)
    ids = torch.randint(0, 32, (24,))
    torch._dynamo.mark_dynamic(ids, 0, min=20, max=64)
    with torch.no_grad():
        assert_close(step(ids), model(ids))
    (runner,) = backend.runners
    assert isinstance(runner, Runner) and runner.stats()["capture_sizes"] == [32]
    assert fused(op_counts(backend.graphs[0])) == PLAIN and not backend.report.graphs[0].variants


@pytest.mark.skipif(precompile.SerializableCallable is object, reason="torch without AOT precompile")
def test_a_precompiled_graph_above_the_bound_keeps_the_configured_rewrite() -> None:
    """No decode size in the token range, which without aot_compile means no gemm_fusion: the
    artifact still holds the graph as configured (its key is the configuration's), and says so."""
    torch._dynamo.reset()
    model = Decoder().eval()
    backend = fxrewrite.Backend(mode="full", gemm_fusion=True, capture_sizes=SIZES, progress=False, cache=False)
    ids = torch.randint(0, 32, (24,))
    torch._dynamo.mark_dynamic(ids, 0, min=20, max=64)
    step = backend.aot_compile(model, (ids,), dynamic=None)
    run(model, step, 24)
    assert fused(op_counts(backend.graphs[0])) == FUSED
    assert any("aot_compile keeps one rewrite" in n for n in backend.report.graphs[0].notes)
