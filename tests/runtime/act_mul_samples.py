"""Operand pairs for ``fxr.act_mul`` at the layouts models hand it, on the generator's device
(shared by test_act_mul_ops.py on CPU and test_act_mul_gpu.py on CUDA)."""

from __future__ import annotations

from collections.abc import Callable

import torch

Pair = tuple[torch.Tensor, torch.Tensor]


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=gen.device).to(dtype)


def mamba(gen: torch.Generator, dtype: torch.dtype, tokens: int = 5) -> Pair:
    """A gate chunked off the channels of a transposed projection [B, 2D, L], a contiguous scan output."""
    gate = rand(gen, 2, tokens, 2 * 24, dtype=dtype).transpose(1, 2)[:, 24:]
    return gate, rand(gen, 2, 24, tokens, dtype=dtype)


def view_halves(gen: torch.Generator, dtype: torch.dtype) -> Pair:
    """``h.view(B, T, 2, -1)[..., 1, :]`` and ``[..., 0, :]``: rows at stride 2d."""
    h = rand(gen, 2, 3, 2 * 64, dtype=dtype).view(2, 3, 2, 64)
    return h[..., 1, :], h[..., 0, :]


def permuted(gen: torch.Generator, dtype: torch.dtype) -> Pair:
    """[T, B, H, D] from heads-major storage times a contiguous value: three leading dims."""
    return rand(gen, 2, 4, 5, 64, dtype=dtype).permute(2, 0, 1, 3), rand(gen, 5, 2, 4, 64, dtype=dtype)


def expanded(gen: torch.Generator, dtype: torch.dtype) -> Pair:
    """One operand expanded (stride 0) to the other's shape: equal shapes, read as they lie."""
    return rand(gen, 7, 64, dtype=dtype), rand(gen, 7, 1, dtype=dtype).expand(7, 64)


def same_tensor(gen: torch.Generator, dtype: torch.dtype) -> Pair:
    x = rand(gen, 4, 64, dtype=dtype)
    return x, x


LAYOUTS: dict[str, Callable[[torch.Generator, torch.dtype], Pair]] = {
    "rows": lambda gen, dtype: (rand(gen, 7, 64, dtype=dtype), rand(gen, 7, 64, dtype=dtype)),
    "one-token": lambda gen, dtype: (rand(gen, 1, 1, 33, dtype=dtype), rand(gen, 1, 1, 33, dtype=dtype)),
    "wide": lambda gen, dtype: (rand(gen, 3, 3000, dtype=dtype), rand(gen, 3, 3000, dtype=dtype)),
    "mamba": mamba,
    "view-halves": view_halves,
    "permuted": permuted,
    "expanded": expanded,
    "same-tensor": same_tensor,
}
