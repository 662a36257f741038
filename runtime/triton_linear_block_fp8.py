"""The ``triton`` provider's block-FP8 GEMM (``fxr.linear_block_fp8``, ``runtime/ops/linear_block_fp8.py``).

    # the dequantizing reference                          # one kernel, FP8 tensor cores
    y = F.linear(dequant(a_q, a_s), dequant(w_q, w_s))    y = linear_block_fp8(a_q, a_s, w_q, w_s, bf16)

A program computes a [BM, BN] tile of the output. Along K it walks the 128-wide blocks the
scales are given for: ``tl.dot`` of the two e4m3 tiles ([BM, 128] of the activations, [128, BN]
of the weight read through its transpose) into float32, times the activation rows' scales for
that block and the weight tile's one scale (``BN`` divides 128, so a tile lies in one weight
block row), added to the float32 accumulator; the sum is rounded once to the output dtype.
Scaling each block's product before adding it is what the per-block scales require, and it also
bounds how long Hopper's FP8 MMA accumulates at its reduced precision (128 products).

Tiles by rows: 16 rows (``tl.dot``'s smallest) up to 16, then 32, 64, 128; ``BN`` 32 up to 16
rows, 64 up to 64 (more programs for a weight-streaming decode GEMM: 128 for N = 4096), 128
above. Compiled for sm90 the 64- and 128-row tiles are FP8 ``wgmma``, the smaller ones
``mma.sync`` on the e4m3 values converted to fp16 (exactly). Not tuned on a GPU yet. Runs under
``TRITON_INTERPRET=1`` on CPU tensors (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxrewrite.runtime.ops.linear_block_fp8 import BLOCK
from fxrewrite.runtime.triton_kernels import device_of


@triton.jit
def _linear_block_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, m, n, k,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """``c[m, n] = sum_kb (a[m, kb] . w[n, kb]) * as[m, kb] * ws[n // BK, kb]`` over the ``k // BK``
    blocks ``kb``; ``a`` [m, k], ``w`` [n, k], ``c`` [m, n] contiguous; ``as`` [m, k / BK],
    ``ws`` [n / BK, k / BK]."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok, col_ok = rows < m, cols < n
    blocks = k // BK
    w_block = (tl.program_id(1) * BN) // BK  # the weight tile row this output tile lies in
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, blocks):
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * k + (kb * BK + ks)[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * k + (kb * BK + ks)[:, None], mask=col_ok[None, :], other=0.0)
        a_s = tl.load(as_ptr + rows * blocks + kb, mask=row_ok, other=0.0)
        w_s = tl.load(ws_ptr + w_block * blocks + kb)
        acc += tl.dot(a, w, out_dtype=tl.float32) * (a_s[:, None] * w_s)
    out = c_ptr + rows[:, None].to(tl.int64) * n + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tiles(m: int) -> tuple[int, int, int]:
    """(BM, BN, num_warps) for ``m`` rows."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    bn = 32 if m <= 16 else 64 if m <= 64 else 128
    return bm, bn, 4 if bm <= 64 else 8


def linear_block_fp8(a_q: Tensor, a_scale: Tensor, w_q: Tensor, w_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    k = a_q.shape[-1]
    n = w_q.shape[0]
    m = a_q.numel() // k
    out = torch.empty((*a_q.shape[:-1], n), dtype=out_dtype, device=a_q.device)
    bm, bn, warps = tiles(m)
    with device_of(a_q):
        _linear_block_fp8_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            a_q, a_scale, w_q, w_scale, out, m, n, k, BM=bm, BN=bn, BK=BLOCK, num_warps=warps, num_stages=3,
        )  # fmt: skip
    return out
