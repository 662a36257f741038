"""What every engine hook calls (fxrewrite/integrations/engine.py), with no engine installed:
fusing an engine's graph and recording it, its fused ops per layer, the engine's own kernels
named, constants handed over as inputs, the report of how an engine split the fused graph, and
the report logged and written to FXREWRITE_REPORT_DIR.
"""

from __future__ import annotations

import json
import logging
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
from helpers.engine import HIDDEN, EngineDecoder, tokens

from fxrewrite.integrations import engine
from fxrewrite.testing import assert_close

# layer 0's add + norm is functional: the residual it would overwrite is the graph's input
LAYERS = {
    "layers.0": {"rms_norm": 1, "fused_add_rms_norm": 1, "rotary_embedding": 1, "silu_and_mul": 1},
    "layers.1": {"fused_add_rms_norm_": 2, "rotary_embedding": 1, "silu_and_mul": 1},
    "norm": {"fused_add_rms_norm_": 1},
}


@torch.library.custom_op("fxrtest_engine::rms_norm", mutates_args=())
def engine_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An engine's own RMSNorm kernel: a custom op opaque to the rules."""
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@torch.library.custom_op("fxrtest_engine::scale", mutates_args=())
def engine_scale(x: torch.Tensor) -> torch.Tensor:
    """An engine op named like nothing fxrewrite fuses."""
    return 2 * x


@torch.library.custom_op("fxrtest_engine::cpu_fused_moe", mutates_args=())
def engine_moe(x: torch.Tensor) -> torch.Tensor:
    """An engine's MoE kernel: fxrewrite's ``moe`` is one of its words."""
    return x.clone()


@torch.library.custom_op("fxrtest_engine::rms_normalize", mutates_args=())
def engine_normalize(x: torch.Tensor) -> torch.Tensor:
    """Shares letters with ``rms_norm`` but not its words: not one of fxrewrite's ops."""
    return x.clone()


engine_rms_norm.register_fake(lambda x, w: torch.empty_like(x))
for _op in (engine_scale, engine_moe, engine_normalize):
    _op.register_fake(lambda x: torch.empty_like(x))


def compile_with(hook: Callable[[fx.GraphModule, list[Any]], Any], model: Any, *inputs: Any) -> Any:
    torch._dynamo.reset()
    return torch.compile(model, backend=hook, fullgraph=True, dynamic=True)(*inputs)


def fuse_whole(gm: fx.GraphModule, inputs: list[Any]) -> Any:
    engine.publish(engine.fuse(gm, inputs, engine="toy", stage="whole graph"))
    return gm


def test_fuse_records_the_fused_ops_per_layer(caplog: pytest.LogCaptureFixture) -> None:
    model, (pos, h, _) = EngineDecoder(), tokens()
    with torch.no_grad(), caplog.at_level(logging.INFO, logger=engine.log.name):
        out = compile_with(fuse_whole, model, pos, h)
        assert_close(out, model(pos, h))
    entry = engine.reports()[-1]
    assert (entry.engine, entry.stage, entry.layers) == ("toy", "whole graph", LAYERS)
    assert not entry.report.near_misses and not entry.report.rejected and not entry.engine_kernels
    table = entry.table()
    assert "fxrewrite on toy's graph (whole graph)" in table and "near misses: none" in table
    assert table in caplog.text, "publish logs the table"
    assert json.loads(json.dumps(entry.to_dict()))["fused_ops_by_layer"] == LAYERS


