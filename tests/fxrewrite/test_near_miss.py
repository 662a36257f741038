"""Near misses: where a rule's anchor matched but the rule did not, the report says where and why.

Each kind is planted in an otherwise matching RMSNorm (the library's pattern, with a guard that
also demands weight dtype == input dtype, as the flashinfer kernels do) and its reason asserted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fxrewrite import Rule
from fxrewrite.config import Config
from fxrewrite.rewrites import activation, norm
from fxrewrite.rule import Bindings
from fxrewrite.testing import Compiled, check_rewrite


def same_dtype_guard(b: Bindings) -> bool | str:
    if b["weight"].dtype != b["x"].dtype:
        return f"weight {b['weight'].dtype} != input {b['x'].dtype}"
    return norm.norm_guard(b)


RMS_NORM = Rule("rms_norm", norm.rms_norm_pattern, norm.rms_norm_replacement, same_dtype_guard, norm.WILDCARDS)


def rms_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    exponent: int = 2,
    keepdim: bool = True,
    eps: float = 1e-6,
    before_rsqrt: Callable[[torch.Tensor], torch.Tensor] = lambda v: v,
    after_mul: Callable[[torch.Tensor], torch.Tensor] = lambda v: v,
) -> Any:
    """HF Llama's RMSNorm with hooks to plant one defect; returns (out, variance)."""
    h = x.to(torch.float32)
    variance = h.pow(exponent).mean(-1, keepdim=keepdim)
    h = after_mul(h * torch.rsqrt(before_rsqrt(variance + eps)))
    return w * h.to(x.dtype), variance


def _only_out(**plant: Any) -> Callable[..., torch.Tensor]:
    return lambda x, w: rms_norm(x, w, **plant)[0]


def _with_variance(x: torch.Tensor, w: torch.Tensor) -> Any:
    return rms_norm(x, w)  # the variance is also returned: used outside the match


def _bf16_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, w.to(torch.bfloat16))[0]


def compile_norm(fn: Callable[..., Any], tokens: int = 4, **overrides: Any) -> Compiled:
    """Compile ``fn(x, w)`` with RMS_NORM only; nothing may be fused, numerics equal eager."""
    x, w = torch.randn(tokens, 8), torch.randn(8)
    return check_rewrite(fn, x, w, rules=[RMS_NORM], dynamic=False, expect={"fxr.rms_norm": 0}, **overrides)


def test_the_unplanted_norm_matches() -> None:
    """The positive twin of every case below: no defect, one fused norm, no near miss."""
    r = check_rewrite(_only_out(), torch.randn(4, 8), torch.randn(8), rules=[RMS_NORM], expect={"fxr.rms_norm": 1})
    assert not r.report.near_misses


@pytest.mark.parametrize(
    ("fn", "tokens", "at", "reason"),
    [
        (_only_out(exponent=4), 4, "pow_1", "`pow_1` exponent: literal 4 != 2"),
        (_with_variance, 4, "variance", "internal node `variance` has 1 user(s) outside the match (`output`)"),
        (_bf16_weight, 4, "mul_1", "guard: weight torch.bfloat16 != input torch.float32"),
        (_only_out(before_rsqrt=torch.abs), 4, "abs_1", "target `abs` interposed (`abs_1`) where `add` was expected"),
        (_only_out(keepdim=False), 8, "variance", "`variance` keepdim: literal False != True"),  # square: broadcasts
        (_only_out(eps=0.5), 4, "add", "eps: 0.5 fails the predicate of this wildcard"),
    ],
    ids=["literal", "used-outside", "guard", "interposed", "wrong-kwarg", "wildcard-predicate"],
)
def test_planted_near_miss_says_where_and_why(fn: Callable[..., Any], tokens: int, at: str, reason: str) -> None:
    r = compile_norm(fn, tokens)
    (miss,) = r.report.near_misses
    assert (miss.rule, miss.at, miss.reason) == ("rms_norm", at, reason)
    assert miss.site == "mul_1", "the site is the anchor: the weight product"


@pytest.mark.parametrize(("near_miss_min", "reported"), [(0.5, False), (0.1, True)])
def test_near_misses_below_the_threshold_are_not_reported(near_miss_min: float, reported: bool) -> None:
    """A defect right under the anchor (1 of the 7 pattern ops a float32 graph can have matched:
    the product; the elided cast counts on neither side) is noise at the default threshold, and
    shown when the threshold is lowered."""
    r = compile_norm(_only_out(after_mul=torch.abs), config=Config(near_miss_min=near_miss_min))
    planted = "target `abs` interposed (`h_1`) where `mul` was expected"
    assert (planted in [m.reason for m in r.report.near_misses]) is reported
    assert reported or not r.report.near_misses


def test_hf_llama_two_projection_mlp_is_a_silu_and_mul_near_miss() -> None:
    """HF Llama's MLP is act(gate_proj(x)) * up_proj(x): two linears, not slices of one (unless
    sibling linears are merged first, which is turned off here). The one-tensor rule says so; the
    library then takes the two outputs as ``fxr.act_mul``."""
    from fxrewrite import models

    model = models.build("llama", layers=1)
    fn, inputs = (lambda ids: model(ids).last_hidden_state), models.example_inputs(model)
    check_rewrite(fn, *inputs, rules=None, merge_siblings=False, expect={"fxr.silu_and_mul": 0, "fxr.act_mul": 1})
    r = check_rewrite(fn, *inputs, rules=activation.ONE_TENSOR_RULES, merge_siblings=False,
                      expect={"fxr.silu_and_mul": 0})  # fmt: skip
    (miss,) = [m for m in r.report.near_misses if m.rule == "silu_and_mul"]
    assert miss.reason.startswith("expected `slice`, found `linear`")
    assert miss.source.startswith("modeling_llama.py:")


def _clamped_norm(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A magnitude renormalization: the eps a clamp, not an addition (no norm op computes it)."""
    return x * target / torch.sqrt(torch.clamp_min(x.pow(2).mean(-1, keepdim=True), 1e-5))


def _reciprocal_root_of_other(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A product with a reciprocal root of something that is no mean of squares."""
    return x * torch.rsqrt(target.abs() + 1e-5)


def _product(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return x * (target + 1e-5)


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (_clamped_norm, "expected `add`, found `clamp`"),
        (_reciprocal_root_of_other, "expected `mean`, found `abs`"),
        (_product, None),
    ],
    ids=["clamped-eps", "rsqrt-of-other", "no-rsqrt"],
)
def test_a_product_with_a_reciprocal_root_is_a_norm_shaped_near_miss(fn: Callable[..., Any], reason: str | None) -> None:
    """The bare float32 norm rule matches 2 of its 5 operations (the product, the ``rsqrt``)
    before these differ: below the config's 0.5, yet a norm-shaped site, so the rule's own
    threshold reports it with why; a product with no reciprocal root is no site of it."""
    x, target = torch.randn(4, 8), torch.rand(4, 1) + 0.5
    r = check_rewrite(fn, x, target, rules=[norm.RMS_NORM_FLOAT32], dynamic=False, expect={"fxr.rms_norm": 0})
    misses = [m.reason for m in r.report.near_misses if m.rule == "rms_norm_float32"]
    if reason is None:
        assert not misses
    else:
        assert len(misses) == 1 and misses[0].startswith(reason), misses
    plain = check_rewrite(fn, x, target, rules=[norm.RMS_NORM_FLOAT32], dynamic=False, expect={"fxr.rms_norm": 0},
                          config=Config(near_miss_min=0.5))  # fmt: skip
    assert [m.reason for m in plain.report.near_misses] == misses, "the rule's own threshold, not the config's"
