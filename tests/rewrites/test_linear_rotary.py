"""RoPE in the qkv GEMM's epilogue (rewrites/linear_rotary.py, pass ``fuse_gemm_rotary``), on an
engine's spelling of the decoder (tests/helpers/engine.py: merged qkv, a cos|sin cache indexed by
positions) compiled in mode "full"; the op's kernel: tests/runtime/test_linear_fused_ops.py."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import HEAD, HIDDEN, KV_HEADS, EngineDecoder, EngineRMSNorm, EngineRotary, stand_in_attention, tokens
from helpers.rewrites import BF16, DYNAMIC, check, reasons, sites

FULL = {"mode": "full", "gemm_fusion": True}  # Config.gemm_fusion: off by default
RULE = "rms_norm_linear_rotary"


@DYNAMIC
def test_the_qkv_gemm_rotates_q_and_k(dynamic: bool | str) -> None:
    """Two engine layers: each qkv GEMM takes its norm and the rotation (the first layer's
    residual is the model's input: a new tensor for its add); each add but the last hands the
    next norm its squares (the second qkv reads a hand-off and still rotates)."""
    torch.manual_seed(0)
    expect = {RULE: 2, "rms_norm_linear_silu_and_mul": 2, "linear_add_rms_parts": 3, "linear_add_": 1, "rms_norm": 1}
    r = check(EngineDecoder(), *tokens()[:2], expect=expect, dynamic=dynamic, **FULL)
    assert [s.rule for s in sites(r, RULE)] == [RULE, RULE] and not reasons(r, RULE)


def test_bf16_rotates_in_the_epilogue_too() -> None:
    """bf16, one layer read by the engine's attention stand-in."""
    torch.manual_seed(0)
    check(NormRope().to(BF16), *tokens(dtype=BF16)[:2], expect={RULE: 1}, **FULL)


class NormRope(torch.nn.Module):
    """norm -> merged projection -> RoPE on q and k -> attention. ``layout``: the projection's
    column order; ``rotary_dim``: the rotated part of each head; ``leak``: the unrotated q is
    read too."""

    def __init__(self, layout: str = "qkv", rotary_dim: int = HEAD, leak: bool = False) -> None:
        super().__init__()
        self.layout, self.leak = layout, leak
        self.norm = EngineRMSNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD, bias=False)
        self.rotary = EngineRotary(rotary_dim)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        sizes = {"q": HIDDEN, "k": KV_HEADS * HEAD, "v": KV_HEADS * HEAD}
        parts = dict(zip(self.layout, self.qkv(self.norm(h)).split([sizes[c] for c in self.layout], dim=-1)))
        q, k = self.rotary(positions, parts["q"], parts["k"])
        out = stand_in_attention(q, k, parts["v"])
        return out + parts["q"] if self.leak else out


def test_k_before_q_rotates_the_same_columns() -> None:
    torch.manual_seed(0)
    check(NormRope("kqv"), *tokens()[:2], expect={RULE: 1}, **FULL)


@pytest.mark.parametrize(("model", "why"), [
    (lambda: NormRope("qvk"), "are not adjacent columns from 0 of one GEMM"),
    (lambda: NormRope(leak=True), "(q or k before the rotation) is also read by"),
])  # fmt: skip
def test_negative_twins_keep_the_rotation(model: object, why: str) -> None:
    """v between q and k (the epilogue rotates one range of columns); the unrotated q read
    elsewhere (the GEMM's output would hold the rotated one): the rotation stays, reported."""
    torch.manual_seed(0)
    r = check(model(), *tokens()[:2], expect={"rms_norm_linear": 1, "rotary_embedding": 1}, **FULL)  # type: ignore[operator]
    assert any(why in reason for reason in reasons(r, RULE)), reasons(r, RULE)


def test_partial_rotary_keeps_the_rotation() -> None:
    """Negative twin: half of each head rotates (Phi-3, GLM): the epilogue rotates whole heads."""
    torch.manual_seed(0)
    r = check(NormRope(rotary_dim=HEAD // 2), *tokens()[:2], expect={"rms_norm_linear": 1, "rotary_embedding": 1},
              **FULL)  # fmt: skip
    assert any("partial rotary" in reason for reason in reasons(r, RULE))


def test_nothing_to_fuse_where_graphs_run_eagerly() -> None:
    """Negative twin: mode "none" has no GEMM with its norm (fuse_gemm_norm does not run)."""
    torch.manual_seed(0)
    check(NormRope(), *tokens()[:2], expect={"rms_norm": 1, "rotary_embedding": 1}, mode="none")


def test_float32_matches_eager_bit_for_bit() -> None:
    """On CPU the op's reference rotates what the GEMM's reference computed, as the unfused ops."""
    torch.manual_seed(0)
    check(NormRope(), *tokens()[:2], expect={RULE: 1}, exact=True, dynamic=False, **FULL)


def test_only_permutes_that_undo_one_another_are_seen_through() -> None:
    """The q a rotation reads may sit behind a transpose and the permute that undoes it
    ([B, S, H, D] -> [B, H, S, D] -> back); a pair that leaves the dims moved is no view of the
    GEMM's columns (negative twin)."""
    from fxrewrite.rewrites import linear_rotary

    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3, 4, 5)
    t = g.call_method("transpose", (x, 1, 2))
    t.meta["val"] = torch.empty(2, 4, 3, 5)
    back = g.call_function(torch.ops.aten.permute.default, (t, [0, 2, 1, 3]))
    moved = g.call_function(torch.ops.aten.permute.default, (t, [0, 1, 3, 2]))
    assert linear_rotary._identity([back, t])  # the last applied first
    assert not linear_rotary._identity([moved, t]) and not linear_rotary._identity([t])
