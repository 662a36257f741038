"""RMSNorm family: ``fxr::rms_norm``, ``gemma_rms_norm``, add + RMSNorm, and in-place twins.

Each ``*_reference`` function below is the op's spec and its CPU impl; rules that produce these
ops must match exactly the code it spells. On CUDA the op runs sgl-kernel or flashinfer when the
call meets their constraints, else our Triton kernel, which takes any float dtype, a weight of
another dtype and rows at any strides (per-head norms read through a view of a merged
projection) (:mod:`fxrewrite.runtime.providers`).

    # before (HF LlamaRMSNorm)                        # after
    h = x.to(torch.float32)                           y = torch.ops.fxr.rms_norm(x, w, eps)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = w * h.to(x.dtype)

Where the weight is applied decides one rounding: Llama rounds the normed value to the input
dtype and then multiplies (``cast_last=False``); OLMo2 and gpt-oss multiply in float32 and round
once, ``(w * h).to(x.dtype)`` (``cast_last=True``), which is what the sgl-kernel and flashinfer
kernels compute. Gemma's ``(h * (1 + w.float())).to(x.dtype)`` rounds once too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.providers import Kernel, OpDef

NormFn = Callable[[Tensor, Tensor | None, float], Tensor]

# --------------------------------------------------------------------------- references (the spec)


def rms_norm_reference(
    x: Tensor, weight: Tensor | None, eps: float, cast_last: bool = False, round_scale: bool = False
) -> Tensor:
    """HF Llama RMSNorm over the last dim of ``x`` (any rank >= 1); dtype ``promote(weight, x)``.

    ``h = x.float(); h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps);
    return weight * h.to(x.dtype)``

    ``cast_last``: ``return (weight * h).to(x.dtype)`` instead: scaled in float32 (or the
    weight's wider dtype), rounded once; dtype ``x.dtype``.

    ``weight=None`` (no scale, nanochat, Llama 4's QK norm): ``return h.to(x.dtype)``; both
    orders are that one computation.

    ``round_scale``: the per-row scale is rounded to ``x``'s dtype and multiplies ``x`` there
    (DeepSeek-V4): ``y = x * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)``;
    ``return y`` without a weight, else ``weight * y`` (``cast_last`` then changes nothing).
    """
    h = x.float()
    scale = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if round_scale:
        y = x * scale.to(x.dtype)
        return y if weight is None else weight * y
    return rms_norm_scaled(x, scale, weight, cast_last)


def rms_norm_scaled(x: Tensor, scale: Tensor, weight: Tensor | None, cast_last: bool = False) -> Tensor:
    """:func:`rms_norm_reference` from the per-row float32 ``scale`` on: ``x * scale``, the
    weight applied in the ``cast_last`` order (shared with the norms whose statistics another
    op computed, ``fxr.rms_norm_linear(..., parts=...)``)."""
    h = x.float() * scale
    if weight is None:
        return h.to(x.dtype)
    if cast_last:
        return (weight * h).to(x.dtype)
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
    norm: Callable[..., Tensor], x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, *flags: bool
) -> tuple[Tensor, Tensor]:
    """``sum = x + residual; return norm(sum, weight, eps, *flags), sum`` (shared by spec and
    kernels; ``flags``: the norm's own, ``cast_last``)."""
    total = x + residual
    return norm(total, weight, eps, *flags), total


def add_then_norm_(norm: NormFn, x: Tensor, residual: Tensor, weight: Tensor | None, eps: float) -> None:
    """In place, sgl-kernel semantics: ``residual += x; x[:] = norm(residual, weight, eps)``."""
    residual.add_(x)
    x.copy_(norm(residual, weight, eps))


def fused_add_rms_norm_reference(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, cast_last: bool = False
) -> tuple[Tensor, Tensor]:
    """Returns ``(out, sum)``: ``sum = x + residual; out = rms_norm_reference(sum, weight, eps,
    cast_last)`` (``weight`` None: no scale)."""
    return add_then_norm(P(rms_norm_reference, cast_last=cast_last), x, residual, weight, eps)


def gemma_fused_add_rms_norm_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Returns ``(out, sum)``: ``sum = x + residual; out = gemma_rms_norm_reference(sum, weight, eps)``."""
    return add_then_norm(gemma_rms_norm_reference, x, residual, weight, eps)


def fused_add_rms_norm_inplace_reference(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, cast_last: bool = False
) -> None:
    """``residual <- x + residual; x <- rms_norm_reference(residual, weight, eps, cast_last)``
    (``x`` and ``residual`` of one dtype)."""
    add_then_norm_(P(rms_norm_reference, cast_last=cast_last), x, residual, weight, eps)


def gemma_fused_add_rms_norm_inplace_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> None:
    """``residual <- x + residual; x <- gemma_rms_norm_reference(residual, weight, eps)``."""
    add_then_norm_(gemma_rms_norm_reference, x, residual, weight, eps)


# --------------------------------------------------------------------------- fake impls


def _rms_norm_fake(
    x: Tensor, weight: Tensor | None, eps: float, cast_last: bool = False, round_scale: bool = False
) -> Tensor:
    if weight is None or (cast_last and not round_scale):
        return x.new_empty(x.shape)
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


def _gemma_rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape)


def fake_sum(x: Tensor, residual: Tensor) -> Tensor:
    """A fake ``x + residual``."""
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    return x.new_empty(shape, dtype=torch.promote_types(x.dtype, residual.dtype))


def _fused_add_fake(
    norm_fake: Callable[..., Tensor], x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, *flags: bool
) -> tuple[Tensor, Tensor]:
    total = fake_sum(x, residual)
    return norm_fake(total, weight, eps, *flags), total


def _inplace_fake(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, *flags: bool) -> None:
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


def as_heads(x: Tensor) -> Tensor | None:
    """``x`` as a 3D [rows, heads, head_dim] view (``[B, T, H, D]`` read through a view of a
    merged projection: rows at one stride, heads at another); None when no such view exists."""
    if x.dim() < 3:
        return None
    try:
        return x.view(-1, *x.shape[-2:])
    except RuntimeError:
        return None


def check_norm_args(x: Tensor, weight: Tensor | None, *others: Tensor) -> str | None:
    """What every norm kernel needs of its arguments, layout aside: a weight, one half dtype
    for all (the kernels reinterpret ``weight`` as the input dtype: vLLM issue 48330), one
    device, equal shapes, a non-empty input and a unit-stride ``[hidden]`` weight aligned to the
    vectors."""
    if weight is None:
        return "no weight"
    reason = constraints.check_half(x, weight, *others) or constraints.check_same_device(x, weight, *others)
    if reason:
        return reason
    for t in others:
        if t.shape != x.shape:
            return f"shape {tuple(t.shape)} != input shape {tuple(x.shape)}"
    if x.numel() == 0:
        return "empty input"
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.stride(0) != 1:
        return f"weight {tuple(weight.shape)} is not a contiguous [{x.shape[-1]}] vector"
    if not constraints.is_aligned(weight, vector_bytes(x)):
        return f"weight address not {vector_bytes(x)}-byte aligned"
    return None


def vector_bytes(x: Tensor) -> int:
    """The norm kernels' vector width in bytes: ``gcd(16 / itemsize, hidden)`` elements."""
    return math.gcd(16 // x.element_size(), x.shape[-1]) * x.element_size()


def check_norm(
    x: Tensor, weight: Tensor | None, *others: Tensor, allow_3d: bool = False, contiguous: bool = False
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
        if view is None and allow_3d:
            view = as_heads(t)
        if view is None:
            ranks = "2D or 3D" if allow_3d else "2D"
            return f"{t.dim()}D input with these strides is not viewable as {ranks} rows"
        if not constraints.is_aligned(view, vec_bytes, *view.stride()[:-1]):
            return f"address or row stride not {vec_bytes}-byte aligned"
    return None


# The libraries' kernels scale in float32 and round once: exactly ``cast_last=True``; for the
# Llama order (round, then scale) they differ from the spec by that one rounding, as they do
# inside vLLM and SGLang.


def _norm_check(
    x: Tensor, weight: Tensor | None, eps: float, cast_last: bool = False, round_scale: bool = False, *,
    allow_3d: bool = False, contiguous: bool = False,
) -> str | None:  # fmt: skip
    if round_scale:
        return "scale rounded to the input dtype"
    return check_norm(x, weight, allow_3d=allow_3d, contiguous=contiguous)


def _fused_add_check(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, cast_last: bool = False) -> str | None:
    # The sum is a fresh contiguous tensor: only the arguments matter, not their layout.
    return check_norm_args(x, weight, residual)


def _inplace_check(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, cast_last: bool = False, *,
    contiguous: bool = False,
) -> str | None:  # fmt: skip
    if x.data_ptr() == residual.data_ptr():
        return "x and residual share memory"
    return check_norm(x, weight, residual, contiguous=contiguous)


# --------------------------------------------------------------------------- kernels


def sgl_norm(kernel: str, x: Tensor, weight: Tensor, eps: float, cast_last: bool = False,
             round_scale: bool = False) -> Tensor:  # fmt: skip
    """sgl-kernel's own ``rmsnorm`` / ``gemma_rmsnorm`` (2D; the op, not the wrapper, which
    would hand the call to flashinfer)."""
    rows = as_rows(x)
    assert rows is not None
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    getattr(torch.ops.sgl_kernel, kernel).default(out, rows, weight, eps, providers.enable_pdl(x.device))
    return out.view(x.shape)


def flashinfer_norm(kernel: str, x: Tensor, weight: Tensor, eps: float, cast_last: bool = False,
                    round_scale: bool = False) -> Tensor:  # fmt: skip
    """flashinfer ``norm.rmsnorm`` (2D rows or 3D per-head, strided rows) / ``gemma_rmsnorm`` (2D)."""
    rows = as_rows(x)
    view = rows if rows is not None else as_heads(x)
    assert view is not None
    out = torch.empty(view.shape, dtype=x.dtype, device=x.device)
    fn = getattr(providers.library("flashinfer.norm"), kernel)
    fn(view, weight, eps, out=out, enable_pdl=providers.enable_pdl(x.device))
    return out.view(x.shape)


def _sgl_fused_add_(kernel: str, x: Tensor, residual: Tensor, weight: Tensor, eps: float, cast_last: bool = False) -> None:
    pdl = providers.enable_pdl(x.device)
    getattr(torch.ops.sgl_kernel, kernel).default(as_rows(x), as_rows(residual), weight, eps, pdl)


def _flashinfer_fused_add_(kernel: str, x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                           cast_last: bool = False) -> None:  # fmt: skip
    fn = getattr(providers.library("flashinfer.norm"), kernel)
    fn(as_rows(x), as_rows(residual), weight, eps, enable_pdl=providers.enable_pdl(x.device))


def _triton_norm_check(x: Tensor, weight: Tensor | None, eps: float, cast_last: bool = False,
                       round_scale: bool = False) -> str | None:  # fmt: skip
    return constraints.check_strided_rows(x) or triton_weight_check(x, weight)


def _triton_inplace_check(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float,
                          cast_last: bool = False) -> str | None:  # fmt: skip
    if residual.dtype != x.dtype:
        return f"residual {residual.dtype} != input {x.dtype}"
    return constraints.check_strided_rows(x, residual) or triton_weight_check(x, weight)


def _triton_fused_add_check(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float,
                            cast_last: bool = False) -> str | None:  # fmt: skip
    # The sum is a fresh contiguous tensor: the dtypes and the weight matter, not the layout.
    if residual.dtype != x.dtype or residual.shape != x.shape:
        return f"residual {residual.dtype}{tuple(residual.shape)} != input {x.dtype}{tuple(x.shape)}"
    if reason := constraints.check_float(x):
        return reason
    if x.numel() == 0:
        return "empty input"
    return constraints.check_triton_row(x.shape[-1]) or triton_weight_check(x, weight)


def triton_weight_check(x: Tensor, weight: Tensor | None) -> str | None:
    """What our Triton norm kernels need of a weight: none, or a unit-stride ``[hidden]`` float
    vector on ``x``'s device (of any float dtype: the kernels load it as it is)."""
    if weight is None:
        return None
    if reason := constraints.check_float(weight):
        return "weight " + reason
    if weight.device != x.device:
        return f"weight on {weight.device}, input on {x.device}"
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.stride(0) != 1:
        return f"weight {tuple(weight.shape)} is not a contiguous [{x.shape[-1]}] vector"
    return None


P = functools.partial
sgl_rms_norm = P(sgl_norm, "rmsnorm")
sgl_gemma_rms_norm = P(sgl_norm, "gemma_rmsnorm")
flashinfer_rms_norm = P(flashinfer_norm, "rmsnorm")
flashinfer_gemma_rms_norm = P(flashinfer_norm, "gemma_rmsnorm")

# sgl-kernel's norm binding predates flashinfer's strided one: give it contiguous rows only.
_SGL_CHECK = P(_norm_check, contiguous=True)
_SGL_INPLACE_CHECK = P(_inplace_check, contiguous=True)
_FI = "flashinfer.norm"

# Triton last: any float dtype, a weight of another dtype, rows at any strides (per-head norms
# read through a view of a merged projection), so that no call runs the torch reference.
RMS_NORM_KERNELS = (
    Kernel("sgl_kernel", sgl_rms_norm, _SGL_CHECK),
    Kernel("flashinfer", flashinfer_rms_norm, P(_norm_check, allow_3d=True), module=_FI),
    providers.triton_kernel("rms_norm", _triton_norm_check),
)
GEMMA_RMS_NORM_KERNELS = (
    Kernel("sgl_kernel", sgl_gemma_rms_norm, _SGL_CHECK),
    Kernel("flashinfer", flashinfer_gemma_rms_norm, _norm_check, module=_FI),
    providers.triton_kernel("gemma_rms_norm", _triton_norm_check),
)


def _with_add(kernels: tuple[Kernel, ...]) -> tuple[Kernel, ...]:
    """Functional add + norm on CUDA: ``x + residual`` in torch, then the norm kernel (the fused
    kernels are in place only; the matcher picks the ``_`` op when it may overwrite)."""
    return tuple(
        Kernel(k.provider, P(add_then_norm, k.run), _triton_fused_add_check if k.provider == "triton" else
               _fused_add_check, k.min_capability, f"{k.name}+torch", k.module)  # fmt: skip
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
            providers.triton_kernel("fused_add_rms_norm_", _triton_inplace_check),
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
            providers.triton_kernel("gemma_fused_add_rms_norm_", _triton_inplace_check),
        ),
        _INPLACE,
    ),
)
OPS: tuple[str, ...] = providers.define_all(DEFS)
