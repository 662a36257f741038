"""LayerNorm family: ``fxr::layer_norm``, add + LayerNorm, and its in-place twin.

Each ``*_reference`` function below is the op's spec and its CPU impl; rules that produce these
ops must match exactly the code it spells. Weight and bias are optional (OLMo's LayerNorm has
neither, ``nn.LayerNorm(bias=False)`` no bias).

    # before (nn.LayerNorm, bf16)                     # after
    y = F.layer_norm(x, (64,), w, b, 1e-5)            y = torch.ops.fxr.layer_norm(x, w, b, 1e-5)

    # before (a LayerNorm written out, in float32)
    h = x.float()
    m = h.mean(-1, keepdim=True)
    v = (h - m).pow(2).mean(-1, keepdim=True)
    y = (w.float() * ((h - m) * torch.rsqrt(v + eps))).to(x.dtype)   ->  fxr.layer_norm(x, w, None, eps)

Like ``torch.nn.functional.layer_norm`` on half inputs, the op computes in float32 (float64 for
float64 inputs) and rounds once to the input dtype (``cast_last=True``). ``cast_last=False`` is the
other order model code writes: the normalized value rounded to the input dtype first, then
scaled and shifted in the dtype torch's promotion gives (``w * h.to(x.dtype) + b``).

On CUDA: flashinfer's ``norm.layernorm`` where the call fits it (bf16 rows, float32 weight and
bias both present, rounded once), else our Triton kernel (any float dtype, weight and bias
optional and of any float dtype, rows at any strides, the residual add in the same kernel), else
the reference (:mod:`fxrewrite.runtime.providers`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops.norm import as_rows
from fxrewrite.runtime.providers import Kernel, OpDef

TRITON_LAYER_NORM = "fxrewrite.runtime.triton_layernorm"
"""The ``triton`` provider's module for these ops (its launchers are named as the ops)."""

# --------------------------------------------------------------------------- references (the spec)


def layer_norm_reference(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, cast_last: bool = True
) -> Tensor:
    """LayerNorm over the last dim of ``x`` (any rank >= 1).

    ``h = x.to(promote(x.dtype, float32)); d = h - h.mean(-1, keepdim=True);
    y = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps)``, then

    ``cast_last``: ``y = y * weight + bias`` (each when present) and ``y.to(x.dtype)``: computed
    in float32, rounded once, as ``F.layer_norm`` computes half inputs; dtype ``x.dtype``.
    Otherwise ``y = y.to(x.dtype) * weight + bias``, each step in torch's promoted dtype.
    """
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    d = h - h.mean(-1, keepdim=True)
    y = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps)
    if not cast_last:
        y = y.to(x.dtype)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(x.dtype) if cast_last else y


def fused_add_layer_norm_reference(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, cast_last: bool = True
) -> tuple[Tensor, Tensor]:
    """Returns ``(out, sum)``: ``sum = x + residual; out = layer_norm_reference(sum, weight,
    bias, eps, cast_last)``."""
    total = x + residual
    return layer_norm_reference(total, weight, bias, eps, cast_last), total


def fused_add_layer_norm_inplace_reference(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, cast_last: bool = True
) -> None:
    """``residual <- x + residual; x <- layer_norm_reference(residual, weight, bias, eps,
    cast_last)`` (``x`` and ``residual`` of one dtype, the normed value of that dtype)."""
    residual.add_(x)
    x.copy_(layer_norm_reference(residual, weight, bias, eps, cast_last))


# --------------------------------------------------------------------------- fake impls


def out_dtype(x: Tensor, weight: Tensor | None, bias: Tensor | None, cast_last: bool) -> torch.dtype:
    """The dtype the op returns: ``x``'s when rounded last, else what promotion gives."""
    dtype = x.dtype
    if not cast_last:
        for t in (weight, bias):
            if t is not None:
                dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _layer_norm_fake(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, cast_last: bool = True) -> Tensor:
    return x.new_empty(x.shape, dtype=out_dtype(x, weight, bias, cast_last))


