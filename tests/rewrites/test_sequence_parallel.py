"""Sequence parallelism (rewrites/sequence_parallel.py): which fused all-reduce + add + RMSNorm
sites become ``fxr.sp_reduce_add_rms_norm``, and what the report says of each.

In process, on a fake 2-rank group (its all-reduce returns its input), the numerics are those
of calls below the threshold (the fused all-reduce path; the fake group's reduce-scatter is no
sum). The sharded path's numbers, on real ranks, are in tests/runtime/test_sequence_parallel_ops.py
and tests/bench/test_tp_model.py (the tensor-parallel Llama against the unsharded model).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers.rewrites import BF16, F32, LlamaRMSNorm, check, fake_process_group, reasons, sites

import fxrewrite
from fxrewrite.config import Config
from fxrewrite.runtime.ops.quant import quant_fp8_static
from fxrewrite.runtime.ops.quant_block import quant_fp8_block
from fxrewrite.runtime.ops.quant_nvfp4 import quant_nvfp4
from fxrewrite.testing import compile_once

AR, SP, RULE = "all_reduce_add_rms_norm", "sp_reduce_add_rms_norm", "sequence_parallel"
OFF = 10**6  # a threshold no test call reaches: numerics through the all-reduce path


@pytest.fixture(scope="module", autouse=True)
def fake_group() -> Iterator[None]:
    with fake_process_group():
        yield


class TwoSites(torch.nn.Module):
    """Two row-parallel projections, each summed over the group, added to the residual stream
    and normed: the sum of the first is the residual of the second. ``leak``: what else reads
    a sum ("output": the last sum is returned; "reader": the first sum is also doubled)."""

    def __init__(self, hidden: int = 64, leak: str = "") -> None:
        super().__init__()
        self.p1, self.p2 = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(2))
        self.n1, self.n2 = LlamaRMSNorm(hidden), LlamaRMSNorm(hidden)
        self.leak = leak

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        group = dist.group.WORLD
        h1 = funcol.all_reduce(self.p1(x), "sum", group) + residual
        y1 = self.n1(h1)
        h2 = funcol.all_reduce(self.p2(y1), "sum", group) + h1
        out = (self.n2(h2),)
        if self.leak == "output":
            out += (h2,)
        if self.leak == "reader":
            out += (h1 * 2,)
        return out


def _inputs(dtype: torch.dtype = F32, tokens: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(tokens, 64, generator=g).to(dtype), torch.randn(tokens, 64, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_a_chain_becomes_sequence_parallel(dtype: torch.dtype) -> None:
    """Both sites sharded; the report names the pattern, the threshold and the shape per site."""
    r = check(TwoSites().to(dtype), *_inputs(dtype), expect={SP: 2}, sequence_parallel_min_tokens=OFF)
    assert r.counts()["_c10d_functional.all_reduce"] == 0
    assert [s.module for s in sites(r, RULE)] == ["n1", "n2"]
    note = sites(r, RULE)[0].note
    assert note.startswith("reduce-scatter -> add + RMSNorm on 1/2 of the rows -> all-gather at >= 1000000 rows"), note
    assert f"hidden 64, {dtype}" in note and "rows s" in note, note  # symbolic rows: decided per call
    assert reasons(r, RULE) == []


def test_the_report_says_which_capture_sizes_shard() -> None:
    r = check(TwoSites(), *_inputs(tokens=3), expect={SP: 2, "linear": 2}, sequence_parallel_min_tokens=8,
              mode="piecewise", capture_sizes=(1, 2, 4, 8, 16))  # 3 rows, padded to 4: the all-reduce path
    assert "capture sizes sharded: [8, 16], all-reduce: 3 smaller" in sites(r, RULE)[1].note


def test_off_by_default_and_a_threshold_of_at_least_one() -> None:
    r = check(TwoSites(), *_inputs(), expect={AR: 2})
    assert "sequence_parallel" not in [p.name for p in fxrewrite.pipeline(Config())]
    names = [p.name for p in fxrewrite.pipeline(Config(sequence_parallel_min_tokens=512))]
    assert names[names.index("fuse_collective") + 1] == "sequence_parallel"
    assert sites(r, RULE) == []
    with pytest.raises(ValueError, match="at least 1"):
        Config(sequence_parallel_min_tokens=0).resolved()


def test_a_static_row_count_below_the_threshold_keeps_the_fused_all_reduce() -> None:
    """Compiled for 7 rows (``dynamic=False``) with a threshold of 8: the graph keeps
    ``fxr.all_reduce_add_rms_norm``, and a note says why; with 7 it is sharded."""
    r = check(TwoSites(), *_inputs(), expect={AR: 2}, dynamic=False, sequence_parallel_min_tokens=8)
    notes = [n for g in r.report.graphs for n in g.notes if n.startswith(RULE)]
    assert len(notes) == 2 and notes[0].endswith("fused all-reduce kept, 7 rows (static) < 8"), notes
    r = compile_once(TwoSites(), *_inputs(), dynamic=False, sequence_parallel_min_tokens=7)  # no numerics: a fake group
    assert r.counts()["fxr.sp_reduce_add_rms_norm"] == 2 and "rows 7," in sites(r, RULE)[0].note


# -- negative twins: a sum read where only this rank's rows would be wrong ---------------------


def test_not_when_the_last_sum_is_a_graph_output() -> None:
    """The second site's sum is returned: it would hold only this rank's rows. The whole chain
    stays (the first site's sum is the second's residual: sharding one alone is wrong)."""
    r = check(TwoSites(leak="output"), *_inputs(), expect={AR: 2}, sequence_parallel_min_tokens=4)
    assert sites(r, RULE) == []
    why = "the sum is a graph output (only this rank's rows of it would be right)"
    got = reasons(r, RULE)
    assert got[1] == why and got[0].endswith(why) and got[0].startswith("in the chain of"), got


def test_not_when_a_sum_has_another_reader() -> None:
    r = check(TwoSites(leak="reader"), *_inputs(), expect={AR: 2}, sequence_parallel_min_tokens=4)
    assert sites(r, RULE) == []
    got = reasons(r, RULE)
    assert len(got) == 2 and "which would see only this rank's rows" in got[0] and "aten::mul.Tensor" in got[0], got


def test_nothing_to_shard_without_a_fused_all_reduce() -> None:
    """An all-reduce whose value is also read elsewhere does not fuse (the collective rule's
    near miss says why); a norm with no all-reduce before it is no site: neither is sharded."""

    class ReducedTwice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p, self.n = torch.nn.Linear(64, 64, bias=False), LlamaRMSNorm(64)

        def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
            y = funcol.all_reduce(self.p(x), "sum", dist.group.WORLD)
            h = y + residual
            return self.n(h), h, y * 2

    r = check(ReducedTwice(), *_inputs(), expect={"fused_add_rms_norm": 1}, sequence_parallel_min_tokens=4)
    assert sites(r, RULE) == [] and reasons(r, RULE) == []
    assert reasons(r, AR) == ["internal node `y` has 1 user(s) outside the match (`mul_2`)"]

    def plain(x: torch.Tensor, residual: torch.Tensor, m: torch.nn.Module = LlamaRMSNorm(64)) -> tuple[torch.Tensor, ...]:
        h = x * 2 + residual
        return m(h), h

    r = check(plain, *_inputs(), expect={"fused_add_rms_norm": 1}, sequence_parallel_min_tokens=4)
    assert sites(r, RULE) == [] and reasons(r, RULE) == []


QUANTIZERS = {
    "all_reduce_add_rms_norm_quant_fp8": lambda y: quant_fp8_static(y, torch.tensor(0.05)),
    "all_reduce_add_rms_norm_block_quant_fp8": lambda y: quant_fp8_block(y, 32),
    "all_reduce_add_rms_norm_quant_nvfp4": lambda y: quant_nvfp4(y, torch.tensor(300.0)),
}


@pytest.mark.parametrize("op", list(QUANTIZERS))
def test_a_quantized_site_is_not_sharded_and_says_so(op: str) -> None:
    """A site whose norm feeds a quantizer (static FP8, block FP8, NVFP4): the sharded op has no
    such output; the fused quant site stays, and the report names it."""

    norm = LlamaRMSNorm(64).to(BF16)

    def fn(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
        q = QUANTIZERS[op](norm(h))
        return (*q, h) if isinstance(q, tuple) else (q, h)

    r = check(fn, *_inputs(BF16), expect={op: 1}, sequence_parallel_min_tokens=4, dynamic=False, exact=True)
    assert sites(r, RULE) == []
    assert reasons(r, RULE) == [f"fxr::{op} (quantized output): no sharded form of it"]
