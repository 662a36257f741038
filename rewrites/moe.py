"""Mixture-of-experts blocks become one ``fxr.moe`` call: the router's softmax and top-k, the
experts and the weighted sum over each token's experts.

    %probs = aten.softmax.int(%logits_f32, -1)               %moe = fxr.moe(%x, %logits, None, None,
    %topk = aten.topk(%probs, 2, -1, True, True)      ->                   %gate_up_proj, %down_proj,
    ... renormalize, sort / gather, grouped_mm or bmm,                     2, True, "silu")
    silu(gate) * up, down GEMM, * weights, scatter, sum ...

    %scores = aten.sigmoid(%logits); ... groups ...          %r = fxr.moe_route(%logits, %bias, 8,
    %ids = aten.topk(%choice, 8)[1]                   ->           "sigmoid", "scores", 8, 4, 2, True, 2.5)
    %w = %scores.gather(1, %ids) ... * 2.5                   %moe = fxr.moe(%x, None, %r[0], %r[1], ...)
    ... experts as above ...

Why a graph pass and not a rule: transformers 5 runs an experts module through
``use_experts_implementation``, and each implementation spells the same function differently:
``batched_mm`` gathers each pair's weights and calls ``bmm``; ``grouped_mm`` sorts the pairs by
expert, counts them with ``histc`` and calls ``grouped_mm`` (bf16) or its own custom op (other
dtypes), then undoes the sort with an in-place ``setitem``; 5.17 adds sentinel masks and an
in-place ``clamp_`` that 5.24 dropped. The eager loop (``for expert in expert_hit``) does not
compile under ``fullgraph=True`` (it iterates over a data-dependent ``nonzero``). A pattern per
spelling would enumerate versions; instead the pass binds the block by its interface and proves
its function:

1. **Routing** (from each ``aten.topk`` over the last dim, :mod:`.moe_router`): the router
   bound by what it computes. A softmax router ``fxr.moe`` computes itself (softmax then top-k,
   renormalized or not, or top-k of the logits then softmax) hands it the logits; any other
   router ``fxr.moe_route`` states (sigmoid, a correction bias, groups, scaling, Llama 4's dense
   scores) is in the block, and ``fxr.moe`` takes that op's weights and ids. A router neither
   can state binds as given routing: the op takes the weights and ids the experts read, and
   the router stays as written (a near miss says why). A router whose experts do not fuse
   becomes ``fxr.moe_route`` alone.
2. **Experts**: walking forward from the routing in graph order, the first floating ``[T, H]``
   value that depends on the ids, the weights and two 3-D weights read from graph inputs is the
   block's output (followed through casts and reshapes that keep ``[T, H]``). Walking back from
   it, the block is every node up to the routing, the two weights, scalars and the ``[T, H]``
   values that do not depend on the routing: the hidden states (wherever the code reshaped
   them). The routing weight scales the experts' input (``weight_input``) when it reaches the
   gate/up GEMM.
3. **Guards**: the block reads nothing else, nothing outside it reads a value inside it, it
   mutates none of its inputs, it holds one activation (SiLU or GELU), the weights are laid
   out as ``[E, 2I, H]`` (gate rows, then up rows) and ``[E, H, I]`` or stored transposed
   (``[E, H, 2I]``, ``[E, I, H]``: the op reads transposed views), and the router chooses
   among as many experts as there are (an extra "no expert" class would hand the op ids out of
   range).
4. **Proof**: the block, copied into a standalone graph, and ``fxr.moe``'s reference run on
   fresh random hidden states and routing (the model's own expert weights, random ones where
   these are all zero or not parameters) and must agree within the dtype's tolerance
   (:func:`fxrewrite.verify.agrees`). Always, whatever ``Config.verify`` says: the structure
   binds the interface, the numbers prove the function (which half is the gate, that the
   weights multiply the down projection once). Verdicts are cached per block signature, so a
   model's identical layers are checked once.

A block that nearly fused (routing and experts' weights found) and failed a guard or the proof
is a near miss with the reason. Shared experts (Qwen2-MoE) are plain MLPs beside the block and
fuse as any MLP does; this pass runs before the activation rules, which would otherwise take
the experts' SiLU-and-mul.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite import meta
from fxrewrite.canonicalize import CAST, CLAMP, GELU, MUL, PERMUTE, SIGMOID, SILU, SLICE, SUM, TOPK
from fxrewrite.canonicalize_shape import RESHAPES
from fxrewrite.passes import SiteFilter
from fxrewrite.report import NearMiss, PassResult, Rejected, Site
from fxrewrite.rewrites import moe_router
from fxrewrite.rewrites.moe_router import writes
from fxrewrite.runtime.ops.moe import moe_reference
from fxrewrite.runtime.ops.moe_route import moe_route_reference
from fxrewrite.verify import agrees, extract_nodes, run_float64

RULE = "moe"
ROUTE_RULE = "moe_route"  # a router fused alone (its experts not)
MAX_BLOCK_NODES = 400
"""Most nodes a block may hold (the backward walk gives up beyond: it left the block)."""

# Ops that pass a [T, H] output on unchanged but for dtype and layout (a top-1 block's sum over
# its one slot included): the block's output is followed through them.
_PASS_THROUGH = frozenset({CAST, *RESHAPES, SUM, torch.ops.aten.squeeze.dim, torch.ops.aten.unsqueeze.default})
_PASS_THROUGH_METHODS = frozenset({"view", "reshape", "squeeze", "unsqueeze", "contiguous"})
# Views that lead from a 3-D weight graph input to the GEMM that reads it.
_WEIGHT_VIEWS = frozenset({PERMUTE, torch.ops.aten.transpose.int})
_WEIGHT_VIEW_METHODS = frozenset({"transpose", "permute", "t", "contiguous"})


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a block is routed. ``router`` set: ``fxr.moe_route`` routes (the router's region is in
    the block); ``logits`` set: ``fxr.moe`` routes (softmax, ``renormalize`` as bound); else the
    op reads ``weights`` and ``ids``, the values the experts read."""

    topk: fx.Node
    ids: fx.Node
    weights: fx.Node
    top_k: int
    logits: fx.Node | None = None
    renormalize: bool = False
    scores: tuple[fx.Node, ...] = ()  # the router's nodes (in the block)
    router: moe_router.Router | None = None

    @property
    def inputs(self) -> tuple[fx.Node, ...]:
        if self.router is not None:
            r = self.router
            return (r.logits,) if r.bias is None else (r.logits, r.bias)
        return (self.logits,) if self.logits is not None else (self.weights, self.ids)

    def describe(self) -> str:
        if self.router is not None:
            return f"fxr.moe_route({self.router.describe()})"
        return "logits" if self.logits is not None else "given weights"


