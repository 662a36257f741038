"""GEMMs with the decode step's small ops inside: an RMSNorm before them, a residual add after.

At decode sizes every linear of a layer reads its whole weight for a few rows (``fxr.linear``),
and the norms and residual adds between them are launches of their own that move a few KB each.
These ops put them into the GEMM: the Triton kernel (:mod:`fxrewrite.runtime.triton_gemm`, up to
``SKINNY_ROWS`` rows) computes each row's ``rsqrt(mean(x^2) + eps)`` in its k loop, applies the
norm weight to the A tiles and the per-row scale in the epilogue; the residual add happens
before the store. Above ``SKINNY_ROWS`` rows each op runs what it replaces: the norm kernel then
cuBLAS (``fxr.rms_norm``, whichever library serves it), or cuBLAS with the add in its epilogue
(``addmm``): a prefill keeps its kernels.

    # before                                                  # after
    y = fxr.linear(fxr.rms_norm(x, g, eps), w, b)             y = fxr.rms_norm_linear(x, g, eps, w, b)
    h = fxr.linear_silu_and_mul(fxr.rms_norm(x, g, eps), w)   h = fxr.rms_norm_linear_silu_and_mul(x, g, eps, w)
    s = fxr.linear(a, w) + r                                  s = fxr.linear_add(a, w, r)
    r += fxr.linear(a, w)   (r dead otherwise)                r = fxr.linear_add_(a, w, r)
    s = fxr.linear_add(a, w, r)                               s, sg, parts = fxr.linear_add_rms_parts(a, w, r, g)
    y = fxr.rms_norm_linear(s, g, eps, w2)                    y = fxr.rms_norm_linear(sg, None, eps, w2, parts=parts)
    y = fxr.rms_norm_linear(x, g, eps, w, b)                  y = fxr.rms_norm_linear_rotary(x, g, eps, w, b,
    q, k = fxr.rotary_embedding(pos, y[:, :q] .., y[:, q:qk] .., cache, True)      False, pos, cache, qk)

The hand-off (``linear_add_rms_parts``, and ``parts`` of the norm ops): the GEMM that makes the
residual stream's rows also computes what the next norm needs of whole rows, ``s * g`` and each
row's sums of squares over slots of ``PART`` columns, so that the GEMM reading the norm keeps a
k loop that only streams its operands (squares summed in the k loop cost the decode GEMMs a
third of their time: bench/RESULTS.md). ``parts`` given, a norm op's ``x`` is the weighted
``s * g`` (its own weight None) and its per-row scale is ``rsqrt(sum(parts) / k + eps)``.

``rms_norm_linear_rotary`` also rotates the output's first ``rotated`` columns (q's heads, then
k's; NeoX halves, heads of the cache's width) by ``cos_sin_cache[positions]``: the Triton kernel
has each program compute a block of a head's first half and the partner block half a head
further (two accumulators, each weight row read once) and rotate them before the store; above 16
rows, the norm, cuBLAS and flashinfer's rotation in place on the output (the kernels it replaces).

``cast_last`` is the norm's (``fxr.rms_norm``'s flag): where its weight multiplies, which the
kernel does not need (it applies the weight to ``x`` and the scale last, rounding the A tile
once), so it is part of the spec only. Rounding against the spec (the unfused ops, which round
the normed value, the product and the sum to the dtype each): the kernels round the A tile
``x * g`` once and the output once (``linear_add``: the sum once, as ``addmm`` does); the error
against float32 is no larger than the spec's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops.activation import silu_and_mul_reference
from fxrewrite.runtime.ops.linear import PART, TRITON_GEMM, TRITON_ROWS, gated_check, gate_up_rows, skinny_check
from fxrewrite.runtime.ops.norm import as_rows, rms_norm_reference, rms_norm_scaled
from fxrewrite.runtime.ops.rotary import HEAD_DIMS, rotary_embedding_q_reference
from fxrewrite.runtime.providers import Kernel, OpDef

# --------------------------------------------------------------------------- references (the spec)


def normed(x: Tensor, norm_weight: Tensor | None, eps: float, cast_last: bool = False,
           parts: Tensor | None = None) -> Tensor:  # fmt: skip
    """``fxr.rms_norm(x, norm_weight, eps, cast_last)``; with ``parts`` (a hand-off's sums of
    squares, [..., slots] float32) the row's scale is ``rsqrt(sum(parts) / k + eps)``."""
    if parts is None:
        return rms_norm_reference(x, norm_weight, eps, cast_last)
    return rms_norm_scaled(x, torch.rsqrt(parts.sum(-1, keepdim=True) / x.shape[-1] + eps), norm_weight, cast_last)


