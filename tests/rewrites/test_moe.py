"""fuse_moe (rewrites/moe.py): MoE blocks written as model code become one ``fxr.moe``; the
near misses say why a block did not. HF's own blocks (Mixtral, Qwen2-MoE, OLMoE in every experts
implementation that compiles) are in test_moe_families.py.

The blocks here spell transformers' ``batched_mm`` experts with a router of each kind; each
positive test has a negative twin that changes one thing the op cannot stand for.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, DYNAMIC, F32, check, fused_nodes, misses, sites

Experts = Callable[["MoE", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def batched(m: MoE, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """transformers' batched_mm experts: each (token, slot) pair gathers its expert's weights."""
    k, flat = ids.shape[-1], ids.reshape(-1)
    gate_up = torch.bmm(m.gate_up[flat], x.repeat_interleave(k, dim=0).unsqueeze(-1)).squeeze(-1)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.bmm(m.down[flat], m.act(gate).mul(up).unsqueeze(-1)).squeeze(-1)
    return (out * w.reshape(-1, 1)).view(-1, k, out.shape[-1]).sum(dim=1).to(x.dtype)


class MoE(torch.nn.Module):
    """A router (``scoring``: "softmax" then top-k, "topk_softmax", or "sigmoid") and stacked
    experts [E, 2I, H] / [E, H, I] run by ``experts``."""

    def __init__(self, experts: Experts = batched, scoring: str = "softmax", renormalize: bool = True,
                 inplace: bool = False, act: Callable[[torch.Tensor], torch.Tensor] = F.silu, count: int = 8,
                 top_k: int = 2, hidden: int = 32, width: int = 16) -> None:  # fmt: skip
        super().__init__()
        self.router = torch.nn.Parameter(torch.randn(count, hidden) * 0.5)
        self.gate_up = torch.nn.Parameter(torch.randn(count, 2 * width, hidden) * hidden**-0.5)
        self.down = torch.nn.Parameter(torch.randn(count, hidden, width) * width**-0.5)
        self.experts, self.scoring, self.renormalize, self.inplace = experts, scoring, renormalize, inplace
        self.act, self.top_k = act, top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.router)
        if self.scoring == "topk_softmax":
            values, ids = torch.topk(logits, self.top_k, dim=-1)
            return F.softmax(values, dim=-1, dtype=torch.float32), ids
        scores = torch.sigmoid(logits) if self.scoring == "sigmoid" else F.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        if self.renormalize and self.inplace:
            weights /= weights.sum(dim=-1, keepdim=True)
        elif self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(self, x, *self.route(x))


def x(tokens: int = 6, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(tokens, 32).to(dtype)


def fused_args(r: object) -> tuple[object, ...]:
    (node,) = fused_nodes(r, "moe")  # type: ignore[arg-type]
    return node.args


# --------------------------------------------------------------------------- routers


@DYNAMIC
@pytest.mark.parametrize("inplace", [False, True], ids=["div", "inplace-div"])
def test_softmax_top_k_renormalized_takes_the_logits(dynamic: bool | str, inplace: bool) -> None:
    r = check(MoE(inplace=inplace), x(), expect={"moe": 1}, dynamic=dynamic)
    logits, weights, ids, gate_up, down, top_k, renormalize, act = fused_args(r)[1:9]
    assert logits.target is torch.ops.aten.linear.default and weights is ids is None
    assert (gate_up.name, down.name) == ("l_self_parameters_gate_up_", "l_self_parameters_down_")
    assert (top_k, renormalize, act) == (2, True, "silu")
    assert [s.note for s in sites(r, "moe")] == ["logits, top_k=2, renormalize=True, silu"]
    assert not r.report.near_misses
    assert r.counts()["aten.topk"] == r.counts()["aten.softmax"] == 0


def test_softmax_top_k_as_the_softmax_gives_them() -> None:
    r = check(MoE(renormalize=False), x(), expect={"moe": 1})
    assert fused_args(r)[7] is False


def test_top_k_then_softmax_is_the_renormalized_form() -> None:
    r = check(MoE(scoring="topk_softmax", top_k=3), x(), expect={"moe": 1})
    assert fused_args(r)[6:8] == (3, True)


def test_sigmoid_scoring_routes_through_moe_route() -> None:
    """A router fxr.moe cannot compute itself (sigmoid, top-k, renormalized) becomes
    fxr.moe_route; fxr.moe reads its weights and ids."""
    r = check(MoE(scoring="sigmoid"), x(), expect={"moe": 1, "moe_route": 1})
    logits, weights, ids = fused_args(r)[1:4]
    (route,) = fused_nodes(r, "moe_route")
    assert logits is None and weights.args == (route, 0) and ids.args == (route, 1)
    assert route.args[0].target is torch.ops.aten.linear.default and route.args[2:] == (
        2, "sigmoid", "scores", 1, 1, 2, True, 1.0)  # fmt: skip
    assert fused_args(r)[7] is False  # renormalized already, by the router
    assert r.counts()["aten.topk"] == r.counts()["aten.sigmoid"] == 0 and not r.report.near_misses


def test_routing_read_outside_the_block_hands_over_weights_and_ids() -> None:
    """Negative twin of taking the logits: the ids are also returned, so fxr.moe takes given
    weights and ids; the router alone becomes fxr.moe_route, whose ids are returned."""

    class Returns(MoE):
        def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            w, ids = self.route(t)
            return batched(self, t, w, ids), ids

    r = check(Returns(), x(), expect={"moe": 1, "moe_route": 1})
    logits, weights, ids = fused_args(r)[1:4]
    (route,) = fused_nodes(r, "moe_route")
    assert logits is None and weights.args == (route, 0) and ids.args == (route, 1)
    assert r.counts()["aten.topk"] == 0 and not r.report.near_misses
    assert [s.note for s in sites(r, "moe_route")] == ["softmax, top_k=2, renormalize=True"]


# --------------------------------------------------------------------------- experts


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gelu_tanh_experts(dtype: torch.dtype) -> None:
    r = check(MoE(act=lambda v: F.gelu(v, approximate="tanh")).to(dtype), x(dtype=dtype), expect={"moe": 1})
    assert fused_args(r)[8] == "gelu_tanh"


def test_single_token_and_top_1() -> None:
    r = check(MoE(top_k=1), x(1), expect={"moe": 1}, dynamic=False)
    assert fused_args(r)[6] == 1 and not r.report.near_misses


def slot_merged(m: MoE, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Top-1 with the one slot dropped by a reshape ``[T, 1, H] -> [T, H]`` instead of a sum:
    the reshape merges the last dims, canonically ``aten.flatten``."""
    k, flat = ids.shape[-1], ids.reshape(-1)
    gate_up = torch.bmm(m.gate_up[flat], x.repeat_interleave(k, dim=0).unsqueeze(-1)).squeeze(-1)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.bmm(m.down[flat], m.act(gate).mul(up).unsqueeze(-1)).squeeze(-1)
    return (out * w.reshape(-1, 1)).view(-1, k, out.shape[-1]).reshape(x.shape[0], -1)


