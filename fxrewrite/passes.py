"""PassManager: ordered, named passes over one graph, each timed, counted, linted and dumped.

A pass is ``(gm) -> PassResult``: it edits ``gm.graph`` in place (the manager regenerates the
Python code once, at the end). The manager runs them in order and for each records the time in
ms and the matches, and lints the graph after each pass that changed it; with a dump directory it writes ``NN.<pass>.before.py`` and
``NN.<pass>.after.py`` (the readable code of the graph) so a rewrite can be diffed::

    pm = PassManager([Pass("canonicalize", canonicalize_pass), Pass("fuse_norm", norm_pass)],
                     dump_dir="/tmp/dumps")
    report = pm.run(gm)          # GraphReport: per pass ms / matches, sites, near misses
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.fx as fx

from fxrewrite.report import GraphReport, PassResult, fused_op_counts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Pass:
    """A named step: ``fn(gm)`` rewrites ``gm`` in place and says what it did."""

    name: str
    fn: Callable[[fx.GraphModule], PassResult]


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


class PassManager:
    """Runs passes in order; see the module docstring."""

    def __init__(
        self, passes: Sequence[Pass], dump_dir: str | None = None, graph_id: int = 0, lint: bool = True
    ) -> None:
        self.passes = list(passes)
        self.lint = lint
        self.dump_dir = prepare_dump_dir(dump_dir) if dump_dir else None
        self.graph_id = graph_id

    def run(self, gm: fx.GraphModule) -> GraphReport:
        report = GraphReport(nodes_before=len(gm.graph.nodes))
        start = time.perf_counter()
        for i, p in enumerate(self.passes):
            self._dump(gm, i, p.name, "before")
            t0 = time.perf_counter()
            result = p.fn(gm)
            ms = (time.perf_counter() - t0) * 1e3
            if self.lint and result.matches:  # a pass that changed nothing leaves a linted graph
                gm.graph.lint()
            self._dump(gm, i, p.name, "after")
            log.debug("pass %s: %.2f ms, %d matches", p.name, ms, result.matches)
            report.add(p.name, ms, result, len(gm.graph.nodes))
        gm.recompile()  # passes edit the graph; its Python code is generated once, here
        report.rewrite_ms = (time.perf_counter() - start) * 1e3
        report.nodes_after = len(gm.graph.nodes)
        report.fused_ops = fused_op_counts(gm)
        return report

    def _dump(self, gm: fx.GraphModule, i: int, name: str, when: str) -> None:
        if self.dump_dir is None:
            return
        prefix = f"g{self.graph_id}." if self.graph_id else ""
        path = self.dump_dir / f"{prefix}{i:02d}.{name}.{when}.py"
        try:
            path.write_text(gm.print_readable(print_output=False))
        except OSError as e:
            raise DumpError(f"cannot write graph dump {os.fspath(path)!r}: {e.strerror or e}") from e
