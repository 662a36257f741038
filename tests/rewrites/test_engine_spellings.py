"""A serving engine's native torch code, as vLLM 0.32 spells it with its custom ops off, written
here as plain torch (no vLLM needed): the default rules fuse each piece, and negative twins stay.

The spellings (vLLM's ``RMSNorm.forward_native`` through its IR ops, ``RotaryEmbedding
.forward_native``, ``SiluAndMul.forward_native``) differ from transformers' where it matters:

* RMSNorm reads ``self.weight.data`` and multiplies after casting to the weight's dtype;
* the residual add happens in float32 (``x.float() + residual.float()``) and the new residual is
  that sum cast back, computed *before* the norm reads the sum;
* RoPE indexes a ``[max_positions, rotary_dim]`` cos|sin cache with flattened positions
  (``index_select``), views q/k ``[tokens, heads, head_dim]``, rotates ``q[..., :rotary_dim]`` and
  concatenates the pass-through ``q[..., rotary_dim:]`` (empty when the whole head rotates).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, F32, check, reasons

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
    (attention is left out: an engine's opaque op, not what the rules touch)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_norm, self.post_norm = EngineRMSNorm(HIDDEN), EngineRMSNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD, bias=False)
        self.rotary = EngineRotary(dtype=dtype)
        self.o = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.gate_up = torch.nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h, residual = self.input_norm(h, residual)
        q, k, v = self.qkv(h).split([HIDDEN, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
        q, k = self.rotary(positions, q, k)
        attn = q + k.repeat(1, HEADS // KV_HEADS) + v.repeat(1, HEADS // KV_HEADS)  # stands in for attention
        h, residual = self.post_norm(self.o(attn), residual)
        return self.down(silu_and_mul(self.gate_up(h))), residual


def _tokens(n: int = 6, dtype: torch.dtype = F32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.arange(n) + 3, torch.randn(n, HIDDEN, dtype=dtype), torch.randn(n, HIDDEN, dtype=dtype)


def test_engine_rms_norm() -> None:
    for dtype in (F32, BF16):
        r = check(EngineRMSNorm(HIDDEN).to(dtype), torch.randn(6, HIDDEN, dtype=dtype), expect={"rms_norm": 1})
        assert r.report.rules() == {"rms_norm": 1} and not r.report.near_misses


def test_engine_add_rms_norm_sums_in_float32() -> None:
    """bf16: the float32-sum rule (the graph casts the sum back beside the norm); float32: every
    cast is a no-op and the plain add + norm rule takes it."""
    for dtype, rule in ((BF16, "add_rms_norm_f32_sum"), (F32, "add_rms_norm")):
        x, res = torch.randn(6, HIDDEN, dtype=dtype), torch.randn(6, HIDDEN, dtype=dtype)
        r = check(EngineRMSNorm(HIDDEN).to(dtype), x, res, expect={"fused_add_rms_norm": 1})
        assert r.report.rules() == {rule: 1} and not r.report.near_misses


def test_engine_add_rms_norm_twin_residual_kept_in_float32() -> None:
    """Negative twin: the new residual stays float32 (never cast back): the fused op returns it in
    the input's dtype, so nothing fuses, and the report says which output it could not find."""

    class KeepsFloat32Residual(EngineRMSNorm):
        def forward(self, x, residual):  # type: ignore[override]
            s = x.to(torch.float32) + residual.to(torch.float32)
            normed = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * self.weight
            return normed, s

    x, res = torch.randn(6, HIDDEN, dtype=BF16), torch.randn(6, HIDDEN, dtype=BF16)
    r = check(KeepsFloat32Residual(HIDDEN).to(BF16), x, res, expect={})
    [why] = reasons(r, "add_rms_norm_f32_sum")
    assert why.startswith("no reader of") and "computes the pattern's output" in why, why


def test_engine_rotary_whole_head_folds_into_one_kernel() -> None:
    """The empty pass-through slice and its ``cat`` go; the rotation of q and k becomes one
    ``rotary_embedding`` on the cache the engine indexes (its rows bound the positions)."""
    for dtype in (F32, BF16):
        pos, h, _ = _tokens(dtype=dtype)
        r = check(RopeOnQKV(dtype=dtype).to(dtype), pos, h, expect={"rotary_embedding": 1})
        assert not r.report.near_misses
        assert r.counts()["torch.cat"] == 0 and r.counts()["aten.index_select"] == 0


def test_engine_rotary_partial_rotates_the_first_dims() -> None:
    pos, h, _ = _tokens()
    r = check(RopeOnQKV(rotary_dim=HEAD // 2), pos, h, expect={"rotary_embedding": 1})
    assert not r.report.near_misses


def test_engine_rotary_positions_reordered_before_the_cache() -> None:
    """The cache read at positions reordered first: the tables are per position of the reordered
    tensor, which the kernel then reads."""
    pos, h, _ = _tokens()
    r = check(RopeOnQKV(index="reversed-positions"), pos, h, expect={"rotary_embedding": 1})
    assert not r.report.near_misses


def test_engine_rotary_twin_rows_not_per_position() -> None:
    """Negative twin: the rows read are reordered after the gather, so token i gets another
    token's angles: the rotation is matched, its tables do not fold, and the report says why."""
    pos, h, _ = _tokens()
    r = check(RopeOnQKV(index="reversed-rows"), pos, h, expect={"apply_rotary": 2})
    assert reasons(r, "rotary_embedding") == ["cos/sin are not per-position tables (shuffled positions do not shuffle them)"] * 2


def test_engine_silu_and_mul_and_its_twin() -> None:
    x = torch.randn(6, 2 * HIDDEN)
    check(silu_and_mul, x, expect={"silu_and_mul": 1})
    overlap = lambda x: F.silu(x[..., : HIDDEN + 8]) * x[..., HIDDEN - 8 :]  # noqa: E731 - gate and up overlap
    r = check(overlap, x, expect={})
    assert r.counts()["aten.silu"] == 1


def test_engine_layer_fuses_everything() -> None:
    """A whole layer of engine code: both norms with the residual add (the second in place: its
    inputs are the layer's own), RoPE and SiLU-and-mul fuse and nothing nearly matches, in float32
    and bf16."""
    for dtype in (F32, BF16):
        pos, h, res = _tokens(dtype=dtype)
        r = check(EngineLayer(dtype).to(dtype), pos, h, res,
                  expect={"fused_add_rms_norm": 1, "fused_add_rms_norm_": 1, "rotary_embedding": 1,
                          "silu_and_mul": 1})  # fmt: skip
        assert not r.report.near_misses, r.report.near_misses