@dataclasses.dataclass(frozen=True)
class Block:
    """A bound MoE block: its nodes in graph order (``output`` last) and the op's arguments."""

    routing: Routing
    nodes: list[fx.Node]
    output: fx.Node
    x: fx.Node
    w_gate_up: fx.Node
    w_down: fx.Node
    activation: str
    transposed: bool = False  # the weights are stored [E, H, 2I] / [E, I, H]: the op reads transposed views
    weight_input: bool = False  # the routing weight scales the experts' input (reaches the gate/up GEMM)
    b_gate_up: fx.Node | None = None  # [E, 2I], added to the gate/up GEMM's output
    b_down: fx.Node | None = None  # [E, H], added to the down GEMM's output
    interleaved: bool = False  # gate and up rows alternate
    alpha: float = 1.702  # the clamped SwiGLU's
    limit: float = 7.0

    def args(self, weights: Any = None, ids: Any = None, experts: tuple[Any, Any] | None = None) -> tuple[Any, ...]:
        """``fxr.moe``'s arguments; with a router, ``weights`` and ``ids`` are its outputs;
        ``experts``: the expert weights as the op reads them (the views of transposed storage)."""
        r = self.routing
        if r.router is not None:
            given = (None, weights, ids)
        else:
            given = (None, r.weights, r.ids) if r.logits is None else (r.logits, None, None)
        w_gate_up, w_down = experts or (self.w_gate_up, self.w_down)
        return (self.x, *given, w_gate_up, w_down, r.top_k, r.renormalize, self.activation, self.weight_input,
                self.b_gate_up, self.b_down, self.interleaved, self.alpha, self.limit)  # fmt: skip

    def describe(self) -> str:
        r = self.routing
        layout = "".join(f", {name}" for name, on in (
            ("transposed weights", self.transposed), ("weight on the input", self.weight_input),
            ("biases", self.b_gate_up is not None or self.b_down is not None), ("interleaved", self.interleaved)) if on)
        return f"({r.describe()}, top_k={r.top_k}, renormalize={r.renormalize}, {self.activation}{layout})"


