"""One spelling per operation, so that one pattern covers every way model code writes it.

Dynamo records torch-level code as written: ``x.pow(2)``, ``x ** 2``, ``torch.pow(x, 2)`` and
``x * x`` are four different nodes. This pass rewrites the operations rules care about into
ATen overloads with every argument bound against the overload's schema, and removes no-ops::

    %pow_1 = call_method[pow](%h, 2)                 %pow_1 = aten.pow.Tensor_Scalar(%h, 2)
    %var = call_method[mean](%pow_1, -1,       ->    %var = aten.mean.dim(%pow_1, [-1], True)
                             keepdim=True)
    %h2 = call_method[to](%x, torch.float32)          (removed when %x is already float32)

Canonical forms (each has a test in tests/fxrewrite/test_canonicalize.py):

* method, function and operator forms -> one ATen overload (``aten.add.Tensor`` ...), arguments
  bound against its schema (kwargs vs positional, defaults filled in);
* scalar-first arithmetic -> tensor first (``2 * x`` -> ``mul(x, 2)``, ``1 - x`` -> ``rsub``,
  ``c / x`` -> ``mul(reciprocal(x), c)``);
* ``.float()`` / ``.half()`` / ``.to(dtype)`` / ``.to(other)`` / ``.type(dtype)`` / ``.type_as``
  -> ``prims.convert_element_type``; casts to the dtype a tensor already has are removed; where
  widening casts sit and which arithmetic reads them (``h * w.float()`` with ``h`` float32 ->
  ``h * w``; ``rotate_half(x).float()`` -> ``rotate_half(x.float())``):
  :mod:`fxrewrite.canonicalize_cast`;
* ``x ** 2`` / ``x.pow(2)`` / ``torch.square(x)`` / ``x * x`` -> ``aten.pow.Tensor_Scalar(x, 2)``;
* ``1 / sqrt(x)`` and ``reciprocal(sqrt(x))`` -> ``aten.rsqrt``; ``a / sqrt(x)`` -> ``a * rsqrt(x)``
  (equal up to rounding);
* ``F.silu(x)`` and ``x * sigmoid(x)`` -> ``aten.silu``; ``F.gelu`` -> ``aten.gelu``; ``F.softplus`` ->
  ``aten.softplus`` with its beta and threshold;
* ``x.index_select(d, i)`` / ``torch.index_select`` -> ``aten.index_select`` with a negative dim;
* ``F.linear`` -> ``aten.linear``; ``x @ w.t()`` (``.T``, ``.mT``, ``transpose``, ``permute``; ``matmul``
  or ``mm``) of a matrix ``w`` -> ``aten.linear(x, w)``; ``torch._scaled_mm(x, w.t(), ...)`` (an FP8
  GEMM; the transpose spelled any of those ways) -> ``aten._scaled_mm(x, aten.t(w), ...)``, every
  argument bound to the schema;
* reshapes (``view``, ``reshape``, ``flatten``, ``unflatten``: ``aten.reshape``, or ``aten.flatten`` /
  ``aten.unflatten`` where they merge or split the last dims), slices (``x[..., a:b]``, ``chunk``,
  ``split``: ``aten.slice.Tensor``), ``contiguous``, ``expand``, ``cat``, ``permute``:
  :mod:`fxrewrite.canonicalize_shape`;
* reduction dims -> a list of negative ints (``mean``, ``amax``, ``sum`` over dims);
* ``F.softmax`` / ``torch.softmax`` / ``x.softmax`` -> ``aten.softmax.int(x, dim)`` with a negative
  dim, its ``dtype=`` argument as a cast before it (what the argument means);
  ``torch.topk`` / ``x.topk`` -> ``aten.topk`` with every argument bound (dim negative);
* ``F.layer_norm`` / ``torch.layer_norm`` -> ``aten.layer_norm`` and ``var`` -> ``aten.var.correction``,
  every argument bound: :mod:`fxrewrite.canonicalize_norm`;
* a call of an op packet with one overload -> that overload, arguments bound: Dynamo records
  ``torch.ops._c10d_functional.all_reduce(x, 'sum', '0')`` (the packet) for a functional
  collective, patterns trace to ``.default``.

The library's first pass then computes a pure call repeated on the same inputs once
(:mod:`fxrewrite.cse`): the three quantizations of one normed value that q, k and v projections
each write become one.

Pattern graphs (traced with ``torch.fx.symbolic_trace``, no fake values) go through the same code;
rules that depend on shapes (negative dims, no-op removal, the reshape spellings) only act where
shapes are known, so patterns are written with negative dims, and a pattern's reshape stays
``aten.reshape``: the matcher pairs it with each spelling (``canonicalize_shape.SPELLINGS``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxrewrite import canonicalize_norm, canonicalize_shape, meta
from fxrewrite.canonicalize_cast import CAST, earlier_cast, hoist, recast, uncast
# the shape forms' targets, named here with the others rules use
from fxrewrite.canonicalize_shape import FLATTEN, MAX, PERMUTE, RESHAPE, SLICE, UNFLATTEN  # noqa: F401

A = torch.ops.aten

# The canonical targets rules can name.
ADD, SUB, MUL, DIV, RSUB = A.add.Tensor, A.sub.Tensor, A.mul.Tensor, A.div.Tensor, A.rsub.Scalar
POW, RSQRT, SQRT, RECIP = A.pow.Tensor_Scalar, A.rsqrt.default, A.sqrt.default, A.reciprocal.default
MEAN, LINEAR = A.mean.dim, A.linear.default
SCALED_MM, TRANSPOSE = A._scaled_mm.default, A.t.default
SILU, GELU, SIGMOID, NEG = A.silu.default, A.gelu.default, A.sigmoid.default, A.neg.default
SOFTPLUS = A.softplus.default
CLAMP, AMAX = A.clamp.default, A.amax.default
INDEX_SELECT = A.index_select.default
SUM, SOFTMAX, TOPK = A.sum.dim_IntList, A.softmax.int, A.topk.default

COMMUTATIVE = frozenset({ADD, MUL})
# Canonical ops that may still become no-ops (after a rewrite changed an input's dtype or shape).
_NOOP_CANDIDATES = frozenset({CAST, RESHAPE, SLICE, RECIP, PERMUTE})

_DTYPE_METHODS = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
}

# (op, target) -> the normalizer of a form kept in its own module, called with the pass and the node
NORMALIZERS = {**canonicalize_norm.NORMALIZERS, **canonicalize_shape.NORMALIZERS}

_MATMUL = {("call_function", operator.matmul), ("call_function", torch.matmul), ("call_method", "matmul"),
           ("call_function", torch.mm), ("call_method", "mm")}


def _transposed_matrix(node: Any) -> fx.Node | None:
    """``w`` when ``node`` is the transpose of ``w`` spelled any way Dynamo records it on a
    matrix (rank checked by the caller), else None."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    w, rest = node.args[0], list(node.args[1:])
    key = _key(node)
    if key in (("call_method", "t"), ("call_function", torch.t)) and not rest:
        return w
    if key == ("call_function", getattr) and rest in (["T"], ["mT"]):
        return w
    if key in (("call_method", "transpose"), ("call_function", torch.transpose)) and len(rest) == 2:
        return w if all(isinstance(d, int) for d in rest) and {d % 2 for d in rest} == {0, 1} else None
    if key == ("call_method", "permute") or (node.op == "call_function" and node.target is PERMUTE):
        dims = list(rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest)
        return w if len(dims) == 2 and all(isinstance(d, int) for d in dims) and [d % 2 for d in dims] == [1, 0] else None
    return None


