"""The ``triton`` provider's NVFP4 kernels (``fxr.*_quant_nvfp4``): RMSNorm, add + RMSNorm or a
gated activation, and the NVFP4 quantizer after it, in one kernel.

    # unfused: the norm kernel, then ~25 torch ops (or a quantizer kernel)   # one kernel
    y = rms_norm(x, w, eps); q, s = quant_nvfp4(y, g)                        q, s = rms_norm_quant_nvfp4(x, w, eps, g)

One kernel serves every op (``PRE`` picks what precedes the quantizer; ``PRE=0``, the quantizer
alone, is :func:`quant_nvfp4` here: ``fxr.quant_nvfp4``, the unfused pair's second half in
bench/bench_ops.py, and the GPU tests' bit-exact check). The value before the quantizer is rounded where the spec rounds it
(``runtime/ops/quant_nvfp4.py`` and the norm / activation references); the quantizer is the
spec's step for step: IEEE products and divisions (``div_rn``), the scale rounded to e4m3 by the
conversion (to nearest even), and the e2m1 code counted from the grid's midpoints, ``>`` where a
tie goes down to the even code and ``>=`` where it goes up, which is ``torch.round`` on the
grid's steps. So the codes and scales are the spec's bits whenever the quantizer's input is;
what can differ before it on the GPU is the norm's summation order and approximate ``rsqrt`` /
``exp`` (``STORE_Y`` lets the GPU tests read that input back and check the quantizer alone).

Imported through ``providers.library("fxrewrite.runtime.triton_nvfp4")`` only, as the other
Triton modules are; under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxrewrite.runtime.ops import quant_nvfp4 as spec
from fxrewrite.runtime.triton_kernels import STATIC_BLOCK, _warps, activate, device_of

ACTS = {"silu": 0, "none": 1, "tanh": 2}  # triton_kernels.activate's codes, by GELU's ``approximate`` (or SiLU)
NONE, NORM, ADD_NORM, ACT = 0, 1, 2, 3  # PRE


@triton.jit
def _quantize_nvfp4(y, col0, n, q_ptr, s_ptr, g_ptr, BLOCK: tl.constexpr):
    """Store ``y`` ([BLOCK] float32, columns ``col0 + i`` of one row, ``n`` valid; ``col0`` and
    ``n`` multiples of 16) as NVFP4: codes two a byte at ``q_ptr`` (the row's), scales at ``s_ptr``."""
    blocks = tl.reshape(y, [BLOCK // 16, 16])
    g = tl.zeros([BLOCK // 16], tl.float32) + tl.load(g_ptr)
    one = tl.full([BLOCK // 16], 1.0, tl.float32)
    amax = tl.max(tl.abs(blocks), axis=1)
    s = tl.clamp(g * (amax * 0.16666666666666666), -448.0, 448.0)  # 1 / 6 in float32, as the spec
    s8 = s.to(s_ptr.dtype.element_ty)
    t = s8.to(tl.float32) * tl.math.div_rn(one, g)
    inv = tl.where(t == 0.0, 0.0, tl.math.div_rn(one, tl.where(t == 0.0, 1.0, t)))  # no 1 / 0 computed
    v = tl.clamp(blocks * inv[:, None], -6.0, 6.0)
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
            + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))  # fmt: skip
    code = code + tl.where(v < 0.0, 8, 0)
    pairs = tl.reshape(code, [BLOCK // 2, 2])
    packed = tl.sum(pairs << (tl.arange(0, 2) * 4)[None, :], axis=1)
    q_cols = col0 // 2 + tl.arange(0, BLOCK // 2)
    tl.store(q_ptr + q_cols, packed.to(tl.uint8), mask=q_cols < n // 2)
    s_cols = col0 // 16 + tl.arange(0, BLOCK // 16)
    tl.store(s_ptr + s_cols, s8, mask=s_cols < n // 16)


@triton.jit
def _nvfp4_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, y_ptr, q_ptr, s_ptr, g_ptr, b_ptr, x_stride, r_stride, b_stride, n, eps,
                  BLOCK: tl.constexpr, PRE: tl.constexpr, ACT_KIND: tl.constexpr, STORE_Y: tl.constexpr,
                  CAST_LAST: tl.constexpr = False):  # fmt: skip
    """Program (row, column block) (one block holds the row for the norms): ``y`` of ``n``
    values, then NVFP4. ``PRE``: 0 ``y = x``; 1 ``y = w * norm(x).to(dtype)`` rounded to the dtype
    (``CAST_LAST``: ``(w * norm(x))`` rounded once);
    2 the same of ``sum = (x + r)`` rounded, ``sum`` stored; 3 ``y = (act(gate).to(dtype) * up)``
    rounded, ``gate = x[row, :n]``, ``up = b[row, :n]`` (rows at ``b_stride``: the halves of one
    [.., 2n] row, ``b`` then ``x`` ``n`` columns in, or ``fxr.act_mul``'s second operand). ``STORE_Y``: ``y`` stored too."""
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK
    cols = col0 + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = x_ptr.dtype.element_ty
    x_row = x_ptr + row * x_stride
    if PRE == 3:
        gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(b_ptr + row * b_stride + cols, mask=mask, other=0.0).to(tl.float32)
        act = activate(gate, ACT_KIND).to(dtype).to(tl.float32)
        y = (act * up).to(dtype).to(tl.float32)
    else:
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        if PRE == 2:
            r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(sum_ptr + row * n + cols, x, mask=mask)
        h = x.to(tl.float32)
        if PRE == 0:
            y = h
        else:
            h = h * tl.math.rsqrt(tl.sum(h * h, axis=0) / n + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if not CAST_LAST:
                h = h.to(dtype).to(tl.float32)
            y = (w * h).to(dtype).to(tl.float32)
    if STORE_Y:
        tl.store(y_ptr + row * n + cols, y.to(dtype), mask=mask)
    _quantize_nvfp4(y, col0, n, q_ptr + row * (n // 2), s_ptr + row * (n // 16), g_ptr, BLOCK)


def _launch(x: Tensor, global_scale: Tensor, pre: int, n: int, weight: Tensor | None = None, eps: float = 0.0,
            residual: Tensor | None = None, act: str = "silu",
            y_out: Tensor | None = None, cast_last: bool = False, b: Tensor | None = None) -> tuple[Tensor, ...]:  # fmt: skip
    """(q, s[, sum]) shaped as the op returns them, for ``n`` output values a row; ``y_out``
    (rows x n, x's dtype) receives the quantizer's input; ``b``: an activation's up operand (``x``
    its gate, both [.., n]), else the activations read the halves of ``x``'s rows."""
    rows = x.view(-1, x.shape[-1])
    up = b.view(-1, n) if b is not None else rows[:, n:] if pre == ACT else rows
    lead = x.shape[:-1]
    q = torch.empty((*lead, n // 2), dtype=torch.uint8, device=x.device)
    s = torch.empty((*lead, n // spec.BLOCK), dtype=spec.SCALE_DTYPE, device=x.device)
    res = residual.view(-1, n) if residual is not None else rows
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else q
    if pre in (NORM, ADD_NORM):
        block = triton.next_power_of_2(n)
    else:
        block = min(triton.next_power_of_2(n), STATIC_BLOCK)
    grid = (rows.shape[0], triton.cdiv(n, block))
    with device_of(x):
        _nvfp4_kernel[grid](
            rows, res, weight if weight is not None else rows, total, y_out if y_out is not None else q, q, s,
            global_scale, up, rows.stride(0), res.stride(0), up.stride(0), n, eps, BLOCK=block, PRE=pre, ACT_KIND=ACTS[act],
            STORE_Y=y_out is not None, CAST_LAST=cast_last, num_warps=_warps(block),
        )  # fmt: skip
    return (q, s, total) if residual is not None else (q, s)


# --------------------------------------------------------------------------- the ops' signatures


def quant_nvfp4(y: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor]:
    """The quantizer alone (``fxr.quant_nvfp4``; the unfused pair's second half, and GPU tests)."""
    return _launch(y, global_scale, NONE, y.shape[-1])  # type: ignore[return-value]


def rms_norm_quant_nvfp4(x: Tensor, weight: Tensor, eps: float, global_scale: Tensor, cast_last: bool = False,
                         y_out: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    return _launch(x, global_scale, NORM, x.shape[-1], weight, eps, y_out=y_out, cast_last=cast_last)  # type: ignore[return-value]


def fused_add_rms_norm_quant_nvfp4(x: Tensor, residual: Tensor, weight: Tensor, eps: float, global_scale: Tensor,
                                   cast_last: bool = False,
                                   y_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    out = _launch(x, global_scale, ADD_NORM, x.shape[-1], weight, eps, residual, y_out=y_out, cast_last=cast_last)
    return out  # type: ignore[return-value]


def silu_and_mul_quant_nvfp4(x: Tensor, global_scale: Tensor, y_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return _launch(x, global_scale, ACT, x.shape[-1] // 2, y_out=y_out)  # type: ignore[return-value]


def gelu_and_mul_quant_nvfp4(x: Tensor, global_scale: Tensor, approximate: str = "none",
                             y_out: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    return _launch(x, global_scale, ACT, x.shape[-1] // 2, act=approximate, y_out=y_out)  # type: ignore[return-value]


def act_mul_quant_nvfp4(a: Tensor, b: Tensor, global_scale: Tensor, activation: str = "silu",
                        y_out: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    act = {"silu": "silu", "gelu": "none", "gelu_tanh": "tanh"}[activation]  # ACTS is keyed by GELU's approximate
    return _launch(a, global_scale, ACT, a.shape[-1], act=act, y_out=y_out, b=b)  # type: ignore[return-value]
