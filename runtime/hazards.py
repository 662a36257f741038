"""What CUDA-graph capture cannot hold, read off the pieces before capture; where a capture failed.

Read-only analyses of the pieces :mod:`fxrewrite.split` cuts, for :mod:`fxrewrite.runtime.cudagraph`:

* :func:`find_capture_hazards`: host syncs, copies between host and device (explicit, and the
  implicit ones: a device tensor indexed with a Python list, a device op reading a host tensor, an
  op reading its device value on the host: ``masked_fill``'s), data-dependent shapes. Each is a
  :class:`Hazard` with the op and its source line;
* :func:`read_on_host`: the argument an op reads on the host (``masked_fill``'s value);
* :func:`mutated_placeholders`: inputs a piece writes in place;
* :func:`is_trivial`: a piece that launches nothing (not worth a graph);
* :func:`failing_node`: the node of a piece that raised an exception (a capture that failed).

Example (a device tensor indexed with a Python list, as Falcon's ``fused_qkv[..., [-2], :]``: the
list becomes a host tensor copied to the device on every call, which capture refuses)::

    before capture: %getitem = operator.getitem(%qkv, (Ellipsis, [-2], slice(None, None, None)))
    -> Hazard: "call_function getitem (node getitem): indexes a device tensor with a Python list ..."

``fxrewrite.fold_constants`` turns such lists into device constants at compile time, so a
hazard here means the graph was compiled without that pass or holds a form it does not fold.
"""

from __future__ import annotations

import dataclasses
import operator
import types
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fxrewrite import meta


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
    """Raised before capture (``Config.strict_capture``) when a piece to be captured holds
    :class:`Hazard` s; without it the piece runs eagerly and the report says why."""

    def __init__(self, hazards: Sequence[Hazard]) -> None:
        self.hazards = tuple(hazards)
        body = "\n".join(f"  {h}" for h in hazards)
        super().__init__(
            f"{len(hazards)} op(s) cannot be captured in a CUDA graph (they sync with the host, "
            f"move data between devices or have data-dependent shapes):\n{body}\n"
            "Make them splitting ops (run eagerly), move them out of the model, or use mode='none' "
            "(with strict_capture off, FXREWRITE_STRICT unset, their pieces run eagerly instead)."
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
_INDEXING = (operator.getitem, operator.setitem)
# ops whose tensor overload reads one argument on the host: ATen calls ``.item()`` on the 0-dim
# value (CPU and CUDA kernels alike), a device-to-host copy and sync where it lives on the device
_READ_ON_HOST = {"masked_fill": (2, "value"), "masked_fill_": (2, "value"), "index_fill": (3, "value"),
                 "index_fill_": (3, "value")}  # fmt: skip


def _qualified(target: Any) -> str:
    """"ns::name" of a torch op (OpOverload or OpOverloadPacket), "" for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return ""


def op_name(node: Node) -> str:
    """The op's short name: a method's name, an ATen op's name without namespace, a function's
    ``__name__``."""
    t = node.target
    if node.op == "call_method":
        return str(t)
    return _qualified(t).split("::")[-1] or getattr(t, "__name__", str(t))


def _call_nodes(graph: torch.fx.Graph) -> Iterable[Node]:
    return (n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr"))


def where(node: Node) -> str:
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


def host_lists(index: Any) -> list[list[Any]]:
    """The non-empty Python lists in an index (``x[..., [-2], :]``, ``x[[0, 2]]``): each becomes a
    host tensor that indexing copies to the device on every call."""
    if isinstance(index, list) and index and not any(isinstance(v, (Node, slice, type(...), type(None))) for v in index):
        return [index]
    if isinstance(index, (tuple, list)):
        return [lst for v in index for lst in host_lists(v)]
    return []


def _on_device(value: Any) -> bool:
    return bool(_devices(value) - {"cpu", "meta"})


def read_on_host(node: Node) -> tuple[int | str, Node] | None:
    """The argument of ``node`` that its op reads on the host (its position, or its keyword, and
    the node), where it is a node: the value of ``masked_fill`` and ``index_fill`` (a 0-dim tensor
    is read with ``.item()``). None for other ops and for a number.

        >>> gm = torch.fx.symbolic_trace(lambda x, m, v: x.masked_fill(m, v))
        >>> read_on_host(list(gm.graph.nodes)[3])
        (2, v)
    """
    slot = _READ_ON_HOST.get(op_name(node)) if node.op in ("call_function", "call_method") else None
    if slot is None:
        return None
    pos, key = slot
    where_, arg = (pos, node.args[pos]) if len(node.args) > pos else (key, node.kwargs.get(key))
    return (where_, arg) if isinstance(arg, Node) else None


def _host_tensor_read(node: Node) -> str | None:
    """The name of a host tensor (not a 0-dim scalar, which kernels take by value) that a device
    op reads: the op copies it to the device first, a pageable copy capture refuses."""
    if not _on_device(_value(node)):
        return None
    for a in node.all_input_nodes:
        v = _value(a)
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() > 0 and not _empty(v):
            return a.name
    return None


def _reason(node: Node, host_scalars: Collection[str]) -> str | None:
    name = op_name(node)
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
    if node.op == "call_function" and node.target in _INDEXING and len(node.args) > 1 and (
            _on_device(_value(arg0)) and host_lists(node.args[1])):
        return ("indexes a device tensor with a Python list: a host index tensor is built and copied "
                "to the device on every call (a pageable copy capture forbids)")
    if (read := read_on_host(node)) is not None and _on_device(_value(read[1])):
        return (f"reads its value `{read[1].name}`, a device tensor, on the host (the op calls .item() on it: a "
                "device-to-host copy and sync, which capture forbids; a Python number or a CPU scalar is not copied)")
    if name not in _TRANSFERS and (host := _host_tensor_read(node)) is not None:
        return f"a device op reading the host tensor `{host}`: it is copied to the device first (a pageable copy)"
    symbolic = (torch.Tensor, torch.SymInt, torch.SymBool)  # a SymFloat is a value, not a shape
    if any(free_unbacked_symbols(v) for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, symbolic)):
        return "has a data-dependent shape or value (unbacked symbol)"
    return None


def find_capture_hazards(gm: GraphModule, host_scalars: Collection[str] | None = None) -> list[Hazard]:
    """Every op of ``gm`` that CUDA-graph capture cannot hold, with its source line.

    Flagged: host reads (``.item()``, ``.tolist()``, ``_local_scalar_dense``, ``bool(t)``),
    ops with data-dependent output shapes (``nonzero``, ``masked_select``, ``unique``, any node
    whose example value has an unbacked symbol), syncs (``torch.cuda.synchronize``), printing,
    copies between host and device (``.cpu()``, ``.to("cpu")`` of a device tensor,
    ``.to("cuda")`` / ``torch.tensor(..., device="cuda")`` from host memory), and the copies
    an op makes itself: a device tensor indexed with a Python list (``x[..., [-2], :]``), a
    device op reading a host tensor of one or more dims, and the reverse, ``masked_fill`` /
    ``index_fill`` whose value is a 0-dim device tensor (ATen reads it with ``.item()``, a sync:
    transformers' CPM-Ant fills its scores with ``torch.scalar_tensor(-inf, device=...)``;
    :mod:`fxrewrite.runtime.fold_constants` passes such a value as a number where it is a constant).

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
        Hazard(n.name, f"{n.op} {op_name(n)}", reason, where(n))
        for n in _call_nodes(gm.graph)
        if (reason := _reason(n, host_scalars)) is not None
    ]


