"""The ``triton`` provider's fused mixture-of-experts (``fxr::moe``): five launches, no host sync.

1. ``_route_kernel`` (a program per chunk of tokens): each token's top-k experts and float32
   weights (softmax of the logits, top-k, renormalized if asked; or the given ones), and the
   chunk's count of (token, slot) pairs per expert.
2. ``_align_kernel`` (a program per chunk): each pair's row in an expert-sorted list in which
   every expert's pairs start at a multiple of ``BM`` (the GEMMs' rows per program): the
   expert's offset, plus its pairs in earlier chunks, plus the pair's rank in its own chunk.
   Ranks come from counting, not atomics: the order is the tokens' (deterministic), and the
   interpreter runs it as the GPU does.
3. ``_moe_gemm_kernel`` with ``GATED``: program (b, n) takes the ``BM`` rows of block b, all of
   one expert, gathers their tokens' rows of x and multiplies them by that expert's gate and up
   rows ``n*BN .. (n+1)*BN``; stores ``act(gate) * up`` per pair.
4. The same kernel with ``WEIGHTED``: the down GEMM of the pairs' activations, times each pair's
   routing weight, stored per pair in float32.
5. ``_moe_sum_kernel``: each token's top-k pair rows summed in float32 (slot order), rounded once.

At prefill sizes (128-row blocks) on Hopper the GEMMs read both operands through TMA
(``_moe_gemm_tma_kernel``): ``_gather_kernel`` first copies x's rows into sorted order, and the
gated GEMM stores h in that order for the down GEMM (six launches).

At decode sizes an expert's pairs fit one block: each active expert's weights are read once,
by the programs of its block; blocks beyond the last expert's end return at once (the grid is
sized for the most blocks T tokens can need, so a CUDA graph replays it for any routing).
Rounding follows :func:`fxrewrite.runtime.ops.moe.moe_reference`: GEMM outputs, the activation
and its product in the input dtype; the weighted sum in float32. Under ``TRITON_INTERPRET=1``
the kernels run on CPU tensors (``tests/runtime/test_moe_ops.py``).

    weights, ids, counts = route(logits)              # [T, k] f32, [T, k] i32, [chunks, E]
    rows, ends, totals = align(ids, counts)           # pair -> expert-sorted row, per expert
    h = gemm(x, w_gate_up, GATED)                     # [T*k, I]
    part = gemm(h, w_down, WEIGHTED)                  # [T*k, H] f32
    y = sum(part)                                     # [T, H]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxrewrite.runtime.ops import moe as moe_ops

try:  # host-side TMA descriptors (Triton 3.4+)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernel serves every size
    TensorDescriptor = None

ACT_IDS = {name: i for i, name in enumerate(moe_ops.ACTIVATIONS)}  # "silu" 0, "gelu" 1, "gelu_tanh" 2
ONE_HOT_ELEMENTS = 16384
"""Largest pairs x experts one-hot a program of routing or alignment holds (sets its chunk of tokens)."""
CHUNK_TOKENS = 64
"""Most tokens per routing program, so prefill sizes route in many programs (H200, Mixtral at 4096
tokens: 4 programs of 1024 tokens took 17.7 us)."""
SUM_BLOCK = 1024
GATHER_BLOCK = 256
SMEM_BUDGET = 160 * 1024
"""Shared memory a GEMM program's pipeline stages may take (an H100/H200 SM has 228 KB)."""
SMEM_TMA = 200 * 1024
"""The same for the TMA kernel: its 4 stages of 48 KB, with room for its barriers (227 KB a block)."""
L2_GROUP = 8
"""Blocks of sorted rows whose GEMM programs run together over every output tile (compute-bound
sizes): a group is about one expert's rows at prefill sizes, so its weights stream once."""


# --------------------------------------------------------------------------- kernels


