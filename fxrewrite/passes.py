"""PassManager: ordered, named passes over one graph, each timed, counted, linted and dumped.

A pass is ``(gm) -> PassResult``: it edits ``gm.graph`` in place (the manager regenerates the
Python code once, at the end). The manager runs them in order and for each records the time in
ms and the matches, and lints the graph after each pass that changed it; with a dump directory it writes ``NN.<pass>.before.py`` and
``NN.<pass>.after.py`` (the readable code of the graph) so a rewrite can be diffed::

    pm = PassManager([Pass("canonicalize", canonicalize_pass), Pass("fuse_norm", norm_pass)],
                     dump_dir="/tmp/dumps")
    report = pm.run(gm)          # GraphReport: per pass ms / matches, sites, near misses

A pass is a guest in the user's model: when one raises, the manager puts the graph back as the
passes found it, runs the passes before it again and goes on without it; the report names the
pass, the error and the node it was at (``GraphReport.failures``, "PASS FAILED" in the table).
``strict=True`` (``Config.strict``, env ``FXREWRITE_STRICT=1``; on in this project's tests)
raises instead.

A rule library states its passes as data, in order: :class:`RuleGroup` (named rules, the modes
they run in) and :class:`GraphPass` (a function of the graph, with the ``Config`` fields it
reads); ``fxrewrite.backend.pipeline`` turns them into ``Pass`` objects for a ``Config``::

    PIPELINE = (
        GraphPass("merge_siblings", merge_sibling_linears, switch="merge_siblings"),
        RuleGroup("fuse_norm", norm.RULES),
        RuleGroup("select_gemm", linear.RULES, modes=("piecewise", "full")),
        GraphPass("fold_rotary", fold_rotary_tables, options=("max_positions",)),
    )
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Union

import torch.fx as fx

from fxrewrite.config import Config
from fxrewrite.report import GraphReport, PassFailure, PassResult, fused_op_counts
from fxrewrite.rule import Rule

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Pass:
    """A named step: ``fn(gm)`` rewrites ``gm`` in place and says what it did."""

    name: str
    fn: Callable[[fx.GraphModule], PassResult]


@dataclasses.dataclass(frozen=True)
class RuleGroup:
    """A library's named pass that applies ``rules``; ``modes``: the ``Config.mode`` values it
    runs in (None: every mode); ``switch``: a ``Config`` field whose false value turns it off."""

    name: str
    rules: Sequence[Rule]
    modes: tuple[str, ...] | None = None
    switch: str | None = None

    def runs_in(self, mode: str) -> bool:
        return self.modes is None or mode in self.modes


# What a fusion pass asks before it replaces a site: ``(anchor, nodes) -> None`` to go ahead, or
# a reason to refuse (the pass records it as rejected and leaves the site as written).
SiteFilter = Callable[[fx.Node, Sequence[fx.Node]], Union[str, None]]


@dataclasses.dataclass(frozen=True)
class GraphPass:
    """A library's named pass that is a function of the graph, not rules:
    ``fn(gm, **{f: getattr(config, f) for f in options})``; ``switch``: a ``Config``
    field whose false value (False, None) turns it off; ``fusion``: it fuses as the rule groups do (``fuse_moe``), so
    ``Config.rules`` replaces it with them.

    A fusion pass takes a keyword ``site_filter`` (a :data:`SiteFilter`, None by default) and
    calls it for each site it is about to replace, in the order it finds them, with the node
    that names the site (its source line) and the nodes it replaces; it replaces only the
    sites the filter lets through. ``bind`` makes that filter ask ``Config.match_filter``
    with a :class:`FusionMatch`, as a rule's matches do: bisection switches the pass's sites
    on and off as it does a rule's."""

    name: str
    fn: Callable[..., PassResult]
    options: tuple[str, ...] = ()
    switch: str | None = None
    fusion: bool = False

    def __post_init__(self) -> None:
        if self.fusion and "site_filter" not in inspect.signature(self.fn).parameters:
            raise TypeError(f"fusion pass {self.name!r}: {self.fn!r:.80} takes no `site_filter` keyword")

    def bind(self, config: Config) -> Pass:
        """The ``Pass`` that runs ``fn`` with ``config``'s values of ``options`` (and, for a
        fusion pass, ``config.match_filter`` as its ``site_filter``)."""
        kwargs: dict[str, Any] = {f: getattr(config, f) for f in self.options}
        if self.fusion and config.match_filter is not None:
            kwargs["site_filter"] = functools.partial(_ask, config.match_filter, self)
        return Pass(self.name, functools.partial(self.fn, **kwargs) if kwargs else self.fn)


@dataclasses.dataclass(frozen=True)
class FusionMatch:
    """A site a fusion pass is about to replace, as ``Config.match_filter`` sees it (a rule's
    site is a :class:`fxrewrite.match.Match`): ``rule`` the pass, ``anchor`` the node that names
    the site, ``nodes`` those it replaces (graph order)."""

    rule: GraphPass
    anchor: fx.Node
    nodes: tuple[fx.Node, ...]


def _ask(match_filter: Callable[[Any], str | None], step: GraphPass, anchor: fx.Node, nodes: Sequence[fx.Node]) -> str | None:
    return match_filter(FusionMatch(step, anchor, tuple(nodes)))


Step = Union[RuleGroup, GraphPass]  # one entry of a library's ordered passes


class DumpError(OSError):
    """The dump directory cannot be created or written."""