_Miss = moe_router.Miss


# --------------------------------------------------------------------------- the pass


def fuse_moe(gm: fx.GraphModule, site_filter: SiteFilter | None = None) -> PassResult:
    """Replace every MoE block of ``gm`` by ``fxr.moe`` (see the module docstring), and every
    router whose experts do not fuse by ``fxr.moe_route``. A proven block is offered to
    ``site_filter`` first (its router's ``topk`` names it): a reason refuses it, and the block
    stays as written (reported as rejected, not as a near miss)."""
    result = PassResult()
    fake_mode = meta.fake_mode_of(gm.graph)
    moe_router.number(gm.graph)
    for topk in [n for n in meta.outside_transforms(gm.graph) if n.op == "call_function" and n.target is TOPK]:
        if topk.graph is None:
            continue  # erased with an earlier block
        router: moe_router.Router | None = None
        router_miss: _Miss | None = None
        try:
            router = moe_router.bind(topk)
        except _Miss as e:
            router_miss = e
        miss: _Miss | None = None
        fused: Block | None = None
        refused = False
        for routing in _routings(topk, router):
            try:
                block = _bind(gm, routing)
                if block is None:
                    break  # no experts here: not a MoE block
                _prove(gm, block)
            except _Miss as e:
                miss = miss or e  # the first reading's reason: the richest routing
                continue
            miss = None
            refusal = site_filter(topk, block.nodes) if site_filter is not None else None
            if refusal is None:
                _replace(gm.graph, block, fake_mode, result)
                fused = block
            else:
                result.rejected.append(Rejected(RULE, topk.name, meta.source_line(topk), refusal))
                refused = True
            break
        given = fused is not None and fused.routing.router is None and fused.routing.logits is None
        if router is not None and not refused and (fused is None or given):
            refusal = site_filter(topk, list(router.nodes)) if site_filter is not None and fused is None else None
            if refusal is None:
                _replace_router(gm.graph, router, fake_mode, result)
            else:
                result.rejected.append(Rejected(ROUTE_RULE, topk.name, meta.source_line(topk), refusal))
        for why, rule in ((router_miss, ROUTE_RULE), (miss, RULE)):
            if why is not None:  # the experts' miss names the module around the router and the experts
                module = meta.module_path(topk) if rule == ROUTE_RULE else meta.common_module((topk, why.at))
                result.near_misses.append(NearMiss(rule, topk.name, meta.source_line(topk), why.at.name, why.reason,
                                                   module or meta.module_path(topk)))  # fmt: skip
    return result


def _pos(n: fx.Node) -> int:
    return moe_router.position(n)


# --------------------------------------------------------------------------- routing


def _routings(topk: fx.Node, router: moe_router.Router | None) -> list[Routing]:
    """The readings of ``topk`` as a router, the richest first: ``fxr.moe`` routing from the
    logits (softmax routers), ``fxr.moe_route`` routing (any router bound), then as given
    weights and ids (the router stays, or becomes ``fxr.moe_route`` on its own)."""
    if router is None:
        sel = moe_router.selection(topk)
        return [] if sel is None else [Routing(topk, sel.ids, sel.weights, topk.args[1])]
    r, k = router, router.top_k
    readings = []
    if r.plain:
        readings.append(Routing(topk, r.ids, r.weights, k, r.logits, r.renormalize, r.nodes))
    readings.append(Routing(topk, r.ids, r.weights, k, scores=r.nodes, router=r))
    readings.append(Routing(topk, r.ids, r.weights, k))
    return readings


# --------------------------------------------------------------------------- experts


