"""Canonical forms of shape and view operations: reshapes, slices, splits, ``cat`` and
``permute``. Kept beside :mod:`fxrewrite.canonicalize`, whose pass calls these for the targets in
:data:`NORMALIZERS` (the same ``_Canon`` helpers: ``set`` binds the schema, ``drop`` removes a
no-op, ``neg_dim`` makes dims negative where ranks are known)::

    %g = call_method[view](%h, %s0, 4, 16)      -> %g = aten.unflatten.int(%h, -1, [-1, 16])
    %y = call_method[view](%g, %s0, 64)         -> %y = aten.flatten.using_ints(%g, -2, -1)
    %a = getitem(%x, (Ellipsis, slice(None, 8))) -> %a = aten.slice.Tensor(%x, -1, 0, 8, 1)

* ``view`` and ``reshape`` (and ``view_as`` / ``reshape_as`` of a static shape) -> ``aten.reshape``
  when the input is contiguous (then both are views); a reshape to the same shape is removed; one
  that merges the trailing dims and keeps the leading ones -> ``aten.flatten(x, start, -1)``
  (``stack((-x2, x1), -1).reshape_as(x)`` is ``.flatten(-2)``), and one that splits the last dim
  into pieces other than 1 -> ``aten.unflatten(x, -1, [-1, *rest])``, as ``x.unflatten`` of the
  last dim is spelled (``x.reshape(*x.shape[:-1], -1, 2)`` is ``x.unflatten(-1, (-1, 2))``);
  ``flatten`` -> ``aten.flatten.using_ints`` with negative dims (removed when it keeps the shape);
* ``x[..., a:b:s]``, ``chunk`` and ``split`` along one dim -> ``aten.slice.Tensor`` with a negative
  dim, start 0 for None and end ``sys.maxsize`` for "to the end"; full-range slices are removed;
* ``contiguous()`` on a contiguous tensor and ``expand`` to the same shape are removed; ``cat``
  drops operands empty along its dim (and a ``cat`` of one operand is that operand);
  ``permute`` of a ``transpose`` / ``permute`` becomes one permute, and the identity is removed.

Which reshape spelling a graph gets depends on shapes, which a pattern does not have: a pattern's
``reshape(x, sizes)`` stays ``aten.reshape``. :data:`RESHAPES` names the spellings, for code that
looks for "a reshape"; the matcher pairs a pattern's reshape with each (:data:`SPELLINGS`), its
sizes read by :func:`reshape_sizes`.
"""

from __future__ import annotations

import functools
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from fxrewrite import meta

A = torch.ops.aten
MAX = sys.maxsize
SLICE, RESHAPE, PERMUTE = A.slice.Tensor, A.reshape.default, A.permute.default
FLATTEN, UNFLATTEN = A.flatten.using_ints, A.unflatten.int

RESHAPES = frozenset({RESHAPE, FLATTEN, UNFLATTEN})
"""The canonical spellings of a reshape (the same elements in the same order, another shape),
chosen by the shapes: code that looks for "a reshape" accepts each (:func:`reshape_sizes`)."""

SPELLINGS: dict[Any, frozenset[Any]] = {RESHAPE: RESHAPES}
"""A pattern's target -> the graph targets that may compute the same, their arguments read as
the pattern's by :func:`args_as`. A pattern is canonicalized without shapes, so its
``reshape(x, sizes)`` stays ``aten.reshape``; the graph's may have become ``aten.flatten`` or
``aten.unflatten``, and still pairs with it."""


@functools.cache
def pairs_with(target: Any) -> frozenset[Any]:
    """The graph targets a pattern node calling ``target`` may pair with: itself and its
    :data:`SPELLINGS`."""
    return SPELLINGS.get(target, frozenset()) | {target}


