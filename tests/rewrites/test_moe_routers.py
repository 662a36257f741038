"""fuse_moe on routers written as model code, each kind with a negative twin: the router becomes
``fxr.moe_route`` (its weights and ids feed ``fxr.moe``), or stays with a near miss that says why.
The experts are transformers' ``batched_mm`` spelling (test_moe.py); the routers are written as
the families write them (DeepSeek-V3 / GLM-4.5 grouped sigmoid, biased sigmoid, top-k of biased
logits, biased softmax, DeepSeek-V2 group-limited greedy, Llama 4's dense scores). The
transformers families themselves are in test_moe_router_families.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, DYNAMIC, F32, check, fused_nodes, misses, sites
from test_moe import MoE, batched, x

Router = Callable[["Routed", torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def grouped_sigmoid(m: Routed, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM-4.5: sigmoid scores, a bias for the choice only, 4 groups ranked by the
    sum of their top 2, 2 groups kept, weights from the unbiased scores, renormalized, scaled."""
    logits = F.linear(h.float(), m.router.float())
    scores = logits.sigmoid()
    choice = scores + m.bias
    group_scores = choice.view(-1, 4, 2).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=2, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, 4, 2).reshape(-1, 8)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=m.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * m.scaling, ids  # a float attribute: a literal, or lifted to the graph (DYNAMIC "lifted")


