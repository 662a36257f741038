"""Reading and recomputing the fake-tensor metadata Dynamo leaves on nodes.

Dynamo stores a fake tensor (or SymInt/SymFloat) in ``node.meta["example_value"]``; exported
graphs use ``"val"``. Pattern graphs traced by ``torch.fx.symbolic_trace`` carry no fake values, so
they get a coarse kind ("tensor" or "scalar") in ``node.meta["fxr_kind"]`` instead.
"""

from __future__ import annotations

import functools
import logging
import operator
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch.utils.weak import WeakIdKeyDictionary

log = logging.getLogger(__name__)

# Ops whose output may share storage with an input: an in-place kernel must not write to them.
VIEW_TARGETS = frozenset(
    {
        torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten.slice.Tensor,
        torch.ops.aten.expand.default, torch.ops.aten.permute.default, torch.ops.aten.transpose.int,
        torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.t.default,
        torch.ops.aten.alias.default, torch.ops.aten.as_strided.default, torch.ops.aten.flatten.using_ints,
        torch.ops.aten.unflatten.int, operator.getitem,
    }
)  # fmt: skip
VIEW_METHODS = frozenset(
    {"view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "t", "contiguous",
     "to", "type", "narrow", "unflatten", "flatten", "detach", "view_as", "expand_as", "__getitem__"}
)  # fmt: skip




def is_view(n: fx.Node) -> bool:
    """``n``'s output may share storage with its first input (a view, ``.to`` that may return
    its input); one output of a multi-output op is not a view."""
    if n.target is operator.getitem and isinstance(value(n.args[0]), (tuple, list)):
        return False
    return (n.op == "call_function" and n.target in VIEW_TARGETS) or (n.op == "call_method" and n.target in VIEW_METHODS)


_NOT_TENSOR_METHODS = frozenset({"size", "dim", "item", "numel", "tolist", "stride", "is_contiguous"})


def value(node: Any) -> Any:
    """The fake value of ``node`` (tensor, SymInt, tuple ...) or None when unknown."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value")
    return node.meta.get("val") if v is None else v


def tensor(node: Any) -> torch.Tensor | None:
    """The fake tensor of ``node``, or None if it is not known to be a tensor."""
    v = value(node)
    return v if isinstance(v, torch.Tensor) else None


def hint(v: Any) -> Any:
    """A concrete value for an int / float / bool that may be symbolic (its hint: the value
    Dynamo traced with); None for an unbacked symbol."""
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        node = v.node
        h = getattr(node, "hint", None)
        if h is None:
            try:
                h = node.require_hint() if hasattr(node, "require_hint") else None
            except Exception:  # noqa: BLE001 - an unbacked symbol has no hint
                h = None
        return h
    return v


UNBACKED_STAND_IN = 7  # what a size read from data (an unbacked symbol) is checked at, within its range


def check_value(v: Any) -> Any:
    """A concrete value to check a site at: :func:`hint`, or for an expression of unbacked
    symbols (a count read from data: tokens routed to an expert, the length of a ``nonzero``)
    its value at :func:`_stand_ins`. None when those break one of the graph's runtime asserts
    that tie the symbols, or the expression cannot be evaluated."""
    h = hint(v)
    if h is not None or not isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return h
    try:
        env = v.node.shape_env
        expr = env.replace(v.node.expr)
        values = _stand_ins(env, expr.free_symbols)
        if values is None:
            return None
        return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(v)](expr.xreplace(values))
    except Exception:  # noqa: BLE001 - an expression sympy cannot evaluate here: no value
        return None


def _stand_ins(env: Any, symbols: set[Any]) -> dict[Any, Any] | None:
    """``symbols``, and every symbol the graph's runtime asserts tie them to, at concrete
    values: backed symbols at their hints; an unbacked one that an assert equates with a known
    value solved from it (several summing to one value get equal shares: the sizes of a split);
    the others at ``UNBACKED_STAND_IN`` clamped into their range. None when the asserts that
    tie them do not all hold there."""
    import sympy

    values: dict[Any, Any] = dict(getattr(env, "backed_var_to_val", None) or env.var_to_val)
    asserts = [ra.expr for ras in env.deferred_runtime_asserts.values() for ra in ras]
    tied, wanted, grew = [], set(symbols), True
    while grew:
        grew = False
        for a in asserts:
            if a not in tied and a.free_symbols & wanted:
                tied.append(a)
                wanted |= a.free_symbols
                grew = True
    for a in tied:
        if isinstance(a, sympy.Eq):
            values.update(_shares(sympy.expand((a.lhs - a.rhs).xreplace(values))))
    for sym in wanted - values.keys():
        r = env.var_to_range[sym]
        values[sym] = sympy.Max(r.lower, sympy.Min(UNBACKED_STAND_IN, r.upper))
    in_range = all(env.var_to_range[s].lower <= values[s] <= env.var_to_range[s].upper
                   for s in wanted if s in env.var_to_range)  # fmt: skip
    return values if in_range and all(a.xreplace(values) is sympy.true for a in tied) else None


def _shares(e: Any) -> dict[Any, int]:
    """Values of the symbols of ``e`` (``c * (x1 + ... + xn) + k``, all coefficients equal)
    that make it zero, in equal shares; empty when ``e`` has another form or no such values."""
    unknowns = sorted(e.free_symbols, key=str)
    if not unknowns:
        return {}
    c = e.coeff(unknowns[0])
    k = e.xreplace(dict.fromkeys(unknowns, 0))
    if c == 0 or e != c * sum(unknowns) + k or not (-k / c).is_integer or -k / c < 0:
        return {}
    q, r = divmod(int(-k / c), len(unknowns))
    return {u: q + (i < r) for i, u in enumerate(unknowns)}


@functools.cache
def _example_mode() -> Any:
    """One FakeTensorMode without a shape environment, for :func:`example`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def example(v: Any) -> Any:
    """``v`` (a fake value) at its hints: a tensor becomes a fake tensor of concrete shape and
    strides, same dtype and device, outside the graph's shape environment (reading its sizes
    adds no guard); a symbolic scalar its hint; None when a size has no hint."""
    if not isinstance(v, torch.Tensor):
        return hint(v)
    shape, stride = [hint(d) for d in v.shape], [hint(d) for d in v.stride()]
    if any(d is None for d in shape + stride):
        return None
    with _example_mode():
        return torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)