_UNARY: dict[Any, Any] = {}
for _name in ("rsqrt", "sqrt", "reciprocal", "sigmoid", "neg", "tanh", "exp", "abs", "relu"):
    _op = getattr(A, _name).default
    _UNARY[("call_method", _name)] = _op
    _UNARY[("call_function", getattr(torch, _name))] = _op
_UNARY[("call_function", operator.neg)] = A.neg.default
_UNARY[("call_function", F.silu)] = SILU
_UNARY[("call_function", F.relu)] = A.relu.default
_UNARY[("call_function", F.sigmoid)] = SIGMOID

_BINARY_NAMES = {
    "add": ADD, "sub": SUB, "mul": MUL, "div": DIV, "true_divide": DIV, "multiply": MUL,
    "subtract": SUB, "divide": DIV,
}  # fmt: skip
_BINARY: dict[Any, Any] = {}
for _name, _op in _BINARY_NAMES.items():
    _BINARY[("call_method", _name)] = _op
    if hasattr(torch, _name):
        _BINARY[("call_function", getattr(torch, _name))] = _op
for _fn, _op in ((operator.add, ADD), (operator.sub, SUB), (operator.mul, MUL), (operator.truediv, DIV)):
    _BINARY[("call_function", _fn)] = _op


_INDEX_SELECT = {("call_function", torch.index_select), ("call_method", "index_select")}
_SOFTPLUS = {("call_function", F.softplus), ("call_function", torch._C._nn.softplus), ("call_method", "softplus")}

