"""The ``triton`` provider's gated RMSNorm (``fxr.rms_norm_gated``): the norm, its weight and a
SiLU or sigmoid gate in one kernel, over rows at any strides (a gate sliced out of a merged
projection, per-head rows), any float dtype, groups of the row normalized apart (Mamba2).

    # three to six kernels (cast, act, mul, norm, mul, cast)   # one
    y = w * norm(x).to(dtype); y = (y * F.silu(z.float())).to(dtype)  y = rms_norm_gated(x, z, w, eps)

It rounds where the spec (``runtime/ops/norm_variants.py``) rounds; what differs is the order of
the row sum and the approximate ``rsqrt`` and ``exp``. Imported through
``providers.library("fxrewrite.runtime.triton_norms")`` only, as ``triton_kernels`` is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxrewrite.runtime.triton_kernels import device_of, row_offsets, rows_launch

ACTS = {"silu": 0, "sigmoid": 1}


@triton.jit
def _rms_norm_gated_kernel(x_ptr, g_ptr, w_ptr, out_ptr, n_rows, groups, size, eps, d1, d2,
                           xs0, xs1, xs2, gs0, gs1, gs2, os0, os1, os2,
                           BLOCK: tl.constexpr, ROWS: tl.constexpr, GATE_FIRST: tl.constexpr, ACT: tl.constexpr,
                           CAST_LAST: tl.constexpr, ROUND_WEIGHTED: tl.constexpr):  # fmt: skip
    """``ROWS`` group rows per program: row ``r`` is group ``r % groups`` (``size`` values) of
    token row ``r // groups`` (leading dims [d0, d1, d2] at any strides per tensor). ``a =
    act(gate)``; ``h = x`` (times ``a`` first with ``GATE_FIRST``); ``h *= rsqrt(mean(h^2) +
    eps)``; ``y = w * h`` (``CAST_LAST``) or ``w * h.to(dtype)``, rounded to the dtype when
    ``ROUND_WEIGHTED`` (the weight is of the input's dtype or narrower); without ``GATE_FIRST``
    ``y * a``; stored in ``out``'s dtype."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < size)[None, :]
    dtype = x_ptr.dtype.element_ty
    tokens = rows // groups
    col = ((rows % groups) * size)[:, None] + cols[None, :]
    h = tl.load(x_ptr + row_offsets(tokens, d1, d2, xs0, xs1, xs2)[:, None] + col, mask=mask, other=0.0)
    g = tl.load(g_ptr + row_offsets(tokens, d1, d2, gs0, gs1, gs2)[:, None] + col, mask=mask, other=0.0)
    h, g = h.to(tl.float32), g.to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))  # F.silu, approximate division
    else:
        a = 1.0 / (1.0 + tl.exp(-g))
    if GATE_FIRST:
        h = h * a
    h = h * tl.math.rsqrt(tl.sum(h * h, axis=1) / size + eps)[:, None]
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    if CAST_LAST:
        y = w * h
    else:
        y = w * h.to(dtype).to(tl.float32)
        if ROUND_WEIGHTED:
            y = y.to(dtype).to(tl.float32)
    if not GATE_FIRST:
        y = y * a
    o_off = row_offsets(tokens, d1, d2, os0, os1, os2)[:, None] + col
    tl.store(out_ptr + o_off, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_gated(x: Tensor, gate: Tensor, weight: Tensor, eps: float, group_size: int | None = None,
                   gate_first: bool = False, activation: str = "silu", cast_last: bool = False) -> Tensor:  # fmt: skip
    n = x.shape[-1]
    size = n if group_size is None else group_size
    weighted = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=weighted if gate_first and not cast_last else x.dtype, device=x.device)
    grid, layout, meta = rows_launch(size, x, gate, out)  # a program's rows are groups
    with device_of(x):
        _rms_norm_gated_kernel[grid](
            x, gate, weight, out, x.numel() // size, n // size, size, eps, *layout, GATE_FIRST=gate_first,
            ACT=ACTS[activation], CAST_LAST=cast_last, ROUND_WEIGHTED=weighted == x.dtype, **meta,
        )  # fmt: skip
    return out
