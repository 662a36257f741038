"""Precompiled models: a warm start that skips Dynamo's tracing.

The compile cache (:mod:`fxrewrite.cache`) skips our passes in a new process, but Dynamo still
traces the model there first. A precompiled artifact holds what that trace made as well: torch's
AOT precompile (``torch._dynamo.aot_compile``, torch >= 2.10) keeps Dynamo's guards and the
bytecode that calls the graph; fxrewrite adds the rewritten graph. A new process loads it and runs
without tracing, without any pass, every serializable guard checked on each call::

    backend = fxrewrite.Backend(mode="piecewise")
    with torch.no_grad():                                   # grad mode is guarded: serve as you compile
        step = backend.aot_compile(model, (input_ids,))    # traces and rewrites now
        step(input_ids)                                     # runs like model(input_ids)
    step.save("llama.fxr")
    ...                                                     # a new process
    step = fxrewrite.load("llama.fxr", model, fxrewrite.Backend(mode="piecewise"))
    step = fxrewrite.warm_start(model, "llama.fxr", (input_ids,), backend=backend)  # load, else compile and save

The artifact (one file): a header, then torch's serialized ``AOTCompiledFunction``, whose
compiled function is a :class:`FusedGraph`:

* the header: the compile cache's key of the graph (:func:`fingerprint.key_of`) with its parts:
  the digest of the Dynamo graph, the input devices, and digests of the configuration and the
  environment. On load the key is computed again from the loading backend's configuration and
  this process's versions; any difference (a config field, a rule's code, torch, fxrewrite's
  source, a kernel library, the GPU) raises :class:`StaleArtifact` naming which part;
* Dynamo's guards, less those torch cannot serialize (object identity: ``ID_MATCH`` and its kind,
  and guards on globals, as torch's own precompile drops them, with the key order of global
  dicts: :func:`_local_key_order`). The model's code is checked instead: every function
  Dynamo traced is hashed (torch's ``SourceInfo``) and compared on load;
* the rewritten graph (``torch.fx._graph_pickler``: nodes, fake values with their symbolic
  shapes, ``torch.ops.fxr.*`` targets by name) and its constants: folded tables as tensors; a
  merged weight as its recipe, made again from this process's parameters at the first call;
* digests of the real values the passes read (``meta.real``: the buffer RoPE tables fold from),
  compared at the first call, and the report of the rewrite.

The runner (``mode="piecewise" | "full"``: split, dispatch, CUDA graphs) is built at the first call
from the loaded graph and that call's inputs, as a cold compile builds it from Dynamo's inputs.
A call whose guards fail, or whose values read differ, compiles with Dynamo instead (logged; the
compile cache still serves the passes); ``recompile=False`` raises :class:`GuardFailure` /
:class:`StaleArtifact`, as torch's own precompiled functions raise on a guard failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import os
import pickle
import struct
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from fxrewrite import fingerprint, meta
from fxrewrite.cache import _decode_report, _digest, _encode_report, _write_atomic
from fxrewrite.passes import collector_paused
from fxrewrite.report import GraphReport

if TYPE_CHECKING:
    from fxrewrite.backend import Backend

try:  # torch >= 2.10 (2.11 and 2.13 tested)
    from torch._dynamo.aot_compile_types import SerializableCallable
except ImportError:  # pragma: no cover - older torch: precompile raises at use
    SerializableCallable = object  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

MAGIC = b"FXRPRE1\n"  # then the header's length (8 bytes), the header (JSON), torch's bytes
# Node metadata the runner and reports read: fake values, static-input marks, source lines and
# module paths for messages (cut down by _portable)
KEPT_META = ("example_value", "val", "stack_trace", "tensor_dict", "nn_module_stack")
_STATIC_MARK = "_dynamo_static_input_type"


class StaleArtifact(RuntimeError):
    """The artifact does not fit this process (its key, its traced sources or the values its
    passes read differ, or torch cannot load it); the message says why. A miss: compile again."""


class GuardFailure(RuntimeError):
    """A call's inputs fail the artifact's guards (``recompile=False``)."""


def call_module(model: Any, /, *args: Any, **kwargs: Any) -> Any:
    """What is traced and precompiled: a call of ``model``. A function of fxrewrite's own, so
    the artifact's bytecode names nothing the loading process lacks (a model's ``forward`` may
    be wrapped by decorators, which torch cannot serialize by name)."""
    return model(*args, **kwargs)


def _traced() -> Callable[..., Any]:
    """:func:`call_module` over globals that hold the builtins too: torch 2.11's AOT precompile
    looks each name the compiled bytecode reads (``type`` where it rebuilds a model's output)
    up in the traced function's globals alone, where 2.13 also reads ``__builtins__``. Dynamo
    installs its own globals for the bytecode in that dict too (:func:`_installed_globals`)."""
    import builtins
    import types

    fn = types.FunctionType(call_module.__code__, {**vars(builtins), **vars(sys.modules[__name__])},
                            call_module.__name__, call_module.__defaults__, call_module.__closure__)  # fmt: skip
    fn.__qualname__, fn.__module__, fn.__doc__ = call_module.__qualname__, __name__, call_module.__doc__
    return fn


def _available() -> None:
    if SerializableCallable is object:
        raise RuntimeError(f"precompiled artifacts need torch's AOT precompile (torch >= 2.10), not {torch.__version__}")


# --------------------------------------------------------------------------- the compiled graph


@dataclasses.dataclass
class Identity:
    """What the cache key holds of one Dynamo graph before its passes: the graph's digest and
    the devices of its inputs (the configuration and the environment are the backend's)."""

    graph: str
    devices: list[str]

    @classmethod
    def of(cls, gm: fx.GraphModule, example_inputs: Sequence[Any], graph_digest: str | None = None) -> Identity:
        """``graph_digest``: :func:`fingerprint.graph_digest` of ``gm`` when the compile cache
        made it already (one fingerprint of the graph, not two)."""
        if graph_digest is None:
            graph_digest, _ = fingerprint.graph_digest(gm)  # Uncacheable: the artifact cannot be keyed
        return cls(graph_digest, sorted(str(d) for d in fingerprint.devices(example_inputs)))

    def header(self, config: Any) -> dict[str, Any]:
        """The artifact's header: the key and its parts' digests (to say which part differs)."""
        on = [torch.device(d) for d in self.devices]
        return {"format": 1, "key": fingerprint.key_of(self.graph, config, on), "graph": self.graph,
                "devices": self.devices, "config": fingerprint.digest(fingerprint.config_fingerprint(config)),
                "environment": fingerprint.digest(fingerprint.environment(on))}  # fmt: skip


class FusedGraph(SerializableCallable):  # type: ignore[misc]
    """The function Dynamo's bytecode calls with the graph's inputs: the rewritten graph through
    its runner. Made by the backend when it precompiles (:meth:`cold`) or by torch from an
    artifact (:meth:`deserialize_compile_artifacts`); a loaded one is bound to a backend
    (:meth:`bind`) and builds its runner at its first call."""

    def __init__(self, gm: fx.GraphModule, state: dict[str, Any], runner: Callable[..., Any] | None = None) -> None:
        self.gm, self.state, self.runner = gm, state, runner
        self.backend: Backend | None = None
        self.report: GraphReport | None = None

    @classmethod
    def cold(cls, gm: fx.GraphModule, example_inputs: Sequence[Any], runner: Callable[..., Any], report: GraphReport,
             identity: Identity, config: Any) -> FusedGraph:  # fmt: skip
        """After the passes (and the runner) of a precompile: what the artifact keeps of ``gm``,
        keyed under ``config``."""
        names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
        inputs = dict(zip(names, example_inputs))
        recipes = {name: None if r is None else [fingerprint.target_ref(r[0]), list(r[1])]
                   for name, r in gm.meta.get("fxr_constants", {}).items()}  # fmt: skip
        reads = {name: _digest(inputs[name]) for name in sorted(meta.reads(gm.graph)) if name in inputs}
        state = {"header": identity.header(config), "inputs": names, "recipes": recipes, "reads": reads,
                 "report": _encode_report(report)}  # fmt: skip
        fn = cls(gm, state, runner)
        fn.report = report
        return fn

    def __call__(self, *args: Any) -> Any:
        runner = self.runner
        if runner is None:
            runner = self.runner = self._materialize(args)
        return runner(*args)

    def bind(self, backend: Backend) -> None:
        """Hand the loaded graph to ``backend``: its report and graphs list it; the runner is
        built with its configuration at the first call. StaleArtifact when the graph's key under
        ``backend``'s configuration, in this process, is not the one it was compiled under."""
        check_header(self.state["header"], backend.config)
        self.backend = backend
        self.report = _decode_report(self.state["report"])
        self.report.notes.append(f"loaded from a precompiled artifact: no Dynamo trace, no pass (they took "
                                 f"{self.report.rewrite_ms / 1e3:.3f} s when compiled)")  # fmt: skip
        self.report.rewrite_ms = 0.0
        backend.graphs.append(self.gm)
        backend.report.graphs.append(self.report)

    def _materialize(self, args: Sequence[Any]) -> Callable[..., Any]:
        """Constants made from this call's inputs, the values read checked, the runner built."""
        from fxrewrite.backend import build_runtime

        if self.backend is None:
            raise RuntimeError("a precompiled graph loaded by torch alone: load it with fxrewrite.load(path, model)")
        inputs = dict(zip(self.state["inputs"], args))
        for name, want in self.state["reads"].items():
            if _digest(inputs[name]) != want:
                raise StaleArtifact(f"the value of {name} differs from the one the passes read when it was compiled")
        for name, recipe in self.state["recipes"].items():
            if recipe is not None:
                value = fingerprint.resolve_target(recipe[0])(*(inputs[n] for n in recipe[1]))
                setattr(self.gm, name, value)
        return build_runtime(self.backend, self.gm, list(args), self.report, prebuild=True)

    @classmethod
    def serialize_compile_artifacts(cls, fn: FusedGraph) -> bytes:
        from torch.fx._graph_pickler import Options

        graph = _portable(fn.gm, fn.state["recipes"])
        with _slices():
            data = _pickler().dumps(graph, Options(ops_filter=None, node_metadata_key_filter=KEPT_META.__contains__))
        return pickle.dumps({"state": json.dumps(fn.state), "graph": data})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> FusedGraph:
        from torch._subclasses import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        saved = pickle.loads(data)
        with _slices():
            gm = GraphPickler.loads(saved["graph"], FakeTensorMode(shape_env=ShapeEnv()))
        gm.recompile()
        return cls(gm, json.loads(saved["state"]))


@functools.cache
def _pickler() -> type:
    """torch's GraphPickler, with a fake tensor's mode left out (a view's fake base names it; the
    loader gives every fake value its own new mode) and sympy functions of symbolic shapes by
    name."""
    import sympy
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    class Pickler(GraphPickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, FakeTensorMode):
                return type(None), ()
            if inspect.isclass(obj) and issubclass(obj, sympy.Function) and hasattr(obj, "_torch_unpickler"):
                return obj._torch_unpickler, (obj._torch_handler_name,)
            return super().reducer_override(obj)

    return Pickler


@contextlib.contextmanager
def _slices() -> Any:
    """Slices (``x[:, :n]`` arguments) as pytree nodes while the graph is pickled or loaded, as
    torch >= 2.12 does itself (2.11 does not)."""
    from torch.fx import _graph_pickler
    from torch.utils import _pytree as pytree

    if hasattr(_graph_pickler, "patch_pytree_map_over_slice") or slice in pytree.SUPPORTED_NODES:
        yield
        return
    pytree._private_register_pytree_node(slice, lambda x: ([x.start, x.stop, x.step], None), lambda x, c: slice(*x))
    try:
        yield
    finally:
        pytree._deregister_pytree_node(slice)


def _portable(gm: fx.GraphModule, recipes: dict[str, Any]) -> fx.GraphModule:
    """A copy of ``gm`` to pickle: node metadata cut to :data:`KEPT_META` (the static-input
    mark alone of ``tensor_dict``, the innermost path of ``nn_module_stack``), constants with a recipe as empty tensors (made again from the
    parameters on load), ``gm.meta`` empty. ``gm`` itself is untouched."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in graph.nodes:
        kept = {k: n.meta[k] for k in KEPT_META if k in n.meta}
        if "tensor_dict" in kept:
            kept["tensor_dict"] = {k: v for k, v in kept["tensor_dict"].items() if k == _STATIC_MARK}
        if kept.get("nn_module_stack"):  # the innermost module's path, not its class
            key, (path, _) = list(kept["nn_module_stack"].items())[-1]
            kept["nn_module_stack"] = {key: (str(path), None)}
        n.meta = kept
    root: dict[str, Any] = {}
    for n in graph.find_nodes(op="get_attr"):
        value = fingerprint._attribute(gm, n.target)
        root[n.target] = torch.empty(0, dtype=value.dtype) if recipes.get(n.target) is not None else value
    return fx.GraphModule(root, graph)


# --------------------------------------------------------------------------- precompiled models


class Precompiled:
    """A model compiled ahead of time: call it like the model (``model`` is bound). ``save``
    writes the artifact; :func:`load` reads it in another process."""

    def __init__(self, fn: Any, model: Any, backend: Backend, header: dict[str, Any], *, dynamic: bool | None,
                 recompile: bool = True) -> None:  # fmt: skip
        self.fn, self.model, self.backend, self.header = fn, model, backend, header
        self.dynamic, self.recompile = dynamic, recompile
        self.loaded = False
        self.traced_globals: dict[str, Any] = vars(sys.modules[__name__])  # where Dynamo installed its own
        self._fallback: Callable[..., Any] | None = None
        self._stale: str | None = None

    @property
    def graph(self) -> FusedGraph:
        return self.fn._artifacts.compiled_fn

    def guard_check(self, *args: Any, **kwargs: Any) -> bool:
        """Whether a call with these arguments passes the artifact's guards."""
        return bool(self.fn.guard_check(self.model, *args, **kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._stale is None:
            if self.fn.guard_check(self.model, *args, **kwargs):
                try:
                    return self.fn.fn(self.model, *args, **kwargs)  # the guards are checked: torch's call would again
                except StaleArtifact as e:
                    self._stale = str(e)
                    if not self.recompile:
                        raise
                    log.warning("fxrewrite precompiled graph not used, compiling with Dynamo: %s", e)
            else:
                reason = self._guard_reason(args, kwargs)
                if not self.recompile:
                    raise GuardFailure(f"the inputs fail the precompiled graph's guards: {reason}")
                log.warning("fxrewrite: inputs fail the precompiled graph's guards (%s); compiling with Dynamo", reason)
        return self._dynamo()(*args, **kwargs)

    def _guard_reason(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        bound = inspect.signature(call_module).bind(self.model, *args, **kwargs)
        bound.apply_defaults()  # the empty *args / **kwargs too: the guards name them
        f_locals = bound.arguments
        info = self.fn._artifacts.guard_manager.check_verbose(f_locals)
        return "; ".join(getattr(info, "verbose_code_parts", []) or [str(info)])

    def _dynamo(self) -> Callable[..., Any]:
        if self._fallback is None:
            self._fallback = self.backend.compile(self.model, dynamic=self.dynamic)
        return self._fallback

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the artifact to ``path`` (atomically: a reader sees the old file or the new)."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        if self.loaded:
            raise RuntimeError("a loaded artifact is saved already; compile with Backend.aot_compile to save anew")
        result = AOTCompiledFunction.serialize(self.fn)
        blob = getattr(result, "serialized_data", result)  # 2.11 and 2.13: a result object; older: bytes
        header = json.dumps({**self.header, "globals": _installed_globals(self.fn._artifacts, self.traced_globals)}).encode()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, lambda f: f.write(MAGIC + struct.pack("<Q", len(header)) + header + blob))
        return path


def _installed_globals(artifacts: Any, mine: dict[str, Any]) -> dict[str, Any]:
    """The globals Dynamo installed in ``mine`` (the traced function's globals) for the bytecode
    (a module it reconstructs an output with, ``___module_collections_<id>_c0``), by name: torch
    keeps only imports, builtins and the graph's inputs."""
    import builtins

    env = artifacts.runtime_env
    out: dict[str, Any] = {}
    for ref in sorted(env.external_refs):
        if ref in env.used_globals or ref in env.import_sources or ref == artifacts.backend_id or ref not in mine:
            continue
        if hasattr(builtins, ref) or (ref in globals() and not ref.startswith("___")):
            continue  # this module's own names are there in the loading process
        value = mine[ref]
        out[ref] = ["module", value.__name__] if inspect.ismodule(value) else fingerprint.target_ref(value)
    return out


def _globals(header: dict[str, Any]) -> dict[str, Any]:
    """This module's globals, with those :func:`_installed_globals` named, over the builtins
    (torch 2.11 looks each name the bytecode reads up in these globals alone: ``type`` missed
    there; 2.13 also reads ``__builtins__``)."""
    import builtins
    import importlib

    found = {name: importlib.import_module(ref[1]) if ref[0] == "module" else fingerprint.resolve_target(ref)
             for name, ref in header.get("globals", {}).items()}  # fmt: skip
    return {**vars(builtins), **vars(sys.modules[__name__]), **found}


def aot_compile(backend: Backend, model: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, *,
                dynamic: bool | None = True, recompile: bool = True) -> Precompiled:  # fmt: skip
    """Trace ``model(*args, **kwargs)`` with Dynamo now, rewrite the graph with ``backend``,
    and return it precompiled (see :meth:`fxrewrite.Backend.aot_compile`)."""
    _available()
    from torch._dynamo.aot_compile import aot_compile_fullgraph
    from torch._dynamo.hooks import Hooks

    from fxrewrite.backend import _SpecializeFloats

    backend._precompiling = FusedGraph
    traced = _traced()
    try:
        with _SpecializeFloats() if backend.config.specialize_floats else _nothing(), _keeping_dim_marks(), \
                _local_key_order(), _lazy_code(), collector_paused():
            fn = aot_compile_fullgraph(traced, ((model, *args), dict(kwargs or {})),
                                       hooks=Hooks(guard_filter_fn=serializable_guards), backend=backend,
                                       dynamic=dynamic)  # fmt: skip
    finally:
        backend._precompiling = None
    graph = fn._artifacts.compiled_fn
    if not isinstance(graph, FusedGraph):
        raise RuntimeError(f"the backend returned {type(graph).__name__}, not a precompiled fxrewrite graph")
    out = Precompiled(fn, model, backend, graph.state["header"], dynamic=dynamic, recompile=recompile)
    out.traced_globals = traced.__globals__
    return out


def _lazy_code() -> Any:
    """GraphModules whose Python code is generated at their first call or read, not at each
    ``recompile``, as under ``torch.compile``: Dynamo's compile of a frame sets this (its
    ``use_lazy_graph_module``), its AOT precompile (2.11 to 2.13) does not. The graph given to
    the backend, the split's modules and the pieces then generate their code once, when run
    (in mode full: the lone piece's; the graph's own and the split module's, never), not at
    each pass that edits them (on the 32-layer CPU model about 5 generations of the whole
    graph's code, 0.2 s)."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(torch._dynamo.config.use_lazy_graph_module)


# torch.compiler's dimension marks (mark_static, mark_dynamic, ...) on an input tensor: guarded
_DIM_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices",
              "_dynamo_strict_unbacked_indices", "_dynamo_static_indices", "_dynamo_shape_ids",
              "_dynamo_unbacked_bounds", "_has_dynamo_dim_marking")  # fmt: skip


@contextlib.contextmanager
def _keeping_dim_marks() -> Any:
    """Dynamo's guards pickled with each tensor's dimension marks. torch (2.11 to 2.13) pickles a
    guarded tensor as its meta tensor and drops them; the guards rebuilt on load then expect no
    mark, and an input marked as at compile time (``mark_static``, as the CUDA-graph runner
    wants for all but the token count) fails them. The marks ride along and are set back."""
    from torch._dynamo.guards import GuardsStatePickler

    original = GuardsStatePickler.reducer_override
    tensor_fn = GuardsStatePickler._unpickle_tensor.__func__

    def reducer_override(self: Any, obj: Any) -> Any:
        out = original(self, obj)
        if not isinstance(obj, torch.Tensor):
            return out
        if isinstance(out, tuple) and getattr(out[0], "__func__", None) is tensor_fn:
            marks = {k: getattr(obj, k) for k in _DIM_MARKS if hasattr(obj, k)}
            if marks:
                return _unpickle_marked, (marks, out[0], out[1])
        return out

    GuardsStatePickler.reducer_override = reducer_override
    try:
        yield
    finally:
        GuardsStatePickler.reducer_override = original


@contextlib.contextmanager
def _local_key_order() -> Any:
    """Dynamo's guards pickled without the key order of dicts reached through a global. Dynamo
    keeps, apart from its guards, the dicts whose keys it read by position (``list(d.keys())[2]``),
    and torch (2.11 to 2.13) pickles them even when the guard filter drops every guard on a
    global. A global dict's key order is this process's history: transformers' registry of model
    classes holds every class built before, so a process that built another model first saved
    ``[2]`` where a new one finds a single key, and the artifact could not be loaded there
    (IndexError while torch rebuilt the guards). Dicts reached from the model's own arguments
    keep theirs."""
    from torch._dynamo import guards
    from torch._dynamo.source import is_from_global_source

    original = guards.pickle_guards_state

    def pickle_guards_state(state: Any, *args: Any, **kwargs: Any) -> bytes:
        og = state.output_graph
        og.guard_on_key_order = {s for s in og.guard_on_key_order if not is_from_global_source(s)}
        return original(state, *args, **kwargs)

    guards.pickle_guards_state = pickle_guards_state
    try:
        yield
    finally:
        guards.pickle_guards_state = original


def _unpickle_marked(marks: dict[str, Any], unpickle: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> torch.Tensor:
    t = unpickle(*args)
    for k, v in marks.items():
        setattr(t, k, v)
    return t


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def serializable_guards(entries: Sequence[Any]) -> list[bool]:
    """Dynamo's guard filter for a precompile: every guard but those torch cannot serialize
    (identity checks, ``ID_MATCH`` and the guards derived from it, and guards on globals)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (e.is_global or {e.guard_type, *e.derived_guard_types} & unsupported) for e in entries]


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], bytes]:
    """The artifact's header and torch's bytes (StaleArtifact: not an artifact of this format)."""
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise StaleArtifact(f"{path} is not an fxrewrite artifact of this format")
    (size,) = struct.unpack("<Q", data[len(MAGIC) : len(MAGIC) + 8])
    start = len(MAGIC) + 8
    try:
        header = json.loads(data[start : start + size])
    except ValueError as e:
        raise StaleArtifact(f"{path}: unreadable header ({e})") from e
    return header, data[start + size :]


def check_header(header: dict[str, Any], config: Any) -> None:
    """StaleArtifact unless ``header``'s key is the key of its graph under ``config`` here."""
    if header.get("format") != 1:
        raise StaleArtifact(f"artifact format {header.get('format')!r}, not 1")
    now = Identity(header["graph"], header["devices"]).header(config)
    if now["key"] != header["key"]:
        differ = [part for part in ("config", "environment") if now[part] != header[part]]
        what = {"config": "the configuration or rules", "environment": "torch, fxrewrite, a kernel library or the device"}
        raise StaleArtifact("the compile cache's key differs: " + (" and ".join(what[p] for p in differ) or "unknown"))


def check_sources(source_info: Any) -> None:
    """StaleArtifact when a function Dynamo traced has other source now (torch's SourceInfo:
    each traced function's lines and their hash)."""
    import importlib

    from torch._dynamo.package import _hash_sourcelines

    for s in source_info.inlined_sources:
        try:
            module = sys.modules.get(s.module) or importlib.import_module(s.module)
            same = _hash_sourcelines(module, s.firstlineno, s.lastlineno) == s.checksum
        except (ImportError, OSError, TypeError) as e:
            raise StaleArtifact(f"the traced module {s.module} cannot be read here ({e})") from e
        if not same:
            raise StaleArtifact(f"the source of {s.module} (lines {s.firstlineno}-{s.lastlineno}) changed")


def load(path: str | os.PathLike[str], model: Any, backend: Backend | None = None, *, dynamic: bool | None = True,
         recompile: bool = True) -> Precompiled:  # fmt: skip
    """The artifact at ``path`` for ``model``, run through ``backend`` (default ``Backend()``;
    its configuration must be the one compiled with). No Dynamo trace, no pass. Raises
    :class:`StaleArtifact` on a miss (FileNotFoundError when there is no file)."""
    _available()
    from torch._dynamo.aot_compile import AOTCompiledFunction
    from torch._dynamo.convert_frame import get_compile_id
    from torch._dynamo.utils import get_metrics_context
    from torch._guards import CompileContext, compile_context

    from fxrewrite.backend import Backend

    backend = backend or Backend()
    header, blob = read_header(path)
    check_header(header, backend.config)
    try:
        with compile_context(CompileContext(get_compile_id({}))), get_metrics_context():
            fn = AOTCompiledFunction.deserialize(blob, _globals(header))
    except Exception as e:  # noqa: BLE001 - torch refuses it (another Python, GPU, a missing op): a miss
        raise StaleArtifact(f"torch cannot load {path}: {type(e).__name__}: {e}") from e
    check_sources(fn.source_info())
    graph = fn._artifacts.compiled_fn
    if not isinstance(graph, FusedGraph):
        raise StaleArtifact(f"{path} holds a {type(graph).__name__}, not an fxrewrite graph")
    graph.bind(backend)
    done = Precompiled(fn, model, backend, header, dynamic=dynamic, recompile=recompile)
    done.loaded = True
    return done


def warm_start(model: Any, path: str | os.PathLike[str], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
               *, backend: Backend | None = None, dynamic: bool | None = True) -> Precompiled:  # fmt: skip
    """What a serving engine calls at start-up: the artifact at ``path`` when it fits (no
    trace, no pass), else ``model`` compiled now with ``args`` / ``kwargs`` as example inputs
    and saved there (the reason for the miss logged)."""
    from fxrewrite.backend import Backend

    backend = backend or Backend()
    try:
        return load(path, model, backend, dynamic=dynamic)
    except FileNotFoundError:
        log.info("fxrewrite: no precompiled artifact at %s; compiling", path)
    except StaleArtifact as e:
        log.warning("fxrewrite: precompiled artifact %s not used (%s); compiling again", path, e)
    done = aot_compile(backend, model, args, kwargs, dynamic=dynamic)
    done(*args, **(kwargs or {}))  # before saving: a runner that cannot run is not kept
    done.save(path)
    return done
