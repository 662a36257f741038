"""``fxr::moe``: a mixture-of-experts block in one op: routing, the experts' gated MLPs, and the
routing-weighted sum over each token's experts.

    y = torch.ops.fxr.moe(x, router_logits, None, None, w_gate_up, w_down, top_k, renormalize, "silu")
    y = torch.ops.fxr.moe(x, None, topk_weights, topk_ids, w_gate_up, w_down, top_k, renormalize, "silu")

x [..., H] (T tokens); routing either from ``router_logits`` [..., E] (softmax in float32 over
the experts, the ``top_k`` largest) or given as ``topk_weights`` / ``topk_ids`` [..., top_k];
``renormalize`` divides each token's weights by their sum (top-k then softmax is softmax then
top-k renormalized: the same weights); ``weight_input``: the weight scales each expert's input
(Llama 4) instead of its output. gpt-oss's experts: ``b_gate_up`` / ``b_down`` biases per
expert, gate and up ``interleaved`` (alternate rows), and the ``clamped_swiglu`` activation
(``alpha``, ``limit``). The experts are the stacked tensors a transformers
experts module holds, used in place: ``w_gate_up`` [E, 2I, H] (gate rows, then up rows) and
``w_down`` [E, H, I]. ``activation``: "silu", "gelu" or "gelu_tanh", applied to the gate half.

    # before (HF Mixtral / Qwen2-MoE / OLMoE, grouped_mm or batched_mm experts)
    probs = softmax(router_logits.float(), -1); w, ids = topk(probs, k); w /= w.sum(-1, keepdim=True)
    ... sort / gather / grouped_mm(gate_up) / silu * up / grouped_mm(down) / * w / scatter / sum ...
    # after
    y = torch.ops.fxr.moe(x, router_logits, None, None, gate_up_proj, down_proj, k, True, "silu")

The reference (the spec, and the CPU impl) rounds where the unfused code rounds: each expert's
gate/up GEMM output, the activation and its product, the down GEMM output in the input dtype;
the weighted sum over a token's experts in float32, rounded once. It runs every expert on every
token and keeps what was routed: no data-dependent shapes, so it also serves inside a CUDA graph
capture where no kernel can (slow, never wrong). On CUDA, bf16/fp16, the ``triton``
provider (:mod:`fxrewrite.runtime.triton_moe`) runs it in five launches: routing, alignment by
expert, the gate/up GEMM with the activation, the down GEMM with the routing weights, the sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.providers import Kernel, OpDef

ACTIVATIONS: tuple[str, ...] = ("silu", "gelu", "gelu_tanh", "clamped_swiglu")
TRITON_MOE = "fxrewrite.runtime.triton_moe"
"""The ``triton`` provider's MoE kernels (imports Triton at the top)."""
MAX_EXPERTS = 1024
"""Most experts the Triton kernels take (one token's scores are held in one program)."""


def check_args(
    x: Tensor, router_logits: Tensor | None, topk_weights: Tensor | None, topk_ids: Tensor | None,
    w_gate_up: Tensor, w_down: Tensor, top_k: int, activation: str, b_gate_up: Tensor | None = None,
    b_down: Tensor | None = None,
) -> tuple[int, int]:  # fmt: skip
    """(experts E, expert width I); ValueError naming what does not fit."""
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"moe: expert weights must be 3-D, got w_gate_up {tuple(w_gate_up.shape)}, "
                         f"w_down {tuple(w_down.shape)}")  # fmt: skip
    e, i2, h = w_gate_up.shape
    if i2 % 2 or x.shape[-1] != h or tuple(w_down.shape) != (e, h, i2 // 2):
        raise ValueError(f"moe: w_gate_up {tuple(w_gate_up.shape)} must be [E, 2I, H] and w_down "
                         f"{tuple(w_down.shape)} [E, H, I] with H = x.shape[-1] = {x.shape[-1]}")  # fmt: skip
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"moe: expert weights are {w_gate_up.dtype} / {w_down.dtype}, x is {x.dtype}")
    for name, b, want in (("b_gate_up", b_gate_up, (e, i2)), ("b_down", b_down, (e, h))):
        if b is not None and (tuple(b.shape) != want or b.dtype != x.dtype):
            raise ValueError(f"moe: {name} {b.dtype}{list(b.shape)} must be {x.dtype}{list(want)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe: activation {activation!r} is not one of {ACTIVATIONS}")
    if not 1 <= top_k <= e:
        raise ValueError(f"moe: top_k {top_k} outside 1..{e} (the number of experts)")
    if (router_logits is None) == (topk_weights is None and topk_ids is None):
        raise ValueError("moe: give router_logits, or topk_weights and topk_ids, not both")
    if router_logits is not None:
        if tuple(router_logits.shape) != (*x.shape[:-1], e):
            raise ValueError(f"moe: router_logits {tuple(router_logits.shape)} must be {(*x.shape[:-1], e)}")
    elif topk_weights is None or topk_ids is None:
        raise ValueError("moe: topk_weights and topk_ids go together")
    else:
        want = (*x.shape[:-1], top_k)
        if tuple(topk_weights.shape) != want or tuple(topk_ids.shape) != want:
            raise ValueError(f"moe: topk_weights {tuple(topk_weights.shape)} and topk_ids "
                             f"{tuple(topk_ids.shape)} must be {want}")  # fmt: skip
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
            raise ValueError(f"moe: topk_ids must be integers, got {topk_ids.dtype}")
    return e, i2 // 2