def test_the_block_output_is_followed_through_every_reshape_spelling() -> None:
    """The block's output is followed through its views (the slot view, then the merge back,
    an ``aten.flatten``): they go with the block, nothing reads fxr.moe's output through them."""
    r = check(MoE(experts=slot_merged, top_k=1), x(), expect={"moe": 1})
    assert r.counts()["aten.flatten"] == r.counts()["aten.reshape"] == 0 and not r.report.near_misses


def swapped(m: MoE, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The activation on the up half: not the op's gate-first layout."""
    k, flat = ids.shape[-1], ids.reshape(-1)
    gate_up = torch.bmm(m.gate_up[flat], x.repeat_interleave(k, dim=0).unsqueeze(-1)).squeeze(-1)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.bmm(m.down[flat], (gate * m.act(up)).unsqueeze(-1)).squeeze(-1)
    return (out * w.reshape(-1, 1)).view(-1, k, out.shape[-1]).sum(dim=1)


def weighted_twice(m: MoE, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return batched(m, x, w * w, ids)


@pytest.mark.parametrize(("experts", "expect"), [(swapped, {"act_mul": 1}), (weighted_twice, {"silu_and_mul": 1})])
def test_a_block_that_computes_something_else_is_a_near_miss(experts: Experts, expect: dict[str, int]) -> None:
    """Negative twins of the proof: the structure binds, the numbers refuse (the router still
    becomes fxr.moe_route, and the experts' SiLU-and-mul fuses: of one row where it has the gate
    first, of the two halves as act_mul where the activation is on the up half)."""
    expect = {**expect, "moe_route": 1}
    r = check(MoE(experts=experts), x(), expect=expect)
    (miss,) = misses(r, "moe")
    assert miss.reason.startswith("the block does not compute fxr.moe(logits, top_k=2, renormalize=True, silu): "
                                  "max abs error")  # fmt: skip


def with_bias(m: MoE, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A bias per expert on the activation's output ([E, I]): not one the op adds (its biases
    are on the GEMMs' outputs, ``ClampedSwiGLU`` below)."""
    k, flat = ids.shape[-1], ids.reshape(-1)
    gate_up = torch.bmm(m.gate_up[flat], x.repeat_interleave(k, dim=0).unsqueeze(-1)).squeeze(-1)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.bmm(m.down[flat], (m.act(gate) * up + m.bias[flat]).unsqueeze(-1)).squeeze(-1)
    return (out * w.reshape(-1, 1)).view(-1, k, out.shape[-1]).sum(dim=1)


def transposed(m: MoE, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Weights stored [E, H, 2I] and [E, I, H] (gpt-oss's layout), multiplied from the left."""
    k, flat = ids.shape[-1], ids.reshape(-1)
    gate_up = torch.bmm(x.repeat_interleave(k, dim=0).unsqueeze(1), m.gate_up_t[flat]).squeeze(1)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.bmm((m.act(gate) * up).unsqueeze(1), m.down_t[flat]).squeeze(1)
    return (out * w.reshape(-1, 1)).view(-1, k, out.shape[-1]).sum(dim=1)


def mixed_layout(m: MoE, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """gate_up as stored [E, 2I, H], down stored transposed [E, I, H]: neither layout."""
    k, flat = ids.shape[-1], ids.reshape(-1)
    gate_up = torch.bmm(m.gate_up[flat], x.repeat_interleave(k, dim=0).unsqueeze(-1)).squeeze(-1)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.bmm((m.act(gate) * up).unsqueeze(1), m.down_t[flat]).squeeze(1)
    return (out * w.reshape(-1, 1)).view(-1, k, out.shape[-1]).sum(dim=1)


def two_activations(m: MoE, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    k, flat = ids.shape[-1], ids.reshape(-1)
    gate_up = torch.bmm(m.gate_up[flat], x.repeat_interleave(k, dim=0).unsqueeze(-1)).squeeze(-1)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.bmm(m.down[flat], (m.act(gate) * m.act(up)).unsqueeze(-1)).squeeze(-1)
    return (out * w.reshape(-1, 1)).view(-1, k, out.shape[-1]).sum(dim=1)


def overwrites_x(m: MoE, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Scales its input by the routing in place (an in-place op the routing does not reach,
    ``x.mul_(2.0)`` before the experts, stays outside the block and fuses)."""
    return batched(m, x.mul_(w.sum(dim=-1, keepdim=True).to(x.dtype)), w, ids)


MISSES = {  # experts, reason, what fuses still (the experts' SiLU-and-mul, where they have one)
    "bias": (with_bias, r"the experts also read `\w+bias\w*`, not hidden states, routing or expert weights"),
    # with H = 2I the shapes also read as transposed storage: the proof refuses that reading
    "mixed_layout": (mixed_layout, r"the block does not compute fxr.moe\(logits, top_k=2, renormalize=True, silu, "
                                   r"transposed weights\): max abs error .*"),
    "two_activations": (two_activations, r"the experts hold 2 activations \(SiLU or GELU\) and no clamped SwiGLU, fxr.moe one"),
    "overwrites_x": (overwrites_x, r"`mul_` overwrites the block's input `l_x_` in place"),
}


@pytest.mark.parametrize("name", MISSES)
def test_guards_name_what_the_op_cannot_stand_for(name: str) -> None:
    experts, reason = MISSES[name]
    model = MoE(experts=experts)
    model.bias = torch.nn.Parameter(torch.randn(8, 16))
    model.gate_up_t = torch.nn.Parameter(model.gate_up.detach().transpose(1, 2).contiguous())
    model.down_t = torch.nn.Parameter(model.down.detach().transpose(1, 2).contiguous())
    # two activations: act(gate) * act(up) is act_mul of gate and act(up)
    r = check(model, x(), expect={"act_mul" if name == "two_activations" else "silu_and_mul": 1, "moe_route": 1})
    reasons = {m.reason for m in misses(r, "moe")}
    assert len(reasons) == 1 and re.fullmatch(reason, reasons.pop()), reasons


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_weights_stored_transposed_are_read_through_views(dtype: torch.dtype) -> None:
    """[E, H, 2I] and [E, I, H] (gpt-oss's and Llama 4's layout, grouped_mm's ``is_transposed``):
    the op reads transposed views of the parameters, no copy. Its negative twin, one weight of
    each layout, is ``mixed_layout`` above."""
    model = MoE(experts=transposed)
    model.gate_up_t = torch.nn.Parameter(model.gate_up.detach().transpose(1, 2).contiguous())
    model.down_t = torch.nn.Parameter(model.down.detach().transpose(1, 2).contiguous())
    r = check(model.to(dtype), x(dtype=dtype), expect={"moe": 1})
    gate_up, down = fused_args(r)[4:6]
    assert gate_up.target is down.target is torch.ops.aten.transpose.int and gate_up.args[1:] == (1, 2)
    assert (gate_up.args[0].name, down.args[0].name) == ("l_self_parameters_gate_up_t_", "l_self_parameters_down_t_")
    assert [s.note for s in sites(r, "moe")] == ["logits, top_k=2, renormalize=True, silu, transposed weights"]


def test_a_value_of_the_block_read_outside_it_is_a_near_miss() -> None:
    class Leaky(MoE):
        def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            w, ids = self.route(t)
            flat = ids.reshape(-1)
            gate_up = torch.bmm(self.gate_up[flat], t.repeat_interleave(2, dim=0).unsqueeze(-1)).squeeze(-1)
            gate, up = gate_up.chunk(2, dim=-1)
            out = torch.bmm(self.down[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
            return (out * w.reshape(-1, 1)).view(-1, 2, out.shape[-1]).sum(dim=1), gate_up  # returned: cannot go

    r = check(Leaky(), x(), expect={"silu_and_mul": 1, "moe_route": 1})
    (miss,) = misses(r, "moe")
    assert miss.reason == "`gate_up` is read outside the MoE block by `output`"


def test_a_top_k_that_routes_no_experts_is_left_alone() -> None:
    """Negative twin of the anchor: top-k over scores that feed no experts is no block and no
    near miss."""
    r = check(lambda t: torch.topk(torch.softmax(t, dim=-1), 2, dim=-1)[0].sum(dim=-1), x(), expect={})
    assert r.counts()["aten.topk"] == 1 and not r.report.near_misses


def test_two_blocks_in_a_row_fuse_apart() -> None:
    first, second = MoE(), MoE(scoring="topk_softmax")
    r = check(lambda t: second(first(t) + t), x(), expect={"moe": 2})
    assert [s.note.split(",")[0] for s in sites(r, "moe")] == ["logits", "logits"]


class ClampedSwiGLU(torch.nn.Module):
    """gpt-oss: a router with a bias, top-k of the logits then softmax; experts stored
    [E, H, 2I] / [E, I, H], gate and up interleaved, a bias per expert on each GEMM, the
    clamped SwiGLU (``up_clamp``: the up half's clamp, one-sided in the negative twin)."""

    def __init__(self, up_clamp: tuple[float | None, float] = (-7.0, 7.0), count: int = 8, hidden: int = 32,
                 width: int = 16) -> None:  # fmt: skip
        super().__init__()
        self.router = torch.nn.Linear(hidden, count)
        self.gate_up = torch.nn.Parameter(torch.randn(count, hidden, 2 * width) * hidden**-0.5)
        self.gate_up_bias = torch.nn.Parameter(torch.randn(count, 2 * width))
        self.down = torch.nn.Parameter(torch.randn(count, width, hidden) * width**-0.5)
        self.down_bias = torch.nn.Parameter(torch.randn(count, hidden))
        self.up_clamp = up_clamp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(h), 2, dim=-1)
        w = torch.softmax(top, dim=1, dtype=top.dtype)
        flat = ids.reshape(-1)
        gate_up = torch.bmm(h.repeat_interleave(2, dim=0).unsqueeze(1), self.gate_up[flat]).squeeze(1)
        gate_up = gate_up + self.gate_up_bias[flat]
        gate, up = gate_up[..., ::2].clamp(min=None, max=7.0), gate_up[..., 1::2].clamp(*self.up_clamp)
        act = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
        out = torch.bmm(act.unsqueeze(1), self.down[flat]).squeeze(1) + self.down_bias[flat]
        return (out * w.reshape(-1, 1)).view(-1, 2, out.shape[-1]).sum(dim=1)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_clamped_swiglu_experts_with_biases_interleaved(dtype: torch.dtype) -> None:
    r = check(ClampedSwiGLU().to(dtype), x(dtype=dtype) * 4, expect={"moe": 1})
    args = fused_args(r)
    assert args[1].target is torch.ops.aten.linear.default  # the router's logits, its bias included
    assert args[8:] == ("clamped_swiglu", False, args[10], args[11], True, 1.702, 7.0)
    assert (args[10].name, args[11].name) == ("l_self_parameters_gate_up_bias_", "l_self_parameters_down_bias_")
    assert [s.note for s in sites(r, "moe")] == [
        "logits, top_k=2, renormalize=True, clamped_swiglu, transposed weights, biases, interleaved"]
    assert not r.report.near_misses


def test_a_swiglu_clamped_otherwise_is_a_near_miss() -> None:
    """Negative twin: the up half clamped from above only (the router alone still fuses)."""
    r = check(ClampedSwiGLU(up_clamp=(None, 7.0)), x() * 4, expect={"moe_route": 1})
    (miss,) = misses(r, "moe")
    assert miss.reason.startswith("the experts hold 0 activations (SiLU or GELU) and no clamped SwiGLU"), miss.reason
