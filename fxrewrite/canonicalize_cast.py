"""Canonical forms of dtype casts: where a widening cast sits, and which arithmetic reads it.
Kept beside :mod:`fxrewrite.canonicalize`, whose pass calls these with itself (``_Canon``) as
``canon``. Model code upcasts in many places that compute the same values; one form per value::

    h * w.float()          (h float32, w bf16)  -> h * w                 promotion casts w anyway
    x.float() + y.float()  (both bf16)          -> x + y.float()         one cast, not both
    v = x.float().pow(2).mean(-1); x * rsqrt(v) -> x.float() * rsqrt(v)  the cast made before, shared
    rotate_half(x).float() * sin, x.float() ... -> rotate_half(x.float()) * sin
    q.float() * 2 + q.float().flip(-1)          -> one cast of q

* :func:`uncast`: a widening cast read only by one ``+ - * /`` that type promotion does anyway
  goes;
* :func:`recast`, its converse: an operand that promotion widens reads the equal cast the code
  computed before and reads elsewhere, so both reads of a norm's input are one node;
* :func:`hoist`: a widening cast of a rearrangement of ``x`` (slices, negation, stack, cat,
  flatten, reshape: each value kept exactly) goes before it, onto the cast of ``x`` the code
  already made, so a rotation upcast before or after it is one form;
* :func:`earlier_cast`: a second cast of one value to one dtype is the first.

Each reads an earlier node only where nothing is written in place between the two
(:func:`reached_unwritten`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
import torch.fx as fx

from fxrewrite import meta

A = torch.ops.aten
CAST = torch.ops.prims.convert_element_type.default

# Ops that move, copy or negate values and change none: a cast after them equals one before.
EXACT = frozenset({A.slice.Tensor, A.neg.default, A.flatten.using_ints, A.unflatten.int, A.reshape.default,
                   A.unsqueeze.default, A.squeeze.dim, A.permute.default, A.transpose.int, A.expand.default,
                   A.select.int, A.cat.default, A.stack.default, torch.cat, torch.stack})  # fmt: skip


def reached_unwritten(node: fx.Node, candidates: Collection[fx.Node], within: int = 256) -> fx.Node | None:
    """The nearest of ``candidates`` before ``node`` (within ``within`` nodes) with nothing
    written in place between it and ``node``, else None."""
    n = node.prev
    for _ in range(within):
        if n.op == "root":
            return None
        if meta.written_args(n):
            return None
        if n in candidates:
            return n
        n = n.prev
    return None


def earlier_cast(node: fx.Node) -> fx.Node | None:
    """An earlier ``CAST`` of the same value to the same dtype that ``node`` (a canonical cast)
    may read instead: model code that writes ``q.float()`` twice in one expression computes one
    value, and a rule matches it once. Not where anything is written in place between the two,
    or either cast, or a view of it, is written later."""
    x = node.args[0]
    if not isinstance(x, fx.Node):
        return None
    twin = reached_unwritten(node, _casts(x, node.args[1]) - {node})
    return twin if twin is not None and not meta.written_later(twin) and not meta.written_later(node) else None


def _casts(x: fx.Node, dtype: Any) -> set[fx.Node]:
    """The casts of ``x`` to ``dtype`` in the graph."""
    return {u for u in x.users if u.op == "call_function" and u.target is CAST and u.args == (x, dtype)}


def _casts_of(x: fx.Node, dtype: Any, node: fx.Node) -> fx.Node | None:
    """A cast of ``x`` to ``dtype`` that ``node`` can read in its place (:func:`reached_unwritten`)."""
    casts = _casts(x, dtype)
    return reached_unwritten(node, casts) if casts else None


def _widens(src: torch.dtype, dtype: Any) -> bool:
    return (isinstance(dtype, torch.dtype) and src.is_floating_point and dtype.is_floating_point and src != dtype
            and min(src.itemsize, dtype.itemsize) > 1 and torch.promote_types(src, dtype) == dtype)  # fmt: skip


def uncast(x: Any, other: Any) -> Any:
    """``x``'s source when ``x`` is a widening cast, read only here, that the arithmetic with
    ``other`` would do anyway: ``h * w.float()`` with ``h`` float32 computes exactly ``h * w``
    (mixed dtypes are computed in the promoted one), so the cast goes and every order of cast
    and multiply in model code (``(w.float() * h)``, ``(h * w.to(h.dtype))``) reads as ``h * w``."""
    if not (isinstance(x, fx.Node) and x.target is CAST and isinstance(x.args[0], fx.Node)):
        return x
    if len(x.users) != 1:
        return x  # read elsewhere too: the cast stays, and patterns that share it still match
    src, o = meta.tensor(x.args[0]), meta.tensor(other) if isinstance(other, fx.Node) else other
    if src is None or not meta.promotion_makes(src, x.args[1], o):
        return x
    return x.args[0]


def recast(x: Any, other: Any, node: fx.Node) -> Any:
    """The widening cast of ``x`` to the dtype of ``other`` that ``node``'s arithmetic does
    anyway, where the code computes that cast before ``node`` and reads it elsewhere: ``h = x.float();
    v = h.pow(2).mean(-1); x * rsqrt(v)`` reads as ``h * rsqrt(v)``, so both reads of the
    norm's input are one node whichever of them the code spells with the cast. The converse of
    :func:`uncast` (a cast read only here goes), so the two agree on one form."""
    src = meta.tensor(x) if isinstance(x, fx.Node) else None
    o = meta.tensor(other) if isinstance(other, fx.Node) else None
    if src is None or o is None or not _widens(src.dtype, o.dtype) or not meta.promotion_makes(src, o.dtype, o):
        return x  # only the cast to the other operand's own dtype: bf16 * float16 (float32) stays as written
    c = _casts_of(x, o.dtype, node)
    return c if c is not None and any(u is not node for u in c.users) else x


def hoist(canon: Any, node: fx.Node) -> bool:
    """``node``, a widening cast of ``y``, where ``y`` rearranges one tensor ``x`` through
    :data:`EXACT` ops read nowhere else, and the code casts ``x`` itself to that dtype before
    (the walk up from ``y`` stops at the first node it casts):
    the rearrangement reads that cast instead and ``node`` goes (``rotate_half(x).float()`` ->
    ``rotate_half(x.float())``, bit for bit the same values). Whether it did."""
    y, dtype = node.args
    src = meta.tensor(y)
    if not isinstance(y, fx.Node) or src is None or not _widens(src.dtype, dtype):
        return False
    chain: set[fx.Node] = set()
    sources: set[fx.Node] = set()
    stack = [y]
    while stack:
        n = stack.pop()
        if n in chain:
            continue
        if n.op != "call_function" or n.target not in EXACT or (n is not y and _casts(n, dtype)):
            sources.add(n)  # not a rearrangement, or one the code casts itself: where the walk stops
            continue
        chain.add(n)
        stack.extend(a for a in n.all_input_nodes if meta.is_tensor(a))
    if len(sources) != 1 or y in sources:
        return False
    [x] = sources
    inside = {*chain, node}
    if any(not set(n.users) <= inside for n in chain):
        return False  # a step of the rearrangement is read elsewhere: it stays in x's dtype
    cast = _casts_of(x, dtype, node)
    readers = [n for n in chain if x in n.all_input_nodes]
    if cast is None or any(reached_unwritten(r, {cast}) is None for r in readers):
        return False  # no cast of x before every reader of x in the rearrangement
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    for n in sorted(chain, key=order.__getitem__):
        n.replace_input_with(x, cast)
        meta.propagate(n, canon.fake_mode)
    canon.drop(node, y)
    return True
