"""The rotary ops' references (runtime/ops/rotary.py) against the unfused code they replace: HF's
``apply_rotary_pos_emb`` (NeoX), GPT-J's pairs, partial rotary; and the two table forms."""

from __future__ import annotations

import pytest
import torch
from rotary_samples import rope_cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from fxrewrite.runtime.ops import rotary

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


def tables(cache: torch.Tensor, positions: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width HF tables ``[N, R]`` from a cache: each angle twice (halves, or pairs)."""
    cos, sin = cache[positions].chunk(2, dim=-1)
    if interleaved:
        return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@DTYPES
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [(1, 4, 2, 64), (7, 3, 1, 128), (33, 2, 2, 32)])
def test_rotary_embedding_is_hf_apply_rotary_pos_emb(dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    cache = rope_cache(100, head_dim)
    pos = torch.randint(0, 100, (tokens,), generator=g)
    cos, sin = tables(cache, pos)
    # HF: q [B, H, T, D], tables [B, T, D] in the activations' dtype
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None].to(dtype), sin[None].to(dtype))
    got_q, got_k = torch.ops.fxr.rotary_embedding(pos, q, k, cache, True)
    close(got_q, want_q[0].transpose(0, 1))
    close(got_k, want_k[0].transpose(0, 1))
    close(torch.ops.fxr.rotary_embedding_q(pos, q, cache, True), got_q)


def test_bf16_rotation_rounds_once() -> None:
    """Where HF's bf16 code rounds ``q * cos``, ``rotate(q) * sin`` and their sum, the reference
    rounds once: on the model's own (bf16) tables it is the exact rotation rounded to bf16, so no
    further from the float64 rotation by exact angles than the code it replaces (SmolLM2's bf16
    logits, ``tests/fxrewrite/test_smollm2.py``, rest on it)."""
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(1, 300, 4, 64, generator=g) * 3).to(torch.bfloat16)  # [B, T, H, D]
    pos, exact = torch.arange(300), rope_cache(300, 64, theta=100000.0)
    cache = exact.to(torch.bfloat16).float()  # the tables as the bf16 model computes them
    turned = torch.cat((-q[..., 32:], q[..., :32]), -1).double()

    def rotated(c: torch.Tensor) -> torch.Tensor:  # in float64, by the tables of cache c
        cos, sin = (t.double()[:, None] for t in tables(c, pos))
        return q.double() * cos + turned * sin

    cos, sin = (t.to(torch.bfloat16) for t in tables(cache, pos))
    hf, _ = apply_rotary_pos_emb(q, q, cos[None], sin[None], unsqueeze_dim=2)
    got = torch.ops.fxr.rotary_embedding_q(pos, q[0], cache, True)[None]
    assert torch.equal(got, rotated(cache).to(torch.bfloat16))
    assert not torch.equal(got, hf)  # the three roundings of the bf16 code differ somewhere
    assert (got.double() - rotated(exact)).abs().mean() < (hf.double() - rotated(exact)).abs().mean()


def test_interleaved_is_gptj() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g)
    cache, pos = rope_cache(20, 64), torch.tensor([0, 3, 19, 7, 7])
    cos, sin = tables(cache, pos, interleaved=True)
    turned = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    close(torch.ops.fxr.rotary_embedding_q(pos, x, cache, False), x * cos[:, None] + turned * sin[:, None])


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_partial_rotary_passes_the_rest_through(is_neox: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, 64, generator=g)
    cache, pos = rope_cache(30, 32), torch.randint(0, 30, (6,), generator=g)
    out = torch.ops.fxr.rotary_embedding_q(pos, x, cache, is_neox)
    assert torch.equal(out[..., 32:], x[..., 32:])
    close(out[..., :32], torch.ops.fxr.rotary_embedding_q(pos, x[..., :32].contiguous(), cache, is_neox))
    assert not torch.allclose(out[..., :32], x[..., :32])


@DTYPES
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_apply_rotary_full_and_half_tables_agree(dtype: torch.dtype, interleaved: bool) -> None:
    """The HF (full-width) and engine (half-width) spellings compute the same rotation, and
    ``rotary_embedding`` is ``apply_rotary`` on tables read from the cache."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 32, generator=g).to(dtype)
    cache, pos = rope_cache(10, 32), torch.tensor([1, 0, 9, 4])
    cos_h, sin_h = cache[pos].chunk(2, dim=-1)
    cos_f, sin_f = tables(cache, pos, interleaved)
    half = torch.ops.fxr.apply_rotary(x, cos_h[:, None].to(dtype), sin_h[:, None].to(dtype), interleaved, False)
    full = torch.ops.fxr.apply_rotary(x, cos_f[:, None].to(dtype), sin_f[:, None].to(dtype), interleaved, True)
    close(full, half)
    close(torch.ops.fxr.rotary_embedding_q(pos, x, cache, not interleaved), half)


def test_apply_rotary_promotes_like_the_code_it_replaces() -> None:
    """bf16 x times float32 tables is float32 in torch: the op returns what the pattern did."""
    x = torch.randn(2, 1, 8, dtype=torch.bfloat16)
    cos = torch.ones(2, 1, 8)
    out = torch.ops.fxr.apply_rotary(x, cos, torch.zeros(2, 1, 8), False, True)
    assert out.dtype == torch.float32 and torch.equal(out, x.float())


def test_flashinfer_check_names_what_it_cannot_serve() -> None:
    q, cache, pos = torch.randn(3, 2, 80, dtype=torch.bfloat16), rope_cache(8, 80), torch.arange(3)
    assert rotary.check_rotary(pos, cache, q) == "head size 80 not in (64, 128, 256, 512)"
    assert "float32" in rotary.check_rotary(pos, cache.double(), q.new_zeros(3, 2, 64))
    assert "contiguous last dim" in rotary.check_rotary(pos, rope_cache(8, 64), q.new_zeros(3, 64, 2).transpose(1, 2))
    assert rotary.check_rotary(pos, rope_cache(8, 64), q.new_zeros(3, 2, 128)) is None
