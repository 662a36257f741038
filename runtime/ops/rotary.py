"""Rotary position embedding (RoPE).

Two stages, two kinds of op. Model code computes cos and sin tables and rotates q and k with
them; the rules (``rewrites/rotary.py``) first turn the rotation into ``fxr::apply_rotary``, which
takes the tables as the model computed them, then ``rewrites/rotary_tables.py`` folds the tables
into one float32 ``cos_sin_cache`` indexed by position and calls the kernels' op::

    # before (HF Llama, per layer, for q and for k)        # after (one op per layer)
    x1, x2 = q[..., :64], q[..., 64:]                       q, k = fxr.rotary_embedding(
    q = q * cos + torch.cat((-x2, x1), -1) * sin                positions, q, k, cos_sin_cache, True)

``fxr::rotary_embedding(positions [N], q [N, Hq, D], k [N, Hk, D], cos_sin_cache [P, R], is_neox)``
rotates the first ``R`` features of every head of token ``n`` by the angles of position
``positions[n]``: ``cos_sin_cache[p] = cat(cos(p * f), sin(p * f))``, ``R/2`` frequencies ``f``.
NeoX layout rotates feature ``i`` with ``i + R/2``; interleaved (GPT-J) rotates ``2i`` with ``2i+1``.
Features past ``R`` pass through (partial rotary, as Phi-3 and GLM do). Functional: new tensors
(flashinfer's kernel writes them, at head sizes 64, 128, 256, 512 in 16-bit floats; our Triton
kernel, ``runtime/triton_rotary.py``, at any other head size and in float32; sgl-kernel's
``rotary_embedding`` works in place only, on a cache of the query's dtype, so it does not serve
this op). ``fxr::rotary_embedding_q`` rotates one tensor, for models that rotate q alone or q and
k at different places.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.providers import Kernel, OpDef

# --------------------------------------------------------------------------- references (the spec)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """``x`` rotated pairwise by the half-width angles ``cos``/``sin`` (broadcast against each
    half of ``x``), in the dtype of the arguments."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate_full(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """``x * cos + rotate(x) * sin`` with full-width tables, as HF models write it."""
    if interleaved:
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


def apply_rotary_reference(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, full_tables: bool) -> Tensor:
    """Rotate the first ``R`` features of ``x`` by tables that broadcast against it.

    ``full_tables``: ``cos``/``sin`` have ``R`` features and the result is ``x * cos + rotate(x) *
    sin`` (the HF spelling; for RoPE the two halves, or each even/odd pair, of a row are equal);
    else they have ``R / 2`` and the result is the pairwise rotation by those angles (the engine
    spelling). Computed in float32; the result has the promoted dtype of ``x``, ``cos`` and
    ``sin``; features past ``R`` pass through (partial rotary).
    """
    dtype = functools.reduce(torch.promote_types, (x.dtype, cos.dtype, sin.dtype))
    rotary_dim = cos.shape[-1] * (1 if full_tables else 2)
    xr, c, s = x[..., :rotary_dim].float(), cos.float(), sin.float()
    if full_tables:
        out = _rotate_full(xr, c, s, interleaved)
    else:
        out = _rotate(xr, c, s, interleaved)
    out = out.to(dtype)
    if rotary_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rotary_dim:].to(dtype).expand(*out.shape[:-1], -1)), dim=-1)


def rotary_embedding_q_reference(positions: Tensor, q: Tensor, cos_sin_cache: Tensor, is_neox: bool) -> Tensor:
    """``q [N, H, D]`` rotated by ``cos_sin_cache[positions]`` (``[N, R]``: R/2 cos, then R/2 sin)."""
    cos, sin = cos_sin_cache[positions.long()].unsqueeze(-2).chunk(2, dim=-1)
    return apply_rotary_reference(q, cos, sin, not is_neox, False).to(q.dtype)


def rotary_embedding_reference(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    """:func:`rotary_embedding_q_reference` of ``q`` and of ``k`` (``k [N, Hk, D]``)."""
    return (
        rotary_embedding_q_reference(positions, q, cos_sin_cache, is_neox),
        rotary_embedding_q_reference(positions, k, cos_sin_cache, is_neox),
    )


def _apply_rotary_fake(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, full_tables: bool) -> Tensor:
    dtype = functools.reduce(torch.promote_types, (x.dtype, cos.dtype, sin.dtype))
    return x.new_empty(x.shape, dtype=dtype)


def _rotary_q_fake(positions: Tensor, q: Tensor, cos_sin_cache: Tensor, is_neox: bool) -> Tensor:
    # One position per token: tells Dynamo the two sizes are one symbol (else each input that
    # only this op reads gets its own).
    torch._check(positions.shape[0] == q.shape[0], lambda: f"{positions.shape[0]} positions for {q.shape[0]} tokens")
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _rotary_fake(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool) -> tuple[Tensor, Tensor]:
    return _rotary_q_fake(positions, q, cos_sin_cache, is_neox), _rotary_q_fake(positions, k, cos_sin_cache, is_neox)


# --------------------------------------------------------------------------- kernel constraints

HEAD_DIMS: tuple[int, ...] = (64, 128, 256, 512)  # flashinfer 0.7.2 dispatches these head sizes


def _check_heads(positions: Tensor, cos_sin_cache: Tensor, xs: tuple[Tensor, ...],
                 head_sizes: tuple[int, ...] | None) -> str | None:  # fmt: skip
    """What every kernel needs of the positions and of q / k: 1-D int32/int64 positions, one per
    token; ``[N, H, D]`` tensors with a contiguous last dim (token and head strides are free);
    D in ``head_sizes`` (a library's dispatch), else at most one Triton program's row; an even
    rotary width ``R``, ``0 < R <= D``."""
    if positions.dtype not in (torch.int32, torch.int64) or positions.dim() != 1:
        return f"positions {positions.dtype}{tuple(positions.shape)}, needs 1-D int32/int64"
    width = cos_sin_cache.shape[-1]
    for x in xs:
        if x.dim() != 3 or x.stride(-1) != 1:
            return f"input {tuple(x.shape)} strides {x.stride()}: needs [N, H, D] with a contiguous last dim"
        if x.shape[0] != positions.shape[0]:
            return f"{positions.shape[0]} positions for {x.shape[0]} tokens"
        if head_sizes is not None and x.shape[-1] not in head_sizes:
            return f"head size {x.shape[-1]} not in {head_sizes}"
        if head_sizes is None and (reason := constraints.check_triton_row(x.shape[-1])):
            return reason
        if width == 0 or width % 2 or width > x.shape[-1]:
            return f"rotary width {width} for head size {x.shape[-1]}"
    return None


def check_rotary(positions: Tensor, cos_sin_cache: Tensor, *xs: Tensor) -> str | None:
    """flashinfer's ``apply_rope_with_cos_sin_cache``: bf16/fp16 tensors of one dtype, D in
    :data:`HEAD_DIMS`, a float32 contiguous cache, one device (and :func:`_check_heads`)."""
    reason = constraints.check_half(*xs) or constraints.check_same_device(positions, cos_sin_cache, *xs)
    if reason:
        return reason
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        return f"cos_sin_cache {cos_sin_cache.dtype} (contiguous={cos_sin_cache.is_contiguous()}), needs contiguous float32"
    return _check_heads(positions, cos_sin_cache, xs, HEAD_DIMS)


def check_triton_rotary(positions: Tensor, cos_sin_cache: Tensor, *xs: Tensor) -> str | None:
    """Our Triton kernel (``runtime/triton_rotary.py``) takes what flashinfer's dispatch leaves:
    any head size up to one program's row, float16, bfloat16 or float32 tensors (each its own
    dtype), a cache of 16- or 32-bit floats with a contiguous last dim. It refuses other dtypes,
    a cache of another layout, tensors on several devices, and what :func:`_check_heads` names
    (layouts other than ``[N, H, D]`` with a contiguous last dim, an odd, zero or too wide
    rotary width, positions that are not 1-D int32/int64, one per token)."""
    reason = constraints.check_same_device(positions, cos_sin_cache, *xs)
    if reason:
        return reason
    if cos_sin_cache.dim() != 2 or cos_sin_cache.stride(-1) != 1 or constraints.check_float(cos_sin_cache):
        return (f"cos_sin_cache {cos_sin_cache.dtype}{tuple(cos_sin_cache.shape)} strides {cos_sin_cache.stride()}: "
                "needs [P, R] floats of 16 or 32 bits with a contiguous last dim")  # fmt: skip
    for x in xs:
        if reason := constraints.check_float(x):
            return reason
    return _check_heads(positions, cos_sin_cache, xs, None)


def _pair(check: Callable[..., str | None], positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor,
          is_neox: bool) -> str | None:  # fmt: skip
    """``check`` of the pair op's q and k, which share one head size."""
    if k.shape[-1] != q.shape[-1]:
        return f"q head size {q.shape[-1]} != k head size {k.shape[-1]}"
    return check(positions, cos_sin_cache, q, k)


