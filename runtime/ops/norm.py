"""RMSNorm family: ``fxr::rms_norm``, ``gemma_rms_norm``, add + RMSNorm, and in-place twins.

Each ``*_reference`` function below is the op's spec and its CPU impl; rules that produce these
ops must match exactly the code it spells. On CUDA the op runs sgl-kernel or flashinfer when the
call meets their constraints (:mod:`fxrewrite.runtime.providers`).

    # before (HF LlamaRMSNorm)                        # after
    h = x.to(torch.float32)                           y = torch.ops.fxr.rms_norm(x, w, eps)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = w * h.to(x.dtype)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from fxrewrite.runtime import providers
from fxrewrite.runtime.providers import Kernel, OpDef

NormFn = Callable[[Tensor, Tensor, float], Tensor]

# --------------------------------------------------------------------------- references (the spec)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF Llama RMSNorm over the last dim of ``x`` (any rank >= 1); dtype ``promote(weight, x)``.

    ``h = x.float(); h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps);
    return weight * h.to(x.dtype)``
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def gemma_rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma RMSNorm (scale ``1 + weight``, all in float32); dtype ``x.dtype``.

    ``h = x.float(); h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps);
    return (h * (1.0 + weight.float())).to(x.dtype)``
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def add_then_norm(
    norm: NormFn, x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``sum = x + residual; return norm(sum, weight, eps), sum`` (shared by spec and kernels)."""
    total = x + residual
    return norm(total, weight, eps), total