def rms_norm_linear_reference(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor, bias: Tensor | None = None,
                              cast_last: bool = False, parts: Tensor | None = None) -> Tensor:  # fmt: skip
    """``F.linear(rms_norm(x, norm_weight, eps, cast_last), w, bias)`` (``fxr.rms_norm``'s spec;
    ``parts``: the norm's sums of squares, :func:`normed`)."""
    return F.linear(normed(x, norm_weight, eps, cast_last, parts), w, bias)


def rms_norm_linear_silu_and_mul_reference(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor,
                                           bias: Tensor | None = None, cast_last: bool = False,
                                           parts: Tensor | None = None) -> Tensor:  # fmt: skip
    """``silu_and_mul(rms_norm_linear(x, ...))``: w [2d, k] (gate rows, then up rows) -> [..., d]."""
    gate_up_rows(w)
    return silu_and_mul_reference(rms_norm_linear_reference(x, norm_weight, eps, w, bias, cast_last, parts))


def rms_norm_linear_rotary_reference(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor, bias: Tensor | None,
                                     cast_last: bool, positions: Tensor, cos_sin_cache: Tensor, rotated: int,
                                     parts: Tensor | None = None) -> Tensor:  # fmt: skip
    """:func:`rms_norm_linear_reference`, its first ``rotated`` columns (q's heads, then k's) rotated
    as ``fxr.rotary_embedding`` rotates them: heads of ``D = cos_sin_cache.shape[-1]`` columns,
    NeoX halves, angles ``cos_sin_cache[positions]`` (x [..., k]: N rows, positions [N])."""
    y = rms_norm_linear_reference(x, norm_weight, eps, w, bias, cast_last, parts)
    rows = y.reshape(-1, y.shape[-1])
    heads = rows[:, :rotated].reshape(rows.shape[0], -1, cos_sin_cache.shape[-1])
    turned = rotary_embedding_q_reference(positions, heads, cos_sin_cache, True)
    return torch.cat((turned.reshape(rows.shape[0], rotated), rows[:, rotated:]), dim=-1).view(y.shape)


def linear_add_reference(x: Tensor, w: Tensor, residual: Tensor) -> Tensor:
    """``F.linear(x, w) + residual``: the new residual stream."""
    return F.linear(x, w) + residual


def linear_add_inplace_reference(x: Tensor, w: Tensor, residual: Tensor) -> None:
    """``residual += F.linear(x, w)``."""
    residual.add_(F.linear(x, w))


