"""Folding the cos/sin tables of the rotations into a cache indexed by position (``fold_rotary``).

The rules of ``rotary.py`` leave ``fxr.apply_rotary(x, cos, sin, ..)``; :func:`fold_rotary_tables`
looks at where ``cos`` and ``sin`` come from. When both are functions of one integer tensor (the
positions) and of constants (an ``inv_freq`` buffer, a cos/sin cache buffer, a scaling factor), it
evaluates them once at compile time, on the real buffers, for every position ``0 .. P-1``: that is
the ``cos_sin_cache`` the kernels index. The table is checked, not assumed: evaluated again on
shuffled positions it must shuffle the same way (a per-position table), and full-width HF tables
must repeat their halves (or pairs) exactly.
The rotation then becomes ``fxr.rotary_embedding_q(positions, x3, cache)`` on an ``[N, heads,
head_dim]`` view of ``x`` (``[B, H, T, D]``, ``[B, T, H, D]`` and ``[T, H*D]``-as-``[T, H, D]``
layouts are recognised from how the tables broadcast), and :func:`pair_rotaries` merges the q and
k rotations of a layer into one ``fxr.rotary_embedding``::

    %cos = ... inv_freq, positions ...                    %cache = get_attr[fxr_rotary_cache_0]
    %q_embed = fxr.apply_rotary(%q, %cos, %sin, ..)  ->   %qk = fxr.rotary_embedding(%pos, %q3, %k3, %cache, True)
    %k_embed = fxr.apply_rotary(%k, %cos, %sin, ..)

``P``: the rows of a table the positions index (an engine's cache), else
``Config.max_positions``; a constant indexed without the positions (``inv_freq[None, :, None]``)
bounds nothing. Every gather at the positions is checked to stay inside its table for positions
``0 .. P-1`` before it runs (else no fold: out of range, a GPU gather asserts or reads past the
table). Positions at or past ``P`` are out of range for the kernels, as for any engine's cache.
Where the tables cannot be folded, ``fxr.apply_rotary`` stays (the torch reference serves it) and
the report says why.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite import meta
from fxrewrite.canonicalize import CAST, NEG, PERMUTE, RESHAPE
from fxrewrite.meta import dim_key
from fxrewrite.report import NearMiss, PassResult
from fxrewrite.rewrites.rotary import ROTARY_Q, pair_rotaries

APPLY = torch.ops.fxr.apply_rotary.default
SYM_SIZE = torch.ops.aten.sym_size.int


def _gather(n: fx.Node) -> tuple[Any, Any, int | None] | None:
    """``(table, index, dim)`` of a node that reads ``table`` at integer indices along ``dim``
    (``table[index]``, ``index_select``, ``embedding``, ``gather``; dim None where the indexing does not say
    which), else None. ``operator.getitem`` gathers only with a tensor in its index:
    ``inv_freq[None, :, None]`` is a view of the table."""
    if n.op != "call_function":
        return None
    a = n.args
    if n.target is torch.ops.aten.index_select.default:  # canonical graphs count dims from the end
        t = meta.tensor(a[0])
        return a[0], a[2], None if t is None else a[1] % max(t.dim(), 1)
    if n.target is torch.ops.aten.embedding.default:
        return a[0], a[1], 0
    if n.target in (torch.gather, torch.ops.aten.gather.default) and len(a) >= 3 and isinstance(a[1], int):
        t = meta.tensor(a[0])  # gather(table, dim, index): GPT-J's sin/cos rows at the positions
        return a[0], a[2], None if t is None else a[1] % max(t.dim(), 1)
    if n.target is torch.nn.functional.embedding:
        return a[1], a[0], 0
    if n.target is torch.ops.aten.index.Tensor:  # None entries: whole dims before the index
        at = next((d for d, i in enumerate(a[1]) if i is not None), None)
        return None if at is None else (a[0], a[1][at], at)
    if n.target is operator.getitem and isinstance(a[0], fx.Node) and meta.tensor(a[0]) is not None:
        index = a[1] if isinstance(a[1], tuple) else (a[1],)
        tensors = [d for d, i in enumerate(index) if isinstance(i, fx.Node)]
        if not tensors:
            return None
        if len(tensors) > 1 or any(i != slice(None) for i in index[: tensors[0]]):
            return a[0], index[tensors[0]], None  # a tensor index after None or Ellipsis
        return a[0], index[tensors[0]], tensors[0]
    return None


def _integer(n: fx.Node) -> bool:
    t = meta.tensor(n)
    return t is not None and t.dtype in (torch.int32, torch.int64)


def _varying(t: torch.Tensor | None, last: bool = True) -> list[Any]:
    """The sizes of ``t`` that are not 1 (``last=False``: of every dim but the last)."""
    shape = [] if t is None else list(t.shape) if last else list(t.shape[:-1])
    return [dim_key(s) for s in shape if dim_key(s) != 1]


# Factories whose values their literal arguments fix (not ``rand``, not ``empty``).
VALUE_FACTORIES = frozenset({"arange", "ones", "zeros", "full", "linspace", "logspace", "eye", "tensor",
                             "scalar_tensor", "as_tensor"})  # fmt: skip


def _constants(nodes: list[fx.Node], literal_ints: bool) -> dict[fx.Node, bool]:
    """Which of ``nodes`` (in graph order) are the same at every call: module state, attributes,
    factories of literal arguments (integer ones only with ``literal_ints``) and what only
    they feed."""
    const: dict[fx.Node, bool] = {}
    for n in nodes:
        if n.op == "placeholder":
            const[n] = meta.is_state(n)  # module state, not an input
        elif n.op == "get_attr":
            const[n] = True
        elif not n.all_input_nodes:  # a factory: ``arange(0, 16, 2)``, or positions ``arange(8)``
            name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
            const[n] = name in VALUE_FACTORIES and (literal_ints or not _integer(n))
        else:
            const[n] = all(const[a] for a in n.all_input_nodes)
    return const


def _no_positions(nodes: list[fx.Node], const: dict[fx.Node, bool]) -> str:
    """Why no one integer tensor stands between the tables and the graph's inputs."""
    leaves = [n for n in nodes if not const[n] and (n.op == "placeholder" or not n.all_input_nodes)]
    def name(n: fx.Node) -> str:  # an input by its name, a factory by its call too
        return n.name if n.op == "placeholder" else f"{n.name} = {getattr(n.target, '__name__', n.target)}(...)"

    ints = sorted(name(n) for n in leaves if _integer(n) or isinstance(meta.value(n), torch.SymInt))
    others = sorted(name(n) for n in leaves if name(n) not in ints)
    if not ints:
        return f"cos/sin are not computed from integer positions in the graph: they come from inputs {others}"
    if others:
        return f"cos/sin depend on {others}, which are neither the positions nor constants"
    return f"cos/sin depend on more than one integer positions tensor: {ints}"