def failing_node(gm: GraphModule, error: BaseException) -> Node | None:
    """The node of ``gm`` whose line of the generated ``forward`` raised ``error`` (the innermost
    such frame of its traceback), or None when the error did not pass through that code.

        >>> gm = torch.fx.symbolic_trace(lambda x: (x + 1).tolist().bad)
        >>> try:
        ...     gm.forward(torch.ones(2))
        ... except AttributeError as e:
        ...     failing_node(gm, e).name
        'getattr_1'
    """
    code = type(gm).forward.__code__ if isinstance(type(gm).forward, types.FunctionType) else None
    lineno_map = getattr(gm, "_lineno_map", None)
    if code is None or not lineno_map:
        return None
    found = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            found = lineno_map.get(tb.tb_lineno - code.co_firstlineno)
        tb = tb.tb_next
    return list(gm.graph.nodes)[found] if found is not None else None


_VIEWS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "expand",
          "narrow", "select", "t", "as_strided", "view_as", "unflatten", "unbind", "split",
          "chunk", "slice", "diagonal", "movedim", "getitem", "detach", "alias", "contiguous"}


def is_view(node: Node) -> bool:
    """Whether ``node`` returns a view of (or its first argument) itself: reshapes, slices,
    getitems, ``detach``, ``contiguous``."""
    return node.op in ("call_function", "call_method") and op_name(node) in _VIEWS


def is_trivial(gm: GraphModule) -> bool:
    """True when ``gm`` launches no kernel of its own: only views, getitems and scalar math.

    Such a piece is not worth a CUDA graph (an empty capture is an error on some versions).

        >>> is_trivial(torch.fx.symbolic_trace(lambda x: x.view(-1).transpose(0, 0)))
        True
    """
    for node in _call_nodes(gm.graph):
        name = op_name(node)
        if name in _VIEWS or name in _ITEMS:
            continue
        if ("example_value" in node.meta or "val" in node.meta) and not _devices(_value(node)):
            continue
        return False
    return True


def written_bases(graph: torch.fx.Graph) -> set[Node]:
    """Every node written in place (``meta.written_args``), and each node it views, back to the
    base of the view chain."""
    written: set[Node] = set()
    for node in _call_nodes(graph):
        for base in meta.written_args(node):
            while isinstance(base, Node):
                written.add(base)
                if base.op == "placeholder" or not base.args or not is_view(base):
                    break
                base = base.args[0]
    return written


def mutated_placeholders(gm: GraphModule) -> set[str]:
    """Names of the placeholders that ``gm`` writes in place, directly or through a view.

    Example::

        >>> def f(x, y):
        ...     x[0].add_(1)
        ...     return y + 1
        >>> sorted(mutated_placeholders(torch.fx.symbolic_trace(f)))
        ['x']
    """
    return {n.name for n in written_bases(gm.graph) if n.op == "placeholder"}
