"""Tensors the graph builds from Python values, evaluated once at compile time.

Model code builds small tensors from literals on every call, and Dynamo records each as a call
that runs every step: transformers' eager attention mask ``torch.tensor(0.0, device=mask.device,
dtype=dtype)`` (5.17; ``torch.zeros((), ...)`` in 5.24), Falcon's ALiBi slopes (``torch.full``,
``torch.arange``, ``torch.pow``), a batch ``torch.arange(1, device=...)``, and Falcon's
``fused_qkv[..., [-2], :]``, whose list index becomes a host tensor that indexing copies to the
device. Each costs a host tensor, an allocation and a launch per call; a host-to-device copy is a
pageable copy, which CUDA-graph capture refuses (:mod:`fxrewrite.runtime.hazards`).

:func:`fold_constants` evaluates them once, on the device the graph runs on, and reads the result
as a graph constant (:func:`fxrewrite.meta.constant_node`; the compile cache stores it as any
folded constant)::

    before: %zeros = torch.zeros((), device=cuda:0, dtype=torch.bfloat16)
            %mask = torch.where(%m, %zeros, -3.4e+38)
    after:  %fxr_const_0 = get_attr[target=fxr_const_0]
            %mask = torch.where(%m, %fxr_const_0, -3.4e+38)

    before: %k = operator.getitem(%qkv, (Ellipsis, [-2], slice(None, None, None)))
    after:  %fxr_const_1 = get_attr[target=fxr_const_1]     # torch.tensor([-2]) on qkv's device
            %k = operator.getitem(%qkv, (Ellipsis, %fxr_const_1, slice(None, None, None)))

A folded 0-dim value read where the op takes a number is given as the number: ``masked_fill``'s
and ``index_fill``'s value (:func:`fxrewrite.runtime.hazards.read_on_host`). Their tensor
overload reads it with ``.item()`` on every call, a device-to-host copy and sync that CUDA-graph
capture refuses ("operation not permitted when stream is capturing"); the number overload is the
same computation (ATen's tensor overload calls it with ``.item()``)::

    before: %scalar_tensor = torch.scalar_tensor(-inf, device=cuda:0, dtype=torch.bfloat16)
            %score_1 = torch.masked_fill(%score, %eq, %scalar_tensor)
    after:  %score_1 = torch.masked_fill(%score, %eq, -inf)

What folds: a creation op whose arguments are all Python values (``torch.tensor``, ``as_tensor``,
``scalar_tensor``, ``full``, ``zeros``, ``ones``, ``arange``, ``linspace``, ``eye``; ``new_*`` of a
tensor and ``*_like`` of one of static shape, which read only its dtype, device and shape), then
casts, views and arithmetic of folded values only (as Dynamo spells them, and as ``canonicalize``
does: any ATen or prims overload that writes nothing and draws no random numbers). What stays: a tensor built from a runtime value
(a SymInt or a tensor the graph computes), of a symbolic size, written in place (through any
view or alias), returned by the graph (a caller could write it), random, uninitialised
(``empty``), or larger than :data:`MAX_BYTES`. Lists of Python ints indexing a tensor (``getitem``
and ``setitem``) become int64 constants on its device: the same advanced indexing, without the copy.

Where it runs: after every rule and fusion pass, before ``cleanup``, in every mode. After the
rules, so they match the graph as the model wrote it (and a replacement that builds a constant is
folded too); in every mode, since run eagerly each folded call is a host tensor, an allocation
and a launch saved per step, and a graph that runs the same in every mode is one to debug.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import free_symbols

from fxrewrite import meta
from fxrewrite.report import PassResult
from fxrewrite.runtime.hazards import host_lists, is_view, op_name, read_on_host

log = logging.getLogger(__name__)

MAX_BYTES = 1 << 20  # a larger constant is memory held for good; built per call it is pool memory

_A = torch.ops.aten
_SOURCES = {torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.full, torch.zeros, torch.ones, torch.arange,
            torch.linspace, torch.eye, _A.scalar_tensor.default, _A.full.default, _A.zeros.default, _A.ones.default,
            _A.arange.default, _A.arange.start, _A.arange.start_step}  # fmt: skip
_LIKE = {torch.zeros_like, torch.ones_like, torch.full_like}  # read the first argument's metadata only
_NEW = {"new_tensor", "new_full", "new_zeros", "new_ones"}  # likewise
# methods that may return their input itself (a no-op cast): an alias, as far as writes go
_CASTS = {"to", "type", "float", "half", "bfloat16", "double", "int", "long", "bool", "cuda", "cpu", "contiguous",
          "detach", "view_as", "type_as"}  # fmt: skip
_PURE_METHODS = _CASTS | {"clone", "add", "sub", "mul", "div", "pow", "neg", "exp", "log", "sqrt", "rsqrt",
                          "reciprocal", "cumsum", "tril", "triu", "masked_fill", "repeat"}  # fmt: skip
_PURE_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
                   operator.pow, operator.neg, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
                   operator.ge, operator.and_, operator.or_, operator.invert, operator.getitem, torch.add, torch.sub,
                   torch.mul, torch.div, torch.pow, torch.neg, torch.exp, torch.log, torch.sqrt, torch.rsqrt,
                   torch.reciprocal, torch.cat, torch.stack, torch.where, torch.cumsum, torch.tril, torch.triu,
                   torch.unsqueeze, torch.reshape, torch.flatten, torch.transpose, torch.permute, torch.masked_fill,
                   torch.ones_like, torch.zeros_like, torch.full_like}  # fmt: skip


def _aliases(node: fx.Node) -> bool:
    """May ``node`` return (a view of) its first argument?"""
    return is_view(node) or (node.op == "call_method" and node.target in _CASTS)


def _unsafe(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value is written in place or returned, and those they alias back to the base:
    a constant shared by every call must be neither."""
    roots = [a for n in graph.nodes for a in meta.written_args(n)] + graph.output_node().all_input_nodes
    unsafe: set[fx.Node] = set()
    for base in roots:
        while isinstance(base, fx.Node) and base not in unsafe:
            unsafe.add(base)
            if not (base.args and _aliases(base)):
                break
            base = base.args[0]
    return unsafe