def grouped_biased_weights(m: Routed, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Negative twin: the weights gathered from the biased scores."""
    logits = F.linear(h.float(), m.router.float())
    choice = logits.sigmoid() + m.bias
    ids = torch.topk(choice, k=m.top_k, dim=-1)[1]
    weights = choice.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def biased_sigmoid(m: Routed, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AFMoE, HunYuan-V3, MiniMax-M2, Laguna: no groups; ``/=`` and an eps on the sum."""
    scores = torch.sigmoid(F.linear(h, m.router).to(torch.float32))
    _, ids = torch.topk(scores + m.bias, m.top_k, dim=-1, sorted=False)
    weights = scores.gather(1, ids)
    weights /= weights.sum(dim=-1, keepdim=True)
    return (weights * 1.5).to(h.dtype), ids


def large_eps(m: Routed, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Negative twin: an eps on the sum that changes the weights."""
    scores = torch.sigmoid(F.linear(h, m.router).float())
    ids = torch.topk(scores + m.bias, m.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 0.5), ids


def biased_logits(m: Routed, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kolibri: the top-k of the biased logits, a sigmoid of the chosen logits, renormalized."""
    logits = F.linear(h.float(), m.router.float())
    ids = torch.topk(logits + m.bias, m.top_k, dim=-1)[1]
    weights = logits.gather(1, ids).sigmoid()
    return weights / weights.sum(dim=-1, keepdim=True), ids


def biased_softmax(m: Routed, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ERNIE 4.5: softmax scores, a bias for the choice, the sum clamped from below."""
    scores = F.softmax(F.linear(h.float(), m.router.float()), dim=1, dtype=torch.float)
    _, ids = torch.topk(scores + m.bias.squeeze(), m.top_k, dim=-1)
    weights = torch.gather(scores, dim=-1, index=ids)
    return (weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=1e-12)).to(h.dtype), ids


def greedy_groups(m: Routed, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's group-limited greedy: softmax, a group's score its best expert, masked to 0,
    the top-k values themselves scaled."""
    scores = F.linear(h.float(), m.router.float()).softmax(dim=-1, dtype=torch.float32)
    group_scores = scores.view(-1, 4, 2).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=2, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, 4, 2).reshape(-1, 8)
    weights, ids = torch.topk(scores.masked_fill(~mask.bool(), 0.0), k=m.top_k, dim=-1, sorted=False)
    return weights * 16.0, ids


def sqrt_softplus(m: Routed, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4: ``sqrt(softplus)`` scores, a bias for the choice, an eps on the sum, scaled."""
    scores = F.softplus(F.linear(h.float(), m.router.float())).sqrt()
    ids = torch.topk(scores + m.bias, m.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * m.scaling, ids


def sqrt_softplus_beta2(m: Routed, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Negative twin: the sqrt of a softplus with another beta (not the op's scoring)."""
    scores = F.softplus(F.linear(h.float(), m.router.float()), beta=2.0).sqrt()
    ids = torch.topk(scores + m.bias, m.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def softplus_scores(m: Routed, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Negative twin of any scoring: softplus, which fxr.moe_route does not compute."""
    scores = F.softplus(F.linear(h.float(), m.router.float()))
    ids = torch.topk(scores, m.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids


class Routed(MoE):
    """test_moe's block with a router of each kind and a [E] correction bias."""

    def __init__(self, router: Router, top_k: int = 2) -> None:
        super().__init__(top_k=top_k)
        self.bias = torch.nn.Parameter(torch.randn(8) * 0.1, requires_grad=False)
        self.route_fn, self.scaling = router, 2.5

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route_fn(self, h)
        return batched(self, h, weights, ids)


ROUTERS = {  # router, fxr.moe_route's arguments after the logits and bias, the site's note
    "grouped_sigmoid": (grouped_sigmoid, (2, "sigmoid", "scores", 4, 2, 2, True, 2.5),
                        "sigmoid, top_k=2, biased, 2 of 4 groups by top-2, renormalize=True, scaling=2.5"),
    "biased_sigmoid": (biased_sigmoid, (2, "sigmoid", "scores", 1, 1, 2, True, 1.5),
                       "sigmoid, top_k=2, biased, renormalize=True, scaling=1.5"),
    "biased_logits": (biased_logits, (2, "sigmoid", "logits", 1, 1, 2, True, 1.0),
                      "sigmoid, top_k=2, chosen on the logits, biased, renormalize=True"),
    "biased_softmax": (biased_softmax, (2, "softmax", "scores", 1, 1, 2, True, 1.0),
                       "softmax, top_k=2, biased, renormalize=True"),
    "greedy_groups": (greedy_groups, (2, "softmax", "scores", 4, 2, 1, False, 16.0),
                      "softmax, top_k=2, 2 of 4 groups by top-1, renormalize=False, scaling=16"),
    "sqrt_softplus": (sqrt_softplus, (2, "sqrtsoftplus", "scores", 1, 1, 2, True, 2.5),
                      "sqrtsoftplus, top_k=2, biased, renormalize=True, scaling=2.5"),
}  # fmt: skip


def route_node(r: object) -> torch.fx.Node:
    (node,) = fused_nodes(r, "moe_route")  # type: ignore[arg-type]
    return node


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("name", ROUTERS)
def test_router_becomes_moe_route_feeding_moe(name: str, dtype: torch.dtype) -> None:
    router, args, note = ROUTERS[name]
    r = check(Routed(router).to(dtype), x(dtype=dtype), expect={"moe": 1, "moe_route": 1})
    route = route_node(r)
    assert route.args[0].target is torch.ops.aten.linear.default and route.args[2:] == args
    assert (route.args[1] is not None) == ("biased" in note)
    (moe,) = fused_nodes(r, "moe")
    weights = moe.args[2]
    if weights.target is torch.ops.prims.convert_element_type.default:  # rounded as the router rounds them
        assert weights.args[1] == dtype and name in ("biased_sigmoid", "biased_softmax")
        weights = weights.args[0]
    assert moe.args[1] is None and weights.args == (route, 0) and moe.args[3].args == (route, 1)
    assert r.counts()["aten.topk"] == 0 and not r.report.near_misses
    assert [s.note.split(", silu")[0] for s in sites(r, "moe")] == [f"fxr.moe_route({note}), top_k=2, renormalize=False"]


@DYNAMIC
def test_grouped_router_in_every_dynamic_mode(dynamic: bool | str) -> None:
    """Lifted, the routed scaling is a float the graph reads: the op takes that node."""
    r = check(Routed(grouped_sigmoid), x(7), expect={"moe": 1, "moe_route": 1}, dynamic=dynamic)
    args = route_node(r).args[2:]
    if dynamic == "lifted":
        assert isinstance(args[-1], torch.fx.Node) and args[:-1] == ROUTERS["grouped_sigmoid"][1][:-1]
    else:
        assert args == ROUTERS["grouped_sigmoid"][1]
    assert not r.report.near_misses


SCORINGS_0 = "the router holds 0 softmax, sigmoid or sqrt-softplus scorings, fxr.moe_route one"
NEGATIVE = {  # router, the router's near miss
    "grouped_biased_weights": (grouped_biased_weights, "the router's weights are not fxr.moe_route(sigmoid, top_k=2, "
                                                       "biased, renormalize=True)'s: max abs error"),
    "large_eps": (large_eps, "the router's weights are not fxr.moe_route(sigmoid, top_k=2, biased, renormalize=True)'s"),
    "softplus_scores": (softplus_scores, SCORINGS_0),
    "sqrt_softplus_beta2": (sqrt_softplus_beta2, SCORINGS_0),
}  # fmt: skip


@pytest.mark.parametrize("name", NEGATIVE)
def test_a_router_the_op_does_not_compute_stays_with_a_near_miss(name: str) -> None:
    """Negative twins: the router stays as written (its top-k too) and says why; the experts
    still fuse, reading its weights and ids."""
    router, reason = NEGATIVE[name]
    r = check(Routed(router), x(), expect={"moe": 1})
    (miss,) = misses(r, "moe_route")
    assert miss.reason.startswith(reason), miss.reason
    assert r.counts()["aten.topk"] == 1 and fused_nodes(r, "moe")[0].args[1] is None


def test_ties_choose_the_experts_the_code_chooses() -> None:
    """Equal logits everywhere (a zero router): the reference runs the router's own ops, so on
    CPU the compiled model picks the experts eager picks (another choice of equal scores would
    move outputs by their size, not by a float32 rounding: the experts' GEMMs may sum in another
    order, as on an AMD EPYC CPU)."""
    model = Routed(grouped_sigmoid)
    with torch.no_grad():
        model.router.zero_()
        model.bias.zero_()
    check(model, x(), expect={"moe": 1, "moe_route": 1})


class Dense(torch.nn.Module):
    """Llama 4: top-1 of the logits scattered into -inf, a sigmoid of that (zero but at the
    chosen expert), every expert run on every token's input scaled by its score, weights stored
    [E, H, 2I] / [E, I, H] (bmm, no gather)."""

    def __init__(self, score: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid, hidden: int = 32,
                 width: int = 16, count: int = 8) -> None:  # fmt: skip
        super().__init__()
        self.router = torch.nn.Parameter(torch.randn(count, hidden) * 0.5)
        self.gate_up = torch.nn.Parameter(torch.randn(count, hidden, 2 * width) * hidden**-0.5)
        self.down = torch.nn.Parameter(torch.randn(count, width, hidden) * width**-0.5)
        self.score = score

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.router)
        top, ids = torch.topk(logits, 1, dim=1)
        scores = self.score(torch.full_like(logits, float("-inf")).scatter_(1, ids, top).float()).to(h.dtype)
        routed = h.repeat(scores.shape[1], 1) * scores.transpose(0, 1).reshape(-1, 1)
        gate_up = torch.bmm(routed.view(self.gate_up.shape[0], -1, h.shape[-1]), self.gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.bmm(up * F.silu(gate), self.down).view(-1, h.shape[-1])
        return out.view(scores.shape[1], -1, h.shape[-1]).sum(dim=0)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_dense_scores_and_the_weight_on_the_input(dtype: torch.dtype) -> None:
    r = check(Dense().to(dtype), x(dtype=dtype), expect={"moe": 1, "moe_route": 1})
    assert route_node(r).args[2:] == (1, "sigmoid", "logits", 1, 1, 2, False, 1.0)
    (moe,) = fused_nodes(r, "moe")
    assert moe.args[9] is True and moe.args[4].target is torch.ops.aten.transpose.int
    assert [s.note for s in sites(r, "moe")] == [
        "fxr.moe_route(sigmoid, top_k=1, chosen on the logits, renormalize=False, dense weights), top_k=1, "
        "renormalize=False, silu, transposed weights, weight on the input"]  # fmt: skip
    assert r.counts()["aten.topk"] == 0 and not r.report.near_misses


def test_dense_scores_of_another_function_are_a_near_miss() -> None:
    """Negative twin: an exponential of the scattered values (not a sigmoid: exp(-inf) is 0 too,
    but the op does not compute it): the experts' SiLU-and-mul still fuses."""
    r = check(Dense(score=torch.exp), x(), expect={"silu_and_mul": 1})
    assert [m.reason for m in misses(r, "moe_route")] == [SCORINGS_0]
    assert r.counts()["aten.topk"] == 1


class ExtraClass(MoE):
    """A router over E + 1 classes whose last one means "no expert" (masked away before the
    experts): the router fuses alone; the experts, reading ids that may be out of their range
    as the op would get them, do not."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(h, self.router9), dim=-1)
        ids = torch.topk(probs, self.top_k, dim=-1)[1]
        weights = probs.gather(1, ids)
        skip = ids == 8
        return batched(self, h, weights.masked_fill(skip, 0), ids.masked_fill(skip, 0))


def test_a_router_among_more_classes_than_experts_fuses_alone() -> None:
    model = ExtraClass()
    model.router9 = torch.nn.Parameter(torch.randn(9, 32) * 0.5)
    r = check(model, x(), expect={"moe_route": 1, "silu_and_mul": 1})
    assert route_node(r).args[2:4] == (2, "softmax")
    (miss,) = misses(r, "moe")
    assert miss.reason == "the router chooses among 9 experts, the experts hold 8 (an id may be out of their range)"
    assert [s.note for s in sites(r, "moe_route")] == ["softmax, top_k=2, renormalize=False"]


def test_router_scores_read_outside_it_are_a_near_miss() -> None:
    """The scores also returned: the router cannot go (its top-k stays); the experts fuse."""

    class Returns(Routed):
        def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            scores = torch.sigmoid(F.linear(h, self.router))
            ids = torch.topk(scores + self.bias, 2, dim=-1)[1]
            weights = scores.gather(1, ids)
            return batched(self, h, weights / weights.sum(dim=-1, keepdim=True), ids), scores

    r = check(Returns(biased_sigmoid), x(), expect={"moe": 1})
    (miss,) = misses(r, "moe_route")
    assert miss.reason.startswith("the router's `scores` is read outside it by `output`"), miss.reason
