"""``fxr.moe`` on CPU: the reference against a per-pair loop written from the definition, its
routing forms, its errors, the Triton kernels' constraints and launch configuration, and the
kernels themselves under Triton's interpreter (fp16: the interpreter multiplies bf16 ``tl.dot``
operands wrongly; skipped without Triton). The fused op's generic checks (fake impl, opcheck,
Dynamo, providers) run with the other ops in test_ops.py and test_providers.py."""

from __future__ import annotations

import dataclasses
import types
import zlib

import pytest
import torch
import torch.nn.functional as F
from moe_samples import experts, routing

from fxrewrite.runtime.ops import moe
from fxrewrite.testing import assert_close

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def per_pair(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
             w_down: torch.Tensor, act: str = "silu") -> torch.Tensor:  # fmt: skip
    """The definition, one (token, slot) pair at a time: ``sum_j w[t, j] * down_e(act(gate_e x) * up_e x)``."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.zeros(rows.shape, dtype=torch.float64)
    half = w_gate_up.shape[1] // 2
    fn = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[act]
    for t in range(rows.shape[0]):
        for j in range(ids.shape[-1]):
            e = int(ids.reshape(-1, ids.shape[-1])[t, j])
            gate_up = F.linear(rows[t], w_gate_up[e])
            h = fn(gate_up[:half]) * gate_up[half:]
            out[t] += float(weights.reshape(-1, ids.shape[-1])[t, j]) * F.linear(h, w_down[e]).double()
    return out.to(x.dtype).view(x.shape)


def sample(gen: torch.Generator, tokens: int = 5, count: int = 8, width: int = 16, hidden: int = 32,
           dtype: torch.dtype = F32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    x = torch.randn((tokens, hidden), generator=gen).to(dtype)
    logits = torch.randn((tokens, count), generator=gen).to(dtype)
    return (x, logits, *experts(count, width, hidden, dtype, gen))


# --------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_reference_is_the_routing_weighted_sum_of_each_tokens_experts(
    gen: torch.Generator, dtype: torch.dtype, renormalize: bool
) -> None:
    x, logits, gate_up, down = sample(gen, dtype=dtype)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(2, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    got = moe.moe_reference(x, logits, None, None, gate_up, down, 2, renormalize)
    assert_close(got, per_pair(x, weights, ids, gate_up, down))


@pytest.mark.parametrize("activation", [a for a in moe.ACTIVATIONS if a != "clamped_swiglu"])  # its own test below
def test_activation_is_applied_to_the_gate_half(gen: torch.Generator, activation: str) -> None:
    x, _, gate_up, down = sample(gen)
    weights, ids = routing(5, 3, gen, 8)
    got = moe.moe_reference(x, None, weights, ids, gate_up, down, 3, False, activation)
    assert_close(got, per_pair(x, weights, ids, gate_up, down, activation))


def test_top_k_then_softmax_is_softmax_then_top_k_renormalized(gen: torch.Generator) -> None:
    """Mixtral's original router (softmax over the top-k logits) and the renormalized form give
    the same weights: the op takes either as ``renormalize=True`` from the logits."""
    x, logits, gate_up, down = sample(gen)
    values, ids = logits.topk(2, dim=-1)
    given = moe.moe_reference(x, None, torch.softmax(values, dim=-1), ids, gate_up, down, 2, False)
    assert_close(moe.moe_reference(x, logits, None, None, gate_up, down, 2, True), given)


def test_leading_dims_and_given_routing_renormalized(gen: torch.Generator) -> None:
    x, _, gate_up, down = sample(gen, tokens=6)
    weights, ids = routing(6, 2, gen, 8)
    got = moe.moe_reference(x.view(2, 3, -1), None, weights.view(2, 3, 2), ids.view(2, 3, 2), gate_up, down, 2, True)
    assert got.shape == (2, 3, x.shape[-1])
    assert_close(got.view(6, -1), per_pair(x, weights / weights.sum(-1, keepdim=True), ids, gate_up, down))


def test_an_expert_no_token_chose_contributes_nothing(gen: torch.Generator) -> None:
    """Negative twin of the weighting: an expert's weights change nothing unless it is routed to."""
    x, _, gate_up, down = sample(gen)
    weights, ids = routing(5, 2, gen, [0, 3, 6])
    before = moe.moe_reference(x, None, weights, ids, gate_up, down, 2, False)
    gate_up[[1, 2, 4, 5, 7]] = 100.0
    assert torch.equal(moe.moe_reference(x, None, weights, ids, gate_up, down, 2, False), before)
    gate_up[3] *= 2
    assert not torch.allclose(moe.moe_reference(x, None, weights, ids, gate_up, down, 2, False), before)


