"""Canonical forms of LayerNorm's spellings: the library call and the variance a hand-written
LayerNorm reads. Kept beside :mod:`fxrewrite.canonicalize`, whose pass calls these for the
targets in :data:`NORMALIZERS` (the same ``_Canon`` helpers: ``set`` binds the schema,
``neg_dim`` makes dims negative where ranks are known)::

    %y = call_function[F.layer_norm](%x, (64,), %w, None, eps=1e-05)
        -> %y = aten.layer_norm.default(%x, [64], %w, None, 1e-05, True)
    %v = call_method[var](%h, -1, keepdim=True, unbiased=False)
        -> %v = aten.var.correction(%h, [-1], correction=0, keepdim=True)

* ``F.layer_norm`` / ``torch.layer_norm``, positional or keyword arguments (``nn.LayerNorm`` as
  Dynamo records it is ``F.layer_norm``) -> ``aten.layer_norm.default`` with every argument
  spelled out: the normalized shape a list (``torch.Size([s0])`` of a symbolic size unwrapped), absent weight and bias ``None``, ``cudnn_enable``
  True (it changes nothing but which kernel ATen picks on some devices);
* ``x.var(...)`` / ``torch.var(...)`` over dims -> ``aten.var.correction`` with the correction
  spelled out: ``unbiased=False`` and ``correction=0`` are one form, ``unbiased=True`` and the
  default are ``correction=1``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

LAYER_NORM = torch.ops.aten.layer_norm.default
VAR = torch.ops.aten.var.correction

_LAYER_NORM_ARGS = ("input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable")


def layer_norm(canon: Any, node: fx.Node) -> None:
    """``F.layer_norm`` / ``torch.layer_norm`` -> ``aten.layer_norm.default``, every argument
    bound (see the module docstring)."""
    if len(node.args) > len(_LAYER_NORM_ARGS):
        return None
    args = dict(zip(_LAYER_NORM_ARGS, node.args))
    for name, v in node.kwargs.items():
        if name not in _LAYER_NORM_ARGS or name in args:
            return None  # not a form of layer_norm's signature: kept as written
        args[name] = v
    if "input" not in args or "normalized_shape" not in args:
        return None
    shape = args["normalized_shape"]
    if isinstance(shape, fx.Node) and shape.target is torch.Size and len(shape.args) == 1 and not shape.kwargs:
        shape = shape.args[0]  # x.shape[-1:] under dynamic shapes: torch.Size([s0]) of a symbolic size
    if isinstance(shape, int):
        shape = [shape]
    elif isinstance(shape, (list, tuple)):
        shape = list(shape)
    elif not isinstance(shape, fx.Node):
        return None
    canon.set(node, LAYER_NORM, (args["input"], shape, args.get("weight"), args.get("bias"), args.get("eps", 1e-5), True))
    return None


def var(canon: Any, node: fx.Node) -> None:
    """``var`` over given dims -> ``aten.var.correction(x, dims, correction=c, keepdim=k)``;
    a variance over every value (no dim) is kept as written."""
    x, rest, kwargs = node.args[0], list(node.args[1:]), dict(node.kwargs)
    dim, unbiased = kwargs.pop("dim", None), kwargs.pop("unbiased", None)
    correction, keepdim = kwargs.pop("correction", None), kwargs.pop("keepdim", False)
    if kwargs:
        return None  # out=: kept as written
    if rest and isinstance(rest[0], bool):
        unbiased = rest.pop(0)  # var(x, unbiased)
    elif rest:
        dim = rest.pop(0)
        if rest:
            unbiased = rest.pop(0)
        if rest:
            keepdim = rest.pop(0)
    if rest or dim is None or not isinstance(keepdim, bool):
        return None
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    if not all(isinstance(d, int) for d in dims):
        return None
    if unbiased is not None:
        correction = 1 if unbiased else 0
    elif correction is None:
        correction = 1
    if isinstance(correction, float) and correction.is_integer():
        correction = int(correction)
    canon.set(node, VAR, (x, [canon.neg_dim(x, d) for d in dims]), {"correction": correction, "keepdim": keepdim})
    return None


NORMALIZERS: dict[tuple[str, Any], Callable[[Any, fx.Node], None]] = {
    ("call_function", F.layer_norm): layer_norm,
    ("call_function", torch.layer_norm): layer_norm,
    ("call_function", torch.var): var,
    ("call_method", "var"): var,
}
"""(op, target) of a graph node -> its normalizer, called with the canonicalizing pass and the node."""