def _static(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not free_symbols(value)


def _metadata_only(node: fx.Node) -> bool:
    """A creation op reading only its first argument's dtype, device (and shape): ``new_*`` and ``*_like``."""
    return (node.op == "call_method" and node.target in _NEW) or (node.op == "call_function" and node.target in _LIKE)


def _pure_overload(target: Any) -> bool:
    """An ATen or prims overload that writes nothing, draws no random numbers and returns
    initialised memory: what ``canonicalize`` makes of casts, views and arithmetic."""
    return (isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims")
            and not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags
            and "empty" not in target._schema.name)  # fmt: skip


def _foldable_op(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _SOURCES or node.target in _PURE_FUNCTIONS or _pure_overload(node.target)
    return node.op == "call_method" and (node.target in _PURE_METHODS or node.target in _NEW)


def _stand_in(node: fx.Node) -> torch.Tensor | None:
    """A real tensor with the metadata ``new_*`` / ``*_like`` read from ``node`` (its values unread)."""
    v = meta.tensor(node)
    if v is None or not _static(v):
        return None
    try:  # sizes free of symbols may still be SymInts (transformers 5.24's Mistral at decode): as ints
        shape, stride = [int(s) for s in v.shape], [int(s) for s in v.stride()]
        with unset_fake_temporarily():
            return torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)
    except Exception as e:  # noqa: BLE001 - no stand-in: the node stays as written
        log.debug("fold_constants: no stand-in for %s: %s: %s", node.name, type(e).__name__, e)
        return None


class _Folder:
    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm, self.graph = gm, gm.graph
        self.fake_mode = meta.fake_mode_of(gm.graph)
        self.values: dict[fx.Node, torch.Tensor] = {}  # the folded nodes' real values
        self.constants: dict[tuple[Any, ...], fx.Node] = {}
        self.first = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)

    def evaluate(self, node: fx.Node, unsafe: set[fx.Node]) -> None:
        """Fold ``node`` into ``self.values`` when it computes a constant (see the module docstring)."""
        fake = meta.value(node)
        if node in unsafe or not _foldable_op(node) or not _static(fake) or fake.untyped_storage().nbytes() > MAX_BYTES:
            return
        args, kwargs = node.args, node.kwargs
        if _metadata_only(node) and args and isinstance(args[0], fx.Node) and args[0] not in self.values:
            like = _stand_in(args[0])
            if like is None:
                return
            args = (like, *args[1:])
        inputs = _nodes((args, kwargs))
        if any(a not in self.values for a in inputs) or not (inputs or node.target in _SOURCES or _metadata_only(node)):
            return
        args, kwargs = fx.node.map_arg((args, kwargs), self.values.__getitem__)
        try:
            with unset_fake_temporarily(), torch.inference_mode(False), torch.no_grad():
                value = getattr(args[0], node.target)(*args[1:], **kwargs) if node.op == "call_method" else (
                    node.target(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - not evaluable here (a device this process lacks): stays
            log.debug("fold_constants: %s stays: %s: %s", node.name, type(e).__name__, e)
            return
        if (isinstance(value, torch.Tensor) and not value.requires_grad and value.shape == fake.shape
                and value.dtype == fake.dtype and value.device == fake.device):  # fmt: skip
            self.values[node] = value

    def constant(self, value: torch.Tensor) -> fx.Node:
        """One get_attr per distinct value, before the first op (every reader comes after it)."""
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        key = (value.dtype, value.device, tuple(value.shape), tuple(value.stride()), data)
        if key not in self.constants:
            k = 0
            while hasattr(self.gm, f"fxr_const_{k}"):
                k += 1
            with self.graph.inserting_before(self.first):
                self.constants[key] = meta.constant_node(self.gm, f"fxr_const_{k}", value, self.fake_mode)
        return self.constants[key]

    def index_lists(self, node: fx.Node) -> int:
        """Int lists indexing a tensor in ``node`` (getitem / setitem) made constants on its device."""
        x = meta.tensor(node.args[0]) if node.args else None
        if x is None or len(node.args) < 2:
            return 0
        lists = [lst for lst in host_lists(node.args[1]) if all(type(v) is int for v in lst)]
        if not lists:
            return 0
        with unset_fake_temporarily():
            made = {id(lst): self.constant(torch.tensor(lst, dtype=torch.long, device=x.device)) for lst in lists}

        def swap(index: Any) -> Any:
            if id(index) in made:
                return made[id(index)]
            return type(index)(swap(v) for v in index) if isinstance(index, (tuple, list)) else index

        node.args = (node.args[0], swap(node.args[1]), *node.args[2:])
        return len(lists)


def _nodes(args: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(args, out.append)
    return out


_NUMBER_OVERLOADS = {"Tensor": "Scalar", "int_Tensor": "int_Scalar", "Dimname_Tensor": "Dimname_Scalar"}


def _as_numbers(node: fx.Node, value: torch.Tensor, folded: dict[fx.Node, torch.Tensor]) -> int:
    """Give the 0-dim ``value`` of ``node`` as a number to the readers that take one (see the
    module docstring; an ATen overload becomes its number twin, ``masked_fill.Tensor`` ->
    ``masked_fill.Scalar``); how many."""
    made = 0
    for user in list(node.users):
        read = read_on_host(user)
        if user in folded or read is None or read[1] is not node:
            continue
        if isinstance(user.target, torch._ops.OpOverload):
            twin = _NUMBER_OVERLOADS.get(user.target._overloadname)
            overload = getattr(user.target.overloadpacket, twin, None) if twin else None
            if overload is None:
                continue
            user.target = overload
        slot, number = read[0], value.item()
        if isinstance(slot, int):
            user.args = (*user.args[:slot], number, *user.args[slot + 1:])
        else:
            user.kwargs = {**user.kwargs, slot: number}
        made += 1
    return made


def fold_constants(gm: fx.GraphModule) -> PassResult:
    """Evaluate the tensors ``gm`` builds from Python values once and read them as constants;
    make int-list indices device constants; pass a folded 0-dim value as a number where the op
    reads it on the host. ``matches``: constants and numbers read where calls were."""
    folder = _Folder(gm)
    if folder.first is None:
        return PassResult()
    unsafe = _unsafe(gm.graph)
    matches = 0
    for node in list(gm.graph.nodes):
        if node.op in ("call_function", "call_method"):
            folder.evaluate(node, unsafe)
        if node.op == "call_function" and node.target in (operator.getitem, operator.setitem) and node not in folder.values:
            matches += folder.index_lists(node)
    folded = folder.values
    for node, value in folded.items():
        if value.dim() == 0:
            matches += _as_numbers(node, value, folded)
        if any(u not in folded for u in node.users):  # the frontier: read by ops that stay
            node.replace_all_uses_with(folder.constant(value), delete_user_cb=lambda u: u not in folded)
            matches += 1
    for node in reversed(list(folded)):
        if not node.users:
            gm.graph.erase_node(node)
    if folded:
        log.debug("fold_constants: %d calls evaluated at compile time, read as %d constants (%s)", len(folded),
                  len(folder.constants), ", ".join(sorted({op_name(n) for n in folded})))
    return PassResult(matches=matches)