def _bind(gm: fx.GraphModule, routing: Routing) -> Block | None:
    """The block ``routing`` feeds, checked against the guards; None when no experts read it."""
    t = meta.tensor(routing.ids)
    if t is None or t.dim() < 2:
        return None
    if routing.router is None and routing.logits is None and not meta.same_shape(routing.weights, routing.ids):
        raise _Miss(f"the experts read weights {list(meta.tensor(routing.weights).shape)} beside ids "
                    f"{list(t.shape)}: not given routing fxr.moe takes", routing.weights)  # fmt: skip
    tokens = functools.reduce(operator.mul, t.shape[:-1])  # [T, k], or [B, S, k]: B * S tokens
    output, weights = _find_output(routing, tokens)
    if output is None:
        return None
    w_gate_up, w_down, transposed = _roles(weights, output)
    hidden_size = meta.tensor(w_down).shape[2 if transposed else 1]
    chosen_among, experts = meta.tensor(routing.topk.args[0]).shape[-1], meta.tensor(w_gate_up).shape[0]
    if meta.dim_key(chosen_among) != meta.dim_key(experts):
        raise _Miss(f"the router chooses among {chosen_among} experts, the experts hold {experts} (an id may be "
                    "out of their range)", routing.topk)  # fmt: skip
    if t.dim() != 2:
        raise _Miss(f"the router routes {list(t.shape)} ids (not [T, k]: the op's routing and its input would "
                    "disagree in shape)", routing.topk)  # fmt: skip
    nodes, reads = _walk_back(output, routing, tokens, hidden_size)
    stops = set(routing.inputs)
    unknown = [n for n in reads if not meta.is_tensor(n) and meta.value(n) is not None and meta.hint(meta.value(n)) is None]
    if unknown:
        raise _Miss(f"the experts run on sizes read from tensors at run time (`{unknown[0].name}`: the tokens "
                    "each expert got), which fxr.moe does not take", output)  # fmt: skip
    missing = [n for n in routing.inputs if n not in reads]
    if missing:
        raise _Miss(f"the experts do not read the routing's `{missing[0].name}`", missing[0])
    hidden = [n for n in reads if n not in stops and _rows(n, tokens, hidden_size)]
    if len(hidden) != 1:
        raise _Miss(f"the experts read {len(hidden)} [T, {hidden_size}] values from before the router, "
                    "not one (the hidden states)", output)  # fmt: skip
    b_gate_up, b_down = _biases(reads, nodes, w_gate_up, w_down, transposed)
    known = (hidden[0], w_gate_up, w_down, b_gate_up, b_down)
    others = [n for n in reads if _tensors(n) and n not in stops and n not in known]
    if others:
        names = ", ".join(f"`{n.name}`" for n in others[:3])
        raise _Miss(f"the experts also read {names}, not hidden states, routing or expert weights", others[0])
    inside = set(nodes)
    for n in nodes:
        outside = [u for u in n.users if u not in inside] if n is not output else []
        if outside:
            raise _Miss(f"`{n.name}` is read outside the MoE block by `{outside[0].name}`", n)
        target = writes(n)
        if target is not None and target not in inside:
            raise _Miss(f"`{n.name}` overwrites the block's input `{target.name}` in place", n)
    activation, alpha, limit = _activation([n for n in nodes if n not in routing.scores], output)
    interleaved = any(n.target is SLICE and n.args[4] == 2 for n in nodes)
    x = meta.tensor(hidden[0])
    if meta.tensor(output).dtype != x.dtype:
        raise _Miss(f"the block returns {meta.tensor(output).dtype}, its input is {x.dtype}", output)
    gemm = next((n for n in nodes if _weight_input(n) is None and any(_weight_input(a) is w_gate_up
                                                                      for a in n.all_input_nodes)), output)  # fmt: skip
    weight_input = routing.weights in moe_router.upstream(gemm, set(nodes) | {routing.weights})
    return Block(routing, nodes, output, hidden[0], w_gate_up, w_down, activation, transposed, weight_input,
                 b_gate_up, b_down, interleaved, alpha, limit)  # fmt: skip