def _single(check: Callable[..., str | None], positions: Tensor, q: Tensor, cos_sin_cache: Tensor,
            is_neox: bool) -> str | None:  # fmt: skip
    return check(positions, cos_sin_cache, q)


_check_pair = functools.partial(_pair, check_rotary)
_check_q = functools.partial(_single, check_rotary)
_triton_check_pair = functools.partial(_pair, check_triton_rotary)
_triton_check_q = functools.partial(_single, check_triton_rotary)


# --------------------------------------------------------------------------- kernels


def flashinfer_rotary(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool) -> tuple[Tensor, Tensor]:
    """flashinfer ``apply_rope_with_cos_sin_cache``: one kernel writes both new tensors."""
    rope = providers.library("flashinfer.rope")
    q_out, k_out = rope.apply_rope_with_cos_sin_cache(positions, q, k, q.shape[-1], cos_sin_cache, is_neox)
    return q_out.view(q.shape), k_out.view(k.shape)


def flashinfer_rotary_q(positions: Tensor, q: Tensor, cos_sin_cache: Tensor, is_neox: bool) -> Tensor:
    """The q-only op through the same kernel with an empty key (no k heads: no k work)."""
    return flashinfer_rotary(positions, q, q[:, :0], cos_sin_cache, is_neox)[0]


