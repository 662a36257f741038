"""The ``triton`` provider's LayerNorm kernel (``fxr.layer_norm``, ``fused_add_layer_norm`` and its
in-place twin), beside :mod:`fxrewrite.runtime.triton_kernels` and reached the same way, through
``providers.library("fxrewrite.runtime.triton_layernorm")``, so that the package imports without
Triton.

One kernel for the three ops: rows at any strides (leading dims as
:func:`fxrewrite.runtime.constraints.leading_dims` collapses them; the last dim contiguous), any
float dtype of 16 or 32 bits, weight and bias optional and of any such dtype, the residual add
fused (its sum written to a fresh tensor or over the residual)::

    # three kernels (add, norm, and torch's own layer_norm kernel)   # one kernel
    s = x + r                                                         y, s = fused_add_layer_norm(x, r, w, b, eps)
    y = F.layer_norm(s, (n,), w, b, eps)

Rounding follows the spec (:func:`fxrewrite.runtime.ops.layernorm.layer_norm_reference`): the sum
rounded to the input dtype, mean and variance of its float32 values (two passes over the row, held
in registers), ``(h - mean) * rsqrt(var + eps)``, then weight and bias in float32 and one rounding
(``CAST_LAST``), or the normalized value rounded first and each step after it rounded to the output
dtype. What differs from the spec is the order of the row sums and the approximate ``rsqrt``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxrewrite.runtime.ops.layernorm import out_dtype
from fxrewrite.runtime.triton_kernels import device_of, row_offsets, rows_launch


@triton.jit
def _layer_norm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, n_rows, n, eps, d1, d2,
                       xs0, xs1, xs2, rs0, rs1, rs2, ss0, ss1, ss2, os0, os1, os2,
                       BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                       HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, CAST_LAST: tl.constexpr):  # fmt: skip
    """``ROWS`` rows per program, each tensor at its own strides over leading dims [d0, d1, d2]:
    ``h = x.float()`` (with ``HAS_RESIDUAL``: ``s = (x + r)`` rounded to the dtype and stored at
    ``sum``, ``h = s.float()``); ``d = h - mean(h)``; ``y = d * rsqrt(mean(d^2) + eps)``; then
    ``y * w + b`` rounded once (``CAST_LAST``) or ``y`` rounded first and each step after it;
    stored at ``out``."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    dtype = x_ptr.dtype.element_ty
    out_ty = out_ptr.dtype.element_ty
    x_off = row_offsets(rows, d1, d2, xs0, xs1, xs2)[:, None] + cols[None, :]
    h = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_off = row_offsets(rows, d1, d2, rs0, rs1, rs2)[:, None] + cols[None, :]
        total = (h + tl.load(r_ptr + r_off, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        s_off = row_offsets(rows, d1, d2, ss0, ss1, ss2)[:, None] + cols[None, :]
        tl.store(sum_ptr + s_off, total, mask=mask)
        h = total.to(tl.float32)
    mean = tl.sum(h, axis=1) / n
    d = tl.where(mask, h - mean[:, None], 0.0)
    y = d * tl.math.rsqrt(tl.sum(d * d, axis=1) / n + eps)[:, None]
    if not CAST_LAST:
        y = y.to(dtype).to(tl.float32)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if not CAST_LAST:
            y = y.to(out_ty).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    o_off = row_offsets(rows, d1, d2, os0, os1, os2)[:, None] + cols[None, :]
    tl.store(out_ptr + o_off, y.to(out_ty), mask=mask)


def _launch(x: Tensor, residual: Tensor | None, total: Tensor | None, weight: Tensor | None, bias: Tensor | None,
            eps: float, cast_last: bool, out: Tensor) -> None:  # fmt: skip
    """``_layer_norm_kernel`` over ``x``'s rows; ``total`` gets the sum when ``residual`` is given
    (``residual`` itself, in place)."""
    tensors = (x, residual if residual is not None else x, total if total is not None else x, out)
    n = x.shape[-1]
    grid, layout, meta = rows_launch(n, *tensors)
    with device_of(x):
        _layer_norm_kernel[grid](
            x, tensors[1], weight if weight is not None else x, bias if bias is not None else x, out, tensors[2],
            x.numel() // n, n, eps, *layout, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None, CAST_LAST=cast_last, **meta,
        )  # fmt: skip


def _empty(x: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty(x.shape, dtype=dtype, device=x.device)


# --------------------------------------------------------------------------- the ops' signatures


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, cast_last: bool = True) -> Tensor:
    out = _empty(x, out_dtype(x, weight, bias, cast_last))
    _launch(x, None, None, weight, bias, eps, cast_last, out)
    return out


def fused_add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                         cast_last: bool = True) -> tuple[Tensor, Tensor]:  # fmt: skip
    total, out = _empty(x, x.dtype), _empty(x, out_dtype(x, weight, bias, cast_last))
    _launch(x, residual, total, weight, bias, eps, cast_last, out)
    return out, total


def fused_add_layer_norm_(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                          cast_last: bool = True) -> None:  # fmt: skip
    _launch(x, residual, residual, weight, bias, eps, cast_last, x)
