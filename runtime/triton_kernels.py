"""Our Triton kernels: the ``triton`` provider's library, as ``sgl_kernel`` and ``flashinfer`` are
the others.

- RMSNorm (plain, Gemma's, in-place add + RMSNorm; with or without a weight; the scale rounded
  first; the L2 norm, which sums where RMSNorm averages) and SiLU/GELU-and-mul over rows at any strides
  (per-head norms read through a view of a merged projection, a gate/up slice of a wider GEMM's
  output), any float dtype, a weight of another dtype: the calls sgl-kernel and flashinfer
  cannot take, so that none runs the torch reference.
- The FP8 ops that sgl-kernel and flashinfer serve as two kernels (or not at all): RMSNorm,
  add + RMSNorm, SiLU-and-mul, each fused with static or dynamic per-token FP8 (float8_e4m3fn)
  quantization, in one kernel; the per-token quantizer alone (the norm kernel without its norm).
- The decode-size GEMM and what it fuses (``linear``, ``linear_silu_and_mul``, the norm
  prologue, the residual epilogue) live in :mod:`fxrewrite.runtime.triton_gemm`.

This module imports ``triton`` at the top, so the op modules never import it; they reach it
through ``providers.library("fxrewrite.runtime.triton_kernels")``, which turns a missing or
broken Triton into "not importable" (counted fallback), and the package imports without it.

    # two kernels (norm, then sgl_per_token_quant_fp8)     # one kernel
    y = sgl_rms_norm(x, w, eps)                             q, s = rms_norm_dynamic_quant_fp8(x, w, eps)
    q, s = sgl_per_token_quant(y)

Every launcher below takes the op's arguments and returns what ``torch.ops.fxr.<op>`` returns;
the per-call constraints (half dtypes, layout, FP8-capable device) are checked by the op
modules before a launcher is called. Rounding follows the reference (the spec) step by step:
the sum, the normed value, the weighted value, SiLU and its product are rounded to the input
dtype where the unfused torch code rounds them; the per-token scale ``max(amax, 1e-12) / 448``
and ``y / s`` are IEEE divisions. What differs is summation order and the approximate ``rsqrt``,
``exp`` and SiLU division: at most one FP8 step, rarely.

Under ``TRITON_INTERPRET=1`` (read when this module is imported) the kernels run on CPU tensors;
the CPU tests use that.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxrewrite.runtime import constraints
from fxrewrite.runtime.ops import quant
from fxrewrite.runtime.ops.activation import ACT_MUL_ACTIVATIONS

FP8_MAX: tl.constexpr = tl.constexpr(quant.FP8_MAX)
AMAX_FLOOR: tl.constexpr = tl.constexpr(quant.AMAX_FLOOR)
# Static SiLU-and-mul has no row reduction: blocks of columns spread few tokens over many SMs.
# Everything else holds a row in one program: at most quant.TRITON_MAX_ROW values (the op
# module's check), 32 warps of 32 values per thread.
STATIC_BLOCK = 1024


# --------------------------------------------------------------------------- kernels


@triton.jit
def _quantize_store(y, q_ptrs, mask, s_ptr, scale_ptr, DYNAMIC: tl.constexpr):
    """Store ``y`` (float32, one row or part of one) as FP8: dynamic per token
    (``s = max(amax, 1e-12) / 448`` stored at ``s_ptr``) or by the static scale at ``scale_ptr``;
    ``q = clamp(y / s, -448, 448)`` rounded to nearest even. The division is IEEE, per value, as
    the spec's: ``y`` and ``amax`` are both values of the input dtype, so ``y / s`` lands exactly
    on e4m3 midpoints often, and multiplying by ``1 / s`` (as sgl-kernel and flashinfer do)
    rounds about 0.5% of them the other way (measured on CPU)."""
    if DYNAMIC:
        amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0)
        s = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
        tl.store(s_ptr, s)
    else:
        s = tl.load(scale_ptr)
    q = tl.clamp(tl.math.div_rn(y, s), -FP8_MAX, FP8_MAX)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    sum_ptr,
    q_ptr,
    s_ptr,
    scale_ptr,
    x_stride,
    r_stride,
    n,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    DYNAMIC: tl.constexpr,
    CAST_LAST: tl.constexpr = False,
    NORM: tl.constexpr = True,
):
    """One row per program: ``[sum = x + r]; y = w * (h * rsqrt(mean(h^2) + eps)).to(dtype)``
    with ``h = sum.float()`` (``CAST_LAST``: ``y = (w * h).to(dtype)``), rounded to the input
    dtype as the reference does; then FP8. Without ``NORM``, ``y = x.float()``: the quantizer
    alone (``fxr.dynamic_quant_fp8``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * n + cols, x, mask=mask)
    y = x.to(tl.float32)
    if NORM:
        h = y * tl.math.rsqrt(tl.sum(y * y, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if not CAST_LAST:
            h = h.to(dtype).to(tl.float32)
        y = (w * h).to(dtype).to(tl.float32)
    _quantize_store(y, q_ptr + row * n + cols, mask, s_ptr + row, scale_ptr, DYNAMIC)


@triton.jit
def _act_mul_quant_kernel(a_ptr, b_ptr, q_ptr, s_ptr, scale_ptr, a_stride, b_stride, d,
                          BLOCK: tl.constexpr, DYNAMIC: tl.constexpr, ACT: tl.constexpr = 0):  # fmt: skip
    """Program (row, block): ``y = (act(gate).to(dtype) * up).to(dtype)`` over ``BLOCK`` columns
    of ``gate = a[row, :d]``, ``up = b[row, :d]`` (each row at its stride: ``fxr.act_mul``'s two
    operands, or the halves of one [.., 2d] row, ``b`` a view ``d`` columns in); ``ACT``:
    :func:`activate`'s code; then FP8 (dynamic: one block holds the row)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = a_ptr.dtype.element_ty
    gate = tl.load(a_ptr + row * a_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(b_ptr + row * b_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act = activate(gate, ACT).to(dtype).to(tl.float32)
    y = (act * up).to(dtype).to(tl.float32)
    _quantize_store(y, q_ptr + row * d + cols, mask, s_ptr + row, scale_ptr, DYNAMIC)


@triton.jit
def row_offsets(rows, d1, d2, s0, s1, s2):
    """Element offsets of ``rows`` (flat indices over leading dims [d0, d1, d2]) at strides s0..s2."""
    i2 = rows % d2
    i1 = (rows // d2) % d1
    i0 = rows // (d1 * d2)
    return i0 * s0 + i1 * s1 + i2 * s2


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, n_rows, n, eps, slot_stride, slot_table, out_table,
                     d1, d2, xs0, xs1, xs2, rs0, rs1, rs2, os0, os1, os2,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     CAST_LAST: tl.constexpr, OFFSET: tl.constexpr, HAS_WEIGHT: tl.constexpr = True,
                     ROUND_SCALE: tl.constexpr = False, MEAN: tl.constexpr = True,
                     SLOTS: tl.constexpr = 1, TABLES: tl.constexpr = False, OUTS: tl.constexpr = 1):  # fmt: skip
    """``ROWS`` rows per program, each at its own address (leading dims [d0, d1, d2] at any
    strides, the last dim contiguous): ``h = x.float()`` (``SLOTS`` > 1: the float32 sum of the
    ``SLOTS`` partial rows ``slot_stride`` elements apart, not rounded; with ``TABLES``: slot
    ``k`` at ``slot_table[k]`` bytes from ``x``, and ``y`` below stored ``OUTS`` times, copy
    ``k`` at ``out_table[k]`` bytes from ``out``: the peers' memory of a symmetric buffer); with
    ``HAS_RESIDUAL``: ``s = (x + r)`` rounded to the dtype, written at ``sum`` (``r``'s strides:
    over ``r`` in place), and ``h = s.float()``); ``h *= rsqrt(mean(h^2) +
    eps)`` (``sum`` for ``MEAN=False``: the L2 norm); ``y = (w + OFFSET) * h`` rounded once
    (``CAST_LAST``) or ``w * h.to(dtype)`` rounded again, as the spec rounds; without a weight
    ``h`` rounded; ``ROUND_SCALE``: ``x * rsqrt(..).to(dtype)`` in the dtype (then times ``w``);
    stored at ``out`` (its own strides)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n)[None, :]
    dtype = x_ptr.dtype.element_ty
    x_off = row_offsets(rows, d1, d2, xs0, xs1, xs2)[:, None] + cols[None, :]
    if TABLES:
        h = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for slot in tl.static_range(SLOTS):
            h += tl.load(x_ptr + tl.load(slot_table + slot) // (dtype.primitive_bitwidth // 8) + x_off, mask=mask,
                         other=0.0).to(tl.float32)  # fmt: skip
    else:
        h = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
        for slot in tl.static_range(1, SLOTS):
            h += tl.load(x_ptr + slot * slot_stride + x_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_off = row_offsets(rows, d1, d2, rs0, rs1, rs2)[:, None] + cols[None, :]
        total = (h + tl.load(r_ptr + r_off, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(sum_ptr + r_off, total, mask=mask)
        h = total.to(tl.float32)
    square_sum = tl.sum(h * h, axis=1)
    if MEAN:
        square_sum = square_sum / n
    scale = tl.math.rsqrt(square_sum + eps)[:, None]
    if ROUND_SCALE:
        h = (h * scale.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    else:
        h = h * scale
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :] + OFFSET
        if CAST_LAST or ROUND_SCALE:
            y = w * h
        else:
            y = w * h.to(dtype).to(tl.float32)
    else:
        y = h
    o_off = row_offsets(rows, d1, d2, os0, os1, os2)[:, None] + cols[None, :]
    if TABLES:
        for k in tl.static_range(OUTS):
            step = out_ptr.dtype.element_ty.primitive_bitwidth // 8
            tl.store(out_ptr + tl.load(out_table + k) // step + o_off, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + o_off, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def activate(g, ACT: tl.constexpr):
    """``act(g)`` in float32; ``ACT``: 0 SiLU, 1 GELU (erf), 2 GELU (tanh)."""
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))  # F.silu, approximate division
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0))  # tanh(z)
    return a


@triton.jit
def _act_and_mul_kernel(x_ptr, y_ptr, n_rows, d, d1, d2, xs0, xs1, xs2,
                        BLOCK: tl.constexpr, ROWS: tl.constexpr, ACT: tl.constexpr):  # fmt: skip
    """``y = act(gate).to(dtype) * up`` rounded to the dtype, ``gate = x[row, :d]``, ``up =
    x[row, d:2d]``, rows at any strides; ``ACT``: 0 SiLU, 1 GELU (erf), 2 GELU (tanh). Program
    (row block, column block)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < d)[None, :]
    dtype = x_ptr.dtype.element_ty
    base = x_ptr + row_offsets(rows, d1, d2, xs0, xs1, xs2)[:, None] + cols[None, :]
    g = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    y = activate(g, ACT).to(dtype).to(tl.float32) * up
    tl.store(y_ptr + rows[:, None] * d + cols[None, :], y.to(dtype), mask=mask)


# --------------------------------------------------------------------------- launchers


def device_of(x: Tensor) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it ``x``'s (tensor-parallel processes may
    hold several); nothing for CPU tensors (the interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _warps(block: int) -> int:
    """About 16 values per thread: 4 warps up to 2048 columns, 32 warps at 16384 and above."""
    return max(4, min(32, block // 512))


def _outputs(x: Tensor, d: int, dynamic: bool) -> tuple[Tensor, Tensor]:
    """q [rows, d] FP8 and s [rows, 1] float32 (a 1-element placeholder when static)."""
    rows = x.numel() // x.shape[-1]
    q = torch.empty((rows, d), dtype=quant.FP8_DTYPE, device=x.device)
    s = torch.empty((rows if dynamic else 1, 1), dtype=torch.float32, device=x.device)
    return q, s


def _rms_norm_quant(
    x: Tensor, weight: Tensor | None, eps: float, scale: Tensor | None, residual: Tensor | None, cast_last: bool = False
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(q, s or None when static, sum or None without residual), shaped as the op returns them;
    ``weight`` None: no norm, the quantizer alone."""
    n = x.shape[-1]
    rows = x.view(-1, n)
    res = residual.view(-1, n) if residual is not None else rows
    dynamic = scale is None
    q, s = _outputs(x, n, dynamic)
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device) if residual is not None else q
    block = triton.next_power_of_2(n)
    with device_of(x):
        _rms_norm_quant_kernel[(rows.shape[0],)](
            rows, res, rows if weight is None else weight, total, q, s, s if dynamic else scale, rows.stride(0),
            res.stride(0), n, eps, BLOCK=block, HAS_RESIDUAL=residual is not None, DYNAMIC=dynamic,
            CAST_LAST=cast_last, NORM=weight is not None, num_warps=_warps(block),
        )  # fmt: skip
    return (
        q.view(x.shape),
        s.view(*x.shape[:-1], 1) if dynamic else None,
        total.view(x.shape) if residual is not None else None,
    )