_CLAMP = {("call_function", f) for f in (torch.clamp, torch.clip, torch.clamp_min, torch.clamp_max)} | {
    ("call_method", m) for m in ("clamp", "clip", "clamp_min", "clamp_max")
}


# Python's operators as Dynamo records some of them on tensors (torch 2.11: ``t.__eq__(0)``, where
# 2.13 records ``operator.eq``): method name -> (the operator's function, whether its two operands
# swap: ``a.__radd__(b)`` is ``b + a``)
_BINARY_OPERATORS = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
                     "rshift")  # fmt: skip
_DUNDERS: dict[str, tuple[Any, bool]] = {
    **{f"__{n}__": (vars(operator)[f"__{n}__"], False) for n in (*_BINARY_OPERATORS, "eq", "ne", "lt", "le", "gt", "ge",
                                                                  "neg", "pos", "invert", "abs")},  # fmt: skip
    **{f"__r{n}__": (vars(operator)[f"__{n}__"], True) for n in _BINARY_OPERATORS},
}


def _key(node: fx.Node) -> tuple[str, Any]:
    return (node.op, node.target)


def bind_schema(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Bind ``args``/``kwargs`` against ``op``'s schema: positional arguments all spelled out
    (defaults filled in), keyword-only arguments in kwargs only when they differ from default."""
    out_args: list[Any] = []
    out_kwargs: dict[str, Any] = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            v = args[i]
        elif arg.name in kwargs:
            v = kwargs[arg.name]
        elif arg.has_default_value():
            v = arg.default_value
        else:
            raise TypeError(f"{op}: missing argument {arg.name!r}")
        if arg.kwarg_only:
            if not (arg.has_default_value() and v == arg.default_value):
                out_kwargs[arg.name] = v
        else:
            out_args.append(v)
    return tuple(out_args), out_kwargs


class _Canon:
    """One pass over a graph; see the module docstring for the forms."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.fake_mode = meta.fake_mode_of(self.graph)
        self.changed = 0

    # -- helpers ------------------------------------------------------------------------------
    def set(self, node: fx.Node, target: Any, args: tuple, kwargs: dict | None = None) -> None:
        args, kwargs = bind_schema(target, args, kwargs or {})
        if node.op == "call_function" and node.target is target and node.args == args and node.kwargs == kwargs:
            return
        # each attribute set on a node updates the graph's lookup table: set only what changes
        if node.op != "call_function":
            node.op = "call_function"
        node.target = target
        node.args = args
        if kwargs or node.kwargs:
            node.kwargs = kwargs
        self.changed += 1

    def drop(self, node: fx.Node, replacement: Any) -> None:
        """Remove ``node``: its users read ``replacement`` instead."""
        node.replace_all_uses_with(replacement)
        self.graph.erase_node(node)
        self.changed += 1

    def new(self, before: fx.Node, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        args, kwargs = bind_schema(target, args, kwargs or {})
        with self.graph.inserting_before(before):
            n = self.graph.call_function(target, args, kwargs)
        meta.copy_provenance(before, n)
        n.meta["fxr_kind"] = "tensor"
        meta.propagate(n, self.fake_mode)
        return n

    def rank(self, node: Any) -> int | None:
        t = meta.tensor(node)
        return t.dim() if t is not None else None

    def neg_dim(self, node: Any, dim: int) -> int:
        r = self.rank(node)
        return dim - r if (isinstance(dim, int) and dim >= 0 and r is not None) else dim

    def dtype(self, node: Any) -> torch.dtype | None:
        t = meta.tensor(node)
        return t.dtype if t is not None else None

    # -- the pass ------------------------------------------------------------------------------
    def run(self) -> int:
        for node in list(self.graph.nodes):
            if node.op in ("call_function", "call_method") and node.graph is not None:
                self.visit(node)
        return self.changed

    def visit(self, node: fx.Node) -> None:
        if isinstance(node.target, torch._ops.OpOverload) and node.target not in _NOOP_CANDIDATES:
            return  # already canonical (a second run, or ATen in the source): nothing to do
        if isinstance(node.target, torch._ops.OpOverloadPacket):
            if node.op == "call_function" and node.target.overloads() == ["default"]:
                self.set(node, node.target.default, node.args, node.kwargs)
            return None
        if node.op == "call_method" and node.target in _DUNDERS and not node.kwargs:
            fn, swap = _DUNDERS[node.target]
            node.op, node.target = "call_function", fn
            node.args = node.args[::-1] if swap else node.args
            self.changed += 1
        key = _key(node)
        if key in NORMALIZERS:
            return NORMALIZERS[key](self, node)
        if node.op == "call_method" and node.target in _DTYPE_METHODS:
            return self.cast(node, node.args[0], _DTYPE_METHODS[node.target])
        if key in (("call_method", "to"), ("call_method", "type"), ("call_method", "type_as")):
            return self.to(node)
        if key == ("call_function", CAST):
            return self.cast(node, node.args[0], node.args[1])
        if key in _UNARY:
            return self.unary(node, _UNARY[key])
        if key in _BINARY:
            return self.binary(node, _BINARY[key])
        if key in (("call_function", operator.pow), ("call_function", torch.pow), ("call_method", "pow")):
            return self.pow(node)
        if key in (("call_function", torch.square), ("call_method", "square")):
            return self.set(node, POW, (node.args[0], 2))
        if key in (("call_function", torch.mean), ("call_method", "mean")):
            return self.reduce(node, MEAN)
        if key in (("call_function", torch.amax), ("call_method", "amax")):
            return self.reduce(node, AMAX)
        if key in (("call_function", torch.sum), ("call_method", "sum")):
            return self.reduce(node, SUM)
        if key in (("call_function", F.softmax), ("call_function", torch.softmax), ("call_method", "softmax")):
            return self.softmax(node)
        if key in (("call_function", torch.topk), ("call_method", "topk")):
            return self.topk(node)
        if key in _CLAMP:
            lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
            hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
            if node.target in ("clamp_max", torch.clamp_max):  # the one bound is the upper one
                lo, hi = None, node.args[1] if len(node.args) > 1 else node.kwargs.get("max")
            if meta.is_tensor(lo) or meta.is_tensor(hi):
                return None  # tensor bounds: clamp.Tensor, not a form rules use
            return self.set(node, CLAMP, (node.args[0], lo, hi))
        if key in _INDEX_SELECT:  # an engine's cos/sin cache read at the positions
            x = node.args[0]
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            index = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
            if not isinstance(dim, int) or "out" in node.kwargs:
                return None  # a named dim, or an out= buffer: kept as written
            return self.set(node, INDEX_SELECT, (x, self.neg_dim(x, dim), index))
        if key in _SOFTPLUS and not node.kwargs.keys() - {"beta", "threshold"}:
            return self.set(node, SOFTPLUS, node.args, node.kwargs)
        if key in (("call_function", F.gelu),):
            return self.set(node, GELU, (node.args[0],), {"approximate": node.kwargs.get("approximate", "none")})
        if key in (("call_function", F.linear), ("call_function", torch._C._nn.linear)):
            return self.set(node, LINEAR, node.args, node.kwargs)
        if key in _MATMUL:
            return self.matmul(node)
        if key == ("call_function", torch._scaled_mm):
            return self.scaled_mm(node)
        return None

    # -- forms ---------------------------------------------------------------------------------
    def unary(self, node: fx.Node, op: Any) -> None:
        x = node.args[0]
        if not meta.is_tensor(x):
            return  # -s on a symbolic scalar stays a Python operator
        if op is RECIP and isinstance(x, fx.Node) and x.target is SQRT and len(x.users) == 1:
            self.set(node, RSQRT, (x.args[0],))
            self.graph.erase_node(x)
            return
        self.set(node, op, (x,))

    def binary(self, node: fx.Node, op: Any) -> None:
        a, b = node.args[0], node.args[1]
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1 or "rounding_mode" in node.kwargs or "out" in node.kwargs:
            return
        ta, tb = meta.is_tensor(a), meta.is_tensor(b)
        if not (ta or tb):
            return  # arithmetic on sizes / symbolic scalars stays as Python operators
        if not ta:
            if op in COMMUTATIVE:
                a, b = b, a
            elif op is SUB:
                return self.set(node, RSUB, (b, a))
            elif op is DIV:
                # c / sqrt(y) -> rsqrt(y) * c when the sqrt is read only here (as in unary)
                fold = isinstance(b, fx.Node) and b.target is SQRT and len(b.users) == 1
                recip = self.new(node, RSQRT, (b.args[0],)) if fold else self.new(node, RECIP, (b,))
                if a == 1:
                    self.drop(node, recip)
                else:
                    self.set(node, MUL, (recip, a))
                if fold:
                    self.graph.erase_node(b)
                return None
        if op is MUL and a is b:
            return self.set(node, POW, (a, 2))
        for x, sig in ((a, b), (b, a)):
            if op is MUL and isinstance(sig, fx.Node) and sig.target is SIGMOID and sig.args[0] is x:
                self.set(node, SILU, (x,))
                if not sig.users:  # else x looks used outside any match that consumes the silu
                    self.graph.erase_node(sig)
                return None
        if op is DIV and isinstance(b, fx.Node) and b.target is SQRT and len(b.users) == 1:
            # a / sqrt(v) -> a * rsqrt(v): equal up to rounding (one ulp in float32), and the
            # form RMSNorm rules are written in
            rsqrt = self.new(node, RSQRT, (b.args[0],))
            self.set(node, MUL, (a, rsqrt))
            self.graph.erase_node(b)
            return None
        if op is DIV and a == 1:
            return None
        first = recast(uncast(a, b), b, node)
        args = (first, recast(uncast(b, first), first, node))  # x.float() + y.float(): one cast, not both
        self.set(node, op, args)
        for old in {a, b} - set(args):
            if not old.users:  # a cast read nowhere else
                self.graph.erase_node(old)
        return None

    def matmul(self, node: fx.Node) -> None:
        """``x @ w.t()`` (``.T``, ``.mT``, ``transpose(0, 1)``, ``permute(1, 0)``; ``matmul`` or
        ``mm``) of a matrix ``w`` -> ``linear(x, w)``; the transpose goes if nothing else reads it."""
        if len(node.args) != 2 or node.kwargs:
            return None
        x, wt = node.args
        w = _transposed_matrix(wt)
        if w is None or self.rank(w) != 2 or not self.rank(x):
            return None
        self.set(node, LINEAR, (x, w))
        if not wt.users:
            self.graph.erase_node(wt)
        return None

    def scaled_mm(self, node: fx.Node) -> None:
        """``torch._scaled_mm(x, wt, ...)`` -> ``aten._scaled_mm``, arguments bound; ``wt`` a
        transpose of a matrix ``w`` (as :meth:`matmul` reads them) -> ``aten.t(w)``, the one spelling
        the FP8 linear rule is written in; the old transpose goes if nothing else reads it."""
        args, kwargs = bind_schema(SCALED_MM, node.args, {("self" if k == "input" else k): v
                                                          for k, v in node.kwargs.items()})  # fmt: skip
        wt = args[1]
        w = _transposed_matrix(wt)
        if w is not None and self.rank(w) in (2, None) and not (wt.op == "call_function" and wt.target is TRANSPOSE):
            args = (args[0], self.new(node, TRANSPOSE, (w,)), *args[2:])
        self.set(node, SCALED_MM, args, kwargs)
        if isinstance(wt, fx.Node) and wt is not args[1] and not wt.users:
            self.graph.erase_node(wt)
        return None

    def pow(self, node: fx.Node) -> None:
        x, e = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("exponent")
        if not meta.is_tensor(x) or isinstance(e, fx.Node):
            return
        if isinstance(e, float) and e.is_integer():
            e = int(e)
        if e == 0.5:
            return self.set(node, SQRT, (x,))
        self.set(node, POW, (x, e))

    def reduce(self, node: fx.Node, op: Any) -> None:
        x = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if dim is None or "dtype" in node.kwargs or "out" in node.kwargs:
            return
        dims = [self.neg_dim(x, d) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
        self.set(node, op, (x, dims, keepdim))

    def softmax(self, node: fx.Node) -> None:
        """``softmax(x, dim, dtype=d)`` casts ``x`` to ``d`` first (so documented): the cast
        becomes its own node, and a softmax in the input's dtype is the one form."""
        x = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        at = 3 if node.target is F.softmax else 2  # F.softmax(input, dim, _stacklevel, dtype)
        dtype = node.args[at] if len(node.args) > at else node.kwargs.get("dtype")
        if not isinstance(dim, int) or not meta.is_tensor(x) or (dtype is not None and not isinstance(dtype, torch.dtype)):
            return None  # softmax without a dim picks one by rank (deprecated): kept as written
        if dtype is not None and self.dtype(x) != dtype:
            x = self.new(node, CAST, (x, dtype))
        self.set(node, SOFTMAX, (x, self.neg_dim(x, dim)))
        return None

    def topk(self, node: fx.Node) -> None:
        x = node.args[0]
        args = dict(zip(("self", "k", "dim", "largest", "sorted"), node.args))
        args.update(node.kwargs)
        if "out" in args or "k" not in args or not meta.is_tensor(x):
            return None
        dim = self.neg_dim(x, args.get("dim", -1))
        self.set(node, TOPK, (x, args["k"], dim, args.get("largest", True), args.get("sorted", True)))
        return None

    def to(self, node: fx.Node) -> None:
        x, rest = node.args[0], list(node.args[1:])
        dtype = node.kwargs.get("dtype")
        if node.target == "type_as":
            dtype = self.dtype(rest[0]) if rest else None
            if dtype is None:
                return
            rest = []
        for a in rest:
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, fx.Node) and node.target == "to" and meta.is_tensor(a):
                dtype = self.dtype(a)
                if dtype is None:
                    return
            elif isinstance(a, fx.Node) and a.op == "placeholder" and a.meta.get("fxr_kind") == "scalar":
                dtype = a  # a pattern's dtype wildcard
            elif isinstance(a, fx.Node):
                return  # .to(<a node holding a dtype or device>): kept as written
            elif isinstance(a, (str, torch.device)) or a is None:
                if not self.same_device(x, a):
                    return
        if "device" in node.kwargs and not self.same_device(x, node.kwargs["device"]):
            return
        if node.kwargs.get("memory_format") is not None or node.kwargs.get("copy"):
            return
        if dtype is None:
            t = meta.tensor(x)
            if t is not None and node.target == "to":
                return self.drop(node, x)  # .to(its own device) with no dtype
            return
        self.cast(node, x, dtype)

    def same_device(self, x: Any, device: Any) -> bool:
        t = meta.tensor(x)
        if device is None:
            return True
        if t is None:
            return False
        d = torch.device(device)
        return t.device.type == d.type and (d.index is None or t.device.index == d.index)

    def cast(self, node: fx.Node, x: Any, dtype: torch.dtype) -> None:
        if isinstance(dtype, torch.dtype) and self.dtype(x) == dtype:
            return self.drop(node, x)
        self.set(node, CAST, (x, dtype))
        if (twin := earlier_cast(node)) is not None:
            self.drop(node, twin)
        else:
            hoist(self, node)


def noop_source(node: fx.Node) -> fx.Node | None:
    """The input ``node`` passes on unchanged when it is a canonical no-op (a cast to the dtype
    its input has, a full-range slice, a reshape to the same shape), else None. A replacement's
    slice or cast can become one once its scalars are bound: ``fxr.silu_and_mul(x[..., a:e])``
    with ``a = 0`` and ``e`` the end is ``fxr.silu_and_mul(x)``."""
    if node.op != "call_function" or not node.args or not isinstance(src := node.args[0], fx.Node):
        return None
    t = meta.tensor(src)
    if t is None:
        return None
    if node.target is CAST:
        return src if node.args[1] == t.dtype else None
    if node.target is RESHAPE:
        return src if meta.same_shape(node, src) else None
    if node.target is SLICE:
        _, dim, start, end, step = node.args
        size = t.shape[dim]
        full = isinstance(end, int) and isinstance(size, int) and end >= size
        return src if start == 0 and step == 1 and (end == MAX or full) else None
    return None


def canonicalize(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place into canonical form; returns the number of nodes changed."""
    return _Canon(gm).run()
