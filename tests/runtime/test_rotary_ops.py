"""The rotary ops' references (runtime/ops/rotary.py) against the unfused code they replace: HF's
``apply_rotary_pos_emb`` (NeoX), GPT-J's pairs, partial rotary; and the two table forms. The Triton
provider (runtime/triton_rotary.py), interpreted, against the reference: bit for bit; what its
check refuses; the order in which the providers serve. On the GPU: tests/runtime/test_rotary_gpu.py."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch
from rotary_samples import fused_qkv, rope_cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from fxrewrite.runtime import providers
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


# --------------------------------------------------------------------------- the Triton provider

HALF_AND_FLOAT = [torch.float16, torch.bfloat16, torch.float32]
# (head size, rotary width): flashinfer's 128 and sizes it does not dispatch (DeepSeek-V4's rope
# slice: 2 wide at bench/coverage.py's shape, 8 at the GPU runs'; 32, Phi-2's 80), whole and partial
HEADS = [(2, 2), (8, 8), (32, 32), (80, 80), (128, 128), (80, 32), (128, 64)]


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """The spec's values bit for bit, its dtype, shape and (contiguous) strides."""
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} values differ"


@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("head_dim, rotary_dim", HEADS, ids=[f"d{d}-r{r}" for d, r in HEADS])
def test_triton_kernel_is_the_reference_bit_for_bit(triton_rotary: types.ModuleType, head_dim: int, rotary_dim: int,
                                                    is_neox: bool, dtype: torch.dtype) -> None:  # fmt: skip
    """q and k views of a fused qkv output (strided tokens): the same float32 products and sums
    as the spec, no FMA, one rounding; features past the rotary width copied."""
    g = torch.Generator().manual_seed(head_dim * 1000 + rotary_dim)
    q, k = fused_qkv(5, 4, 2, head_dim, dtype, g)
    cache, pos = rope_cache(40, rotary_dim), torch.randint(0, 40, (5,), generator=g)
    assert rotary._triton_check_pair(pos, q, k, cache, is_neox) is None
    got = triton_rotary.rotary_embedding(pos, q, k, cache, is_neox)
    want = rotary.rotary_embedding_reference(pos, q, k, cache, is_neox)
    for a, b, x in zip(got, want, (q, k)):
        same(a, b)
        assert not torch.equal(a[..., :rotary_dim], x[..., :rotary_dim])
    same(triton_rotary.rotary_embedding_q(pos, q, cache, is_neox), want[0])


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_triton_kernel_rotates_a_rope_slice_of_each_head(triton_rotary: types.ModuleType, is_neox: bool) -> None:
    """DeepSeek-V4 rotates the trailing 8 features of larger heads: q alone (int32 positions), head
    stride 40, token stride 40 * (heads + 2 kv heads); and 3 heads, not a power of two."""
    g = torch.Generator().manual_seed(8)
    q, k = fused_qkv(7, 3, 1, 8, torch.bfloat16, g, nope=32)
    assert q.stride() == (200, 40, 1)
    cache, pos = rope_cache(40, 8), torch.randint(0, 40, (7,), generator=g, dtype=torch.int32)
    assert rotary._triton_check_q(pos, q, cache, is_neox) is None
    want = rotary.rotary_embedding_q_reference(pos, q, cache, is_neox)
    same(triton_rotary.rotary_embedding_q(pos, q, cache, is_neox), want)
    for a, b in zip(triton_rotary.rotary_embedding(pos, q, k, cache, is_neox),
                    rotary.rotary_embedding_reference(pos, q, k, cache, is_neox)):  # fmt: skip
        same(a, b)


def test_triton_kernel_takes_each_tensor_in_its_own_dtype(triton_rotary: types.ModuleType) -> None:
    """fp16 q, float32 k, a bf16 cache: the reference reads the cache in float32 and returns each
    tensor in its dtype; so does the kernel (flashinfer takes none of this)."""
    g = torch.Generator().manual_seed(5)
    q, k = fused_qkv(6, 2, 2, 96, torch.float16, g)
    k = k.float()
    cache, pos = rope_cache(40, 96).to(torch.bfloat16), torch.randint(0, 40, (6,), generator=g)
    assert rotary._triton_check_pair(pos, q, k, cache, True) is None
    assert rotary._check_pair(pos, q, k, cache, True) == "dtype float32 != input dtype float16"
    for a, b in zip(triton_rotary.rotary_embedding(pos, q, k, cache, True),
                    rotary.rotary_embedding_reference(pos, q, k, cache, True)):  # fmt: skip
        same(a, b)