def hand_off(s: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(s, s * norm_weight, parts)``: what the next RMSNorm of ``s`` needs of whole rows, the
    weighted rows (rounded to ``s``'s dtype) and each row's float32 sums of squares over slots
    of ``PART`` columns (``parts [..., ceil(n / PART)]``, the last slot partial)."""
    h = s.float()
    squares = F.pad(h.square(), (0, -h.shape[-1] % PART))
    return s, (h * norm_weight.float()).to(s.dtype), squares.unflatten(-1, (-1, PART)).sum(-1)


def linear_add_rms_parts_reference(x: Tensor, w: Tensor, residual: Tensor,
                                   norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``s = F.linear(x, w) + residual`` and the next norm's hand-off (:func:`hand_off`):
    ``rms_norm(s, g, eps)`` is ``fxr.rms_norm_linear``'s ``normed(s * g, None, eps, parts=parts)``."""
    return hand_off(linear_add_reference(x, w, residual), norm_weight)


def _norm_linear_fake(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor, bias: Tensor | None = None,
                      cast_last: bool = False, parts: Tensor | None = None) -> Tensor:  # fmt: skip
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _norm_gated_fake(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor, bias: Tensor | None = None,
                     cast_last: bool = False, parts: Tensor | None = None) -> Tensor:  # fmt: skip
    return x.new_empty((*x.shape[:-1], gate_up_rows(w)))


def _norm_rotary_fake(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor, bias: Tensor | None,
                      cast_last: bool, positions: Tensor, cos_sin_cache: Tensor, rotated: int,
                      parts: Tensor | None = None) -> Tensor:  # fmt: skip
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _hand_off_fake(x: Tensor, w: Tensor, residual: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    out = (*x.shape[:-1], w.shape[0])
    return x.new_empty(out), x.new_empty(out), x.new_empty((*out[:-1], -(-w.shape[0] // PART)), dtype=torch.float32)


def _linear_add_fake(x: Tensor, w: Tensor, residual: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _inplace_fake(x: Tensor, w: Tensor, residual: Tensor) -> None:
    return None


# --------------------------------------------------------------------------- kernel constraints


def norm_weight_check(x: Tensor, norm_weight: Tensor | None) -> str | None:
    """The kernel's norm weight: none, or a contiguous ``[k]`` vector of ``x``'s dtype and device."""
    if norm_weight is None:
        return None
    if norm_weight.dtype != x.dtype or norm_weight.device != x.device:
        return f"norm weight {norm_weight.dtype} on {norm_weight.device}, input {x.dtype} on {x.device}"
    if norm_weight.dim() != 1 or norm_weight.shape[0] != x.shape[-1] or norm_weight.stride(0) != 1:
        return f"norm weight {tuple(norm_weight.shape)} is not a contiguous [{x.shape[-1]}] vector"
    return None


MAX_PARTS = 1024
"""Most slots of a hand-off a norm op's Triton kernel sums per row (k up to 32768 columns)."""


def parts_check(x: Tensor, parts: Tensor | None) -> str | None:
    """A hand-off's sums of squares: none, or contiguous float32 ``[..., slots]`` rows matching
    ``x``'s, at most :data:`MAX_PARTS` slots, on ``x``'s device."""
    if parts is None:
        return None
    if parts.dtype != torch.float32 or not parts.is_contiguous() or parts.shape[:-1] != x.shape[:-1]:
        return f"parts {parts.dtype}{tuple(parts.shape)} (contiguous={parts.is_contiguous()}) for input {tuple(x.shape)}"
    if not 0 < parts.shape[-1] <= MAX_PARTS:
        return f"{parts.shape[-1]} slots of squares: the kernel sums 1 to {MAX_PARTS}"
    return constraints.check_same_device(x, parts)


def _norm_check(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor, bias: Tensor | None = None,
                cast_last: bool = False, parts: Tensor | None = None) -> str | None:  # fmt: skip
    return skinny_check(x, w, bias) or norm_weight_check(x, norm_weight) or parts_check(x, parts)


def _norm_gated_check(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor, bias: Tensor | None = None,
                      cast_last: bool = False, parts: Tensor | None = None) -> str | None:  # fmt: skip
    return gated_check(x, w, bias) or norm_weight_check(x, norm_weight) or parts_check(x, parts)


def rotary_layout_check(x: Tensor, w: Tensor, positions: Tensor, cos_sin_cache: Tensor, rotated: int) -> str | None:
    """Rotation in the GEMM's epilogue: a position per row of ``x``, a contiguous float32
    ``[P, D]`` cache, heads of D (a multiple of 32: a program's block of at least 16 columns
    inside half a head) tiling the ``rotated`` columns and the output."""
    d = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else 0
    rows = x.numel() // max(x.shape[-1], 1)
    if positions.dim() != 1 or positions.shape[0] != rows or positions.dtype not in (torch.int32, torch.int64):
        return f"positions {positions.dtype}{tuple(positions.shape)} for input {tuple(x.shape)}"
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous() or d % 32:
        return f"cos_sin_cache {cos_sin_cache.dtype}{tuple(cos_sin_cache.shape)}: needs contiguous float32 [P, 32 m]"
    if rotated <= 0 or rotated % d or w.shape[0] % d or rotated > w.shape[0]:
        return f"{rotated} rotated of {w.shape[0]} columns in heads of {d}"
    return constraints.check_same_device(x, positions, cos_sin_cache)


def _norm_rotary_check(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor, bias: Tensor | None,
                       cast_last: bool, positions: Tensor, cos_sin_cache: Tensor, rotated: int,
                       parts: Tensor | None = None) -> str | None:  # fmt: skip
    return (_norm_check(x, norm_weight, eps, w, bias, cast_last, parts)
            or rotary_layout_check(x, w, positions, cos_sin_cache, rotated))


def residual_check(x: Tensor, w: Tensor, residual: Tensor, dtype: torch.dtype | None = None) -> str | None:
    """What adding ``residual`` to ``linear(x, w)`` in an epilogue needs: the output's dtype
    (``dtype``, else x's) and shape, rows of unit stride along n (viewable as [rows, n]), no
    memory shared with ``x``."""
    shape = (*x.shape[:-1], w.shape[0]) if w.dim() == 2 else None
    dtype = dtype or x.dtype
    if residual.dtype != dtype or residual.shape != shape:
        return f"residual {residual.dtype}{tuple(residual.shape)} != output {dtype}{shape}"
    rows = as_rows(residual)
    if rows is None or rows.stride(-1) != 1:
        return "residual rows not viewable with unit stride"
    # fake tensors (a build ahead plans on them) have no memory: nothing to share
    if not is_fake(x) and residual.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return "residual and input share memory"
    return constraints.check_same_device(x, residual)


def _add_check(x: Tensor, w: Tensor, residual: Tensor) -> str | None:
    return skinny_check(x, w) or residual_check(x, w, residual)


def hand_off_check(x: Tensor, w: Tensor, residual: Tensor, norm_weight: Tensor,
                   dtype: torch.dtype | None = None) -> str | None:  # fmt: skip
    """The sum's operands of a hand-off (:func:`residual_check`) and the next norm's weight:
    ``[n]`` contiguous, of the output's dtype (``dtype``, else ``x``'s)."""
    n, dtype = w.shape[0], dtype or x.dtype
    if norm_weight.dtype != dtype or tuple(norm_weight.shape) != (n,) or norm_weight.stride(0) != 1:
        return f"norm weight {norm_weight.dtype}{tuple(norm_weight.shape)}: needs a contiguous [{n}] of {dtype}"
    return residual_check(x, w, residual, dtype) or constraints.check_same_device(x, norm_weight)


def _hand_off_check(x: Tensor, w: Tensor, residual: Tensor, norm_weight: Tensor) -> str | None:
    return skinny_check(x, w) or hand_off_check(x, w, residual, norm_weight)

# --------------------------------------------------------------------------- above SKINNY_ROWS rows


def rows_kernels(t: Tensor) -> Any:
    """The Triton row kernels of the hand-off (:mod:`fxrewrite.runtime.triton_rows`) for ``t``'s
    contiguous rows on CUDA, else None (torch's ops compute the same)."""
    return providers.library(TRITON_ROWS) if t.is_cuda and t.is_contiguous() else None


def _norm_cublas(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor, bias: Tensor | None = None,
                 cast_last: bool = False, parts: Tensor | None = None) -> Tensor:  # fmt: skip
    """The norm kernel, then cuBLAS; with a hand-off's squares, one Triton kernel scales the rows
    (torch's ops where Triton is absent or a weight remains)."""
    if parts is None:
        return F.linear(torch.ops.fxr.rms_norm.default(x, norm_weight, eps, cast_last), w, bias)
    kernels = rows_kernels(x) if norm_weight is None and parts.is_contiguous() else None
    rows = kernels.scale_rows(x, parts, eps) if kernels is not None else normed(x, norm_weight, eps, cast_last, parts)
    return F.linear(rows, w, bias)


def _norm_cublas_silu_and_mul(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor, bias: Tensor | None = None,
                              cast_last: bool = False, parts: Tensor | None = None) -> Tensor:  # fmt: skip
    return torch.ops.fxr.silu_and_mul.default(_norm_cublas(x, norm_weight, eps, w, bias, cast_last, parts))


def _norm_cublas_rope(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor, bias: Tensor | None,
                      cast_last: bool, positions: Tensor, cos_sin_cache: Tensor, rotated: int,
                      parts: Tensor | None = None) -> Tensor:  # fmt: skip
    """The norm, cuBLAS, then flashinfer's rotation in place on the output's q and k columns (as
    two [N, heads * D] strided views: all heads but the last, and the last)."""
    y = _norm_cublas(x, norm_weight, eps, w, bias, cast_last, parts)
    rows, d = y.view(-1, y.shape[-1]), cos_sin_cache.shape[-1]
    rope = providers.library("flashinfer.rope")
    rope.apply_rope_with_cos_sin_cache_inplace(positions, rows[:, : rotated - d], rows[:, rotated - d : rotated], d,
                                               cos_sin_cache, True)  # fmt: skip
    return y


def _rope_check(x: Tensor, norm_weight: Tensor | None, eps: float, w: Tensor, bias: Tensor | None,
                cast_last: bool, positions: Tensor, cos_sin_cache: Tensor, rotated: int,
                parts: Tensor | None = None) -> str | None:  # fmt: skip
    """flashinfer's in-place rotation on the GEMM's output rows: its head sizes, half dtypes, a
    position per row, at least two heads to rotate (it takes them as q and k)."""
    d = cos_sin_cache.shape[-1]
    if rotated < 2 * d or rotated % d or positions.numel() * x.shape[-1] != x.numel():
        return f"{rotated} rotated columns in heads of {d} (input {tuple(x.shape)}, {positions.numel()} positions)"
    if d not in HEAD_DIMS:
        return f"head size {d} not in {HEAD_DIMS}"
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        return f"cos_sin_cache {cos_sin_cache.dtype}: needs contiguous float32"
    if positions.dtype not in (torch.int32, torch.int64) or positions.dim() != 1:
        return f"positions {positions.dtype}{tuple(positions.shape)}, needs 1-D int32/int64"
    return constraints.check_half(x, w) or constraints.check_same_device(x, positions, cos_sin_cache)


def _addmm(x: Tensor, w: Tensor, residual: Tensor) -> Tensor:
    """``residual + x @ w.T`` in one cuBLAS call (the add in its epilogue)."""
    n = w.shape[0]
    return torch.addmm(residual.reshape(-1, n), x.reshape(-1, x.shape[-1]), w.t()).view(residual.shape)


def _addmm_(x: Tensor, w: Tensor, residual: Tensor) -> None:
    """``residual += x @ w.T`` in one cuBLAS call, into ``residual``'s own rows (no copy)."""
    rows = as_rows(residual)
    if rows is None:
        residual.add_(F.linear(x, w))
    else:
        rows.addmm_(x.reshape(-1, x.shape[-1]), w.t())


def _addmm_parts(x: Tensor, w: Tensor, residual: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """cuBLAS with the add in its epilogue, then the hand-off in one Triton kernel (torch's ops
    where Triton is absent)."""
    return hand_off_rows(_addmm(x, w, residual), norm_weight)


def hand_off_rows(s: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`hand_off` of rows a library GEMM made, in one Triton kernel (torch's ops where
    Triton is absent)."""
    kernels = rows_kernels(s) if norm_weight.is_contiguous() else None
    return kernels.hand_off_rows(s, norm_weight) if kernels is not None else hand_off(s, norm_weight)


def _same_dtype(x: Tensor, w: Tensor, residual: Tensor, *_: object) -> str | None:
    if not x.dtype == w.dtype == residual.dtype:
        return f"dtypes {x.dtype}, {w.dtype}, {residual.dtype} differ"
    return None


def always(*args: object) -> None:
    """A torch path's check: it serves every call."""
    return None


def gemm_kernel(op: str, check: object) -> Kernel:
    """The Triton GEMM module's kernel of ``op`` (runtime/triton_gemm.py), built ahead."""
    return providers.triton_kernel(op, check, prepare=True, module=TRITON_GEMM)  # type: ignore[arg-type]


DEFS: tuple[OpDef, ...] = (
    OpDef("rms_norm_linear", rms_norm_linear_reference, _norm_linear_fake,
          (gemm_kernel("rms_norm_linear", _norm_check), Kernel("torch", _norm_cublas, always, label="rms_norm+cublas"))),
    OpDef("rms_norm_linear_silu_and_mul", rms_norm_linear_silu_and_mul_reference, _norm_gated_fake,
          (gemm_kernel("rms_norm_linear_silu_and_mul", _norm_gated_check),
           Kernel("torch", _norm_cublas_silu_and_mul, always, label="rms_norm+cublas+silu_and_mul"))),
    OpDef("rms_norm_linear_rotary", rms_norm_linear_rotary_reference, _norm_rotary_fake,
          (gemm_kernel("rms_norm_linear_rotary", _norm_rotary_check),
           Kernel("flashinfer", _norm_cublas_rope, _rope_check, label="rms_norm+cublas+flashinfer_rope",
                  module="flashinfer.rope"))),
    OpDef("linear_add", linear_add_reference, _linear_add_fake,
          (gemm_kernel("linear_add", _add_check), Kernel("torch", _addmm, _same_dtype, label="cublas_addmm"))),
    OpDef("linear_add_", linear_add_inplace_reference, _inplace_fake,
          (gemm_kernel("linear_add_", _add_check), Kernel("torch", _addmm_, _same_dtype, label="cublas_addmm")),
          mutates_args=("residual",)),
    OpDef("linear_add_rms_parts", linear_add_rms_parts_reference, _hand_off_fake,
          (gemm_kernel("linear_add_rms_parts", _hand_off_check),
           Kernel("torch", _addmm_parts, _same_dtype, label="cublas_addmm+hand_off"))),
)  # fmt: skip
OPS: tuple[str, ...] = providers.define_all(DEFS)
