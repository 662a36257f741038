"""CPU tests of the fused ops: reference vs the unfused code it replaces, fake impls, opcheck."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)

SHAPES_2D = [(1, 33), (7, 64), (16, 4096)]


def _llama_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = x.to(torch.float32) * torch.rsqrt(variance + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("shape", SHAPES_2D)
def test_rms_norm_matches_llama(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(torch.ops.fxr.rms_norm(x, w, 1e-6), _llama_rms_norm(x, w, 1e-6), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(1, 66), (5, 128)])
def test_silu_and_mul_matches_unfused(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    d = shape[-1] // 2
    torch.testing.assert_close(torch.ops.fxr.silu_and_mul(x), F.silu(x[..., :d]) * x[..., d:], rtol=0, atol=0)
