"""fuse_moe on transformers' MoE families whose routers ``fxr.moe_route`` states: one family per
router kind (DeepSeek-V3 / GLM-4.5 groups, biased sigmoid, top-k of biased logits, biased
softmax, Llama 4's dense scores with the weight on the input and transposed weights, Aria's
transposed weights), and the families whose router fuses alone (an extra "no expert" class,
experts written as a loop over ``split``). Built as the coverage sweep builds them
(``bench/coverage.py``: the default config shrunk, random weights), called on 8 tokens; exact
counts of ``fxr.moe`` and ``fxr.moe_route``, no ``topk`` left, no near miss of either, outputs
against eager (largest error relative to the largest value, as test_moe_families.py)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from helpers.rewrites import BF16, F32, fused, fused_nodes, misses

from fxrewrite import models
from fxrewrite.testing import Compiled, compile_once

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import coverage  # noqa: E402  (bench/coverage.py: the sweep's builder)

# family -> (fxr.moe, fxr.moe_route) per model at the sweep's shape, the moe_route's scoring,
# select, n_group and renormalize, and the experts' near miss where they do not fuse
FAMILIES: dict[str, tuple[int, int, tuple[object, ...], str | None]] = {
    "glm4_moe": (1, 1, ("sigmoid", "scores", 1, True), None),
    "hy_v3": (1, 1, ("sigmoid", "scores", 1, True), None),
    "kolibri1": (2, 2, ("sigmoid", "logits", 1, False), None),  # norm_topk_prob off by default
    "ernie4_5_moe": (1, 1, ("softmax", "scores", 1, True), None),
    "llama4_text": (2, 2, ("sigmoid", "logits", 1, False), None),
    "aria_text": (2, 0, (), None),  # top-k of the logits then softmax: fxr.moe routes itself
    "zaya": (0, 2, ("softmax", "scores", 1, False), "the router chooses among 9 experts, the experts hold 8"),
}  # fmt: skip
CASES = [(f, F32) for f in FAMILIES] + [(f, BF16) for f in ("glm4_moe", "kolibri1", "llama4_text")]
TOLERANCE = {F32: 1e-5, BF16: 2e-2}


@functools.cache
def compiled(family: str, dtype: torch.dtype) -> Compiled:
    model, _ = coverage.build(family)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    return compile_once(model.to(dtype), ids)


@pytest.mark.parametrize(("family", "dtype"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_routers_fuse_with_their_experts(family: str, dtype: torch.dtype) -> None:
    r = compiled(family, dtype)
    moes, routes, route_args, experts_miss = FAMILIES[family]
    counts = fused(r.counts())
    assert (counts.get("moe", 0), counts.get("moe_route", 0)) == (moes, routes), counts
    assert r.counts().get("aten.topk", 0) == 0
    assert misses(r, "moe_route") == []
    assert [m.reason.split(" (")[0] for m in misses(r, "moe")] == [experts_miss] * (routes if experts_miss else 0)
    for node in fused_nodes(r, "moe_route"):
        assert (node.args[3], node.args[4], node.args[5], node.args[8]) == route_args
    out, eager = models.hidden_states(r.output).float(), models.hidden_states(r.eager).float()
    assert ((out - eager).abs().max() / eager.abs().max()).item() < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["none", "piecewise"])
@pytest.mark.parametrize("family", ["glm4_moe", "kolibri1", "llama4_text", "gpt_oss"])
def test_on_the_gpu_triton_serves_router_and_experts(family: str, mode: str) -> None:
    """bf16 on CUDA, eager and in piecewise CUDA graphs: fxr.moe_route and fxr.moe served by
    their Triton kernels (no fallback) at 8, 5 and 1 tokens, outputs as test_moe_families.py's."""
    import fxrewrite
    from fxrewrite.runtime import providers

    torch._dynamo.reset()
    providers.reset_counts()
    model, _ = coverage.build(family)
    model = model.to("cuda", BF16)
    backend = fxrewrite.Backend(mode=mode, capture_sizes=(1, 2, 4, 8), max_capture_size=8)
    compiled_model = backend.compile(model)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for tokens in (8, 5, 1):
            ids = torch.randint(0, 256, (1, tokens), device="cuda", generator=gen)
            out, eager = (models.hidden_states(m(ids)).float() for m in (compiled_model, model))
            assert ((out - eager).abs().max() / eager.abs().max()).item() < TOLERANCE[BF16]
    served = providers.served()
    for op in ("moe_route", "moe"):
        assert served[op].get("triton", 0) > 0 and served[op].get("fallbacks") == {}, (op, served[op])