def reshape_sizes(node: fx.Node) -> list[Any] | None:
    """The sizes ``aten.reshape`` would be written with to compute ``node``, a canonical reshape
    (:data:`RESHAPES`): a reshape's own list; for ``flatten(x, s, e)`` ``x``'s sizes with dims
    ``s..e`` as one ``-1``, for ``unflatten(x, d, sizes)`` ``x``'s sizes with dim ``d`` as
    ``sizes`` (``x``'s sizes ints, or SymInts where symbolic: no graph node holds them, so a
    replacement may read only the static entries). None for another node, or where ``x``'s shape
    is unknown::

        aten.unflatten(%h, -1, [-1, 16])  of h: [s0, 64]   -> [s0, -1, 16]
        aten.flatten(%g, -2, -1)          of g: [s0, 4, 16] -> [s0, -1]
    """
    if node.op != "call_function" or node.target not in RESHAPES:
        return None
    if node.target is RESHAPE:
        return list(node.args[1])
    t = meta.tensor(node.args[0])
    if t is None or t.dim() == 0:
        return None
    shape = list(t.shape)
    if node.target is FLATTEN:
        start, end = (d % len(shape) for d in node.args[1:3])
        return shape[:start] + [-1] + shape[end + 1 :]
    dim = node.args[1] % len(shape)
    return shape[:dim] + list(node.args[2]) + shape[dim + 1 :]


def args_as(target: Any, node: fx.Node) -> list[Any] | None:
    """``node``'s arguments as a call of ``target`` takes them, where ``node`` computes what that
    call would (``target`` a pattern's, ``node.target`` one of its :data:`SPELLINGS`); None where
    they cannot be read so."""
    if node.target == target:
        return list(node.args)
    if target is RESHAPE and (sizes := reshape_sizes(node)) is not None:
        return [node.args[0], sizes]
    return None


def reshape(canon: Any, node: fx.Node) -> None:
    """``view`` / ``reshape`` / ``view_as`` / ``reshape_as`` -> removed, ``aten.flatten``,
    ``aten.unflatten`` or ``aten.reshape`` (see the module docstring)."""
    x, shape = node.args[0], node.args[1:]
    if node.target in ("view_as", "reshape_as"):  # the other tensor's shape, as ints where known
        other = meta.tensor(shape[0]) if len(shape) == 1 else None
        shape = [tuple(other.shape)] if other is not None and all(isinstance(s, int) for s in other.shape) else [None]
    if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
        shape = shape[0]
    elif len(shape) == 1 and isinstance(shape[0], fx.Node) and not isinstance(meta.value(shape[0]), int):
        return  # x.view(y.shape): a Size-valued node, kept as written
    if "size" in node.kwargs or "shape" in node.kwargs:
        shape = node.kwargs.get("size", node.kwargs.get("shape"))
    if any(isinstance(s, torch.dtype) for s in shape):
        return  # view(dtype) reinterprets bits
    if meta.same_shape(node, x):
        return canon.drop(node, x)
    t = meta.tensor(x)
    if node.target in ("view", "view_as") and (t is None or not t.is_contiguous()):
        return
    start = _merged_tail(t, meta.tensor(node))
    if start is not None:
        return canon.set(node, FLATTEN, (x, start, -1))
    pieces = _split_last(t, meta.tensor(node), list(shape))
    if pieces is not None:
        return canon.set(node, UNFLATTEN, (x, -1, pieces))
    if any(s is None for s in shape):
        return  # x.reshape_as(y) of a symbolic shape that is not a flatten: kept as written
    canon.set(node, RESHAPE, (x, list(shape)))


def flatten(canon: Any, node: fx.Node) -> None:
    """``flatten`` -> ``aten.flatten.using_ints`` with negative dims; removed when it keeps the shape."""
    x = node.args[0]
    start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
    end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
    if meta.same_shape(node, x):
        return canon.drop(node, x)  # flattening a 1-d tensor (an engine's positions)
    return canon.set(node, FLATTEN, (x, canon.neg_dim(x, start), canon.neg_dim(x, end)))


