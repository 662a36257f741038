"""Sample arguments for the rotary ops, by parameter name, shared by the generic op tests
(``test_ops.py``, ``test_providers.py``) and the GPU tests: a tensor ``shape`` ``[N, ..., D]``
gives ``N`` tokens of head size ``D``."""

from __future__ import annotations

import torch

POSITIONS = 40  # rows of the sample cos/sin cache
NAMES = ("cos", "sin", "interleaved", "full_tables", "positions", "q", "k", "cos_sin_cache", "is_neox")


def rope_cache(positions: int, rotary_dim: int, theta: float = 10000.0, device: str | torch.device = "cpu") -> torch.Tensor:
    """``[positions, rotary_dim]`` float32 ``cat(cos(p f), sin(p f))``, f = theta^(-2i/rotary_dim)."""
    freqs = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    angles = torch.arange(positions, dtype=torch.float64, device=device)[:, None] * freqs
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def rotary_arg(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> object:
    n, d = shape[0], shape[-1]
    if name in ("cos", "sin"):  # full-width tables broadcast over the middle dims of x
        angles = torch.randn((n, *[1] * (len(shape) - 2), d // 2), generator=gen) * 3
        half = angles.cos() if name == "cos" else angles.sin()
        return torch.cat((half, half), dim=-1).to(dtype)
    if name == "positions":
        return torch.randint(0, POSITIONS, (n,), generator=gen)
    if name in ("q", "k"):
        return torch.randn((n, 3 if name == "q" else 1, d), generator=gen).to(dtype)
    if name == "cos_sin_cache":
        return rope_cache(POSITIONS, d)
    if name == "interleaved":
        return False
    if name in ("full_tables", "is_neox"):
        return True
    raise KeyError(name)


def fused_qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator,
              nope: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """q ``[tokens, heads, head_dim]`` and k ``[tokens, kv_heads, head_dim]`` as the rules hand them
    over: views of one fused qkv output (token stride ``(heads + 2 kv_heads) * width``), each head
    the trailing ``head_dim`` features of ``width = nope + head_dim`` (DeepSeek's rope slice of a
    larger head: head stride ``width``). On ``gen``'s device."""
    width = nope + head_dim
    qkv = torch.randn(tokens, heads + 2 * kv_heads, width, generator=gen, device=gen.device).to(dtype)
    return qkv[:, :heads, nope:], qkv[:, heads : heads + kv_heads, nope:]
