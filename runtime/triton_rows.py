"""The norm's hand-off above the decode sizes: two row kernels around a cuBLAS GEMM.

Up to ``SKINNY_ROWS`` rows the GEMM that makes a row also stores what the next RMSNorm needs of
it (``HAND_OFF`` in :mod:`fxrewrite.runtime.triton_gemm`): ``s * g`` and the row's sums of
squares by slot of ``PART`` columns; the GEMM that reads it applies the per-row scale in its
epilogue. Above that, cuBLAS makes the rows, and one kernel each does the two halves:

    s, sg, parts = hand_off_rows(s, g)          # after the producing GEMM: s * g, the squares by slot
    y = linear(scale_rows(x, parts, eps), w)    # before the reading GEMM, a norm without weight

One program per row, the whole row in one block (:func:`_row_block`). Under
``TRITON_INTERPRET=1`` they run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxrewrite.runtime.ops import linear as linear_ops
from fxrewrite.runtime.triton_kernels import device_of

# Columns per slot of a hand-off's sums of squares (the skinny kernel's smallest BN).
PART: tl.constexpr = tl.constexpr(linear_ops.PART)


@triton.jit
def _hand_off_rows_kernel(s_ptr, g_ptr, sg_ptr, parts_ptr, n, parts_n, BLOCK: tl.constexpr):
    """Program p: row p of ``s`` (contiguous rows of ``n``) -> ``sg = s * g`` and the row's sums
    of squares by slot of ``PART`` columns (what the skinny kernel's ``HAND_OFF`` stores, for
    rows a cuBLAS GEMM made)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    h = tl.load(s_ptr + row * n + cols, mask=cols < n, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    tl.store(sg_ptr + row * n + cols, (h * g).to(sg_ptr.dtype.element_ty), mask=cols < n)
    slots = tl.arange(0, BLOCK // PART)
    tl.store(parts_ptr + row * parts_n + slots, tl.sum(tl.reshape(h * h, [BLOCK // PART, PART]), axis=1),
             mask=slots < parts_n)  # fmt: skip


@triton.jit
def _scale_rows_kernel(x_ptr, parts_ptr, out_ptr, n, parts_n, eps, BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    """Program p: ``out[p] = x[p] * rsqrt(sum(parts[p]) / n + eps)`` rounded once (a norm without
    weight whose squares a hand-off gave), for the cuBLAS GEMM that reads it."""
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, SLOTS)
    squares = tl.sum(tl.load(parts_ptr + row * parts_n + slots, mask=slots < parts_n, other=0.0), axis=0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n + cols, mask=cols < n, other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(squares / n + eps)
    tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=cols < n)


def _row_block(n: int) -> tuple[int, int]:
    """(BLOCK, warps) for one program per row of ``n``: whole slots, more warps for wider rows."""
    block = max(triton.next_power_of_2(n), linear_ops.PART)
    return block, min(max(block // 512, 1), 16)


def hand_off_rows(s: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(s, s * g, parts)`` of ``s``'s rows (contiguous, any count) in one kernel."""
    n = s.shape[-1]
    rows = s.reshape(-1, n)
    block, warps = _row_block(n)
    parts_n = triton.cdiv(n, linear_ops.PART)
    sg = torch.empty_like(rows)
    parts = torch.empty((rows.shape[0], parts_n), dtype=torch.float32, device=s.device)
    if rows.shape[0]:
        with device_of(s):
            _hand_off_rows_kernel[(rows.shape[0],)](rows, norm_weight, sg, parts, n, parts_n, BLOCK=block,
                                                    num_warps=warps)  # fmt: skip
    return s, sg.view(s.shape), parts.view(*s.shape[:-1], parts_n)


def scale_rows(x: Tensor, parts: Tensor, eps: float) -> Tensor:
    """``x * rsqrt(sum(parts) / n + eps)`` per row, rounded to ``x``'s dtype (contiguous rows)."""
    n = x.shape[-1]
    rows, slots = x.reshape(-1, n), parts.reshape(-1, parts.shape[-1])
    block, warps = _row_block(n)
    out = torch.empty_like(rows)
    if rows.shape[0]:
        with device_of(x):
            _scale_rows_kernel[(rows.shape[0],)](rows, slots, out, n, slots.shape[-1], eps, BLOCK=block,
                                                 SLOTS=triton.next_power_of_2(slots.shape[-1]), num_warps=warps)  # fmt: skip
    return out.view(x.shape)
