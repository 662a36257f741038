"""``fxr.moe_route`` on CPU: the reference against routers written as the model code writes them
(it must choose what they choose, ties included, and give their weights), its errors, the Triton
kernel's constraints, and the kernel itself under Triton's interpreter (skipped without Triton).
The generic checks (fake impl, opcheck, Dynamo, providers) run with the other ops in test_ops.py
and test_providers.py."""

from __future__ import annotations

import re
import types
import zlib

import pytest
import torch
import torch.nn.functional as F

from fxrewrite.runtime.ops import moe_route
from fxrewrite.testing import assert_close

F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def grouped_sigmoid(logits: torch.Tensor, bias: torch.Tensor, k: int, groups: int, kept: int, scaling: float,
                    renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The DeepSeek-V3 / GLM-4.5 router as transformers writes it."""
    e = logits.shape[-1]
    scores = logits.float().sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=kept, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, e // groups).reshape(-1, e)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * scaling, ids


def greedy_groups(logits: torch.Tensor, k: int, groups: int, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's group-limited greedy router: softmax, a group's score its best expert."""
    e = logits.shape[-1]
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    group_scores = scores.view(-1, groups, e // groups).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=kept, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, groups, e // groups).reshape(-1, e)
    return torch.topk(scores.masked_fill(~mask.bool(), 0.0), k=k, dim=-1, sorted=False)


def biased_logits_sigmoid(logits: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the biased logits, then a sigmoid of the chosen logits, renormalized."""
    ids = torch.topk(logits + bias, k, dim=-1)[1]
    w = logits.gather(1, ids).sigmoid()
    return w / w.sum(dim=-1, keepdim=True), ids


def biased_softmax(logits: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax scores, top-k of the biased scores, weights clamped-renormalized."""
    scores = F.softmax(logits, dim=1, dtype=torch.float)
    ids = torch.topk(scores + bias, k, dim=-1)[1]
    w = torch.gather(scores, dim=-1, index=ids)
    return w / torch.clamp(w.sum(dim=-1, keepdim=True), min=1e-12), ids


def top_k_then_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(values, dim=-1), ids


def same_routing(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The same experts per token (in any order: the code's top-k may be unsorted), each with
    its weight."""
    (w, ids), (w_ref, ids_ref) = got, want
    assert w.dtype == F32 and ids.dtype == torch.int64
    order, order_ref = ids.sort(dim=-1), ids_ref.sort(dim=-1)
    assert torch.equal(order.values, order_ref.values)
    assert_close(w.gather(-1, order.indices), w_ref.float().gather(-1, order_ref.indices))


def sample(gen: torch.Generator, tokens: int = 9, experts: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn((tokens, experts), generator=gen), torch.randn(experts, generator=gen) * 0.3


# --------------------------------------------------------------------------- the reference


@pytest.mark.parametrize(("groups", "kept"), [(1, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_sigmoid_router(gen: torch.Generator, groups: int, kept: int, renormalize: bool) -> None:
    logits, bias = sample(gen, experts=32)
    got = moe_route.moe_route_reference(logits, bias, 4, "sigmoid", "scores", groups, kept, 2, renormalize, 2.5)
    same_routing(got, grouped_sigmoid(logits, bias, 4, groups, kept, 2.5, renormalize))


def test_greedy_groups_router(gen: torch.Generator) -> None:
    logits, _ = sample(gen, experts=32)
    got = moe_route.moe_route_reference(logits, None, 3, "softmax", "scores", 8, 2, 1, False, 1.0)
    same_routing(got, greedy_groups(logits, 3, 8, 2))


def test_groups_change_the_choice(gen: torch.Generator) -> None:
    """Negative twin: without the group limit the same scores choose other experts."""
    logits, bias = sample(gen, tokens=32, experts=32)
    grouped = moe_route.moe_route_reference(logits, bias, 4, "sigmoid", "scores", 8, 2, 2, True)
    flat = moe_route.moe_route_reference(logits, bias, 4, "sigmoid", "scores", 1, 1, 2, True)
    assert not torch.equal(grouped[1].sort(-1).values, flat[1].sort(-1).values)


def test_selection_on_biased_logits(gen: torch.Generator) -> None:
    logits, bias = sample(gen)
    got = moe_route.moe_route_reference(logits, bias, 2, "sigmoid", "logits", renormalize=True)
    same_routing(got, biased_logits_sigmoid(logits, bias, 2))
    scores_chosen = moe_route.moe_route_reference(logits, bias, 2, "sigmoid", "scores", renormalize=True)
    assert not torch.equal(scores_chosen[1], got[1])  # the bias steers the logits' choice otherwise


def test_biased_softmax_and_top_k_then_softmax(gen: torch.Generator) -> None:
    logits, bias = sample(gen)
    same_routing(moe_route.moe_route_reference(logits, bias, 3, "softmax", "scores", renormalize=True),
                 biased_softmax(logits, bias, 3))  # fmt: skip
    same_routing(moe_route.moe_route_reference(logits, None, 3, "softmax", "logits", renormalize=True),
                 top_k_then_softmax(logits, 3))  # fmt: skip


def test_ties_choose_what_torch_topk_chooses() -> None:
    """Equal choice values: the reference computes what the code computes, so it picks the same
    experts the code's own top-k picks."""
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0]]).repeat(3, 1)
    bias = torch.zeros(8)
    same_routing(moe_route.moe_route_reference(logits, bias, 2, "sigmoid", "scores", 4, 2, 2, True, 1.0),
                 grouped_sigmoid(logits, bias, 2, 4, 2, 1.0))  # fmt: skip


def test_leading_dims_and_half_logits(gen: torch.Generator) -> None:
    logits, bias = sample(gen, tokens=6)
    w, ids = moe_route.moe_route_reference(logits.view(2, 3, -1).to(BF16), bias, 2, "sigmoid", "scores", 4, 2, 2, True)
    assert w.shape == ids.shape == (2, 3, 2) and w.dtype == F32
    same_routing((w.view(6, 2), ids.view(6, 2)), grouped_sigmoid(logits.to(BF16), bias, 2, 4, 2, 1.0))


BAD = [
    (dict(scoring="relu"), "moe_route: scoring 'relu' is not one of"),
    (dict(select="bias"), "moe_route: select 'bias' is not one of"),
    (dict(n_group=3), "moe_route: n_group 3 must divide the 16 experts"),
    (dict(n_group=4, topk_group=5), "moe_route: topk_group 5 outside 1..4 (n_group)"),
    (dict(n_group=4, group_top=5), "moe_route: group_top 5 outside 1..4 (experts per group)"),
    (dict(n_group=4, topk_group=1, top_k=5), "moe_route: top_k 5 outside 1..4 (the experts of 1 of 4 groups)"),
    (dict(correction_bias=torch.zeros(8)), "moe_route: correction_bias float32[8] must be floating [16]"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_arguments_raise_clear_errors(gen: torch.Generator, case: int) -> None:
    logits, bias = sample(gen)
    kwargs = {"correction_bias": bias, "top_k": 2, **BAD[case][0]}
    with pytest.raises(ValueError, match="^" + re.escape(BAD[case][1])):
        torch.ops.fxr.moe_route(logits, **kwargs)


def test_triton_check_names_what_the_kernel_cannot_serve(gen: torch.Generator) -> None:
    logits, bias = sample(gen)
    assert moe_route.triton_check(logits, bias, 2) is None and moe_route.triton_check(logits.to(BF16), None, 2) is None
    assert moe_route.triton_check(logits.double(), None, 2) == "dtype float64 is not a float of 16 or 32 bits"
    assert moe_route.triton_check(logits.t().contiguous().t(), None, 2) == (
        "router logits without unit stride along the experts")  # fmt: skip
    many = torch.zeros(2, moe_route.MAX_EXPERTS + 1)
    assert moe_route.triton_check(many, None, 2) == f"{moe_route.MAX_EXPERTS + 1} experts, more than {moe_route.MAX_EXPERTS}"


# --------------------------------------------------------------------------- the Triton kernel, interpreted


CASES = [  # tokens, experts, top_k, scoring, select, n_group, topk_group, group_top, renormalize, bias
    (1, 8, 2, "softmax", "scores", 1, 1, 2, True, False),
    (9, 16, 3, "softmax", "logits", 1, 1, 2, True, False),  # top-k of the logits then softmax; k not a power of 2
    (70, 32, 4, "sigmoid", "scores", 8, 3, 2, True, True),  # DeepSeek-V3: two programs of tokens
    (5, 24, 2, "sigmoid", "scores", 4, 2, 2, False, True),  # 24 experts: a block wider than E, groups of 6
    (7, 16, 2, "softmax", "scores", 4, 2, 1, False, False),  # DeepSeek-V2's group-limited greedy
    (6, 10, 2, "sigmoid", "logits", 1, 1, 2, True, True),  # biased logits chosen, sigmoid weights
    (12, 16, 2, "sqrtsoftplus", "scores", 1, 1, 2, True, True),  # DeepSeek-V4
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-{c[3]}-{c[4]}-g{c[5]}")
def test_kernel_against_the_reference(triton_route: types.ModuleType, gen: torch.Generator, case: tuple) -> None:
    tokens, experts, k, scoring, select, groups, kept, top, renormalize, biased = case
    logits, bias = sample(gen, tokens, experts)
    args = (logits, bias if biased else None, k, scoring, select, groups, kept, top, renormalize, 1.5)
    assert moe_route.triton_check(*args) is None
    w, ids = triton_route.moe_route(*args)
    w_ref, ids_ref = moe_route.moe_route_reference(*args)
    assert torch.equal(ids, ids_ref)  # both sorted, best first
    assert_close(w, w_ref)


def test_kernel_sqrt_softplus_holds_its_precision_in_the_tails(triton_route: types.ModuleType) -> None:
    """``sqrt(softplus(l))`` where ``log(1 + exp(l))`` would round to 0 (l = -30: the score is
    3e-7, not 0), across torch's threshold (l > 20 is l itself) and past it; every expert chosen,
    so the weights are the scores, best first."""
    logits = torch.tensor([[-30.0, -20.0, -5.0, 0.0, 5.0, 19.5, 20.5, 40.0]])
    w, ids = triton_route.moe_route(logits, None, 8, "sqrtsoftplus", "scores", 1, 1, 2, False, 1.0)
    assert ids.tolist() == [list(range(7, -1, -1))]
    want = torch.nn.functional.softplus(logits.double()).sqrt().flip(-1).float()
    torch.testing.assert_close(w, want, rtol=4e-7, atol=0)


def test_kernel_takes_the_lowest_expert_among_equals(triton_route: types.ModuleType) -> None:
    """Ties everywhere (equal logits): the lowest experts of the lowest groups, in order."""
    logits = torch.zeros(3, 16)
    w, ids = triton_route.moe_route(logits, None, 3, "sigmoid", "scores", 4, 2, 2, True, 1.0)
    assert ids.tolist() == [[0, 1, 2]] * 3 and torch.allclose(w, torch.full((3, 3), 1 / 3))


def test_kernel_reads_half_logits_in_place_from_a_wider_projection(triton_route: types.ModuleType,
                                                                    gen: torch.Generator) -> None:  # fmt: skip
    wide = torch.randn((5, 20), generator=gen).half()
    args = (wide[:, :16], None, 2, "softmax", "scores", 1, 1, 2, True, 1.0)
    assert not args[0].is_contiguous()
    w, ids = triton_route.moe_route(*args)
    w_ref, ids_ref = moe_route.moe_route_reference(*args)
    assert torch.equal(ids, ids_ref) and w.shape == (5, 2)
    assert_close(w, w_ref)


def test_kernel_with_sqrt_softplus_compiles_for_hopper() -> None:
    """``SCORING=2`` (DeepSeek-V4) built for sm90 by this Triton's NVIDIA backend: what the
    interpreter lets through, the GPU's compiler may refuse. Its exp and sqrt are in the PTX (the
    log is libdevice's, inlined)."""
    from helpers.triton import compile_for_hopper

    ptx = compile_for_hopper(
        moe_route.TRITON_ROUTE, "_moe_route_kernel",
        {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i64", "routed_scaling": "fp32"},
        {"TOKENS": 64, "E_BLOCK": 16, "K": 2, "K_BLOCK": 2, "SCORING": 2, "SELECT_LOGITS": False, "HAS_BIAS": True,
         "N_GROUP": 1, "G_BLOCK": 1, "TOPK_GROUP": 1, "GROUP_TOP": 2, "RENORMALIZE": True})  # fmt: skip
    assert re.search(r"\bex2\.approx", ptx) and re.search(r"\bsqrt\.", ptx)