@triton.jit
def _route_kernel(logits_ptr, logits_stride, given_w_ptr, given_ids_ptr, w_ptr, ids_ptr, counts_ptr, T, E,
                  TOKENS: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr, K_BLOCK: tl.constexpr,
                  FROM_LOGITS: tl.constexpr, RENORMALIZE: tl.constexpr):  # fmt: skip
    """Program c: tokens ``c*TOKENS ..``: weights [T, K] float32 and ids [T, K] int32, and
    ``counts[c, e]``, the pairs of these tokens routed to expert e. Top-k picks the largest
    probability, the lowest expert among equals."""
    c = tl.program_id(0)
    t = c * TOKENS + tl.arange(0, TOKENS)
    tmask = t < T
    e = tl.arange(0, E_BLOCK)
    slot = tl.arange(0, K_BLOCK)
    out = t[:, None].to(tl.int64) * K + slot[None, :]
    omask = tmask[:, None] & (slot < K)[None, :]
    if FROM_LOGITS:
        logits = tl.load(logits_ptr + t[:, None].to(tl.int64) * logits_stride + e[None, :],
                         mask=tmask[:, None] & (e < E)[None, :], other=float("-inf")).to(tl.float32)  # fmt: skip
        logits = tl.where(tmask[:, None], logits, 0.0)  # rows past T: finite, never stored
        p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        p = tl.where((e < E)[None, :], p, -1.0)  # columns past E are never chosen
        weights = tl.zeros([TOKENS, K_BLOCK], tl.float32)
        ids = tl.zeros([TOKENS, K_BLOCK], tl.int32)
        for j in tl.static_range(K):
            best = tl.max(p, axis=1)
            idx = tl.min(tl.where(p == best[:, None], e[None, :], E_BLOCK), axis=1)
            weights = tl.where(slot[None, :] == j, best[:, None], weights)
            ids = tl.where(slot[None, :] == j, idx[:, None], ids)
            p = tl.where(e[None, :] == idx[:, None], -2.0, p)
    else:
        weights = tl.load(given_w_ptr + out, mask=omask, other=0.0).to(tl.float32)
        ids = tl.load(given_ids_ptr + out, mask=omask, other=0).to(tl.int32)
    if RENORMALIZE:
        weights = weights / tl.where(tmask, tl.sum(weights, axis=1), 1.0)[:, None]
    tl.store(w_ptr + out, weights, mask=omask)
    tl.store(ids_ptr + out, ids, mask=omask)
    hits = tl.where(omask, ids, E_BLOCK)  # padding matches no expert
    counts = tl.zeros([E_BLOCK], tl.int32)
    for j in tl.static_range(K):
        col = tl.sum(tl.where(slot[None, :] == j, hits, 0), axis=1)  # [TOKENS]: slot j's experts
        counts += tl.sum((col[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c * E_BLOCK + e, counts)


@triton.jit
def _align_kernel(ids_ptr, counts_ptr, rows_ptr, ends_ptr, totals_ptr, n_pairs, n_chunks, E,
                  PAIRS: tl.constexpr, PAIRS_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
                  CHUNK_BLOCK: tl.constexpr, BM: tl.constexpr):  # fmt: skip
    """Program c: ``rows[p]`` for the pairs ``p = c*PAIRS ..`` (pair = token * k + slot): the
    start of its expert's segment (each padded to a multiple of ``BM``), plus that expert's pairs
    in chunks before c, plus the pair's rank among this chunk's pairs of that expert. Program 0
    also stores each expert's padded segment end and pair count."""
    c = tl.program_id(0)
    e = tl.arange(0, E_BLOCK)
    totals = tl.zeros([E_BLOCK], tl.int32)
    before = tl.zeros([E_BLOCK], tl.int32)
    for c0 in range(0, n_chunks, CHUNK_BLOCK):
        ch = c0 + tl.arange(0, CHUNK_BLOCK)
        counts = tl.load(counts_ptr + ch[:, None] * E_BLOCK + e[None, :], mask=(ch < n_chunks)[:, None], other=0)
        totals += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((ch < c)[:, None], counts, 0), axis=0)
    padded = (totals + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    if c == 0:
        tl.store(ends_ptr + e, ends)
        tl.store(totals_ptr + e, totals)
    i = tl.arange(0, PAIRS_BLOCK)
    p = c * PAIRS + i
    pmask = (i < PAIRS) & (p < n_pairs)
    ids = tl.load(ids_ptr + p, mask=pmask, other=E_BLOCK)
    hit = ids[:, None] == e[None, :]  # [PAIRS, E_BLOCK]
    rank = tl.sum(tl.where(hit, tl.cumsum(hit.to(tl.int32), axis=0) - 1, 0), axis=1)
    base = ends - padded + before
    row = tl.sum(tl.where(hit, base[None, :], 0), axis=1) + rank
    tl.store(rows_ptr + row, p, mask=pmask)


@triton.jit
def _activation(gate, ACT: tl.constexpr):
    """silu (0), gelu erf (1) or gelu tanh (2) of float32 ``gate``; divisions approximate."""
    if ACT == 0:
        y = gate / (1.0 + tl.exp(-gate))
    elif ACT == 1:
        y = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        y = gate * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * inner)))  # 0.5 * (1 + tanh(inner))
    return y


