"""Tensor-parallel rules (rewrites/collective.py): all-reduce + residual add + RMSNorm (+ FP8).

The model code is written with ``torch.distributed._functional_collectives`` as a row-parallel
linear ends; the process group is a fake one (``torch.testing._internal.distributed.fake_pg``,
one process playing rank 0 of 2: its all-reduce returns its input), so eager and compiled runs
compute the same thing and the rules are tested in process, fast. The real sum over ranks is
tested in tests/runtime/test_collective_ops.py and tests/bench/test_tp_model.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers.rewrites import (
    BF16, DTYPE_MODES, F32, LlamaRMSNorm, check, fake_process_group, fused_nodes, quant_static, reasons, sites,
)  # fmt: skip

from fxrewrite.rewrites import collective

AR = "all_reduce_add_rms_norm"


@pytest.fixture(scope="module", autouse=True)
def fake_group() -> Iterator[None]:
    """Rank 0 of a fake 2-rank default group (and a second group of both ranks)."""
    with fake_process_group():
        yield


class RowParallelThenNorm(torch.nn.Module):
    """``o_proj`` of one rank, summed over the group, added to the residual, normed: the end of
    a tensor-parallel attention block. Returns the norm and the new residual."""

    def __init__(self, hidden: int = 64, reduce_op: str = "sum", group: object = None, also: bool = False) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm = LlamaRMSNorm(hidden)
        self.reduce_op, self.group, self.also = reduce_op, group, also

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = funcol.all_reduce(self.proj(x), self.reduce_op, self.group or dist.group.WORLD)
        h = y + residual
        out = (self.norm(h), h)
        return (*out, y * 2) if self.also else out


def _inputs(dtype: torch.dtype = F32, tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(tokens, 64, dtype=dtype), torch.randn(tokens, 64, dtype=dtype)


@DTYPE_MODES
def test_all_reduce_add_rms_norm(dtype: torch.dtype, dynamic: bool) -> None:
    r = check(RowParallelThenNorm().to(dtype), *_inputs(dtype), expect={AR: 1}, dynamic=dynamic)
    assert r.report.rules() == {AR: 1}
    assert not r.report.near_misses
    assert r.counts_before()["_c10d_functional.all_reduce"] == 1
    assert r.counts()["_c10d_functional.all_reduce"] == 0 and r.counts()["_c10d_functional.wait_tensor"] == 0


def test_the_fused_op_reduces_over_the_group_the_model_named() -> None:
    """Two groups of the same ranks: each site's op carries its own all-reduce's group name."""
    other = dist.new_group([0, 1])
    assert other.group_name != dist.group.WORLD.group_name

    def two(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = RowParallelThenNorm.forward(m1, x, r)[0]
        return a, RowParallelThenNorm.forward(m2, a, r)[0]

    m1, m2 = RowParallelThenNorm(), RowParallelThenNorm(group=other)
    r = check(two, *_inputs(), torch.ones(64), expect={AR: 2})
    names = [n.args[4] for n in fused_nodes(r, AR)]
    assert names == [dist.group.WORLD.group_name, other.group_name]


def test_all_reduce_add_rms_norm_quant_fp8() -> None:
    """Static FP8 quantization of the norm joins the fused op (the sum is returned too)."""
    scale = torch.tensor(0.05)

    def fn(x: torch.Tensor, residual: torch.Tensor, m: torch.nn.Module = RowParallelThenNorm()) -> tuple[torch.Tensor, ...]:
        out, h = m(x, residual)
        return quant_static(out, scale), h

    r = check(fn, *_inputs(), expect={"all_reduce_add_rms_norm_quant_fp8": 1}, exact=True)
    assert [s.rule for s in sites(r)] == ["all_reduce_add_rms_norm_quant_fp8"]


# -- negative twins: each one defect keeps the collective rule off ----------------------------


def test_not_when_the_reduced_value_has_another_reader() -> None:
    """``y`` is also read outside (``y * 2``): the fused kernel never materializes it alone.
    The add + norm still fuse (functional: ``y`` lives on)."""
    r = check(RowParallelThenNorm(also=True), *_inputs(), expect={"fused_add_rms_norm": 1})
    assert r.counts()["_c10d_functional.all_reduce"] == 1
    assert reasons(r, AR) == ["internal node `y` has 1 user(s) outside the match (`mul_2`)"]


def test_not_for_another_reduction() -> None:
    """A max-reduction is no sum: the collective stays, add + norm fuse (functional: the residual is a graph input)."""
    r = check(RowParallelThenNorm(reduce_op="max"), *_inputs(), expect={"fused_add_rms_norm": 1})
    assert r.counts()["_c10d_functional.all_reduce"] == 1
    assert reasons(r, AR) == ["`tensor` reduce_op: literal 'max' != 'sum'"]


def test_not_when_the_norm_weight_has_another_dtype() -> None:
    """bf16 activations with a float32 norm weight: the kernel would read the weight as bf16."""
    m = RowParallelThenNorm().to(BF16)
    m.norm.weight.data = m.norm.weight.data.float()
    r = check(m, *_inputs(BF16), expect={"fused_add_rms_norm": 1})
    assert reasons(r, AR) == ["guard: norm weight torch.float32 != input torch.bfloat16 (the fused kernel reads it as the input dtype)"]


def test_rules_are_listed_quant_first() -> None:
    assert [r.name for r in collective.RULES] == ["all_reduce_add_rms_norm_quant_fp8", AR]


def test_not_tried_on_a_graph_without_collectives() -> None:
    """A plain add + norm (no all-reduce in the graph) is no near miss of the collective rules."""

    def fn(x: torch.Tensor, residual: torch.Tensor, m: torch.nn.Module = LlamaRMSNorm(64)) -> tuple[torch.Tensor, ...]:
        h = x * 2 + residual
        return m(h), h

    r = check(fn, *_inputs(), expect={"fused_add_rms_norm": 1})
    assert reasons(r, AR) == [] and reasons(r, "all_reduce_add_rms_norm_quant_fp8") == []
