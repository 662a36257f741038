"""GPU tests of the rotary ops: flashinfer's kernel and ours (runtime/triton_rotary.py) against the
reference, and the default order (flashinfer where it dispatches, Triton for the rest).

    source .devkit/setup.sh && python3 -m pytest -q tests/runtime/test_rotary_gpu.py -m gpu
"""

from __future__ import annotations

import pytest
import torch
from helpers.gpu import force, fresh_counts  # noqa: F401  (fresh_counts: autouse fixture of this module)
from rotary_samples import fused_qkv, rope_cache

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops.rotary import rotary_embedding_q_reference, rotary_embedding_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
FI_REFUSES = "flashinfer: head size 80 not in (64, 128, 256, 512)"


@pytest.fixture
def flashinfer() -> None:
    force("flashinfer")


@pytest.fixture
def triton() -> None:
    force("triton")


def served(op: str) -> dict:
    return providers.served()[op]


def cuda_gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.usefixtures("flashinfer")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (128, 128), (256, 256), (128, 64)])
@pytest.mark.parametrize("tokens", [1, 7, 512])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_flashinfer_matches_reference(dtype: torch.dtype, head_dim: int, rotary_dim: int, tokens: int, is_neox: bool) -> None:
    """q and k sliced out of one fused qkv output (strided rows), as the rules hand them over."""
    q, k = fused_qkv(tokens, 32, 8, head_dim, dtype, cuda_gen(tokens * head_dim))
    cache = rope_cache(4096, rotary_dim, device="cuda")
    pos = torch.randint(0, 4096, (tokens,), device="cuda", generator=cuda_gen(tokens))
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


@pytest.mark.usefixtures("flashinfer")
def test_unsupported_head_size_falls_back_with_reason() -> None:
    q = torch.randn(4, 2, 80, device="cuda", dtype=torch.bfloat16)
    cache, pos = rope_cache(16, 80, device="cuda"), torch.arange(4, device="cuda")
    torch.ops.fxr.rotary_embedding_q(pos, q, cache, True)
    assert served("rotary_embedding_q") == {"torch": 1, "fallbacks": {FI_REFUSES: 1}}


def capture_and_replay(head_dim: int, dtype: torch.dtype) -> None:
    """Warm-up (the kernel's first call builds or loads it outside capture), capture, new
    positions, replay: the outputs are those of the new positions."""
    q, k = fused_qkv(8, 32, 8, head_dim, dtype, cuda_gen(head_dim))
    cache, pos = rope_cache(1024, head_dim, device="cuda"), torch.arange(8, device="cuda") * 3
    torch.ops.fxr.rotary_embedding(pos, q, k, cache, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.fxr.rotary_embedding(pos, q, k, cache, True)
    pos.copy_(torch.arange(8, device="cuda") * 5)
    graph.replay()
    for a, b in zip(out, rotary_embedding_reference(pos, q, k, cache, True)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.usefixtures("flashinfer")
def test_captured_in_a_cuda_graph() -> None:
    capture_and_replay(128, torch.bfloat16)


# --------------------------------------------------------------------------- our Triton kernel

# flashinfer's sizes and those it does not dispatch: DeepSeek-V4's rope slice (2 or 8 wide at the
# tiny test shapes), 32, Phi-2's 80, 96; whole and partial rotary
TRITON_HEADS = [(2, 2), (8, 8), (32, 32), (64, 32), (80, 80), (80, 32), (96, 96), (128, 64), (256, 256)]


@pytest.mark.usefixtures("triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("head_dim, rotary_dim", TRITON_HEADS, ids=[f"d{d}-r{r}" for d, r in TRITON_HEADS])
@pytest.mark.parametrize("tokens", [1, 7, 512])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_triton_is_the_reference_bit_for_bit(dtype: torch.dtype, head_dim: int, rotary_dim: int, tokens: int,
                                             is_neox: bool) -> None:  # fmt: skip
    """Compiled without FP fusion, the kernel computes the reference's float32 products and sums
    and rounds once, as the reference does on the GPU: equal values, dtype and strides."""
    q, k = fused_qkv(tokens, 32, 8, head_dim, dtype, cuda_gen(tokens * head_dim + rotary_dim))
    cache = rope_cache(4096, rotary_dim, device="cuda")
    pos = torch.randint(0, 4096, (tokens,), device="cuda", generator=cuda_gen(tokens)).int()
    got = torch.ops.fxr.rotary_embedding(pos, q, k, cache, is_neox)
    want = rotary_embedding_reference(pos, q, k, cache, is_neox)
    q_only = torch.ops.fxr.rotary_embedding_q(pos, q, cache, is_neox)
    for a, b in zip((*got, q_only), (*want, want[0])):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
        assert torch.equal(a, b), f"{int((a != b).sum())} of {a.numel()} values differ"
    assert served("rotary_embedding") == {"triton": 1, "fallbacks": {}}
    assert served("rotary_embedding_q") == {"triton": 1, "fallbacks": {}}


@pytest.mark.usefixtures("triton")
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_triton_rotates_a_rope_slice_of_each_head(is_neox: bool) -> None:
    """DeepSeek-V4's layout: the trailing 8 features of 40-wide heads, q alone."""
    q, _ = fused_qkv(33, 4, 1, 8, torch.bfloat16, cuda_gen(8), nope=32)
    cache, pos = rope_cache(64, 8, device="cuda"), torch.arange(33, device="cuda")
    got = torch.ops.fxr.rotary_embedding_q(pos, q, cache, is_neox)
    assert torch.equal(got, rotary_embedding_q_reference(pos, q, cache, is_neox))
    assert served("rotary_embedding_q") == {"triton": 1, "fallbacks": {}}


@pytest.mark.usefixtures("triton")
def test_triton_captured_in_a_cuda_graph() -> None:
    capture_and_replay(80, torch.bfloat16)
    assert served("rotary_embedding") == {"triton": 2, "fallbacks": {}}  # the warm-up and the capture


def test_default_order_flashinfer_then_triton() -> None:
    """No override: flashinfer takes its head sizes (where it imports), Triton head size 80 and
    float32, nothing falls back."""
    gen = cuda_gen(0)
    pos = torch.arange(5, device="cuda")
    for head_dim, dtype in ((128, torch.bfloat16), (80, torch.bfloat16), (128, torch.float32)):
        q, k = fused_qkv(5, 4, 2, head_dim, dtype, gen)
        torch.ops.fxr.rotary_embedding(pos, q, k, rope_cache(16, head_dim, device="cuda"), True)
    fi = providers.library("flashinfer.rope") is not None
    assert served("rotary_embedding") == {**({"flashinfer": 1, "triton": 2} if fi else {"triton": 3}), "fallbacks": {}}
