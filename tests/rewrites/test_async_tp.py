"""Async TP (rewrites/async_tp.py): which sequence-parallel sites take the GEMM before them and
the GEMM after them into their collectives, and what the report says of each.

In process, on a fake 2-rank group, numerics are those of calls below the threshold (the fake
group's reduce-scatter is no sum). On two gloo processes, a tensor-parallel block compiled on
each rank (sequence parallelism from 4 rows, async TP) equals the unsharded block computed in
one process: 7 rows (sharded, not a multiple of the ranks) and 3 (not sharded), with each half
of the rewrite and its negative twin. tests/bench/test_tp_model.py runs the whole TP Llama.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers.rewrites import BF16, F32, LlamaRMSNorm, check, fake_process_group, reasons, sites

import fxrewrite
from fxrewrite.config import Config
from fxrewrite.testing import op_counts, run_ranks

REDUCE, GATHER, SP, RULE = "sp_linear_reduce_add_rms_norm", "sp_all_gather_linear", "sp_reduce_add_rms_norm", "async_tp"
SITE = "sp_linear_reduce_add_rms_norm_linear"
OFF = 10**6  # a threshold no test call reaches: numerics through the all-reduce path
HIDDEN, INNER = 64, 96


class Block(torch.nn.Module):
    """A tensor-parallel layer's second half and the final norm: row-parallel ``o``, summed and
    added to the residual, normed; column-parallel ``up`` reads it, row-parallel ``down`` after
    it, summed, added, normed and returned. ``twin``: "bias" (``up`` has a bias: its all-gather
    stays), "scaled" (``o``'s output doubled before the sum: its GEMM stays), "both" (the
    scaling, and the norm read by ``up`` and by ``up2``: the first site stays whole). ``tp``
    False: no all-reduce (the unsharded block)."""

    def __init__(self, inner: int = INNER, width: int = HIDDEN, twin: str = "", tp: bool = True) -> None:
        super().__init__()
        self.o = torch.nn.Linear(width, HIDDEN, bias=False)
        self.up = torch.nn.Linear(HIDDEN, inner, bias=twin == "bias")
        self.up2 = torch.nn.Linear(HIDDEN, inner, bias=False) if twin == "both" else None
        self.down = torch.nn.Linear(inner, HIDDEN, bias=False)
        self.n1, self.n2 = LlamaRMSNorm(HIDDEN), LlamaRMSNorm(HIDDEN)
        self.twin, self.tp = twin, tp

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(t, "sum", dist.group.WORLD) if self.tp else t

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        scaled = self.o(x) * 2 if self.twin in ("scaled", "both") else self.o(x)
        h1 = self.reduce(scaled) + residual
        y1 = self.n1(h1)
        z = self.up(y1) if self.up2 is None else self.up(y1) + self.up2(y1)
        h2 = self.reduce(self.down(z)) + h1
        return self.n2(h2)


def _inputs(dtype: torch.dtype = F32, tokens: int = 7, width: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(tokens, width, generator=g).to(dtype), torch.randn(tokens, HIDDEN, generator=g).to(dtype)


class TestInProcess:
    @pytest.fixture(scope="class", autouse=True)
    def fake_group(self) -> Iterator[None]:
        with fake_process_group():
            yield

    @pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
    def test_both_gemms_move_into_the_first_site(self, dtype: torch.dtype) -> None:
        """Site 1: ``o`` + reduce-scatter, ``up`` + all-gather, one op; site 2 (its norm is the
        output): ``down`` + reduce-scatter, then the all-gather it had. No linear left outside."""
        r = check(Block().to(dtype), *_inputs(dtype), expect={SITE: 1, REDUCE: 1},
                  sequence_parallel_min_tokens=OFF, async_tp=True, async_tp_overlap_min_tokens=4096)  # fmt: skip
        assert r.counts()["aten.linear"] == 0, r.counts()
        first, second = (s.note for s in sites(r, RULE))
        assert first.startswith("`o` GEMM + reduce-scatter -> add + RMSNorm on 1/2 of the rows -> all-gather + `up` "
                                "GEMM at >= 1000000 rows, fused all-reduce + add + RMSNorm below"), first  # fmt: skip
        assert f"hidden 64, {dtype}" in first and "rows s" in first, first
        assert first.endswith("; one op: whole GEMMs around one exchange kernel below 4096 rows, each GEMM split by "
                              "the ranks' rows from there"), first  # fmt: skip
        site = next(n for n in r.graph.graph.nodes if n.target is torch.ops.fxr.sp_linear_reduce_add_rms_norm_linear.default)
        assert "up" in site.args[5].name and site.args[6:9] == (False, OFF, 4096), site.args
        assert second.startswith("`down` GEMM + reduce-scatter -> add + RMSNorm on 1/2 of the rows -> all-gather "
                                 "(the normed output is a graph output) at"), second  # fmt: skip
        assert reasons(r, RULE) == []

    def test_piecewise_the_gated_gemm_gathers_and_the_capture_sizes_are_named(self) -> None:
        """In piecewise mode the MLP's gate_up + SiLU-and-mul is ``fxr.linear_silu_and_mul``
        (select_gemm) when async TP runs: its all-gather op is gated."""

        class Gated(Block):
            def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
                h1 = self.reduce(self.o(x)) + residual
                gate, up = self.up(self.n1(h1)).chunk(2, dim=-1)
                return self.n2(self.reduce(self.down(torch.nn.functional.silu(gate) * up)) + h1)

        model = Gated()
        model.down = torch.nn.Linear(INNER // 2, HIDDEN, bias=False)
        r = check(model, *_inputs(tokens=3), expect={SITE: 1, REDUCE: 1},
                  sequence_parallel_min_tokens=8, async_tp=True, mode="piecewise", capture_sizes=(1, 2, 4, 8, 16))  # fmt: skip
        site = next(n for n in r.graph.graph.nodes if n.target is torch.ops.fxr.sp_linear_reduce_add_rms_norm_linear.default)
        assert site.args[6] is True and site.args[8] == 2048, site.args  # gated, the default overlap threshold
        assert "capture sizes sharded: [8, 16], all-reduce: 3 smaller" in sites(r, RULE)[0].note

    def test_off_by_default_and_only_with_sequence_parallelism(self) -> None:
        r = check(Block(), *_inputs(), expect={SP: 2}, sequence_parallel_min_tokens=OFF)
        assert sites(r, RULE) == []
        assert "async_tp" not in [p.name for p in fxrewrite.pipeline(Config(sequence_parallel_min_tokens=4))]
        names = [p.name for p in fxrewrite.pipeline(Config(sequence_parallel_min_tokens=4, async_tp=True, mode="piecewise"))]
        assert names.index("async_tp") == names.index("select_gemm") + 1, names
        with pytest.raises(ValueError, match="set sequence_parallel_min_tokens too"):
            Config(async_tp=True).resolved()
        with pytest.raises(ValueError, match="async_tp_overlap_min_tokens=0: at least 1"):
            Config(sequence_parallel_min_tokens=4, async_tp=True, async_tp_overlap_min_tokens=0).resolved()

    # -- negative twins: a half that cannot move keeps its collective ---------------------------

    def test_a_linear_with_a_bias_keeps_its_all_gather(self) -> None:
        r = check(Block(twin="bias"), *_inputs(), expect={REDUCE: 2}, sequence_parallel_min_tokens=OFF, async_tp=True)
        first = sites(r, RULE)[0].note
        assert first.startswith("`o` GEMM + reduce-scatter -> add + RMSNorm on 1/2 of the rows -> all-gather "
                                "(the normed output's reader `up` has a bias)"), first  # fmt: skip

    def test_a_scaled_projection_keeps_its_reduce_scatter(self) -> None:
        r = check(Block(twin="scaled"), *_inputs(), expect={REDUCE: 2, GATHER: 1}, sequence_parallel_min_tokens=OFF,
                  async_tp=True)  # fmt: skip
        first = sites(r, RULE)[0].note
        assert first.startswith("reduce-scatter (the reduced input `scaled` is aten::mul.Tensor, not a linear) -> add + "
                                "RMSNorm on 1/2 of the rows -> all-gather + `up` GEMM"), first  # fmt: skip
        node = next(n for n in r.graph.graph.nodes if n.target is torch.ops.fxr.sp_linear_reduce_add_rms_norm.default)
        assert node.args[1] is None and node.args[6] is False, node.args  # no GEMM, out left sharded

    def test_a_site_with_neither_half_stays_sequence_parallel(self) -> None:
        r = check(Block(twin="both"), *_inputs(), expect={SP: 1, REDUCE: 1}, sequence_parallel_min_tokens=OFF,
                  async_tp=True, merge_siblings=False)  # fmt: skip
        assert len(sites(r, RULE)) == 1
        why = reasons(r, RULE)
        assert len(why) == 1 and why[0].startswith("before: the reduced input `scaled` is aten::mul.Tensor, not a linear; "
                                                   "after: the normed output has 2 readers"), why  # fmt: skip


# --------------------------------------------------------------------------- two gloo ranks

TWINS = ("", "bias", "scaled")


def _shard(full: Block, rank: int, world: int) -> Block:
    """Rank ``rank``'s block: ``o`` and ``down`` by input columns (row-parallel), ``up`` by output
    rows (column-parallel, its bias too); norms replicated."""
    part = Block(INNER // world, HIDDEN // world, full.twin)
    with torch.no_grad():
        part.o.weight.copy_(full.o.weight.chunk(world, 1)[rank])
        part.up.weight.copy_(full.up.weight.chunk(world, 0)[rank])
        if full.up.bias is not None:
            part.up.bias.copy_(full.up.bias.chunk(world, 0)[rank])
        part.down.weight.copy_(full.down.weight.chunk(world, 1)[rank])
        part.n1.load_state_dict(full.n1.state_dict())
        part.n2.load_state_dict(full.n2.state_dict())
    return part


def tp_block_worker(rank: int, world: int) -> dict[str, Any]:
    """Per twin and mode: the sharded block compiled with SP from 4 rows and async TP, at 7 and
    3 rows, against the full block in this process; the fused op counts of each graph."""
    import fxrewrite.runtime.ops  # noqa: F401

    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for twin in TWINS:
        full = Block(twin=twin, tp=False)
        if full.up.bias is not None:
            torch.nn.init.normal_(full.up.bias)
        part = _shard(full, rank, world)
        for mode in ("none", "piecewise"):
            torch._dynamo.reset()
            backend = fxrewrite.Backend(mode=mode, capture_sizes=(3, 7), sequence_parallel_min_tokens=4, async_tp=True,
                                        progress=False)  # fmt: skip
            step = torch.compile(part, backend=backend, fullgraph=True, dynamic=True)
            errs = []
            for tokens in (7, 3, 7):
                x, residual = _inputs(tokens=tokens)
                with torch.no_grad():
                    want = full.eval()(x, residual)
                    got = step(x.chunk(world, 1)[rank], residual)
                errs.append(float((got - want).abs().max() / want.abs().max()))
            counts = [op_counts(g) for g in backend.graphs]
            out[f"{twin}/{mode}"] = {"errs": errs,
                                     "counts": [{k: c[f"fxr.{k}"] for k in (SITE, REDUCE, GATHER, SP)} for c in counts]}  # fmt: skip
    torch._dynamo.reset()
    return out


def test_a_sharded_block_equals_the_full_one_on_two_ranks() -> None:
    """Both halves moved (``o`` and ``up`` at the first site, one op, ``down`` at the second), and each
    twin with its half left in place, equal the unsharded block at a sharded row count (7: 4 rows
    a rank, one padding) and one below the threshold (3), eagerly and in emulated pieces."""
    results = run_ranks(tp_block_worker, backend="gloo", timeout=300)
    expect = {"": {SITE: 1, REDUCE: 1, GATHER: 0, SP: 0}, "bias": {SITE: 0, REDUCE: 2, GATHER: 0, SP: 0},
              "scaled": {SITE: 0, REDUCE: 2, GATHER: 1, SP: 0}}  # fmt: skip
    for rank, res in enumerate(results):
        for key, r in res.items():
            assert max(r["errs"]) < 1e-5, (rank, key, r)
            assert r["counts"] and all(c == expect[key.split("/")[0]] for c in r["counts"]), (rank, key, r)