def at_hints(args: Any) -> Any:
    """``args`` (a node's arguments, nested) with every node as :func:`example` of its value:
    what a call of the node will pass, for a kernel built ahead (``providers.prebuild``)."""
    return fx.node.map_arg(args, lambda a: example(value(a)))


def is_tensor(arg: Any) -> bool:
    """True if ``arg`` is a node that produces a tensor (from fake values or the pattern kind)."""
    if not isinstance(arg, fx.Node):
        return False
    v = value(arg)
    if v is not None:
        return isinstance(v, torch.Tensor)
    return arg.meta.get("fxr_kind") == "tensor"


def mark_kinds(graph: fx.Graph, scalar_names: Iterable[str]) -> None:
    """Give every node of a pattern graph a kind, since symbolic tracing records no values.

    Placeholders are tensors unless named in ``scalar_names``; a call is a tensor when one of its
    inputs is (except ``size``/``item``-like methods and ``getattr``).
    """
    scalars = set(scalar_names)
    for n in graph.nodes:
        if n.op == "placeholder":
            kind = "scalar" if n.target in scalars else "tensor"
        elif n.op in ("call_function", "call_method"):
            inputs = n.all_input_nodes
            tensorish = any(is_tensor(a) for a in inputs)
            if n.op == "call_method" and n.target in _NOT_TENSOR_METHODS:
                tensorish = False
            if n.target is getattr or (n.target is operator.getitem and not is_tensor(n.args[0])):
                tensorish = False
            kind = "tensor" if tensorish else "scalar"
        else:
            kind = "scalar"
        n.meta["fxr_kind"] = kind