def unflatten(canon: Any, node: fx.Node) -> None:
    """``x.unflatten(d, sizes)`` -> ``aten.unflatten.int``; of the last dim, as a reshape
    splitting it spells it (``[-1, *rest]``); patterns, without shapes, as written."""
    x = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    sizes = node.args[2] if len(node.args) > 2 else node.kwargs.get("sizes")
    if not isinstance(dim, int) or not isinstance(sizes, (list, tuple)):
        return
    pieces = _split_last(meta.tensor(x), meta.tensor(node))
    if pieces is not None:
        return canon.set(node, UNFLATTEN, (x, -1, pieces))
    canon.set(node, UNFLATTEN, (x, canon.neg_dim(x, dim), list(sizes)))


def _merged_tail(x: torch.Tensor | None, out: torch.Tensor | None) -> int | None:
    """``start`` (negative) when ``out`` is ``x`` with its dims from ``start`` on merged into one
    and at least one leading dim kept: what ``x.flatten(start)`` makes. Else None."""
    if x is None or out is None or not 2 <= out.dim() < x.dim():
        return None
    keep = out.dim() - 1
    if not all(meta.dim_key(a) == meta.dim_key(b) for a, b in zip(x.shape[:keep], out.shape[:keep])):
        return None
    merged = functools.reduce(operator.mul, x.shape[keep:], 1)
    return keep - x.dim() if meta.dim_key(merged) == meta.dim_key(out.shape[-1]) else None


def _split_last(x: torch.Tensor | None, out: torch.Tensor | None, written: list[Any] = ()) -> list[int] | None:
    """``[-1, *rest]`` when ``out`` is ``x`` with its last dim split into pieces, none of them 1,
    every one after the first static (``rest``; the sizes ``written`` in the reshape where Dynamo
    left an expression of a symbolic head size): what ``x.unflatten(-1, (-1, *rest))`` makes. Else
    None."""
    if x is None or out is None or x.dim() == 0 or out.dim() <= x.dim():
        return None
    keep = x.dim() - 1
    if not all(meta.dim_key(a) == meta.dim_key(b) for a, b in zip(x.shape[:keep], out.shape[:keep])):
        return None
    first, *rest = out.shape[keep:]
    if len(written) == out.dim() and all(isinstance(w, int) for w in written[keep + 1 :]):
        rest = written[keep + 1 :]
    if not all(isinstance(r, int) and r > 1 for r in rest) or meta.dim_key(first) == 1:
        return None
    return [-1, *rest]


def slice_(canon: Any, node: fx.Node, x: Any, dim: int = 0, start: Any = None, end: Any = None, step: Any = None) -> None:
    step = 1 if step is None else step
    start, end, dim = 0 if start is None else start, MAX if end is None else end, canon.neg_dim(x, dim)
    t = meta.tensor(x)
    if t is not None and isinstance(end, int) and isinstance(t.shape[dim], int) and end >= t.shape[dim]:
        end = MAX
    if start == 0 and end == MAX and step == 1:
        return canon.drop(node, x)
    canon.set(node, SLICE, (x, dim, start, end, step))


def aten_slice(canon: Any, node: fx.Node) -> None:
    """A canonical slice again (after a rewrite): removed where it became full-range."""
    return slice_(canon, node, *node.args[:5])


def getitem(canon: Any, node: fx.Node) -> None:
    """``x[..., a:b:s]`` and ``x[a:b, :]`` of a tensor -> one slice along one dim; a piece of a
    split last dim, ``h.unflatten(-1, (-1, d))[..., i, :]`` -> ``h[..., i*d:(i+1)*d]`` (other
    forms untouched)."""
    if not meta.is_tensor(node.args[0]):
        return
    x, idx = node.args
    idx = idx if isinstance(idx, tuple) else (idx,)
    if _piece_of_split_last(canon, node, x, idx):
        return
    if not all(isinstance(i, slice) or i is Ellipsis for i in idx) or idx.count(Ellipsis) > 1:
        return
    real = [(pos, s) for pos, s in enumerate(idx) if isinstance(s, slice) and s != slice(None)]
    if len(real) > 1:
        return
    if not real:
        return canon.drop(node, x)
    pos, s = real[0]
    # after an Ellipsis the dim counts from the end; before it (or without one), from the front
    dim = pos - len(idx) if Ellipsis in idx and pos > idx.index(Ellipsis) else pos
    slice_(canon, node, x, dim, s.start, s.stop, s.step)


