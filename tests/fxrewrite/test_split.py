"""Splitting at attention ops (fxrewrite.split) on Dynamo graphs (the capture analyses of the
pieces: tests/runtime/test_hazards.py).

The graph fixtures (recording backend, toy attention models, custom attention ops, tiny Llama)
live in tests/helpers/graphs.py, shared with tests/runtime/test_cudagraph*.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fxrewrite.runtime.hazards import find_capture_hazards
from fxrewrite.split import Source, split_graph
from helpers.graphs import SDPA, Recorded, TinyLlama, ToyAttention, llama_inputs, record, seeded, toy_inputs


def call_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


@pytest.fixture(scope="module")
def toy() -> Recorded:
    return record(seeded(ToyAttention), toy_inputs([8, 5, 13]), dynamic=True)


@pytest.fixture(scope="module")
def custom() -> Recorded:
    return record(seeded(lambda: ToyAttention("custom")), toy_inputs([8, 6]), dynamic=True)


@pytest.fixture(scope="module", params=[True, False], ids=["dynamic", "static"])
def llama(request: pytest.FixtureRequest) -> Recorded:
    pytest.importorskip("transformers")
    sizes = [8, 11] if request.param else [8]
    return record(seeded(TinyLlama), llama_inputs(sizes), dynamic=request.param)


def assert_same_outputs(split: Callable[..., Any], rec: Recorded) -> None:
    for args in rec.calls:
        torch.testing.assert_close(split(*args), rec.gm(*args), rtol=0, atol=0)


def assert_each_split_op_alone(sg: Any, is_op: Callable[[torch.fx.Node], bool]) -> None:
    for piece in sg.pieces:
        ops = [n for n in call_nodes(piece.submodule) if is_op(n)]
        assert len(ops) == (1 if piece.is_splitting else 0), piece.name
        if piece.is_splitting:
            assert piece.num_nodes == 1 and len(call_nodes(piece.submodule)) == 1


def test_toy_pieces_alternate_and_keep_semantics(toy: Recorded) -> None:
    sg = split_graph(toy.gm, [SDPA])
    assert [p.is_splitting for p in sg.pieces] == [False, True, False, True, False]
    assert [p.index for p in sg.pieces] == list(range(5)) and sg.num_splitting == 2
    assert sg.missing == ()
    assert_each_split_op_alone(sg, lambda n: n.target is SDPA)
    assert sum(p.num_nodes for p in sg.pieces) == len(call_nodes(toy.gm))
    assert len(toy.calls) == 3  # 8, 5 and 13 tokens, one dynamic graph
    assert_same_outputs(sg, toy)
    sg.module.graph.lint()


def test_pieces_keep_original_node_order(toy: Recorded) -> None:
    sg = split_graph(toy.gm, [SDPA])
    order = [str(n.target) for p in sg.pieces for n in call_nodes(p.submodule)]
    assert order == [str(n.target) for n in call_nodes(toy.gm)]


def test_symint_crosses_pieces_under_dynamic_shapes(toy: Recorded) -> None:
    sg = split_graph(toy.gm, [SDPA])
    for piece in sg.pieces:  # split_module hands the token count s0 to every piece whose shapes use it
        values = [ph.meta.get("example_value") for ph in piece.submodule.graph.find_nodes(op="placeholder")]
        assert any(isinstance(v, torch.SymInt) for v in values), piece.name
    assert {args[0] for args in toy.calls} == {8, 5, 13}
    assert_same_outputs(sg, toy)


def test_llama_splits_at_each_attention(llama: Recorded) -> None:
    sg = split_graph(llama.gm, [SDPA])
    assert [p.is_splitting for p in sg.pieces] == [False, True, False, True, False]
    assert_each_split_op_alone(sg, lambda n: n.target is SDPA)
    assert sg.summary()[1] == {"name": sg.pieces[1].name, "splitting": True, "nodes": 1}
    assert_same_outputs(sg, llama)


def test_sources_name_inputs_and_producers(llama: Recorded) -> None:
    sg = split_graph(llama.gm, [SDPA])
    inputs = list(llama.gm.graph.find_nodes(op="placeholder"))
    first = {inputs[s.index].name for s in sg.pieces[0].sources if s.kind == "input"}
    assert any("input_ids" in name for name in first)
    attention = sg.pieces[1].sources
    assert Source("piece", 0) in attention and all(s.kind in ("piece", "input") for s in attention)
    assert Source("piece", 1) in sg.pieces[2].sources  # the attention output feeds the next piece


@pytest.mark.parametrize("spec", [
    torch.ops.fxrtest.attn, torch.ops.fxrtest.attn.default, "fxrtest::attn", "fxrtest.attn.default",
], ids=["packet", "overload", "string", "string-overload"])
def test_custom_attention_op_specs(spec: Any, custom: Recorded) -> None:
    rec = custom
    sg = split_graph(rec.gm, [spec])
    assert [p.is_splitting for p in sg.pieces] == [False, True, False, True, False]
    assert sg.missing == ()
    assert_same_outputs(sg, rec)
    both = split_graph(rec.gm, [torch.ops.fxrtest.attn, torch.ops.fxrtest.attn.default])
    assert both.missing == () and both.num_splitting == 2


def test_out_variant_attention_writes_into_previous_piece_buffer() -> None:
    rec = record(seeded(lambda: ToyAttention("custom_out")), toy_inputs([8, 6]), dynamic=True)
    sg = split_graph(rec.gm, ["fxrtest::attn_out"])
    assert [p.is_splitting for p in sg.pieces] == [False, True, False, True, False]
    # the buffer the op writes (torch.empty_like) is made by the piece before and read after
    assert Source("piece", 0) in sg.pieces[1].sources and Source("piece", 0) in sg.pieces[2].sources
    assert_same_outputs(sg, rec)


def test_missing_ops_are_reported_not_raised(toy: Recorded) -> None:
    sg = split_graph(toy.gm, [SDPA, torch._C._nn.scaled_dot_product_attention, torch.ops.fxrtest.attn, "nope::op"])
    assert sg.missing == (torch.ops.fxrtest.attn, "nope::op")
    assert sg.num_splitting == 2
    whole = split_graph(toy.gm, ())
    assert len(whole.pieces) == 1 and not whole.pieces[0].is_splitting and whole.missing == ()
    assert_same_outputs(whole, toy)


def test_autocast_region_before_a_splitting_op() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):  # Dynamo: _enter_autocast / _exit_autocast nodes
            y = x.float() * 2
        return SDPA(y, y, y) + 1

    rec = record(f, [(torch.randn(2, 8, 4),)], dynamic=True)
    assert find_capture_hazards(rec.gm) == []
    sg = split_graph(rec.gm, [SDPA])
    assert [p.is_splitting for p in sg.pieces] == [False, True, False]
    assert_same_outputs(sg, rec)


def test_adjacent_and_leading_splitting_ops_make_no_empty_piece() -> None:
    def f(q: torch.Tensor) -> torch.Tensor:
        a = SDPA(q, q, q)
        return SDPA(a, a, a) * 2

    gm = torch.fx.symbolic_trace(f)
    sg = split_graph(gm, [SDPA])
    assert [(p.is_splitting, p.num_nodes) for p in sg.pieces] == [(True, 1), (True, 1), (False, 1)]
    q = torch.randn(2, 5, 8)
    torch.testing.assert_close(sg(q), f(q))


