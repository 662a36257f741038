"""What the backend did, for people: per pass time and matches, per rule the sites it fused
(with the model source line), near misses with reasons, node counts, runtime statistics."""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any

import torch.fx as fx


@dataclasses.dataclass
class Site:
    """One place a rule fused: the replacement node and where the replaced code came from."""

    rule: str
    node: str
    source: str
    module: str
    inplace: bool = False
    note: str = ""


@dataclasses.dataclass
class NearMiss:
    """A place where a rule's anchor matched but the rule did not, and why."""

    rule: str
    site: str
    source: str
    at: str
    reason: str
    module: str = ""  # the module the anchor is in (``meta.module_path``)


@dataclasses.dataclass
class Rejected:
    """A match whose rewrite was refused (replacement metadata differs, verification failed)."""

    rule: str
    site: str
    source: str
    reason: str


@dataclasses.dataclass
class PassFailure:
    """A pass that raised: the graph went on as the pass found it (``Config.strict`` raises)."""

    name: str
    error: str
    site: str = ""  # the node it was at, with its source line, when the pass says


@dataclasses.dataclass
class PassRecord:
    name: str
    ms: float
    matches: int
    nodes_after: int


@dataclasses.dataclass
class PassResult:
    """What one pass returns: how many rewrites, and the details the report lists."""

    matches: int = 0
    sites: list[Site] = dataclasses.field(default_factory=list)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)
    rejected: list[Rejected] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class GraphReport:
    """The report of one compiled graph."""

    nodes_before: int = 0
    nodes_after: int = 0
    passes: list[PassRecord] = dataclasses.field(default_factory=list)
    sites: list[Site] = dataclasses.field(default_factory=list)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)
    rejected: list[Rejected] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    fused_ops: dict[str, int] = dataclasses.field(default_factory=dict)
    runtime: dict[str, Any] = dataclasses.field(default_factory=dict)
    rewrite_ms: float = 0.0
    failures: list[PassFailure] = dataclasses.field(default_factory=list)
    # the token counts this rewrite serves ("": all), and the graph's other rewrites, each
    # serving other counts (Config.gemm_fusion_max_tokens, fxrewrite.runtime.by_size)
    serves: str = ""
    variants: list[GraphReport] = dataclasses.field(default_factory=list)

    def add(self, name: str, ms: float, result: PassResult, nodes_after: int) -> None:
        self.passes.append(PassRecord(name, ms, result.matches, nodes_after))
        self.sites += result.sites
        self.near_misses += result.near_misses
        self.rejected += result.rejected
        self.notes += result.notes


def fused_op_counts(gm: fx.GraphModule) -> dict[str, int]:
    """Calls of ``torch.ops.fxr.*`` in ``gm`` by op name."""
    counts: collections.Counter[str] = collections.Counter()
    for n in gm.graph.nodes:
        name = getattr(n.target, "name", None)
        if n.op == "call_function" and callable(name):
            qual = n.target.name()
            if qual.startswith("fxr::"):
                counts[qual.split("::", 1)[1].split(".")[0]] += 1
    return dict(counts)


