"""Fuse one graph a serving engine captured, and keep the report of it.

An engine hook (vLLM's Dynamo backend or piecewise plugin, SGLang's plugin) calls :func:`fuse`
with the graph Dynamo captured and the inputs Dynamo passed with it (the real weights and
buffers: rotary tables fold from them). fxrewrite runs its pipeline in mode ``"none"``: the graph
is rewritten in place and handed back; the engine then splits it at its own splitting ops, runs
its own attention and captures its own CUDA graphs, as it did without fxrewrite::

    %h = pow/mean/rsqrt/mul ... (vLLM's RMSNorm, native)   ->  %h = fxr.rms_norm(%x, %w, 1e-06)
    %o = vllm.unified_attention_with_output(%q, ...)       ->  (kept: the engine's op, its split point)

Each call records an :class:`EngineGraph` in this process (:func:`reports`), logs its report
with the fused ops per layer, and, with ``FXREWRITE_REPORT_DIR`` set, writes it there as
``<engine>-<pid>-<n>.json`` and ``.txt``: engines compile in worker processes. A graph in which
the engine already calls its own kernels for what fxrewrite fuses (``_C::rotary_embedding``, a
custom op left on) gets a note naming them: those sites are opaque to the rules.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from fxrewrite import meta
from fxrewrite.backend import Backend
from fxrewrite.config import Config
from fxrewrite.fingerprint import Uncacheable
from fxrewrite.passes import prepare_dump_dir
from fxrewrite.precompile import FusedGraph
from fxrewrite.report import GraphReport, _table
from fxrewrite.runtime.ops import OPS

log = logging.getLogger(__name__)

REPORT_DIR_ENV = "FXREWRITE_REPORT_DIR"
_LAYER = re.compile(r"layers?[\[.](\d+)")  # `layers[3]`, `layers.3`, `model.layer.3`
_RECORDED: list[EngineGraph] = []  # this process's engine graphs, in compile order


@dataclasses.dataclass
class EngineGraph:
    """One engine graph fxrewrite fused: which engine, at which stage, the report, and the fused
    ops per layer (``{"layers.0": {"rms_norm": 1, ...}, "norm": {...}}``)."""

    engine: str
    stage: str
    report: GraphReport
    layers: dict[str, dict[str, int]]
    engine_kernels: dict[str, int]
    split: dict[str, Any] = dataclasses.field(default_factory=dict)  # how the engine split the fused graph
    compiled: Any = None  # fuse(serializable=...): the graph for the engine's AOT compile

    def to_dict(self) -> dict[str, Any]:
        g = self.report
        return {
            "engine": self.engine,
            "stage": self.stage,
            "fused_ops": g.fused_ops,
            "fused_ops_by_layer": self.layers,
            "engine_kernels": self.engine_kernels,
            "split": self.split,
            "rules": dict(collections.Counter(s.rule for s in g.sites)),
            "near_misses": [dataclasses.asdict(m) for m in g.near_misses],
            "rejected": [dataclasses.asdict(r) for r in g.rejected],
            "notes": list(g.notes),
            "nodes_before": g.nodes_before,
            "nodes_after": g.nodes_after,
            "rewrite_ms": round(g.rewrite_ms, 2),
        }

    def table(self) -> str:
        """The fused ops per layer, then near misses, rejected rewrites and notes."""
        g = self.report
        ops = sorted({op for counts in self.layers.values() for op in counts})
        out = [f"fxrewrite on {self.engine}'s graph ({self.stage}): {g.nodes_before} -> {g.nodes_after} nodes "
               f"in {g.rewrite_ms:.0f} ms; fused ops: "
               + (", ".join(f"{k} x{v}" for k, v in sorted(g.fused_ops.items())) or "none")]  # fmt: skip
        if ops:
            rows = [[where] + [counts.get(op, "") for op in ops] for where, counts in self.layers.items()]
            out.append(_table(["layer"] + ops, rows))
        if self.split:
            sp = self.split
            at = ", ".join(f"{k} x{v}" for k, v in sorted(sp["splitting_ops"].items())) or "no splitting op"
            out.append(f"{self.engine} split it into {sp['pieces']} pieces it compiles, at {at}; "
                       f"fused ops inside those pieces: {sp['fused_ops_in_pieces']}")  # fmt: skip
        if g.near_misses:
            out.append(f"near misses ({len(g.near_misses)}):")
            out.append(_table(["rule", "site", "source", "reason"],
                              [[m.rule, m.site, m.source, m.reason] for m in g.near_misses]))  # fmt: skip
        else:
            out.append("near misses: none")
        out += [f"REJECTED {r.rule} at {r.site} ({r.source}): {r.reason}" for r in g.rejected]
        out += [f"note: {n}" for n in g.notes]
        return "\n".join(out)


def engine_config(**overrides: Any) -> Config:
    """The configuration under an engine: mode ``"none"`` (the engine owns splitting and CUDA
    graphs); ``FXREWRITE_DUMP_DIR``, ``FXREWRITE_VERIFY``, ``FXREWRITE_PROVIDER`` apply as usual."""
    return Config(mode="none", **overrides)


def fuse(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    engine: str,
    stage: str,
    config: Config | None = None,
    serializable: type[FusedGraph] | None = None,
) -> EngineGraph:
    """Rewrite ``gm`` in place with fxrewrite's pipeline; the record of it (kept in this process:
    :func:`reports`; :func:`publish` logs and writes it). ``engine`` and ``stage`` name where the
    graph came from (``"vllm"``, ``"whole graph"``) in the report. ``serializable``: for an
    engine's AOT compile, the record's ``compiled`` is the graph as that subclass of
    :class:`~fxrewrite.precompile.FusedGraph` (None when the graph cannot be keyed, logged)."""
    kernels = engine_kernels(gm)
    backend = Backend(config or engine_config())
    backend._precompiling = serializable
    try:
        compiled = backend(gm, list(example_inputs))
    except Uncacheable as e:  # raised before any pass: the graph is as it was
        log.info("fxrewrite: %s's graph is fused but cannot be precompiled: %s", engine, e)
        backend._precompiling, compiled = None, None
        backend(gm, list(example_inputs))
    report = backend.report.graphs[-1]
    entry = _record(gm, report, engine, stage, kernels)
    entry.compiled = compiled if serializable is not None else None
    return entry


def loaded(gm: fx.GraphModule, report: GraphReport, *, engine: str, stage: str) -> EngineGraph:
    """The record of a graph an engine loaded from its precompiled artifact (no pass ran)."""
    return _record(gm, report, engine, stage, engine_kernels(gm))


def _record(gm: fx.GraphModule, report: GraphReport, engine: str, stage: str, kernels: dict[str, int]) -> EngineGraph:
    if kernels:
        names = ", ".join(f"{k} x{v}" for k, v in sorted(kernels.items()))
        note = (f"the graph calls {engine}'s own kernels for ops fxrewrite fuses ({names}): they are opaque "
                "to the rules, which match the engine's native torch code (where it has such code for them: "
                "switch its custom ops off)")  # fmt: skip
        if note not in report.notes:  # a loaded report has it already
            report.notes.append(note)
    entry = EngineGraph(engine, stage, report, fused_ops_by_layer(gm), kernels)
    _RECORDED.append(entry)
    return entry


def publish(entry: EngineGraph, logger: logging.Logger | None = None) -> None:
    """Log ``entry``'s report (INFO, on the engine's logger where given) and, with
    ``FXREWRITE_REPORT_DIR`` set, write it there as ``<engine>-<pid>-<n>.json`` / ``.txt``."""
    logger = logger or log
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", entry.table())
    where = os.environ.get(REPORT_DIR_ENV)
    if where:
        stem = prepare_dump_dir(where) / f"{entry.engine}-{os.getpid()}-{_RECORDED.index(entry)}"
        Path(f"{stem}.json").write_text(json.dumps(entry.to_dict(), indent=2, default=str))
        Path(f"{stem}.txt").write_text(entry.table() + "\n")


def fuse_then_split(
    split: Callable[[fx.GraphModule, list[Any]], Any],
    owner: Any,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    engine: str,
    logger: logging.Logger | None = None,
) -> Any:
    """What an engine's piecewise backend runs with fxrewrite in front: fuse ``gm``, hand the
    fused graph to the engine's own ``split(graph, inputs)`` (its splitting, piece compilers and
    CUDA graphs), return what that returns. Constants the passes added are handed over as
    trailing inputs and appended at each call (:func:`lift_constants`). ``owner``: the engine's
    backend object; its ``piecewise_graphs`` (vLLM's and SGLang's name) say how it split."""
    entry = fuse(gm, example_inputs, engine=engine, stage=f"before {engine}'s split")
    lifted, consts = lift_constants(gm)
    compiled = split(lifted, [*example_inputs, *consts])
    entry.split = describe_split(getattr(owner, "piecewise_graphs", None) or [])
    publish(entry, logger)
    return functools.partial(_with_constants, compiled, tuple(consts)) if consts else compiled


def _with_constants(compiled: Callable[..., Any], consts: tuple[Any, ...], *args: Any) -> Any:
    return compiled(*args, *consts)


def describe_split(items: Sequence[Any]) -> dict[str, Any]:
    """How an engine split a fused graph: its pieces (objects with ``.graph`` and
    ``.is_splitting_graph``, as vLLM's and SGLang's ``SplitItem``), the splitting ops, and the
    fused ops that landed inside the pieces it compiles."""
    if not items:
        return {}
    ops: collections.Counter[str] = collections.Counter()
    fused = 0
    for item in items:
        for n in item.graph.graph.nodes:
            name = _op_name(n)
            if name is None:
                continue
            if item.is_splitting_graph:
                ops[name] += 1
            elif name.startswith("fxr::"):
                fused += 1
    pieces = sum(1 for item in items if not item.is_splitting_graph)
    return {"pieces": pieces, "splitting_ops": dict(ops), "fused_ops_in_pieces": fused}


def lift_constants(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """A copy of ``gm`` whose constants (``get_attr``: a folded rotary cache, merged weights) are
    trailing placeholders, and their values: for an engine whose own code generation takes only
    inputs (vLLM's stitching of split pieces); the caller passes the values after the engine's
    inputs. ``gm`` itself is left as it is (Dynamo still owns its placeholders)::

        %cache = get_attr[fxr_rotary_cache_0]   ->   %fxr_rotary_cache_0 = placeholder (last)
    """
    if not gm.graph.find_nodes(op="get_attr"):
        return gm, []
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    last = list(graph.find_nodes(op="placeholder"))[-1:]
    values: list[torch.Tensor] = []
    for n in list(graph.find_nodes(op="get_attr")):
        values.append(functools.reduce(getattr, n.target.split("."), gm))
        with graph.inserting_after(last[0]) if last else graph.inserting_before(next(iter(graph.nodes))):
            p = graph.placeholder(n.target.replace(".", "_"))
        p.meta.update(n.meta)
        n.replace_all_uses_with(p)
        graph.erase_node(n)
        last = [p]
    return fx.GraphModule(gm, graph), values


def reports() -> list[EngineGraph]:
    """The engine graphs fxrewrite fused in this process, in compile order."""
    return list(_RECORDED)


def fused_ops_by_layer(gm: fx.GraphModule) -> dict[str, dict[str, int]]:
    """Calls of ``torch.ops.fxr.*`` grouped by the decoder layer they came from (``layers.N``,
    from the replaced code's module path), other modules by their own path, in graph order."""
    groups: dict[str, collections.Counter[str]] = {}
    for n in gm.graph.nodes:
        name = _fxr_name(n)
        if name is None:
            continue
        path = meta.module_path(n)
        m = _LAYER.search(path)
        where = f"layers.{m.group(1)}" if m else (re.sub(r"\[(\d+)\]", r".\1", path) or "(model)")
        groups.setdefault(where, collections.Counter())[name] += 1
    return {k: dict(v) for k, v in groups.items()}


def engine_kernels(gm: fx.GraphModule) -> dict[str, int]:
    """Calls of ops outside aten/prims/fxr named for an op fxrewrite fuses into: the same name
    up to underscores (``_C::rms_norm``, ``sgl_kernel::rmsnorm``, ``_C::rotary_embedding``), or
    its words inside the engine op's (``_C::cpu_fused_moe``, ``vllm::moe_forward``,
    ``_C::rms_norm_dynamic_per_token_quant``): the engine's own kernels."""
    found: collections.Counter[str] = collections.Counter()
    for n in gm.graph.nodes:
        qual = _op_name(n)
        if qual is None:
            continue
        ns, _, name = qual.partition("::")
        if ns not in ("aten", "prims", "fxr") and _names_a_fused_op(name):
            found[qual] += 1
    return dict(found)


@functools.cache
def _names_a_fused_op(name: str) -> bool:
    words = _words(name)
    for op in OPS:
        mine = _words(op)
        if "".join(words) == "".join(mine):
            return True
        if any(words[i : i + len(mine)] == mine for i in range(len(words) - len(mine) + 1)):
            return True
    return False


def _words(name: str) -> list[str]:
    return [w for w in name.lower().split("_") if w]


def _op_name(n: fx.Node) -> str | None:
    """``ns::name`` of an op call (overload or packet), else None."""
    if n.op != "call_function":
        return None
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return t.name()
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name
    return None


def _fxr_name(n: fx.Node) -> str | None:
    qual = _op_name(n)
    return qual.split("::", 1)[1] if qual and qual.startswith("fxr::") else None
