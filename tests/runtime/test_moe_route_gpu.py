"""``fxr.moe_route``'s kernels on the GPU against the reference, each provider it has forced in
turn (:data:`KERNELS`; the Triton kernel): the router kinds (softmax, sigmoid, biased,
group-limited, top-k of the logits), 1 to 4096 tokens, up to 256 experts, bf16 and float32
logits, and capture into a CUDA graph that replays other logits. (test_ops_gpu.py's generic
harness leaves this op out: its arguments are no [tokens, hidden] activations.)

    source .devkit/setup.sh && python3 -m pytest -q tests/runtime/test_moe_route_gpu.py -m gpu
"""

from __future__ import annotations

import pytest
import torch
from helpers.gpu import force, fresh_counts, gen  # noqa: F401  (fresh_counts, gen: pytest fixtures of this module)

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import moe_route
from fxrewrite.runtime.providers import Kernel
from fxrewrite.testing import assert_close

pytestmark = pytest.mark.gpu
KERNELS = moe_route.KERNELS  # every provider of fxr.moe_route

ROUTERS = {  # top_k, scoring, select, n_group, topk_group, group_top, renormalize, bias, scaling
    "deepseek-v3": (8, "sigmoid", "scores", 8, 4, 2, True, True, 2.5),
    "glm-4.5": (8, "sigmoid", "scores", 1, 1, 2, True, True, 1.0),
    "biased-sigmoid": (4, "sigmoid", "scores", 1, 1, 2, True, True, 1.0),
    "biased-logits": (4, "sigmoid", "logits", 1, 1, 2, True, True, 1.0),
    "deepseek-v4": (6, "sqrtsoftplus", "scores", 1, 1, 2, True, True, 1.5),
    "greedy-groups": (6, "softmax", "scores", 8, 3, 1, False, False, 16.0),
    "softmax": (2, "softmax", "scores", 1, 1, 2, True, False, 1.0),
    "top-k-softmax": (4, "softmax", "logits", 1, 1, 2, True, False, 1.0),
}


def distinct_logits(tokens: int, count: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """No two logits of a row equal, exactly so in bf16, centred on 0: ties would leave the
    choice to each implementation."""
    order = torch.rand((tokens, count), generator=gen, device="cuda").argsort(dim=-1).float()
    step = 2.0 ** -max(0, (count // 8).bit_length())
    return ((order - count / 2) * step).to(dtype)


def args_for(router: str, tokens: int, count: int, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16,
             ) -> tuple[object, ...]:  # fmt: skip
    top_k, scoring, select, groups, kept, top, renormalize, biased, scaling = ROUTERS[router]
    bias = torch.rand(count, generator=gen, device="cuda") * 2.0 ** -10 if biased else None  # small beside the steps
    return (distinct_logits(tokens, count, gen, dtype), bias, top_k, scoring, select, groups, kept, top, renormalize,
            scaling)  # fmt: skip


def check(args: tuple[object, ...], kernel: Kernel = KERNELS[0]) -> None:
    """One call served by ``kernel`` (no fallback): ids equal to the reference's, weights close."""
    w, ids = torch.ops.fxr.moe_route(*args)
    assert providers.served()["moe_route"] == {kernel.name: 1, "fallbacks": {}}
    w_ref, ids_ref = moe_route.moe_route_reference(*args)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref)


@pytest.mark.parametrize("tokens", [1, 3, 64, 257, 4096])
@pytest.mark.parametrize("count", [16, 64, 256])
@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.provider)
def test_kernel_against_the_reference(gen: torch.Generator, kernel: Kernel, router: str, count: int,
                                      tokens: int) -> None:  # fmt: skip
    force(kernel.provider)
    check(args_for(router, tokens, count, gen), kernel)


def test_float32_logits(gen: torch.Generator) -> None:
    check(args_for("deepseek-v3", 100, 256, gen, torch.float32))


def test_cuda_graph_replays_other_logits(gen: torch.Generator) -> None:
    static = list(args_for("deepseek-v3", 16, 64, gen))
    torch.ops.fxr.moe_route(*static)  # build the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = torch.ops.fxr.moe_route(*static)
    for _ in range(2):
        static[0].copy_(distinct_logits(16, 64, gen, torch.bfloat16))  # type: ignore[union-attr]
        graph.replay()
        torch.cuda.synchronize()
        w_ref, ids_ref = moe_route.moe_route_reference(*static)
        assert torch.equal(ids, ids_ref)
        assert_close(w, w_ref)
