"""``fxr::moe_route``: a mixture-of-experts router in one op: scores, biased and group-limited
top-k selection, the chosen experts' weights.

    weights, ids = torch.ops.fxr.moe_route(router_logits, correction_bias, top_k, scoring, select,
                                           n_group, topk_group, group_top, renormalize, routed_scaling)

``router_logits`` [..., E] (any float dtype; computed in float32). ``scoring``: "softmax",
"sigmoid" or "sqrtsoftplus" (``sqrt(softplus(l))``, DeepSeek-V4) of the logits: the scores the
weights are read from. ``select``: what top-k ranks:
"scores" or the raw "logits", plus ``correction_bias`` [E] when given (a bias that steers the
choice only, never the weights). With ``n_group`` > 1 the experts form ``n_group`` equal groups;
a group's score is the sum of its ``group_top`` best choice values, only the ``topk_group`` best
groups stay eligible. The ``top_k`` best eligible experts are chosen (ids int64, the best
first); their weights (float32) are their scores, divided by their sum if ``renormalize``, times
``routed_scaling``. Weights and ids feed ``fxr.moe`` as given routing.

    # before (DeepSeek-V3 / GLM-4.5 style: sigmoid, bias for the choice, groups, renormalized, scaled)
    scores = logits.sigmoid(); choice = scores + bias
    group_scores = choice.view(T, G, E // G).topk(2)[0].sum(-1); keep = group_scores.topk(kg)[1]
    choice = choice.masked_fill(~mask_of(keep), -inf); ids = choice.topk(k)[1]
    w = scores.gather(1, ids); w /= w.sum(-1, keepdim=True) + 1e-20; w = w * scaling
    # after
    w, ids = torch.ops.fxr.moe_route(logits, bias, k, "sigmoid", "scores", G, kg, 2, True, scaling)

Other routers it states: softmax then top-k (Mixtral, Qwen-MoE: ``"softmax", "scores"``), top-k
of the logits then a softmax over the k values (``"softmax", "logits"``, renormalized: the same
weights), top-k of biased logits then a sigmoid of the chosen ones (``"sigmoid", "logits"``),
biased softmax scores (``"softmax", "scores"`` with a bias). The reference (the spec, the CPU
impl) computes what such code computes, op for op, so that on CPU it chooses the experts the code
chooses, ties included; the ``triton`` provider (:mod:`fxrewrite.runtime.triton_route`, one
launch) takes the lowest expert among equal choice values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.providers import Kernel, OpDef

SCORINGS: tuple[str, ...] = ("softmax", "sigmoid", "sqrtsoftplus")
SELECTS: tuple[str, ...] = ("scores", "logits")
TRITON_ROUTE = "fxrewrite.runtime.triton_route"
"""The ``triton`` provider's router kernel (imports Triton at the top)."""
MAX_EXPERTS = 1024
"""Most experts the Triton kernel takes (one token's choice values are held in one program)."""
MAX_GROUPS = 64