def bad(x, logits, gate_up, down):  # type: ignore[no-untyped-def]
    """Each case: arguments that break one rule, and the start of the message naming it."""
    weights, ids = logits.softmax(-1).topk(2)
    return [
        ((x, logits, None, None, gate_up[0], down, 2, True), "moe: expert weights must be 3-D"),
        ((x, logits, None, None, gate_up[:, :-1], down, 2, True), "moe: w_gate_up (8, 31, 32) must be [E, 2I, H]"),
        ((x[:, :-1], logits, None, None, gate_up, down, 2, True), "moe: w_gate_up (8, 32, 32) must be [E, 2I, H]"),
        ((x, logits, None, None, gate_up.double(), down, 2, True), "moe: expert weights are torch.float64"),
        ((x, logits, None, None, gate_up, down, 2, True, "relu"), "moe: activation 'relu' is not one of"),
        ((x, logits, None, None, gate_up, down, 9, True), "moe: top_k 9 outside 1..8"),
        ((x, logits, weights, ids, gate_up, down, 2, True), "moe: give router_logits, or topk_weights and topk_ids"),
        ((x, None, None, None, gate_up, down, 2, True), "moe: give router_logits, or topk_weights and topk_ids"),
        ((x, None, weights, None, gate_up, down, 2, True), "moe: topk_weights and topk_ids go together"),
        ((x, logits[:, :4], None, None, gate_up, down, 2, True), "moe: router_logits (5, 4) must be (5, 8)"),
        ((x, None, weights, ids, gate_up, down, 3, True), "moe: topk_weights (5, 2) and topk_ids (5, 2) must be (5, 3)"),
        ((x, None, weights, ids.float(), gate_up, down, 2, True), "moe: topk_ids must be integers"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_bad_arguments_raise_clear_errors(gen: torch.Generator, case: int) -> None:
    x, logits, gate_up, down = sample(gen)
    args, message = bad(x, logits, gate_up, down)[case]
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]").replace(".", r"\.")):  # fmt: skip
        torch.ops.fxr.moe(*args)


def test_triton_check_names_what_the_kernels_cannot_serve(gen: torch.Generator) -> None:
    """No Triton needed: the constraints live in the op module."""
    x, logits, gate_up, down = sample(gen, dtype=BF16)
    ok = (x, logits, None, None, gate_up, down, 2, True)
    assert moe.triton_check(*ok) is None
    assert moe.triton_check(x.float(), logits, None, None, gate_up.float(), down.float(), 2, True) == (
        "dtype float32 not bf16/fp16")  # fmt: skip
    assert moe.triton_check(x, logits, None, None, gate_up.half(), down, 2, True) == "dtype float16 != input dtype bfloat16"
    transposed = gate_up.transpose(1, 2).contiguous().transpose(1, 2)  # [E, H, 2I] stored: served
    assert moe.triton_check(x, logits, None, None, transposed, down, 2, True) is None
    strided = torch.zeros((8, 32, 64), dtype=BF16)[:, :, ::2]
    assert moe.triton_check(x, logits, None, None, strided, down, 2, True) == (
        "expert weights without unit stride along their last two dims")  # fmt: skip
    many = moe.MAX_EXPERTS + 1
    gate_up, down = torch.zeros((many, 2, 32), dtype=BF16), torch.zeros((many, 32, 1), dtype=BF16)
    assert moe.triton_check(x, None, *routing(5, 2, gen, 8), gate_up, down, 2, True) == (
        f"{moe.MAX_EXPERTS + 1} experts, more than {moe.MAX_EXPERTS}")  # fmt: skip


# --------------------------------------------------------------------------- the Triton kernels, interpreted


CASES = [  # tokens, experts, top_k, hidden, width, renormalize, routing, activation
    (1, 4, 2, 32, 16, True, "logits", "silu"),
    (5, 8, 1, 64, 32, False, "logits", "silu"),
    (37, 8, 2, 48, 32, True, "given", "gelu_tanh"),
    (20, 16, 8, 32, 16, False, "logits", "gelu"),
    (64, 6, 6, 32, 16, True, "logits", "silu"),  # top_k not a power of two, all experts
    (150, 8, 2, 32, 16, True, "logits", "silu"),  # routing programs of CHUNK_TOKENS tokens, the last one partial
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-{c[6]}-{c[7]}")
def test_kernel_against_the_reference(triton_moe: types.ModuleType, gen: torch.Generator, case: tuple) -> None:
    tokens, count, top_k, hidden, width, renormalize, how, act = case
    x, logits, gate_up, down = sample(gen, tokens, count, width, hidden, F16)
    given = (None, *routing(tokens, top_k, gen, count)) if how == "given" else (logits, None, None)
    args = (x, *given, gate_up, down, top_k, renormalize, act)
    assert moe.triton_check(*args) is None
    assert_close(triton_moe.moe(*args), moe.moe_reference(*args))


@pytest.mark.parametrize("how", ["logits", "given"])
def test_kernel_reads_transposed_weights(triton_moe: types.ModuleType, gen: torch.Generator, how: str) -> None:
    """Weights stored [E, H, 2I] and [E, I, H] (read as their transposed views): strided along k."""
    x, logits, gate_up, down = sample(gen, 11, 8, 16, 48, F16)
    gate_up, down = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (gate_up, down))
    given = (logits, None, None) if how == "logits" else (None, *routing(11, 2, gen, 8))
    args = (x, *given, gate_up, down, 2, True, "silu")
    assert gate_up.stride(1) == 1 and not triton_moe.tma_ready(x, gate_up, down)
    assert_close(triton_moe.moe(*args), moe.moe_reference(*args))


def test_weight_on_the_input_scales_each_experts_input(gen: torch.Generator) -> None:
    """``weight_input``: ``sum_j down_e(act(gate_e(w x)) * up_e(w x))``, per pair from the definition;
    its negative twin, the weight on the output, differs (the experts are not linear)."""
    x, _, gate_up, down = sample(gen)
    weights, ids = routing(5, 2, gen, 8)
    got = moe.moe_reference(x, None, weights, ids, gate_up, down, 2, False, "silu", True)
    want = sum(per_pair(x * weights[:, j:j + 1], torch.ones(5, 1), ids[:, j:j + 1], gate_up, down) for j in range(2))
    assert_close(got, want)
    assert not torch.allclose(got, moe.moe_reference(x, None, weights, ids, gate_up, down, 2, False, "silu"))


def test_kernel_scales_the_input_by_the_weight(triton_moe: types.ModuleType, gen: torch.Generator) -> None:
    x, _, gate_up, down = sample(gen, 9, 8, 16, 32, F16)
    args = (x, None, *routing(9, 1, gen, 8), gate_up, down, 1, False, "silu", True)
    assert_close(triton_moe.moe(*args), moe.moe_reference(*args))


def clamped_experts(gen: torch.Generator, count: int, width: int, hidden: int, dtype: torch.dtype,
                    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """gpt-oss's experts: weights stored [E, H, 2I] / [E, I, H] with gate and up interleaved,
    a bias per expert on each GEMM (read through transposed views, as the op takes them)."""
    gate_up = (torch.randn((count, hidden, 2 * width), generator=gen) * hidden**-0.5).to(dtype)
    down = (torch.randn((count, width, hidden), generator=gen) * width**-0.5).to(dtype)
    b_gate_up = torch.randn((count, 2 * width), generator=gen).to(dtype)
    b_down = torch.randn((count, hidden), generator=gen).to(dtype)
    return gate_up.transpose(1, 2), down.transpose(1, 2), b_gate_up, b_down


def gpt_oss_experts(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, experts: tuple[torch.Tensor, ...],
                    limit: float = 7.0) -> torch.Tensor:  # fmt: skip
    """gpt-oss's experts as transformers writes them, one pair at a time."""
    gate_up_t, down_t, b_gate_up, b_down = (e.transpose(1, 2) if e.dim() == 3 else e for e in experts)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = x[t] @ gate_up_t[e] + b_gate_up[e]
            gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(min=-limit, max=limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
            out[t] += float(w[t, j]) * (h @ down_t[e] + b_down[e]).float()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_clamped_swiglu_experts_with_biases_interleaved(gen: torch.Generator, dtype: torch.dtype) -> None:
    x = torch.randn((6, 32), generator=gen).to(dtype) * 4  # past the clamp
    experts = clamped_experts(gen, 8, 16, 32, dtype)
    weights, ids = routing(6, 2, gen, 8)
    got = moe.moe_reference(x, None, weights, ids, experts[0], experts[1], 2, False, "clamped_swiglu", False,
                            experts[2], experts[3], True, 1.702, 7.0)  # fmt: skip
    assert_close(got, gpt_oss_experts(x, weights, ids, experts))
    halves = moe.moe_reference(x, None, weights, ids, experts[0], experts[1], 2, False, "clamped_swiglu", False,
                               experts[2], experts[3], False)  # fmt: skip
    assert not torch.allclose(got.float(), halves.float())  # negative twin: gate and up as halves


def test_kernel_clamped_swiglu_biases_interleaved(triton_moe: types.ModuleType, gen: torch.Generator) -> None:
    x = torch.randn((13, 32), generator=gen).half() * 4
    experts = clamped_experts(gen, 8, 16, 32, F16)
    args = (x, None, *routing(13, 2, gen, 8), experts[0], experts[1], 2, False, "clamped_swiglu", False, experts[2],
            experts[3], True, 1.702, 7.0)  # fmt: skip
    assert moe.triton_check(*args) is None
    assert_close(triton_moe.moe(*args), moe.moe_reference(*args))


def test_kernel_skips_experts_that_receive_no_token(triton_moe: types.ModuleType, gen: torch.Generator) -> None:
    """Tokens routed to 3 of 16 experts: the other experts' blocks are empty; their weights are
    NaN, so reading any of them would show."""
    x, _, gate_up, down = sample(gen, 9, 16, 16, 32, F16)
    used = [2, 7, 13]
    idle = [e for e in range(16) if e not in used]
    gate_up[idle], down[idle] = float("nan"), float("nan")
    args = (x, None, *routing(9, 2, gen, used), gate_up, down, 2, False, "silu")
    assert_close(triton_moe.moe(*args), moe.moe_reference(*args))


def test_kernel_aligns_over_many_chunks_and_blocks(triton_moe: types.ModuleType, gen: torch.Generator,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Small one-hot chunks (4 tokens) and slabs of chunk counts, and 16-row blocks over 2
    experts that get ~37 pairs each: positions cross chunks, an expert spans several blocks."""
    monkeypatch.setattr(triton_moe, "ONE_HOT_ELEMENTS", 64)
    x, logits, gate_up, down = sample(gen, 37, 8, 16, 32, F16)
    args = (x, None, *routing(37, 2, gen, [1, 6]), gate_up, down, 2, True, "silu")
    cfg = triton_moe.MoeConfig(16, triton_moe.GemmConfig(16, 32), triton_moe.GemmConfig(32, 16))
    assert_close(triton_moe.moe(*args, cfg=cfg), moe.moe_reference(*args))


@pytest.mark.parametrize("group", [1, 2, 3, 0])
def test_kernel_runs_blocks_in_l2_groups(triton_moe: types.ModuleType, gen: torch.Generator, group: int) -> None:
    """Programs ordered in groups of blocks over every column tile (a last group smaller than
    the rest, 0: all blocks at once): each (block, tile) computed once, whatever the group."""
    x, _, gate_up, down = sample(gen, 37, 8, 48, 40, F16)
    args = (x, None, *routing(37, 2, gen, [0, 3, 6]), gate_up, down, 2, True, "silu")
    gemm = triton_moe.GemmConfig(16, 16, group=group)
    cfg = triton_moe.MoeConfig(16, gemm, dataclasses.replace(gemm, bn=32))
    assert_close(triton_moe.moe(*args, cfg=cfg), moe.moe_reference(*args))


TMA_CASES = [  # tokens, experts, top_k, hidden, width, column tile, routing
    (37, 8, 2, 48, 40, 16, "logits"),  # width 40: a weight tile runs past an expert's rows; hidden 48: a k tail
    (20, 16, 8, 32, 24, 32, "given"),
    (5, 4, 2, 32, 16, 32, "logits"),  # a column tile wider than the expert
]


@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-H{c[3]}-I{c[4]}-bn{c[5]}")
def test_tma_kernel_against_the_reference(triton_moe: types.ModuleType, gen: torch.Generator, case: tuple) -> None:
    """The prefill path (x gathered into sorted order, both GEMMs through TMA descriptors) at
    16-row blocks: out-of-range reads are zeros, tiles past an expert's rows never stored."""
    tokens, count, top_k, hidden, width, bn, how = case
    x, logits, gate_up, down = sample(gen, tokens, count, width, hidden, F16)
    given = (None, *routing(tokens, top_k, gen, count)) if how == "given" else (logits, None, None)
    args = (x, *given, gate_up, down, top_k, True, "silu")
    assert triton_moe.tma_ready(x, gate_up, down)
    cfg = triton_moe.MoeConfig(16, triton_moe.GemmConfig(bn, 32, group=2), triton_moe.GemmConfig(bn, 16), tma=True)
    assert_close(triton_moe.moe(*args, cfg=cfg), moe.moe_reference(*args))


def test_tma_kernel_never_uses_the_rows_of_idle_experts(triton_moe: types.ModuleType, gen: torch.Generator) -> None:
    """Tokens routed to 3 of 8 experts whose neighbours hold NaN weights: the tiles that run past
    an expert's 40 rows read them, and those columns must never reach the output."""
    x, _, gate_up, down = sample(gen, 19, 8, 40, 32, F16)
    used = [1, 4, 6]
    idle = [e for e in range(8) if e not in used]
    gate_up[idle], down[idle] = float("nan"), float("nan")
    args = (x, None, *routing(19, 2, gen, used), gate_up, down, 2, False, "silu")
    cfg = triton_moe.MoeConfig(16, triton_moe.GemmConfig(32, 16), triton_moe.GemmConfig(32, 16), tma=True)
    assert_close(triton_moe.moe(*args, cfg=cfg), moe.moe_reference(*args))


def test_tma_needs_contiguous_weights_with_16_byte_rows(triton_moe: types.ModuleType, gen: torch.Generator) -> None:
    """Weights TMA cannot describe as one [E * rows, K] matrix (experts' rows not adjacent: a
    slice of a wider stack; rows of 40 bytes) take the pointer kernel, even when the configuration
    asks for TMA, with the same result."""
    x, logits, gate_up, down = sample(gen, 9, 4, 16, 32, F16)
    assert triton_moe.tma_ready(x, gate_up, down) and triton_moe.tma_ready(x[:, ::2], gate_up, down)
    strided = torch.cat([gate_up, gate_up[:, :8]], dim=1)[:, :32]
    assert strided.stride(-1) == 1 and not strided.is_contiguous()
    narrow = sample(gen, 9, 4, 16, 20, F16)
    assert not triton_moe.tma_ready(x, strided, down) and not triton_moe.tma_ready(narrow[0], *narrow[2:])
    cfg = triton_moe.MoeConfig(16, triton_moe.GemmConfig(16, 16), triton_moe.GemmConfig(16, 16), tma=True)
    for args in ((x, logits, None, None, strided, down, 2, True, "silu"), (*narrow[:2], None, None, *narrow[2:], 2, True, "silu")):
        assert_close(triton_moe.moe(*args, cfg=cfg), moe.moe_reference(*args))


def test_kernel_reads_logits_in_place_from_a_wider_projection(triton_moe: types.ModuleType, gen: torch.Generator) -> None:
    """Router logits sliced from a merged GEMM's output (a router merged with a sibling)."""
    x, _, gate_up, down = sample(gen, 7, 8, 16, 32, F16)
    wide = torch.randn((7, 9), generator=gen).half()
    args = (x, wide[:, :8], None, None, gate_up, down, 2, True, "silu")
    assert not args[1].is_contiguous()
    assert_close(triton_moe.moe(*args), moe.moe_reference(*args))


def test_launch_configuration() -> None:
    """No Triton run: decode sizes take 16-row blocks (an expert's weights read once per block)
    and stream wide column tiles; prefill grows the blocks; stages stay within shared memory."""
    cfg = pytest.importorskip("fxrewrite.runtime.triton_moe", reason="triton is not installed")
    mixtral_decode = cfg.config(8, 2, 8, 14336, 4096, 132)
    assert mixtral_decode.bm == 16 and mixtral_decode.gate_up.bn == 128 and mixtral_decode.down.bn == 128
    assert cfg.config(1, 2, 8, 14336, 4096, 132).down.bn == 32  # 2 active experts: narrow tiles fill the SMs
    assert cfg.config(4096, 8, 128, 768, 4096, 132).bm == 128
    # TMA serves the 128-row blocks only (at decode sizes it measured no faster)
    prefill, decode = cfg.config(4096, 2, 8, 14336, 4096, 132, tma=True), cfg.config(8, 2, 8, 14336, 4096, 132, tma=True)
    assert prefill.tma and prefill.down.bn == 256 and not decode.tma and decode == mixtral_decode
    assert prefill.gate_up.bk * (128 + 2 * prefill.gate_up.bn) * 2 * prefill.gate_up.stages <= cfg.SMEM_TMA
    assert [cfg.block_rows(pairs, 8) for pairs in (8, 128, 256, 512, 8192)] == [16, 16, 32, 64, 128]
    for tokens in (1, 8, 64, 512, 4096):
        for g, gated in ((cfg.config(tokens, 8, 128, 768, 4096, 132).gate_up, True),
                         (cfg.config(tokens, 2, 8, 14336, 4096, 132).down, False)):  # fmt: skip
            bm = cfg.block_rows(tokens * (8 if gated else 2), 128 if gated else 8)
            assert g.bk * (bm + g.bn * (2 if gated else 1)) * 2 * g.stages <= cfg.SMEM_BUDGET