def _memory(a: Any) -> list[fx.Node]:
    """``a`` and the tensors it is a view of: what a write into ``a`` changes."""
    out = []
    while isinstance(a, fx.Node):
        out.append(a)
        a = a.args[0] if meta.is_view(a) and a.args else None
    return out


def _base(n: Any) -> Any:
    """The tensor ``n`` is a view of (``n`` itself when it is none): two nodes of one base alias."""
    return _memory(n)[-1] if isinstance(n, fx.Node) else n


def _reads(targets: tuple[fx.Node, ...], writers: list[fx.Node],
           order: dict[fx.Node, int]) -> tuple[set[fx.Node], list[fx.Node], list[fx.Node]]:  # fmt: skip
    """What computing ``targets`` reads: their ancestors, and the in-place writes (of
    ``writers``) into them before each target, with what those read; and the writes after a
    target into what it read. Such a write changes the tables only where it writes their own
    memory (then they are not folded); else it changes an input of theirs after they were
    computed, which matters to the folded op only if the input is its positions (a cache's
    length advanced after the tables: the caller checks)."""
    read: set[fx.Node] = set()
    used: set[fx.Node] = set()
    late: list[fx.Node] = []
    for t in targets:
        seen = meta.ancestors(t)
        while new := [w for w in writers if w not in used and w not in late
                      and any(m in seen for a in meta.written_args(w) for m in _memory(a))]:  # fmt: skip
            for w in new:
                if order[w] < order[t]:
                    used.add(w)
                    seen |= meta.ancestors(w)
                elif any(_base(a) is _base(t) for a in meta.written_args(w)):
                    raise _NotFoldable(f"`{w.name}` writes in place into the tables' `{t.name}` after it is computed")
                else:
                    late.append(w)
        read |= seen
    return read, sorted(used, key=order.__getitem__), late