class WithEngineKernels(torch.nn.Module):
    """A norm the engine computes with its own kernel, then one written in torch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.fxrtest_engine.rms_norm(x, self.w)
        y = torch.ops.fxrtest_engine.scale(y)
        y = torch.ops.fxrtest_engine.rms_normalize(torch.ops.fxrtest_engine.cpu_fused_moe(y))
        h = y.float()
        return self.w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(y.dtype)


def test_the_engines_own_kernels_are_named_in_a_note() -> None:
    """The engine's ``rms_norm`` kernel is named (the rules cannot see into it), and so is its
    ``cpu_fused_moe`` (``moe`` one of its words); its ``scale`` and ``rms_normalize`` ops, named
    like nothing fxrewrite fuses, are not (negative twins); the torch norm still fuses."""
    compile_with(fuse_whole, WithEngineKernels(), torch.randn(4, HIDDEN))
    entry = engine.reports()[-1]
    assert entry.engine_kernels == {"fxrtest_engine::rms_norm": 1, "fxrtest_engine::cpu_fused_moe": 1}
    assert entry.report.fused_ops == {"rms_norm": 1}
    [note] = entry.report.notes
    assert ("the graph calls toy's own kernels for ops fxrewrite fuses (fxrtest_engine::cpu_fused_moe x1, "
            "fxrtest_engine::rms_norm x1)") in note  # fmt: skip


def test_publish_writes_the_report_where_asked(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine.REPORT_DIR_ENV, str(tmp_path / "reports"))
    compile_with(fuse_whole, EngineDecoder(), *tokens()[:2])
    [doc] = sorted((tmp_path / "reports").glob("toy-*.json"))
    assert json.loads(doc.read_text())["fused_ops_by_layer"] == LAYERS
    assert doc.with_suffix(".txt").read_text().startswith("fxrewrite on toy's graph")


def _split_at(gm: fx.GraphModule, op: str) -> list[types.SimpleNamespace]:
    """Pieces as an engine's splitter lists them (``SplitItem``: ``graph``, ``is_splitting_graph``),
    each call of ``fxr::<op>`` alone in its piece."""
    ids, part, at_op = {}, 0, set()
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        here = engine._op_name(n) == f"fxr::{op}"
        part += here
        ids[n] = part
        if here:
            at_op.add(part)
        part += here
    split = torch.fx.passes.split_module.split_module(gm, None, ids.__getitem__, keep_original_order=True)
    return [types.SimpleNamespace(graph=getattr(split, f"submod_{i}"), is_splitting_graph=i in at_op)
            for i in sorted(set(ids.values()))]  # fmt: skip


def test_fuse_then_split_hands_the_fused_graph_and_its_constants_over() -> None:
    """The engine's split gets the fused graph with the folded rotary cache as a trailing input
    (not a module constant) and the real cache as its value; the callable it returns gets the
    cache appended at every call; the report says how the engine split the graph."""
    owner = types.SimpleNamespace(piecewise_graphs=None)
    seen: dict[str, Any] = {}

    def split(graph: fx.GraphModule, inputs: list[Any]) -> Any:
        seen.update(graph=graph, inputs=inputs)
        owner.piecewise_graphs = _split_at(graph, "silu_and_mul")
        return graph

    def hook(gm: fx.GraphModule, inputs: list[Any]) -> Any:
        seen["dynamo_placeholders"] = len(gm.graph.find_nodes(op="placeholder"))
        return engine.fuse_then_split(split, owner, gm, inputs, engine="toy")

    model, (pos, h, _) = EngineDecoder(), tokens()
    with torch.no_grad():
        assert_close(compile_with(hook, model, pos, h), model(pos, h))
        assert_close(compile_with(hook, model, pos[:3], h[:3]), model(pos[:3], h[:3]))
    graph = seen["graph"]
    assert not graph.graph.find_nodes(op="get_attr")
    cache = graph.graph.find_nodes(op="placeholder")[-1]
    assert cache.name.startswith("fxr_rotary_cache") and len(seen["inputs"]) == seen["dynamo_placeholders"] + 1
    assert torch.equal(seen["inputs"][-1], model.layers[0].rotary.cos_sin_cache.float())
    entry = engine.reports()[-1]
    assert entry.stage == "before toy's split"
    assert entry.split == {"pieces": 3, "splitting_ops": {"fxr::silu_and_mul": 2}, "fused_ops_in_pieces": 7}


def test_lift_constants_leaves_a_graph_without_constants_alone() -> None:
    gm = fx.symbolic_trace(lambda x: x + 1)
    assert engine.lift_constants(gm) == (gm, [])
