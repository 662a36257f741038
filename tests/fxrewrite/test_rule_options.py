"""Rule options the LayerNorm steps need, on toy rules: optional tensor arguments (bound to
``None``), a rule's own near-miss threshold (``COMPLETE``: only refused complete matches),
guards that say ``NOT_A_SITE``, and inputs only a match read removed with it."""

from __future__ import annotations

import pytest
import torch

from fxrewrite import Backend, Rule, RuleError
from fxrewrite.rule import COMPLETE, NOT_A_SITE, Bindings
from fxrewrite.testing import check_rewrite


# x * scale? + shift -> torch.addcmul-like: a pattern whose scale may be absent (None)
def scaled_pattern(x, scale, shift):
    return torch.ops.aten.layer_norm.default(x, [8], scale, None, 1e-5, True) + shift


def scaled_replacement(x, scale, shift):
    return torch.ops.fxr.layer_norm(x, scale, shift, 1e-5, False)


def vector_guard(b: Bindings) -> bool | str:
    shift = b["shift"]
    if shift.dim() > 1:
        return NOT_A_SITE  # an activation, not a bias
    return True if shift.shape[0] == 8 else f"shift of {shift.shape[0]}"


SHIFT = Rule("shift", scaled_pattern, scaled_replacement, vector_guard, optional=("scale",), near_miss_min=COMPLETE)


def with_shift(x: torch.Tensor, w: torch.Tensor | None, shift: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (8,), w, None, 1e-5) + shift


@pytest.mark.parametrize("weight", [True, False], ids=["scale", "no-scale"])
def test_optional_argument_binds_a_tensor_or_none(weight: bool) -> None:
    w = torch.randn(8) if weight else None
    r = check_rewrite(with_shift, torch.randn(3, 8), w, torch.randn(8), rules=[SHIFT], expect={"fxr.layer_norm": 1},
                      absent=["aten.layer_norm", "aten.add"])  # fmt: skip
    (node,) = [n for n in r.graph.graph.nodes if n.target is torch.ops.fxr.layer_norm.default]
    assert (node.args[1] is None) is not weight


def test_without_optional_a_none_is_a_mismatch() -> None:
    rule = Rule("shift_strict", scaled_pattern, scaled_replacement, vector_guard)
    r = check_rewrite(with_shift, torch.randn(3, 8), None, torch.randn(8), rules=[rule], expect={"aten.layer_norm": 1})
    assert [m.reason for m in r.report.near_misses] == ["`layer_norm` weight: scale: expected a tensor, found literal None"]


def test_optional_must_name_a_tensor_argument() -> None:
    with pytest.raises(RuleError, match=r"^rule 'bad': optional \['nope'\] are not tensor arguments of the pattern$"):
        Backend(rules=[Rule("bad", scaled_pattern, scaled_replacement, optional=("nope",))])


def test_not_a_site_refuses_without_a_near_miss() -> None:
    """The negative twin: a shift of the activation's own shape is no bias; the guard's other
    refusal (a vector of another length) is a near miss as usual."""
    x = torch.randn(3, 8)
    r = check_rewrite(with_shift, x, None, torch.randn(3, 8), rules=[SHIFT], expect={"aten.layer_norm": 1})
    assert not r.report.near_misses
    r = check_rewrite(with_shift, x, None, torch.randn(1), rules=[SHIFT], expect={"aten.layer_norm": 1})
    assert [m.reason for m in r.report.near_misses] == ["guard: shift of 1"]


def scaled_then_shifted(x: torch.Tensor, w: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (8,), w, None, 1e-5) * 2 + shift


@pytest.mark.parametrize(("threshold", "reported"), [(None, True), (COMPLETE, False)], ids=["config", "complete"])
def test_a_rule_threshold_keeps_partial_matches_quiet(threshold: float | None, reported: bool) -> None:
    """A step that extends a fused op (here: a shift after the norm) fails half-way at every
    add that is not one; with ``near_miss_min=COMPLETE`` it says nothing there."""
    rule = Rule("shift_quiet", scaled_pattern, scaled_replacement, vector_guard, optional=("scale",),
                near_miss_min=threshold)  # fmt: skip
    r = check_rewrite(scaled_then_shifted, torch.randn(3, 8), torch.randn(8), torch.randn(8), rules=[rule],
                      expect={"aten.layer_norm": 1})  # fmt: skip
    assert bool(r.report.near_misses) is reported


def test_inputs_only_the_match_read_go_with_it() -> None:
    """``F.layer_norm(s, s.shape[-1:])`` under dynamic shapes reads ``s``'s size; the rule drops
    the shape, and the size call goes at once, not at the pass's cleanup: a later rule of the
    pass may then replace ``s`` (the add + norm step: the read would have been before it)."""
    from fxrewrite.rewrites import layernorm

    def add_norm(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = a * 2 + b * 3
        return torch.nn.functional.layer_norm(s, s.shape[-1:]), s

    r = check_rewrite(add_norm, torch.randn(3, 8), torch.randn(3, 8), rules=layernorm.RULES,
                      expect={"fxr.fused_add_layer_norm_": 1}, absent=["method.size"])  # fmt: skip
    assert not r.report.near_misses