def _act_mul_quant(a: Tensor, b: Tensor, scale: Tensor | None, act: int = 0) -> tuple[Tensor, Tensor | None]:
    """FP8 of ``act(a) * b`` (equal shapes, rows at one stride each, the last dim contiguous)."""
    d = a.shape[-1]
    dynamic = scale is None
    q, s = _outputs(a, d, dynamic)
    ra, rb = a.reshape(-1, d), b.reshape(-1, d)  # views: the op module's checks ask rows at one stride
    block = triton.next_power_of_2(d) if dynamic else min(triton.next_power_of_2(d), STATIC_BLOCK)
    grid = (q.shape[0], triton.cdiv(d, block))
    with device_of(a):
        _act_mul_quant_kernel[grid](
            ra, rb, q, s, s if dynamic else scale, ra.stride(0), rb.stride(0), d, BLOCK=block, DYNAMIC=dynamic, ACT=act,
            num_warps=_warps(block),
        )  # fmt: skip
    return q.view(a.shape), s.view(*a.shape[:-1], 1) if dynamic else None


def _silu_and_mul_quant(x: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The halves of each (contiguous) row as the two operands: ``b`` is ``x`` ``d`` columns in."""
    d = x.shape[-1] // 2
    return _act_mul_quant(x[..., :d], x[..., d:], scale)


def _rows_per_program(block: int) -> int:
    """Rows a program holds: about 4096 values (head-dim rows of per-head norms take many)."""
    return max(1, min(64, 4096 // block))


def rows_launch(width: int, *tensors: Tensor) -> tuple[tuple[int, ...], list[int], dict[str, int]]:
    """How a strided-rows kernel that holds ``width`` values of a row (one norm) covers equally
    shaped ``tensors``: its grid, its arguments ``d1, d2`` and each tensor's three leading strides
    (:func:`constraints.leading_dims`), and ``BLOCK``, ``ROWS`` (rows per program), ``num_warps``."""
    layout = constraints.leading_dims(*tensors)
    assert layout is not None, "the op module's check lets only such layouts through"
    (_, d1, d2), strides = layout
    block = triton.next_power_of_2(width)
    per = _rows_per_program(block)
    grid = (triton.cdiv(tensors[0].numel() // width, per),)
    meta = {"BLOCK": block, "ROWS": per, "num_warps": _warps(block * per)}
    return grid, [d1, d2, *(s for st in strides for s in st)], meta


def _norm_rows(x: Tensor, weight: Tensor | None, eps: float, out: Tensor, residual: Tensor | None,
               cast_last: bool, offset: float, round_scale: bool = False, mean: bool = True,
               total: Tensor | None = None, slots: int = 1, slot_stride: int = 0,
               tables: tuple[Tensor, Tensor] | None = None) -> None:  # fmt: skip
    """Launch ``_rms_norm_kernel`` over ``x``'s rows (each tensor at its own strides; ``total``,
    where the sum goes when not over ``residual``, at ``residual``'s; ``tables``: the byte
    offsets from ``x`` of the slots summed and from ``out`` of the copies stored, int64)."""
    n = x.shape[-1]
    r = residual if residual is not None else x
    assert total is None or total.stride() == r.stride(), "the sum is stored at the residual's strides"
    grid, layout, meta = rows_launch(n, x, r, out)
    slot_table, out_table = tables if tables is not None else (x, x)
    with device_of(x):
        _rms_norm_kernel[grid](
            x, r, weight if weight is not None else x, out, r if total is None else total, x.numel() // n, n, eps,
            slot_stride, slot_table, out_table, *layout, HAS_RESIDUAL=residual is not None, CAST_LAST=cast_last,
            OFFSET=offset, HAS_WEIGHT=weight is not None, ROUND_SCALE=round_scale, MEAN=mean,
            SLOTS=slot_table.numel() if tables is not None else slots, TABLES=tables is not None,
            OUTS=out_table.numel() if tables is not None else 1, **meta,
        )  # fmt: skip


def _act_and_mul(x: Tensor, act: int) -> Tensor:
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    layout = constraints.leading_dims(x)
    assert layout is not None, "the op module's check lets only such layouts through"
    (_, d1, d2), (strides,) = layout
    n_rows = out.numel() // d if d else 0
    grid, meta = columns_launch(n_rows, d)
    with device_of(x):
        _act_and_mul_kernel[grid](x, out, n_rows, d, d1, d2, *strides, ACT=act, **meta)
    return out


def columns_launch(n_rows: int, n: int) -> tuple[tuple[int, int], dict[str, int]]:
    """How an elementwise kernel with no row reduction covers ``n_rows`` rows of ``n`` columns:
    programs of ``ROWS`` rows by ``BLOCK`` columns (few tokens still spread over many SMs);
    its grid and ``BLOCK``, ``ROWS``, ``num_warps``."""
    block = min(triton.next_power_of_2(n), STATIC_BLOCK)
    per = _rows_per_program(block)
    return (triton.cdiv(n_rows, per), triton.cdiv(n, block)), {"BLOCK": block, "ROWS": per, "num_warps": _warps(block * per)}


# --------------------------------------------------------------------------- the ops' signatures


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, cast_last: bool = False,
             round_scale: bool = False) -> Tensor:  # fmt: skip
    plain = weight is None or (cast_last and not round_scale)
    dtype = x.dtype if plain else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _norm_rows(x, weight, eps, out, None, cast_last, 0.0, round_scale)
    return out


def l2_norm(x: Tensor, eps: float) -> Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm_rows(x, None, eps, out, None, False, 0.0, mean=False)
    return out


def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm_rows(x, weight, eps, out, None, True, 1.0)
    return out


def fused_add_rms_norm_(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, cast_last: bool = False) -> None:
    _norm_rows(x, weight, eps, x, residual, cast_last, 0.0)


def gemma_fused_add_rms_norm_(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    _norm_rows(x, weight, eps, x, residual, True, 1.0)


def sum_add_rms_norm(partials: Tensor, residual: Tensor, weight: Tensor, eps: float, out: Tensor,
                     total: Tensor) -> None:  # fmt: skip
    """``partials`` ``[S, n, H]`` (rows contiguous, any slot stride): ``total = sum of the S
    partials + residual`` in float32, rounded once; ``out = rms_norm(total, weight, eps)``;
    ``residual``, ``out`` and ``total`` ``[n, H]`` (``total`` at ``residual``'s strides). A
    reduce-scatter's partial products, the residual add and the norm in one pass
    (``runtime/ops/async_tp.py``); the sum is not rounded before the add, as the fused
    all-reduce kernels do not round it (a reduce-scatter on its own would)."""
    _norm_rows(partials[0], weight, eps, out, residual, False, 0.0, total=total, slots=partials.shape[0],
               slot_stride=partials.stride(0))  # fmt: skip


def exchange_add_rms_norm(mine: Tensor, slot_table: Tensor, residual: Tensor, weight: Tensor, eps: float,
                          out: Tensor, out_table: Tensor, total: Tensor) -> None:  # fmt: skip
    """Sequence parallelism's reduce-scatter, add + norm and all-gather in one pass over this
    rank's rows, through memory every rank maps (``runtime/ops/async_tp.py``): ``mine`` ``[n, H]``
    is those rows of this rank's partial product, and ``slot_table[k]`` the byte offset from it
    of the same rows of rank ``k``'s (``0`` for this rank); ``total = their float32 sum +
    residual``, rounded once; ``out = rms_norm(total, weight, eps)`` stored at ``out`` and
    ``out_table[k]`` bytes from it (each rank's copy of these rows). ``residual``, ``out`` and
    ``total`` ``[n, H]`` (``total`` at ``residual``'s strides)."""
    _norm_rows(mine, weight, eps, out, residual, False, 0.0, total=total, tables=(slot_table, out_table))


def silu_and_mul(x: Tensor) -> Tensor:
    return _act_and_mul(x, 0)


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    return _act_and_mul(x, 2 if approximate == "tanh" else 1)


def rms_norm_quant_fp8(x: Tensor, weight: Tensor, eps: float, scale: Tensor, cast_last: bool = False) -> Tensor:
    return _rms_norm_quant(x, weight, eps, scale, None, cast_last)[0]


def rms_norm_dynamic_quant_fp8(x: Tensor, weight: Tensor, eps: float, cast_last: bool = False) -> tuple[Tensor, Tensor]:
    q, s, _ = _rms_norm_quant(x, weight, eps, None, None, cast_last)
    return q, s  # type: ignore[return-value]


def fused_add_rms_norm_quant_fp8(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor, cast_last: bool = False
) -> tuple[Tensor, Tensor]:
    q, _, total = _rms_norm_quant(x, weight, eps, scale, residual, cast_last)
    return q, total  # type: ignore[return-value]


def fused_add_rms_norm_dynamic_quant_fp8(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, cast_last: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    return _rms_norm_quant(x, weight, eps, None, residual, cast_last)  # type: ignore[return-value]


def silu_and_mul_quant_fp8(x: Tensor, scale: Tensor) -> Tensor:
    return _silu_and_mul_quant(x, scale)[0]


def silu_and_mul_dynamic_quant_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    return _silu_and_mul_quant(x, None)  # type: ignore[return-value]


def dynamic_quant_fp8(y: Tensor) -> tuple[Tensor, Tensor]:
    q, s, _ = _rms_norm_quant(y, None, 0.0, None, None)
    return q, s  # type: ignore[return-value]


def act_mul_quant_fp8(a: Tensor, b: Tensor, scale: Tensor, activation: str = "silu") -> Tensor:
    return _act_mul_quant(a, b, scale, ACT_MUL_ACTIVATIONS.index(activation))[0]


def act_mul_dynamic_quant_fp8(a: Tensor, b: Tensor, activation: str = "silu") -> tuple[Tensor, Tensor]:
    return _act_mul_quant(a, b, None, ACT_MUL_ACTIVATIONS.index(activation))  # type: ignore[return-value]