def route(router_logits: Tensor | None, topk_weights: Tensor | None, topk_ids: Tensor | None, top_k: int,
          renormalize: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Each token's experts and weights, [T, top_k] float32 and int64: softmax of the logits in
    float32, the ``top_k`` largest (or the given ones), divided by their sum if ``renormalize``."""
    if router_logits is not None:
        probs = torch.softmax(router_logits.reshape(-1, router_logits.shape[-1]).float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
    else:
        weights, ids = topk_weights.reshape(-1, top_k).float(), topk_ids.reshape(-1, top_k).long()  # type: ignore[union-attr]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def act_and_mul(gate_up: Tensor, activation: str, interleaved: bool = False, alpha: float = 1.702,
                limit: float = 7.0) -> Tensor:  # fmt: skip
    """``act(gate) * up`` of ``gate_up`` [..., 2I] (gate half first; ``interleaved``: gate, up,
    gate, up ...), in its dtype. ``clamped_swiglu``: the gate clamped from above and the up from
    both sides at ``limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    i = gate_up.shape[-1] // 2
    gate, up = (gate_up[..., 0::2], gate_up[..., 1::2]) if interleaved else (gate_up[..., :i], gate_up[..., i:])
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "clamped_swiglu":
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


def moe_reference(
    x: Tensor, router_logits: Tensor | None, topk_weights: Tensor | None, topk_ids: Tensor | None,
    w_gate_up: Tensor, w_down: Tensor, top_k: int, renormalize: bool, activation: str = "silu",
    weight_input: bool = False, b_gate_up: Tensor | None = None, b_down: Tensor | None = None,
    interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0,
) -> Tensor:  # fmt: skip
    """``y[t] = sum_j w[t, j] * down_e(act_and_mul(gate_up_e(x[t])))`` with ``e = ids[t, j]``
    (:func:`route`), summed in float32 and rounded once; see the module docstring. With
    ``weight_input`` the weight scales the expert's input instead (rounded to x's dtype):
    ``y[t] = sum_j down_e(act_and_mul(gate_up_e(w[t, j] * x[t])))``. Biases ``b_gate_up`` [E, 2I]
    and ``b_down`` [E, H] are added to each GEMM's output (rounded, then added: as code that adds
    them after the GEMM rounds)."""
    check_args(x, router_logits, topk_weights, topk_ids, w_gate_up, w_down, top_k, activation, b_gate_up, b_down)
    rows = x.reshape(-1, x.shape[-1])
    weights, ids = route(router_logits, topk_weights, topk_ids, top_k, renormalize)
    out = torch.zeros(rows.shape, dtype=torch.float32, device=x.device)
    for e in range(w_gate_up.shape[0]):
        routed = ids == e
        share = (weights * routed).sum(dim=-1, keepdim=True)  # [T, 1]: this expert's weight per token
        inputs = (rows.float() * share).to(rows.dtype) if weight_input else rows
        gate_up = F.linear(inputs, w_gate_up[e])
        h = act_and_mul(gate_up if b_gate_up is None else gate_up + b_gate_up[e], activation, interleaved, alpha, limit)
        down = F.linear(h, w_down[e])
        down = (down if b_down is None else down + b_down[e]).float()
        out += torch.where(routed.any(dim=-1, keepdim=True), down if weight_input else share * down, 0.0)
    return out.to(x.dtype).view(x.shape)


def _moe_fake(
    x: Tensor, router_logits: Tensor | None, topk_weights: Tensor | None, topk_ids: Tensor | None,
    w_gate_up: Tensor, w_down: Tensor, top_k: int, renormalize: bool, activation: str = "silu",
    weight_input: bool = False, b_gate_up: Tensor | None = None, b_down: Tensor | None = None,
    interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0,
) -> Tensor:  # fmt: skip
    check_args(x, router_logits, topk_weights, topk_ids, w_gate_up, w_down, top_k, activation, b_gate_up, b_down)
    return x.new_empty(x.shape)


def triton_check(
    x: Tensor, router_logits: Tensor | None, topk_weights: Tensor | None, topk_ids: Tensor | None,
    w_gate_up: Tensor, w_down: Tensor, top_k: int, renormalize: bool, activation: str = "silu",
    weight_input: bool = False, b_gate_up: Tensor | None = None, b_down: Tensor | None = None,
    interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0,
) -> str | None:  # fmt: skip
    """The Triton kernels: bf16/fp16 input and weights, weights with unit stride along one of
    their last two dims (as stored, or a transposed view), at most ``MAX_EXPERTS`` experts, every
    tensor on the input's device."""
    reason = constraints.check_half(x, w_gate_up, w_down)
    if reason:
        return reason
    if any(w.stride(-1) != 1 and w.stride(-2) != 1 for w in (w_gate_up, w_down)):
        return "expert weights without unit stride along their last two dims"
    if w_gate_up.shape[0] > MAX_EXPERTS:
        return f"{w_gate_up.shape[0]} experts, more than {MAX_EXPERTS}"
    others = [t for t in (router_logits, topk_weights, topk_ids, b_gate_up, b_down) if t is not None]
    return constraints.check_same_device(x, w_gate_up, w_down, *others)


def _triton(*args: object) -> Tensor:
    return providers.library(TRITON_MOE).moe(*args)  # type: ignore[union-attr]


KERNELS = (Kernel("triton", _triton, triton_check, (8, 0), module=TRITON_MOE),)

DEFS: tuple[OpDef, ...] = (OpDef("moe", moe_reference, _moe_fake, KERNELS),)
OPS: tuple[str, ...] = providers.define_all(DEFS)

__all__ = ["ACTIVATIONS", "DEFS", "OPS", "act_and_mul", "check_args", "moe_reference", "route", "triton_check"]
