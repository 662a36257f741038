"""Triton kernels of the block-FP8 ops (``runtime/ops/quant_block.py``): RMSNorm, add + RMSNorm,
SiLU-and-mul and GELU-and-mul (erf, tanh), each followed by per-token-group FP8 quantization, in
one kernel; one kernel for all of them, the producer picked by a constexpr.

    # two kernels (norm, then sgl_per_token_group_quant_fp8)   # one kernel
    y = rms_norm(x, w, eps)                                    q, s = rms_norm_block_quant_fp8(x, w, eps, 128)
    q, s = quant_fp8_block(y, 128)

A program holds one row's tile as ``[GROUPS, GROUP]`` (a group per tile row): for a norm the
whole row (its sum of squares is one reduction), for an activation or the quantizer alone
(``QUANT_ONLY``: ``fxr.block_quant_fp8``) ``ACT_BLOCK`` columns of it.
The quantization is the spec's float32 steps in its order, IEEE where the spec is: ``s =
div_rn(max(amax, 1e-12), 448)``, ``q = clamp(div_rn(y, s), -448, 448)`` rounded to nearest
even, so the bytes and scales equal ``quant_fp8_block`` of ``y`` bit for bit. ``y`` is rounded
to the input dtype where the unfused torch code rounds it (the sum, the normed value, the
weighted value, the activation, its product), to nearest even as the GPU's ``cvt.rn`` rounds
(the CPU tests make Triton's interpreter round so: ``tests/runtime/conftest.py``). ``rsqrt`` is
``1 / sqrt``, both steps IEEE, as torch computes it on CPU; ``exp`` and ``erf`` are Triton's,
``tanh(z)`` is ``1 - 2 / (1 + exp(2z))``; built without FP fusion (no FMA contracts a product
into a sum the spec rounds apart). What may differ from the reference is the order of the
sum of squares and those functions' last bits (measured in the interpreter on random rows: none
in bf16 / fp16 norms, about 1e-4 of the activations' FP8 values; float32 scales, unrounded, move
with every last bit). With ``STORE_Y`` the kernel also stores ``y``: the tests quantize it with
the spec and compare, bit for bit.

Imports ``triton`` at the top: the op module reaches it through ``providers.library``. Runs
under ``TRITON_INTERPRET=1`` on CPU tensors (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxrewrite.runtime.ops import quant, quant_block
from fxrewrite.runtime.ops.activation import ACT_MUL_ACTIVATIONS
from fxrewrite.runtime.triton_kernels import _warps, device_of

FP8_MAX: tl.constexpr = tl.constexpr(quant.FP8_MAX)
AMAX_FLOOR: tl.constexpr = tl.constexpr(quant.AMAX_FLOOR)
ACT_BLOCK = 1024  # columns an activation program holds (the row is spread over programs)

# the producer before the quantization (constexpr MODE; constexpr globals, as a kernel reads them)
QUANT_ONLY, RMS_NORM, ADD_RMS_NORM, SILU, GELU, GELU_TANH = (tl.constexpr(i) for i in range(6))


@triton.jit
def _block_quant_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, q_ptr, s_ptr, y_ptr, b_ptr, x_stride, b_stride, n, eps,
                        GROUP: tl.constexpr, GROUPS: tl.constexpr, MODE: tl.constexpr,
                        STORE_Y: tl.constexpr, CAST_LAST: tl.constexpr = False):  # fmt: skip
    """Program (row, block): ``y`` over columns ``[block * GROUPS * GROUP, ...)`` of the output
    row (``n`` columns), then FP8 per group. The activations read the gate from ``x`` and up from
    ``b``, rows at strides ``x_stride`` and ``b_stride`` (the halves of one [.., 2n] row: ``b`` is
    ``x`` ``n`` columns in; ``fxr.act_mul``'s operands: two tensors); the norms read contiguous rows.
    A norm's ``y`` is ``w * normed.to(dtype)`` rounded, or with ``CAST_LAST`` ``(w * normed)`` rounded once."""
    row = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * GROUPS
    groups = g0 + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < n
    dtype = x_ptr.dtype.element_ty
    if MODE <= ADD_RMS_NORM:
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
        if MODE == ADD_RMS_NORM:
            x = (x.to(tl.float32) + tl.load(r_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            tl.store(sum_ptr + row * n + cols, x, mask=mask)
        y = x.to(tl.float32)
        if MODE != QUANT_ONLY:
            ss = tl.sum(tl.sum(y * y, axis=1), axis=0)
            scale = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, n.to(tl.float32)) + eps))
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = y * scale
            if not CAST_LAST:
                y = y.to(dtype).to(tl.float32)
            y = (w * y).to(dtype).to(tl.float32)
    else:
        gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(b_ptr + row * b_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if MODE == SILU:
            act = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
        elif MODE == GELU:
            act = gate * 0.5 * (1.0 + tl.math.erf(gate * 0.7071067811865476))
        else:
            inner = 0.7978845608028654 * (gate + 0.044715 * (gate * gate * gate))
            act = 0.5 * gate * (2.0 - tl.math.div_rn(2.0, 1.0 + tl.exp(2.0 * inner)))  # 1 + tanh(inner)
        y = (act.to(dtype).to(tl.float32) * up).to(dtype).to(tl.float32)
    if STORE_Y:
        tl.store(y_ptr + row * n + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1)
    s = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
    q = tl.clamp(tl.math.div_rn(y, s[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * n + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * (n // GROUP) + groups, s, mask=groups < n // GROUP)


def launch(mode: int, x: Tensor, n: int, group: int, weight: Tensor | None = None, eps: float = 0.0,
           residual: Tensor | None = None, y_out: Tensor | None = None,
           cast_last: bool = False, b: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """Run :func:`_block_quant_kernel` over ``x``'s rows (contiguous; ``n`` output columns per
    row); returns ``(q, s, sum or None)`` shaped as the op returns them. ``y_out`` (a tensor of
    the output's shape): store the value quantized there too. ``cast_last``: the norms' order.
    ``b``: an activation's up operand, ``x`` its gate (each rows at one stride, of ``n`` values);
    without it the activations read the halves of ``x``'s rows."""
    mode = int(getattr(mode, "value", mode))
    rows = x.numel() // x.shape[-1]
    gate, up = (x, b) if b is not None else (x[..., :n], x[..., n:]) if mode > ADD_RMS_NORM else (x, x)
    gate, up = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])  # views (checked by the op module)
    shape = (*x.shape[:-1], n)
    q, s = quant_block.block_outputs(x, group, shape)
    total = torch.empty_like(x) if residual is not None else None
    per_row = triton.next_power_of_2(n // group)
    norm = mode in (RMS_NORM, ADD_RMS_NORM)  # a row's sum of squares: the row in one program
    groups = per_row if norm else max(1, min(per_row, ACT_BLOCK // group))
    dummy = x
    with device_of(x):
        _block_quant_kernel[(rows, triton.cdiv(n // group, groups))](
            gate, residual if residual is not None else dummy, weight if weight is not None else dummy,
            total if total is not None else dummy, q, s, y_out if y_out is not None else dummy, up,
            gate.stride(0), up.stride(0), n, eps,
            GROUP=group, GROUPS=groups, MODE=mode, STORE_Y=y_out is not None, CAST_LAST=cast_last,
            num_warps=_warps(groups * group),
            enable_fp_fusion=False,  # no FMA: each product and sum rounds on its own, as the spec's
        )  # fmt: skip
    return q, s, total


# --------------------------------------------------------------------------- the ops' signatures


def rms_norm_block_quant_fp8(x: Tensor, weight: Tensor, eps: float, group: int,
                             cast_last: bool = False) -> tuple[Tensor, Tensor]:  # fmt: skip
    q, s, _ = launch(RMS_NORM, x, x.shape[-1], group, weight, eps, cast_last=cast_last)
    return q, s


def fused_add_rms_norm_block_quant_fp8(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group: int, cast_last: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    return launch(ADD_RMS_NORM, x, x.shape[-1], group, weight, eps, residual, cast_last=cast_last)  # type: ignore[return-value]


def silu_and_mul_block_quant_fp8(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    q, s, _ = launch(SILU, x, x.shape[-1] // 2, group)
    return q, s


def gelu_and_mul_block_quant_fp8(x: Tensor, group: int, approximate: str = "none") -> tuple[Tensor, Tensor]:
    q, s, _ = launch(GELU_TANH if approximate == "tanh" else GELU, x, x.shape[-1] // 2, group)
    return q, s


def act_mul_block_quant_fp8(a: Tensor, b: Tensor, group: int, activation: str = "silu") -> tuple[Tensor, Tensor]:
    mode = (SILU, GELU, GELU_TANH)[ACT_MUL_ACTIVATIONS.index(activation)]
    q, s, _ = launch(mode, a, a.shape[-1], group, b=b)
    return q, s


def block_quant_fp8(y: Tensor, group: int = quant_block.GROUP) -> tuple[Tensor, Tensor]:
    """``quant_fp8_block(y, group)`` alone (the quantizer the fused kernels end in)."""
    q, s, _ = launch(QUANT_ONLY, y, y.shape[-1], group)
    return q, s
