"""GPU tests of the rotary ops: flashinfer's kernel against the reference.

    source .devkit/setup.sh && python3 -m pytest -q tests/runtime/test_rotary_gpu.py -m gpu
"""

from __future__ import annotations

import pytest
import torch
from rotary_samples import rope_cache

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops.rotary import rotary_embedding_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(autouse=True)
def flashinfer() -> None:
    if not providers.available("flashinfer"):
        pytest.skip("flashinfer is not importable here")
    providers.configure("flashinfer")
    providers.reset_counts()
    yield
    providers.configure(None)


def served(op: str) -> dict:
    return providers.served()[op]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (128, 128), (256, 256), (128, 64)])
@pytest.mark.parametrize("tokens", [1, 7, 512])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_flashinfer_matches_reference(dtype: torch.dtype, head_dim: int, rotary_dim: int, tokens: int, is_neox: bool) -> None:
    """q and k sliced out of one fused qkv output (strided rows), as the rules hand them over."""
    g = torch.Generator(device="cuda").manual_seed(tokens * head_dim)
    qkv = torch.randn(tokens, (32 + 2 * 8) * head_dim, device="cuda", generator=g).to(dtype)
    q = qkv[:, : 32 * head_dim].view(tokens, 32, head_dim)
    k = qkv[:, 32 * head_dim : 40 * head_dim].view(tokens, 8, head_dim)
    cache = rope_cache(4096, rotary_dim, device="cuda")
    pos = torch.randint(0, 4096, (tokens,), device="cuda", generator=g)
    got = torch.ops.fxr.rotary_embedding(pos, q, k, cache, is_neox)
    want = rotary_embedding_reference(pos, q, k, cache, is_neox)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=TOL[dtype], atol=TOL[dtype])
    assert served("rotary_embedding") == {"flashinfer": 1, "fallbacks": {}}
    assert torch.equal(got[0][..., rotary_dim:], q[..., rotary_dim:]), "pass-through features copied"
    q_only = torch.ops.fxr.rotary_embedding_q(pos, q, cache, is_neox)
    torch.testing.assert_close(q_only.float(), want[0].float(), rtol=TOL[dtype], atol=TOL[dtype])
    assert served("rotary_embedding_q") == {"flashinfer": 1, "fallbacks": {}}


def test_unsupported_head_size_falls_back_with_reason() -> None:
    q = torch.randn(4, 2, 80, device="cuda", dtype=torch.bfloat16)
    cache, pos = rope_cache(16, 80, device="cuda"), torch.arange(4, device="cuda")
    torch.ops.fxr.rotary_embedding_q(pos, q, cache, True)
    assert served("rotary_embedding_q") == {"torch": 1, "fallbacks": {"flashinfer: head size 80 not in (64, 128, 256, 512)": 1}}


def test_captured_in_a_cuda_graph() -> None:
    q = torch.randn(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, 8, 128, device="cuda", dtype=torch.bfloat16)
    cache, pos = rope_cache(1024, 128, device="cuda"), torch.arange(8, device="cuda") * 3
    torch.ops.fxr.rotary_embedding(pos, q, k, cache, True)  # warm-up: JIT load outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.fxr.rotary_embedding(pos, q, k, cache, True)
    pos.copy_(torch.arange(8, device="cuda") * 5)
    graph.replay()
    for a, b in zip(out, rotary_embedding_reference(pos, q, k, cache, True)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
