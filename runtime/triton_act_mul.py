"""The ``triton`` provider's ``fxr.act_mul``: ``act(a) * b`` for two operands of one shape in one
elementwise pass (eager: the activation, written out and read back, then the product). No library
has this kernel: sgl-kernel 0.4.6 and flashinfer 0.7.2 take one [..., 2d] tensor.

    # two kernels (silu, mul)               # one
    y = scan_output * F.silu(gate)          y = act_mul(gate, scan_output, "silu", False)

Operands at any strides (a gate chunked along a [B, 2D, L] projection's channels, the product
read in eager's layout): the launcher allocates the output at the strides eager gives the
product (``activation.out_strides``) and walks it in its memory order, the output contiguous
there, each operand at its own strides (``activation.act_mul_plan``). It rounds where the spec
rounds: the activation to ``a``'s dtype, then the product to the promoted dtype (eager computes a
product of two float dtypes in float32 too). Imported through
``providers.library("fxrewrite.runtime.triton_act_mul")`` only, as ``triton_kernels`` is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxrewrite.runtime.ops import activation as ops
from fxrewrite.runtime.triton_kernels import activate, columns_launch, device_of, row_offsets


@triton.jit
def _act_mul_kernel(a_ptr, b_ptr, out_ptr, n_rows, n, d1, d2, as0, as1, as2, asn, bs0, bs1, bs2, bsn,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, ACT: tl.constexpr):  # fmt: skip
    """``out = act(a).to(a's dtype) * b`` in float32, rounded to ``out``'s dtype (the promoted one). Row ``r`` (leading dims [d0, d1, d2])
    of ``n`` columns: ``a`` at ``row_offsets(r, .., as0, as1, as2) + col * asn``, ``b`` likewise,
    ``out`` at ``r * n + col``. Program (row block, column block)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n)[None, :]
    a = tl.load(a_ptr + row_offsets(rows, d1, d2, as0, as1, as2)[:, None] + (cols * asn)[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + row_offsets(rows, d1, d2, bs0, bs1, bs2)[:, None] + (cols * bsn)[None, :], mask=mask, other=0.0)
    y = activate(a.to(tl.float32), ACT).to(a_ptr.dtype.element_ty).to(tl.float32) * b.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * n + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def act_mul(a: Tensor, b: Tensor, activation: str = "silu", act_first: bool = True) -> Tensor:
    stride = ops.out_strides(a, b, activation, act_first)
    plan = ops.act_mul_plan(tuple(a.shape), a.stride(), b.stride(), stride)
    assert not isinstance(plan, str), "the op module's check lets only such layouts through"
    n, (_, d1, d2), sa, sb = plan
    out = torch.empty_strided(a.shape, stride, dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    n_rows = a.numel() // n
    grid, meta = columns_launch(n_rows, n)
    with device_of(a):
        _act_mul_kernel[grid](a, b, out, n_rows, n, d1, d2, *sa, *sb,
                              ACT=ops.ACT_MUL_ACTIVATIONS.index(activation), **meta)  # fmt: skip
    return out
