"""``fxr::linear``: ``F.linear`` served by the fastest GEMM for its number of rows.

At decode sizes a linear reads its whole weight to produce a few rows: the step's time is the
weight's bytes over the memory bandwidth, and what counts is how close a kernel comes to it.
cuBLAS picks split-K kernels there, two launches for some shapes, and reads the 8B-shaped
Llama's weights at 1.14x the copy floor at 8 rows on the H100 (bench/RESULTS.md, eighth run). Up to ``SKINNY_ROWS`` rows the
``triton`` provider streams the weight once in one launch; above, cuBLAS serves (the label
``cublas``: torch's own GEMM, not a fallback).

    # before (nn.Linear, F.linear, merged projections)     # after
    y = aten.linear(x, w, b)                                y = torch.ops.fxr.linear(x, w, b)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fxrewrite.runtime import providers
from fxrewrite.runtime.providers import Kernel, OpDef

SKINNY_ROWS = 16
"""Most rows the Triton kernel takes (one tile of ``tl.dot``); more go to cuBLAS."""


def linear_reference(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, bias)``: x [..., k], w [n, k], bias [n] -> [..., n]."""
    return F.linear(x, w, bias)


def _linear_fake(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def skinny_check(x: Tensor, w: Tensor, bias: Tensor | None = None) -> str | None:
    """The Triton kernel: bf16/fp16 throughout, a 2-D weight with unit stride along k, at most
    ``SKINNY_ROWS`` rows, a contiguous bias."""
    reason = providers.check_half(x, w, *([bias] if bias is not None else []))
    if reason:
        return reason
    if w.dim() != 2 or x.dim() == 0 or x.shape[-1] != w.shape[-1]:
        return f"shapes {tuple(x.shape)} x {tuple(w.shape)}"
    if w.numel() == 0:
        return "empty weight"
    rows = x.numel() // max(x.shape[-1], 1)
    if not 0 < rows <= SKINNY_ROWS:
        return f"{rows} rows: cuBLAS serves outside 1..{SKINNY_ROWS}"
    if w.stride(-1) != 1:
        return "weight has no unit stride along k"
    if bias is not None and (bias.dim() != 1 or not bias.is_contiguous()):
        return "bias not a contiguous vector"
    return providers.check_same_device(x, w, *([bias] if bias is not None else []))


def _cublas(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    return F.linear(x, w, bias)


def _always(*args: object) -> None:
    return None


KERNELS = (
    providers.triton_kernel("linear", skinny_check),
    Kernel("torch", _cublas, _always, label="cublas"),
)

DEFS: tuple[OpDef, ...] = (OpDef("linear", linear_reference, _linear_fake, KERNELS),)
for _op in DEFS:
    providers.define_op(_op)

OPS: tuple[str, ...] = tuple(op.name for op in DEFS)