def _activation(nodes: list[fx.Node], output: fx.Node) -> tuple[str, float, float]:
    """(activation, alpha, limit): one SiLU or GELU; or a clamped SwiGLU (``gate.clamp(max=l)``,
    ``up.clamp(-l, l)``, ``gate * sigmoid(gate * alpha)``; the proof checks the rest)."""
    acts = [n for n in nodes if n.target in (SILU, GELU)]
    if len(acts) == 1:
        approximate = acts[0].kwargs.get("approximate", "none")
        return ("silu" if acts[0].target is SILU else "gelu_tanh" if approximate == "tanh" else "gelu"), 1.702, 7.0
    number = (int, float)
    gates = [n for n in nodes if n.target is CLAMP and n.args[1] is None and isinstance(n.args[2], number)]
    ups = [n for n in nodes if n.target is CLAMP and isinstance(n.args[1], number) and isinstance(n.args[2], number)
           and n.args[1] == -n.args[2]]  # fmt: skip
    sigmoids = [n for n in nodes if n.target is SIGMOID and n.args[0].target is MUL and n.args[0].args[0] in gates
                and isinstance(n.args[0].args[1], number)]  # fmt: skip
    if not acts and len(gates) == len(ups) == len(sigmoids) == 1 and gates[0].args[2] == ups[0].args[2]:
        return "clamped_swiglu", float(sigmoids[0].args[0].args[1]), float(gates[0].args[2])
    raise _Miss(f"the experts hold {len(acts)} activations (SiLU or GELU) and no clamped SwiGLU, fxr.moe one", output)


def _biases(reads: list[fx.Node], nodes: list[fx.Node], w_gate_up: fx.Node, w_down: fx.Node,
            transposed: bool) -> tuple[fx.Node | None, fx.Node | None]:  # fmt: skip
    """The experts' biases among the block's graph inputs: ``[E, 2I]`` (gate/up) and ``[E, H]``
    (down); where both have one shape, the one read first is the gate/up's."""
    e, i2, h = map(meta.dim_key, meta.tensor(w_gate_up).shape)
    if transposed:
        i2, h = h, i2
    first = {n: min((_pos(u) for u in n.users if u in set(nodes)), default=0) for n in reads}
    found = sorted((n for n in reads if n.op in ("placeholder", "get_attr") and (t := meta.tensor(n)) is not None
                    and t.dim() == 2 and tuple(map(meta.dim_key, t.shape)) in ((e, i2), (e, h))), key=first.get)  # fmt: skip
    gate_up = next((n for n in found if tuple(map(meta.dim_key, meta.tensor(n).shape)) == (e, i2)), None)
    down = next((n for n in found if n is not gate_up and tuple(map(meta.dim_key, meta.tensor(n).shape)) == (e, h)), None)
    return gate_up, down


def _find_output(routing: Routing, tokens: Any) -> tuple[fx.Node | None, tuple[fx.Node, ...]]:
    """The first floating ``[T, *]`` value after the routing that depends on its ids and weights
    and on two 3-D weight inputs, followed through pass-through ops; and those weights."""
    reads_ids = routing.weights in _downstream({routing.ids}, _pos(routing.weights))  # gathered, densified
    seeds = {routing.ids: (True, False, frozenset()), routing.weights: (reads_ids, True, frozenset())}
    deps: dict[fx.Node, tuple[bool, bool, frozenset[fx.Node]]] = dict(seeds)
    node = routing.topk.next
    while node.op != "output":
        ins = [deps[a] for a in node.all_input_nodes if a in deps]
        if ins and node not in deps:
            weights = frozenset().union(*(d[2] for d in ins), filter(None, map(_weight_input, node.all_input_nodes)))
            if len(weights) > 2:
                return None, ()  # the walk reached the next block's experts
            deps[node] = (any(d[0] for d in ins), any(d[1] for d in ins), weights)
            if deps[node][:2] == (True, True) and len(weights) == 2 and _rows(node, tokens):
                return _follow(node, tokens), tuple(sorted(weights, key=_pos))
        node = node.next
    return None, ()


def _weight_input(n: fx.Node) -> fx.Node | None:
    """The 3-D floating graph input (parameter) that ``n`` is, a view of, or one expert of
    (``w[i]``: experts run one by one), else None."""
    while (n.op == "call_function" and (n.target in _WEIGHT_VIEWS or n.target is operator.getitem
                                        and isinstance(n.args[1], int))
           or n.op == "call_method" and n.target in _WEIGHT_VIEW_METHODS):  # fmt: skip
        n = n.args[0]
    t = meta.tensor(n)
    ok = n.op in ("placeholder", "get_attr") and t is not None and t.dim() == 3 and t.dtype.is_floating_point
    return n if ok else None


