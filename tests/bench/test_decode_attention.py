"""The Triton kernels of the engine model's attention op (bench/decode_attention.py) against its
torch path: split-KV decode against SDPA in float64, the cache write against ``index_copy_``,
the write inside the decode launch against both, on fresh random caches (GPU; skipped without
Triton)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.gpu

import engine_model  # noqa: E402  (after the skip: decode_attention imports triton)
from decode_attention import decode_attention, split_plan, store_kv  # noqa: E402


def sdpa_decode(q, k_cache, v_cache, seq_lens, length):  # type: ignore[no-untyped-def]
    kv_range = torch.arange(length, dtype=torch.int32, device=q.device)
    return engine_model._decode(q.double(), k_cache.double(), v_cache.double(), seq_lens, kv_range)


def key_counts(kind: str, batch: int, length: int) -> torch.Tensor:
    """seq_lens [batch] int32: ``length`` each ("full", "middle"), padding rows of length 0 among
    real ones ("zeros"), or random in [1, length]."""
    if kind in ("full", "middle"):
        return torch.full((batch,), length, dtype=torch.int32, device="cuda")
    if kind == "zeros":
        return torch.tensor([0, 1, length, 0, 5][:batch], dtype=torch.int32, device="cuda")
    return torch.randint(1, length + 1, (batch,), dtype=torch.int32, device="cuda")


def caches(rows: int, max_len: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (rows, max_len, kv_heads, dim)
    return (torch.randn(shape, generator=g, device="cuda").to(dtype), torch.randn(shape, generator=g, device="cuda").to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,heads,kv_heads,dim,length,lens",
    [
        (8, 32, 8, 128, 1025, "full"),       # the 8B shape's decode 8
        (1, 32, 8, 128, 4000, "random"),     # many splits
        (64, 32, 8, 128, 300, "random"),     # one split per program
        (3, 8, 8, 64, 129, "random"),        # no GQA
        (5, 16, 2, 128, 77, "zeros"),        # padding rows: length 0 reads one key
        (6, 12, 4, 128, 64, "random"),       # more sequences than cache rows: rows modulo
    ],
)
def test_matches_sdpa(batch, heads, kv_heads, dim, length, lens, dtype) -> None:  # type: ignore[no-untyped-def]
    rows = 4 if batch == 6 else max(batch, 1)
    k_cache, v_cache = caches(rows, length + 16, kv_heads, dim, dtype, seed=batch + length)
    q = torch.randn(batch, heads, dim, device="cuda").to(dtype)
    seq_lens = key_counts(lens, batch, length)
    got = decode_attention(q, k_cache, v_cache, seq_lens, length)
    want = sdpa_decode(q, k_cache, v_cache, seq_lens, length)
    assert got.shape == q.shape and got.dtype == dtype and got.is_contiguous()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_strided_query_from_a_merged_projection() -> None:
    k_cache, v_cache = caches(8, 600, 8, 128, torch.bfloat16, seed=1)
    qkv = torch.randn(8, 48, 128, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :32]  # a view: batch stride 48 heads
    seq_lens = torch.randint(1, 513, (8,), dtype=torch.int32, device="cuda")
    torch.testing.assert_close(decode_attention(q, k_cache, v_cache, seq_lens, 512).double(),
                               sdpa_decode(q, k_cache, v_cache, seq_lens, 512), atol=2e-2, rtol=2e-2)


def test_split_plan_fills_the_device_in_whole_blocks() -> None:
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for batch, length in [(1, 1025), (8, 1025), (64, 1025), (8, 16)]:
        splits, chunk = split_plan(batch, 8, length, device)
        assert chunk % 64 == 0 and splits * chunk >= length > (splits - 1) * chunk
        assert splits == 1 or batch * 8 * (splits - 1) < 2 * sms


def test_replays_in_a_cuda_graph_with_new_lengths() -> None:
    k_cache, v_cache = caches(8, 1100, 8, 128, torch.bfloat16, seed=2)
    q = torch.randn(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((8,), 1024, dtype=torch.int32, device="cuda")
    decode_attention(q, k_cache, v_cache, seq_lens, 1025)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k_cache, v_cache, seq_lens, 1025)
    seq_lens.copy_(torch.randint(1, 1026, (8,), dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.testing.assert_close(out.double(), sdpa_decode(q, k_cache, v_cache, seq_lens, 1025),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_store_kv_writes_what_index_copy_writes(tokens: int) -> None:
    k_cache, v_cache = caches(4, 128, 8, 128, torch.bfloat16, seed=tokens)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(tokens, 48, 128, device="cuda", dtype=torch.bfloat16)
    k, v = qkv[:, 32:40], qkv[:, 40:]  # views of a merged projection
    slots = torch.randperm(4 * 128, device="cuda")[:tokens]
    store_kv(k, v, k_cache, v_cache, slots)
    want_k.view(-1, 8, 128).index_copy_(0, slots, k)
    want_v.view(-1, 8, 128).index_copy_(0, slots, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,kv_heads,length,lens", [(8, 8, 1025, "full"), (3, 2, 4000, "random"), (5, 2, 77, "zeros"),
                                                         (4, 8, 3000, "middle")])
def test_store_in_the_decode_launch(batch, kv_heads, length, lens, dtype) -> None:  # type: ignore[no-untyped-def]
    """``store=(k, v, slots)`` writes what ``index_copy_`` writes and returns what decoding after
    a separate write returns, also where the new key sits in any program's slice of the row
    (random lengths, many splits), in the middle of a row, and for padding rows (length 0)."""
    max_len, heads = length + 16, 4 * kv_heads
    k_cache, v_cache = caches(batch, max_len, kv_heads, 128, dtype, seed=batch + length)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q = torch.randn(batch, heads, 128, device="cuda").to(dtype)
    qkv = torch.randn(batch, heads + 2 * kv_heads, 128, device="cuda").to(dtype)
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]  # views of a merged projection
    seq_lens = key_counts(lens, batch, length)
    position = (seq_lens.long() - 1).clamp(min=0)  # decode: the new token is the row's last key
    if lens == "middle":  # a write anywhere in the row (a slot the engine reuses)
        position = torch.randint(0, length, (batch,), device="cuda")
    slots = torch.arange(batch, device="cuda") * max_len + position
    got = decode_attention(q, k_cache, v_cache, seq_lens, length, store=(k, v, slots))
    want_k.view(-1, kv_heads, 128).index_copy_(0, slots, k)
    want_v.view(-1, kv_heads, 128).index_copy_(0, slots, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, decode_attention(q, want_k, want_v, seq_lens, length), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), sdpa_decode(q, want_k, want_v, seq_lens, length), atol=tol, rtol=tol)


def test_store_needs_contiguous_caches() -> None:
    k_cache, v_cache = caches(2, 64, 2, 128, torch.bfloat16, seed=0)
    q, kv = torch.randn(2, 8, 128, device="cuda").to(torch.bfloat16), torch.randn(2, 2, 128, device="cuda").to(torch.bfloat16)
    lens, slots = torch.full((2,), 10, dtype=torch.int32, device="cuda"), torch.tensor([9, 73], device="cuda")
    with pytest.raises(ValueError, match="contiguous caches"):
        decode_attention(q, k_cache[:, :32], v_cache[:, :32], lens, 10, store=(kv, kv, slots))