def _piece_of_split_last(canon: Any, node: fx.Node, x: Any, idx: tuple[Any, ...]) -> bool:
    """``h.view(B, T, 2, d)[..., i, :]`` (a reshape or unflatten that splits ``h``'s last dim in
    two, the second piece ``d`` static; piece ``i >= 0`` of the first) is ``h[..., i*d:(i+1)*d]``:
    the same values, in the form the gated-activation rules read as the halves of one row. True
    when rewritten."""
    if not (len(idx) == 3 and idx[0] is Ellipsis and idx[2] == slice(None) and type(idx[1]) is int and idx[1] >= 0):
        return False
    if not (isinstance(x, fx.Node) and x.target in RESHAPES and isinstance(x.args[0], fx.Node)):
        return False
    pieces = _split_last(meta.tensor(x.args[0]), meta.tensor(x))
    if pieces is None or len(pieces) != 2:
        return False
    d, i = pieces[1], idx[1]
    slice_(canon, node, x.args[0], -1, i * d, (i + 1) * d)
    return True


def chunk(canon: Any, node: fx.Node) -> None:
    chunks = node.args[1] if len(node.args) > 1 else node.kwargs.get("chunks")
    _split(canon, node, lambda size: [-(-size // chunks)] * chunks)


def split(canon: Any, node: fx.Node) -> None:
    sizes = node.args[1] if len(node.args) > 1 else node.kwargs.get("split_size_or_sections")
    if isinstance(sizes, fx.Node) or (isinstance(sizes, (list, tuple)) and not all(isinstance(n, int) for n in sizes)):
        return  # symbolic sizes: the bounds are not known here
    _split(canon, node, lambda size: [sizes] * -(-size // sizes) if isinstance(sizes, int) else list(sizes))


def _split(canon: Any, node: fx.Node, pieces: Callable[[int], list[Any]]) -> None:
    """``chunk`` / ``split`` along a static dim, read by ``getitem`` users -> one slice each."""
    x = node.args[0]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    t = meta.tensor(x)
    if t is None or not isinstance(t.shape[dim], int):
        return
    size = t.shape[dim]
    bounds, start = [], 0
    for n in pieces(size):
        if not isinstance(n, int) or start >= size:
            break
        bounds.append((start, min(start + n, size)))
        start += n
    _split_users(canon, node, bounds, canon.neg_dim(x, dim))


def _split_users(canon: Any, node: fx.Node, bounds: list[tuple[int, int]], dim: int) -> None:
    x = node.args[0]
    users = list(node.users)
    if not all(u.target is operator.getitem and isinstance(u.args[1], int) and -len(bounds) <= u.args[1] < len(bounds) for u in users):
        return
    for u in users:
        start, end = bounds[u.args[1]]
        slice_(canon, u, x, dim, start, end)
    if not node.users:
        canon.graph.erase_node(node)


def contiguous(canon: Any, node: fx.Node) -> None:
    """``contiguous()`` of a contiguous tensor -> removed."""
    t = meta.tensor(node.args[0])
    if t is not None and t.is_contiguous() and not node.kwargs:
        return canon.drop(node, node.args[0])
    return None


def expand(canon: Any, node: fx.Node) -> None:
    """``expand`` / ``expand_as`` to the shape the tensor has -> removed."""
    if meta.same_shape(node, node.args[0]):
        return canon.drop(node, node.args[0])
    return None


def cat(canon: Any, node: fx.Node) -> None:
    """``cat`` drops operands that are empty along its dim (Phi-3's partial-rotary code keeps
    ``q[..., rotary_dim:]`` even when the rotation covers the whole head) and the legacy empty
    ``[0]`` tensors it skips at any dim (a KV cache that starts as ``torch.tensor([])``);
    ``cat`` of one operand is that operand, unless a user writes the result in place."""
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
        return None
    keep = [t for t in tensors if not _empty_along(meta.tensor(t), dim)]
    if len(keep) == len(tensors) or not keep or not _same_promotion(node, keep):
        return None
    if len(keep) == 1 and meta.same_shape(node, keep[0]) and not any(meta.written_args(u) for u in node.users):
        return canon.drop(node, keep[0])
    node.args, node.kwargs = (keep, dim), {}
    canon.changed += 1
    return None


def _empty_along(t: torch.Tensor | None, dim: int) -> bool:
    """Whether ``torch.cat(..., dim)`` takes nothing from ``t``: no rows along ``dim``, or the
    legacy 1-D empty tensor cat skips whatever the rank of the others."""
    if t is None:
        return False
    if t.dim() == 1 and isinstance(t.shape[0], int) and t.shape[0] == 0:
        return True
    if not -t.dim() <= dim < t.dim():
        return False
    n = t.shape[dim]
    return isinstance(n, int) and n == 0


def _same_promotion(node: fx.Node, operands: list[Any]) -> bool:
    """Whether ``operands`` alone promote to the dtype ``node`` returns: an empty float32
    operand makes ``cat([empty_f32, x_bf16])`` float32, and dropping it would change that."""
    out, values = meta.tensor(node), [meta.tensor(t) for t in operands]
    if out is None or any(v is None for v in values):
        return False
    return functools.reduce(torch.promote_types, [v.dtype for v in values]) == out.dtype


def permute(canon: Any, node: fx.Node) -> None:
    """``permute`` of a ``transpose`` or ``permute`` -> one permute of the source; the identity
    permutation is removed (a rewrite that views ``[B, H, T, D]`` as ``[B, T, H, D]`` undoes
    the model's transpose)."""
    x, dims = node.args[0], node.args[1]
    r = canon.rank(x)
    if r is None or not isinstance(x, fx.Node) or not all(isinstance(d, int) for d in dims):
        return None
    dims = [d % r for d in dims]
    inner: list[int] | None = None
    if x.op == "call_method" and x.target == "transpose" and len(x.args) == 3 and all(isinstance(d, int) for d in x.args[1:]):
        inner = list(range(r))
        a, b = x.args[1] % r, x.args[2] % r
        inner[a], inner[b] = inner[b], inner[a]
    elif x.op == "call_function" and x.target is PERMUTE and all(isinstance(d, int) for d in x.args[1]):
        inner = [d % r for d in x.args[1]]
    src = x
    if inner is not None:
        dims, src = [inner[d] for d in dims], x.args[0]
    if dims == list(range(r)):
        return canon.drop(node, src)
    if src is not x:
        canon.set(node, PERMUTE, (src, dims))
    return None


NORMALIZERS: dict[tuple[str, Any], Callable[[Any, fx.Node], None]] = {
    **dict.fromkeys([("call_method", "view"), ("call_method", "reshape"), ("call_function", torch.reshape),
                     ("call_method", "view_as"), ("call_method", "reshape_as")], reshape),
    ("call_method", "flatten"): flatten,
    ("call_function", torch.flatten): flatten,
    ("call_method", "unflatten"): unflatten,
    ("call_function", torch.unflatten): unflatten,
    ("call_method", "contiguous"): contiguous,
    ("call_method", "expand"): expand,
    ("call_method", "expand_as"): expand,
    ("call_function", operator.getitem): getitem,
    ("call_function", torch.chunk): chunk,
    ("call_method", "chunk"): chunk,
    ("call_function", torch.split): split,
    ("call_method", "split"): split,
    **dict.fromkeys([("call_function", torch.cat), ("call_function", torch.concat),
                     ("call_function", torch.concatenate)], cat),
    ("call_function", PERMUTE): permute,
    ("call_function", SLICE): aten_slice,
}  # fmt: skip
"""(op, target) of a graph node -> its normalizer, called with the canonicalizing pass and the node."""
