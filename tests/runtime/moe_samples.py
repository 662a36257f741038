"""Sample arguments for ``fxr.moe`` and ``fxr.moe_route`` by parameter name, shared by the
generic op tests (``test_ops.py``, ``test_providers.py``) and the MoE tests: ``x`` of shape
``[..., H]``, ``EXPERTS`` experts of width ``WIDTH``, ``TOP_K`` per token, routed from logits;
the router a DeepSeek-V3-style one (sigmoid, a correction bias, 2 groups of which 1 is kept,
renormalized, scaled)."""

from __future__ import annotations

import torch

EXPERTS, WIDTH, TOP_K = 4, 16, 2
NAMES = ("router_logits", "topk_weights", "topk_ids", "w_gate_up", "w_down", "top_k", "renormalize", "activation",
         "weight_input", "b_gate_up", "b_down", "interleaved", "alpha", "limit", "correction_bias", "scoring", "select", "n_group", "topk_group", "group_top",
         "routed_scaling")
ROUTER = {"scoring": "sigmoid", "select": "scores", "n_group": 2, "topk_group": 1, "group_top": 2, "routed_scaling": 2.5}


def moe_arg(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> object:
    hidden = shape[-1]
    device = gen.device
    if name == "router_logits":
        return torch.randn((*shape[:-1], EXPERTS), generator=gen, device=device).to(dtype)
    if name in ("topk_weights", "topk_ids"):
        return None
    if name == "w_gate_up":
        return experts(EXPERTS, WIDTH, hidden, dtype, gen)[0]
    if name == "w_down":
        return experts(EXPERTS, WIDTH, hidden, dtype, gen)[1]
    if name == "correction_bias":
        return torch.randn(EXPERTS, generator=gen, device=device) * 0.1
    if name in ROUTER:
        return ROUTER[name]
    defaults = {"b_gate_up": None, "b_down": None, "interleaved": False, "alpha": 1.702, "limit": 7.0}
    if name in defaults:
        return defaults[name]
    return {"top_k": TOP_K, "renormalize": True, "activation": "silu", "weight_input": False}[name]


def experts(count: int, width: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights as transformers holds them: gate_up [E, 2I, H], down [E, H, I],
    scaled so that each GEMM keeps its input's magnitude."""
    d = gen.device
    gate_up = torch.randn((count, 2 * width, hidden), generator=gen, device=d) * hidden**-0.5
    down = torch.randn((count, hidden, width), generator=gen, device=d) * width**-0.5
    return gate_up.to(dtype), down.to(dtype)


def routing(tokens: int, top_k: int, gen: torch.Generator, used: int | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Given routing: per token ``top_k`` distinct experts among ``used`` (a count: experts
    0 .. used-1; or a list: only these, the others get no token), float32 weights in (0, 1]."""
    d = gen.device
    pool = torch.tensor(list(range(used)) if isinstance(used, int) else used, device=d)
    pick = torch.rand((tokens, len(pool)), generator=gen, device=d).argsort(dim=-1)[:, :top_k]
    weights = torch.rand((tokens, top_k), generator=gen, device=d) * 0.9 + 0.1
    return weights, pool[pick]