def _rows(n: fx.Node, tokens: Any, width: Any = None) -> bool:
    """``n`` is a floating ``[T, *]`` value (``[T, width]`` when given)."""
    t = meta.tensor(n)
    return (t is not None and t.dim() == 2 and t.dtype.is_floating_point and meta.dim_key(t.shape[0]) == meta.dim_key(tokens)
            and (width is None or meta.dim_key(t.shape[1]) == meta.dim_key(width)))  # fmt: skip


def _follow(n: fx.Node, tokens: Any) -> fx.Node:
    """The last ``[T, *]`` value on the chain of single readers of ``n`` through pass-through ops
    (the sum's cast back to the input dtype; a top-1 block's view and sum over its one slot)."""
    best = n
    while len(n.users) == 1:
        u = next(iter(n.users))
        passes = (u.op == "call_function" and u.target in _PASS_THROUGH) or (
            u.op == "call_method" and u.target in _PASS_THROUGH_METHODS)  # fmt: skip
        if not passes or sum(1 for a in u.all_input_nodes if meta.is_tensor(a)) != 1:
            break
        n = u
        best = n if _rows(n, tokens) else best
    return best


def _walk_back(output: fx.Node, routing: Routing, tokens: Any, hidden_size: Any) -> tuple[list[fx.Node], list[fx.Node]]:
    """The block's nodes (graph order) and what it reads: back from ``output`` to the routing's
    inputs, graph inputs, scalars, and ``[T, H]`` values that do not depend on the routing (the
    hidden states, wherever the code reshaped them)."""
    stops = set(routing.inputs)
    routed = _downstream(stops, _pos(output))
    nodes: set[fx.Node] = set()
    reads: list[fx.Node] = []
    stack = [output]
    while stack:
        n = stack.pop()
        if n in nodes or n in reads:
            continue
        computes = _tensors(n) or writes(n) is not None
        hidden = n not in routed and _rows(n, tokens, hidden_size)
        if n in stops or n.op in ("placeholder", "get_attr") or not computes or hidden:
            reads.append(n)
            continue
        nodes.add(n)
        if len(nodes) > MAX_BLOCK_NODES:
            raise _Miss(f"the experts' block grows past {MAX_BLOCK_NODES} nodes", output)
        stack.extend(n.all_input_nodes)
        stack.extend(u for u in n.users if writes(u) is n)  # writes into it (``inv[perm] = arange``)
    return sorted(nodes, key=_pos), reads


def _downstream(sources: set[fx.Node], last: int) -> set[fx.Node]:
    """``sources`` and every node up to position ``last`` that reads them, transitively."""
    seen = set(sources)
    stack = list(sources)
    while stack:
        for u in stack.pop().users:
            if u not in seen and _pos(u) <= last:
                seen.add(u)
                stack.append(u)
    return seen


def _roles(weights: Sequence[fx.Node], output: fx.Node) -> tuple[fx.Node, fx.Node, bool]:
    """(gate_up, down, transposed) among the two weights: ``[E, 2I, H]`` and ``[E, H, I]``, or
    stored transposed, ``[E, H, 2I]`` and ``[E, I, H]``; else a miss naming the layout."""
    for a, b in (weights, tuple(reversed(weights))):
        (e, i2, h), down = (tuple(map(meta.dim_key, meta.tensor(w).shape)) for w in (a, b))
        if isinstance(i2, int) and i2 % 2 == 0 and down == (e, h, i2 // 2):
            return a, b, False
        if isinstance(h, int) and h % 2 == 0 and down == (e, h // 2, i2):
            return a, b, True
    shapes = " and ".join(str(tuple(meta.tensor(w).shape)) for w in weights)
    (e, a, b), other = (tuple(map(meta.dim_key, meta.tensor(w).shape)) for w in weights)
    kind = " (one projection in, one out: experts without a gate)" if other in ((e, b, a), (e, a, b)) else ""
    raise _Miss(f"expert weights {shapes} are not [E, 2I, H] and [E, H, I], nor stored transposed{kind}", output)


def _tensors(n: fx.Node) -> bool:
    """``n`` computes a tensor, or several (``topk``, ``sort``)."""
    v = meta.value(n)
    return isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v))


