"""The ``triton`` provider's mixture-of-experts router (``fxr::moe_route``): one launch, a program
per chunk of tokens, each token's row of logits held in registers.

    p = softmax(l), sigmoid(l) or sqrt(softplus(l))    # float32 scores
    c = (p or l) + bias                                # choice values; columns past E are -inf
    groups: g_score[g] = sum of the group's group_top best c; keep the topk_group best groups,
            c = -inf outside them
    top_k times: the largest available c (the lowest expert among equals), its score p
    w = p / sum(p) if renormalize; w *= routed_scaling

Rounding: float32 throughout; ``exp`` and the sums are Triton's, so a choice value may differ
from the reference's by an ulp (a near-tie may then pick the other expert). Under
``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (``tests/runtime/test_moe_route_ops.py``).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxrewrite.runtime.ops import moe_route as route_ops

ONE_ROW_ELEMENTS = 8192
"""Largest tokens x experts block a program holds (sets its chunk of tokens)."""
CHUNK_TOKENS = 64


@triton.jit
def _column(values, cols, j):
    """Column ``j`` of a [TOKENS, N] tensor whose column indices are ``cols`` [N]."""
    return tl.sum(tl.where(cols[None, :] == j, values, 0.0), axis=1)


@triton.jit
def _moe_route_kernel(logits_ptr, logits_stride, bias_ptr, w_ptr, ids_ptr, T, E, routed_scaling,
                      TOKENS: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr, K_BLOCK: tl.constexpr,
                      SCORING: tl.constexpr,
                      SELECT_LOGITS: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr,
                      G_BLOCK: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOP: tl.constexpr,
                      RENORMALIZE: tl.constexpr):  # fmt: skip
    """Program c: tokens ``c*TOKENS ..``: weights [T, K] float32 and ids [T, K] int64."""
    c = tl.program_id(0)
    t = c * TOKENS + tl.arange(0, TOKENS)
    tmask = t < T
    e = tl.arange(0, E_BLOCK)
    emask = e < E
    logits = tl.load(logits_ptr + t[:, None].to(tl.int64) * logits_stride + e[None, :],
                     mask=tmask[:, None] & emask[None, :], other=0.0).to(tl.float32)  # fmt: skip
    if SCORING == 1:  # sigmoid
        p = 1.0 / (1.0 + tl.exp(-logits))
    elif SCORING == 2:  # sqrt(softplus): max(l, 0) + log1p(exp(-|l|)), l itself past torch's threshold 20
        z = tl.exp(-tl.abs(logits))
        u = 1.0 + z
        log1p = tl.where(u == 1.0, z, tl.log(u) * z / (u - 1.0))  # log1p to a few ulps where z is small
        p = tl.sqrt(tl.where(logits > 20.0, logits, tl.maximum(logits, 0.0) + log1p))
    else:
        shifted = tl.where(emask[None, :], logits, float("-inf"))
        p = tl.exp(shifted - tl.max(shifted, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
    choice = logits if SELECT_LOGITS else p
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=emask, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(emask[None, :], choice, float("-inf"))
    if N_GROUP > 1:
        size = E // N_GROUP
        group = e // size
        g = tl.arange(0, G_BLOCK)
        group_scores = tl.full([TOKENS, G_BLOCK], float("-inf"), tl.float32)
        for j in tl.static_range(N_GROUP):
            inside = tl.where((group == j)[None, :], choice, float("-inf"))
            score = tl.zeros([TOKENS], tl.float32)
            for _ in tl.static_range(GROUP_TOP):
                best = tl.max(inside, axis=1)
                first = tl.min(tl.where(inside == best[:, None], e[None, :], E_BLOCK), axis=1)
                score += best
                inside = tl.where(e[None, :] == first[:, None], float("-inf"), inside)
            group_scores = tl.where(g[None, :] == j, score[:, None], group_scores)
        kept = tl.zeros([TOKENS, G_BLOCK], tl.int32)
        open_groups = g[None, :] < N_GROUP
        for _ in tl.static_range(TOPK_GROUP):
            avail = open_groups & (kept == 0)
            best = tl.max(tl.where(avail, group_scores, float("-inf")), axis=1)
            first = tl.min(tl.where(avail & (group_scores == best[:, None]), g[None, :], G_BLOCK), axis=1)
            kept = tl.where(g[None, :] == first[:, None], 1, kept)
        keep = tl.zeros([TOKENS, E_BLOCK], tl.int32)
        for j in tl.static_range(N_GROUP):
            keep = tl.where((group == j)[None, :], _column(kept.to(tl.float32), g, j).to(tl.int32)[:, None], keep)
        choice = tl.where(keep != 0, choice, float("-inf"))
    slot = tl.arange(0, K_BLOCK)
    weights = tl.zeros([TOKENS, K_BLOCK], tl.float32)
    ids = tl.zeros([TOKENS, K_BLOCK], tl.int64)
    taken = ~emask[None, :] | (tl.zeros([TOKENS, E_BLOCK], tl.int32) != 0)
    for j in tl.static_range(K):
        values = tl.where(taken, float("-inf"), choice)
        best = tl.max(values, axis=1)
        first = tl.min(tl.where(~taken & (values == best[:, None]), e[None, :], E_BLOCK), axis=1)
        picked = tl.sum(tl.where(e[None, :] == first[:, None], p, 0.0), axis=1)
        weights = tl.where(slot[None, :] == j, picked[:, None], weights)
        ids = tl.where(slot[None, :] == j, first.to(tl.int64)[:, None], ids)
        taken = taken | (e[None, :] == first[:, None])
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    weights = weights * routed_scaling
    out = t[:, None].to(tl.int64) * K + slot[None, :]
    omask = tmask[:, None] & (slot < K)[None, :]
    tl.store(w_ptr + out, weights, mask=omask)
    tl.store(ids_ptr + out, ids, mask=omask)


def moe_route(
    router_logits: Tensor, correction_bias: Tensor | None, top_k: int, scoring: str = "softmax",
    select: str = "scores", n_group: int = 1, topk_group: int = 1, group_top: int = 2, renormalize: bool = False,
    routed_scaling: float = 1.0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``fxr::moe_route`` (see :mod:`fxrewrite.runtime.ops.moe_route`)."""
    experts = route_ops.check_route_args(router_logits, correction_bias, top_k, scoring, select, n_group, topk_group,
                                         group_top)  # fmt: skip
    lead = router_logits.shape[:-1]
    logits = router_logits.reshape(-1, experts)
    tokens, dev = logits.shape[0], logits.device
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=dev)
    if tokens:
        e_block = triton.next_power_of_2(experts)
        chunk = max(1, min(triton.next_power_of_2(tokens), ONE_ROW_ELEMENTS // e_block, CHUNK_TOKENS))
        bias = correction_bias if correction_bias is not None else weights
        ctx = torch.cuda.device(dev) if logits.is_cuda else contextlib.nullcontext()
        with ctx:
            _moe_route_kernel[(triton.cdiv(tokens, chunk),)](
                logits, logits.stride(0), bias, weights, ids, tokens, experts, float(routed_scaling), TOKENS=chunk,
                E_BLOCK=e_block, K=top_k, K_BLOCK=triton.next_power_of_2(top_k), SCORING=route_ops.SCORINGS.index(scoring),
                SELECT_LOGITS=select == "logits", HAS_BIAS=correction_bias is not None, N_GROUP=n_group,
                G_BLOCK=triton.next_power_of_2(n_group), TOPK_GROUP=topk_group, GROUP_TOP=group_top, RENORMALIZE=renormalize,
            )  # fmt: skip
    return weights.view(*lead, top_k), ids.view(*lead, top_k)
