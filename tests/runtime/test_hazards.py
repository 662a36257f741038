"""The capture analyses of the pieces (fxrewrite.runtime.hazards): host syncs and transfers,
implicit copies (a device tensor indexed with a Python list, as Falcon's multi-query attention
spells it), data-dependent shapes, inputs written in place, trivial pieces, the node a failure
came from. No GPU: graphs carry fake CUDA values."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxrewrite.runtime.hazards import (
    failing_node,
    find_capture_hazards,
    host_lists,
    is_trivial,
    mutated_placeholders,
    read_on_host,
)
from helpers.graphs import Recorded, TinyLlama, llama_inputs, on_fake_device, record, seeded


@pytest.fixture(scope="module", params=[True, False], ids=["dynamic", "static"])
def llama(request: pytest.FixtureRequest) -> Recorded:
    pytest.importorskip("transformers")
    sizes = [8, 11] if request.param else [8]
    return record(seeded(TinyLlama), llama_inputs(sizes), dynamic=request.param)


def call_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


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
    assert "test_hazards.py" in hazard.source and "x.amax().item()" in str(hazard)


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


def on_device(f: Callable[..., Any], *inputs: torch.Tensor, host: Sequence[str] = ()) -> torch.fx.GraphModule:
    """symbolic_trace ``f``, propagate fake values on CPU, then move every tensor value to a fake
    CUDA device but those of the nodes named in ``host`` (this CPU build of torch cannot run
    indexing on fake CUDA tensors)."""
    gm = torch.fx.symbolic_trace(f)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    return on_fake_device(gm, host)


def split_heads(fused_qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Falcon's multi-query split (transformers 5.17 and 5.24, ``FalconAttention._split_heads``):
    one shared key head and one value head, picked with one-element lists."""
    fused = fused_qkv.view(2, 5, 4 + 2, 8)
    return fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]


def test_hazards_flag_a_device_tensor_indexed_with_a_python_list() -> None:
    """Why Falcon's capture failed on the H100 ("Cannot copy between CPU and CUDA tensors during
    CUDA graph capture unless the CPU tensor is pinned"): the list is a literal of the getitem, no
    node is a host tensor, and getitem was no transfer op; indexing builds a host tensor from it
    and copies it to the device on every call."""
    hazards = find_capture_hazards(on_device(split_heads, torch.randn(2, 5, 48)))
    assert [(h.node, h.op) for h in hazards] == [("getitem_1", "call_function getitem"),
                                                 ("getitem_2", "call_function getitem")]
    assert "Python list" in hazards[0].reason
    # slices, ints, None and Ellipsis index in place: no list, no hazard
    assert find_capture_hazards(on_device(lambda x: x[..., 1:3, None][0], torch.randn(2, 5, 8))) == []
    assert host_lists((Ellipsis, [-2], slice(None))) == [[-2]] and host_lists([0, 2]) == [[0, 2]]
    assert host_lists((0, slice(1, None))) == [] and host_lists([]) == []


def test_hazards_flag_a_device_op_reading_a_host_tensor_but_not_a_host_scalar() -> None:
    def f(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[i] + 1, x * i.sum()  # a host index tensor is copied; a 0-dim host value is an argument

    hazards = find_capture_hazards(on_device(f, torch.randn(4, 3), torch.tensor([0, 2]), host=("i", "sum_1")))
    assert [(h.node, h.reason) for h in hazards] == [
        ("getitem", "a device op reading the host tensor `i`: it is copied to the device first (a pageable copy)")]


def fills(x: torch.Tensor, v: torch.Tensor, w: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
    m = x > 0
    return (x.masked_fill(m, v), torch.masked_fill(x, m, value=v), x.index_fill(0, i, v),  # v: on the device
            x.masked_fill(m, w), x.masked_fill(m, -1.0), x.index_fill(0, i, 0.5))  # w: a CPU scalar; numbers


def test_hazards_flag_a_fill_value_read_on_the_host_from_the_device() -> None:
    """Why CPM-Ant's capture failed on the H100 ("operation not permitted when stream is
    capturing"): ``masked_fill`` and ``index_fill`` read a 0-dim value tensor with ``.item()``, a
    device-to-host copy and sync where it lives on the device. A CPU scalar is read on the host
    without a copy, a number is an argument: neither is a hazard."""
    inputs = torch.randn(4, 3), torch.tensor(1.0), torch.tensor(2.0), torch.tensor([0, 2])
    gm = on_device(fills, *inputs, host=("w",))
    hazards = find_capture_hazards(gm, host_scalars=())
    assert [(h.node, h.op) for h in hazards] == [("masked_fill", "call_method masked_fill"),
                                                 ("masked_fill_1", "call_function masked_fill"),
                                                 ("index_fill", "call_method index_fill")]
    assert hazards[0].reason.startswith("reads its value `v`, a device tensor, on the host")
    assert "device-to-host copy and sync" in hazards[0].reason
    nodes = {n.name: n for n in gm.graph.nodes}
    reads = {name: read_on_host(nodes[name]) for name in
             ("masked_fill", "masked_fill_1", "index_fill", "masked_fill_2", "masked_fill_3", "index_fill_1", "gt")}
    assert reads == {"masked_fill": (2, nodes["v"]), "masked_fill_1": ("value", nodes["v"]),
                     "index_fill": (3, nodes["v"]), "masked_fill_2": (2, nodes["w"]),
                     "masked_fill_3": None, "index_fill_1": None, "gt": None}


def test_failing_node_names_the_op_that_raised() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.relu()
        return y.view(3, 3) + 1  # 4 elements: the view raises

    gm = torch.fx.symbolic_trace(f)
    with pytest.raises(RuntimeError) as info:
        gm.forward(torch.randn(4))
    node = failing_node(gm, info.value)
    assert node is not None and (node.op, node.target) == ("call_method", "view")
    assert failing_node(gm, RuntimeError("raised elsewhere")) is None