# --------------------------------------------------------------------------- proof


_VERDICTS = moe_router.Verdicts()


def _prove(gm: fx.GraphModule, block: Block) -> None:
    """Run the block and ``fxr.moe``'s reference (after ``fxr.moe_route``'s, with a router) on
    the same fresh inputs; a miss unless they agree (one verdict per block signature)."""
    route = block.routing.router.args() if block.routing.router is not None else ()
    key = moe_router.signature(block.nodes, block.args(), route)
    verdict = _VERDICTS.get(key, lambda: _check(gm, block))
    if verdict is not None:
        raise _Miss(verdict, block.output)


def _check(gm: fx.GraphModule, block: Block) -> str | None:
    sub, inputs = extract_nodes(block.nodes, [block.output])
    gen = torch.Generator().manual_seed(0)
    values = [_sample(gm, n, block, gen) for n in inputs]

    def value(a: Any) -> Any:
        return values[inputs.index(a)] if isinstance(a, fx.Node) else a

    try:
        return _compare(sub, values, value, block)
    except Exception as e:  # noqa: BLE001 - a block that does not run as bound is not one
        return f"the block does not run as fxr.moe{block.describe()}: {type(e).__name__}: {e}"


def _compare(sub: fx.GraphModule, values: list[Any], value: Callable[[Any], Any], block: Block) -> str | None:
    """The block run on ``values`` against the op's reference on the same inputs (``value`` of
    each argument)."""
    router = block.routing.router
    with torch.no_grad():  # the block mutates none of its inputs (checked): run it on them
        want = sub(*values)[0]
        routed: tuple[Any, Any] = (None, None)
        if router is not None:  # the weights rounded as the code rounds them
            w, ids = moe_route_reference(*map(value, router.args()))
            routed = (w.to(meta.tensor(router.weights).dtype), ids)
        experts = tuple(value(w).transpose(1, 2) if block.transposed else value(w)
                        for w in (block.w_gate_up, block.w_down))  # fmt: skip
        got = moe_reference(*map(value, block.args(*routed, experts=experts)))
    why = agrees(got, want, lambda: (run_float64(sub, values) or [None])[0])
    return None if why is None else f"the block does not compute fxr.moe{block.describe()}: {why}"


def _sample(gm: fx.GraphModule, n: fx.Node, block: Block, gen: torch.Generator) -> Any:
    """A value for the block's input ``n``: the model's expert weights (random where all zero or
    not parameters), random hidden states, routing of distinct experts per token, hints for sizes."""
    t = meta.tensor(n)
    if t is None:
        return meta.hint(meta.value(n))
    shape = tuple(int(meta.hint(d)) for d in t.shape)
    device = t.device if t.device.type != "meta" else torch.device("cpu")
    if n in (block.w_gate_up, block.w_down, block.b_gate_up, block.b_down):
        real = n.meta.get("fxr_param") if n.op == "placeholder" else getattr(gm, str(n.target), None)
        if isinstance(real, torch.Tensor) and bool(real.detach().ne(0).any()):
            return real.detach()
        return (torch.randn(shape, generator=gen) / shape[-1] ** 0.5).to(t.dtype).to(device)
    r = block.routing
    logits = r.router.logits if r.router is not None else r.logits
    if n is logits:  # distinct per row, exactly representable: ties would leave top-k to chance
        return moe_router.sample_logits(t, gen).to(device)
    if r.router is not None and n is r.router.bias:
        return moe_router.sample_bias(n, gen).to(device)
    experts = meta.tensor(block.w_gate_up).shape[0]
    order = torch.rand((shape[0], int(meta.hint(experts))), generator=gen).argsort(dim=-1)
    if n is r.ids:
        return order[:, : shape[-1]].to(t.dtype).to(device)
    if n is r.weights:
        return (torch.rand(shape, generator=gen) + 0.1).to(t.dtype).to(device)
    return torch.randn(shape, generator=gen).to(t.dtype).to(device)


