"""SGLang (0.5.23) with fxrewrite fusing the graph its piecewise backend splits: the adapter
tested against SGLang's own interface code, as far as SGLang runs without CUDA.

SGLang's compilation backend does not import here: ``sglang.srt.compilation.backend`` imports
its CUDA piecewise backend, which raises ``NotImplementedError: weak_ref_tensor is implemented
only for CUDA, XPU, and NPU.`` at import. What runs here is SGLang's own code for everything else
the adapter touches: its plugin discovery (``load_plugins_by_group`` finds fxrewrite's entry
point), its ``HookRegistry`` (the AROUND hook fxrewrite registers) and its wrapper for that hook
(``_wrap_fn``, what ``apply_hooks`` installs), and its ``split_graph`` (read from the installed
``backend.py``: SGLang's splitter, which compares ``str(node.target)`` with ``sglang.<op>``).
SGLang's server, its piece compiler and its CUDA graphs are not run.

Skipped unless SGLang's package imports: ``pip install --no-deps sglang==0.5.23 orjson ipython``
is enough (its full install needs CUDA libraries).
"""

from __future__ import annotations

import ast
import importlib.util
import types
from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.fx as fx
from helpers.engine import EngineDecoder, stand_in_attention, tokens

from fxrewrite.integrations import engine
from fxrewrite.testing import assert_close

pytestmark = pytest.mark.engine
hooks = pytest.importorskip("sglang.srt.plugins.hook_registry", reason="SGLang is not installed")
plugins = pytest.importorskip("sglang.srt.plugins")

from fxrewrite.integrations import sglang as fxr_sglang  # noqa: E402

SPLIT_OP = "sglang.fxrtest_attention"  # SGLang names its splitting ops sglang.<op>


@torch.library.custom_op("sglang::fxrtest_attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Stands in for SGLang's attention op (``torch.ops.sglang.*``): opaque, where it splits."""
    return stand_in_attention(q, k, v)


attention.register_fake(lambda q, k, v: torch.empty_like(q))


def sglang_split_graph() -> Any:
    """SGLang's ``split_graph`` (and its ``SplitItem``), executed from the source of the
    installed ``sglang/srt/compilation/backend.py`` (whose imports need CUDA)."""
    origin = importlib.util.find_spec("sglang.srt.compilation.backend").origin
    tree = ast.parse(open(origin).read())
    wanted = [n for n in tree.body if getattr(n, "name", None) in ("SplitItem", "split_graph")]
    assert len(wanted) == 2, "SGLang's backend.py no longer defines SplitItem and split_graph"
    scope: dict[str, Any] = {"torch": torch, "fx": fx, "dataclasses": __import__("dataclasses")}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), origin, "exec"), scope)
    return scope["split_graph"]


class Backend:
    """SGLang's ``SGLangBackend`` as far as fxrewrite meets it: ``compile_config.split_ops``,
    ``__call__(graph, example_inputs)`` that splits with SGLang's ``split_graph`` and keeps
    ``piecewise_graphs``. Its piece compiler and CUDA graphs are not here."""

    def __init__(self) -> None:
        self.compile_config = types.SimpleNamespace(split_ops=[SPLIT_OP])
        self.piecewise_graphs: list[Any] = []

    def __call__(self, graph: fx.GraphModule, example_inputs: Any) -> Any:
        self.split_gm, self.piecewise_graphs = sglang_split_graph()(graph, self.compile_config.split_ops)
        return self.split_gm


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Any:
    """SGLang's HookRegistry, emptied for the test and restored after it."""
    monkeypatch.setattr(hooks.HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(hooks.HookRegistry, "_patched", set())
    return hooks.HookRegistry


def run_plugin() -> None:
    """What SGLang's ``load_plugins`` does for fxrewrite's entry point (then it applies hooks)."""
    found = plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP)
    func, dist = found["fxrewrite"]
    token = hooks._current_plugin_source.set(hooks.HookSource("fxrewrite", dist))
    try:
        func()
    finally:
        hooks._current_plugin_source.reset(token)


def test_sglang_finds_the_plugin_and_it_hooks_the_backend(registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fxr_sglang.ENABLE_ENV, "1")
    run_plugin()
    [(kind, hook, source)] = registry._hooks[fxr_sglang.TARGET]
    assert (kind, hook, source.plugin_name) == (hooks.HookType.AROUND, fxr_sglang.fuse_then_split, "fxrewrite")


def test_twin_without_the_switch_the_plugin_hooks_nothing(registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fxr_sglang.ENABLE_ENV, raising=False)
    run_plugin()
    assert not registry._hooks


def test_the_hooked_backend_splits_the_fused_graph() -> None:
    """SGLang's wrapper around ``__call__`` with fxrewrite's hook: the graph is fused, SGLang's
    splitter still finds its attention op (named as SGLang compares it), every fused op lands in
    a piece it compiles, and the stitched pieces compute the model at two token counts."""
    backend = Backend()
    call = hooks._wrap_fn(Backend.__call__, fxr_sglang.fuse_then_split, hooks.HookType.AROUND)
    model = EngineDecoder(attention=torch.ops.sglang.fxrtest_attention)
    before = len(engine.reports())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, inputs: call(backend, gm, inputs), fullgraph=True, dynamic=True)
    with torch.no_grad():
        for n in (6, 3):
            pos, h, _ = tokens(n)
            assert_close(compiled(pos, h), model(pos, h))
    [entry] = engine.reports()[before:]
    fused = sum(sum(ops.values()) for ops in entry.layers.values())
    assert entry.engine == "sglang" and entry.report.fused_ops["rotary_embedding"] == 2
    assert entry.split == {"pieces": 3, "splitting_ops": {"sglang::fxrtest_attention": 2}, "fused_ops_in_pieces": fused}
    assert [item.is_splitting_graph for item in backend.piecewise_graphs] == [False, True, False, True, False]


def _attention_graph() -> fx.GraphModule:
    g = fx.Graph()
    q = g.placeholder("q")
    a = g.call_function(torch.ops.sglang.fxrtest_attention.default, (q, q, q))
    g.output(g.call_function(torch.ops.aten.add.Tensor, (a, q)))
    return fx.GraphModule(torch.nn.Module(), g)


def test_restore_split_ops_names_the_op_as_sglang_compares_it() -> None:
    gm = _attention_graph()
    assert fxr_sglang.restore_split_ops(gm, [SPLIT_OP]) == 1
    [n] = [n for n in gm.graph.nodes if "fxrtest_attention" in str(n.target)]
    assert str(n.target) == SPLIT_OP and n.target is torch.ops.sglang.fxrtest_attention


def test_twin_restore_split_ops_leaves_other_ops_alone() -> None:
    gm = _attention_graph()
    assert fxr_sglang.restore_split_ops(gm, ["sglang.other_attention"]) == 0
    assert [str(n.target) for n in gm.graph.nodes if n.op == "call_function"] == [
        "sglang.fxrtest_attention.default", "aten.add.Tensor"]  # fmt: skip