class _NotFoldable(Exception):
    """The tables of a rotation cannot be folded; the message says why."""


class _Tables:
    """Where a rotation's ``cos`` and ``sin`` come from: one positions tensor and constants.

    Constants: module state, attributes, factories of literal arguments (``arange(0, dim, 2)``
    of an ``inv_freq`` computed in ``forward``) and what is computed from them alone. Under
    static shapes the positions may be such a factory (``arange(T)``): when the tables come out
    constant, integer factories are taken for positions instead. In-place writes into the
    tables' intermediates (``freqs[..., idx] = ...``) are part of their computation."""

    def __init__(self, gm: fx.GraphModule, cos: fx.Node, sin: fx.Node, order: dict[fx.Node, int],
                 writers: list[fx.Node]) -> None:  # fmt: skip
        self.gm, self.targets = gm, (cos, sin)
        read, self.writers, late = _reads(self.targets, writers, order)
        nodes = sorted(read, key=order.__getitem__)
        for literal_ints in (True, False):
            const = _constants(nodes, literal_ints)
            if not (const[cos] and const[sin]):
                break
        else:
            raise _NotFoldable("cos and sin do not depend on positions")
        for w in self.writers:
            written = next((m for a in meta.written_args(w) for m in _memory(a) if const.get(m)), None)
            if written is not None:
                raise _NotFoldable(f"`{w.name}` writes in place into `{written.name}`, a constant the tables read")
        rows = _varying(meta.tensor(cos), last=False)
        found = [n for n in reversed(nodes) if not const[n] and self._dominates(n, const)]
        if not found:
            raise _NotFoldable(_no_positions(nodes, const))
        self.positions = next((n for n in found if _varying(meta.tensor(n)) == rows), None)
        if self.positions is None:
            p = found[-1]
            raise _NotFoldable(f"each row of the tables ({tuple(meta.tensor(cos).shape[:-1])}) is computed from several "
                               f"positions (`{p.name}` {tuple(meta.tensor(p).shape)}: multimodal RoPE sections, say); "
                               "a cache row holds the angles of one position")  # fmt: skip
        for w in late:
            if any(_base(a) is _base(self.positions) for a in meta.written_args(w)):
                raise _NotFoldable(f"`{w.name}` writes in place into the positions `{self.positions.name}` after the "
                                   "tables are computed: the folded op would read the new values")  # fmt: skip
        between = meta.ancestors(*self.targets, *self.writers, stop=self.positions)
        self.nodes = [n for n in nodes if n in between]  # recomputed for other positions, in order
        self.depends = {self.positions} | {n for n in self.nodes if not const[n]}  # the positions flow into them

    def _dominates(self, v: fx.Node, const: dict[fx.Node, bool]) -> bool:
        if not _integer(v):
            return False
        seen, stack = {v}, [*self.targets, *self.writers]
        while stack:
            n = stack.pop()
            if n in seen or const[n]:
                continue
            seen.add(n)
            if n.op == "placeholder" or not n.all_input_nodes:
                return False  # an input, or a factory, reached around v
            stack.extend(n.all_input_nodes)
        return True

    def rows(self, default: int) -> int:
        """How many positions the tables cover: the rows of a constant table the positions
        index (an engine's cache), else ``default``. Only a gather whose index depends on the
        positions bounds them; one of a constant index (``inv_freq[None, :, None]``) does not."""
        bounds = []
        for n in self.nodes:
            g = _gather(n)
            if g is None or not self._reads_positions(g[1]):
                continue
            table, _, dim = g
            if dim is None or not isinstance(table, fx.Node):
                continue
            if table.op in ("placeholder", "get_attr"):
                value = self._value(table, {})
            elif not self._reads_positions(table):  # a constant table reshaped or repeated: its size
                value = meta.tensor(table)
            else:
                continue  # a table computed from the positions themselves: checked when evaluated
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and isinstance(value.shape[dim], int):
                bounds.append(value.shape[dim])
        return min(bounds) if bounds else default

    def _reads_positions(self, index: Any) -> bool:
        return isinstance(index, fx.Node) and index in self.depends

    def _value(self, node: Any, env: dict[fx.Node, Any]) -> Any:
        if not isinstance(node, fx.Node):
            return node
        if node in env:
            return env[node]
        if node.op == "placeholder":
            return meta.real(node)  # read: the compile cache keys on its value
        if node.op == "get_attr":
            return meta.attribute(self.gm, node.target)
        raise _NotFoldable(f"`{node.name}` is not computed from positions and constants")

    def _check_in_range(self, n: fx.Node, env: dict[fx.Node, Any]) -> None:
        """A gather at the positions reads inside its table: checked on the host before it runs
        (out of range, a CUDA gather would assert on the device or read past the table)."""
        g = _gather(n)
        if g is None or not self._reads_positions(g[1]):
            return
        table, index, dim = g
        t, i = self._value(table, env), self._value(index, env)
        if dim is None:
            raise _NotFoldable(f"`{n.name}` indexes its table at the positions along an unknown dim")
        if not (isinstance(t, torch.Tensor) and isinstance(i, torch.Tensor)) or i.dtype not in (torch.int32, torch.int64):
            raise _NotFoldable(f"`{n.name}` reads at the positions, not with integer indices")
        if i.numel() and not (0 <= int(i.min()) and int(i.max()) < t.shape[dim]):
            raise _NotFoldable(f"positions 0..P-1 read `{n.name}` at {int(i.min())}..{int(i.max())}, "
                               f"outside its table's {t.shape[dim]} rows")  # fmt: skip

    def evaluate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions (shaped as the graph's positions), on the real buffers."""
        env: dict[fx.Node, Any] = {self.positions: positions}

        def arg(a: Any) -> Any:
            return fx.node.map_aggregate(a, lambda v: self._value(v, env))

        try:
            for n in self.nodes:
                if n.op not in ("call_function", "call_method"):
                    continue  # placeholders and get_attr: read by _value
                args, kwargs = arg(n.args), arg(n.kwargs)
                self._check_in_range(n, env)
                if n.op == "call_method":
                    env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:
                    env[n] = n.target(*args, **kwargs)
        except _NotFoldable:
            raise
        except Exception as e:  # noqa: BLE001 - shapes baked into the graph, say; reported
            raise _NotFoldable(f"evaluating the tables for other positions failed at `{n.name}`: {type(e).__name__}: {e}") from e
        return env[self.targets[0]], env[self.targets[1]]


# Ops that only reshape their input (every element keeps its value): the table behind them is the same.
RESHAPES = {"unsqueeze", "view", "reshape", "expand", "squeeze", torch.ops.aten.unsqueeze.default,
            torch.ops.aten.reshape.default, torch.ops.aten.expand.default, torch.ops.aten.squeeze.dim}  # fmt: skip


def _source(node: fx.Node) -> fx.Node:
    """``node`` with reshapes of one input peeled off."""
    while node.op in ("call_function", "call_method") and node.target in RESHAPES and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _signed_source(node: fx.Node) -> tuple[fx.Node, bool]:
    """``node`` with reshapes and negations peeled off, and whether it negates what is left (the
    rotations the other way round read ``-sin``: the sign goes into the cache, and the tables
    are evaluated once for both directions)."""
    negated, node = False, _source(node)
    while node.op == "call_function" and node.target is NEG and isinstance(node.args[0], fx.Node):
        negated, node = not negated, _source(node.args[0])
    return node, negated


def _position_axes(t: torch.Tensor) -> list[int]:
    """The dims of the graph's positions ``t`` that other positions may run along: its last dim
    that is not 1 (the tokens); for one token (every dim 1, a decode step) each dim, last first,
    since only the tables' own code tells which dim is the tokens' and which broadcast."""
    varying = [i for i, s in enumerate(t.shape) if dim_key(s) != 1]
    return varying[-1:] if varying else list(reversed(range(t.dim())))


def _positions_like(t: torch.Tensor, values: torch.Tensor, at: int) -> torch.Tensor:
    """``values`` (1-D) shaped as the graph's positions ``t``, along its dim ``at``."""
    shape = [1] * t.dim()
    shape[at] = values.numel()
    return values.to(t.dtype).view(shape)


def _evaluate_along(tables: _Tables, t: torch.Tensor, values: torch.Tensor) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
    """The tables for ``values`` along the first of :func:`_position_axes` they evaluate along,
    and that dim. ``position_ids[..., None] * inv_freq`` of a ``[1, 1]`` decode step evaluates
    along dim 0 or 1, not along the last (it would broadcast the positions against the
    frequencies)."""
    if t.dim() == 0:
        raise _NotFoldable("the positions are a 0-d tensor")
    *first, last = _position_axes(t)
    for at in first:
        with contextlib.suppress(_NotFoldable):
            return at, tables.evaluate(_positions_like(t, values, at))
    return last, tables.evaluate(_positions_like(t, values, last))


def _half_of(table: torch.Tensor, interleaved: bool, what: str) -> torch.Tensor:
    """The half-width angles of a full-width HF table, whose halves (or pairs) must repeat."""
    a, b = (table[:, 0::2], table[:, 1::2]) if interleaved else table.chunk(2, dim=-1)
    if not torch.equal(a, b):
        raise _NotFoldable(f"the {'pairs' if interleaved else 'halves'} of {what} differ: not rotary tables")
    return a


CHECKED_POSITIONS = 1024  # positions re-evaluated, shuffled, to check the tables are per position


def build_cache(tables: _Tables, width: int, full: bool, interleaved: bool, max_positions: int, device: Any,
                negated: tuple[bool, bool] = (False, False)) -> torch.Tensor:  # fmt: skip
    """``[P, R]`` float32 ``cat(cos, sin)`` of the half-width angles per position, checked;
    ``negated``: cos, sin read negated by the rotation."""
    p = tables.rows(max_positions)
    pos_t = meta.tensor(tables.positions)
    arange = torch.arange(p, device=device)
    # the check: shuffled positions (a random sample of them) must read the same rows
    sample = torch.randperm(p, generator=torch.Generator().manual_seed(0))[:CHECKED_POSITIONS].to(device)
    at, tables_p = _evaluate_along(tables, pos_t, arange)
    cos, sin = (v.reshape(p, -1) for v in tables_p)
    cos_p, sin_p = (v.reshape(len(sample), -1) for v in tables.evaluate(_positions_like(pos_t, sample, at)))
    if cos.shape[-1] != width:
        raise _NotFoldable(f"tables evaluate to {cos.shape[-1]} features per position, expected {width}")
    if not (torch.equal(cos_p, cos[sample]) and torch.equal(sin_p, sin[sample])):
        raise _NotFoldable("cos/sin are not per-position tables (shuffled positions do not shuffle them)")
    if full:
        cos, sin = _half_of(cos, interleaved, "cos"), _half_of(sin, interleaved, "sin")
    cos, sin = (-t if neg else t for t, neg in zip((cos, sin), negated))
    return torch.cat((cos, sin), dim=-1).float().contiguous()


def _layout(x: torch.Tensor, cos: torch.Tensor) -> tuple[list[int], list[int]]:
    """x's token dims (tables vary along them) and head dims (tables broadcast), last dim apart."""
    cshape = [1] * (x.dim() - cos.dim()) + list(cos.shape)
    tokens, heads = [], []
    for d in range(x.dim() - 1):
        if dim_key(cshape[d]) == 1 and dim_key(x.shape[d]) != 1:
            heads.append(d)
        else:
            tokens.append(d)
    return tokens, heads


class _Folder:
    """One pass of :func:`fold_rotary_tables` over a graph."""

    def __init__(self, gm: fx.GraphModule, max_positions: int) -> None:
        self.gm, self.graph, self.max_positions = gm, gm.graph, max_positions
        self.fake_mode = meta.fake_mode_of(gm.graph)
        self.caches: dict[tuple[Any, ...], fx.Node] = {}
        self.unfoldable: dict[tuple[Any, ...], str] = {}  # why the tables of a source did not fold
        self._order: dict[fx.Node, int] | None = None  # graph order, made again after a fold adds nodes
        self.flat: dict[fx.Node, fx.Node] = {}

    @functools.cached_property
    def writers(self) -> list[fx.Node]:
        """The graph's in-place writes, in order (read when the first table is built; folds add none)."""
        return [n for n in self.graph.nodes if meta.written_args(n)]

    def node(self, target: Any, *args: Any, like: fx.Node, shape: Sequence[Any] | None = None) -> fx.Node:
        """A new node before the insertion point; its value propagated, or, given ``shape``, a
        contiguous tensor of that shape in its input's dtype and device (a reshape whose sizes the
        fold knows: propagating ``reshape(x, [-1, heads, head_dim])`` over symbolic head dims
        costs sympy a third of a second a node)."""
        n = self.graph.call_function(target, args)
        n.meta["fxr_rule"] = "rotary_embedding"
        meta.copy_provenance(like, n)
        src = meta.tensor(args[0])
        if shape is not None and self.fake_mode is not None and src is not None:
            with self.fake_mode:
                n.meta["example_value"] = torch.empty(tuple(shape), dtype=src.dtype, device=src.device)
        else:
            meta.propagate(n, self.fake_mode)
        return n

    def cache(self, n: fx.Node) -> fx.Node:
        x, cos, sin, interleaved, full = n.args
        # Layers that each reshape the model's tables (HF's per-layer ``cos.unsqueeze(1)``) read
        # the same values: evaluate the tables once per source, not once per layer.
        (c, c_neg), (s, s_neg) = _signed_source(cos), _signed_source(sin)
        key = (c, s, c_neg, s_neg, interleaved, full)
        if key in self.unfoldable:  # every layer reading these tables fails alike
            raise _NotFoldable(self.unfoldable[key])
        if key not in self.caches:
            if self._order is None:
                self._order = {node: i for i, node in enumerate(self.graph.nodes)}
            try:
                tables = _Tables(self.gm, c, s, self._order, self.writers)
                width = meta.tensor(cos).shape[-1]
                value = build_cache(tables, width, full, interleaved, self.max_positions, meta.tensor(x).device,
                                    (c_neg, s_neg))  # fmt: skip
            except _NotFoldable as e:
                self.unfoldable[key] = str(e)
                raise
            self.caches[key] = self._constant(value, tables.positions)
        return self.caches[key]

    def _constant(self, value: torch.Tensor, positions: fx.Node) -> fx.Node:
        """One get_attr per distinct table and positions: layers that each compute the same
        tables (an engine's per-layer ``cos.unsqueeze(1)``) share one cache, and can pair."""
        for node in self.caches.values():
            old = getattr(self.gm, node.target)
            if node.meta["fxr_positions"] is positions and old.shape == value.shape and torch.equal(old, value):
                return node
        first = next(n for n in self.graph.nodes if n.op != "placeholder")
        with self.graph.inserting_before(first):
            node = meta.constant_node(self.gm, f"fxr_rotary_cache_{len(set(self.caches.values()))}", value, self.fake_mode)
        node.meta["fxr_positions"] = positions
        return node

    def positions(self, pos: fx.Node) -> fx.Node:
        """The positions as one flat vector, made once per positions node."""
        if pos not in self.flat:
            with self.graph.inserting_after(pos):
                self.flat[pos] = self.node(RESHAPE, pos, [-1], like=pos)
        return self.flat[pos]

    def fold(self, n: fx.Node) -> None:
        x, cos, sin, interleaved, full = n.args
        xt, ct = meta.tensor(x), meta.tensor(cos)
        if xt is None or ct is None:
            raise _NotFoldable("no shape information")
        tokens, heads = _layout(xt, ct)
        # The kernel's [N, heads, head_dim] view: heads and head size become static (a symbolic
        # one, as when q is a graph input under dynamic=True, is specialized with a guard).
        heads_n = int(functools.reduce(operator.mul, (xt.shape[d] for d in heads), 1))
        head_dim = int(xt.shape[-1])
        cache = self.cache(n)
        pos = cache.meta["fxr_positions"]
        pos_sizes = [dim_key(s) for s in meta.tensor(pos).shape if dim_key(s) != 1]
        tok_sizes = [dim_key(xt.shape[d]) for d in tokens if dim_key(xt.shape[d]) != 1]
        if pos_sizes != tok_sizes:
            raise _NotFoldable(f"positions {tuple(meta.tensor(pos).shape)} do not line up with the token dims of x {tuple(xt.shape)}")
        perm = tokens + heads + [xt.dim() - 1]
        # The upcast forms end in casts (float32, then back): the kernel writes x's dtype at once.
        chain = [n]
        while len(chain[-1].users) == 1 and next(iter(chain[-1].users)).target is CAST:
            chain.append(next(iter(chain[-1].users)))
        while len(chain) > 1 and meta.tensor(chain[-1]).dtype != xt.dtype:
            chain.pop()
        replaced, out_dtype = chain[-1], meta.tensor(chain[-1]).dtype
        with self.graph.inserting_before(n):
            if out_dtype != xt.dtype:  # tables wider than x, read so: rotate x in their dtype, as the rotation did
                x = self.node(CAST, x, out_dtype, like=n)
            xp = x if perm == sorted(perm) else self.node(PERMUTE, x, perm, like=n)
            rows = functools.reduce(operator.mul, (xt.shape[d] for d in tokens), 1)
            x3 = self.node(RESHAPE, xp, [-1, heads_n, head_dim], like=n, shape=(rows, heads_n, head_dim))
            r = self.node(ROTARY_Q, self.positions(pos), x3, cache, not interleaved, like=n)
            sizes = [s if isinstance(s, int) else self.node(SYM_SIZE, xp, i, like=n) for i, s in enumerate(meta.tensor(xp).shape)]
            out = self.node(RESHAPE, r, sizes, like=n)
            if perm != sorted(perm):
                out = self.node(PERMUTE, out, [perm.index(d) for d in range(len(perm))], like=n)
        replaced.replace_all_uses_with(out)
        for old in reversed(chain):
            self.graph.erase_node(old)
        self._order = None  # nodes were added


def fold_rotary_tables(gm: fx.GraphModule, max_positions: int = 32768) -> PassResult:
    """Turn each ``fxr.apply_rotary`` whose tables fold into ``fxr.rotary_embedding_q``, then pair
    the q and k rotations of each layer (:func:`pair_rotaries`); see the module docstring."""
    result = PassResult()
    folder = _Folder(gm, max_positions)
    for n in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is APPLY]:
        if _unread(n):  # a rotation nobody reads (k of a q-only model): never pair it in
            continue
        try:
            folder.fold(n)
        except _NotFoldable as e:
            result.near_misses.append(NearMiss("rotary_embedding", n.name, meta.source_line(n), n.args[1].name, str(e),
                                                        meta.module_path(n)))
            continue
        result.matches += 1
    pair_rotaries(gm, result)
    return result


def _unread(n: fx.Node) -> bool:
    """Erase ``n`` and the casts after it when nothing else reads them; whether it did."""
    if not all(u.target is CAST and _unread(u) for u in list(n.users)):
        return False
    n.graph.erase_node(n)
    return True