@dataclasses.dataclass
class Report:
    """Everything the backend compiled, graph by graph. ``table()`` for people, ``to_dict()``
    for machines."""

    graphs: list[GraphReport] = dataclasses.field(default_factory=list)
    providers: dict[str, Any] = dataclasses.field(default_factory=dict)  # the model's calls
    verification_providers: dict[str, Any] = dataclasses.field(default_factory=dict)  # verify's own
    cache: dict[str, Any] = dataclasses.field(default_factory=dict)  # the compile cache's CacheStats

    @property
    def sites(self) -> list[Site]:
        return [s for g in self.graphs for s in g.sites]

    @property
    def near_misses(self) -> list[NearMiss]:
        return [m for g in self.graphs for m in g.near_misses]

    @property
    def rejected(self) -> list[Rejected]:
        return [r for g in self.graphs for r in g.rejected]

    @property
    def failures(self) -> list[PassFailure]:
        """Every pass that raised, in the graphs and in their variants."""
        return [f for g in self.graphs for r in (g, *g.variants) for f in r.failures]

    def rules(self) -> dict[str, int]:
        """Rule name -> matched sites, over all graphs."""
        return dict(collections.Counter(s.rule for s in self.sites))

    def fused_ops(self) -> dict[str, int]:
        total: collections.Counter[str] = collections.Counter()
        for g in self.graphs:
            total.update(g.fused_ops)
        return dict(total)

    def to_dict(self) -> dict[str, Any]:
        passes: dict[str, dict[str, float]] = {}
        for g in self.graphs:
            for p in g.passes:
                e = passes.setdefault(p.name, {"name": p.name, "ms": 0.0, "matches": 0})
                e["ms"] += p.ms
                e["matches"] += p.matches
        return {
            "graphs": len(self.graphs),
            "passes": list(passes.values()),
            "rules": self.rules(),
            "fused_ops": self.fused_ops(),
            "sites": [dataclasses.asdict(s) for s in self.sites],
            "near_misses": [dataclasses.asdict(m) for m in self.near_misses],
            "rejected": [dataclasses.asdict(r) for r in self.rejected],
            "failures": [dataclasses.asdict(f) for f in self.failures],
            "nodes_before": sum(g.nodes_before for g in self.graphs),
            "nodes_after": sum(g.nodes_after for g in self.graphs),
            "rewrite_ms": sum(r.rewrite_ms for g in self.graphs for r in (g, *g.variants)),
            "variants": [{"graph": i, "serves": v.serves, "fused_ops": v.fused_ops, "rewrite_ms": v.rewrite_ms,
                          "nodes_after": v.nodes_after} for i, g in enumerate(self.graphs) for v in g.variants],
            "runtime": [g.runtime for g in self.graphs if g.runtime],
            "providers": self.providers,
            "verification_providers": self.verification_providers,
            "cache": self.cache,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def table(self, notes: bool = True) -> str:
        """A plain-text report: passes, rules, near misses, rejected rewrites, and the passes'
        notes (``notes=False``: only how many there are)."""
        out: list[str] = []
        for i, g in enumerate(self.graphs):
            serves = f" (serves {g.serves})" if g.serves else ""
            out.append(f"graph {i}{serves}: {g.nodes_before} nodes -> {g.nodes_after} nodes, rewrite {g.rewrite_ms:.1f} ms")
            out.append(_table(["pass", "ms", "matches", "nodes after"],
                              [[p.name, f"{p.ms:.2f}", p.matches, p.nodes_after] for p in g.passes]))  # fmt: skip
            by_rule = collections.Counter(s.rule for s in g.sites)
            if by_rule:
                rows = []
                for rule, n in sorted(by_rule.items()):
                    first = next(s for s in g.sites if s.rule == rule)
                    inplace = sum(s.inplace for s in g.sites if s.rule == rule)
                    rows.append([rule, n, inplace, first.source or first.module])
                out.append(_table(["rule", "sites", "in place", "first site"], rows))
            if g.fused_ops:
                out.append("fused ops: " + ", ".join(f"{k} x{v}" for k, v in sorted(g.fused_ops.items())))
            if g.near_misses:
                out.append(f"near misses ({len(g.near_misses)}):")
                out.append(_table(["rule", "site", "source", "at", "reason"],
                                  [[m.rule, m.site, m.source, m.at, m.reason] for m in g.near_misses]))  # fmt: skip
            else:
                out.append("near misses: none")
            for r in g.rejected:
                out.append(f"REJECTED {r.rule} at {r.site} ({r.source}): {r.reason}")
            for f in g.failures:
                at = f" at {f.site}" if f.site else ""
                out.append(f"PASS FAILED {f.name}{at}: {f.error} (the graph went on as the pass found it)")
            if notes:
                out.extend(f"note: {note}" for note in g.notes)
            elif g.notes:
                out.append(f"notes: {len(g.notes)} (not shown)")
            for v in g.variants:
                out.append(f"graph {i}, rewritten again for {v.serves}: {v.nodes_after} nodes, rewrite {v.rewrite_ms:.1f} ms")
                out.append("  fused ops: " + (", ".join(f"{k} x{n}" for k, n in sorted(v.fused_ops.items())) or "none"))
                out.extend(f"  PASS FAILED {f.name}: {f.error}" for f in v.failures)
            if g.runtime:
                out.append("runtime: " + ", ".join(f"{k}={v}" for k, v in g.runtime.items()
                                                   if k not in ("eager_pieces", "variants")))  # fmt: skip
                out.extend(f"  of {v['tokens']} tokens: " + ", ".join(f"{k}={v[k]}" for k in _VARIANT_RUNTIME)
                           for v in g.runtime.get("variants", ()))  # fmt: skip
                out.extend(_eager_piece(p) for p in g.runtime.get("eager_pieces", ()))
        if self.providers:
            out.append("providers: " + json.dumps(self.providers, default=str))
        if self.verification_providers:
            out.append("providers of verification's own calls (not the model's): "
                       + json.dumps(self.verification_providers, default=str))
        out += self.cache_lines()
        return "\n".join(out)

    def cache_lines(self) -> list[str]:
        """``cache hit: N graphs, saved X s``, entries found but not used and why, and what was
        stored or not (empty with the cache off)."""
        c = self.cache
        if not c:
            return []
        lines = [f"cache hit: {c['hits']} graphs, saved {c['saved_s']:.2f} s"] if c["hits"] else []
        if c["stored"] or c["misses"]:
            lines.append(f"cache miss: {c['misses']} graphs, stored {c['stored']}")
        lines += [f"cache: entry found, not used ({n}x): {why}" for why, n in c["not_used"].items()]
        lines += [f"cache: not stored ({n}x): {why}" for why, n in c["not_stored"].items()]
        return lines


# what the table shows of each variant's runner (the graph's line adds them up)
_VARIANT_RUNTIME = ("capture_sizes", "graphs", "replays", "eager_calls", "reason")


def _eager_piece(p: dict[str, Any]) -> str:
    """A piece the CUDA-graph runner runs eagerly, as one line: where, why, at which sizes."""
    sizes = "every size" if p["sizes"] == "all" else "sizes " + ", ".join(map(str, p["sizes"]))
    return f"runs eagerly at {sizes}: {p['piece']}, {p['op']} at {p['source']}: {p['reason']}"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join("  " + ln for ln in lines)
