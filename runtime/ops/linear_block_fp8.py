"""``fxr::linear_block_fp8``: the GEMM of a block-FP8 checkpoint (DeepSeek-V3's format, the FP8
releases of Qwen3 and others), on FP8 tensor cores where the device has them.

Activations arrive quantized per token and group of 128 along K (``fxr.*_block_quant_fp8``,
the spec ``quant_block.quant_fp8_block``: e4m3 values ``a_q`` [..., K], float32 scales
``a_scale`` [..., K / 128]); the weight is quantized offline per 128 x 128 tile (e4m3 ``w_q``
[N, K], float32 ``w_scale`` [N / 128, K / 128]: :func:`quant_weight_block`). The product is the
dequantized one, accumulated in float32 and rounded once to ``out_dtype``::

    # before: the dequantizing reference GEMM               # after
    a = dequant_fp8_block(a_q, a_scale)                      y = torch.ops.fxr.linear_block_fp8(
    y = F.linear(a, dequant_weight_block(w_q, w_scale))          a_q, a_scale, w_q, w_scale, torch.bfloat16)

CUDA, in order (not measured against each other yet: ``bench/bench_ops.py --ops linear_block_fp8``
times the first against the reference; an override cannot pick the second, whose provider
"torch" forces the reference: it serves where Triton does not import, and its GPU test calls it):

- ``triton``: our kernel (``fxrewrite.runtime.triton_linear_block_fp8``): per output tile, one
  ``tl.dot`` of e4m3 operands per 128-wide K block, its float32 result times the two blocks'
  scales added to a float32 accumulator (the scales change every 128 along K, so each block's
  product is promoted and scaled before the next; Ada, Hopper and newer).
- ``torch`` (label ``cublaslt``): ``torch._scaled_mm`` with the DeepSeek recipe, activations
  ``BlockWise1x128`` (scales outer-dim-major: a transposed copy of ``a_scale``) and weights
  ``BlockWise128x128`` (``w_scale`` as it is, read through ``.t()``): cuBLASLt >= 12.9, Hopper
  only (``ScaledBlas.cpp``: "DeepSeek style (1x128, 128x128) scaling only supported in CUDA for
  SM90"; on Blackwell cuBLAS takes no 2D block scales).

Neither is bit exact with the reference (summation order, and Hopper's FP8 MMA accumulates a
block's products in less than float32): within a few float32 roundings of the output's scale
(``tests/runtime/test_linear_block_fp8_ops.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops.quant import AMAX_FLOOR, FP8_CAPABILITY, FP8_DTYPE, FP8_MAX
from fxrewrite.runtime.ops.quant_block import GROUP, dequant_fp8_block
from fxrewrite.runtime.providers import Kernel, OpDef

BLOCK = GROUP  # weights: 128 x 128 tiles; activations: groups of 128 along K
TRITON_MODULE = "fxrewrite.runtime.triton_linear_block_fp8"
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# --------------------------------------------------------------------------- the weight format


def quant_weight_block(w: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """``w`` [N, K] (both multiples of ``block``) -> (q [N, K] FP8, s [N / block, K / block] float32),
    each ``block`` x ``block`` tile scaled by its own ``max(amax, 1e-12) / 448``."""
    n, k = w.shape
    tiles = w.float().reshape(n // block, block, k // block, block)
    s = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    q = (tiles / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(n, k), s.reshape(n // block, k // block)


def dequant_weight_block(q: Tensor, s: Tensor) -> Tensor:
    """float32 ``q * s``, each scale over its tile."""
    block_n, block_k = q.shape[0] // s.shape[0], q.shape[1] // s.shape[1]
    return q.float() * s.repeat_interleave(block_n, 0).repeat_interleave(block_k, 1)


# --------------------------------------------------------------------------- the spec


def linear_block_fp8_reference(a_q: Tensor, a_scale: Tensor, w_q: Tensor, w_scale: Tensor,
                               out_dtype: torch.dtype) -> Tensor:  # fmt: skip
    """``F.linear(dequant_fp8_block(a_q, a_scale), dequant_weight_block(w_q, w_scale)).to(out_dtype)``:
    [..., K] x [N, K] -> [..., N], in float32, rounded once."""
    return F.linear(dequant_fp8_block(a_q, a_scale), dequant_weight_block(w_q, w_scale)).to(out_dtype)


def _fake(a_q: Tensor, a_scale: Tensor, w_q: Tensor, w_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    return a_q.new_empty((*a_q.shape[:-1], w_q.shape[0]), dtype=out_dtype)


# --------------------------------------------------------------------------- kernel constraints


def check_formats(a_q: Tensor, a_scale: Tensor, w_q: Tensor, w_scale: Tensor, out_dtype: torch.dtype) -> str | None:
    """What both kernels need (and the spec assumes): e4m3 operands, float32 scales in the layouts
    above (groups of 128 along K, 128 x 128 weight tiles), K and N multiples of 128, contiguous
    operands, one device."""
    if a_q.dtype != FP8_DTYPE or w_q.dtype != FP8_DTYPE:
        return f"operands {a_q.dtype}, {w_q.dtype} are not float8_e4m3fn"
    if a_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        return f"scales {a_scale.dtype}, {w_scale.dtype} are not float32"
    if out_dtype not in OUT_DTYPES:
        return f"output dtype {out_dtype}"
    if a_q.dim() == 0 or w_q.dim() != 2 or a_q.shape[-1] != w_q.shape[1]:
        return f"shapes {tuple(a_q.shape)} x {tuple(w_q.shape)}"
    n, k = w_q.shape
    if a_q.numel() == 0 or n == 0:
        return "empty operand"
    if k % BLOCK or n % BLOCK:
        return f"K {k} and N {n} are not multiples of {BLOCK}"
    if tuple(a_scale.shape) != (*a_q.shape[:-1], k // BLOCK):
        return f"activation scales {tuple(a_scale.shape)}: not one per {BLOCK} of K"
    if tuple(w_scale.shape) != (n // BLOCK, k // BLOCK):
        return f"weight scales {tuple(w_scale.shape)}: not one per {BLOCK} x {BLOCK} tile"
    for t in (a_q, a_scale, w_q, w_scale):
        if not t.is_contiguous():
            return "operand or scales not contiguous"
    return constraints.check_same_device(a_q, a_scale, w_q, w_scale)


def _cublaslt_check(a_q: Tensor, a_scale: Tensor, w_q: Tensor, w_scale: Tensor, out_dtype: torch.dtype) -> str | None:
    reason = check_formats(a_q, a_scale, w_q, w_scale, out_dtype)
    cap = providers.device_capability(a_q.device)
    if reason is None and cap is not None and cap[0] != 9:
        return f"sm{cap[0]}{cap[1]}: cuBLASLt's 1x128 x 128x128 block scaling is Hopper's"
    if reason is None and a_q.device.type == "cuda":
        key = (a_q.device, a_q.numel() // a_q.shape[-1], w_q.shape[0], a_q.shape[-1], out_dtype)
        if key not in _PROBED and torch.cuda.is_current_stream_capturing():
            return "cuBLASLt's block scaling not probed at this shape before capture"
        return _probe(key)
    return reason


_PROBED: dict[tuple[Any, ...], str | None] = {}


def _probe(key: tuple[Any, ...]) -> str | None:
    """Whether this torch and cuBLAS run the block-scaled recipe at these sizes (torch 2.11 with
    the H100 machine's cuBLAS runs a 128-row product and answers CUBLAS_STATUS_NOT_SUPPORTED for
    one row): one product of zeros of the call's sizes, once per sizes."""
    if key not in _PROBED:
        device, m, n, k, out_dtype = key
        a = torch.zeros(m, k, device=device).to(torch.float8_e4m3fn)
        w = torch.zeros(n, k, device=device).to(torch.float8_e4m3fn)
        try:
            _cublaslt(a, torch.ones(m, k // BLOCK, device=device), w, torch.ones(n // BLOCK, k // BLOCK, device=device),
                      out_dtype)  # fmt: skip
            _PROBED[key] = None
        except RuntimeError as e:
            _PROBED[key] = f"this torch / cuBLAS lacks the block-scaled recipe at {m} x {n} x {k}: {str(e).splitlines()[0][:100]}"
    return _PROBED[key]


# --------------------------------------------------------------------------- kernels


def _cublaslt(a_q: Tensor, a_scale: Tensor, w_q: Tensor, w_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``torch._scaled_mm`` (cuBLASLt): A [M, K] row-major with scales [M, K / 128] outer-dim-major
    (stride (1, M)); B = ``w_q.t()`` [K, N] column-major with scales ``w_scale.t()``."""
    k = a_q.shape[-1]
    rows, scales = a_q.reshape(-1, k), a_scale.reshape(-1, k // BLOCK)
    out = torch._scaled_mm(rows, w_q.t(), scale_a=scales.t().contiguous().t(), scale_b=w_scale.t(),
                           out_dtype=out_dtype)  # fmt: skip
    return out.view(*a_q.shape[:-1], w_q.shape[0])


DEFS: tuple[OpDef, ...] = (
    OpDef("linear_block_fp8", linear_block_fp8_reference, _fake, (
        providers.triton_kernel("linear_block_fp8", check_formats, FP8_CAPABILITY, module=TRITON_MODULE),
        Kernel("torch", _cublaslt, _cublaslt_check, (9, 0), "cublaslt"),
    )),
)  # fmt: skip
OPS: tuple[str, ...] = providers.define_all(DEFS)
