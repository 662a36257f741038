"""What a rewritten graph depends on, as one hash: the key of the compile cache (:mod:`fxrewrite.cache`).

A Dynamo graph, a configuration and an environment decide what the passes make of it::

    key = hash(hash(graph_fingerprint(gm)), config_fingerprint(config), environment(devices))

* **the graph**: every node (op, name, target, arguments, literals exactly), every input's dtype,
  device, symbolic shape and strides, the ranges of its symbols, whether it is a parameter or a
  buffer, the value of each lifted Python float; not the sizes Dynamo traced at (verification
  checks one size and the graph serves all of them, so a graph verified at another size gives
  the same guarantee);
* **the configuration**: every field that changes what the passes do (not ``dump_dir``,
  ``progress``, the cache's own); a rule by its pattern and replacements (:func:`rule_code`: a
  library rule by its functions, any other by its traced and canonicalized graphs) and the code
  of its guard and scalar predicates (:func:`callable_fingerprint`:
  bytecode, constants, closures, defaults, and the same of every function, class and plain value
  of the rule's own modules that the code names, transitively);
* **the environment**: Python, torch, fxrewrite (version and a hash of every source file of the
  package: any edit of a rule, pass or kernel of the library misses), the kernel libraries'
  versions, the name and capability of each CUDA device the inputs live on.

Values the passes read from module state (``meta.real``: RoPE tables folded from a buffer) are
not in the key: the cache stores a digest of each next to the graph and compares it on load.

The same encoding (:func:`encode`, :func:`target_ref`) serializes the rewritten graph: plain
Python values only, no pickled objects, so a cache entry loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from fxrewrite import meta
from fxrewrite.rule import Rule


class Uncacheable(Exception):
    """This graph or configuration cannot be keyed or stored; the message says why."""


# --------------------------------------------------------------------------- values and targets

_ENUMS = ((torch.dtype, "dtype"), (torch.memory_format, "memory_format"), (torch.layout, "layout"))


def encode(v: Any) -> Any:
    """``v`` (a node argument) as plain Python values: a node as ``["node", name]``, containers
    tagged with their type, dtypes / devices / layouts by name. Uncacheable for anything else."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, fx.Node):
        return ["node", v.name]
    if isinstance(v, torch.Size):
        return ["size", [encode(x) for x in v]]
    if isinstance(v, (tuple, list)):
        return ["tuple" if isinstance(v, tuple) else "list", [encode(x) for x in v]]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return ["dict", [[k, encode(x)] for k, x in v.items()]]
    if isinstance(v, slice):
        return ["slice", encode(v.start), encode(v.stop), encode(v.step)]
    if v is Ellipsis:
        return ["ellipsis"]
    if isinstance(v, torch.device):
        return ["device", str(v)]
    for kind, tag in _ENUMS:
        if isinstance(v, kind):
            return [tag, str(v).removeprefix("torch.")]
    raise Uncacheable(f"an argument of type {type(v).__name__} ({v!r:.60})")


def decode(e: Any, nodes: dict[str, fx.Node]) -> Any:
    """The inverse of :func:`encode`, with node names looked up in ``nodes``."""
    if not isinstance(e, list):
        return e
    tag, rest = e[0], e[1:]
    if tag == "node":
        return nodes[rest[0]]
    if tag in ("tuple", "list", "size"):
        items = [decode(x, nodes) for x in rest[0]]
        return tuple(items) if tag == "tuple" else torch.Size(items) if tag == "size" else items
    if tag == "dict":
        return {k: decode(x, nodes) for k, x in rest[0]}
    if tag == "slice":
        return slice(*(decode(x, nodes) for x in rest))
    if tag == "ellipsis":
        return Ellipsis
    if tag == "device":
        return torch.device(rest[0])
    if tag in ("dtype", "memory_format", "layout"):
        value = getattr(torch, rest[0])
        if not isinstance(value, dict(map(reversed, _ENUMS))[tag]):
            raise ValueError(f"not a torch {tag}: {rest[0]!r}")
        return value
    raise ValueError(f"unknown tag {tag!r}")


_REFS: dict[Any, Any] = {}


