"""Which captured size serves a call: input specs, shape checks, size selection, padding.

Pure bookkeeping, no CUDA: :class:`Dispatch` reads a graph's placeholders once (which are
parameters, which carry the token dimension, which are host scalars), then for each call checks
the shapes (a :class:`ShapeError` naming expected and actual), picks the capture size
(:func:`select_size`) and says how to pad. :mod:`fxrewrite.runtime.cudagraph` uses it to
replay; the CPU tests exercise it without a GPU.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import sympy
import torch
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxrewrite.config import Config

_STATIC_MARK = "_dynamo_static_input_type"
_ITEM_TARGETS = ("item", torch.ops.aten._local_scalar_dense.default, torch.ops.aten._local_scalar_dense)


class ShapeError(ValueError):
    """A call with shapes the graph was not compiled (or captured) for."""


def check_capture_sizes(config: Config) -> tuple[int, ...]:
    """``config``'s capture sizes (the default list when unset), or a ValueError saying what is
    wrong: none, not positive integers, not strictly increasing, above ``max_capture_size``.

        >>> check_capture_sizes(Config(capture_sizes=(1, 2, 4)))
        (1, 2, 4)
        >>> check_capture_sizes(Config(capture_sizes=(8, 4)))
        Traceback (most recent call last):
        ...
        ValueError: capture_sizes must be in increasing order: (8, 4)
    """
    sizes = tuple(config.resolved().capture_sizes or ())
    if not sizes:
        raise ValueError("capture_sizes is empty")
    if not all(isinstance(s, int) and s > 0 for s in sizes):
        raise ValueError(f"capture_sizes must be positive integers: {sizes}")
    if any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"capture_sizes must be in increasing order: {sizes}")
    if sizes[-1] > config.max_capture_size:
        raise ValueError(f"capture size {sizes[-1]} is above max_capture_size {config.max_capture_size}")
    return sizes


def select_size(n: int, sizes: Sequence[int], pad: bool) -> int | None:
    """The capture size serving ``n`` tokens (``sizes`` ascending), or None: run eagerly.

    Exact: ``n`` itself when captured. Padded: the smallest size at least ``n``.

        >>> select_size(5, (1, 2, 4, 8), pad=True), select_size(5, (1, 2, 4, 8), pad=False)
        (8, None)
        >>> select_size(9, (1, 2, 4, 8), pad=True) is None
        True
    """
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes) or (not pad and sizes[i] != n):
        return None
    return sizes[i]


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """How the Runner treats one graph input.

    kind: "token" (tensor with the token symbol in ``token_dims``: buffer per size, padded),
    "tensor" (other tensor a captured piece reads: one buffer), "static" (parameter or buffer:
    used in place), "host" (a value frozen at capture and checked per call: a CPU scalar tensor
    read on the host, or an int input that sizes no input tensor), "sym" (the token count
    itself), "pass" (handed over as is: read only by eager pieces).
    """

    name: str
    kind: str
    shape: tuple[Any, ...] = ()
    token_dims: tuple[int, ...] = ()


def _expr(d: Any) -> Any:
    """A dim as an int, or a sympy expression when symbolic (specialized symbols become ints)."""
    e = d.node.expr if isinstance(d, torch.SymInt) else d
    return int(e) if not isinstance(e, sympy.Expr) or e.is_number else e


def _is_static(node: torch.fx.Node, example: Any) -> bool:
    """A parameter, buffer or ``mark_static_address`` tensor: read where it is, never copied."""
    return isinstance(example, torch.Tensor) and (
        _STATIC_MARK in (node.meta.get("tensor_dict") or {}) or isinstance(example, torch.nn.Parameter)
        or getattr(example, _STATIC_MARK, None) is not None)


def _concrete(v: Any) -> Any:
    return v.node.hint if isinstance(v, torch.SymInt) else v


class Dispatch:
    """Device-free call handling: token count, shape checks, size choice, padding, slicing.

    ``captured_inputs``: positions of the inputs read by captured pieces; the token symbol is
    the one dynamic symbol among them (``reason`` says why capture is impossible otherwise).
    """

    def __init__(self, gm: GraphModule, example_inputs: Sequence[Any], captured_inputs: Collection[int],
                 sizes: Sequence[int], pad: bool, on_cuda: bool) -> None:
        nodes = list(gm.graph.find_nodes(op="placeholder"))
        values = [n.meta.get("example_value", ex) for n, ex in zip(nodes, example_inputs)]
        static = [_is_static(n, ex) for n, ex in zip(nodes, example_inputs)]
        # a static tensor's dims (Dynamo gives buffers symbols too) are fixed with its address;
        # so is a SymInt input that only sizes static tensors
        fixed = {s for v, st in zip(values, static) if st for s in free_symbols(v)}
        dims = {s for i in captured_inputs if not static[i] and isinstance(values[i], torch.Tensor)
                for s in free_symbols(values[i])}
        scalars = {s for i in captured_inputs if isinstance(values[i], torch.SymInt)
                   for s in free_symbols(values[i])} - fixed
        # an int input that sizes no input tensor of the graph (transformers' logits_to_keep, where
        # forward is Dynamo's frame) is a value, not a dimension, even where it is the only symbol
        # (a graph of static shapes: one graph): frozen at capture and checked per call, as a host
        # scalar. An int sizing an input that only eager pieces read (input_ids read by a piece run
        # eagerly) is the token count where the captured pieces read no dynamic dim.
        sizing = {s for v, st in zip(values, static) if not st and isinstance(v, torch.Tensor)
                  for s in free_symbols(v)}
        symbols = dims or (scalars & sizing)
        self.frozen = {v.node.expr: _concrete(v) for i, v in enumerate(values) if i in captured_inputs
                       and isinstance(v, torch.SymInt) and v.node.expr in scalars - symbols}  # fmt: skip
        self.reason: str | None = None
        if len(symbols) > 1:
            self.reason = (f"captured pieces read {len(symbols)} dynamic dimensions "
                           f"({', '.join(sorted(map(str, symbols)))}); capture needs one, the token "
                           "count (mark the others static, e.g. dynamic=None + mark_dynamic)")
        self.symbol: sympy.Symbol | None = next(iter(symbols)) if len(symbols) == 1 else None
        self.lo, self.hi = self._range(values)
        self.sizes = tuple(sorted({s for s in sizes if s >= self.lo and (self.hi is None or s <= self.hi)
                                   and self.symbol is not None}))
        if self.symbol is not None and not self.sizes and self.reason is None:
            self.reason = (f"no capture size ({', '.join(map(str, sizes))}) in the range Dynamo compiled the token "
                           f"count {self.symbol} for: [{self.lo}, {self.hi if self.hi is not None else 'inf'}]")
        out = gm.graph.output_node().args[0]
        self.outputs = [self._out_spec(leaf) for leaf in tree_flatten(out)[0]]
        self.pad = pad and self.symbol is not None and all(o != "fixed" for o in self.outputs) and all(
            self._plain(v) for v in values if isinstance(v, torch.Tensor))
        self.inputs = [self._classify(n, v, static[i], i in captured_inputs, on_cuda) for i, (n, v) in enumerate(
            zip(nodes, values))]
        kinds = [s.kind for s in self.inputs]
        self.managed = [i for i, k in enumerate(kinds) if k in ("token", "tensor")]  # inputs with a buffer
        self._locator = next(((i, -1) for i, k in enumerate(kinds) if k == "sym"), None) or next(
            ((i, s.token_dims[0]) for i, s in enumerate(self.inputs) if s.kind == "token"), None)
        self._shapes: dict[tuple[int, int | None], tuple[int, ...]] = {}

    def _range(self, values: Sequence[Any]) -> tuple[int, int | None]:
        for v in values:
            for d in (v,) if isinstance(v, torch.SymInt) else getattr(v, "shape", ()):
                if isinstance(d, torch.SymInt) and d.node.expr == self.symbol:
                    r = d.node.shape_env.var_to_range.get(self.symbol)
                    if r is not None:
                        return int(r.lower), int(r.upper) if isinstance(r.upper, sympy.Integer) else None
        return 0, None

    def _dim(self, d: Any) -> Any:
        """A dim as :func:`_expr` gives it, the frozen int inputs replaced by their values."""
        e = _expr(d)
        return _expr(e.xreplace(self.frozen)) if self.frozen and isinstance(e, sympy.Expr) else e

    def _plain(self, v: torch.Tensor) -> bool:
        """No dim of ``v`` is a compound expression of the token symbol (padding needs plain dims)."""
        return all(e == self.symbol or not (isinstance(e, sympy.Expr) and self.symbol in e.free_symbols)
                   for e in map(self._dim, v.shape))

    def _out_spec(self, leaf: Any) -> Any:
        v = leaf.meta.get("example_value") if isinstance(leaf, torch.fx.Node) else None
        e = self._dim(v) if isinstance(v, torch.SymInt) else None
        if isinstance(e, sympy.Expr) and self.symbol is not None and self.symbol in e.free_symbols:
            return "n" if e == self.symbol else "fixed"
        if isinstance(v, torch.Tensor) and self.symbol is not None:
            return tuple(d for d, e in enumerate(map(self._dim, v.shape)) if e == self.symbol) if self._plain(v) else "fixed"
        return ()

    def _classify(self, node: torch.fx.Node, value: Any, static: bool, captured: bool, on_cuda: bool) -> InputSpec:
        if isinstance(value, torch.SymInt):
            e = value.node.expr
            kind = "sym" if self.symbol is not None and e == self.symbol else "host" if e in self.frozen else "pass"
            return InputSpec(node.name, kind)
        if not isinstance(value, torch.Tensor):
            return InputSpec(node.name, "pass")
        shape = tuple(map(self._dim, value.shape))
        dims = tuple(d for d, e in enumerate(shape) if e == self.symbol) if self.symbol is not None else ()
        if static:
            return InputSpec(node.name, "static", shape)
        scalar = value.device.type == "cpu" and all(isinstance(e, int) for e in shape) and value.numel() == 1
        if captured and scalar and (on_cuda or all(u.target in _ITEM_TARGETS for u in node.users)):
            return InputSpec(node.name, "host", shape)
        if dims and (captured or self.pad):
            return InputSpec(node.name, "token", shape, dims)
        return InputSpec(node.name, "tensor" if captured else "pass", shape)

    def token_count(self, args: Sequence[Any]) -> int | None:
        """``n`` read from the call (None for a static graph)."""
        if self._locator is None:
            return None
        i, d = self._locator
        return int(args[i]) if d < 0 else args[i].shape[d]

    def expected_shape(self, i: int, n: int | None) -> tuple[int, ...]:
        """Shape of input ``i`` for ``n`` tokens (an input with no other dynamic dimension)."""
        key = (i, n)
        shape = self._shapes.get(key)
        if shape is None:
            sub = {self.symbol: n} if self.symbol is not None else {}
            shape = self._shapes[key] = tuple(
                int(e.xreplace(sub)) if isinstance(e, sympy.Expr) else e for e in self.inputs[i].shape)
        return shape

    def check(self, args: Sequence[Any], n: int | None) -> None:
        """Raise :class:`ShapeError` unless every managed input has the shape compiled for ``n``."""
        if len(args) != len(self.inputs):
            raise ShapeError(f"expected {len(self.inputs)} inputs, got {len(args)}")
        if n is not None and (n < self.lo or (self.hi is not None and n > self.hi)):
            raise ShapeError(f"{self.symbol}={n} is outside the range the graph was compiled for: "
                             f"[{self.lo}, {self.hi if self.hi is not None else 'inf'}]")
        for i in self.managed:
            if tuple(args[i].shape) != self.expected_shape(i, n):
                spec, compiled = self.inputs[i], tuple(str(e) for e in self.inputs[i].shape)
                raise ShapeError(f"input {i} ({spec.name}): expected shape {self.expected_shape(i, n)} "
                                 f"(compiled as {compiled}, {self.symbol}={n}), got {tuple(args[i].shape)}")

    def materialize(self, value: Any, n: int | None) -> Any:
        """``value`` (a fake tensor or SymInt from the graph's metadata) for ``n`` tokens: zeros of
        its shape and strides, or an int; other symbols take their traced values."""
        if isinstance(value, torch.SymInt):
            return self._at(value, n)
        if not isinstance(value, torch.Tensor):
            return value
        shape, stride = [self._at(d, n) for d in value.shape], [self._at(d, n) for d in value.stride()]
        return torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device).zero_()

    def _at(self, d: Any, n: int | None) -> int:
        e = _expr(d)
        if not isinstance(e, sympy.Expr):
            return e
        env = d.node.shape_env
        hints = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
        return int(e.xreplace({**hints, self.symbol: n} if n is not None else hints))

    def select(self, n: int | None) -> int | None:
        """The capture size for ``n`` (0 for a static graph), or None."""
        return 0 if n is None else select_size(n, self.sizes, self.pad)

    def finish(self, out: Any, n: int | None, size: int) -> Any:
        """Slice padded outputs back to ``n`` rows and clone them out of the static buffers."""
        leaves, spec = tree_flatten(out)
        result = []
        for leaf, dims in zip(leaves, self.outputs):
            if isinstance(leaf, torch.Tensor):
                for d in dims if isinstance(dims, tuple) and n is not None and n != size else ():
                    leaf = leaf.narrow(d, 0, n)
                leaf = leaf.clone()
            elif dims == "n":
                leaf = n
            result.append(leaf)
        return tree_unflatten(result, spec)


def _dense_strides(shape: Sequence[int], like: torch.Tensor) -> tuple[int, ...]:
    """Dense strides for ``shape`` with the dim order of ``like``."""
    order = sorted(range(len(shape)), key=lambda d: -like.stride(d)) if like.dim() == len(shape) else list(
        range(len(shape)))
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d], step = step, step * max(shape[d], 1)
    return tuple(strides)


def pad_zeros(buf: torch.Tensor, dims: Sequence[int], n: int) -> None:
    """Zero ``buf`` beyond index ``n`` along each of ``dims`` (the padding rows)."""
    for d in dims:
        buf.narrow(d, n, buf.shape[d] - n).zero_()