def _fused_add_fake(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                    cast_last: bool = True) -> tuple[Tensor, Tensor]:  # fmt: skip
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    total = x.new_empty(shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    return _layer_norm_fake(total, weight, bias, eps, cast_last), total


def _inplace_fake(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                  cast_last: bool = True) -> None:  # fmt: skip
    return None


# --------------------------------------------------------------------------- kernel constraints

FLASHINFER_ALIGN = 16  # bytes: flashinfer's CuTe kernel assumes 16-byte aligned rows, weight and bias


def flashinfer_check(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, cast_last: bool = True,
                     *, fresh: bool = False) -> str | None:  # fmt: skip
    """flashinfer 0.7.2 ``norm.layernorm(input, gemma, beta, eps)``: bf16 ``[rows, hidden]``
    rows one after another (its CUDA kernel indexes ``row * hidden``), float32 gamma and beta,
    both given, 16-byte aligned; it scales in float32 and rounds once. ``fresh``: ``x`` stands
    for a tensor the op allocates (the sum of the add), whose layout is contiguous."""
    if weight is None or bias is None:
        return "flashinfer needs both weight and bias"
    if not cast_last:
        return "rounded before the scale: flashinfer rounds once"
    if x.dtype != torch.bfloat16:
        return f"dtype {str(x.dtype).removeprefix('torch.')} not bf16"
    for name, t in (("weight", weight), ("bias", bias)):
        if t.dtype != torch.float32:
            return f"{name} dtype {str(t.dtype).removeprefix('torch.')} not float32"
        if t.dim() != 1 or t.shape[0] != x.shape[-1] or t.stride(0) != 1:
            return f"{name} {tuple(t.shape)} is not a contiguous [{x.shape[-1]}] vector"
        if not constraints.is_aligned(t, FLASHINFER_ALIGN):
            return f"{name} address not {FLASHINFER_ALIGN}-byte aligned"
    if reason := constraints.check_same_device(x, weight, bias):
        return reason
    if x.numel() == 0:
        return "empty input"
    if x.shape[-1] * x.element_size() % FLASHINFER_ALIGN:
        return f"row of {x.shape[-1] * x.element_size()} bytes not {FLASHINFER_ALIGN}-byte aligned"
    if not fresh and not x.is_contiguous():
        return "input not contiguous"
    if not fresh and not constraints.is_aligned(x, FLASHINFER_ALIGN):
        return f"input address not {FLASHINFER_ALIGN}-byte aligned"
    return None


def _triton_affine_check(x: Tensor, weight: Tensor | None, bias: Tensor | None, cast_last: bool) -> str | None:
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if reason := constraints.check_float(t):
            return f"{name} {reason}"
        if t.device != x.device:
            return f"{name} on {t.device}, input on {x.device}"
        if t.dim() != 1 or t.shape[0] != x.shape[-1] or t.stride(0) != 1:
            return f"{name} {tuple(t.shape)} is not a contiguous [{x.shape[-1]}] vector"
    # rounded first, the kernel rounds the product to the output dtype: a bias that widens
    # it would have the product rounded to a narrower one
    if not cast_last and weight is not None and torch.promote_types(x.dtype, weight.dtype) != out_dtype(x, weight, bias, False):
        return f"bias {bias.dtype} widens the product of input {x.dtype} and weight {weight.dtype}"  # type: ignore[union-attr]
    return None


def triton_check(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, cast_last: bool = True) -> str | None:
    return constraints.check_strided_rows(x) or _triton_affine_check(x, weight, bias, cast_last)


def triton_add_check(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                     cast_last: bool = True) -> str | None:  # fmt: skip
    """The fused kernel, functional: ``x`` and ``residual`` of one dtype and shape (the sum is
    rounded to it), each at its own strides."""
    if residual.dtype != x.dtype:
        return f"residual {residual.dtype} != input {x.dtype}"
    return constraints.check_strided_rows(x, residual) or _triton_affine_check(x, weight, bias, cast_last)


def triton_inplace_check(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                         cast_last: bool = True) -> str | None:  # fmt: skip
    """:func:`triton_add_check`, and the normed value of ``x``'s dtype (it is written over ``x``)."""
    if (dtype := out_dtype(x, weight, bias, cast_last)) != x.dtype:
        return f"the normed value is {dtype}, written over an input of {x.dtype}"
    return triton_add_check(x, residual, weight, bias, eps, cast_last)


def _flashinfer_add_check(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                          cast_last: bool = True) -> str | None:  # fmt: skip
    # torch adds into a fresh contiguous tensor, which flashinfer then normalizes
    if residual.dtype != x.dtype or residual.shape != x.shape:
        return f"residual {residual.dtype}{tuple(residual.shape)} != input {x.dtype}{tuple(x.shape)}"
    return constraints.check_same_device(x, residual) or flashinfer_check(x, weight, bias, eps, cast_last, fresh=True)


# --------------------------------------------------------------------------- kernels


def flashinfer_layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                          cast_last: bool = True) -> Tensor:  # fmt: skip
    """flashinfer ``norm.layernorm`` on ``x`` viewed as 2D rows (it allocates the output)."""
    rows = as_rows(x)
    assert rows is not None, "flashinfer_check lets only contiguous inputs through"
    out = providers.library("flashinfer.norm").layernorm(rows, weight, bias, eps)
    return out.view(x.shape)


def flashinfer_fused_add(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                         cast_last: bool = True) -> tuple[Tensor, Tensor]:  # fmt: skip
    total = x + residual
    return flashinfer_layer_norm(total, weight, bias, eps, cast_last), total


_FI = "flashinfer.norm"
_triton_kernel = functools.partial(providers.triton_kernel, module=TRITON_LAYER_NORM)


# Measured (bench/bench_ops.py, H100, torch 2.11, 2026-11-25; bench/RESULTS.md): our Triton
# kernel beats flashinfer's at every token count (LayerNorm of [T, 4096] bf16 with float32 affine:
# 2.35 / 2.48 / 3.59 / 5.75 / 30.8 us against 3.05 / 3.10 / 4.23 / 8.37 / 54.5 at T = 1 / 8 / 64 /
# 512 / 4096), so Triton first; flashinfer serves where Triton does not import. For the add, one
# Triton launch against torch's add then flashinfer's norm (2.46 / 48.7 us against 4.24 / 89.3).
LAYER_NORM_KERNELS = (
    _triton_kernel("layer_norm", triton_check),
    Kernel("flashinfer", flashinfer_layer_norm, flashinfer_check, module=_FI),
)
FUSED_ADD_KERNELS = (
    _triton_kernel("fused_add_layer_norm", triton_add_check),
    Kernel("flashinfer", flashinfer_fused_add, _flashinfer_add_check, label="flashinfer+torch", module=_FI),
)
INPLACE_KERNELS = (_triton_kernel("fused_add_layer_norm_", triton_inplace_check),)

# --------------------------------------------------------------------------- the ops

DEFS: tuple[OpDef, ...] = (
    OpDef("layer_norm", layer_norm_reference, _layer_norm_fake, LAYER_NORM_KERNELS),
    OpDef("fused_add_layer_norm", fused_add_layer_norm_reference, _fused_add_fake, FUSED_ADD_KERNELS),
    OpDef("fused_add_layer_norm_", fused_add_layer_norm_inplace_reference, _inplace_fake, INPLACE_KERNELS,
          ("x", "residual")),
)
OPS: tuple[str, ...] = providers.define_all(DEFS)