def test_triton_kernel_with_no_tokens_or_no_heads(triton_rotary: types.ModuleType) -> None:
    cache = rope_cache(8, 32)
    q, k = torch.randn(0, 4, 32, dtype=torch.float16), torch.randn(0, 1, 32, dtype=torch.float16)
    out = triton_rotary.rotary_embedding(torch.zeros(0, dtype=torch.long), q, k, cache, True)
    assert [t.shape for t in out] == [q.shape, k.shape]
    q, pos = torch.randn(3, 4, 32, dtype=torch.float16), torch.tensor([1, 2, 3])
    got_q, got_k = triton_rotary.rotary_embedding(pos, q, q[:, :0], cache, False)
    same(got_q, rotary.rotary_embedding_q_reference(pos, q, cache, False))
    assert got_k.shape == (3, 0, 32)


def _check_pair(q: torch.Tensor, k: torch.Tensor | None = None, cache: torch.Tensor | None = None,
                pos: torch.Tensor | None = None) -> str | None:  # fmt: skip
    """The Triton kernel's check on the pair op, defaults filled in: 3 tokens, rotary width 8."""
    k = q if k is None else k
    cache = rope_cache(8, 8) if cache is None else cache
    pos = torch.arange(q.shape[0]) if pos is None else pos
    return rotary._triton_check_pair(pos, q, k, cache, True)


Q = torch.zeros(3, 2, 8, dtype=torch.bfloat16)
TRITON_REFUSALS: list[tuple[str, Callable[[], str | None], str]] = [
    ("float64", lambda: _check_pair(Q.double()), "dtype float64 is not a float of 16 or 32 bits"),
    ("int8", lambda: _check_pair(Q, Q.to(torch.int8)), "dtype int8 is not a float of 16 or 32 bits"),
    ("last-dim-strided", lambda: _check_pair(torch.zeros(3, 8, 2, dtype=torch.bfloat16).transpose(1, 2)),
     "input (3, 2, 8) strides (16, 1, 2): needs [N, H, D] with a contiguous last dim"),
    ("2-d", lambda: _check_pair(Q.view(3, 16)), "input (3, 16) strides (16, 1): needs [N, H, D] with a contiguous last dim"),
    ("odd-width", lambda: _check_pair(Q, cache=torch.zeros(8, 7)), "rotary width 7 for head size 8"),
    ("wider-than-head", lambda: _check_pair(Q, cache=rope_cache(8, 16)), "rotary width 16 for head size 8"),
    ("zero-width", lambda: _check_pair(Q, cache=torch.zeros(8, 0)), "rotary width 0 for head size 8"),
    ("head-sizes", lambda: _check_pair(Q, torch.zeros(3, 1, 16, dtype=torch.bfloat16)), "q head size 8 != k head size 16"),
    ("float-positions", lambda: _check_pair(Q, pos=torch.arange(3.0)),
     "positions torch.float32(3,), needs 1-D int32/int64"),
    ("positions-per-token", lambda: _check_pair(Q, pos=torch.arange(4)), "4 positions for 3 tokens"),
    ("cache-float64", lambda: _check_pair(Q, cache=rope_cache(8, 8).double()),
     "cos_sin_cache torch.float64(8, 8) strides (8, 1): needs [P, R] floats of 16 or 32 bits with a contiguous last dim"),
    ("cache-strided", lambda: _check_pair(Q, cache=rope_cache(8, 8).t().contiguous().t()),
     "cos_sin_cache torch.float32(8, 8) strides (1, 8): needs [P, R] floats of 16 or 32 bits with a contiguous last dim"),
    ("devices", lambda: _check_pair(Q, Q.to("meta")), "tensor on meta, input on cpu"),
    ("huge-head", lambda: _check_pair(torch.zeros(1, 1, 65536, dtype=torch.bfloat16)),
     "row of 65536 values exceeds one Triton program (32768)"),
]


@pytest.mark.parametrize("check, reason", [c[1:] for c in TRITON_REFUSALS], ids=[c[0] for c in TRITON_REFUSALS])
def test_triton_check_names_what_it_cannot_serve(check: Callable[[], str | None], reason: str) -> None:
    assert check() == reason


def test_triton_check_takes_what_flashinfer_refuses() -> None:
    """The negative twin of the kernels' order: flashinfer's refusals that Triton serves."""
    pos = torch.arange(3)
    for q, cache in ((Q, rope_cache(8, 8)), (torch.zeros(3, 2, 80, dtype=torch.bfloat16), rope_cache(8, 32)),
                     (torch.zeros(3, 2, 64), rope_cache(8, 64))):  # fmt: skip
        assert rotary.check_rotary(pos, cache, q) is not None
        assert rotary._triton_check_q(pos, q, cache, True) is None