def check_route_args(router_logits: Tensor, correction_bias: Tensor | None, top_k: int, scoring: str, select: str,
                     n_group: int, topk_group: int, group_top: int) -> int:  # fmt: skip
    """The number of experts E; ValueError naming what does not fit."""
    if router_logits.dim() < 1 or not router_logits.dtype.is_floating_point:
        raise ValueError(f"moe_route: router_logits must be floating [..., E], got "
                         f"{str(router_logits.dtype).removeprefix('torch.')}"
                         f"{list(router_logits.shape)}")  # fmt: skip
    e = router_logits.shape[-1]
    if scoring not in SCORINGS:
        raise ValueError(f"moe_route: scoring {scoring!r} is not one of {SCORINGS}")
    if select not in SELECTS:
        raise ValueError(f"moe_route: select {select!r} is not one of {SELECTS}")
    if correction_bias is not None and (tuple(correction_bias.shape) != (e,) or not correction_bias.dtype.is_floating_point):
        raise ValueError(f"moe_route: correction_bias {str(correction_bias.dtype).removeprefix('torch.')}"
                         f"{list(correction_bias.shape)} "
                         f"must be floating [{e}]")  # fmt: skip
    if not 1 <= n_group <= min(e, MAX_GROUPS) or e % n_group:
        raise ValueError(f"moe_route: n_group {n_group} must divide the {e} experts (at most {MAX_GROUPS})")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"moe_route: topk_group {topk_group} outside 1..{n_group} (n_group)")
    if n_group > 1 and not 1 <= group_top <= e // n_group:
        raise ValueError(f"moe_route: group_top {group_top} outside 1..{e // n_group} (experts per group)")
    eligible = topk_group * (e // n_group)
    if not 1 <= top_k <= eligible:
        raise ValueError(f"moe_route: top_k {top_k} outside 1..{eligible} (the experts of {topk_group} of "
                         f"{n_group} groups)")  # fmt: skip
    return e


def score(logits: Tensor, scoring: str) -> Tensor:
    """The scores of float32 ``logits`` [T, E] by ``scoring`` (one of :data:`SCORINGS`)."""
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    return torch.nn.functional.softplus(logits).sqrt()


def moe_route_reference(
    router_logits: Tensor, correction_bias: Tensor | None, top_k: int, scoring: str = "softmax",
    select: str = "scores", n_group: int = 1, topk_group: int = 1, group_top: int = 2, renormalize: bool = False,
    routed_scaling: float = 1.0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(weights [..., top_k] float32, ids [..., top_k] int64): see the module docstring."""
    e = check_route_args(router_logits, correction_bias, top_k, scoring, select, n_group, topk_group, group_top)
    lead = router_logits.shape[:-1]
    logits = router_logits.reshape(-1, e).float()
    scores = score(logits, scoring)
    choice = scores if select == "scores" else logits
    if correction_bias is not None:
        choice = choice + correction_bias.float()
    if n_group > 1:
        group_scores = choice.view(-1, n_group, e // n_group).topk(group_top, dim=-1)[0].sum(dim=-1)
        kept = group_scores.topk(topk_group, dim=-1)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0).bool()
        choice = choice.masked_fill(~mask.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling
    return weights.view(*lead, top_k), ids.view(*lead, top_k)


def _moe_route_fake(
    router_logits: Tensor, correction_bias: Tensor | None, top_k: int, scoring: str = "softmax",
    select: str = "scores", n_group: int = 1, topk_group: int = 1, group_top: int = 2, renormalize: bool = False,
    routed_scaling: float = 1.0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    check_route_args(router_logits, correction_bias, top_k, scoring, select, n_group, topk_group, group_top)
    shape = (*router_logits.shape[:-1], top_k)
    return (router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int64))


def triton_check(
    router_logits: Tensor, correction_bias: Tensor | None, top_k: int, scoring: str = "softmax",
    select: str = "scores", n_group: int = 1, topk_group: int = 1, group_top: int = 2, renormalize: bool = False,
    routed_scaling: float = 1.0,
) -> str | None:  # fmt: skip
    """The Triton kernel: logits of 16 or 32 bits with unit stride along the experts, at most
    ``MAX_EXPERTS`` experts, a bias on the logits' device."""
    if reason := constraints.check_float(router_logits):
        return reason
    if router_logits.stride(-1) != 1 and router_logits.shape[-1] > 1:
        return "router logits without unit stride along the experts"
    if router_logits.shape[-1] > MAX_EXPERTS:
        return f"{router_logits.shape[-1]} experts, more than {MAX_EXPERTS}"
    if correction_bias is not None:
        return constraints.check_float(correction_bias) or constraints.check_same_device(router_logits, correction_bias)
    return None


def _triton(*args: object) -> tuple[Tensor, Tensor]:
    return providers.library(TRITON_ROUTE).moe_route(*args)  # type: ignore[union-attr]


KERNELS = (Kernel("triton", _triton, triton_check, (8, 0), module=TRITON_ROUTE),)

DEFS: tuple[OpDef, ...] = (OpDef("moe_route", moe_route_reference, _moe_route_fake, KERNELS),)
OPS: tuple[str, ...] = providers.define_all(DEFS)

__all__ = ["DEFS", "OPS", "SCORINGS", "SELECTS", "check_route_args", "moe_route_reference", "triton_check"]
