"""Common subexpressions (fxrewrite/cse.py, the library's first pass): a pure call repeated on
the same inputs is computed once; not across an in-place write, nor a random, in-place or
collective op, nor literals of another type (``1`` vs ``1.0``, ``0.0`` vs ``-0.0``).

The positive case is the one that matters to fusion: three projections that each quantize one
normed value (per token, FP8) leave one quantization, which the norm + quant rule then fuses.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from helpers.rewrites import BF16, DYNAMIC, F32, check, quant_per_token, sites

from fxrewrite import cse
from fxrewrite.canonicalize import CAST
from fxrewrite.runtime import providers

A = torch.ops.aten
HIDDEN = 64


def rms_norm(h: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    f = h.to(torch.float32)
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return w * f.to(h.dtype)


class ThreeQuantizations(torch.nn.Module):
    """q, k and v each quantize the normed value themselves (as FP8 linears do); ``write``: an
    in-place write of the normed value between the first quantization and the others."""

    def __init__(self, write: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.write = write

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = rms_norm(x, self.weight)
        q = quant_per_token(h)
        if self.write:
            h.mul_(2)
        k, v = quant_per_token(h), quant_per_token(h)
        return (*q, *k, *v)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@DYNAMIC
def test_repeated_quantizations_become_one_and_fuse_with_the_norm(dtype: torch.dtype, dynamic: bool | str) -> None:
    x = torch.randn(5, HIDDEN).to(dtype)
    r = check(ThreeQuantizations().to(dtype), x, expect={"rms_norm_dynamic_quant_fp8": 1}, dynamic=dynamic, exact=True)
    assert [s.rule for s in sites(r)] == ["rms_norm_dynamic_quant_fp8"]
    cse_pass = next(p for p in r.report.graphs[0].passes if p.name == "cse")
    assert cse_pass.matches >= 2 * 6  # two repeated chains of amax, clamp, div, div, clamp, cast (at least)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_no_merge_across_an_in_place_write(dtype: torch.dtype) -> None:
    """Negative twin: the normed value is written between the quantizations: the first reads
    it before, the others after; k and v (after the write) merge, q (before it) stays its own:
    no quantization fuses with the norm (it has two readers), each fuses alone, in its place
    (the first before the write), numerics as eager."""
    x = torch.randn(5, HIDDEN).to(dtype)
    r = check(ThreeQuantizations(write=True).to(dtype), x, expect={"rms_norm": 1, "dynamic_quant_fp8": 2}, exact=True)
    order = list(r.graph.graph.nodes)
    (write,) = [n for n in order if n.op == "call_method" and n.target == "mul_"]
    first, second = sorted((n for n in order if n.target == torch.ops.fxr.dynamic_quant_fp8.default), key=order.index)
    assert order.index(first) < order.index(write) < order.index(second)


class ThreeNvfp4Quantizations(torch.nn.Module):
    """q, k and v each NVFP4-quantize the normed value with one shared global scale (the recipe
    spells ``torch.where``, ``torch.round``, comparisons: Python-level calls that canonicalization
    keeps); ``mask``: a ``&`` of two masks between them (``operator.and_``: not an in-place write)."""

    def __init__(self, mask: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.register_buffer("global_scale", torch.tensor([300.0]))
        self.mask = mask

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from fxrewrite.runtime.ops.quant_nvfp4 import quant_nvfp4

        h = rms_norm(x, self.weight)
        q = quant_nvfp4(h, self.global_scale)
        extra = ((x > 0) & (x < 1),) if self.mask else ()
        return (*q, *extra, *quant_nvfp4(h, self.global_scale), *quant_nvfp4(h, self.global_scale))


@pytest.mark.parametrize("mask", [False, True], ids=["plain", "and-between"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_repeated_nvfp4_quantizations_become_one_and_fuse_with_the_norm(dtype: torch.dtype, mask: bool) -> None:
    x = torch.randn(5, HIDDEN).to(dtype)
    model = ThreeNvfp4Quantizations(mask).to(dtype)
    model.global_scale = model.global_scale.float()  # one float32 element in any dtype
    r = check(model, x, expect={"rms_norm_quant_nvfp4": 1}, exact=True)
    assert [s.rule for s in sites(r)] == ["rms_norm_quant_nvfp4"]


def test_python_level_pure_calls_are_pure_and_and_writes_nothing() -> None:
    import operator

    from fxrewrite import meta

    assert cse.pure(torch.where) and cse.pure(operator.lt) and not cse.pure(torch.cat)
    g = fx.Graph()
    x = g.placeholder("x")
    both = g.call_function(operator.and_, (x, x))
    assert meta.written_args(both) == [] and meta.written_args(g.call_function(operator.iand, (x, x))) == [x]


def graph_of(build) -> fx.GraphModule:  # noqa: ANN001
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(build(g, x))
    return fx.GraphModule(torch.nn.Module(), g)


def calls(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _abs_add(g: fx.Graph, x: fx.Node, cast: bool) -> fx.Node:
    y = g.call_function(A.add.Tensor, (g.call_function(A.abs.default, (x,)), 1))
    return g.call_function(CAST, (y, torch.float8_e4m3fn)) if cast else y


def test_identical_quantizing_chains_merge_and_their_users_follow() -> None:
    gm = graph_of(lambda g, x: (_abs_add(g, x, cast=True), _abs_add(g, x, cast=True)))
    assert cse.eliminate_common_subexpressions(gm) == 3
    assert calls(gm) == ["aten.abs.default", "aten.add.Tensor", "prims.convert_element_type.default"]
    gm.recompile()
    out = gm(torch.tensor([-1.0, 2.0]))
    assert out[0] is out[1] and torch.equal(out[0].float(), torch.tensor([2.0, 3.0]))


def test_a_repeated_chain_that_quantizes_nothing_stays() -> None:
    """Negative twin: the same chain without the cast to a one-byte dtype is left as written (a
    weighted and an unweighted norm of one value, merged, would fuse as neither:
    tests/rewrites/test_torch_rms_norm.py)."""
    gm = graph_of(lambda g, x: (_abs_add(g, x, cast=False), _abs_add(g, x, cast=False)))
    assert cse.eliminate_common_subexpressions(gm) == 0 and len(calls(gm)) == 4


def test_a_lone_repeated_call_read_by_different_computations_stays() -> None:
    """Negative twin: ``abs(x)`` twice, read by an add and by a mul: no repeated chain, so each
    computation keeps its own (merged, the node would sit inside one rule's pattern with a reader
    outside it, as a norm's ``x.float()`` shared with a quantization's)."""

    def build(g: fx.Graph, x: fx.Node) -> tuple:
        a, b = g.call_function(A.abs.default, (x,)), g.call_function(A.abs.default, (x,))
        return (g.call_function(A.add.Tensor, (a, 1)), g.call_function(A.mul.Tensor, (b, 2)))

    gm = graph_of(build)
    assert cse.eliminate_common_subexpressions(gm) == 0 and len(calls(gm)) == 4


@pytest.mark.parametrize("literals", [(1, 1.0), (0.0, -0.0), (1, True)], ids=["int-float", "signed-zero", "int-bool"])
def test_literals_of_another_type_or_sign_do_not_merge(literals: tuple) -> None:
    def build(g: fx.Graph, x: fx.Node) -> tuple:
        return tuple(g.call_function(A.add.Tensor, (x, v)) for v in literals)

    gm = graph_of(build)
    assert cse.eliminate_common_subexpressions(gm) == 0 and len(calls(gm)) == 2


def test_random_and_in_place_ops_do_not_merge() -> None:
    def build(g: fx.Graph, x: fx.Node) -> tuple:
        r1, r2 = g.call_function(A.rand_like.default, (x,)), g.call_function(A.rand_like.default, (x,))
        c = g.call_function(A.clone.default, (x,))
        w1, w2 = g.call_function(A.add_.Tensor, (c, 1)), g.call_function(A.add_.Tensor, (c, 1))
        return (r1, r2, w1, w2)

    gm = graph_of(build)
    assert cse.eliminate_common_subexpressions(gm) == 0
    gm.recompile()
    r1, r2, c, _ = gm(torch.zeros(64))
    assert not torch.equal(r1, r2) and torch.equal(c, torch.full((64,), 2.0))


def test_purity_of_op_kinds() -> None:
    import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)

    assert cse.pure(A.mul.Tensor) and cse.pure(torch.ops.prims.convert_element_type.default)
    assert cse.pure(torch.ops.fxr.linear_block_fp8.default)
    assert not cse.pure(A.add_.Tensor) and not cse.pure(A.rand_like.default) and not cse.pure(A.bernoulli.default)
    assert not cse.pure(torch.ops.fxr.all_reduce_add_rms_norm.default)  # a collective: two exchanges
    assert not cse.pure(torch.ops._c10d_functional.all_reduce.default)
    assert not providers.is_pure("fused_add_rms_norm_")  # in place
    assert not cse.pure(torch.ops.fxr.fused_add_rms_norm_.default)
