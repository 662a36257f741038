"""The ``triton`` provider's rotary embedding (``fxr.rotary_embedding``, ``fxr.rotary_embedding_q``)
for the calls flashinfer does not dispatch: head sizes other than 64, 128, 256 and 512 (32, 80,
96, DeepSeek-V4's 8-wide rope slice of a larger head...), float32 activations, a cache of 16-bit
floats.

    # the torch reference: a kernel per step, per tensor      # one launch for q and k
    cos, sin = cos_sin_cache[positions].chunk(2, -1)           q, k = rotary_embedding(
    x1, x2 = q[..., :R/2], q[..., R/2:R]                           positions, q, k, cos_sin_cache, True)
    q = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin, q[..., R:])

Program ``(t, b)`` rotates token ``t``'s ``HEADS`` heads of block ``b`` (q's blocks first, then
k's; no k heads for the q-only op): it reads the ``R/2`` angles of ``positions[t]`` once, then
each head's pairs (NeoX: feature ``i`` with ``i + R/2``; interleaved: ``2i`` with ``2i + 1``) and
its features past ``R``, which it copies (partial rotary). q and k at any token and head strides
(views of a fused qkv output), the last dim contiguous; the outputs are new contiguous tensors,
as the op's fake impl says.

Rounding: the spec (``runtime/ops/rotary.py``) computes ``x1 * cos - x2 * sin`` and ``x2 * cos +
x1 * sin`` in float32, each product and sum rounded on its own, and rounds the result once to the
input's dtype. The kernel computes the same float32 operations in the same order, built without
FP fusion (no FMA contracts a product into the sum), and rounds once to nearest even: its outputs
equal the reference's bit for bit, in every dtype (the CPU tests assert ``torch.equal`` under the
interpreter, whose casts the tests make round as the GPU's ``cvt.rn`` does). Pass-through features
are copied, as the reference's round trip through float32 leaves them.

Imported through ``providers.library("fxrewrite.runtime.triton_rotary")`` only, as
``triton_kernels`` is; under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxrewrite.runtime.triton_kernels import _warps, device_of

PROGRAM_VALUES = 2048
"""Head values a program holds at most (``HEADS`` heads of the padded head size): a few per
thread of 4 warps, and many programs for a prefill's tokens."""


@triton.jit
def _rotate_heads(x_ptr, out_ptr, tok, head0, heads, xs0, xs1, cos, sin, D: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, HEADS: tl.constexpr,
                  INTERLEAVED: tl.constexpr):  # fmt: skip
    """Heads ``head0 .. head0 + HEADS`` (of ``heads``) of token ``tok``: ``x`` at ``tok * xs0 + h *
    xs1 + feature``, ``out`` contiguous ``[tokens, heads, D]``; ``cos``/``sin``: ``[BLOCK_HALF]``
    float32, the ``HALF`` angles of the token's position."""
    h = head0 + tl.arange(0, HEADS)
    i = tl.arange(0, BLOCK_HALF)
    rows = (h < heads)[:, None]
    mask = rows & (i < HALF)[None, :]
    src = x_ptr + tok * xs0 + h[:, None] * xs1
    dst = out_ptr + (tok * heads + h[:, None]) * D
    if INTERLEAVED:
        first, second = (2 * i)[None, :], (2 * i + 1)[None, :]
    else:
        first, second = i[None, :], (i + HALF)[None, :]
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    c, s = cos[None, :], sin[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(dst + first, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(dst + second, (x2 * c + x1 * s).to(dtype), mask=mask)
    if BLOCK_PASS > 0:  # partial rotary: features R .. D copied
        j = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
        keep = rows & (j < D)
        tl.store(dst + j, tl.load(src + j, mask=keep, other=0.0).to(dtype), mask=keep)


@triton.jit
def _rotary_kernel(pos_ptr, cs_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, q_heads, k_heads, cs_stride, qs0, qs1, ks0, ks1,
                   D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                   HEADS: tl.constexpr, INTERLEAVED: tl.constexpr):  # fmt: skip
    """Program ``(token, block)``: blocks ``0 .. cdiv(q_heads, HEADS)`` rotate q's heads, the
    rest k's (none when ``k_heads`` is 0), by ``cos_sin = cs[pos[token]]`` (``HALF`` cosines,
    then ``HALF`` sines, at a row stride of ``cs_stride``)."""
    tok = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    angles = cs_ptr + pos * cs_stride + i
    cos = tl.load(angles, mask=i < HALF, other=1.0).to(tl.float32)
    sin = tl.load(angles + HALF, mask=i < HALF, other=0.0).to(tl.float32)
    q_blocks = tl.cdiv(q_heads, HEADS)
    if block < q_blocks:
        _rotate_heads(q_ptr, qo_ptr, tok, block * HEADS, q_heads, qs0, qs1, cos, sin, D, HALF, BLOCK_HALF,
                      BLOCK_PASS, HEADS, INTERLEAVED)  # fmt: skip
    else:
        _rotate_heads(k_ptr, ko_ptr, tok, (block - q_blocks) * HEADS, k_heads, ks0, ks1, cos, sin, D, HALF,
                      BLOCK_HALF, BLOCK_PASS, HEADS, INTERLEAVED)  # fmt: skip


def launch(positions: Tensor, q: Tensor, k: Tensor | None, cos_sin_cache: Tensor,
           is_neox: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """New contiguous ``q`` and ``k`` (None: the q-only op) rotated by ``cos_sin_cache[positions]``;
    the op module's check has let only ``[N, H, D]`` tensors with a contiguous last dim, one head
    size, an even rotary width ``R <= D`` and a cache with a contiguous last dim through."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k is not None else None
    tokens, q_heads, d = q.shape
    k_heads = k.shape[1] if k is not None else 0
    half = cos_sin_cache.shape[-1] // 2
    block_d = triton.next_power_of_2(d)
    heads = max(1, min(triton.next_power_of_2(max(q_heads, k_heads, 1)), PROGRAM_VALUES // block_d))
    blocks = triton.cdiv(q_heads, heads) + triton.cdiv(k_heads, heads)
    if tokens == 0 or blocks == 0:
        return q_out, k_out
    kk, ko = (k, k_out) if k is not None and k_out is not None else (q, q_out)  # no k heads: never read
    with device_of(q):
        _rotary_kernel[(tokens, blocks)](
            positions, cos_sin_cache, q, kk, q_out, ko, q_heads, k_heads, cos_sin_cache.stride(0), q.stride(0),
            q.stride(1), kk.stride(0), kk.stride(1), D=d, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_PASS=triton.next_power_of_2(d - 2 * half) if d > 2 * half else 0, HEADS=heads,
            INTERLEAVED=not is_neox, num_warps=_warps(heads * block_d),
            enable_fp_fusion=False,  # no FMA: each product and sum rounds on its own, as the spec's
        )  # fmt: skip
    return q_out, k_out


# --------------------------------------------------------------------------- the ops' signatures


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool) -> tuple[Tensor, Tensor]:
    return launch(positions, q, k, cos_sin_cache, is_neox)  # type: ignore[return-value]


def rotary_embedding_q(positions: Tensor, q: Tensor, cos_sin_cache: Tensor, is_neox: bool) -> Tensor:
    return launch(positions, q, None, cos_sin_cache, is_neox)[0]
