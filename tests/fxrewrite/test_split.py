"""Splitting at attention ops (fxrewrite.split) on Dynamo graphs, and the capture analyses.

The graph fixtures (recording backend, toy attention models, custom attention ops, tiny Llama)
live in tests/helpers/graphs.py, shared with tests/runtime/test_cudagraph*.py.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxrewrite.split import (
    Source,
    find_capture_hazards,
    is_trivial,
    mutated_placeholders,
    split_graph,
)
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


# ---------------------------------------------------------------------------------------
# Analyses: capture hazards, in-place writes, trivial pieces


def fake_graph(f: Callable[..., Any], *inputs: tuple[Sequence[int], str]) -> torch.fx.GraphModule:
    """symbolic_trace ``f``; fill node metadata from fake inputs (shape, device): no GPU needed."""
    gm = torch.fx.symbolic_trace(f)
    shape_env = ShapeEnv(allow_scalar_outputs=True, allow_dynamic_output_shape_ops=True)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env)
    with mode:
        fakes = [torch.empty(shape, device=device) for shape, device in inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    return gm


def test_hazards_flag_host_syncs_and_transfers() -> None:
    def f(x: torch.Tensor) -> Any:
        a = x * x.sum().item()
        b = x.cpu() + 1
        c = x.to("cpu")
        d = x.tolist()
        ok = x.to("cuda:0").float().view(-1)
        return a, b, c, d, ok

    hazards = find_capture_hazards(fake_graph(f, ((4,), "cuda:0")))
    assert [h.op for h in hazards] == ["call_method item", "call_method cpu", "call_method to", "call_method tolist"]
    assert "host" in hazards[0].reason and "host and device" in hazards[1].reason


def test_hazards_flag_a_host_list_to_the_device_but_not_an_empty_one() -> None:
    # transformers' KV caches start as torch.tensor([], device=...): no bytes move, no copy runs
    graph = torch.fx.Graph()
    with FakeTensorMode():
        values = {"empty": torch.empty(0, device="cuda:0"), "full": torch.empty(2, device="cuda:0")}
    for name, data in (("empty", []), ("full", [1.0, 2.0])):
        node = graph.call_function(torch.tensor, (data,), {"device": "cuda:0"})
        node.name, node.meta["example_value"] = name, values[name]
    graph.output(None)
    assert [h.node for h in find_capture_hazards(torch.fx.GraphModule({}, graph))] == ["full"]


def test_hazards_flag_data_dependent_shapes() -> None:
    def f(x: torch.Tensor) -> Any:
        return torch.nonzero(x), x.nonzero(), torch.ops.aten.masked_select.default(x, x > 0), x.unique()

    hazards = find_capture_hazards(torch.fx.symbolic_trace(f))
    assert [h.op for h in hazards] == ["call_function nonzero", "call_method nonzero",
                                       "call_function masked_select", "call_method unique"]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        rec = record(lambda x: torch.nonzero(x).float().sum(0), [(torch.randn(4),)], dynamic=False)
    assert [h.node for h in find_capture_hazards(rec.gm)][:1] == ["nonzero"]


def test_hazards_allow_host_scalars_but_not_device_items() -> None:
    def f(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        return x * eps.item()

    gm = fake_graph(f, ((4,), "cuda:0"), ((), "cpu"))
    assert find_capture_hazards(gm) == []  # eps: a one-element CPU placeholder
    assert [h.node for h in find_capture_hazards(gm, host_scalars=())] == ["item"]


def test_hazards_name_the_source_line_in_dynamo_graphs() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * x.amax().item()  # the flagged line

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        rec = record(f, [(torch.randn(4),)], dynamic=False)
    (hazard,) = find_capture_hazards(rec.gm)
    assert hazard.op == "call_method item" and "x.amax().item()" in hazard.source
    assert "test_split.py" in hazard.source and "x.amax().item()" in str(hazard)


def test_hazards_flag_synchronize_and_print() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch.cuda.synchronize)
    graph.call_function(print, (x,))
    graph.output(x)
    hazards = find_capture_hazards(torch.fx.GraphModule({}, graph), host_scalars=())
    assert [h.op for h in hazards] == ["call_function synchronize", "call_function print"]


def test_llama_has_only_host_scalar_items(llama: Recorded) -> None:
    assert find_capture_hazards(llama.gm) == []
    items = [n for n in call_nodes(llama.gm) if n.target == "item"]
    flagged = find_capture_hazards(llama.gm, host_scalars=())
    assert len(flagged) == len(items)  # 0 when Dynamo specialized the floats (dynamic=False)


def test_mutated_placeholders_through_views_operators_and_schemas() -> None:
    def f(x: torch.Tensor, buf: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        buf[0].add_(1)
        x.add_(1)
        torch.ops.fxrtest.attn_out(y, y, y, out.view(out.shape))
        return y * 2

    gm = torch.fx.symbolic_trace(f)
    assert mutated_placeholders(gm) == {"x", "buf", "out"}
    def g(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        b[0] += 1  # Dynamo: getitem, operator.iadd, operator.setitem
        c.mul_(2)
        return a + 1

    rec = record(g, [(torch.randn(3), torch.randn(3), torch.randn(3))], dynamic=False)
    assert mutated_placeholders(rec.gm) == {"l_b_", "l_c_"}


def test_is_trivial() -> None:
    assert is_trivial(torch.fx.symbolic_trace(lambda x: x.view(-1).transpose(0, 0)))
    assert not is_trivial(torch.fx.symbolic_trace(lambda x: x.view(-1) + 1))
    assert not is_trivial(torch.fx.symbolic_trace(lambda x: operator.add(x, 1)))
