"""Gated activations: ``fxr::silu_and_mul``, ``fxr::gelu_and_mul``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``d = x.shape[-1] // 2; silu(x[..., :d]) * x[..., d:]``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@torch.library.custom_op("fxr::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d]. See :func:`silu_and_mul_reference`."""
    return silu_and_mul_reference(x)


@silu_and_mul.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
