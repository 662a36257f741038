"""``fxr.moe``'s Triton kernels on the GPU against the reference: bf16, several expert counts,
top-k 1, 2 and 8, 1 to 4096 tokens, experts that receive no token, routing from logits or given,
the real shapes of the benchmark, and capture into a CUDA graph that replays other routings.

    source .devkit/setup.sh && python3 -m pytest -q tests/runtime/test_moe_gpu.py -m gpu
"""

from __future__ import annotations

import pytest
import torch
from helpers.gpu import fresh_counts, gen  # noqa: F401  (pytest fixtures of this module)
from moe_samples import experts, routing

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import moe
from fxrewrite.testing import assert_close

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def distinct_logits(tokens: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """Router logits with no two equal in a row, exactly so in bf16 (steps of a power of two):
    with ties, which expert top-k picks would be up to each implementation."""
    order = torch.rand((tokens, count), generator=gen, device="cuda").argsort(dim=-1).float()
    return (order * 2.0 ** -max(0, (count // 8).bit_length())).to(BF16)


def args_for(tokens: int, count: int, top_k: int, gen: torch.Generator, how: str = "given", hidden: int = 256,
             width: int = 128, renormalize: bool = True, activation: str = "silu", used: int | list[int] | None = None,
             ) -> tuple[object, ...]:  # fmt: skip
    x = torch.randn((tokens, hidden), generator=gen, device="cuda").to(BF16)
    gate_up, down = experts(count, width, hidden, BF16, gen)
    if how == "logits":
        given: tuple[object, ...] = (distinct_logits(tokens, count, gen), None, None)
    else:
        given = (None, *routing(tokens, top_k, gen, count if used is None else used))
    return (x, *given, gate_up, down, top_k, renormalize, activation)


def check(args: tuple[object, ...]) -> None:
    got = torch.ops.fxr.moe(*args)
    assert providers.served()["moe"] == {"triton": 1, "fallbacks": {}}
    assert_close(got, moe.moe_reference(*args))


@pytest.mark.parametrize("tokens", [1, 3, 16, 64, 257, 4096])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("count", [8, 64, 128])
def test_kernel_against_the_reference(gen: torch.Generator, count: int, top_k: int, tokens: int) -> None:
    check(args_for(tokens, count, top_k, gen, how="logits" if tokens % 2 else "given", renormalize=top_k > 1))


@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_experts_that_receive_no_token_are_never_read(gen: torch.Generator, tokens: int) -> None:
    """Tokens routed to 3 of 64 experts; the other 61 hold NaN weights."""
    used = [5, 17, 60]
    args = args_for(tokens, 64, 2, gen, used=used)
    idle = [e for e in range(64) if e not in used]
    args[4][idle], args[5][idle] = float("nan"), float("nan")  # type: ignore[index]
    check(args)


def test_prefill_takes_the_tma_kernel_past_expert_rows_and_idle_experts(gen: torch.Generator) -> None:
    """4096 pairs over 16 experts (128-row blocks: the TMA kernel) with hidden 200 and width 72
    (weight tiles that run past an expert's rows, a k tail), experts 0 and 9 idle with NaN
    weights that those tiles read and must never store."""
    from fxrewrite.runtime import triton_moe

    idle = [0, 9]
    args = args_for(2048, 16, 2, gen, hidden=200, width=72, used=[e for e in range(16) if e not in idle])
    args[4][idle], args[5][idle] = float("nan"), float("nan")  # type: ignore[index]
    assert triton_moe.config(2048, 2, 16, 72, 200, 132, triton_moe.tma_ready(args[0], args[4], args[5])).tma  # type: ignore[arg-type]
    check(args)


@pytest.mark.parametrize("activation", moe.ACTIVATIONS)
def test_activations_and_odd_widths(gen: torch.Generator, activation: str) -> None:
    """Hidden 200 and width 72: k loops with a masked last step in both GEMMs."""
    check(args_for(33, 16, 4, gen, hidden=200, width=72, renormalize=False, activation=activation))


@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
@pytest.mark.parametrize(("count", "top_k", "hidden", "width"), [(8, 2, 4096, 14336), (128, 8, 2048, 768)],
                         ids=["mixtral-8x7b", "128-experts"])  # fmt: skip
def test_benchmark_shapes(gen: torch.Generator, count: int, top_k: int, hidden: int, width: int, tokens: int) -> None:
    check(args_for(tokens, count, top_k, gen, how="logits", hidden=hidden, width=width))


def test_float32_falls_back_to_the_reference_with_the_reason(gen: torch.Generator) -> None:
    args = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args_for(4, 8, 2, gen)]
    torch.testing.assert_close(torch.ops.fxr.moe(*args), moe.moe_reference(*args))
    assert providers.served()["moe"] == {"torch": 1, "fallbacks": {"triton: dtype float32 not bf16/fp16": 1}}


@pytest.mark.parametrize(("tokens", "count"), [(8, 64), (1024, 8)], ids=["decode", "prefill-tma"])
@pytest.mark.parametrize("how", ["logits", "given"])
def test_cuda_graph_replays_other_routings(gen: torch.Generator, how: str, tokens: int, count: int) -> None:
    """Captured once, replayed with inputs that route to other experts (all tokens to two
    experts, then spread): no host sync, a grid sized for any routing of that many tokens (at
    1024 tokens of 8 experts through the TMA kernel, its descriptors captured with the graph)."""
    static = list(args_for(tokens, count, 2, gen, how=how))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.fxr.moe(*static)  # build the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.fxr.moe(*static)
    for used in ([3, 6], count):
        fresh = args_for(tokens, count, 2, gen, how=how, used=used)
        if how == "logits" and isinstance(used, list):  # every token's two largest logits at experts 3 and 9
            fresh[1][:, used] = 100.0  # type: ignore[index]
        for dst, src in zip(static, fresh):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)  # type: ignore[arg-type]
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, moe.moe_reference(*static))


@pytest.mark.parametrize("tokens", [1, 64, 2048])
@pytest.mark.parametrize("weight_input", [False, True])
def test_transposed_weights_and_the_weight_on_the_input(gen: torch.Generator, weight_input: bool, tokens: int) -> None:
    """Weights stored [E, H, 2I] / [E, I, H] (read through transposed views: strided along k,
    never TMA) and, Llama 4's way, the routing weight scaling each expert's input."""
    args = list(args_for(tokens, 16, 1 if weight_input else 2, gen, renormalize=False))
    args[4], args[5] = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in args[4:6])  # type: ignore[union-attr]
    check((*args, weight_input))


def test_gpt_oss_experts(gen: torch.Generator) -> None:
    """Weights stored [E, H, 2I] / [E, I, H], gate and up interleaved, a bias per expert on each
    GEMM, the clamped SwiGLU: the pointer kernels at decode and prefill sizes."""
    for tokens in (1, 8, 1024):
        x = torch.randn((tokens, 256), generator=gen, device="cuda").to(BF16) * 4
        gate_up = torch.randn((16, 256, 256), generator=gen, device="cuda").to(BF16) * 256**-0.5
        down = torch.randn((16, 128, 256), generator=gen, device="cuda").to(BF16) * 128**-0.5
        biases = [torch.randn(shape, generator=gen, device="cuda").to(BF16) for shape in ((16, 256), (16, 256))]
        args = (x, None, *routing(tokens, 4, gen, 16), gate_up.transpose(1, 2), down.transpose(1, 2), 4, False,
                "clamped_swiglu", False, *biases, True, 1.702, 7.0)  # fmt: skip
        providers.reset_counts()
        check(args)
