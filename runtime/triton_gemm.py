"""The decode-size GEMM of the ``triton`` provider, and what it fuses into its prologue and epilogue.

At decode sizes (at most ``TALL_ROWS`` rows; ``SKINNY_ROWS`` with a fusion beyond SiLU-and-mul)
a linear reads its whole weight to produce a few rows: one launch that streams the weight once
is the floor, and the small ops around it cost launches and round trips through memory, not
arithmetic. ``_skinny_linear_kernel`` gives each program ``BN`` output columns and walks the
whole k dimension for every row, so a program sees whole rows of ``x``: what a row-wise op before
the GEMM needs, and each output element once at the end: what an elementwise op after it needs.
Its constexpr switches:

- ``GATED``: ``silu_and_mul`` of the output (an MLP's merged gate and up projection): the program
  also computes the up columns ``n`` rows further down the weight and stores ``silu(gate) * up``.
- ``NORM``: RMSNorm of ``x`` before the GEMM (``linear(rms_norm(x, g, eps), w)``): the sum of
  squares of each row is accumulated in the k loop from the tiles it loads anyway, the norm
  weight ``g`` multiplies the A tiles, and the per-row ``rsqrt(mean(x^2) + eps)`` scales the
  accumulator in the epilogue (it distributes over the dot product).
- ``RESIDUAL``: ``linear(x, w) + residual`` stored (into ``residual`` itself for the in-place op):
  the residual stream's add, in the epilogue of the GEMM that produces the addend.
- ``HAND_OFF`` (with ``RESIDUAL``): the work of the next RMSNorm that needs whole rows, done
  where the rows are made: the sum ``s`` rounded and stored, ``s * g`` (the norm's weight)
  rounded and stored, and each row's sums of squares of ``s`` over blocks of ``PART`` columns
  (float32, one slot per block: no atomics, no buffer to zero). ``PARTS`` > 0 is the reading
  side: ``NORM`` whose sum of squares is the sum of a row's slots, so its k loop only streams
  (``x * g`` is already the A operand, the per-row scale stays in the epilogue). The squares in
  the k loop cost a third of a decode GEMM's time (bench/RESULTS.md, issue 30); the hand-off
  costs the producing GEMM's epilogue a few stores.
- ``HALF`` (rotary, NeoX halves of heads of ``2 * HALF`` columns): a program computes a block of
  a head's first half and the partner block ``HALF`` columns further (a second accumulator, as
  ``GATED`` has: each weight row is still read once), rounds both and rotates them by the angles
  of each row's position in the first ``rotated`` columns (q's and k's heads), as
  ``fxr.rotary_embedding`` would after the GEMM.
- ``FP8`` (``fxr.linear_fp8``): e4m3 ``x`` and weight with per-tensor scales, as
  ``torch._scaled_mm`` takes them: each tile widened to float16 in registers (exact), the sum
  float32, the product of the scales applied in the epilogue. ``OUT_QUANT`` (with ``GATED``:
  ``fxr.linear_fp8_silu_and_mul_quant``): the output quantized to e4m3 with a static scale before
  it is stored, the next FP8 GEMM's input. ``QUANT_A`` (with ``PARTS``:
  ``fxr.rms_norm_quant_linear_fp8``): ``x`` is a hand-off's ``s * g`` in bf16/fp16, normed by
  each row's scale from its slots and quantized to e4m3 in the prologue, tile by tile: the norm's
  quantization in the GEMM that reads it (issue 30, item 5; ``Config.fp8_norm_prologue``, off:
  bench/RESULTS.md).

    # before: three launches at decode                  # after: one each
    n = rms_norm(x, g, eps); y = linear(n, w)            y = rms_norm_linear(x, g, eps, w)
    s = linear(a, w_o); s += r (and a norm, in place)    r = linear_add_(a, w_o, r)
    s = linear(a, w_o) + r; y = linear(rms_norm(s, g), w)   s, sg, parts = linear_add_rms_parts(a, w_o, r, g)
                                                             y = rms_norm_linear(sg, None, eps, w, parts=parts)

Rounding: the accumulator is float32 and is rounded once at the store (with ``GATED``, the gate,
the SiLU and the product are each rounded to the dtype as ``silu_and_mul(linear(...))`` rounds
them). With ``NORM`` the A tile is ``x * g`` rounded to the dtype (the spec rounds ``x * r``,
then ``g * that``: one rounding where it has two, the per-row scale exact in float32); with
``RESIDUAL`` the sum is rounded once (the spec rounds the product, then the sum; cuBLAS's
``addmm``, above 16 rows, rounds once too). ``ROWS`` rows make one tile (:func:`row_tile`: 16,
32 or 64; each has its launch configurations, :func:`skinny_config`). Launches are built ahead
of their first call (:func:`prepare`).

Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (the tests use float16: the
interpreter multiplies bfloat16 ``tl.dot`` operands wrongly).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxrewrite.runtime.ops import linear as linear_ops
from fxrewrite.runtime.triton_kernels import device_of

# Rows held by one program (tl.dot's smallest tile).
SKINNY_ROWS: tl.constexpr = tl.constexpr(linear_ops.SKINNY_ROWS)
# Columns per slot of a hand-off's sums of squares (the smallest BN: every program fills whole slots).
PART: tl.constexpr = tl.constexpr(linear_ops.PART)


@triton.jit(do_not_specialize=["rows", "eps"])  # one build per launch configuration serves a tile's row counts
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, g_ptr, r_ptr, pos_ptr, cs_ptr, sg_ptr, parts_ptr, sa_ptr,
                          sb_ptr, qs_ptr, rows, n, k, x_stride, w_stride, y_stride, r_stride, eps, rotated, parts_n,
                          BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                          GATED: tl.constexpr, NORM: tl.constexpr, NORM_WEIGHT: tl.constexpr, RESIDUAL: tl.constexpr,
                          HALF: tl.constexpr = 0, HAND_OFF: tl.constexpr = False, PARTS: tl.constexpr = 0,
                          PDL: tl.constexpr = False, FP8: tl.constexpr = False, OUT_QUANT: tl.constexpr = False,
                          ROUND: tl.constexpr = None, QUANT_A: tl.constexpr = False,
                          ROWS: tl.constexpr = SKINNY_ROWS):  # fmt: skip
    """Program p: ``y[:, p*BN : (p+1)*BN] = x @ w[p*BN : (p+1)*BN].T (+ bias)`` for all (at most
    ``ROWS``) rows at once, walking k in blocks of ``BK``: every weight element is read once.

    ``GATED``: ``w`` holds 2n rows, gate then up; the program also computes the up columns and
    stores ``silu(gate) * up``. ``NORM``: ``x`` is RMS-normalized first (with ``NORM_WEIGHT``,
    scaled by ``g``); ``RESIDUAL``: ``r`` is added before the store (``y`` may be ``r``).
    ``HALF`` > 0 (rotary, heads of ``2 * HALF`` columns): program p computes ``BN`` columns of a
    head's first half and the ``BN`` columns ``HALF`` further (the pairs RoPE's NeoX layout
    rotates together) and, in the first ``rotated`` columns, rotates each pair by the angles of
    its row's position: ``cos_sin = cs[pos[row]]`` (``HALF`` cosines, then ``HALF`` sines).
    ``HAND_OFF``: also ``sg = (y * g)`` and ``parts[row, j] = sum(y[row, j*PART : (j+1)*PART]^2)``
    (``parts_n`` slots a row); ``PARTS`` (a power of two >= ``parts_n``): ``NORM``'s sum of
    squares is ``sum(parts[row, :parts_n])``, not computed from ``x``. ``PDL``: launched as a
    programmatic dependent launch (:func:`pdl`): it waits for the kernel before it to finish before
    it reads anything, and lets the next one launch once its k loop is done. ``FP8``: ``x`` and
    ``w`` in float8_e4m3fn, the product scaled by ``sa[0] * sb[0]`` (``torch._scaled_mm`` with
    per-tensor scales); each tile is widened to float16 (exact: every e4m3 value is one) for the
    dot, so each product is exact and the sum float32, as in the FP8 MMA. ``OUT_QUANT``: the
    output, rounded to ``ROUND`` as the unfused op's would be, is quantized to e4m3 with the static
    scale ``qs[0]`` (``quant_fp8_static``: divided, clamped to +-448, rounded to nearest even) and
    stored so: the next FP8 GEMM's input, written once. ``QUANT_A`` (with ``FP8``, ``NORM`` and
    ``PARTS``): ``x`` is a hand-off's ``s * g`` in its dtype, and the A tiles are the norm's
    output quantized as the GEMM's input: each row's scale from its slots before the k loop, then
    ``e4m3(clamp(round(x * scale) * (1 / sa[0])))`` per tile (``sa``: the quantization's scale)."""
    pid = tl.program_id(0)
    if HALF > 0:
        first = (pid // (HALF // BN)) * (2 * HALF) + (pid % (HALF // BN)) * BN
        cols = first + tl.arange(0, BN)
    else:
        cols = pid * BN + tl.arange(0, BN)
    r = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BN], tl.float32)
    if GATED or HALF > 0:  # a second block of columns: the up half, or the rotation's partners
        acc_up = tl.zeros([ROWS, BN], tl.float32)
        partner = n + cols if GATED else cols + HALF
    if PDL:  # before any read: the kernel before may still be writing
        tl.extra.cuda.gdc_wait()
    if NORM and PARTS == 0:
        squares = tl.zeros([ROWS], tl.float32)
    if QUANT_A:  # the norm's per-row scale first: each A tile is quantized as it is loaded
        slots = tl.arange(0, PARTS)
        squares = tl.sum(tl.load(parts_ptr + r[:, None] * parts_n + slots[None, :],
                                 mask=(r < rows)[:, None] & (slots < parts_n)[None, :], other=0.0), axis=1)
        row_scale = tl.math.rsqrt(squares / k + eps)[:, None]
        inverse = 1.0 / tl.load(sa_ptr)  # a product per element, not a division (see quant_input)
    for k0 in range(0, k, BK):
        ks = k0 + tl.arange(0, BK)
        x_mask, w_mask = (r < rows)[:, None], (cols < n)[:, None]
        if not EVEN_K:
            x_mask, w_mask = x_mask & (ks < k)[None, :], w_mask & (ks < k)[None, :]
        x = tl.load(x_ptr + r[:, None] * x_stride + ks[None, :], mask=x_mask, other=0.0)
        if QUANT_A:  # rms_norm's output rounded to x's dtype, then quant_fp8_static's e4m3, widened
            normed = (x.to(tl.float32) * row_scale).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = tl.clamp(normed * inverse, -448.0, 448.0).to(tl.float8e4nv).to(tl.float16)
        elif FP8:
            x = x.to(tl.float16)
        if NORM and PARTS == 0:
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            if NORM_WEIGHT:
                g = tl.load(g_ptr + ks, mask=ks < k, other=0.0).to(tl.float32)
                x = (xf * g[None, :]).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * w_stride + ks[None, :], mask=w_mask, other=0.0)
        if FP8:
            w = w.to(tl.float16)
        acc += tl.dot(x, tl.trans(w))
        if GATED or HALF > 0:
            u = tl.load(w_ptr + partner[:, None].to(tl.int64) * w_stride + ks[None, :], mask=w_mask, other=0.0)
            if FP8:
                u = u.to(tl.float16)
            acc_up += tl.dot(x, tl.trans(u))
    if PDL:  # the next kernel may be scheduled now; it waits for this one's stores
        tl.extra.cuda.gdc_launch_dependents()
    dtype = y_ptr.dtype.element_ty
    if OUT_QUANT:  # y is e4m3: the values are rounded as the unquantized output's dtype first
        dtype = ROUND
    if NORM and not QUANT_A:  # (QUANT_A applied the row scale before the quantization)
        if PARTS > 0:
            slots = tl.arange(0, PARTS)
            squares = tl.sum(tl.load(parts_ptr + r[:, None] * parts_n + slots[None, :],
                                     mask=(r < rows)[:, None] & (slots < parts_n)[None, :], other=0.0), axis=1)
        scale = tl.math.rsqrt(squares / k + eps)[:, None]
        acc = acc * scale
        if GATED or HALF > 0:
            acc_up = acc_up * scale
    if FP8:  # the per-tensor scales, as torch._scaled_mm applies them (before the bias)
        scales = tl.load(sa_ptr) * tl.load(sb_ptr)
        acc = acc * scales
        if GATED or HALF > 0:
            acc_up = acc_up * scales
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
        if GATED or HALF > 0:
            acc_up += tl.load(b_ptr + partner, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu, approximate division
        acc = act * acc_up.to(dtype).to(tl.float32)
    mask = (r < rows)[:, None] & (cols < n)[None, :]
    if HALF > 0:
        # the GEMM's outputs rounded to the dtype, rotated in float32, as the unfused ops compute
        a, b = acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32)
        angle = (first % (2 * HALF)) + tl.arange(0, BN)
        turn = mask & (cols < rotated)[None, :]
        pos = tl.load(pos_ptr + r, mask=r < rows, other=0).to(tl.int64)
        base = cs_ptr + pos[:, None] * (2 * HALF) + angle[None, :]
        cos = tl.load(base, mask=turn, other=1.0)
        sin = tl.load(base + HALF, mask=turn, other=0.0)
        acc, acc_up = a * cos - b * sin, b * cos + a * sin
        tl.store(y_ptr + r[:, None] * y_stride + partner[None, :], acc_up.to(dtype), mask=mask)
    if RESIDUAL:
        acc += tl.load(r_ptr + r[:, None] * r_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if OUT_QUANT:
        q = tl.clamp(tl.math.div_rn(acc.to(dtype).to(tl.float32), tl.load(qs_ptr)), -448.0, 448.0)
        tl.store(y_ptr + r[:, None] * y_stride + cols[None, :], q.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + r[:, None] * y_stride + cols[None, :], acc.to(dtype), mask=mask)
    if HAND_OFF:  # the next norm's share of this block: s * g, and the squares of s by slot
        s = tl.where(mask, acc.to(dtype).to(tl.float32), 0.0)
        g = tl.load(g_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
        tl.store(sg_ptr + r[:, None] * n + cols[None, :], (s * g[None, :]).to(dtype), mask=mask)
        squares = tl.sum(tl.reshape(s * s, [ROWS, BN // PART, PART]), axis=2)
        slot = pid * (BN // PART) + tl.arange(0, BN // PART)
        tl.store(parts_ptr + r[:, None] * parts_n + slot[None, :], squares,
                 mask=(r < rows)[:, None] & (slot < parts_n)[None, :])


# --------------------------------------------------------------------------- launch configuration


def row_tile(rows: int) -> int:
    """Rows of the kernel's tile for ``rows`` rows: 16, 32 or 64."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def skinny_config(n: int, sms: int, tile: int = linear_ops.SKINNY_ROWS) -> tuple[int, int, int, int]:
    """(BN output columns per program, BK, warps, stages) for a weight of ``n`` rows on a device
    of ``sms`` SMs, ``tile`` rows at once (:func:`row_tile`). Where ``BN`` = 32 or 64 columns
    give at most one program per SM, the smallest such ``BN`` in one wave, with deep k blocks;
    else many small programs, several per SM. Taller tiles take k blocks of 256 (4 stages where
    they fit 192 KB of shared memory) or, with many programs, blocks of 128 columns (each
    program reads the rows of x again: fewer programs read less). Set from ``bench/bench_gemm.py
    --sweep`` on the 8B layer's four weights at 1-16, 32 and 64 rows (bench/RESULTS.md)."""
    tall = tile > linear_ops.SKINNY_ROWS
    for bn, bk in ((32, 512), (64, 256)):
        if triton.cdiv(n, bn) <= sms:
            return (bn, 256, 4, _stages(tile, bn, 256)) if tall else (bn, bk, 4, 4)
    return (128, 128, 4, 3) if tall else (32, 128, 4, 3)


def gated_config(n: int, sms: int, tile: int = linear_ops.SKINNY_ROWS) -> tuple[int, int, int, int]:
    """The same for ``linear_silu_and_mul`` with ``n`` output columns (2n weight rows): a program
    streams ``BN`` gate and ``BN`` up rows, so in one wave ``BK`` is halved (a stage holds what
    the plain kernel's holds); with many programs, (32, 256, 4, 3) at 16 rows and (64, 128, 4,
    3) in taller tiles, the best on the 8B gate_up weight in the H100 sweeps (bench/RESULTS.md)."""
    tall = tile > linear_ops.SKINNY_ROWS
    for bn, bk in ((32, 256), (64, 128)):
        if triton.cdiv(n, bn) <= sms:
            return (bn, 128, 4, _stages(tile, 2 * bn, 128)) if tall else (bn, bk, 4, 4)
    return (64, 128, 4, 3) if tall else (32, 256, 4, 3)


def _stages(tile: int, bn: int, bk: int) -> int:
    """4 stages where the x tile and ``bn`` weight rows of ``bk`` bf16 values fit 192 KB four times, else 3."""
    return 4 if 4 * (tile + bn) * bk * 2 <= 192 << 10 else 3


@functools.cache
def pdl(device: torch.device) -> bool:
    """Whether the skinny kernel is a programmatic dependent launch on ``device`` (Hopper and
    later): inside a CUDA graph its programs may be scheduled while the kernel before it drains
    (launch latency off the step's critical path). Off on CPU, before sm90, with a Triton
    without it, and with ``FXREWRITE_PDL=0``."""
    if device.type != "cuda" or os.environ.get("FXREWRITE_PDL", "1") in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")


_PDL_OFF: list[bool] = []  # inside without_pdl()


@contextlib.contextmanager
def without_pdl() -> Iterator[None]:
    """Plain launches inside (and so in the CUDA graphs captured inside), in this thread and
    every other: the side-by-side measure of :func:`pdl` (``bench/bench_e2e.py``)."""
    _PDL_OFF.append(True)
    try:
        yield
    finally:
        _PDL_OFF.pop()


def launch_pdl(device: torch.device) -> bool:
    """Whether a kernel launched now on ``device`` goes as a programmatic dependent launch:
    :func:`pdl`, outside :func:`without_pdl`. For every kernel built to wait for the one before
    (``gdc_wait``) before its first read of what that one may write."""
    return pdl(device) and not _PDL_OFF


@functools.cache
def _sms(device: torch.device) -> int:
    # CPU tensors run only under the interpreter: any count serves, take an H100's
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@dataclasses.dataclass(frozen=True)
class Fusion:
    """What a launch fuses around the GEMM: ``gated`` (SiLU-and-mul), ``norm`` (RMSNorm of ``x``
    first, by ``norm_weight`` unless None, with ``eps``; ``parts``: its sums of squares by slot,
    handed off by the GEMM that made ``x``), ``residual`` (added before the store; ``inplace``:
    stored into it; ``hand_off``: the next norm's ``s * g`` and sums of squares stored too, ``g``
    in ``norm_weight``), rotary (``cos_sin_cache`` [P, D] indexed by ``positions``, the first
    ``rotated`` columns in heads of D rotated, NeoX halves), ``scales`` (FP8 operands: the
    per-tensor scales of ``x`` and the weight; ``quant_input``: ``x`` is the norm's input in its
    dtype, quantized to e4m3 with the first scale in the prologue, multiplied by its reciprocal:
    within a float32 ulp of the division, so an e4m3 value may differ only where the quotient lies
    that close to a rounding boundary), ``out_dtype`` (the output's, else ``x``'s; with
    ``out_scale`` the dtype the values round to before they are quantized to e4m3 with it)."""

    gated: bool = False
    norm: bool = False
    norm_weight: Tensor | None = None
    eps: float = 0.0
    residual: Tensor | None = None
    inplace: bool = False
    positions: Tensor | None = None
    cos_sin_cache: Tensor | None = None
    rotated: int = 0
    parts: Tensor | None = None
    hand_off: bool = False
    scales: tuple[Tensor, Tensor] | None = None
    out_dtype: torch.dtype | None = None
    out_scale: Tensor | None = None
    quant_input: bool = False

    @property
    def half(self) -> int:
        """Half a head (rotary: the cache's width over two), 0 without rotary."""
        return self.cos_sin_cache.shape[-1] // 2 if self.cos_sin_cache is not None else 0


PLAIN = Fusion()


@dataclasses.dataclass(frozen=True)
class _Launch:
    """One launch's sizes, strides and constexprs (read from shapes alone: fake tensors do)."""

    n: int
    k: int
    x_stride: int
    y_stride: int
    r_stride: int
    grid: int
    parts_n: int
    meta: dict[str, int | bool]


def _rows(t: Tensor, width: int) -> Tensor:
    return t.reshape(-1, width)


def _plan(x: Tensor, weight: Tensor, bias: Tensor | None, f: Fusion,
          config: tuple[int, int, int, int] | None = None) -> _Launch:  # fmt: skip
    rows_w, k = weight.shape
    n = rows_w // 2 if f.gated else rows_w
    rows = _rows(x, k)
    x_stride = rows.stride(0) if rows.stride(-1) == 1 else k  # the launcher makes them contiguous
    r_stride = _rows(f.residual, n).stride(0) if f.residual is not None else n
    paired = f.gated or f.half > 0  # programs of two column blocks (gate and up, rotation pairs)
    tile = row_tile(rows.shape[0])
    bn, bk, warps, stages = config or (gated_config(n // (1 if f.gated else 2), _sms(x.device), tile) if paired
                                       else skinny_config(n, _sms(x.device), tile))  # fmt: skip
    if f.scales is not None and not f.quant_input and config is None and k % (2 * bk) == 0:
        bk *= 2  # FP8: half the bytes a row, the same bytes a k step (x quantized here is still bf16)
    if f.half:
        bn = bn if f.half % bn == 0 else math.gcd(bn, f.half)  # a program's block inside half a head
    meta = {"BN": bn, "BK": bk, "HAS_BIAS": bias is not None, "EVEN_K": k % bk == 0, "GATED": f.gated,
            "NORM": f.norm, "NORM_WEIGHT": f.norm_weight is not None, "RESIDUAL": f.residual is not None,
            "HALF": f.half, "num_warps": warps, "num_stages": stages}  # fmt: skip
    parts_n = f.parts.shape[-1] if f.parts is not None else triton.cdiv(n, linear_ops.PART) if f.hand_off else 0
    if f.parts is not None:
        meta["PARTS"] = triton.next_power_of_2(parts_n)
    if f.hand_off:
        meta["HAND_OFF"] = True
    if f.scales is not None:
        meta["FP8"] = True
    if f.quant_input:
        meta["QUANT_A"] = True
    if f.out_scale is not None:
        meta.update(OUT_QUANT=True, ROUND=_TL_DTYPES[f.out_dtype or x.dtype])
    if launch_pdl(x.device):
        meta.update(PDL=True, launch_pdl=True)
    if tile != linear_ops.SKINNY_ROWS:
        meta["ROWS"] = tile
    grid = n // (2 * bn) if f.half else triton.cdiv(n, bn)
    return _Launch(n, k, x_stride, r_stride if f.inplace else n, r_stride, grid, parts_n, meta)


def skinny(x: Tensor, weight: Tensor, bias: Tensor | None = None, f: Fusion = PLAIN,
           config: tuple[int, int, int, int] | None = None) -> Any:  # fmt: skip
    """``linear(x, weight, bias)`` with the fusions ``f`` in one launch; ``config``: (BN, BK,
    warps, stages), by default :func:`skinny_config` / :func:`gated_config`. The residual's rows
    must have unit stride (the op modules check it); the in-place form returns the residual, the
    hand-off ``(sum, sum * g, parts)``."""
    p = _plan(x, weight, bias, f, config)
    rows = _rows(x, p.k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    residual = _rows(f.residual, p.n) if f.residual is not None else None
    if f.inplace:
        assert residual is not None
        out = residual
    else:
        out = torch.empty((rows.shape[0], p.n), dtype=_stored(x, f), device=x.device)
    sg = torch.empty_like(out) if f.hand_off else None
    parts = f.parts if f.parts is not None else (
        torch.empty((rows.shape[0], p.parts_n), dtype=torch.float32, device=x.device) if f.hand_off else None)
    with device_of(x):
        _skinny_linear_kernel[(p.grid,)](
            rows, weight, _or(bias, weight), out, _or(f.norm_weight, weight), _or(residual, weight),
            _or(f.positions, weight), _or(f.cos_sin_cache, weight), _or(sg, weight), _or(parts, weight),
            *(f.scales or (weight, weight)), _or(f.out_scale, weight), rows.shape[0], p.n, p.k, rows.stride(0), weight.stride(0), p.y_stride, p.r_stride, f.eps, f.rotated,
            p.parts_n, **p.meta,
        )  # fmt: skip
    if f.hand_off:
        shape = (*x.shape[:-1], p.n)
        return out.view(shape), sg.view(shape), parts.view(*x.shape[:-1], p.parts_n)  # type: ignore[union-attr]
    return f.residual if f.inplace else out.view(*x.shape[:-1], p.n)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _stored(x: Tensor, f: Fusion) -> torch.dtype:
    """The dtype of what the launch stores: e4m3 with ``out_scale``, else ``out_dtype`` or ``x``'s."""
    return torch.float8_e4m3fn if f.out_scale is not None else f.out_dtype or x.dtype


def _or(t: Tensor | None, other: Tensor) -> Tensor:
    """A pointer argument the kernel does not read when ``t`` is None (its constexpr is off)."""
    return t if t is not None else other


def _prepare(x: Tensor, weight: Tensor, bias: Tensor | None, f: Fusion) -> tuple[Any, Callable[[], Any]]:
    """What :func:`skinny` will build for such a call: the same arguments, pointers as their
    dtypes (Triton's ``warmup`` takes them so, as 16-byte aligned addresses: a torch allocation
    is)."""
    p = _plan(x, weight, bias, f)
    pointers = (x, weight, _or(bias, weight), x, _or(f.norm_weight, weight), _or(f.residual, weight),
                _or(f.positions, weight), _or(f.cos_sin_cache, weight), x if f.hand_off else weight)  # fmt: skip
    dtypes = [t.dtype for t in pointers]
    dtypes[3] = _stored(x, f)  # y
    if f.hand_off:
        dtypes[8] = dtypes[3]  # s * g, stored as the sum is
    parts = torch.float32 if f.hand_off or f.parts is not None else weight.dtype
    scales = [t.dtype for t in (*(f.scales or (weight, weight)), _or(f.out_scale, weight))]
    args = (*dtypes, parts, *scales, linear_ops.SKINNY_ROWS, p.n, p.k, p.x_stride, weight.stride(0),
            p.y_stride, p.r_stride, f.eps, f.rotated, p.parts_n)  # fmt: skip
    _bind_device(_skinny_linear_kernel, x.device)

    def build() -> Any:
        with device_of(x):
            kernel = _skinny_linear_kernel.warmup(*args, grid=(1,), **p.meta)
            _load(kernel)
        return kernel

    return ("skinny_linear", x.device, args[:-3] + args[-2:], tuple(p.meta.items())), build  # eps: not built in


def _norm(norm_weight: Tensor | None, eps: float, **kw: Any) -> Fusion:
    return Fusion(norm=True, norm_weight=norm_weight, eps=eps, **kw)


# The ops' launchers and planners, by op name: each takes the op's arguments.
_LAUNCH: dict[str, Callable[..., tuple[Tensor, Tensor, Tensor | None, Fusion]]] = {
    "linear": lambda x, w, bias=None: (x, w, bias, PLAIN),
    "linear_silu_and_mul": lambda x, w, bias=None: (x, w, bias, Fusion(gated=True)),
    "linear_fp8": lambda x, w, scale_a, scale_b, out_dtype: (x, w, None, Fusion(scales=(scale_a, scale_b),
                                                                                out_dtype=out_dtype)),
    "linear_fp8_silu_and_mul_quant": lambda x, w, scale_a, scale_b, out_dtype, scale: (
        x, w, None, Fusion(gated=True, scales=(scale_a, scale_b), out_dtype=out_dtype, out_scale=scale)),
    "rms_norm_linear": lambda x, g, eps, w, bias=None, cast_last=False, parts=None: (
        x, w, bias, _norm(g, eps, parts=parts)),
    "rms_norm_linear_silu_and_mul": lambda x, g, eps, w, bias=None, cast_last=False, parts=None: (
        x, w, bias, _norm(g, eps, gated=True, parts=parts)),
    "rms_norm_linear_rotary": lambda x, g, eps, w, bias, cast_last, positions, cos_sin_cache, rotated, parts=None: (
        x, w, bias, _norm(g, eps, positions=positions, cos_sin_cache=cos_sin_cache, rotated=rotated, parts=parts)),
    "linear_add": lambda x, w, residual: (x, w, None, Fusion(residual=residual)),
    "linear_add_": lambda x, w, residual: (x, w, None, Fusion(residual=residual, inplace=True)),
    "linear_add_rms_parts": lambda x, w, residual, g: (x, w, None, Fusion(residual=residual, norm_weight=g,
                                                                           hand_off=True)),
    "linear_fp8_add_rms_parts": lambda x, w, scale_a, scale_b, out_dtype, residual, g: (
        x, w, None, Fusion(scales=(scale_a, scale_b), out_dtype=out_dtype, residual=residual, norm_weight=g,
                           hand_off=True)),
    "rms_norm_quant_linear_fp8": lambda x, parts, eps, scale, w, scale_b, out_dtype: (
        x, w, None, _norm(None, eps, parts=parts, scales=(scale, scale_b), out_dtype=out_dtype, quant_input=True)),
    "rms_norm_quant_linear_fp8_silu_and_mul_quant": lambda x, parts, eps, scale, w, scale_b, out_dtype, out_scale: (
        x, w, None, _norm(None, eps, parts=parts, scales=(scale, scale_b), out_dtype=out_dtype, quant_input=True,
                          gated=True, out_scale=out_scale)),
}


def prepare(op: str, *args: Any) -> tuple[Any, Callable[[], Any]] | None:
    """``(key, build)`` for what ``op``'s launcher would build at its first call with ``args``
    (shapes, dtypes and devices are read: fake tensors will do), ``build`` compiling it into the
    kernel's cache and loading it (:func:`_load`) without launching it; None for an op that
    builds nothing ahead. Builds of different keys may run in parallel threads
    (:func:`fxrewrite.runtime.providers.prebuild`)."""
    launch = _LAUNCH.get(op)
    return _prepare(*launch(*args)) if launch is not None else None


def _load(kernel: Any) -> None:
    """Load a built kernel onto its device and build Triton's launcher for it (a C stub that
    ``gcc`` compiles, 0.3 s at a cold start on the H100 machine), which Triton otherwise does at
    the first launch. ``_init_handles`` is Triton's, not an API: skipped where absent."""
    init = getattr(kernel, "_init_handles", None)
    if init is not None:
        init()


def _bind_device(kernel: Any, device: torch.device) -> None:
    """Create the JIT function's per-device cache here, in the calling thread: Triton creates it
    on first use, and two threads doing that at once would each make one and lose a build."""
    caches = getattr(kernel, "device_caches", None)  # Triton's, not an API: skipped where absent
    if caches is not None and device.type == "cuda":
        with torch.cuda.device(device):
            caches[torch.cuda.current_device()]  # noqa: B018 - a defaultdict: the lookup creates it


# --------------------------------------------------------------------------- the ops' signatures


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return skinny(*_LAUNCH["linear"](x, weight, bias))


def linear_silu_and_mul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return skinny(*_LAUNCH["linear_silu_and_mul"](x, weight, bias))


def linear_fp8(x: Tensor, weight: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    return skinny(*_LAUNCH["linear_fp8"](x, weight, scale_a, scale_b, out_dtype))


def linear_fp8_silu_and_mul_quant(x: Tensor, weight: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                                  scale: Tensor) -> Tensor:  # fmt: skip
    return skinny(*_LAUNCH["linear_fp8_silu_and_mul_quant"](x, weight, scale_a, scale_b, out_dtype, scale))


def rms_norm_linear(x: Tensor, norm_weight: Tensor | None, eps: float, weight: Tensor, bias: Tensor | None = None,
                    cast_last: bool = False, parts: Tensor | None = None) -> Tensor:  # fmt: skip
    return skinny(*_LAUNCH["rms_norm_linear"](x, norm_weight, eps, weight, bias, cast_last, parts))


def rms_norm_linear_silu_and_mul(x: Tensor, norm_weight: Tensor | None, eps: float, weight: Tensor,
                                 bias: Tensor | None = None, cast_last: bool = False,
                                 parts: Tensor | None = None) -> Tensor:  # fmt: skip
    return skinny(*_LAUNCH["rms_norm_linear_silu_and_mul"](x, norm_weight, eps, weight, bias, cast_last, parts))


def rms_norm_linear_rotary(x: Tensor, norm_weight: Tensor | None, eps: float, weight: Tensor, bias: Tensor | None,
                           cast_last: bool, positions: Tensor, cos_sin_cache: Tensor, rotated: int,
                           parts: Tensor | None = None) -> Tensor:  # fmt: skip
    return skinny(*_LAUNCH["rms_norm_linear_rotary"](x, norm_weight, eps, weight, bias, cast_last, positions,
                                                     cos_sin_cache, rotated, parts))  # fmt: skip


def linear_add_rms_parts(x: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return skinny(*_LAUNCH["linear_add_rms_parts"](x, weight, residual, norm_weight))


def linear_fp8_add_rms_parts(x: Tensor, weight: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                             residual: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return skinny(*_LAUNCH["linear_fp8_add_rms_parts"](x, weight, scale_a, scale_b, out_dtype, residual, norm_weight))


def rms_norm_quant_linear_fp8(x: Tensor, parts: Tensor, eps: float, scale: Tensor, weight: Tensor, scale_b: Tensor,
                              out_dtype: torch.dtype) -> Tensor:  # fmt: skip
    return skinny(*_LAUNCH["rms_norm_quant_linear_fp8"](x, parts, eps, scale, weight, scale_b, out_dtype))


def rms_norm_quant_linear_fp8_silu_and_mul_quant(x: Tensor, parts: Tensor, eps: float, scale: Tensor, weight: Tensor,
                                                 scale_b: Tensor, out_dtype: torch.dtype, out_scale: Tensor) -> Tensor:  # fmt: skip
    return skinny(*_LAUNCH["rms_norm_quant_linear_fp8_silu_and_mul_quant"](x, parts, eps, scale, weight, scale_b,
                                                                           out_dtype, out_scale))  # fmt: skip


def linear_add(x: Tensor, weight: Tensor, residual: Tensor) -> Tensor:
    return skinny(*_LAUNCH["linear_add"](x, weight, residual))


def linear_add_(x: Tensor, weight: Tensor, residual: Tensor) -> None:
    skinny(*_LAUNCH["linear_add_"](x, weight, residual))