@triton.jit
def _block_of(pid, n_blocks, group, N, ends_ptr, totals_ptr, E, E_BLOCK: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr):  # fmt: skip
    """Program ``pid`` of a GEMM: (block b, output tile n, the block's expert, its valid rows).
    Programs run ``group`` blocks at a time over every n (blocks fastest), so the blocks of one
    expert and its weight tiles are read from L2 while they are hot; ``group = n_blocks`` is
    blocks fastest over the whole grid (decode: every active expert's tile n at once). The expert
    is E for blocks past the last expert's end."""
    per_group = group * tl.cdiv(N, BN)
    first = (pid // per_group) * group
    rows_in_group = tl.minimum(n_blocks - first, group)
    b = first + (pid % per_group) % rows_in_group
    n_tile = (pid % per_group) // rows_in_group
    expert, valid = _expert_of(b, ends_ptr, totals_ptr, E, E_BLOCK, BM)
    return b, n_tile, expert, valid


@triton.jit
def _expert_of(b, ends_ptr, totals_ptr, E, E_BLOCK: tl.constexpr, BM: tl.constexpr):
    """Block b's expert (E past the last expert's end) and how many of its ``BM`` rows are pairs."""
    e = tl.arange(0, E_BLOCK)
    ends = tl.load(ends_ptr + e, mask=e < E, other=2147483647)
    expert = tl.sum((ends <= b * BM).to(tl.int32), axis=0)
    start = tl.sum(tl.where(e == expert - 1, ends, 0), axis=0)
    valid = tl.load(totals_ptr + expert, mask=expert < E, other=0) - (b * BM - start)
    return expert, valid


@triton.jit
def _epilogue(acc, acc_up, weights_ptr, pair, mmask, alpha, limit, dtype: tl.constexpr, GATED: tl.constexpr,
              ACT: tl.constexpr, WEIGHTED: tl.constexpr):  # fmt: skip
    """The reference's roundings: GEMM outputs in ``dtype``; gated: ``act(gate) * up`` in
    ``dtype`` (the clamped SwiGLU (3) rounds after each of its steps); weighted: times the
    pair's float32 routing weight."""
    y = acc.to(dtype).to(tl.float32)
    if GATED:
        up = acc_up.to(dtype).to(tl.float32)
        if ACT == 3:
            g = tl.minimum(y, limit)
            u = tl.minimum(tl.maximum(up, -limit), limit)
            s = (1.0 / (1.0 + tl.exp(-(g * alpha).to(dtype).to(tl.float32)))).to(dtype).to(tl.float32)
            y = (u + 1.0).to(dtype).to(tl.float32) * (g * s).to(dtype).to(tl.float32)
        else:
            y = _activation(y, ACT).to(dtype).to(tl.float32) * up
    if WEIGHTED:
        y = y * tl.load(weights_ptr + pair, mask=mmask, other=0.0)[:, None]
    return y


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, rows_ptr, ends_ptr, totals_ptr, weights_ptr, N, K, E,
                     a_stride, w_stride_e, w_stride_n, w_stride_k, w_up, out_stride, n_blocks, group,
                     bias_ptr, bias_stride_e, bias_stride_n, bias_up, alpha, limit,
                     A_ROW_DIV: tl.constexpr, E_BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                     WEIGHTED: tl.constexpr, SCALE_A: tl.constexpr = False, HAS_BIAS: tl.constexpr = False):  # fmt: skip
    """Program (b, n) (:func:`_block_of`): block b's ``BM`` sorted rows, all pairs of one expert,
    times that expert's weight rows ``n*BN ..`` (and with ``GATED`` the up rows, ``w_up``
    elements further). A row of ``a`` is ``pair // A_ROW_DIV`` (x: the pair's token; h: the pair
    itself); the output row is the pair. Weights may be strided along k (a transposed view:
    ``w_stride_k`` != 1, ``w_stride_n`` == 1). ``SCALE_A``: each row of ``a`` times its pair's
    routing weight first, rounded to ``a``'s dtype (the weight on the expert's input).
    ``HAS_BIAS``: the expert's bias added to each rounded GEMM output (the up bias ``bias_up``
    elements after the gate's), rounded again. Interleaved gate/up rows: ``w_stride_n`` twice
    the row stride, ``w_up`` one row."""
    b, n_tile, expert, valid = _block_of(tl.program_id(0), n_blocks, group, N, ends_ptr, totals_ptr, E, E_BLOCK,
                                         BM, BN)  # fmt: skip
    if expert < E:
        m = tl.arange(0, BM)
        mmask = m < valid
        pair = tl.load(rows_ptr + b * BM + m, mask=mmask, other=0).to(tl.int64)
        a_rows = a_ptr + (pair // A_ROW_DIV) * a_stride
        cols = n_tile * BN + tl.arange(0, BN)
        nmask = cols < N
        w_rows = w_ptr + expert.to(tl.int64) * w_stride_e + cols.to(tl.int64) * w_stride_n
        acc = tl.zeros([BM, BN], tl.float32)
        acc_up = acc
        if SCALE_A:
            scale = tl.load(weights_ptr + pair, mask=mmask, other=0.0)[:, None]
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            a_mask, w_mask = mmask[:, None], nmask[:, None]
            if not EVEN_K:
                a_mask, w_mask = a_mask & (ks < K)[None, :], w_mask & (ks < K)[None, :]
            a = tl.load(a_rows[:, None] + ks[None, :], mask=a_mask, other=0.0)
            if SCALE_A:
                a = (a.to(tl.float32) * scale).to(a_ptr.dtype.element_ty)
            w = tl.load(w_rows[:, None] + ks[None, :] * w_stride_k, mask=w_mask, other=0.0)
            acc += tl.dot(a, tl.trans(w))
            if GATED:
                u = tl.load(w_rows[:, None] + w_up + ks[None, :] * w_stride_k, mask=w_mask, other=0.0)
                acc_up += tl.dot(a, tl.trans(u))
        if HAS_BIAS:
            dt = a_ptr.dtype.element_ty
            b_cols = bias_ptr + expert.to(tl.int64) * bias_stride_e + cols * bias_stride_n
            acc = (acc.to(dt).to(tl.float32) + tl.load(b_cols, mask=nmask, other=0.0).to(tl.float32)[None, :]).to(dt)
            if GATED:
                b_up = tl.load(b_cols + bias_up, mask=nmask, other=0.0).to(tl.float32)[None, :]
                acc_up = (acc_up.to(dt).to(tl.float32) + b_up).to(dt)
        y = _epilogue(acc, acc_up, weights_ptr, pair, mmask, alpha, limit, a_ptr.dtype.element_ty, GATED, ACT, WEIGHTED)
        out = out_ptr + pair[:, None] * out_stride + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _gather_kernel(x_ptr, x_stride, out_ptr, rows_ptr, ends_ptr, totals_ptr, H, E, TOP_K: tl.constexpr,
                   E_BLOCK: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr):  # fmt: skip
    """Program (b, c): block b's rows of x in sorted order, columns ``c*BH ..``; a padding row of
    an expert's last block gets zeros (its GEMM rows are then zeros, never stored)."""
    b = tl.program_id(0)
    expert, valid = _expert_of(b, ends_ptr, totals_ptr, E, E_BLOCK, BM)
    if expert < E:
        m = tl.arange(0, BM)
        mmask = m < valid
        pair = tl.load(rows_ptr + b * BM + m, mask=mmask, other=0).to(tl.int64)
        cols = tl.program_id(1) * BH + tl.arange(0, BH)
        cmask = (cols < H)[None, :]
        v = tl.load(x_ptr + (pair // TOP_K)[:, None] * x_stride + cols[None, :], mask=mmask[:, None] & cmask, other=0.0)
        tl.store(out_ptr + (b * BM + m).to(tl.int64)[:, None] * H + cols[None, :], v, mask=cmask)


@triton.jit
def _moe_gemm_tma_kernel(a_desc, w_desc, out_ptr, rows_ptr, ends_ptr, totals_ptr, weights_ptr, N, K, E,
                         out_stride, n_blocks, group, alpha, limit, E_BLOCK: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                         WEIGHTED: tl.constexpr):  # fmt: skip
    """The GEMMs of prefill sizes with both operands through TMA (Hopper's tensor memory
    accelerator; out-of-range reads are zeros): ``a`` in sorted order (x gathered by
    :func:`_gather_kernel`; h as the gated GEMM stores it), ``w`` every expert's rows stacked
    ``[E * rows, K]``. The gated GEMM stores its rows in sorted order, padding rows included
    (zeros); the down GEMM stores each pair's row. A weight tile that runs past an expert's rows
    reads the next one's: those columns are never stored."""
    b, n_tile, expert, valid = _block_of(tl.program_id(0), n_blocks, group, N, ends_ptr, totals_ptr, E, E_BLOCK,
                                         BM, BN)  # fmt: skip
    if expert < E:
        m = tl.arange(0, BM)
        mmask = m < valid
        w_row = expert * (2 * N if GATED else N) + n_tile * BN
        acc = tl.zeros([BM, BN], tl.float32)
        acc_up = acc
        for k0 in range(0, K, BK):
            a = a_desc.load([b * BM, k0])
            acc += tl.dot(a, tl.trans(w_desc.load([w_row, k0])))
            if GATED:
                acc_up += tl.dot(a, tl.trans(w_desc.load([w_row + N, k0])))
        cols = n_tile * BN + tl.arange(0, BN)
        nmask = (cols < N)[None, :]
        if GATED:
            y = _epilogue(acc, acc_up, weights_ptr, m, mmask, alpha, limit, out_ptr.dtype.element_ty, GATED, ACT,
                          WEIGHTED)  # fmt: skip
            out = out_ptr + (b * BM + m).to(tl.int64)[:, None] * out_stride + cols[None, :]
            tl.store(out, y.to(out_ptr.dtype.element_ty), mask=nmask)
        else:
            pair = tl.load(rows_ptr + b * BM + m, mask=mmask, other=0).to(tl.int64)
            y = _epilogue(acc, acc_up, weights_ptr, pair, mmask, alpha, limit, a_desc.dtype, GATED, ACT, WEIGHTED)
            out = out_ptr + pair[:, None] * out_stride + cols[None, :]
            tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask)


@triton.jit
def _moe_sum_kernel(part_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, c): ``out[t, cols] = sum_j part[t*K + j, cols]`` in float32, slot order."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(part_ptr + (t * K + j) * H + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launch configuration


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of one ``_moe_gemm_kernel`` call: output columns per program ``bn``,
    k per step ``bk``, warps, pipeline stages."""

    bn: int
    bk: int
    warps: int = 4
    stages: int = 3
    group: int = 0  # blocks per L2 group (0: all blocks, blocks fastest)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """``bm`` sorted rows per program (each expert's segment is padded to it), and the two GEMMs'
    launch parameters."""

    bm: int
    gate_up: GemmConfig
    down: GemmConfig
    tma: bool = False  # operands through TMA (x gathered into sorted order first), where :func:`tma_ready`


def block_rows(pairs: int, experts: int) -> int:
    """``BM``: 16 (``tl.dot``'s smallest tile) while an expert gets at most 16 pairs on average
    (decode: a block per active expert, its weights read once), growing to 128 as experts fill."""
    per_expert = pairs / experts
    return next((bm for bm in (16, 32, 64) if per_expert <= bm), 128)


def _gemm_config(bm: int, n: int, active: int, sms: int, gated: bool, tma: bool) -> GemmConfig:
    """Memory-bound (``bm`` <= 32): the widest ``bn`` that still gives every SM a program over
    the active experts, deep k steps (a stage of the gated kernel holds gate and up tiles: half
    as deep). Compute-bound: 64 or 128 columns (the gated kernel holds two accumulators), in L2
    groups, as many stages (2 to 4) as fit ``SMEM_BUDGET`` (the best of ``bench_moe.py --sweep`` at
    4096 tokens on the H200); through TMA at 128 rows: 4 stages in L2 groups, the down GEMM 256
    columns wide (the best of an H200 sweep at 4096 tokens, bench/RESULTS.md)."""
    if tma and bm == 128:
        return GemmConfig(128 if gated else 256, 64, 8, 4, L2_GROUP)
    if bm <= 32:
        bn = next((bn for bn in (128, 64) if active * triton.cdiv(n, bn) >= sms), 32)
        bk = (64 if bn == 128 else 128) if gated else (128 if bn == 128 else 256)
        warps = 4
    else:  # 128 x 128 tiles at 128 rows; the gated GEMM's two accumulators then fill 8 warps, ungrouped
        bn, bk, warps = 128 if bm == 128 or not gated else 64, 64, 8 if bm == 128 else 4
    stage = bk * (bm + bn * (2 if gated else 1)) * 2  # bytes of 16-bit tiles per stage
    group = 0 if bm <= 32 or (gated and bm == 128) else L2_GROUP
    return GemmConfig(bn, bk, warps, max(2, min(4, SMEM_BUDGET // stage)), group)


def config(tokens: int, top_k: int, experts: int, width: int, hidden: int, sms: int, tma: bool = False) -> MoeConfig:
    """The launch configuration for ``tokens`` tokens of ``top_k`` experts each, ``experts``
    experts of expert width ``width`` and hidden size ``hidden``, on a device of ``sms`` SMs, with
    ``tma`` where the operands allow it (:func:`tma_ready`): the TMA kernel serves 128-row blocks
    (prefill sizes; at decode sizes it measured no faster). Heuristic; ``bench/bench_moe.py
    --sweep`` measures alternatives."""
    pairs = tokens * top_k
    bm = block_rows(pairs, experts)
    active = min(experts, pairs)
    gemms = (_gemm_config(bm, n, active, sms, gated, tma) for n, gated in ((width, True), (hidden, False)))
    return MoeConfig(bm, *gemms, tma=tma and bm == 128)


def tma_ready(x: Tensor, *weights: Tensor) -> bool:
    """Whether the TMA kernel can read these operands: Triton's host descriptors, a Hopper or
    later device for ``x`` (any CPU tensor: the interpreter), contiguous expert weights whose rows
    (and so the sorted copies of x and h) are multiples of 16 bytes. x itself is read by pointers
    (gathered)."""
    if TensorDescriptor is None or (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] < 9):
        return False
    return all(w.is_contiguous() and w.shape[-1] * w.element_size() % 16 == 0 and w.data_ptr() % 16 == 0
               for w in weights)  # fmt: skip


@functools.cache
def _sms(device: torch.device) -> int:
    # CPU tensors run only under the interpreter: any count serves, take an H100's
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _device_of(x: Tensor) -> contextlib.AbstractContextManager[object]:
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


# --------------------------------------------------------------------------- launcher


def moe(
    x: Tensor, router_logits: Tensor | None, topk_weights: Tensor | None, topk_ids: Tensor | None,
    w_gate_up: Tensor, w_down: Tensor, top_k: int, renormalize: bool, activation: str = "silu",
    weight_input: bool = False, b_gate_up: Tensor | None = None, b_down: Tensor | None = None,
    interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0, *, cfg: MoeConfig | None = None,
) -> Tensor:  # fmt: skip
    """``fxr::moe`` (see :mod:`fxrewrite.runtime.ops.moe`); ``cfg`` overrides :func:`config`. The
    weight on the experts' input, biases and interleaved gate/up take the pointer kernels (the
    TMA kernel reads x unscaled and stores GEMM outputs without biases)."""
    experts, width = moe_ops.check_args(x, router_logits, topk_weights, topk_ids, w_gate_up, w_down, top_k,
                                        activation, b_gate_up, b_down)  # fmt: skip
    hidden = x.shape[-1]
    xs = x.reshape(-1, hidden)
    xs = xs if xs.stride(-1) == 1 else xs.contiguous()
    tokens, pairs, dev = xs.shape[0], xs.shape[0] * top_k, x.device
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=dev)
    if tokens == 0:
        return out.view(x.shape)
    plain = not weight_input and b_gate_up is None and b_down is None and not interleaved
    ready = tma_ready(xs, w_gate_up, w_down) and plain
    cfg = cfg or config(tokens, top_k, experts, width, hidden, _sms(dev), ready)
    e_block, k_block = triton.next_power_of_2(experts), triton.next_power_of_2(top_k)
    chunk = max(1, min(triton.next_power_of_2(tokens), ONE_HOT_ELEMENTS // (e_block * k_block), CHUNK_TOKENS))
    chunks = triton.cdiv(tokens, chunk)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=dev)
    counts = torch.empty((chunks, e_block), dtype=torch.int32, device=dev)
    logits = router_logits.reshape(-1, experts) if router_logits is not None else None
    if logits is not None and logits.stride(-1) != 1:
        logits = logits.contiguous()
    given_w = topk_weights.reshape(-1, top_k).contiguous() if topk_weights is not None else weights
    given_ids = topk_ids.reshape(-1, top_k).contiguous() if topk_ids is not None else ids
    bm = cfg.bm
    blocks = triton.cdiv(pairs + min(experts, pairs) * (bm - 1), bm)  # the most any routing needs
    rows = torch.empty(blocks * bm, dtype=torch.int32, device=dev)
    ends = torch.empty(e_block, dtype=torch.int32, device=dev)
    totals = torch.empty(e_block, dtype=torch.int32, device=dev)
    tma = cfg.tma and ready
    h = torch.empty((blocks * bm if tma else pairs, width), dtype=x.dtype, device=dev)  # sorted rows with TMA
    part = torch.empty((pairs, hidden), dtype=torch.float32, device=dev)
    common = {"E_BLOCK": e_block, "BM": bm}
    with _device_of(x):
        _route_kernel[(chunks,)](
            logits if logits is not None else weights, logits.stride(0) if logits is not None else 0, given_w,
            given_ids, weights, ids, counts, tokens, experts, TOKENS=chunk, E_BLOCK=e_block, K=top_k,
            K_BLOCK=k_block, FROM_LOGITS=logits is not None, RENORMALIZE=renormalize,
        )  # fmt: skip
        _align_kernel[(chunks,)](
            ids, counts, rows, ends, totals, pairs, chunks, experts, PAIRS=chunk * top_k,
            PAIRS_BLOCK=chunk * k_block,
            CHUNK_BLOCK=min(triton.next_power_of_2(chunks), max(1, ONE_HOT_ELEMENTS // e_block)), **common,
        )  # fmt: skip
        if tma:
            _gemms_tma(xs, w_gate_up, w_down, h, part, rows, ends, totals, weights, cfg, top_k, activation, blocks,
                       alpha, limit)  # fmt: skip
        else:
            gemms = ((xs, w_gate_up, b_gate_up, h, cfg.gate_up, True), (h, w_down, b_down, part, cfg.down, False))
            for a, w, b, dst, g, gated in gemms:
                n, k = dst.shape[1], a.shape[1]
                step = 2 if gated and interleaved else 1  # interleaved: gate rows 0, 2, ..., up rows 1, 3, ...
                w_rows = (step * w.stride(1), w.stride(1) if step == 2 else n * w.stride(1))
                b_cols = (0, 0, 0) if b is None else (b.stride(0), step * b.stride(1), b.stride(1) * (1 if step == 2 else n))
                _moe_gemm_kernel[(blocks * triton.cdiv(n, g.bn),)](
                    a, w, dst, rows, ends, totals, weights, n, k, experts, a.stride(0), w.stride(0), w_rows[0],
                    w.stride(2), w_rows[1], dst.stride(0), blocks, min(g.group or blocks, blocks),
                    b if b is not None else weights, *b_cols, float(alpha), float(limit), A_ROW_DIV=top_k if gated else 1,
                    BN=g.bn, BK=g.bk, EVEN_K=k % g.bk == 0, GATED=gated, ACT=ACT_IDS[activation],
                    WEIGHTED=not gated and not weight_input, SCALE_A=gated and weight_input, HAS_BIAS=b is not None,
                    num_warps=g.warps, num_stages=g.stages, **common,
                )  # fmt: skip
        _moe_sum_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK))](part, out, hidden, K=top_k, BLOCK=SUM_BLOCK)
    return out.view(x.shape)


def _gemms_tma(xs: Tensor, w_gate_up: Tensor, w_down: Tensor, h: Tensor, part: Tensor, rows: Tensor, ends: Tensor,
               totals: Tensor, weights: Tensor, cfg: MoeConfig, top_k: int, activation: str, blocks: int,
               alpha: float = 1.702, limit: float = 7.0) -> None:  # fmt: skip
    """x gathered into sorted order, then both GEMMs of :func:`_moe_gemm_tma_kernel`: ``h`` in
    sorted order, ``part`` per pair."""
    experts, hidden, bm = w_gate_up.shape[0], xs.shape[1], cfg.bm
    e_block = triton.next_power_of_2(experts)
    x_sorted = torch.empty((blocks * bm, hidden), dtype=xs.dtype, device=xs.device)
    _gather_kernel[(blocks, triton.cdiv(hidden, GATHER_BLOCK))](
        xs, xs.stride(0), x_sorted, rows, ends, totals, hidden, experts, TOP_K=top_k, E_BLOCK=e_block, BM=bm,
        BH=GATHER_BLOCK,
    )  # fmt: skip
    for a, w, dst, g, gated in ((x_sorted, w_gate_up, h, cfg.gate_up, True), (h, w_down, part, cfg.down, False)):
        n = dst.shape[1]
        a_desc = TensorDescriptor.from_tensor(a, [bm, g.bk])
        w_desc = TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [g.bn, g.bk])
        _moe_gemm_tma_kernel[(blocks * triton.cdiv(n, g.bn),)](
            a_desc, w_desc, dst, rows, ends, totals, weights, n, a.shape[1], experts, dst.stride(0), blocks,
            min(g.group or blocks, blocks), float(alpha), float(limit), E_BLOCK=e_block, BM=bm, BN=g.bn, BK=g.bk,
            GATED=gated,
            ACT=ACT_IDS[activation], WEIGHTED=not gated, num_warps=g.warps, num_stages=g.stages,
        )  # fmt: skip
