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

Two read-only analyses serve the CUDA-graph runtime: :func:`find_capture_hazards` (host syncs,
device transfers and data-dependent shapes, which capture forbids) and
:func:`mutated_placeholders` (inputs written in place).

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
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Literal

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.fx.passes.split_module import split_module

from fxrewrite import meta

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


# ----------------------------------------------------------------------------------------
# Analyses for CUDA-graph capture.

@dataclasses.dataclass(frozen=True)
class Hazard:
    """An op that cannot run inside CUDA-graph capture, where it comes from and why."""

    node: str
    op: str
    reason: str
    source: str

    def __str__(self) -> str:
        return f"{self.op} (node {self.node}): {self.reason}\n    at {self.source}"


class CaptureHazardError(RuntimeError):
    """Raised before capture when a piece to be captured holds :class:`Hazard` s."""

    def __init__(self, hazards: Sequence[Hazard]) -> None:
        self.hazards = tuple(hazards)
        body = "\n".join(f"  {h}" for h in hazards)
        super().__init__(
            f"{len(hazards)} op(s) cannot be captured in a CUDA graph (they sync with the host, "
            f"move data between devices or have data-dependent shapes):\n{body}\n"
            "Make them splitting ops (run eagerly), move them out of the model, or use mode='none'."
        )


_HOST_METHODS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "nonzero",
                 "synchronize", "pin_memory", "masked_select", "unique"}
_HOST_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "_unique", "_unique2",
             "unique_consecutive", "unique_dim", "equal", "is_nonzero", "allclose", "bincount",
             "argwhere", "repeat_interleave"}
_HOST_FUNCTIONS = {torch.nonzero, torch.masked_select, torch.unique, torch.unique_consecutive,
                   torch.equal, torch.allclose, torch.is_nonzero, torch.bincount, torch.argwhere,
                   torch.cuda.synchronize, torch.cuda.empty_cache, print}
_TRANSFERS = {"to", "cuda", "cpu", "copy_", "_to_copy", "tensor", "as_tensor", "type"}
_ITEMS = {"item", "_local_scalar_dense"}


def _qualified(target: Any) -> str:
    """"ns::name" of a torch op (OpOverload or OpOverloadPacket), "" for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return ""


def _op_name(node: Node) -> str:
    t = node.target
    if node.op == "call_method":
        return str(t)
    return _qualified(t).split("::")[-1] or getattr(t, "__name__", str(t))


def _where(node: Node) -> str:
    """The innermost frame of the node's stack trace: 'File "...", line N, in f | code'."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines()]
    frames = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not frames:
        return "(no stack trace)"
    i = frames[-1]
    return " | ".join(ln for ln in lines[i:i + 2] if ln)


def _value(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else None


def _devices(value: Any) -> set[str]:
    out: set[str] = set()
    torch.utils._pytree.tree_map(
        lambda v: out.add(v.device.type) if isinstance(v, torch.Tensor) else None, value
    )
    return out


def _empty(value: Any) -> bool:
    """A tensor with no elements whatever the symbols (``torch.tensor([], device="cuda")``, as
    transformers' KV caches start): copying it to the device launches nothing."""
    return isinstance(value, torch.Tensor) and any(isinstance(d, int) and d == 0 for d in value.shape)


def _reason(node: Node, host_scalars: Collection[str]) -> str | None:
    name = _op_name(node)
    value = _value(node)
    arg0 = node.args[0] if node.args else None
    if name in _ITEMS:
        if isinstance(arg0, Node) and arg0.op == "placeholder" and arg0.name in host_scalars:
            return None  # a host scalar: read on the CPU at capture, value frozen (checked per call)
        return "reads a device value on the host (sync); its value would be frozen at capture"
    if node.op == "call_method" and name in _HOST_METHODS:
        return "syncs with the host"
    if node.op == "call_function" and (node.target in _HOST_FUNCTIONS or (
            _qualified(node.target).startswith("aten::") and name in _HOST_OPS)):
        return "syncs with the host or has a data-dependent result"
    if name in _TRANSFERS and not _empty(value):  # no bytes move: no copy is launched
        src = {d for a in (*node.args, *node.kwargs.values()) for d in _devices(_value(a))} or {"cpu"}
        involved = src | _devices(value)
        if "cpu" in involved and len(involved) > 1:
            return "copies between host and device (a sync, or a pageable copy capture forbids)"
    symbolic = (torch.Tensor, torch.SymInt, torch.SymBool)  # a SymFloat is a value, not a shape
    if any(free_unbacked_symbols(v) for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, symbolic)):
        return "has a data-dependent shape or value (unbacked symbol)"
    return None