def target_ref(t: Any) -> Any:
    """A name for a node's target that :func:`resolve_target` turns back into the same object:
    a string as is, an op overload or packet by its qualified name, a function by its module and
    qualified name (found in ``sys.modules``, never imported). Uncacheable for anything else
    (a lambda, a local function, a callable object)."""
    if isinstance(t, str):
        return t
    try:
        return _REFS[t]
    except (KeyError, TypeError):
        pass
    if isinstance(t, torch._ops.OpOverload):
        ref: Any = ["op", t._schema.name, t._overloadname]
    elif isinstance(t, torch._ops.OpOverloadPacket):
        ref = ["packet", t._qualified_op_name]
    else:
        module = getattr(t, "__module__", None)
        paths = [p for p in (getattr(t, "__qualname__", None), getattr(t, "__name__", None)) if p]
        ref = next((["py", module, p] for p in paths if _lookup(module, p) is t), None)
        if ref is None:
            raise Uncacheable(f"the call target {t!r:.80} cannot be named")
    with contextlib.suppress(TypeError):  # unhashable targets are named every time
        _REFS[t] = ref
    return ref


def resolve_target(ref: Any) -> Any:
    """The object :func:`target_ref` named (KeyError / AttributeError when it is not there)."""
    if isinstance(ref, str):
        return ref
    kind = ref[0]
    if kind in ("op", "packet"):
        ns, name = ref[1].split("::")
        packet = getattr(getattr(torch.ops, ns), name)
        return getattr(packet, ref[2]) if kind == "op" else packet
    found = _lookup(ref[1], ref[2])
    if found is None:
        raise KeyError(f"{ref[1]}.{ref[2]} is not loaded")
    return found


def _lookup(module: str | None, path: str) -> Any:
    obj: Any = sys.modules.get(module or "")
    for part in path.split("."):
        if obj is None or part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj


