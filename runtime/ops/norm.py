"""RMSNorm family: ``fxr::rms_norm``, add + RMSNorm, Gemma variants, in-place twins."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm over the last dim; result dtype is ``promote(weight, x)``.

    ``h = x.float(); h = h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps);
    return weight * h.to(x.dtype)``
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@torch.library.custom_op("fxr::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any rank >= 1). See :func:`rms_norm_reference`."""
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