def fake_mode_of(graph: fx.Graph) -> Any:
    """The FakeTensorMode the graph's values were made in, or None."""
    for n in graph.nodes:
        t = tensor(n)
        mode = getattr(t, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def _fake_arg(a: Any) -> Any:
    return fx.node.map_arg(a, value)


# Fake values already computed, per fake mode, keyed by (target, signature of the inputs).
# Symbolic fake dispatch costs milliseconds per op; a 32-layer model repeats each signature 32x.
_CACHE: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def dim_key(d: Any) -> Any:
    """A hashable stand-in for a size: the int, or the symbolic expression (no printing)."""
    return d.node.expr if isinstance(d, torch.SymInt) else d


# A fake tensor's part of a signature, per tensor: propagated values are shared between nodes.
_TENSOR_SIGNATURES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _signature(a: Any) -> Any:
    if isinstance(a, fx.Node):
        v = value(a)
        if isinstance(v, torch.Tensor):
            sig = _TENSOR_SIGNATURES.get(v)
            if sig is None:
                sig = ("T", v.dtype, v.device, tuple(map(dim_key, v.shape)), tuple(map(dim_key, v.stride())))
                _TENSOR_SIGNATURES[v] = sig
            return sig
        if isinstance(v, torch.SymFloat):
            return ("S", "SymFloat")  # a float never decides a shape
        if isinstance(v, (torch.SymInt, torch.SymBool)):
            return ("S", type(v).__name__, v.node.expr)
        return ("N", id(a))  # unknown: never shared
    if isinstance(a, (list, tuple)):
        return tuple(_signature(x) for x in a)
    if isinstance(a, dict):
        return tuple((k, _signature(v)) for k, v in sorted(a.items()))
    if isinstance(a, slice):
        return ("slice", _signature(a.start), _signature(a.stop), _signature(a.step))
    return (type(a).__name__, repr(a))


def propagate(node: fx.Node, fake_mode: Any) -> None:
    """Compute ``node.meta["example_value"]`` by running its target on its inputs' fake values.

    Results are shared between nodes with the same target and input signature (dtype, device,
    symbolic shape and strides). Leaves the meta empty (and logs at debug) when an input has no
    value or the op refuses fake tensors: later stages treat unknown metadata conservatively.
    """
    if fake_mode is None or node.op != "call_function":
        return
    if any(value(a) is None for a in node.all_input_nodes):
        return
    cache = _CACHE.setdefault(fake_mode, {})
    key = (node.target, _signature(node.args), _signature(node.kwargs))
    if key in cache:
        node.meta["example_value"] = cache[key]
        return
    args, kwargs = _fake_arg(node.args), _fake_arg(node.kwargs)
    try:
        # The Python dispatcher lets composite ops (aten.linear -> matmul) decompose on symbolic
        # shapes, as Dynamo does while tracing (torch 2.11 throws without it).
        with fake_mode, torch.no_grad(), enable_python_dispatcher():
            out = node.target(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - metadata is best effort; the node still runs
        log.debug("no fake value for %s (%s): %s", node.name, node.target, e)
        return
    cache[key] = out
    node.meta["example_value"] = out


def promotion_makes(src: torch.Tensor, dtype: torch.dtype, other: Any) -> bool:
    """Whether ``src.to(dtype)`` as an operand of ``+ - * /`` beside ``other`` computes exactly
    what ``src`` itself computes there: the cast widens (loses nothing) and type promotion with
    ``other`` picks the same dtype with the cast as without it (``h * w.float()`` with ``h``
    float32 and ``w`` bfloat16 is ``h * w``). ``other``: a tensor (a fake one will do) or a number.

    Promotion reads dtypes and whether a tensor is 0-dim, so meta tensors stand in.
    """
    if not (isinstance(dtype, torch.dtype) and src.is_floating_point() and dtype.is_floating_point):
        return False
    if src.dtype.itemsize == 1 or dtype.itemsize == 1:
        return False  # float8 types do not promote: the cast is what makes the arithmetic legal
    if torch.promote_types(src.dtype, dtype) != dtype:
        return False  # narrowing: the cast rounds

    def like(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        return torch.empty([1] * min(t.dim(), 1), dtype=dt, device="meta")

    if isinstance(other, torch.Tensor):
        if other.dtype.is_floating_point and other.dtype.itemsize == 1:
            return False  # float8 beside it: nothing promotes, the arithmetic raises
        other = like(other, other.dtype)
    elif not isinstance(other, (bool, int, float)):
        return False
    return torch.result_type(other, like(src, src.dtype)) == torch.result_type(other, like(src, dtype))


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                      operator.setitem}
# ``a & b``, ``a | b``, ``not a``: named with a trailing underscore (Python keywords), not in place
_OPERATOR_KEYWORDS = {operator.and_, operator.or_, operator.not_}


def written_args(node: fx.Node) -> list[Any]:
    """The arguments ``node`` writes in place: ``x.add_(y)``, ``operator.iadd``, ``out=``,
    ``inplace=True``, an ATen overload whose schema marks an argument written."""
    t = node.target
    if node.op == "call_method":
        inplace = t.endswith("_") and not t.startswith("_")
        return [node.args[0]] if inplace and node.args else []
    if node.op != "call_function":
        return []
    out = [node.kwargs["out"]] if "out" in node.kwargs else []
    if t in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
        out.append(node.args[0])
    elif (getattr(t, "__name__", "").endswith("_") and not getattr(t, "__name__", "_").startswith("_")
          and t not in _OPERATOR_KEYWORDS):  # fmt: skip
        out.append(node.args[0])
    if isinstance(t, torch._ops.OpOverloadPacket) and "default" in t.overloads():
        t = t.default
    if isinstance(t, torch._ops.OpOverload):
        for i, arg in enumerate(t._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                out.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
    return out



def written_later(node: fx.Node) -> bool:
    """``node``'s value, or a view of it, is written in place by some node."""
    stack = [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if any(a is n for a in written_args(u)):
                return True
            if is_view(u):
                stack.append(u)
    return False


def outside_transforms(graph: fx.Graph) -> Iterator[fx.Node]:
    """The nodes of ``graph`` that run outside every functorch transform. Dynamo inlines
    ``torch.vmap`` (``grad``, ``jvp``) as calls that enter and leave a nesting level around the
    body, which runs on batched tensors (Mamba's associative scan in transformers): a fused op
    has no batching rule, so passes leave those bodies as Dynamo traced them."""
    depth = 0
    for n in graph.nodes:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name.endswith("_increment_nesting"):
            depth += 1
        elif name.endswith("_decrement_nesting"):
            depth -= 1
        elif depth == 0:
            yield n


def is_impure(node: fx.Node) -> bool:
    """What dead-code elimination must keep although nothing reads it: FX's own notion (calls
    with side effects, in-place ATen overloads), every in-place write of :func:`written_args`
    (FX drops an unread ``x.add_(1)`` call_method), and every call of a Python function that
    is not a known pure computation: Dynamo records state changes as unread calls (functorch's
    ``_vmap_increment_nesting`` around an inlined ``torch.vmap``, whose removal breaks the
    batched calls after it)."""
    return node.is_impure() or bool(written_args(node)) or (node.op == "call_function" and not _known_pure(node.target))


def _known_pure(target: Any) -> bool:
    """An operator overload (ATen, prims, ours), a function of ``operator`` or ``math``, or a
    public function of the ``torch`` / ``torch.nn.functional`` / ``torch.Tensor`` namespaces."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    module, name = getattr(target, "__module__", None) or "", getattr(target, "__name__", "")
    if module in ("_operator", "operator", "math") or target is getattr:
        return True
    if name.startswith("_"):
        return False
    return any(getattr(ns, name, None) is target for ns in (torch, torch.nn.functional, torch.Tensor))


def size_equal(a: Any, b: Any) -> bool:
    """Two sizes are equal: identical (symbolic) expressions, or else, where one is symbolic
    and Dynamo could not simplify it (``s0 // (s0 // 16) // 2`` for 8), equal for the traced
    sizes; that comparison is recorded as a guard of the compiled graph (Dynamo recompiles
    when it fails), as Inductor's shape decisions are."""
    if dim_key(a) == dim_key(b):
        return True
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return bool(a == b)
    return False


def sizes_match(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes in the sense of :func:`size_equal` (a guard where Dynamo left two spellings
    of one size, such as ``2 * ((d + 1) // 2)`` for an even ``d``)."""
    return a.dim() == b.dim() and all(size_equal(x, y) for x, y in zip(a.shape, b.shape))


def same_sizes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal (possibly symbolic) shapes, compared without adding shape guards."""
    return a.dim() == b.dim() and all(dim_key(x) == dim_key(y) for x, y in zip(a.shape, b.shape))


def same_shape(a: Any, b: Any) -> bool:
    """Both fake tensors known and of identical (possibly symbolic) shape."""
    ta, tb = tensor(a), tensor(b)
    return ta is not None and tb is not None and same_sizes(ta, tb)


def copy_provenance(src: fx.Node, dst: fx.Node) -> None:
    """Keep where the replaced code came from on the node that replaces it."""
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in src.meta and key not in dst.meta:
            dst.meta[key] = src.meta[key]


def source_line(node: fx.Node) -> str:
    """``file:line`` of the model code that produced ``node`` (last user frame of its trace)."""
    trace = node.meta.get("stack_trace") or ""
    for line in reversed(trace.strip().splitlines()):
        line = line.strip()
        if line.startswith("File "):
            parts = line.split(",")
            fname = parts[0][len("File ") :].strip().strip('"')
            lineno = parts[1].strip().removeprefix("line ") if len(parts) > 1 else "?"
            return f"{fname.rsplit('/', 1)[-1]}:{lineno}"
    return ""


def module_path(node: fx.Node) -> str:
    """Qualified name of the innermost module that produced ``node`` (from nn_module_stack)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return _ROOT.sub("", str(path))


def common_module(nodes: Iterable[fx.Node]) -> str:
    """Qualified name of the innermost module every one of ``nodes`` ran in (the nodes with no
    module stack left out): an MoE block around its router and experts."""
    stacks = [list(s.values()) for n in nodes if (s := n.meta.get("nn_module_stack"))]
    if not stacks:
        return ""
    common = [v for v in stacks[0] if all(v in s for s in stacks[1:])]
    return _ROOT.sub("", str(common[-1][0])) if common else ""


# Dynamo's name for the compiled module itself: ``L['self']``, or ``L['args'][0]`` when the
# forward it enters is a wrapper taking the module as its first argument (transformers 5.24's
# decorated forwards)
_ROOT = re.compile(r"^L\['\w+'\](?:\[\d+\])*\.?")


def constant(node: fx.Node) -> float | int | None:
    """The compile-time value of a scalar node that reads a lifted constant, else None.

    Under ``dynamic=True`` Dynamo turns Python float globals and module attributes into 1-element
    tensor inputs read with ``.item()``. The backend records their values at compile time in
    ``meta["fxr_real"]``; a pattern literal may match such a node when the values are equal (the
    rewritten op then uses the compile-time value).
    """
    if node.op == "call_method" and node.target == "item" and isinstance(node.args[0], fx.Node):
        real = node.args[0].meta.get("fxr_real")
        return real.item() if isinstance(real, torch.Tensor) else None
    if node.op == "call_function" and node.target is operator.neg and isinstance(node.args[0], fx.Node):
        c = constant(node.args[0])
        return -c if c is not None else None
    return None


STATE_KEYS = ("fxr_param", "fxr_buffer", "fxr_real")  # a placeholder's compile-time value (backend)


def is_state(node: fx.Node) -> bool:
    """Whether ``node`` is a placeholder holding module state (a parameter, a buffer, a lifted
    Python float) whose compile-time value the backend recorded."""
    return any(k in node.meta for k in STATE_KEYS)


def real(node: fx.Node) -> Any:
    """The compile-time value of a placeholder holding module state, else None. A pass whose
    result depends on such a value reads it here: the read is recorded (:func:`reads`), and the
    compile cache serves the rewritten graph only to a graph whose values read are equal."""
    for key in STATE_KEYS:
        if key in node.meta:
            reads(node.graph).add(node.name)
            return node.meta[key]
    return None


def attribute(gm: fx.GraphModule, target: str) -> Any:
    """``gm``'s attribute ``target`` (``"a.b"``), the read recorded as :func:`real`'s are."""
    reads(gm.graph).add(f"attr:{target}")
    return functools.reduce(getattr, target.split("."), gm)


def reads(graph: fx.Graph) -> set[str]:
    """The real values read so far while rewriting ``graph``: placeholder names, and
    ``attr:<target>`` for attributes of its module (empty for a graph without a module)."""
    gm = graph.owning_module
    return gm.meta.setdefault("fxr_reads", set()) if gm is not None else set()


# How a constant a pass registered can be made again from the graph's inputs, by name:
# ``fn(*[value of each input])``. ``constant_node(..., rebuild=(fn, inputs))`` records it in
# ``gm.meta["fxr_constants"]``; the compile cache calls it instead of storing the tensor.
Rebuild = tuple[Callable[..., torch.Tensor], Sequence[fx.Node]]


def constant_node(gm: fx.GraphModule, name: str, value: torch.Tensor, fake_mode: Any,
                  rebuild: Rebuild | None = None) -> fx.Node:  # fmt: skip
    """A ``get_attr`` node (at the graph's insert point) reading ``value``, registered on ``gm`` as
    the non-persistent buffer ``name``, with a fake value (one per shape, shared by all users).
    ``rebuild``: how to make ``value`` again from placeholders (a view of parameters, say);
    without it the compile cache stores the tensor itself."""
    if not hasattr(gm, name):
        gm.register_buffer(name, value, persistent=False)
    recipes = gm.meta.setdefault("fxr_constants", {})
    recipes[name] = None if rebuild is None else (rebuild[0], [n.name for n in rebuild[1]])
    node = gm.graph.get_attr(name)
    if fake_mode is not None:
        node.meta["example_value"] = constant_fake(value, fake_mode)
    return node


def constant_fake(value: torch.Tensor, fake_mode: Any) -> torch.Tensor:
    """The fake tensor of a constant, one per dtype, device and shape in ``fake_mode``."""
    key = (value.dtype, value.device, tuple(value.shape))
    fakes = _CONSTANT_FAKES.setdefault(fake_mode, {})
    if key not in fakes:
        fakes[key] = fake_mode.from_tensor(value, static_shapes=True)
    return fakes[key]


_CONSTANT_FAKES: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], torch.Tensor]] = weakref.WeakKeyDictionary()


def ancestors(*nodes: fx.Node, stop: fx.Node | None = None) -> set[fx.Node]:
    """``nodes`` and every node they read, transitively; the walk does not enter ``stop``."""
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen and n is not stop:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen

