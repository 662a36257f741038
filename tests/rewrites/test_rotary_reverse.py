"""Rotations the other way round (rewrites/rotary.py's REVERSE_RULES, rotary_tables.py's sign).

``rotate_half`` written as ``cat((x2, -x1))`` (nanochat) turns x by the negated angle: it is the
usual rotation with sin negated. Each form of the usual rotation (HF full-width tables, an
engine's half-width ones, GPT-J pairs, partial rotary, upcast to float32) has its twin here; the
replacement rotates by ``-sin``, and ``fold_rotary`` folds the sign into the cache's sin half
(one cache per table source, shared by q and k). The negative twins are spellings that are no
rotation at all (no negation, both halves negated, both halves added).
"""

from __future__ import annotations

import pytest
import torch
from helpers.rewrites import BF16, DTYPE_MODES, F32, check, reasons
from test_rotary import HEAD_DIM, PAIR, TOKENS, EngineRope, GPTJRope, HFRope, hf_rope, qk

from fxrewrite.rewrites import rotary


def rotate_half_reverse(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((x2, -x1), dim=-1)


def rotate_pairs_reverse(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((x[..., 1::2], -x[..., ::2]), dim=-1).flatten(-2)


class ReverseHFRope(HFRope):
    turn = staticmethod(rotate_half_reverse)


class ReverseGPTJRope(GPTJRope):
    turn = staticmethod(rotate_pairs_reverse)


class ReverseEngineRope(EngineRope):
    """Half-width tables in float32, each half turned the other way."""

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        if self.interleaved:
            x1, x2 = x[..., ::2], x[..., 1::2]
            return torch.stack((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).flatten(-2).to(dtype)
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).to(dtype)


def rules_of(r) -> set[str]:  # type: ignore[no-untyped-def]
    return {rule for rule in r.report.rules() if rule.startswith("rotary_") and rule != "rotary_embedding"}


def cache(r) -> torch.Tensor:  # type: ignore[no-untyped-def]
    (value,) = [b for name, b in r.graph.named_buffers() if name.startswith("fxr_rotary_cache")]
    return value


def assert_sin_negated(reverse: torch.Tensor, forward: torch.Tensor) -> None:
    """The caches of the two directions: the same cos half, sin halves of opposite sign."""
    half = forward.shape[-1] // 2
    assert torch.equal(reverse[:, :half], forward[:, :half])
    assert torch.equal(reverse[:, half:], -forward[:, half:]) and forward[:, half:].abs().max() > 0


# --------------------------------------------------------------------------- positive


@DTYPE_MODES
@pytest.mark.parametrize("layout", ["bhtd", "flat"])
def test_hf_rotate_half_the_other_way_folds_with_sin_negated(layout: str, dtype: torch.dtype, dynamic: bool) -> None:
    inputs = qk(batch=None if layout == "flat" else 1, dtype=dtype)
    r = check(ReverseHFRope(layout, scaling=0.75), *inputs, expect=PAIR, dynamic=dynamic)
    # float32 elides the upcast form's casts: that rule, listed first, takes the site
    assert rules_of(r) == {"rotary_neox_reverse_upcast" if dtype == F32 else "rotary_neox_reverse"}
    assert reasons(r, "rotary_embedding") == []
    assert_sin_negated(cache(r), cache(hf_rope(layout, dtype, dynamic)))  # test_rotary's compile


@pytest.mark.parametrize(
    ("model", "rule"),
    [(ReverseGPTJRope("bhtd"), "rotary_interleaved_reverse"),
     (ReverseEngineRope(), "rotary_neox_half_reverse"),
     (ReverseEngineRope(interleaved=True), "rotary_interleaved_half_reverse")],
    ids=["gptj", "engine-halves", "engine-pairs"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_other_forms_the_other_way(model: torch.nn.Module, rule: str, dtype: torch.dtype) -> None:
    """The engine computes in float32 and casts back (the upcast rule); in float32 every form's
    casts are elided and the upcast rule, listed first, takes it."""
    engine = isinstance(model, EngineRope)
    r = check(model, *qk(batch=None if engine else 1, dtype=dtype), expect=PAIR)
    assert rules_of(r) == {rule + "_upcast" if engine or dtype == F32 else rule}
    if engine:  # the engine's own cache, sin half negated
        assert_sin_negated(cache(r), model.cos_sin_cache)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_partial_rotary_the_other_way(dtype: torch.dtype) -> None:
    r = check(ReverseHFRope("bhtd", rotary_dim=HEAD_DIM // 2), *qk(dtype=dtype), expect=PAIR)
    assert r.report.rules()["rotary_partial"] == 2 and cache(r).shape[-1] == HEAD_DIM // 2


def test_tables_that_do_not_fold_rotate_by_the_negated_sin() -> None:
    """cos and sin as inputs: ``fxr.apply_rotary(q, cos, -sin, ..)`` stays (the torch reference),
    and equals eager (``check``)."""

    def rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return q * cos + rotate_half_reverse(q) * sin

    q = torch.randn(TOKENS, 4, HEAD_DIM)
    cos, sin = torch.randn(TOKENS, 1, HEAD_DIM), torch.randn(TOKENS, 1, HEAD_DIM)
    r = check(rope, q, cos, sin, expect={"apply_rotary": 1})
    (node,) = [n for n in r.graph.graph.nodes if n.target is torch.ops.fxr.apply_rotary.default]
    assert node.args[2].target is torch.ops.aten.neg.default and node.args[2].args[0].name == "l_sin_"


def test_reverse_rules_follow_the_usual_ones() -> None:
    assert rotary.RULES == rotary.ROTATION_RULES + rotary.REVERSE_RULES + [rotary.PARTIAL]
    assert [r.name.replace("_reverse", "") for r in rotary.REVERSE_RULES] == [
        r.name for r in rotary.ROTATION_RULES if "complex" not in r.name]


# --------------------------------------------------------------------------- negative twins


@pytest.mark.parametrize(
    ("halves", "forward", "reverse"),
    [("x2, x1", "expected `neg`, found `slice` (`x2`)", "expected `neg`, found `slice` (`x1`)"),
     ("-x2, -x1", "target `neg` interposed (`neg_1`) where `slice` was expected",
      "target `neg` interposed (`neg`) where `slice` was expected")],
)  # fmt: skip
def test_swapped_halves_without_one_negation_are_no_rotation(halves: str, forward: str, reverse: str) -> None:
    def rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = q[..., : HEAD_DIM // 2], q[..., HEAD_DIM // 2 :]
        turned = torch.cat((x2, x1) if halves == "x2, x1" else (-x2, -x1), dim=-1)
        return q * cos + turned * sin

    q = torch.randn(TOKENS, 4, HEAD_DIM)
    r = check(rope, q, torch.randn(TOKENS, 1, HEAD_DIM), torch.randn(TOKENS, 1, HEAD_DIM), expect={})
    assert (reasons(r, "rotary_neox"), reasons(r, "rotary_neox_reverse")) == ([forward], [reverse])


def test_halves_both_added_are_no_rotation() -> None:
    def rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = q[..., : HEAD_DIM // 2], q[..., HEAD_DIM // 2 :]
        return torch.cat((x1 * cos + x2 * sin, x2 * cos + x1 * sin), dim=-1)

    q = torch.randn(TOKENS, 4, HEAD_DIM)
    half = HEAD_DIM // 2
    r = check(rope, q, torch.randn(TOKENS, 1, half), torch.randn(TOKENS, 1, half), expect={})
    assert reasons(r, "rotary_neox_half_reverse") == ["expected `sub`, found `add` (`add_1`)"]