def digest(parts: Any) -> str:
    """A hex digest of ``repr(parts)`` (plain values: their repr is exact and stable)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=20).hexdigest()


# --------------------------------------------------------------------------- the graph


def node_record(n: fx.Node) -> tuple[Any, ...]:
    """``(op, name, target, args, kwargs)`` of one node, encoded: what the key holds of it and
    what a cache entry stores."""
    return (n.op, n.name, target_ref(n.target), encode(n.args), encode(n.kwargs))


def _size(d: Any) -> str:
    return str(meta.dim_key(d))


def _value_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        try:
            stride = [_size(s) for s in v.stride()]
        except RuntimeError:  # sparse or nested: no strides
            stride = None
        return ["tensor", str(v.dtype), str(v.device), [_size(d) for d in v.shape], stride, v.requires_grad]
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return [type(v).__name__, str(v.node.expr)]
    return ["value", repr(v)]


def input_record(n: fx.Node) -> list[Any]:
    """What the passes may read of a placeholder (or a constant of the Dynamo graph) besides its
    name: its value's metadata, parameter / buffer / static marks, a lifted float's value."""
    v = meta.value(n)
    marks = sorted(k for k in ("fxr_param", "fxr_buffer") if k in n.meta)
    static = "_dynamo_static_input_type" in (n.meta.get("tensor_dict") or {})
    real = n.meta.get("fxr_real")
    lifted = real.tolist() if isinstance(real, torch.Tensor) else None
    return [_value_meta(v), marks, static, lifted]


def graph_fingerprint(gm: fx.GraphModule) -> tuple[list[Any], dict[str, tuple[Any, ...]]]:
    """The graph's part of the key, and each node's record by name (the loader uses those to
    know which nodes of this process's graph a stored node is). Uncacheable when a target or
    argument cannot be named, or a constant of the graph is not a tensor."""
    records: dict[str, tuple[Any, ...]] = {}
    inputs: list[Any] = []
    symbols: set[Any] = set()
    for n in gm.graph.nodes:
        records[n.name] = node_record(n)
        if n.op == "placeholder":
            inputs.append(input_record(n))
            v = meta.value(n)
            if isinstance(v, (torch.Tensor, torch.SymInt)):
                symbols |= free_symbols(v)
        elif n.op == "get_attr":
            value = _attribute(gm, n.target)
            if not isinstance(value, torch.Tensor):
                raise Uncacheable(f"the graph reads `{n.target}`, a {type(value).__name__}, not a tensor")
            inputs.append(["attr", n.target, str(value.dtype), str(value.device), list(value.shape)])
        elif n.op == "call_module":
            raise Uncacheable(f"the graph calls the submodule `{n.target}`")
    fake_mode = meta.fake_mode_of(gm.graph)
    ranges = getattr(getattr(fake_mode, "shape_env", None), "var_to_range", {})
    bounds = sorted((str(s), str(ranges.get(s))) for s in symbols)
    return [list(records.values()), inputs, bounds], records


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), gm)


# --------------------------------------------------------------------------- the configuration


_NOT_KEYED = frozenset({"dump_dir", "progress", "cache", "cache_dir", "strict_capture"})


def config_fingerprint(config: Any) -> list[Any]:
    """Every field of a resolved ``Config`` but those that change no graph (dumps, progress
    output, the cache's own fields), rules and callables by their code."""
    out: list[Any] = []
    for f in dataclasses.fields(config):
        if f.name in _NOT_KEYED:
            continue
        v = getattr(config, f.name)
        if f.name in ("rules", "extra_rules"):
            value = None if v is None else [rule_fingerprint(r) for r in v]
        elif f.name == "splitting_ops":
            value = [op if isinstance(op, str) else target_ref(op) for op in v]
        elif f.name == "attention_quant":
            value = [[target_ref(d.op), target_ref(d.quant_op), d.scale_arg] for d in v]
        elif callable(v):
            value = callable_fingerprint(v)
        else:
            value = encode(v)
        out.append([f.name, value])
    return out


_RULES: dict[int, tuple[Any, list[Any]]] = {}


def rule_fingerprint(rule: Rule) -> list[Any]:
    """A rule by what decides its matches and replacements: its name, its pattern and
    replacements (:func:`rule_code`), and its guard and scalar predicates."""
    hit = _RULES.get(id(rule))
    if hit is not None and hit[0] is rule:
        return hit[1]
    scalars = [[name, getattr(s.kind, "__qualname__", None), callable_fingerprint(s.predicate)]
               for name, s in sorted(rule.scalars.items())]  # fmt: skip
    overwrites = None if rule.inplace is None else list(rule.inplace.overwrites)
    fp = [rule.name, rule.via, rule_code(rule), overwrites, callable_fingerprint(rule.guard), scalars,
          [target_ref(t) for t in rule.requires], list(rule.optional), rule.near_miss_min,
          callable_fingerprint(rule.explain_shared)]  # fmt: skip
    _RULES[id(rule)] = (rule, fp)
    return fp


def library_rule(rule: Rule) -> bool:
    """Whether the pattern and replacements of ``rule`` are functions of fxrewrite's own
    modules (the library's rules, and user rules written with fxrewrite's functions): what they
    trace to is decided by fxrewrite's source, torch's version and the values their closures
    hold, all of which the key holds without tracing them."""
    fns = (rule.pattern, rule.replacement, None if rule.inplace is None else rule.inplace.replacement)
    return all(f is None or (isinstance(f, types.FunctionType) and _ours(f.__module__)) for f in fns)


def rule_code(rule: Rule) -> list[Any]:
    """What ``rule``'s pattern and replacements trace to. A library rule (:func:`library_rule`)
    by its functions (:func:`callable_fingerprint`: their names, closures and defaults; their
    code is in :func:`source_digest`), so a key costs no trace (about 0.3 s for the library's
    rules, in every new process); any other by the code of its traced, canonicalized graphs
    (what its functions compute, whatever global state they read while traced)."""
    if library_rule(rule):
        fns = (rule.pattern, rule.replacement, None if rule.inplace is None else rule.inplace.replacement)
        return ["source", *(callable_fingerprint(f) for f in fns)]
    cr = rule.compiled
    return ["traced", cr.pattern.code, cr.replacement.code, None if cr.inplace is None else cr.inplace.code]


# Modules whose code is keyed otherwise: torch and the standard library by version, fxrewrite by
# the digest of its source.
def _versioned(module: str) -> bool:
    top = module.split(".")[0]
    return top in ("torch", "fxrewrite", "builtins") or top in sys.stdlib_module_names


def _ours(module: str | None) -> bool:
    return (module or "").split(".")[0] == "fxrewrite"


def callable_fingerprint(fn: Any) -> Any:
    """``fn`` by what it computes: for a Python function its bytecode, constants, names,
    closure values and defaults, and the same of every function, class or plain value its code
    names among the globals of a module that is not torch, the standard library or fxrewrite
    (those are keyed by version); ``functools.partial`` and bound methods through their parts;
    a builtin by name. Uncacheable where a captured value has no stable description."""
    if fn is None:
        return None
    return _Walker().callable(fn)


class _Walker:
    """One fingerprint: functions already seen are named, not walked again (recursion)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def callable(self, fn: Any) -> Any:
        if isinstance(fn, functools.partial):
            return ["partial", self.callable(fn.func), self.value(fn.args), self.value(fn.keywords)]
        if isinstance(fn, types.MethodType):
            return ["method", self.callable(fn.__func__), self.value(fn.__self__)]
        if isinstance(fn, types.FunctionType):
            return self.function(fn)
        try:
            return ["target", target_ref(fn)]
        except Uncacheable:
            raise Uncacheable(f"the callable {fn!r:.80} has no stable description") from None

    def function(self, fn: types.FunctionType) -> Any:
        name = [fn.__module__, fn.__qualname__]
        if id(fn) in self.seen:
            return ["function", *name]
        if _ours(fn.__module__):  # code in the source digest; what it closes over may be the user's
            self.seen.add(id(fn))  # (``rule.all_of(user_guard)``)
            cells = [self.value(c.cell_contents) for c in fn.__closure__ or ()]
            return ["function", *name, cells, self.value(fn.__defaults__), self.value(fn.__kwdefaults__)]
        if _versioned(fn.__module__ or ""):
            return ["function", *name]
        self.seen.add(id(fn))
        code = self.code(fn.__code__, fn.__globals__)
        cells = [self.value(c.cell_contents) for c in fn.__closure__ or ()]
        return ["function", *name, code, cells, self.value(fn.__defaults__), self.value(fn.__kwdefaults__)]

    def code(self, code: types.CodeType, globals_: dict[str, Any]) -> Any:
        consts = [self.code(c, globals_) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
        named = []
        for name in code.co_names:  # globals and attributes alike: both may name user code
            if name in globals_:
                named.append([name, self.global_(globals_[name])])
        return [hashlib.blake2b(code.co_code, digest_size=16).hexdigest(), consts, list(code.co_names), named]

    def global_(self, v: Any) -> Any:
        if isinstance(v, types.ModuleType):
            return ["module", v.__name__]
        if isinstance(v, (types.FunctionType, functools.partial)):
            return self.callable(v)
        if isinstance(v, type):
            if _versioned(v.__module__) or id(v) in self.seen:
                return ["class", v.__module__, v.__qualname__]
            self.seen.add(id(v))
            members = sorted((k, self.global_(m)) for k, m in vars(v).items() if isinstance(m, (types.FunctionType, staticmethod, classmethod)))
            return ["class", v.__module__, v.__qualname__, members]
        if isinstance(v, (staticmethod, classmethod)):
            return self.global_(v.__func__)
        try:
            return self.value(v)
        except Uncacheable:
            return ["object", type(v).__module__, type(v).__qualname__]  # its type only

    def value(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str, bytes, torch.dtype, torch.device)):
            return repr(v)
        if isinstance(v, (tuple, list, frozenset, set)):
            items = [self.value(x) for x in v]
            return [type(v).__name__, sorted(items, key=repr) if isinstance(v, (set, frozenset)) else items]
        if isinstance(v, dict):
            return ["dict", sorted(([repr(k), self.value(x)] for k, x in v.items()), key=repr)]
        if isinstance(v, Rule):
            return ["rule", rule_fingerprint(v)]
        if callable(v) and not isinstance(v, type):
            return self.callable(v)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return [type(v).__qualname__, [[f.name, self.value(getattr(v, f.name))] for f in dataclasses.fields(v)]]
        if isinstance(v, type):
            return self.global_(v)
        raise Uncacheable(f"a captured {type(v).__name__} ({v!r:.60}) has no stable description")


# --------------------------------------------------------------------------- the environment


PACKAGES = ("fxrewrite", "fxrewrite.rewrites", "fxrewrite.runtime", "fxrewrite.runtime.ops")
KERNEL_LIBRARIES = (("triton", "triton"), ("sgl_kernel", "sgl-kernel"), ("sgl_kernel", "sglang-kernel"),
                    ("flashinfer", "flashinfer-python"))  # fmt: skip


@functools.cache
def source_digest() -> str:
    """A digest of every Python file of fxrewrite's packages (engine, rules, runtime)."""
    h = hashlib.blake2b(digest_size=20)
    for package in PACKAGES:
        for path in _package_dirs(package):
            for f in sorted(path.glob("*.py")):
                h.update(f"{package}/{f.name}\0".encode())
                h.update(f.read_bytes())
    return h.hexdigest()


def _package_dirs(package: str) -> list[Path]:
    """Where ``package``'s modules are. The engine's is this file's directory: with an editable
    install, a directory of the same name without ``__init__.py`` earlier on sys.path (a test
    tree's ``fxrewrite/``) is what ``find_spec`` reports, and the digest would miss the engine."""
    if package == __package__:
        return [Path(__file__).parent]
    spec = importlib.util.find_spec(package)
    return sorted(Path(d) for d in (spec.submodule_search_locations or [])) if spec else []


@functools.cache
def _library_version(module: str, dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    mod = sys.modules.get(module)
    if mod is not None and getattr(mod, "__version__", None):
        return str(mod.__version__)
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return "absent"
    origin = Path(spec.origin)
    return f"{origin} {origin.stat().st_mtime_ns}"  # found on sys.path without metadata


@functools.cache
def _fxrewrite_version() -> str:
    try:
        return importlib.metadata.version("fxrewrite")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def environment(devices: Iterable[torch.device]) -> list[Any]:
    """Python, torch, fxrewrite (version and source digest), the kernel libraries' versions,
    and each CUDA device's name and compute capability."""
    out: list[Any] = [sys.version, torch.__version__, torch.version.cuda, _fxrewrite_version(), source_digest()]
    out.append([[dist, _library_version(module, dist)] for module, dist in KERNEL_LIBRARIES])
    for d in sorted({str(d) for d in devices if d.type == "cuda"}):
        out.append([d, torch.cuda.get_device_name(d), list(torch.cuda.get_device_capability(d))])
    return out


def devices(values: Iterable[Any]) -> set[torch.device]:
    """The devices of the tensors among ``values``."""
    return {v.device for v in values if isinstance(v, torch.Tensor)}


def graph_digest(gm: fx.GraphModule) -> tuple[str, dict[str, tuple[Any, ...]]]:
    """The digest of :func:`graph_fingerprint`'s first value (the key's part of the graph, which
    a precompiled artifact keeps too), and the node records. Raises Uncacheable."""
    graph, records = graph_fingerprint(gm)
    return digest(graph), records


def key(gm: fx.GraphModule, example_inputs: list[Any], config: Any) -> tuple[str, dict[str, tuple[Any, ...]]]:
    """The cache key of rewriting ``gm`` under ``config`` here, and the graph's node records
    (:func:`graph_fingerprint`). Raises Uncacheable."""
    graph, records = graph_digest(gm)
    return key_of(graph, config, devices(example_inputs)), records


def key_of(graph_digest: str, config: Any, on: Iterable[torch.device]) -> str:
    """The key from its parts: the digest of :func:`graph_fingerprint`'s first value, the
    configuration, the devices of the inputs. A precompiled artifact (:mod:`fxrewrite.precompile`)
    keeps the graph's digest and devices and recomputes its key in the loading process."""
    return digest([graph_digest, config_fingerprint(config), environment(on)])
