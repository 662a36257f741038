"""A serving engine's native torch code, as vLLM 0.32 computes it with its custom ops off, in plain
torch (no vLLM needed): the model code of tests/rewrites/test_engine_spellings.py and of the
engine-integration tests. Imported as ``helpers.engine``.

Where it differs from transformers: RMSNorm reads ``self.weight.data`` and multiplies after
casting to the weight's dtype; the residual add happens in float32 and the new residual (the sum
cast back) is computed before the norm reads the sum; RoPE indexes a ``[positions, rotary_dim]``
cos|sin cache with flattened positions (``index_select``), views q/k as ``[tokens, heads,
head_dim]``, rotates ``q[..., :rotary_dim]`` and concatenates the pass-through ``q[..., rotary_dim:]``
(empty when the whole head rotates); q and k are slices of one merged qkv projection.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

F32 = torch.float32

EPS = 1e-6
HEADS, KV_HEADS, HEAD = 4, 2, 32
HIDDEN = HEADS * HEAD


class EngineRMSNorm(torch.nn.Module):
    """RMSNorm as vLLM's native path computes it, with the optional fused residual add."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        weight, dtype = self.weight.data, x.dtype
        x = x.to(torch.float32)
        if residual is not None:
            x = x + residual.to(torch.float32)
            residual = x.to(dtype)  # the new residual, before the norm reads the sum
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS)
        x = (x.to(weight.dtype) * weight).to(dtype)
        return x if residual is None else (x, residual)


def rope_cache(rotary_dim: int, positions: int = 64, base: float = 10000.0) -> torch.Tensor:
    """``[positions, rotary_dim]``: cos then sin of the half-width angles, per position."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class EngineRotary(torch.nn.Module):
    """RoPE on flat ``[tokens, heads * head_dim]`` q and k from a cos|sin cache buffer."""

    def __init__(self, rotary_dim: int = HEAD, dtype: torch.dtype = F32, index: str = "positions") -> None:
        super().__init__()
        self.rotary_dim, self.index = rotary_dim, index
        self.register_buffer("cos_sin_cache", rope_cache(rotary_dim).to(dtype), persistent=False)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(positions.shape[0], -1, HEAD)
        rotated = rotate_neox(x[..., : self.rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1).reshape(shape)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = positions.flatten()
        rows = positions.flip(0) if self.index == "reversed-positions" else positions
        cos_sin = self.cos_sin_cache.index_select(0, rows)
        if self.index == "reversed-rows":  # the twin: token i reads another token's row
            cos_sin = cos_sin.flip(0)
        cos, sin = cos_sin.chunk(2, dim=-1)
        return self.rotate(positions, q, cos, sin), self.rotate(positions, k, cos, sin)


class RopeOnQKV(torch.nn.Module):
    """q and k as an engine gets them: slices of a merged qkv projection (token count dynamic,
    widths static), then :class:`EngineRotary`."""

    def __init__(self, **rotary: object) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD, bias=False)
        self.rotary = EngineRotary(**rotary)  # type: ignore[arg-type]

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = self.qkv(h).split([HIDDEN, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
        return self.rotary(positions, q, k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class EngineLayer(torch.nn.Module):
    """One decoder layer's elementwise work as an engine writes it around its merged linears
    (attention is an engine's opaque op: ``attention(q, k, v)``, by default a stand-in sum). Without
    a residual (the first layer) the input norm is a plain norm."""

    def __init__(self, dtype: torch.dtype, attention: Callable[..., torch.Tensor] | None = None) -> None:
        super().__init__()
        self.attention = attention or stand_in_attention
        self.input_norm, self.post_norm = EngineRMSNorm(HIDDEN), EngineRMSNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD, bias=False)
        self.rotary = EngineRotary(dtype=dtype)
        self.o = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.gate_up = torch.nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, positions: torch.Tensor, h: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
        if residual is None:
            h, residual = self.input_norm(h), h
        else:
            h, residual = self.input_norm(h, residual)
        q, k, v = self.qkv(h).split([HIDDEN, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
        q, k = self.rotary(positions, q, k)
        h, residual = self.post_norm(self.o(self.attention(q, k, v)), residual)
        return self.down(silu_and_mul(self.gate_up(h))), residual


def stand_in_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Mixes q, k and v (grouped heads repeated) where an engine calls its attention."""
    return q + k.repeat(1, HEADS // KV_HEADS) + v.repeat(1, HEADS // KV_HEADS)


class EngineDecoder(torch.nn.Module):
    """``layers`` :class:`EngineLayer` s and a final norm that adds the last residual: the fused
    ops per layer are layer 0's plain norm, then two add + norms per layer, RoPE and SiLU-and-mul."""

    def __init__(self, layers: int = 2, dtype: torch.dtype = F32,
                 attention: Callable[..., torch.Tensor] | None = None) -> None:  # fmt: skip
        super().__init__()
        self.layers = torch.nn.ModuleList(EngineLayer(dtype, attention) for _ in range(layers))
        self.norm = EngineRMSNorm(HIDDEN)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return self.norm(h, residual)[0]


def tokens(n: int = 6, dtype: torch.dtype = F32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, hidden states and a residual for ``n`` tokens."""
    return torch.arange(n) + 3, torch.randn(n, HIDDEN, dtype=dtype), torch.randn(n, HIDDEN, dtype=dtype)