def _fake_flashinfer_rope() -> types.ModuleType:
    """``flashinfer.rope`` on CPU: the reference under 0.7.2's signature (test_providers.py
    emulates all of flashinfer)."""
    fi = types.ModuleType("flashinfer.rope")

    def apply(positions, query, key, head_size, cos_sin_cache, is_neox=True):  # type: ignore[no-untyped-def]
        return (rotary.rotary_embedding_q_reference(positions, query, cos_sin_cache, is_neox),
                rotary.rotary_embedding_q_reference(positions, key, cos_sin_cache, is_neox))  # fmt: skip

    fi.apply_rope_with_cos_sin_cache = apply  # type: ignore[attr-defined]
    return fi


@pytest.mark.parametrize("flashinfer", [True, False], ids=["flashinfer", "no-flashinfer"])
def test_dispatch_order_flashinfer_then_triton_then_torch(registry: providers._Registry, triton_rotary: types.ModuleType,
                                                          flashinfer: bool) -> None:  # fmt: skip
    """Flashinfer serves its head sizes in 16-bit floats; Triton the rest (head size 8, float32)
    and all of it where flashinfer does not import; the reference only what neither takes."""
    for kernels in (rotary.ROTARY_KERNELS, rotary.ROTARY_Q_KERNELS):
        assert [k.provider for k in kernels] == ["flashinfer", "triton"]
    registry.modules.update({"flashinfer.rope": _fake_flashinfer_rope() if flashinfer else None,
                             rotary.TRITON_ROTARY: triton_rotary})  # fmt: skip
    pair, single = (next(op for op in rotary.DEFS if op.name == name) for name in ("rotary_embedding", "rotary_embedding_q"))
    g = torch.Generator().manual_seed(0)
    for head_dim, dtype in ((128, torch.bfloat16), (8, torch.bfloat16), (64, torch.float32), (8, torch.float64)):
        q, k = fused_qkv(3, 2, 1, head_dim, dtype, g)
        pos, cache = torch.arange(3), rope_cache(8, head_dim)
        for a, b in zip(pair.cuda(pos, q, k, cache, True), rotary.rotary_embedding_reference(pos, q, k, cache, True)):
            same(a, b)
        same(single.cuda(pos, q, cache, False), rotary.rotary_embedding_q_reference(pos, q, cache, False))
    fi_says = "flashinfer: dtype float64 not bf16/fp16; " if flashinfer else "flashinfer.rope not importable; "
    refused = {fi_says + "triton: dtype float64 is not a float of 16 or 32 bits": 1}
    expected = {"flashinfer": 1, "triton": 2} if flashinfer else {"triton": 3}
    assert providers.served()["rotary_embedding"] == {**expected, "torch": 1, "fallbacks": refused}
    assert providers.served()["rotary_embedding_q"] == {**expected, "torch": 1, "fallbacks": refused}


# (dtype, head size, rotary width, heads per program, interleaved): partial NeoX bf16, a float32
# 8-wide head, an fp16 head of one pair (blocks of one value)
SM90_BUILDS = [("bf16", 80, 32, 16, False), ("fp32", 8, 8, 4, True), ("fp16", 2, 2, 8, True)]


@pytest.mark.parametrize("dtype, d, r, heads, interleaved", SM90_BUILDS, ids=[b[0] for b in SM90_BUILDS])
def test_triton_kernel_compiles_for_hopper(dtype: str, d: int, r: int, heads: int, interleaved: bool) -> None:
    """Built for sm90 by this Triton's front end and NVIDIA backend (what the interpreter lets
    through, the compiler may refuse), without FP fusion as the launcher builds it: no ``fma`` in
    the PTX, the products and sums rounded apart, as the spec's."""
    import re

    from helpers.triton import compile_for_hopper

    pass_block = 1 << (d - r - 1).bit_length() if d > r else 0
    constexprs = {"D": d, "HALF": r // 2, "BLOCK_HALF": r // 2, "BLOCK_PASS": pass_block, "HEADS": heads,
                  "INTERLEAVED": interleaved}  # fmt: skip
    types_ = {"pos_ptr": "*i64", "cs_ptr": "*fp32", **{p: f"*{dtype}" for p in ("q_ptr", "k_ptr", "qo_ptr", "ko_ptr")}}
    ptx = compile_for_hopper("fxrewrite.runtime.triton_rotary", "_rotary_kernel", types_, constexprs,
                             enable_fp_fusion=False)  # fmt: skip
    ops = set(re.findall(r"\b(?:mul|add|sub|fma)\.[a-z.]*f32\b", ptx))
    assert ops == {"mul.rn.f32", "add.rn.f32", "sub.rn.f32"}, ops  # with FP fusion: fma.rn.f32
