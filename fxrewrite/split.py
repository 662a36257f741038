"""Split a rewritten FX graph at its splitting ops (attention) into pieces, and read the pieces.

Fusion happens before; this module cuts the fused graph with
``torch.fx.passes.split_module.split_module(..., keep_original_order=True)`` so that every
splitting op sits alone in its piece and the other pieces keep the original node order::

    before: embed -> norm -> qkv -> sdpa -> o_proj -> norm -> mlp -> qkv -> sdpa -> ...
    after:  submod_0 (embed..qkv) | submod_1 (sdpa) | submod_2 (o_proj..qkv) | submod_3 (sdpa) | ...

The top-level module calls the pieces in order; a value crossing pieces (activations,
Dynamo's SymInts such as ``s0``, ``.item()`` scalars) is an output of the piece that makes it
and an input of those that read it. Splitting pieces run eagerly at run time; the others are
captured as CUDA graphs by ``fxrewrite.runtime.cudagraph``.

A splitting op is given as a python function (``torch.nn.functional.scaled_dot_product_attention``,
the same object as ``torch._C._nn.scaled_dot_product_attention`` that Dynamo records), an
``OpOverloadPacket`` (``torch.ops.mylib.attention`` also matches its overloads), an
``OpOverload`` (``torch.ops.mylib.attention.default`` also matches a node calling the packet)
or a string ``"mylib::attention"`` / ``"mylib.attention.default"``. A configured op absent from
the graph is not an error here: it is listed in ``SplitGraph.missing`` for the caller to judge.

What the CUDA-graph runtime asks of the pieces (host syncs, device transfers, inputs written in
place) lives beside it, in :mod:`fxrewrite.runtime.hazards`.

Example::

    >>> import torch, torch.nn.functional as F
    >>> def f(q, w):
    ...     h = (q @ w).relu()
    ...     return F.scaled_dot_product_attention(h, h, h) * 2
    >>> gm = torch.fx.symbolic_trace(f)
    >>> sg = split_graph(gm, [F.scaled_dot_product_attention])
    >>> [(p.name, p.is_splitting) for p in sg.pieces]
    [('submod_0', False), ('submod_1', True), ('submod_2', False)]
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.split_module import split_module

logger = logging.getLogger(__name__)

SplitOp = Callable[..., Any] | torch._ops.OpOverloadPacket | torch._ops.OpOverload | str


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one positional input of a piece comes from in the top-level graph.

    kind "input": graph placeholder number ``index``; "piece": an output of piece ``index``;
    "attr": a ``get_attr`` of the top-level module (a constant); "const": a literal.
    """

    kind: Literal["input", "piece", "attr", "const"]
    index: int = -1


@dataclasses.dataclass(frozen=True)
class Piece:
    """One submodule of the split graph, in execution order."""

    name: str
    index: int
    is_splitting: bool
    submodule: GraphModule
    num_nodes: int
    sources: tuple[Source, ...]


@dataclasses.dataclass(frozen=True)
class SplitGraph:
    """The split module (callable like the original graph) and its pieces in order.

    ``missing`` lists the configured splitting ops that no node of the graph calls.
    """

    module: GraphModule
    pieces: tuple[Piece, ...]
    missing: tuple[Any, ...]

    def __call__(self, *args: Any) -> Any:
        return self.module(*args)

    @property
    def num_splitting(self) -> int:
        return sum(p.is_splitting for p in self.pieces)

    def summary(self) -> list[dict[str, Any]]:
        """One row per piece: name, splitting or not, node count (for reports and logs)."""
        return [{"name": p.name, "splitting": p.is_splitting, "nodes": p.num_nodes} for p in self.pieces]


def resolve_op(op: SplitOp) -> Any:
    """Turn ``"ns::name[.overload]"`` into its op; other specs are returned as given.

    An unknown string resolves to None (reported as missing by :func:`split_graph`).
    """
    if not isinstance(op, str):
        return op
    ns, _, rest = op.replace("::", ".", 1).partition(".")
    name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, ns), name)
        return getattr(packet, overload) if overload else packet
    except (AttributeError, RuntimeError):
        return None


def target_matches(target: Any, op: Any) -> bool:
    """True when a node calling ``target`` calls the splitting op ``op``."""
    if target is op:
        return True
    if isinstance(op, torch._ops.OpOverloadPacket):
        return isinstance(target, torch._ops.OpOverload) and target.overloadpacket is op
    if isinstance(op, torch._ops.OpOverload):
        return (
            isinstance(target, torch._ops.OpOverloadPacket)
            and op.overloadpacket is target
            and op._overloadname == "default"
        )
    return False


def _matching_ops(node: Node, ops: Sequence[Any]) -> list[Any]:
    return [op for op in ops if target_matches(node.target, op)] if node.op == "call_function" else []


def _call_nodes(graph: torch.fx.Graph) -> Iterable[Node]:
    return (n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr"))


def split_graph(gm: GraphModule, splitting_ops: Sequence[SplitOp]) -> SplitGraph:
    """Split ``gm`` so that every call of a splitting op is alone in its piece.

    With no splitting op in the graph (or ``splitting_ops=()``) the result has one piece:
    the whole graph. Pieces keep the original node order; no piece is empty.
    """
    specs = list(dict.fromkeys(splitting_ops))
    resolved = [resolve_op(op) for op in specs]
    ops = [op for op in resolved if op is not None]
    found: set[int] = set()
    partition: dict[Node, int] = {}
    part, used = 0, False
    for node in _call_nodes(gm.graph):
        matched = _matching_ops(node, ops)
        if not matched:
            partition[node], used = part, True
            continue
        found.update(map(id, matched))
        part += used
        partition[node] = part
        part, used = part + 1, False
    split = split_module(gm, gm, lambda n: partition[n], keep_original_order=True)
    split.graph.lint()

    position = {n: i for i, n in enumerate(split.graph.find_nodes(op="placeholder"))}
    owner: dict[Node, int] = {}
    pieces: list[Piece] = []
    for node in split.graph.find_nodes(op="call_module"):
        sub = getattr(split, str(node.target))
        calls = list(_call_nodes(sub.graph))
        sources = tuple(_source(a, position, owner) for a in node.args)
        owner[node] = len(pieces)
        splitting = any(_matching_ops(n, ops) for n in calls)
        pieces.append(Piece(str(node.target), len(pieces), splitting, sub, len(calls), sources))
    missing = tuple(s for s, r in zip(specs, resolved) if r is None or id(r) not in found)
    logger.debug("split into %d pieces, %d at splitting ops; missing ops: %s", len(pieces),
                 sum(p.is_splitting for p in pieces), missing)
    return SplitGraph(split, tuple(pieces), missing)


def _source(arg: Any, position: dict[Node, int], owner: dict[Node, int]) -> Source:
    if not isinstance(arg, Node):
        return Source("const")
    if arg.op == "placeholder":
        return Source("input", position[arg])
    if arg.op == "get_attr":
        return Source("attr")
    if arg.op == "call_function" and arg.target is operator.getitem:
        arg = arg.args[0]
    if arg.op == "call_module" and arg in owner:
        return Source("piece", owner[arg])
    raise ValueError(f"unexpected node {arg.format_node()} feeding a piece of the split graph")