def prepare_dump_dir(path: str) -> Path:
    """Create ``path`` if needed and check it is writable; DumpError naming it otherwise."""
    d = Path(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".fxrewrite-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise DumpError(f"cannot write graph dumps to {str(d)!r}: {e.strerror or e}") from e
    return d


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while the passes run (and while an ahead-of-time
    compile traces, rewrites and pickles its guards: :func:`fxrewrite.precompile.aot_compile`),
    on again after (if it was). The passes allocate many small objects (nodes, fake values), and
    every so many allocations the collector walks the whole heap: Dynamo's, the model's and the
    graph's objects. On a 128-layer Llama every second rewrite paid a full collection of 1.2-1.5
    s, more than the rewrite itself (bench/RESULTS.md, issue 23). What the passes leave in cycles
    is collected at the next collection after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class PassManager:
    """Runs passes in order; see the module docstring."""

    def __init__(
        self, passes: Sequence[Pass], dump_dir: str | None = None, graph_id: int | str = 0, lint: bool = True,
        strict: bool = False,
    ) -> None:  # fmt: skip
        self.passes = list(passes)
        self.lint = lint
        self.strict = strict
        self.dump_dir = prepare_dump_dir(dump_dir) if dump_dir else None
        self.graph_id = graph_id

    def run(self, gm: fx.GraphModule) -> GraphReport:
        with collector_paused():
            return self._run(gm)

    def _run(self, gm: fx.GraphModule) -> GraphReport:
        start = time.perf_counter()
        saved = None if self.strict else _Saved(gm)
        failures: list[PassFailure] = []
        while True:  # once, or once more per pass that raised (without it)
            report = GraphReport(nodes_before=len(gm.graph.nodes))
            try:
                self._passes(gm, report, {f.name for f in failures})
                break
            except _Raised as r:
                if saved is None:
                    raise r.error from None
                failures.append(r.failure)
                log.warning("fxrewrite: pass %s raised %s; the compile goes on without it", r.failure.name, r.failure.error)
                saved.restore(gm)
        gm.recompile()  # passes edit the graph; its Python code is generated once, here
        report.failures = failures
        report.rewrite_ms = (time.perf_counter() - start) * 1e3
        report.nodes_after = len(gm.graph.nodes)
        report.fused_ops = fused_op_counts(gm)
        return report

    def _passes(self, gm: fx.GraphModule, report: GraphReport, skip: set[str]) -> None:
        for i, p in enumerate(self.passes):
            if p.name in skip:
                continue
            self._dump(gm, i, p.name, "before")
            t0 = time.perf_counter()
            try:
                result = p.fn(gm)
                if self.lint and result.matches:  # a pass that changed nothing leaves a linted graph
                    gm.graph.lint()
            except DumpError:
                raise
            except Exception as e:  # noqa: BLE001 - a guest's error: reported, the graph restored
                site = getattr(e, "fxr_site", "")
                raise _Raised(e, PassFailure(p.name, f"{type(e).__name__}: {_first_line(e)}", site)) from e
            ms = (time.perf_counter() - t0) * 1e3
            self._dump(gm, i, p.name, "after")
            log.debug("pass %s: %.2f ms, %d matches", p.name, ms, result.matches)
            report.add(p.name, ms, result, len(gm.graph.nodes))

    def _dump(self, gm: fx.GraphModule, i: int, name: str, when: str) -> None:
        if self.dump_dir is None:
            return
        prefix = f"g{self.graph_id}." if self.graph_id else ""
        path = self.dump_dir / f"{prefix}{i:02d}.{name}.{when}.py"
        try:
            path.write_text(gm.print_readable(print_output=False))
        except OSError as e:
            raise DumpError(f"cannot write graph dump {os.fspath(path)!r}: {e.strerror or e}") from e


class _Raised(Exception):
    """A pass raised ``error`` (internal: carries it out of the pass loop)."""

    def __init__(self, error: Exception, failure: PassFailure) -> None:
        super().__init__(failure.error)
        self.error, self.failure = error, failure


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else ""


def mark_site(error: Exception, node: fx.Node) -> None:
    """Name ``node`` (and its source line) as where ``error`` happened, for the report, unless a
    deeper caller named one already. A pass calls it before letting an exception through."""
    if not getattr(error, "fxr_site", ""):
        from fxrewrite import meta

        source = meta.source_line(node)
        error.fxr_site = f"{node.name} ({source})" if source else node.name  # type: ignore[attr-defined]


class _Saved:
    """The graph as the passes found it, kept cheaply: each node's fields (a graph copy costs
    about 50 us a node, 0.13 s for a 32-layer Llama, on every compile); the graph is rebuilt
    from them only when a pass raised. Also the module's buffers and ``meta``, which passes
    add to (merged weights, folded tables)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.nodes = [(n, n.op, n.target, n.args, n.kwargs, n.type, dict(n.meta)) for n in gm.graph.nodes]
        self.buffers = set(gm._buffers)
        self.meta = {k: copy.copy(v) for k, v in gm.meta.items()}

    def restore(self, gm: fx.GraphModule) -> None:
        old = gm.graph
        graph = fx.Graph(owning_module=gm, tracer_cls=old._tracer_cls, tracer_extras=old._tracer_extras)
        graph._codegen = old._codegen
        env: dict[fx.Node, fx.Node] = {}
        for node, op, target, args, kwargs, type_, node_meta in self.nodes:
            new = graph.create_node(op, target, fx.node.map_arg(args, env.__getitem__),
                                    fx.node.map_arg(kwargs, env.__getitem__), node.name, type_)  # fmt: skip
            new.meta = dict(node_meta)
            env[node] = new
        gm.graph = graph
        for name in set(gm._buffers) - self.buffers:
            del gm._buffers[name]
        gm.meta.clear()
        gm.meta.update({k: copy.copy(v) for k, v in self.meta.items()})
