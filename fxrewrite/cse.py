"""Common subexpressions: a pure call repeated on the same inputs is computed once.

Model code repeats a computation where each module does its own: every FP8 linear quantizes its
own input (only such chains merge: those that go on to a cast to a one-byte dtype), so q, k and
v projections that read one normed hidden state quantize it three times, and the norm's output
has three readers where a norm + quant rule needs one::

    # before                                        # after
    h = rms_norm(x)                                 h = rms_norm(x)
    g = aten.unflatten(h, -1, [-1, 128])            g = aten.unflatten(h, -1, [-1, 128])
    ... q, s = (quantized g)                        ... q, s = (quantized g)
    yq = fxr.linear_block_fp8(q, s, wq, sq)         yq = fxr.linear_block_fp8(q, s, wq, sq)
    g_1 = aten.unflatten(h, -1, [-1, 128])          yk = fxr.linear_block_fp8(q, s, wk, sk)
    ... q_1, s_1 = (quantized g_1)
    yk = fxr.linear_block_fp8(q_1, s_1, wk, sk)

The rule library's first pass (``rewrites.PIPELINE``), after canonicalization, before every rule
and ``merge_siblings`` (whose siblings then read one quantized input). One walk in graph order
numbers the values: a call whose ``(target, args, kwargs)`` (literals by type and value, input
nodes by their class) was seen before joins the earlier node's class, so whole repeated chains
form classes; then each class is computed once where it is part of a repeated chain
(:func:`eliminate_common_subexpressions` says why lone repeated calls stay).

Only calls of op overloads that are functions of their inputs: ATen and prims ops that write
nothing in place and draw no random numbers, and ``fxr`` ops the runtime defines as pure (no
in-place write, no collective, :func:`fxrewrite.runtime.providers.is_pure`). Not merged: across an
in-place write (the table starts again after any node that writes), a value that is written in
place later (or a view of it), calls inside a functorch transform (``vmap`` bodies,
:func:`fxrewrite.meta.outside_transforms`), Python-level calls (``torch.cat``, methods):
canonicalization has turned what rules read into overloads, but for the few that rules read as
written (:data:`PURE_FUNCTIONS`: NVFP4's quantizer rounds and selects with ``torch.round``,
``torch.where`` and comparisons), which merge as overloads do. Equal values of distinct inputs (two
parameters that hold the same scale) stay distinct: a parameter may change after compiling.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from fxrewrite import meta
from fxrewrite.canonicalize import CAST
from fxrewrite.report import PassResult

# Namespaces whose ops are functions of their inputs (fxr ops are asked one by one).
_PURE_NAMESPACES = frozenset({"aten", "prims"})
# The dtypes of quantized values (one byte, not bool: a mask is not a quantization)
_FLOAT8 = (getattr(torch, n) for n in dir(torch) if n.startswith("float8_"))
_QUANTIZED = frozenset(t for t in (torch.uint8, torch.int8, *_FLOAT8) if isinstance(t, torch.dtype) and t.itemsize == 1)
_LITERALS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
PURE_FUNCTIONS = frozenset({torch.where, torch.round, torch.unsqueeze, operator.eq, operator.ne, operator.lt, operator.le,
                            operator.gt, operator.ge})  # fmt: skip
"""Python-level calls left as written by canonicalization that compute a function of their arguments."""


class _Unhashable(Exception):
    pass


def pure(target: Any) -> bool:
    """``target`` computes a function of its arguments alone: no in-place write, no random
    numbers, no communication; outputs returned."""
    if target in PURE_FUNCTIONS:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if schema.is_mutable or not schema.returns or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if target.namespace == "fxr":
        from fxrewrite.runtime import providers

        return providers.is_pure(target._opname)
    return target.namespace in _PURE_NAMESPACES


def _frozen(v: Any, rep: dict[fx.Node, fx.Node]) -> Any:
    """A hashable key for an argument: nodes by the first node of their class (``rep``),
    literals by type and value (``1``, ``1.0`` and ``True`` differ, and so do ``0.0`` and ``-0.0``)."""
    if isinstance(v, fx.Node):
        return rep.get(v, v)
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_frozen(x, rep) for x in v))
    if isinstance(v, float):
        return (float, v, math.copysign(1.0, v))
    if isinstance(v, _LITERALS):
        return (type(v), v)
    raise _Unhashable


def _key(node: fx.Node, rep: dict[fx.Node, fx.Node]) -> tuple | None:
    try:
        kwargs = tuple(sorted((k, _frozen(v, rep)) for k, v in node.kwargs.items()))
        return (node.target, _frozen(node.args, rep), kwargs)
    except _Unhashable:
        return None


def _classes(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """Value numbering: the first node of each class of equal pure calls -> its members, in
    graph order (calls are equal when their targets, literals and the classes of their inputs are)."""
    seen: dict[tuple, fx.Node] = {}
    rep: dict[fx.Node, fx.Node] = {}
    members: dict[fx.Node, list[fx.Node]] = {}
    for node in meta.outside_transforms(gm.graph):
        if meta.written_args(node):
            seen.clear()  # what was read before the write is not what is read after it
            continue
        if node.op != "call_function" or not pure(node.target) or (key := _key(node, rep)) is None:
            continue
        first = seen.setdefault(key, node)
        if first is not node and (meta.written_later(first) or meta.written_later(node)):
            continue
        rep[node] = first
        members.setdefault(first, []).append(node)
    return {first: nodes for first, nodes in members.items() if len(nodes) > 1}


def eliminate_common_subexpressions(gm: fx.GraphModule) -> int:
    """Merge the repeated pure calls of ``gm`` in place (module docstring); returns how many
    nodes were removed.

    Repeated chains merge, not lone calls: a class whose members read the very same nodes (the
    root of a repeated chain) merges only where its readers form a class too (the chain goes
    on). Two different computations that start with the same cast or view of one input (a norm's
    ``x.float()`` and a quantization's of the same ``x``) keep their own: merged, the cast would
    be a node inside the norm's pattern with a reader outside it, and the norm would not fuse."""
    classes = _classes(gm)
    of = {n: first for first, nodes in classes.items() for n in nodes}

    def continues(first: fx.Node) -> bool:
        """Some member reads a node of a repeated class: the class continues a chain."""
        return any(of.get(i) is not None for n in classes[first] for i in n.all_input_nodes)

    def continued(first: fx.Node) -> bool:
        return any(of.get(u) is not None for n in classes[first] for u in n.users)

    def quantizes(first: fx.Node) -> bool:
        """The repeated chain through ``first`` (its classes linked through inputs and readers)
        holds a cast to a one-byte dtype: a quantization, what model code repeats per linear
        (with the views and scales around it). Other repeated chains stay as written: a weighted
        and an unweighted norm of one value share the whole of the unweighted one, and merged,
        its last node would sit inside the weighted norm's pattern with a reader outside it
        (neither would fuse as one op)."""
        stack, seen = [first], set()
        while stack:
            f = stack.pop()
            if f in seen:
                continue
            seen.add(f)
            if f.target is CAST and f.args[1] in _QUANTIZED:
                return True
            linked = [u for n in classes[f] for u in n.users] + [i for n in classes[f] for i in n.all_input_nodes]
            stack += [of[v] for v in linked if of.get(v) is not None]
        return False

    removed = 0
    for first in [f for f in classes if (continues(f) or continued(f)) and quantizes(f)]:
        for node in classes[first][1:]:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            removed += 1
    return removed


def cse_pass(gm: fx.GraphModule) -> PassResult:
    """:func:`eliminate_common_subexpressions` as a pipeline step (``rewrites.PIPELINE``'s first)."""
    return PassResult(matches=eliminate_common_subexpressions(gm))
