"""The compile cache: rewritten graphs kept on disk, so that a restart skips the passes.

A serving engine restarts often (deploys, autoscaling, crashes), and Dynamo gives it the same
graphs every time. With the cache on (the default; ``Config(cache=False)`` or
``FXREWRITE_CACHE=0`` turns it off), the backend keys each Dynamo graph before its passes run
(:func:`fxrewrite.fingerprint.key`: the graph, the configuration and rules by their code, the
versions). On a hit it loads the rewritten graph and skips canonicalization, matching,
verification and the kernel prescan; on a miss it runs them and stores the result::

    <cache_dir>/graphs/<key[:2]>/<key>.pt   one rewritten graph: nodes, constants, report
    <cache_dir>/triton/                     Triton's kernel cache (TRITON_CACHE_DIR, unless set)

``cache_dir``: ``Config.cache_dir``, else ``FXREWRITE_CACHE_DIR``, else
``$XDG_CACHE_HOME/fxrewrite`` (``~/.cache/fxrewrite``). The report says ``cache hit: N graphs,
saved X s`` (the passes' time in the process that stored them, less the load).

An entry holds plain values and tensors, read with ``torch.load(weights_only=True)``:

* the rewritten graph's nodes (op, name, target by qualified name, encoded arguments). On load,
  a node equal to the Dynamo graph's node of its name takes that node's metadata; a new one
  (a fused op) gets fake values computed from its inputs;
* its constants: a merged weight is made again from this process's parameters (its recipe,
  ``meta.constant_node(..., rebuild=...)``), since it is a view of them; anything else (a folded
  RoPE cache) is stored as a tensor;
* a digest of every real value the passes read (``meta.real``: the buffer RoPE tables were
  folded from). The entry is used only if this process's values have the same digests;
* the report of the rewrite, and its time.

Never stale: anything the key does not hold and the passes may depend on is checked on load
(the values read) or keeps the graph out of the cache. Not stored: a graph whose rewrite added
shape guards (on a hit Dynamo's guards for the frame would lack them), a graph with a target or
argument that cannot be named, a configuration with a callable whose captured state has no stable
description. What the key cannot see is state a rule reads at run time outside its code and its
module's globals (a file, an environment variable): switch the cache off for such rules, or
clear ``cache_dir``.

Entries are written to a temporary file and renamed into place: concurrent writers of one key
leave one whole entry, and a reader never sees a partial one. An entry that does not load
(truncated, another format) is ignored with a warning, and the graph is rewritten and stored
again.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from fxrewrite import fingerprint, meta
from fxrewrite.fingerprint import Uncacheable, decode, encode, node_record, resolve_target, target_ref
from fxrewrite.report import GraphReport, NearMiss, PassRecord, Rejected, Site

log = logging.getLogger(__name__)

FORMAT = 1  # the layout of an entry; another value misses


@dataclasses.dataclass
class CacheStats:
    """What the cache did for one backend: graphs loaded and the seconds their passes took when
    they were stored, less the loads; graphs stored; graphs not stored, by reason; entries found
    under their key but not used, by reason (a value the passes read has changed: a warm start
    that misses says why)."""

    hits: int = 0
    saved_s: float = 0.0
    misses: int = 0
    stored: int = 0
    not_stored: dict[str, int] = dataclasses.field(default_factory=dict)
    not_used: dict[str, int] = dataclasses.field(default_factory=dict)


class CompileCache:
    """Rewritten graphs under ``directory`` (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.stats = CacheStats()

    def prepare(self) -> None:
        """Create the directory, and point Triton's cache beside it unless ``TRITON_CACHE_DIR``
        is set (a process-wide setting: it moves every Triton kernel this process builds).
        OSError when the directory cannot be made."""
        (self.dir / "graphs").mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TRITON_CACHE_DIR", str(self.dir / "triton"))

    def graph(self, gm: fx.GraphModule, example_inputs: list[Any], config: Any) -> CachedGraph | None:
        """The cache's handle on ``gm`` (call before the passes run), or None when it cannot
        be keyed (logged)."""
        try:
            graph, records = fingerprint.graph_digest(gm)
        except Uncacheable as e:
            self._not_stored(f"not keyed: {e}")
            return None
        key = fingerprint.key_of(graph, config, fingerprint.devices(example_inputs))
        return CachedGraph(self, key, records, gm, example_inputs, graph)

    def path(self, key: str) -> Path:
        """The entry's files, without their suffix: ``.json`` (the graph), ``.pt`` (its tensors)."""
        return self.dir / "graphs" / key[:2] / key

    def _not_stored(self, why: str) -> None:
        log.info("fxrewrite compile cache: graph not stored: %s", why)
        self.stats.not_stored[why] = self.stats.not_stored.get(why, 0) + 1

    def _not_used(self, why: str) -> None:
        self.stats.misses += 1
        self.stats.not_used[why] = self.stats.not_used.get(why, 0) + 1


class CachedGraph:
    """One Dynamo graph's entry: :meth:`load` before the passes, :meth:`store` after them.
    ``graph_digest``: the graph's part of the key (what a precompiled artifact keeps of it)."""

    def __init__(self, cache: CompileCache, key: str, records: dict[str, tuple[Any, ...]], gm: fx.GraphModule,
                 example_inputs: list[Any], graph_digest: str | None = None) -> None:  # fmt: skip
        self.cache, self.key, self.records, self.gm, self.graph_digest = cache, key, records, gm, graph_digest
        self.inputs = {n.name: v for n, v in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)}
        self.attrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
        self.guards = _shape_guards(gm)

    # -- load ---------------------------------------------------------------------------

    def load(self) -> GraphReport | None:
        """Put the stored rewritten graph in ``gm`` (its graph and constants replaced) and
        return its report; None on a miss (``gm`` untouched)."""
        path = self.cache.path(self.key)
        if not path.with_suffix(".json").exists():
            self.cache.stats.misses += 1
            return None
        start = time.perf_counter()
        try:
            entry = json.loads(path.with_suffix(".json").read_text())
            if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != self.key:
                raise ValueError("not an entry of this format and key")
            if (why := self._changed_reads(entry["reads"])) is not None:
                log.info("fxrewrite compile cache: entry %s not used: %s", path.name, why)
                self.cache._not_used(why)
                return None
            tensors: dict[str, torch.Tensor] = {}
            if entry["tensors"]:
                with torch._guards.tracing(None):  # under Dynamo's tracing context torch.load makes meta tensors
                    tensors = torch.load(path.with_suffix(".pt"), map_location="cpu", weights_only=True)
            graph, constants = self._build(entry, tensors)
        except Exception as e:  # noqa: BLE001 - a damaged entry is a miss; the graph is stored again
            log.warning("fxrewrite compile cache: ignoring the unreadable entry %s (%s: %s); it will be written again",
                        path, type(e).__name__, e)  # fmt: skip
            self.cache._not_used(f"unreadable ({type(e).__name__})")
            return None
        for name, value in constants.items():
            if not hasattr(self.gm, name):
                self.gm.register_buffer(name, value, persistent=False)
        self.gm.graph = graph
        seconds = time.perf_counter() - start
        report = _decode_report(entry["report"])
        report.rewrite_ms = seconds * 1e3
        report.notes.append(f"loaded from the compile cache in {seconds:.3f} s (the passes took "
                            f"{entry['rewrite_s']:.3f} s when stored)")  # fmt: skip
        self.cache.stats.hits += 1
        self.cache.stats.saved_s += entry["rewrite_s"] - seconds
        return report

    def _changed_reads(self, stored: dict[str, str]) -> str | None:
        for name, want in stored.items():
            try:
                got = _digest(self._read(name))
            except (KeyError, AttributeError, Uncacheable) as e:
                return f"{name} cannot be read here ({e})"
            if got != want:
                return f"the value of {name} differs from the one the passes read"
        return None

    def _read(self, name: str) -> Any:
        if name.startswith("attr:"):
            return fingerprint._attribute(self.gm, name.removeprefix("attr:"))
        return self.inputs[name]

    def _build(self, entry: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[fx.Graph, dict[str, torch.Tensor]]:
        """The stored graph, with this process's metadata, and its constants."""
        old = {n.name: n for n in self.gm.graph.nodes}
        fake_mode = meta.fake_mode_of(self.gm.graph)
        constants = {name: self._constant(c, tensors) for name, c in entry["constants"].items()}
        values = _Values(self.gm.graph)
        graph = fx.Graph()
        nodes: dict[str, fx.Node] = {}
        for record in entry["nodes"]:
            op, name, target, args, kwargs = record
            node = graph.create_node(op, resolve_target(target), decode(args, nodes), decode(kwargs, nodes), name)
            if node.name != name:
                raise ValueError(f"node {name!r} came back as {node.name!r}")
            nodes[name] = node
            same = old.get(name)
            if same is not None and self.records.get(name) == tuple(record):
                node.meta = dict(same.meta)  # the same node as Dynamo's: its metadata holds
            elif op == "get_attr" and target in constants and fake_mode is not None:
                node.meta["example_value"] = meta.constant_fake(constants[target], fake_mode)
            elif op == "placeholder":
                raise ValueError(f"input {name!r} is not an input of this graph")
            elif (v := values.find(entry["values"].get(name))) is not None:
                node.meta["example_value"] = v
            else:
                meta.propagate(node, fake_mode)
                values.add(meta.value(node))
        graph.lint()
        return graph, constants

    def _constant(self, c: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if "rebuild" in c:
            return resolve_target(c["rebuild"])(*(self.inputs[name] for name in c["inputs"]))
        return tensors[c["tensor"]].to(c["device"])

    # -- store --------------------------------------------------------------------------

    def store(self, report: GraphReport) -> None:
        """Write the rewritten graph in ``gm`` (after the passes) with its report; a graph that
        cannot be stored is logged and counted (``CacheStats.not_stored``)."""
        try:
            entry, tensors = self._entry(report)
            text = json.dumps(entry)
        except (Uncacheable, TypeError, ValueError) as e:
            self.cache._not_stored(str(e))
            return
        path = self.cache.path(self.key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if tensors:  # first: a reader that finds the graph finds its tensors
                _write_atomic(path.with_suffix(".pt"), lambda f: torch.save(tensors, f))
            _write_atomic(path.with_suffix(".json"), lambda f: f.write(text.encode()))
        except OSError as e:
            log.warning("fxrewrite compile cache: cannot write %s: %s", path, e)
            self.cache._not_stored(f"write failed: {e.strerror or e}")
            return
        self.cache.stats.stored += 1

    def _entry(self, report: GraphReport) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        gm = self.gm
        if (added := _shape_guards(gm) - self.guards) > 0:
            raise Uncacheable(f"the rewrite added {added} shape guard(s), which a cache hit would not")
        recipes = gm.meta.get("fxr_constants", {})
        constants: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}
        for n in gm.graph.find_nodes(op="get_attr"):
            if n.target in self.attrs or n.target in constants:
                continue
            if n.target not in recipes:
                raise Uncacheable(f"the constant `{n.target}` was made by a pass without meta.constant_node")
            value = fingerprint._attribute(gm, n.target)
            recipe = recipes[n.target]
            if recipe is not None:
                constants[n.target] = {"rebuild": target_ref(recipe[0]), "inputs": list(recipe[1])}
            else:
                tensors[n.target] = value.detach().cpu()
                constants[n.target] = {"tensor": n.target, "device": str(value.device)}
        records = [node_record(n) for n in gm.graph.nodes]
        new = [n for n, r in zip(gm.graph.nodes, records) if self.records.get(n.name) != r]
        entry = {
            "format": FORMAT,
            "key": self.key,
            "nodes": records,
            "values": {n.name: _describe(meta.value(n)) for n in new},
            "constants": constants,
            "tensors": bool(tensors),
            "reads": {name: _digest(self._read(name)) for name in sorted(meta.reads(gm.graph))},
            "report": _encode_report(report),
            "rewrite_s": report.rewrite_ms / 1e3,
        }
        return entry, tensors


def _write_atomic(path: Path, write: Any) -> None:
    """``write(file)`` into a temporary file beside ``path``, then renamed onto it: readers see
    the old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# --------------------------------------------------------------------------- fake values

# A new node's fake value is stored as a description (dtype, device, symbolic shape and strides
# as text) and found again among the fake values of this process's Dynamo graph: a fused op's
# output has the shape of a value the model computed. Symbolic fake dispatch costs milliseconds
# per distinct op and shape; a lookup costs microseconds. A value not found is computed.


def _describe(v: Any, text: dict[Any, str] | None = None) -> Any:
    """A fake value as plain values (symbolic sizes as text; ``text`` memoizes the printing of
    each expression), or None for what has no description."""
    text = {} if text is None else text

    def size(d: Any) -> str:
        k = meta.dim_key(d)
        if k not in text:
            text[k] = str(k)
        return text[k]

    if isinstance(v, torch.Tensor):
        try:
            stride = [size(s) for s in v.stride()]
        except RuntimeError:  # sparse or nested: no strides
            return None
        return ("T", str(v.dtype), str(v.device), tuple(size(d) for d in v.shape), tuple(stride), v.requires_grad)
    if isinstance(v, torch.SymInt):
        return ("S", size(v))
    if isinstance(v, (tuple, list)):
        items = tuple(_describe(x, text) for x in v)
        return None if any(i is None for i in items) else ("tuple" if isinstance(v, tuple) else "list", items)
    if v is None or isinstance(v, (bool, int, float)):
        return ("V", v)
    return None


class _Values:
    """The fake values (tensors, SymInts) of a graph, by description; built at first use."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.index: dict[Any, Any] | None = None
        self.text: dict[Any, str] = {}

    def find(self, desc: Any) -> Any:
        """A fake value matching ``desc``, or None."""
        if desc is None:
            return None
        tag = desc[0]
        if tag == "V":
            return desc[1]
        if tag in ("tuple", "list"):
            items = [self.find(d) for d in desc[1]]
            if any(i is None for i in items):
                return None
            return tuple(items) if tag == "tuple" else items
        if self.index is None:
            self.index = {}
            for n in self.graph.nodes:
                self.add(meta.value(n))
        return self.index.get(_freeze(desc))

    def add(self, v: Any) -> None:
        """Index ``v`` (and the tensors and SymInts inside a tuple) by description."""
        if self.index is None:
            return
        if isinstance(v, (tuple, list)):
            for x in v:
                self.add(x)
        elif isinstance(v, (torch.Tensor, torch.SymInt)):
            desc = _describe(v, self.text)
            if desc is not None:
                self.index.setdefault(desc, v)


def _freeze(desc: Any) -> Any:
    """A description read back from JSON (lists) as :func:`_describe` makes it (tuples)."""
    return tuple(_freeze(x) for x in desc) if isinstance(desc, list) else desc


def _shape_guards(gm: fx.GraphModule) -> int:
    """How many guards, replacements and runtime asserts the graph's shape environment holds."""
    env = getattr(meta.fake_mode_of(gm.graph), "shape_env", None)
    if env is None:
        return 0
    asserts = sum(len(v) for v in getattr(env, "deferred_runtime_asserts", {}).values())
    return len(env.guards) + len(getattr(env, "replacements", {})) + asserts


def _digest(v: Any) -> str:
    """A digest of a real value: a tensor's dtype, shape and bytes, or a Python value's repr."""
    if not isinstance(v, torch.Tensor):
        return fingerprint.digest(encode(v))
    t = v.detach()
    if t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor):
        raise Uncacheable("a value read has no data")
    t = t.cpu().contiguous()
    h = hashlib.blake2b(f"{t.dtype} {list(t.shape)}".encode(), digest_size=20)
    if t.numel():
        h.update((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))
    return h.hexdigest()


_REPORT_LISTS = {"passes": PassRecord, "sites": Site, "near_misses": NearMiss, "rejected": Rejected}


def _encode_report(report: GraphReport) -> dict[str, Any]:
    d = dataclasses.asdict(report)
    d["runtime"] = {}  # the runner's, made again in every process
    d["serves"], d["variants"] = "", []  # each rewrite of a graph is an entry of its own
    return d


def _decode_report(d: dict[str, Any]) -> GraphReport:
    fields = {k: v for k, v in d.items() if k != "variants"}
    for name, cls in _REPORT_LISTS.items():
        fields[name] = [cls(**x) for x in d[name]]
    return GraphReport(**fields)
