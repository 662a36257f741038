"""An MoE model compiled in bf16 and checked against its float32 self, leaving out the tokens a
routing near-tie reaches: the end-to-end check of test_moe_families.py and
test_moe_router_families.py (CPU, and CUDA with the Triton kernels), imported as ``helpers.moe``.

A bf16 model's router may pick another expert than the float32 model's wherever two logits are
closer than the rounding moves them, and so may the compiled model's (its kernels round in
another order): such a token jumps (bf16 gpt-oss at hidden 64: up to 0.7 of the largest value),
a difference that a largest-error check cannot tell from a bug. Both bf16 errors are measured on
the other tokens (:func:`fxrewrite.testing.routing_near_ties`) against the float32 model; the
tests hold the compiled one to the eager one's (``err <= max(2 * err_eager, 2e-2)``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from fxrewrite import models
from fxrewrite.testing import routing_near_ties

BF16 = torch.bfloat16


@dataclasses.dataclass
class Run:
    """What :func:`run_bf16` saw: the backend (its report), what served each fused op
    (``providers.served()``), the compiled and eager bf16 errors relative to the float32 model's
    largest value over the tokens kept, the tokens kept and left out."""

    backend: Any
    served: dict[str, dict[str, Any]]
    err: float
    err_eager: float
    kept: int
    left_out: int


def run_bf16(ref32: torch.nn.Module, mode: str, token_counts: tuple[int, ...] = (8, 5, 1, 8)) -> Run:
    """``ref32`` (float32, on its device) copied to bf16, compiled in ``mode`` (capture sizes 1,
    2, 4, 8) and called on one sequence of each of ``token_counts`` tokens (5: padded to a
    captured 8; 1: a graph of its own, Dynamo specializes a dimension of 1; the second 8 replays),
    its outputs and eager bf16's compared with ``ref32``'s on the tokens that neither have a
    routing near-tie nor follow one in their sequence."""
    import fxrewrite
    from fxrewrite.runtime import providers

    torch._dynamo.reset()
    providers.reset_counts()
    device = next(ref32.parameters()).device
    vocab = ref32.get_input_embeddings().weight.shape[0]
    eager16 = copy.deepcopy(ref32).to(BF16)
    backend = fxrewrite.Backend(mode=mode, capture_sizes=(1, 2, 4, 8), max_capture_size=8)
    compiled = backend.compile(copy.deepcopy(eager16))  # merge_siblings re-lays its copy's weights
    err = err_eager = 0.0
    kept = left_out = 0
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for tokens in token_counts:
            ids = torch.randint(0, vocab, (1, tokens), device=device, generator=gen)
            near = routing_near_ties(ref32, eager16, ids, causal=(1, tokens))
            keep = torch.ones(tokens, dtype=torch.bool, device=device) if near is None else ~near.reshape(-1)
            kept, left_out = kept + int(keep.sum()), left_out + int((~keep).sum())
            ref = models.hidden_states(ref32(ids)).float().reshape(tokens, -1)
            scale = ref.abs().max()
            for model, name in ((compiled, "compiled"), (eager16, "eager")):
                diff = (models.hidden_states(model(ids)).float().reshape(tokens, -1) - ref)[keep]
                rel = (diff.abs().max() / scale).item() if keep.any() else 0.0
                err, err_eager = (max(err, rel), err_eager) if name == "compiled" else (err, max(err_eager, rel))
    return Run(backend, providers.served(), err, err_eager, kept, left_out)