_FI = "flashinfer.rope"
TRITON_ROTARY = "fxrewrite.runtime.triton_rotary"
# flashinfer where it dispatches (its kernel, unmeasured against ours), our Triton kernel for the
# rest (other head sizes, float32), the torch reference last.
ROTARY_KERNELS = (
    Kernel("flashinfer", flashinfer_rotary, _check_pair, module=_FI),
    providers.triton_kernel("rotary_embedding", _triton_check_pair, module=TRITON_ROTARY),
)
ROTARY_Q_KERNELS = (
    Kernel("flashinfer", flashinfer_rotary_q, _check_q, module=_FI),
    providers.triton_kernel("rotary_embedding_q", _triton_check_q, module=TRITON_ROTARY),
)

# --------------------------------------------------------------------------- the ops

DEFS: tuple[OpDef, ...] = (
    # The rotation with the model's own tables: what the rules produce first; folded into the
    # cache-indexed ops below where the tables are functions of positions (rewrites/rotary_tables.py).
    OpDef("apply_rotary", apply_rotary_reference, _apply_rotary_fake),
    OpDef("rotary_embedding", rotary_embedding_reference, _rotary_fake, ROTARY_KERNELS),
    OpDef("rotary_embedding_q", rotary_embedding_q_reference, _rotary_q_fake, ROTARY_Q_KERNELS),
)
OPS: tuple[str, ...] = providers.define_all(DEFS)