def add_then_norm_(norm: NormFn, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In place, sgl-kernel semantics: ``residual += x; x[:] = norm(residual, weight, eps)``."""
    residual.add_(x)
    x.copy_(norm(residual, weight, eps))


def fused_add_rms_norm_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Returns ``(out, sum)``: ``sum = x + residual; out = rms_norm_reference(sum, weight, eps)``."""
    return add_then_norm(rms_norm_reference, x, residual, weight, eps)


def gemma_fused_add_rms_norm_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Returns ``(out, sum)``: ``sum = x + residual; out = gemma_rms_norm_reference(sum, weight, eps)``."""
    return add_then_norm(gemma_rms_norm_reference, x, residual, weight, eps)


def fused_add_rms_norm_inplace_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> None:
    """``residual <- x + residual; x <- rms_norm_reference(residual, weight, eps)`` (same dtypes)."""
    add_then_norm_(rms_norm_reference, x, residual, weight, eps)


def gemma_fused_add_rms_norm_inplace_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> None:
    """``residual <- x + residual; x <- gemma_rms_norm_reference(residual, weight, eps)``."""
    add_then_norm_(gemma_rms_norm_reference, x, residual, weight, eps)


# --------------------------------------------------------------------------- fake impls


def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


def _gemma_rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape)


def fake_sum(x: Tensor, residual: Tensor) -> Tensor:
    """A fake ``x + residual``."""
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    return x.new_empty(shape, dtype=torch.promote_types(x.dtype, residual.dtype))


def _fused_add_fake(
    norm_fake: NormFn, x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    total = fake_sum(x, residual)
    return norm_fake(total, weight, eps), total


def _inplace_fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    return None


# --------------------------------------------------------------------------- kernel constraints


def as_rows(x: Tensor) -> Tensor | None:
    """``x`` as a 2D [rows, hidden] view (writes land in ``x``); None when no such view exists."""
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def check_norm_args(x: Tensor, weight: Tensor, *others: Tensor) -> str | None:
    """What every norm kernel needs of its arguments, layout aside: one half dtype for all
    (the kernels reinterpret ``weight`` as the input dtype: vLLM issue 48330), one device, equal
    shapes, a non-empty input and a unit-stride ``[hidden]`` weight aligned to the vectors."""
    reason = providers.check_half(x, weight, *others) or providers.check_same_device(x, weight, *others)
    if reason:
        return reason
    for t in others:
        if t.shape != x.shape:
            return f"shape {tuple(t.shape)} != input shape {tuple(x.shape)}"
    if x.numel() == 0:
        return "empty input"
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.stride(0) != 1:
        return f"weight {tuple(weight.shape)} is not a contiguous [{x.shape[-1]}] vector"
    if not providers.is_aligned(weight, vector_bytes(x)):
        return f"weight address not {vector_bytes(x)}-byte aligned"
    return None


def vector_bytes(x: Tensor) -> int:
    """The norm kernels' vector width in bytes: ``gcd(16 / itemsize, hidden)`` elements."""
    return math.gcd(16 // x.element_size(), x.shape[-1]) * x.element_size()


def check_norm(
    x: Tensor, weight: Tensor, *others: Tensor, allow_3d: bool = False, contiguous: bool = False
) -> str | None:
    """:func:`check_norm_args`, then the layout: last dim unit-stride, the tensor viewable as 2D
    rows (or 3D per-head when ``allow_3d``; fully contiguous when ``contiguous``), and address
    and row strides aligned to the kernel's vectors (:func:`vector_bytes`)."""
    reason = check_norm_args(x, weight, *others)
    if reason:
        return reason
    vec_bytes = vector_bytes(x)
    for t in (x, *others):
        if contiguous and not t.is_contiguous():
            return "input not contiguous"
        if t.stride(-1) != 1:
            return "last dim not contiguous"
        view = as_rows(t)
        if view is None and allow_3d and t.dim() == 3:
            view = t
        if view is None:
            ranks = "2D or 3D" if allow_3d else "2D"
            return f"{t.dim()}D input with these strides is not viewable as {ranks} rows"
        if not providers.is_aligned(view, vec_bytes, *view.stride()[:-1]):
            return f"address or row stride not {vec_bytes}-byte aligned"
    return None


def _norm_check(
    x: Tensor, weight: Tensor, eps: float, *, allow_3d: bool = False, contiguous: bool = False
) -> str | None:
    return check_norm(x, weight, allow_3d=allow_3d, contiguous=contiguous)


def _fused_add_check(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> str | None:
    # The sum is a fresh contiguous tensor: only the arguments matter, not their layout.
    return check_norm_args(x, weight, residual)


def _inplace_check(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, *, contiguous: bool = False
) -> str | None:
    if x.data_ptr() == residual.data_ptr():
        return "x and residual share memory"
    return check_norm(x, weight, residual, contiguous=contiguous)


# --------------------------------------------------------------------------- kernels


def sgl_norm(kernel: str, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """sgl-kernel's own ``rmsnorm`` / ``gemma_rmsnorm`` (2D; the op, not the wrapper, which
    would hand the call to flashinfer)."""
    rows = as_rows(x)
    assert rows is not None
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    getattr(torch.ops.sgl_kernel, kernel).default(out, rows, weight, eps, providers.enable_pdl(x.device))
    return out.view(x.shape)


def flashinfer_norm(kernel: str, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """flashinfer ``norm.rmsnorm`` (2D rows or 3D per-head, strided rows) / ``gemma_rmsnorm`` (2D)."""
    rows = as_rows(x)
    view = rows if rows is not None else x
    out = torch.empty(view.shape, dtype=x.dtype, device=x.device)
    fn = getattr(providers.library("flashinfer.norm"), kernel)
    fn(view, weight, eps, out=out, enable_pdl=providers.enable_pdl(x.device))
    return out.view(x.shape)


def _sgl_fused_add_(kernel: str, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    pdl = providers.enable_pdl(x.device)
    getattr(torch.ops.sgl_kernel, kernel).default(as_rows(x), as_rows(residual), weight, eps, pdl)


def _flashinfer_fused_add_(kernel: str, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    fn = getattr(providers.library("flashinfer.norm"), kernel)
    fn(as_rows(x), as_rows(residual), weight, eps, enable_pdl=providers.enable_pdl(x.device))


P = functools.partial
sgl_rms_norm = P(sgl_norm, "rmsnorm")
sgl_gemma_rms_norm = P(sgl_norm, "gemma_rmsnorm")
flashinfer_rms_norm = P(flashinfer_norm, "rmsnorm")
flashinfer_gemma_rms_norm = P(flashinfer_norm, "gemma_rmsnorm")

# sgl-kernel's norm binding predates flashinfer's strided one: give it contiguous rows only.
_SGL_CHECK = P(_norm_check, contiguous=True)
_SGL_INPLACE_CHECK = P(_inplace_check, contiguous=True)
_FI = "flashinfer.norm"

RMS_NORM_KERNELS = (
    Kernel("sgl_kernel", sgl_rms_norm, _SGL_CHECK),
    Kernel("flashinfer", flashinfer_rms_norm, P(_norm_check, allow_3d=True), module=_FI),
)
GEMMA_RMS_NORM_KERNELS = (
    Kernel("sgl_kernel", sgl_gemma_rms_norm, _SGL_CHECK),
    Kernel("flashinfer", flashinfer_gemma_rms_norm, _norm_check, module=_FI),
)


def _with_add(kernels: tuple[Kernel, ...]) -> tuple[Kernel, ...]:
    """Functional add + norm on CUDA: ``x + residual`` in torch, then the norm kernel (the fused
    kernels are in place only; the matcher picks the ``_`` op when it may overwrite)."""
    return tuple(
        Kernel(k.provider, P(add_then_norm, k.run), _fused_add_check, k.min_capability, f"{k.name}+torch", k.module)
        for k in kernels
    )


# --------------------------------------------------------------------------- the ops

_INPLACE = ("x", "residual")
DEFS: tuple[OpDef, ...] = (
    OpDef("rms_norm", rms_norm_reference, _rms_norm_fake, RMS_NORM_KERNELS),
    OpDef("gemma_rms_norm", gemma_rms_norm_reference, _gemma_rms_norm_fake, GEMMA_RMS_NORM_KERNELS),
    OpDef(
        "fused_add_rms_norm",
        fused_add_rms_norm_reference,
        P(_fused_add_fake, _rms_norm_fake),
        _with_add(RMS_NORM_KERNELS),
    ),
    OpDef(
        "gemma_fused_add_rms_norm",
        gemma_fused_add_rms_norm_reference,
        P(_fused_add_fake, _gemma_rms_norm_fake),
        _with_add(GEMMA_RMS_NORM_KERNELS),
    ),
    OpDef(
        "fused_add_rms_norm_",
        fused_add_rms_norm_inplace_reference,
        _inplace_fake,
        (
            Kernel("sgl_kernel", P(_sgl_fused_add_, "fused_add_rmsnorm"), _SGL_INPLACE_CHECK),
            Kernel("flashinfer", P(_flashinfer_fused_add_, "fused_add_rmsnorm"), _inplace_check, module=_FI),
        ),
        _INPLACE,
    ),
    OpDef(
        "gemma_fused_add_rms_norm_",
        gemma_fused_add_rms_norm_inplace_reference,
        _inplace_fake,
        (
            Kernel("sgl_kernel", P(_sgl_fused_add_, "gemma_fused_add_rmsnorm"), _SGL_INPLACE_CHECK),
            Kernel("flashinfer", P(_flashinfer_fused_add_, "gemma_fused_add_rmsnorm"), _inplace_check, module=_FI),
        ),
        _INPLACE,
    ),
)
OPS: tuple[str, ...] = providers.define_all(DEFS)