def find_capture_hazards(gm: GraphModule, host_scalars: Collection[str] | None = None) -> list[Hazard]:
    """Every op of ``gm`` that CUDA-graph capture cannot hold, with its source line.

    Flagged: host reads (``.item()``, ``.tolist()``, ``_local_scalar_dense``, ``bool(t)``),
    ops with data-dependent output shapes (``nonzero``, ``masked_select``, ``unique``, any node
    whose example value has an unbacked symbol), syncs (``torch.cuda.synchronize``), printing,
    and copies between host and device (``.cpu()``, ``.to("cpu")`` of a device tensor,
    ``.to("cuda")`` / ``torch.tensor(..., device="cuda")`` from host memory).

    Allowed: ``.item()`` of a placeholder named in ``host_scalars``: Dynamo lifts float module
    attributes (RMSNorm eps, attention scaling) to CPU scalar tensors read with ``.item()``
    under ``dynamic=True``. Reading a CPU tensor does not touch the GPU, but the value becomes
    a kernel argument at capture: the runtime checks it is unchanged at every call. By default
    ``host_scalars`` are the placeholders of ``gm`` holding a one-element CPU tensor.

    Example::

        >>> def f(x):
        ...     return x * x.sum().item()
        >>> [h.op for h in find_capture_hazards(torch.fx.symbolic_trace(f))]
        ['call_method item']
    """
    if host_scalars is None:
        host_scalars = {
            p.name for p in gm.graph.find_nodes(op="placeholder")
            if isinstance(v := _value(p), torch.Tensor) and v.device.type == "cpu"
            and v.numel() == 1
        }
    return [
        Hazard(n.name, f"{n.op} {_op_name(n)}", reason, _where(n))
        for n in _call_nodes(gm.graph)
        if (reason := _reason(n, host_scalars)) is not None
    ]


_VIEWS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "expand",
          "narrow", "select", "t", "as_strided", "view_as", "unflatten", "unbind", "split",
          "chunk", "slice", "diagonal", "movedim", "getitem", "detach", "alias", "contiguous"}
def is_trivial(gm: GraphModule) -> bool:
    """True when ``gm`` launches no kernel of its own: only views, getitems and scalar math.

    Such a piece is not worth a CUDA graph (an empty capture is an error on some versions).

        >>> is_trivial(torch.fx.symbolic_trace(lambda x: x.view(-1).transpose(0, 0)))
        True
    """
    for node in _call_nodes(gm.graph):
        name = _op_name(node)
        if name in _VIEWS or name in _ITEMS:
            continue
        if ("example_value" in node.meta or "val" in node.meta) and not _devices(_value(node)):
            continue
        return False
    return True


def mutated_placeholders(gm: GraphModule) -> set[str]:
    """Names of the placeholders that ``gm`` writes in place, directly or through a view.

    Example::

        >>> def f(x, y):
        ...     x[0].add_(1)
        ...     return y + 1
        >>> sorted(mutated_placeholders(torch.fx.symbolic_trace(f)))
        ['x']
    """
    mutated: set[str] = set()
    for node in _call_nodes(gm.graph):
        for base in meta.written_args(node):
            while isinstance(base, Node) and base.op != "placeholder" and base.args and (
                    _op_name(base) in _VIEWS) and isinstance(base.args[0], Node):
                base = base.args[0]
            if isinstance(base, Node) and base.op == "placeholder":
                mutated.add(base.name)
    return mutated