# --------------------------------------------------------------------------- replace


def _replace(graph: fx.Graph, block: Block, fake_mode: Any, result: PassResult) -> None:
    routed: tuple[Any, Any] = (None, None)
    with graph.inserting_before(block.output):
        if block.routing.router is not None:
            routed = _route_call(graph, block.routing.router, fake_mode, _pos(block.output))
        experts = (block.w_gate_up, block.w_down)
        if block.transposed:  # the op reads [E, 2I, H] / [E, H, I]: views of the stored weights
            experts = tuple(graph.call_function(torch.ops.aten.transpose.int, (w, 1, 2)) for w in experts)
            for view in experts:
                _finish(view, block.routing.topk, RULE, _pos(block.output), fake_mode)
        node = graph.call_function(torch.ops.fxr.moe.default, block.args(*routed, experts=experts))
    _finish(node, block.routing.topk, RULE, _pos(block.output), fake_mode)
    block.output.replace_all_uses_with(node)
    for n in reversed(block.nodes):
        graph.erase_node(n)
    result.matches += 1
    module = meta.common_module((block.routing.topk, block.output))
    result.sites.append(Site(RULE, node.name, meta.source_line(block.routing.topk), module,
                             note=block.describe().strip("()")))  # fmt: skip


def _route_call(graph: fx.Graph, router: moe_router.Router, fake_mode: Any, pos: int,
                rounded: bool = True) -> tuple[fx.Node, fx.Node]:  # fmt: skip
    """``fxr.moe_route`` on the router's arguments at the insert point: (weights, ids) nodes; the
    weights cast to the dtype the code gives them (``rounded``), else float32."""
    route = graph.call_function(torch.ops.fxr.moe_route.default, router.args())
    _finish(route, router.topk, ROUTE_RULE, pos, fake_mode)
    picks = []
    for i in (0, 1):
        picks.append(graph.call_function(operator.getitem, (route, i)))
        _finish(picks[-1], router.topk, ROUTE_RULE, pos, fake_mode)
    dtype = meta.tensor(router.weights).dtype
    if rounded and dtype != torch.float32:
        picks[0] = graph.call_function(CAST, (picks[0], dtype))
        _finish(picks[0], router.topk, ROUTE_RULE, pos, fake_mode)
    return picks[0], picks[1]


def _finish(node: fx.Node, anchor: fx.Node, rule: str, pos: int, fake_mode: Any) -> None:
    meta.copy_provenance(anchor, node)
    node.meta["fxr_rule"] = rule
    node.meta[moe_router.POS] = pos
    meta.propagate(node, fake_mode)


def _replace_router(graph: fx.Graph, router: moe_router.Router, fake_mode: Any, result: PassResult) -> None:
    """The router alone becomes ``fxr.moe_route``: its weights (cast to the dtype the code gave
    them) and ids replace the region's, which is erased."""
    outside = [u for n in (router.weights, router.ids) for u in n.users if u not in router.nodes]
    first = min(outside, key=_pos) if outside else router.ids.next
    pos = _pos(first)
    with graph.inserting_before(first):
        weights, ids = _route_call(graph, router, fake_mode, pos, rounded=False)
        if router.dense:  # zero but at the ids
            zeros = graph.call_function(torch.ops.aten.zeros_like.default, (router.logits,), {"dtype": torch.float32})
            weights = graph.call_function(torch.ops.aten.scatter.src, (zeros, -1, ids, weights))
            for n in (zeros, weights):
                _finish(n, router.topk, ROUTE_RULE, pos, fake_mode)
        dtype = meta.tensor(router.weights).dtype
        if dtype != torch.float32:
            weights = graph.call_function(CAST, (weights, dtype))
            _finish(weights, router.topk, ROUTE_RULE, pos, fake_mode)
    router.weights.replace_all_uses_with(weights)
    router.ids.replace_all_uses_with(ids)
    for n in reversed(router.nodes):
        graph.erase_node(n)
    result.matches += 1
    result.sites.append(Site(ROUTE_RULE, ids.args[0].name, meta.source_line(router.topk), meta.module_path(router.topk),
                             note=router.describe()))  # fmt: skip
