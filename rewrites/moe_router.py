"""MoE routers bound by what they compute, for ``fxr.moe_route`` (used by :mod:`.moe`'s pass).

    %scores = aten.sigmoid(%logits)                         %r = fxr.moe_route(%logits, %bias, 2,
    %choice = aten.add(%scores, %bias)                              "sigmoid", "scores", 4, 2, 2,
    ... view [T, 4, E/4], topk(2), sum, topk(2), scatter_,    ->       True, 2.5)
        masked_fill(-inf) ...                                    %w = %r[0]; %ids = %r[1]
    %ids = aten.topk(%choice, 2)[1]
    %w = %scores.gather(1, %ids); %w /= %w.sum(-1, keepdim=True) + 1e-20; %w = %w * 2.5

A router is read from the top-k that chooses the experts (its ids read; its weights either its
values or a ``gather`` of the scores at its ids):

1. **Weights**: from there, single readers through casts, one scoring: softmax, sigmoid or
   sqrt(softplus) (top-k first, then the activation of the chosen values), a renormalization
   (``w / (w.sum(-1, keepdim=True) [+ eps | .clamp(min=eps)])``, ``/=`` too) and products with
   numbers (the routed scaling).
2. **Logits**: a value the top-k's input and the gathered scores are both elementwise functions
   of (back along same-shaped values); the farthest back that the op can stand for: the router
   GEMM's output, or what a softcap left of it.
3. **Region**: every node between the logits and the weights and ids (with in-place writes into
   them, the group mask's ``scatter_``); it may read only the logits, one ``[E]`` bias and
   numbers, and nothing outside reads its values but the weights and ids.
4. **Arguments**: the one scoring in the region (softmax, sigmoid, sqrt(softplus)); the top-k
   chooses among the scores when that activation is upstream of its input, else among the logits; a
   ``[T, G, E/G]`` view with a top-``m`` (or max) per group and a top-``g`` over ``[T, G]``
   makes ``G`` groups of which ``g`` are kept, by the sum of their ``m`` best.
5. **Proof**: the region, copied into a standalone graph, and ``fxr.moe_route``'s reference run
   on the same distinct logits and a random bias (the model's own where not all zero) and must
   choose the same experts per token and give them the same weights (within the dtype's
   tolerance). Verdicts are cached per region signature.

A router that fails reports why; :mod:`.moe` turns that into a near miss.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxrewrite import meta
from fxrewrite.canonicalize import CAST, CLAMP, DIV, MUL, SIGMOID, SOFTMAX, SOFTPLUS, SQRT, SUM, TOPK, A
from fxrewrite.canonicalize_shape import RESHAPES
from fxrewrite.runtime.ops.moe_route import moe_route_reference
from fxrewrite.verify import agrees, extract_nodes

MAX_REGION_NODES = 80
POS = "_fxr_moe_pos"  # a node's place in graph order, set by :func:`number`
MAX_VERDICTS = 256
_ADD = frozenset({A.add.Tensor, operator.add})
_DIVIDES = frozenset({DIV, operator.truediv, operator.itruediv})
_MULTIPLIES = frozenset({MUL, operator.mul, operator.imul})
_MAX = frozenset({A.amax.default, A.max.dim, torch.max, torch.amax})
_GATHERS = frozenset({torch.gather, A.gather.default})


class Miss(Exception):
    """The router cannot be bound; ``at`` is the node the reason is about."""

    def __init__(self, reason: str, at: fx.Node) -> None:
        super().__init__(reason)
        self.reason, self.at = reason, at


@dataclasses.dataclass(frozen=True)
class Router:
    """A bound router: its region (graph order), what the experts read from it, and the
    arguments of ``fxr.moe_route``."""

    topk: fx.Node
    ids: fx.Node
    weights: fx.Node
    logits: fx.Node
    bias: fx.Node | None
    nodes: tuple[fx.Node, ...]
    top_k: int
    scoring: str
    select: str
    n_group: int = 1
    topk_group: int = 1
    group_top: int = 2
    renormalize: bool = False
    routed_scaling: float | fx.Node = 1.0  # a node: a float the graph reads (lifted)
    dense: bool = False  # the weights are [..., E], zero but at the ids (:func:`densify`)

    def args(self) -> tuple[Any, ...]:
        return (self.logits, self.bias, self.top_k, self.scoring, self.select, self.n_group, self.topk_group,
                self.group_top, self.renormalize, self.routed_scaling)  # fmt: skip

    @property
    def experts(self) -> Any:
        return meta.tensor(self.topk.args[0]).shape[-1]

    @property
    def plain(self) -> bool:
        """Softmax routing ``fxr.moe`` computes itself from the logits (top-k of the scores or of
        the logits, renormalized or not; no bias, groups or scaling)."""
        return (self.scoring == "softmax" and self.bias is None and self.n_group == 1 and self.routed_scaling == 1.0
                and (self.select == "scores" or self.renormalize))  # fmt: skip

    def describe(self) -> str:
        parts = [self.scoring, f"top_k={self.top_k}"]
        if self.select == "logits":
            parts.append("chosen on the logits")
        if self.bias is not None:
            parts.append("biased")
        if self.n_group > 1:
            parts.append(f"{self.topk_group} of {self.n_group} groups by top-{self.group_top}")
        parts.append(f"renormalize={self.renormalize}")
        if isinstance(self.routed_scaling, fx.Node):
            parts.append(f"scaling=`{self.routed_scaling.name}`")
        elif self.routed_scaling != 1.0:
            parts.append(f"scaling={self.routed_scaling:g}")
        if self.dense:
            parts.append("dense weights")
        return ", ".join(parts)


# --------------------------------------------------------------------------- binding


@dataclasses.dataclass(frozen=True)
class Selection:
    """What a top-k hands its experts: ``ids``, and ``weights`` at the end of ``chain`` from
    ``start`` (its values, or scores gathered at its ids)."""

    topk: fx.Node
    ids: fx.Node
    start: fx.Node
    chain: tuple[fx.Node, ...]
    renormalize: bool
    scaling: float | fx.Node
    act: fx.Node | None
    dense: bool = False  # the values scattered into a [T, E] of -inf first (Llama 4): dense weights

    @property
    def weights(self) -> fx.Node:
        return self.chain[-1] if self.chain else self.start

    @property
    def gathered(self) -> fx.Node | None:
        """The scores the weights are gathered from, if they are."""
        args = _gather_args(self.start)
        return args[0] if args is not None and args[2] is self.ids else None


def selection(topk: fx.Node) -> Selection | None:
    """``topk`` as the choice of experts: its ids read, and weights; None if it is not one (a
    group's top-k, a top-k over something else)."""
    choice, k, dim, largest = topk.args[:4]
    t = meta.tensor(choice)
    picks = {u.args[1]: u for u in topk.users if u.target is operator.getitem}
    if not isinstance(k, int) or largest is not True or t is None or not t.dtype.is_floating_point or 1 not in picks:
        return None
    if dim not in (-1, t.dim() - 1):
        return None
    ids, values = picks[1], picks.get(0)
    start = values if values is not None and values.users else _gather_of(ids)
    if start is None:
        return None
    dense = _densified(start, ids)
    chain, renormalize, scaling, act = _weights_chain(dense or start)
    if dense is not None:
        chain.insert(0, dense)
    return Selection(topk, ids, start, tuple(chain), renormalize, scaling, act, dense is not None)


def _densified(values: fx.Node, ids: fx.Node) -> fx.Node | None:
    """``full(-inf).scatter_(-1, ids, values)``: the one reader of ``values`` writing them at
    their ids into a ``[..., E]`` of -inf (an activation then zeroes the others), else None."""
    users = list(values.users)
    if len(users) != 1 or users[0].op != "call_method" or users[0].target not in ("scatter_", "scatter"):
        return None
    s = users[0]
    base, dim, index, src = (list(s.args) + [None] * 4)[:4]
    t = meta.tensor(base)
    if index is not ids or src is not values or t is None or dim not in (-1, t.dim() - 1):
        return None
    full = base if base.op == "call_function" and base.target in (torch.full_like, torch.full) else None
    fill = full.args[1] if full is not None and len(full.args) > 1 else None
    return s if fill == float("-inf") and len(base.users) == 1 else None


def bind(topk: fx.Node) -> Router | None:
    """The router whose experts ``topk`` chooses, bound and proven; None when ``topk`` does not
    choose experts (:func:`selection`); :class:`Miss` when it nearly does."""
    sel = selection(topk)
    if sel is None:
        return None
    sources = [topk.args[0]] + ([sel.gathered] if sel.gathered is not None else [])
    candidates = _common(*(_back_chain(s) for s in sources))
    if not candidates:
        raise Miss("the top-k's input and the gathered scores share no logits", topk)
    first: Miss | None = None
    for logits in reversed(candidates):  # the farthest back first
        try:
            router = _read(sel, logits)
            _prove(router)
            return router
        except Miss as e:
            first = first or e
    assert first is not None
    raise first


def _gather_of(ids: fx.Node) -> fx.Node | None:
    """The one reader of ``ids`` that gathers scores at them along the last dim."""
    found = [u for u in ids.users if _gather_args(u) is not None and _gather_args(u)[2] is ids]  # type: ignore[index]
    return found[0] if len(found) == 1 else None


def _gather_args(n: fx.Node) -> tuple[fx.Node, int, fx.Node] | None:
    """(source, dim, index) of a gather along the last dim, in any spelling."""
    if n.op == "call_method" and n.target == "gather" or n.op == "call_function" and n.target in _GATHERS:
        args = list(n.args) + [n.kwargs[k] for k in ("dim", "index") if k in n.kwargs]
        if len(args) >= 3 and isinstance(args[0], fx.Node) and isinstance(args[2], fx.Node):
            t = meta.tensor(args[0])
            if t is not None and args[1] in (-1, t.dim() - 1):
                return args[0], -1, args[2]
    return None


def _weights_chain(start: fx.Node) -> tuple[list[fx.Node], bool, float | fx.Node, fx.Node | None]:
    """The nodes from ``start`` (top-k values or gathered scores) to the weights the experts read:
    casts, one scoring (softmax, sigmoid, sqrt(softplus)), renormalizations, products with
    numbers; and whether it renormalizes, the scaling, the activation if any."""
    chain: list[fx.Node] = []
    renormalize, scaling, act = False, 1.0, None
    node = start
    while True:
        users = list(node.users)
        renorm = _renormalization(node) if len(users) == 2 else None
        if renorm is not None:
            chain += renorm
            node, renormalize = renorm[-1], True
            continue
        if len(users) != 1:
            break
        u = users[0]
        factor = _number_factor(u, node)
        if u.target is CAST and u.args[1].is_floating_point:
            pass
        elif act is None and not renormalize and (root := _softplus_of_sqrt(u)) is not None:
            chain.append(u)  # softplus, then the sqrt that makes the score
            u = act = root
        elif act is None and not renormalize and scoring(u) is not None:
            act = u
            renormalize = renormalize or u.target is SOFTMAX
        elif isinstance(factor, fx.Node) and scaling == 1.0:
            scaling = factor  # a float the graph reads (lifted): the op takes it as it is
        elif isinstance(factor, float) and not isinstance(scaling, fx.Node):
            scaling *= factor
        else:
            break
        chain.append(u)
        node = u
    return chain, renormalize, scaling, act


def _renormalization(node: fx.Node) -> list[fx.Node] | None:
    """``node / node.sum(-1, keepdim=True)`` (``+ eps`` or ``.clamp(min=eps)`` on the sum; ``/=``
    too): its nodes, the division last; else None."""
    total = next((u for u in node.users if u.target is SUM and u.args[1:3] == ([-1], True)), None)
    if total is None or len(total.users) != 1:
        return None
    denom, nodes = total, [total]
    u = next(iter(total.users))
    eps_add = u.target in _ADD and _scalar(u.args[1])
    eps_clamp = u.target is CLAMP and _scalar(u.args[1]) and u.args[2] is None
    if (eps_add or eps_clamp) and len(u.users) == 1:
        denom = u
        nodes.append(u)
    div = next((v for v in node.users if v is not total and _is_divide(v) and v.args[:2] == (node, denom)), None)
    if div is None or list(denom.users) != [div]:
        return None
    return nodes + [div]


def _scalar(a: Any) -> bool:
    """A number, or a node computing one (a float the graph reads)."""
    return isinstance(a, (int, float)) and not isinstance(a, bool) or isinstance(a, fx.Node) and not meta.is_tensor(a)


def _is_divide(n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _DIVIDES) or (n.op == "call_method" and n.target == "div_")


def _number_factor(u: fx.Node, node: fx.Node) -> float | fx.Node | None:
    """The number ``u`` multiplies ``node`` by (``node * c``, ``node / c``; a scalar node the
    graph computes, for a product), else None."""
    if u.op != "call_function" or len(u.args) != 2 or u.args[0] is not node:
        return None
    c = u.args[1]
    if isinstance(c, fx.Node):
        return c if u.target in _MULTIPLIES and not meta.is_tensor(c) and meta.value(c) is not None else None
    if not isinstance(c, (int, float)) or isinstance(c, bool):
        return None
    if u.target in _MULTIPLIES:
        return float(c)
    return 1.0 / c if u.target in _DIVIDES and c != 0 else None


def _back_chain(n: fx.Node) -> list[fx.Node]:
    """``n`` and the values it is an elementwise function of, back along floating values of its
    shape (one such input at each step)."""
    out = [n]
    shape = meta.tensor(n).shape if meta.tensor(n) is not None else None
    while shape is not None and len(out) < MAX_REGION_NODES:
        ins = [a for a in n.all_input_nodes if (t := meta.tensor(a)) is not None and t.dtype.is_floating_point
               and meta.same_shape(a, n)]  # fmt: skip
        if len(ins) != 1:
            break
        n = ins[0]
        out.append(n)
        if n.op in ("placeholder", "get_attr"):
            break
    return out


def _common(*chains: list[fx.Node]) -> list[fx.Node]:
    """The nodes of the first chain that every chain holds, nearest first."""
    return [n for n in chains[0] if all(n in c for c in chains[1:])]


def _read(sel: Selection, logits: fx.Node) -> Router:
    """The router with ``logits`` as its input, checked against the structure (not yet proven)."""
    topk, ids, weights, act_after = sel.topk, sel.ids, sel.weights, sel.act
    nodes = _region(logits, (weights, ids))
    inside = set(nodes)
    for n in nodes:
        outside = [u for u in n.users if u not in inside] if n not in (weights, ids) else []
        if outside:
            raise Miss(f"the router's `{n.name}` is read outside it by `{outside[0].name}`", n)
    e = meta.tensor(topk.args[0]).shape[-1]
    reads = {a for n in nodes for a in n.all_input_nodes if a not in inside}
    tensors = [a for a in reads if a is not logits and meta.is_tensor(a)]
    biases = [a for a in tensors if tuple(map(meta.dim_key, meta.tensor(a).shape)) == (meta.dim_key(e),)]
    others = [a for a in tensors if a not in biases]
    if others or len(biases) > 1:
        bad = (others or biases)[0]
        raise Miss(f"the router reads `{bad.name}` beside its logits `{logits.name}` (one [E] bias at most)", bad)
    acts = [n for n in nodes if scoring(n) is not None]
    if len(acts) != 1:
        raise Miss(f"the router holds {len(acts)} softmax, sigmoid or sqrt-softplus scorings, fxr.moe_route one", topk)
    act = acts[0]
    chooses_scores = act in upstream(topk.args[0], inside)
    if act_after is not None and act is not act_after:
        raise Miss("the router scores the chosen values twice", act_after)
    groups = _groups(nodes, topk, e)
    return Router(topk, ids, weights, logits, biases[0] if biases else None, tuple(nodes), topk.args[1],
                  scoring(act), "scores" if chooses_scores else "logits",
                  *groups, sel.renormalize, sel.scaling, sel.dense)  # fmt: skip


def scoring(n: fx.Node) -> str | None:
    """The scoring ``n`` computes from its input (one of ``fxr.moe_route``'s), else None:
    ``softmax`` over the last dim, ``sigmoid``, ``sqrtsoftplus`` (the sqrt of torch's default
    softplus, beta 1 and threshold 20, read only there)."""
    if n.target is SOFTMAX and n.args[1] == -1:
        return "softmax"
    if n.target is SIGMOID:
        return "sigmoid"
    sp = n.args[0] if n.target is SQRT else None
    if isinstance(sp, fx.Node) and _softplus_of_sqrt(sp) is n:
        return "sqrtsoftplus"
    return None


def _softplus_of_sqrt(n: fx.Node) -> fx.Node | None:
    """The sqrt ``n`` feeds when ``n`` is torch's default softplus read only by a sqrt, else None."""
    if n.target is not SOFTPLUS or tuple(n.args[1:]) != (1, 20) or len(n.users) != 1:
        return None
    [u] = n.users
    return u if u.target is SQRT else None


def upstream(n: fx.Node, inside: set[fx.Node]) -> set[fx.Node]:
    """``n`` and what it reads, transitively, within ``inside``."""
    seen: set[fx.Node] = set()
    stack = [n]
    while stack:
        m = stack.pop()
        if m in inside and m not in seen:
            seen.add(m)
            stack.extend(m.all_input_nodes)
    return seen


def _region(logits: fx.Node, outputs: tuple[fx.Node, ...]) -> list[fx.Node]:
    """The nodes on paths from ``logits`` to ``outputs`` (and in-place writes into them), graph order."""
    last = max(position(o) for o in outputs)
    below: set[fx.Node] = set()
    stack = [logits]
    while stack:
        for u in stack.pop().users:
            if u not in below and position(u) <= last:
                below.add(u)
                stack.append(u)
                if len(below) > 4 * MAX_REGION_NODES:
                    raise Miss(f"the router grows past {MAX_REGION_NODES} nodes", logits)
    nodes: set[fx.Node] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in nodes or n not in below:
            continue
        nodes.add(n)
        stack.extend(n.all_input_nodes)
        stack.extend(u for u in n.users if u in below and writes(u) is n)
    if len(nodes) > MAX_REGION_NODES:
        raise Miss(f"the router grows past {MAX_REGION_NODES} nodes", logits)
    dead = {u for n in nodes for u in n.users if u.target is operator.getitem and not u.users}
    return sorted(nodes | dead, key=position)


def number(graph: fx.Graph) -> None:
    """Number ``graph``'s nodes in order (:func:`position`); new nodes take their anchor's number."""
    for i, n in enumerate(graph.nodes):
        n.meta[POS] = i


def position(n: fx.Node) -> int:
    return n.meta[POS]


def writes(n: fx.Node) -> fx.Node | None:
    """The input ``n`` overwrites in place, if any: ``x.op_()``, ``x[i] = v``, ``x /= y``, a mutable ATen op."""
    first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if n.op == "call_method" and str(n.target).endswith("_"):
        return first
    if n.op == "call_function" and n.target in (operator.setitem, operator.itruediv, operator.iadd, operator.isub,
                                                operator.imul):  # fmt: skip
        return first
    schema = getattr(n.target, "_schema", None)
    return first if schema is not None and schema.is_mutable else None


def _groups(nodes: list[fx.Node], topk: fx.Node, e: Any) -> tuple[int, int, int]:
    """(n_group, topk_group, group_top) from the region's ``[T, G, E/G]`` view, its per-group
    top-``m`` (or max) and its top-``g`` over ``[T, G]``; (1, 1, 2) without groups. The view is
    any canonical reshape (``aten.unflatten(scores, -1, [-1, E/G])`` as written in most code)."""
    views = [n for n in nodes if n.target in RESHAPES and (t := meta.tensor(n)) is not None and t.dim() >= 3
             and meta.dim_key(t.shape[-1] * t.shape[-2]) == meta.dim_key(e)]  # fmt: skip
    if not views:
        return 1, 1, 2
    g = int(meta.hint(meta.tensor(views[0]).shape[-2]))
    per_group = [u for v in views for u in v.users if u.target is TOPK or u.target in _MAX
                 or u.op == "call_method" and u.target in ("max", "amax", "topk")]  # fmt: skip
    others = [n for n in nodes if n.target is TOPK and n is not topk and n not in per_group]
    if len(per_group) != 1 or len(others) != 1 or not isinstance(others[0].args[1], int):
        raise Miss(f"the router's groups ({g} of {meta.hint(e) // max(g, 1)} experts) are not ranked by a top-m "
                   "per group and a top-k over the groups", views[0])  # fmt: skip
    m = per_group[0].args[1] if per_group[0].target is TOPK else 1
    if not isinstance(m, int):
        raise Miss("the router's per-group top-m is not a number", per_group[0])
    return g, others[0].args[1], m


# --------------------------------------------------------------------------- proof


class Verdicts:
    """Proof verdicts (None: proven, else the reason) by signature, the oldest dropped past
    ``MAX_VERDICTS``: a model's identical layers are proven once."""

    def __init__(self) -> None:
        self._verdicts: collections.OrderedDict[tuple[Any, ...], str | None] = collections.OrderedDict()

    def get(self, key: tuple[Any, ...], check: Callable[[], str | None]) -> str | None:
        if key not in self._verdicts:
            self._verdicts[key] = check()
            if len(self._verdicts) > MAX_VERDICTS:
                self._verdicts.popitem(last=False)
        return self._verdicts[key]


_VERDICTS = Verdicts()


def _prove(router: Router) -> None:
    verdict = _VERDICTS.get(signature(router.nodes, router.args(), router.weights, router.ids), lambda: _check(router))
    if verdict is not None:
        raise Miss(verdict, router.topk)


def signature(nodes: Sequence[fx.Node], *args: Any) -> tuple[Any, ...]:
    """What a proof's verdict depends on: the ops and literal arguments of ``nodes``, with its
    own nodes by index and its inputs by dtype, device, (hinted) shape and, for a small
    parameter not all zero, value; ``args`` likewise."""
    index = {n: i for i, n in enumerate(nodes)}

    def norm(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return tuple(norm(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, norm(v)) for k, v in a.items())
        if not isinstance(a, fx.Node):
            return repr(a)
        if a in index:
            return ("node", index[a])
        t = meta.tensor(a)
        if t is None:
            return ("scalar", repr(meta.hint(meta.value(a))))
        real = real_value(a)
        return ("input", t.dtype, t.device.type, tuple(repr(meta.hint(d)) for d in t.shape),
                None if real is None else tuple(real.tolist()))  # fmt: skip

    return tuple((n.op, str(n.target), norm(n.args), norm(n.kwargs)) for n in nodes), norm(args)


def real_value(n: fx.Node) -> torch.Tensor | None:
    """A small parameter's or buffer's value (a bias), if the graph holds it and it is not all zero."""
    while n.op == "call_function" and n.target is CAST or n.op == "call_method" and n.target in ("squeeze", "to"):
        n = n.args[0]
    real = n.meta.get("fxr_param", n.meta.get("fxr_buffer")) if n.op == "placeholder" else None
    if isinstance(real, torch.Tensor) and real.numel() <= 4096 and bool(real.detach().ne(0).any()):
        return real.detach().float().reshape(-1)
    return None


def sample_logits(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Logits of ``t``'s shape (hinted) and dtype, no two of a row equal (exactly, in any float
    dtype: steps of a power of two), centred on 0."""
    shape = tuple(int(meta.hint(d)) for d in t.shape)
    rows = int(torch.tensor(shape[:-1]).prod()) if len(shape) > 1 else 1
    order = torch.rand((rows, shape[-1]), generator=gen).argsort(dim=-1).float()
    step = 2.0 ** -max(0, (shape[-1] // 8).bit_length())
    return ((order - shape[-1] / 2) * step).reshape(shape).to(t.dtype)


def sample_bias(n: fx.Node, gen: torch.Generator) -> torch.Tensor:
    """The model's bias where it is not all zero, else a random one as large as a step of
    :func:`sample_logits`' scores (so that it changes the choice)."""
    t = meta.tensor(n)
    real = real_value(n)
    if real is not None:
        return real.reshape(tuple(int(meta.hint(d)) for d in t.shape)).to(t.dtype)
    return (torch.randn(tuple(int(meta.hint(d)) for d in t.shape), generator=gen) * 0.25).to(t.dtype)


def _check(router: Router) -> str | None:
    sub, inputs = extract_nodes(list(router.nodes), [router.weights, router.ids])
    gen = torch.Generator().manual_seed(0)
    values = []
    for n in inputs:
        t = meta.tensor(n)
        values.append(sample_logits(t, gen) if n is router.logits else sample_bias(n, gen) if t is not None
                      else meta.hint(meta.value(n)))  # fmt: skip
    try:
        with torch.no_grad():
            want_w, want_ids = sub(*[v.clone() if isinstance(v, torch.Tensor) else v for v in values])
            got_w, got_ids = moe_route_reference(*[values[inputs.index(a)] if isinstance(a, fx.Node) else a
                                                   for a in router.args()])  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the router as bound does not run: it is not one
        return f"the router does not run as fxr.moe_route({router.describe()}): {type(e).__name__}: {e}"
    if router.dense:
        got = densify(got_w, got_ids, want_w.shape[-1]).to(want_w.dtype)
        why = agrees(got, want_w, lambda: None)
        return None if why is None else f"the router's weights are not fxr.moe_route({router.describe()})'s: {why}"
    return compare_routing(got_w, got_ids, want_w, want_ids, router.describe())


def densify(weights: torch.Tensor, ids: torch.Tensor, experts: int) -> torch.Tensor:
    """``[..., E]`` float32: each token's weights at its ids, zero elsewhere."""
    zeros = weights.new_zeros((*weights.shape[:-1], experts))
    return zeros.scatter(-1, ids, weights)


def compare_routing(got_w: torch.Tensor, got_ids: torch.Tensor, want_w: torch.Tensor, want_ids: torch.Tensor,
                    what: str) -> str | None:  # fmt: skip
    """None if both choose the same experts per token (in any order) with the same weights."""
    if got_ids.shape != want_ids.shape or want_w.shape != want_ids.shape:
        return f"the router gives {list(want_w.shape)} weights, fxr.moe_route({what}) {list(got_w.shape)}"
    got_order, want_order = got_ids.sort(dim=-1), want_ids.sort(dim=-1)
    if not torch.equal(got_order.values, want_order.values.to(got_order.values.dtype)):
        return f"the router chooses other experts than fxr.moe_route({what})"
    got = got_w.gather(-1, got_order.indices).to(want_w.dtype)
    want = want_w.gather(-1, want_order.indices)
    why = agrees(got, want, lambda: None)
    return None if why is None else f"the router's weights are not fxr.moe_route({what})'s: {why}"
