"""Canonical forms of the norms' library calls: LayerNorm's call and the variance a hand-written
LayerNorm reads, and RMSNorm's call decomposed into the arithmetic the RMSNorm rules match.
Kept beside :mod:`fxrewrite.canonicalize`, whose pass calls these for the targets in
:data:`NORMALIZERS` (the same ``_Canon`` helpers: ``set`` binds the schema, ``neg_dim`` makes
dims negative where ranks are known)::

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
  default are ``correction=1``;
* ``F.rms_norm`` / ``torch.rms_norm`` (``nn.RMSNorm``) over the last dim -> the ops of its
  decomposition (:func:`rms_norm`): no ATen RMSNorm op exists for the rules to name, and the
  decomposed form composes with every rule that holds an RMSNorm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxrewrite import meta

LAYER_NORM = torch.ops.aten.layer_norm.default
VAR = torch.ops.aten.var.correction

_LAYER_NORM_ARGS = ("input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable")
_RMS_NORM_ARGS = ("input", "normalized_shape", "weight", "eps")
_RMS_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
A = torch.ops.aten
CAST = torch.ops.prims.convert_element_type.default
ADD, MUL, POW, RSQRT, MEAN = A.add.Tensor, A.mul.Tensor, A.pow.Tensor_Scalar, A.rsqrt.default, A.mean.dim


def _bind(node: fx.Node, names: tuple[str, ...]) -> dict[str, Any] | None:
    """``node``'s arguments by ``names`` (positional or keyword); None for another signature or
    a call without ``input`` and ``normalized_shape``. The normalized shape becomes a list (of
    ints or symbolic sizes), or stays a node when it is one."""
    if len(node.args) > len(names):
        return None
    args = dict(zip(names, node.args))
    for name, v in node.kwargs.items():
        if name not in names or name in args:
            return None  # not a form of the signature: kept as written
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
    args["normalized_shape"] = shape
    return args


def layer_norm(canon: Any, node: fx.Node) -> None:
    """``F.layer_norm`` / ``torch.layer_norm`` -> ``aten.layer_norm.default``, every argument
    bound (see the module docstring)."""
    if (args := _bind(node, _LAYER_NORM_ARGS)) is None:
        return None
    canon.set(node, LAYER_NORM, (args["input"], args["normalized_shape"], args.get("weight"), args.get("bias"),
                                 args.get("eps", 1e-5), True))  # fmt: skip
    return None


def rms_norm(canon: Any, node: fx.Node) -> None:
    """``F.rms_norm`` / ``torch.rms_norm`` over the last dim -> the arithmetic ATen's own
    decomposition of it computes (``torch._decomp``'s ``_fused_rms_norm``), in the canonical ops
    the RMSNorm rules are written in, so every rule that holds an RMSNorm (add + norm, gated,
    quantized, weightless) matches ``nn.RMSNorm`` as it matches the hand-written one::

        h = x.to(float32)                      # elided for a float32 x
        y = (w * (h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)

    ``eps=None`` is float32's machine epsilon, as there. Kept as written: a normalized shape of
    several dims, an input that is not float32, bfloat16 or float16 (float64 computes in
    float64), unknown metadata."""
    if (args := _bind(node, _RMS_NORM_ARGS)) is None:
        return None
    x, shape, weight, eps = args["input"], args["normalized_shape"], args.get("weight"), args.get("eps")
    t = meta.tensor(x)
    if t is None or t.dtype not in _RMS_NORM_DTYPES or not isinstance(shape, list) or len(shape) != 1:
        return None
    if weight is not None and not isinstance(weight, fx.Node):
        return None
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    if not isinstance(eps, (float, int, fx.Node)):  # a node: a Python float Dynamo lifted
        return None
    h = x if t.dtype == torch.float32 else canon.new(node, CAST, (x, torch.float32))
    mean = canon.new(node, MEAN, (canon.new(node, POW, (h, 2)), [-1], True))
    y = canon.new(node, MUL, (h, canon.new(node, RSQRT, (canon.new(node, ADD, (mean, eps)),))))
    if weight is not None:
        y = canon.new(node, MUL, (weight, y))
    if meta.tensor(y).dtype != t.dtype:
        y = canon.new(node, CAST, (y, t.dtype))
    canon.drop(node, y)
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
    ("call_function", F.rms_norm): rms_norm,
    ("call_function", torch.rms_norm): rms_norm,
    ("call_function", torch.var): var,
    ("call_method", "var"): var,
}
"""(op, target) of a graph node -> its normalizer, called with the canonicalizing pass and the node."""
