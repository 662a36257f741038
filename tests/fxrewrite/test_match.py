"""The node-walking matcher, feature by feature: each positive test has its negative twin.

Rules here are small user rules whose replacements call test ops (namespace ``fxrtest``), so a
rewrite shows in the op counts and the numerics still equal eager.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx

import fxrewrite.rewrite
import fxrewrite.runtime.ops  # noqa: F401  (torch.ops.fxr.rms_norm)
from fxrewrite import Backend, InPlace, Rule, RuleError, Scalar
from fxrewrite.testing import Compiled, check_rewrite, compile_once, op_name
from helpers.rewrites import LlamaRMSNorm

# -- test ops ---------------------------------------------------------------------------------

_BINARY = {"add": torch.add, "mul": torch.mul, "sub": torch.sub}


@torch.library.custom_op("fxrtest::relu_then", mutates_args=())
def relu_then(x: torch.Tensor, w: torch.Tensor, op: str) -> torch.Tensor:
    """``op(relu(x), w)``."""
    return _BINARY[op](torch.relu(x), w)


@torch.library.custom_op("fxrtest::add_relu", mutates_args=())
def add_relu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.relu(x + y)


@torch.library.custom_op("fxrtest::add_relu_", mutates_args=("x",))
def add_relu_(x: torch.Tensor, y: torch.Tensor) -> None:
    """In place: ``x = relu(x + y)``."""
    x.add_(y).relu_()


@torch.library.custom_op("fxrtest::add_relu_both", mutates_args=())
def add_relu_both(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``relu(x + y)`` and the sum."""
    s = x + y
    return torch.relu(s), s


@torch.library.custom_op("fxrtest::relu_relu", mutates_args=())
def relu_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)


def _like(x: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.empty_like(x)


relu_then.register_fake(_like)
add_relu.register_fake(_like)
relu_relu.register_fake(_like)
add_relu_.register_fake(lambda x, y: None)
add_relu_both.register_fake(lambda x, y: (torch.empty_like(x), torch.empty_like(x)))

# -- rules ------------------------------------------------------------------------------------


def relu_mul(x, w):
    return torch.relu(x) * w


def relu_add(x, w):
    return torch.relu(x) + w


def relu_sub(x, w):
    return torch.relu(x) - w


def _relu_then(op: str) -> Callable[..., Any]:
    def replacement(x, w):
        return torch.ops.fxrtest.relu_then(x, w, op)

    return replacement


def add_then_relu(x, y):
    return torch.relu(x + y)


def add_relu_replacement(x, y):
    return torch.ops.fxrtest.add_relu(x, y)


def add_relu_inplace(x, y):
    torch.ops.fxrtest.add_relu_(x, y)
    return x


def add_relu_and_sum(x, y):
    s = x + y
    return torch.relu(s), s


def add_relu_both_replacement(x, y):
    out = torch.ops.fxrtest.add_relu_both(x, y)
    return out[0], out[1]


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms(x, weight, eps):
    return weight * _rms(x, eps)


def rms_with_casts(x, weight, eps, dtype):
    return weight * _rms(x.float(), eps).to(dtype)


def rms_replacement(x, weight, eps):
    return torch.ops.fxr.rms_norm(x, weight, eps)


def casts_back(b) -> bool | str:
    return b["dtype"] == b["x"].dtype or f"casts back to {b['dtype']}, input is {b['x'].dtype}"


EPS = Scalar(float, lambda v: 0.0 < v < 0.1)
RELU_MUL = Rule("relu_mul", relu_mul, _relu_then("mul"))
RELU_ADD = Rule("relu_add", relu_add, _relu_then("add"))
RELU_SUB = Rule("relu_sub", relu_sub, _relu_then("sub"))
ADD_RELU = Rule("add_relu", add_then_relu, add_relu_replacement)
ADD_RELU_INPLACE = Rule("add_relu", add_then_relu, add_relu_replacement, inplace=InPlace(add_relu_inplace, ("x",)))
ADD_RELU_BOTH = Rule("add_relu_both", add_relu_and_sum, add_relu_both_replacement)


# relu(s) and -s: the second output is off the walk back from relu, one operation on the sum
def add_relu_and_neg_sum(x, y):
    s = x + y
    return torch.relu(s), -s


def add_relu_both_neg_replacement(x, y):
    out = torch.ops.fxrtest.add_relu_both(x, y)
    return out[0], -out[1]


ADD_RELU_NEG = Rule("add_relu_neg", add_relu_and_neg_sum, add_relu_both_neg_replacement)
RMS = Rule("rms", rms, rms_replacement, scalars={"eps": EPS})
RMS_CASTS = Rule("rms_casts", rms_with_casts, rms_replacement, casts_back, {"eps": EPS, "dtype": Scalar(torch.dtype)})

# -- helpers ----------------------------------------------------------------------------------


def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape or (4, 8)).to(dtype)


def fused(r: Compiled, name: str) -> list[fx.Node]:
    """The nodes calling ``torch.ops.<namespace>.<name>``."""
    return [n for n in r.graph.graph.nodes if n.op == "call_function" and op_name(n).endswith("." + name)]


def reasons(r: Compiled) -> list[str]:
    return [m.reason for m in r.report.near_misses]


def test_commutative_add_and_mul_match_either_order() -> None:
    r = check_rewrite(
        lambda x, w: (torch.relu(x) * w, w * torch.relu(x), torch.relu(x) + w, w + torch.relu(x)),
        t(), t(), rules=[RELU_MUL, RELU_ADD],
        expect={"fxrtest.relu_then": 4}, absent=["aten.relu", "aten.mul", "aten.add"],
    )  # fmt: skip
    assert r.report.rules() == {"relu_mul": 2, "relu_add": 2}


def test_non_commutative_op_with_swapped_args_does_not_match() -> None:
    r = check_rewrite(lambda x, w: (torch.relu(x) - w, w - torch.relu(x)), t(), t(), rules=[RELU_SUB],
                      expect={"fxrtest.relu_then": 1, "aten.relu": 1, "aten.sub": 1})  # fmt: skip
    (node,) = fused(r, "relu_then")
    assert node.args[2] == "sub"


# -- kwargs vs positional ---------------------------------------------------------------------


def test_kwargs_and_positional_spellings_match_one_pattern() -> None:
    """The pattern says ``x.pow(2).mean(-1, keepdim=True)``; the model ``torch.mean(x * x, dim=-1,
    keepdim=True)``. Twin: ``keepdim=False`` (a square input, so it still broadcasts)."""

    def f(x, w, sq):
        a = w * (x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6))
        b = w * (sq * torch.rsqrt(torch.mean(sq * sq, dim=-1, keepdim=False) + 1e-6))
        return a, b

    r = check_rewrite(f, t(), t(8), t(8, 8), rules=[RMS], expect={"fxr.rms_norm": 1, "aten.mean": 1})
    assert reasons(r) == ["`mean_1` keepdim: literal False != True"]


# -- scalar wildcards -------------------------------------------------------------------------


def _norm_fn(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


@pytest.mark.parametrize(
    ("make", "dynamic", "eps"),
    [(lambda: LlamaRMSNorm(8, 1e-6), False, 1e-6), (lambda: _norm_fn, True, 1e-5),
     (lambda: LlamaRMSNorm(8, 1e-6), True, None)],
    ids=["module-static-literal", "python-constant-literal", "module-dynamic-symfloat"],
)
def test_scalar_wildcard_binds_a_literal_or_a_symfloat(make: Any, dynamic: bool, eps: float | None) -> None:
    fn = make()
    inputs = (t(2, 3, 8),) if isinstance(fn, torch.nn.Module) else (t(2, 3, 8), t(8))
    r = check_rewrite(fn, *inputs, rules=[RMS], dynamic=dynamic, expect={"fxr.rms_norm": 1},
                      absent=["aten.rsqrt", "aten.mean"], specialize_floats=eps is not None)  # fmt: skip
    (node,) = fused(r, "rms_norm")
    bound = node.args[2]
    if eps is not None:
        assert bound == eps and r.counts_before()["method.item"] == 0
    else:  # eps lifted to a placeholder and read with .item(): a SymFloat node
        assert isinstance(bound, fx.Node) and bound.op == "call_method" and bound.target == "item"
        assert isinstance(bound.meta["example_value"], torch.SymFloat)
        assert r.counts_before()["method.item"] == 1


def test_scalar_wildcard_predicate_rejects() -> None:
    r = check_rewrite(LlamaRMSNorm(8, 0.5), t(2, 3, 8), rules=[RMS], dynamic=False,
                      expect={"fxr.rms_norm": 0, "aten.rsqrt": 1})
    assert reasons(r) == ["eps: 0.5 fails the predicate of this wildcard"]


# -- several outputs --------------------------------------------------------------------------


def test_several_outputs_both_used_downstream() -> None:
    def f(a, b):
        s = a + b
        return torch.relu(s) * 2, s * 3

    r = check_rewrite(f, t(), t(), rules=[ADD_RELU_BOTH], expect={"fxrtest.add_relu_both": 1, "aten.mul": 2},
                      absent=["aten.add", "aten.relu"])  # fmt: skip
    assert r.report.rules() == {"add_relu_both": 1}


def test_an_output_off_the_walk_pairs_with_a_reader_of_a_matched_node() -> None:
    def f(a, b):
        s = a + b
        n = -s  # computed before the relu, as vLLM casts the residual sum before its norm
        return torch.relu(s) * 2, n * 3

    r = check_rewrite(f, t(), t(), rules=[ADD_RELU_NEG], expect={"fxrtest.add_relu_both": 1, "aten.neg": 1},
                      absent=["aten.add", "aten.relu"])  # fmt: skip
    assert r.report.rules() == {"add_relu_neg": 1}


def test_an_output_off_the_walk_that_nothing_computes_is_a_near_miss() -> None:
    def f(a, b):
        s = a + b
        return torch.relu(s) * 2, torch.exp(s)  # the sum's other reader is not the pattern's neg

    r = check_rewrite(f, t(), t(), rules=[ADD_RELU_NEG], expect={"aten.add": 1, "aten.relu": 1})
    [miss] = r.report.near_misses
    assert miss.reason.startswith("no reader of `s` computes the pattern's output"), miss.reason


def _unrelated_outputs(x, y):
    return torch.relu(x), torch.sigmoid(y)


def _untraceable(x):
    if x.sum() > 0:  # data-dependent control flow: symbolic_trace cannot follow it
        return torch.relu(x)
    return x


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (Rule("unrelated", _unrelated_outputs, add_relu_both_replacement), "not computed on the way to the first"),
        (Rule("untraceable", _untraceable, torch.relu), "cannot be traced"),
        (Rule("one_for_two", add_relu_and_sum, add_relu_replacement), "returns 1 value(s), the pattern 2"),
        (Rule("bad_scalar", add_then_relu, add_relu_replacement, scalars={"eps": EPS}), "not pattern arguments"),
        (Rule("builtin", add_then_relu, torch.relu), "has no Python signature"),
    ],
    ids=["unrelated-outputs", "untraceable", "output-count", "unknown-scalar", "builtin"],
)
def test_broken_rules_raise_rule_error_naming_the_rule(rule: Rule, message: str) -> None:
    with pytest.raises(RuleError, match=re.escape(f"rule {rule.name!r}") + ".*" + re.escape(message)):
        Backend(rules=[rule])  # rules are traced at construction, before any model is compiled


def test_guard_that_raises_is_a_rule_error_naming_the_rule() -> None:
    rule = Rule("boom", add_then_relu, add_relu_replacement, guard=lambda b: 1 / 0)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as e:
        compile_once(lambda a, b: torch.relu(a + b), t(), t(), rules=[rule])
    assert isinstance(e.value.inner_exception, RuleError)
    assert "guard of rule 'boom' raised ZeroDivisionError" in str(e.value.inner_exception)


# -- containment, overlaps, cycles ------------------------------------------------------------


def test_internal_node_used_outside_blocks_the_match() -> None:
    def f(a, b):
        s = a + b
        return torch.relu(s), torch.relu(a * b + b), s  # the sum is used outside the first match

    r = check_rewrite(f, t(), t(), rules=[ADD_RELU], expect={"fxrtest.add_relu": 1, "aten.relu": 1, "aten.add": 1})
    assert reasons(r) == ["internal node `s` has 1 user(s) outside the match (`output`)"]


@pytest.mark.parametrize(("relus", "sites"), [(3, 1), (4, 2)])
def test_matches_never_overlap(relus: int, sites: int) -> None:
    def chain(x):
        for _ in range(relus):
            x = torch.relu(x)
        return x

    rule = Rule("relu_relu", lambda x: torch.relu(torch.relu(x)), lambda x: torch.ops.fxrtest.relu_relu(x))
    check_rewrite(chain, t(), rules=[rule], expect={"fxrtest.relu_relu": sites, "aten.relu": relus - 2 * sites})


def test_a_match_may_consume_a_replacement_made_earlier_in_the_pass() -> None:
    """relu(relu(x)) -> relu(x) on relu^3: the second match reads the first one's replacement
    (a node the pass created: it has a position for the ordering checks)."""
    rule = Rule("relu_idempotent", lambda x: torch.relu(torch.relu(x)), lambda x: torch.relu(x))
    r = check_rewrite(lambda x: torch.relu(torch.relu(torch.relu(x))), t(), rules=[rule], expect={"aten.relu": 1})
    assert r.report.rules() == {"relu_idempotent": 2}


def test_extra_output_read_before_the_match_ends_is_refused() -> None:
    """``z`` reads the sum and feeds the match: replacing would need the sum before it exists."""

    def cycle(a, b):
        s = a + b
        z = s.exp()
        return torch.relu(s) * z

    def rule_pattern(x, y, z):
        s = x + y
        return torch.relu(s) * z, s

    def rule_replacement(x, y, z):
        out = torch.ops.fxrtest.add_relu_both(x, y)
        return out[0] * z, out[1]

    rule = Rule("add_relu_mul", rule_pattern, rule_replacement)
    r = check_rewrite(cycle, t(), t(), rules=[rule], expect={"fxrtest.add_relu_both": 0, "aten.relu": 1})
    (reason,) = reasons(r)
    assert reason.startswith("output `s` is read by `z` before the match ends at `mul`")
    assert "reordering or form a cycle" in reason


# -- mutation safety --------------------------------------------------------------------------


def _dead_intermediate(a, b):
    h = a * 2
    return torch.relu(h + b)


def _graph_input(a, b):
    return torch.relu(a + b)


def _read_later(a, b):
    h = a * 2
    return torch.relu(h + b) + h


def _a_view(a, b):
    h = (a * 2).reshape(8, 4)
    return torch.relu(h + b.reshape(8, 4))


def _view_read_later(a, b):
    h = a * 2
    v = h.reshape(8, 4)
    return torch.relu(h + b), v + 1


@pytest.mark.parametrize(
    ("fn", "inplace"),
    [(_dead_intermediate, True), (_graph_input, False), (_read_later, False), (_a_view, False),
     (_view_read_later, False)],
    ids=lambda v: getattr(v, "__name__", str(v)).strip("_"),
)  # fmt: skip
def test_inplace_form_only_where_the_overwritten_tensor_is_dead(fn: Any, inplace: bool) -> None:
    a, b = t(), t()
    a0, b0 = a.clone(), b.clone()
    expect = {"fxrtest.add_relu_": int(inplace), "fxrtest.add_relu": int(not inplace)}
    r = check_rewrite(fn, a, b, rules=[ADD_RELU_INPLACE], expect=expect)
    assert [s.inplace for s in r.report.sites] == [inplace]
    assert torch.equal(a, a0) and torch.equal(b, b0), "graph inputs are never overwritten"


# -- the subgraph_rewriter mechanism ----------------------------------------------------------


def _fp32_only(b) -> bool | str:
    return b["x"].dtype == torch.float32 or f"x is {b['x'].dtype}"


SUBGRAPH = Rule("add_relu_sr", add_then_relu, add_relu_replacement, _fp32_only, via="subgraph_rewriter")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_subgraph_rewriter_rule_with_guard(dtype: torch.dtype) -> None:
    ok = dtype == torch.float32
    r = check_rewrite(lambda a, b: torch.relu(a * b + b), t(dtype=dtype), t(dtype=dtype), rules=[SUBGRAPH],
                      expect={"fxrtest.add_relu": int(ok), "aten.relu": int(not ok)})  # fmt: skip
    assert r.report.rules() == ({"add_relu_sr": 1} if ok else {})
    assert reasons(r) == ([] if ok else ["guard: x is torch.float64"])


# -- elided casts -----------------------------------------------------------------------------


def _norm_in_half(x):
    w = torch.ones(x.shape[-1], dtype=x.dtype)
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # no upcast


@pytest.mark.parametrize(
    ("make", "dtype", "sites"),
    [(lambda: LlamaRMSNorm(8), torch.float32, 1), (lambda: LlamaRMSNorm(8), torch.bfloat16, 1),
     (lambda: _norm_in_half, torch.float16, 0)],
    ids=["fp32-casts-elided", "bf16-casts-matched", "fp16-no-upcast"],
)
def test_pattern_casts_pair_with_nothing_when_the_dtype_matches(make: Any, dtype: torch.dtype, sites: int) -> None:
    fn = make()
    fn = fn.to(dtype) if isinstance(fn, torch.nn.Module) else fn
    expect = {"fxr.rms_norm": sites, "aten.rsqrt": 1 - sites}
    r = check_rewrite(fn, t(2, 3, 8, dtype=dtype), rules=[RMS_CASTS], expect=expect)
    assert r.counts_before()["method.to"] == 2 * sites  # the model's own casts, elided or matched


def relu_mul_upcast(x, w):
    return torch.relu(x) * w.to(torch.float32)


RELU_MUL_UPCAST = Rule("relu_mul_upcast", relu_mul_upcast, _relu_then("mul"))


@pytest.mark.parametrize(("x_dtype", "sites"), [(torch.float32, 1), (torch.bfloat16, 0)],
                         ids=["promotion-makes-the-cast", "the-cast-would-change-the-dtype"])  # fmt: skip
def test_a_pattern_upcast_pairs_with_nothing_where_promotion_makes_it(x_dtype: torch.dtype, sites: int) -> None:
    # the graph (as the canonicalizer leaves it) has no cast: relu(x) * w, w bfloat16
    r = check_rewrite(lambda x, w: torch.relu(x) * w, t(4, 8, dtype=x_dtype), t(8, dtype=torch.bfloat16),
                      rules=[RELU_MUL_UPCAST], expect={"fxrtest.relu_then": sites, "aten.mul": 1 - sites})  # fmt: skip
    assert bool(reasons(r)) == (sites == 0)


# -- a pattern's reshape and the graph's canonical spellings of it ------------------------------

RESHAPE = torch.ops.aten.reshape.default


def relu_of_reshape(x, sizes):
    return torch.relu(RESHAPE(x, sizes))


def reshape_of_relu(x, sizes):
    return RESHAPE(torch.relu(x), sizes)


def relu_of_pairs(x):
    return torch.relu(RESHAPE(x, [2, 3, -1, 2]))


def reshaped_relu(x, sizes):
    return RESHAPE(torch.ops.fxrtest.relu_relu(x), sizes)


def pairs_relu(x):
    return RESHAPE(torch.ops.fxrtest.relu_relu(x), [2, 3, -1, 2])


RELU_OF_RESHAPE = Rule("relu_of_reshape", relu_of_reshape, reshaped_relu, scalars={"sizes": Scalar(list)})
RESHAPE_OF_RELU = Rule("reshape_of_relu", reshape_of_relu, reshaped_relu, scalars={"sizes": Scalar(list)})
RELU_OF_PAIRS = Rule("relu_of_pairs", relu_of_pairs, pairs_relu)


def test_a_pattern_reshape_pairs_with_each_canonical_spelling_of_the_graph() -> None:
    """A pattern is canonicalized without shapes: its ``reshape(x, sizes)`` stays a reshape, where
    the graph's split of the last dim became ``unflatten`` and its merge of the last dims
    ``flatten``. Each pairs, the sizes bound as a reshape writes them, also with the reshape as
    the anchor. Twin: a literal size list, which another split does not write."""

    def f(x):
        return (torch.relu(x.view(2, 3, 4, 2)), torch.relu(x.view(2, 24)), torch.relu(x.view(6, 8)),
                torch.relu(x).view(2, 3, 4, 2))  # fmt: skip

    r = check_rewrite(f, t(2, 3, 8), rules=[RELU_OF_RESHAPE, RESHAPE_OF_RELU], dynamic=False,
                      expect={"fxrtest.relu_relu": 4, "aten.relu": 0, "aten.unflatten": 0, "aten.flatten": 0})  # fmt: skip
    assert r.counts_before()["method.view"] == 4 and r.report.rules() == {"relu_of_reshape": 3, "reshape_of_relu": 1}
    sizes = [n.args[1] for n in r.graph.graph.nodes if n.op == "call_function" and n.target is RESHAPE]
    assert sorted(sizes) == [[2, -1], [2, 3, -1, 2], [2, 3, -1, 2], [6, 8]]
    r = check_rewrite(lambda x: (torch.relu(x.view(2, 3, 4, 2)), torch.relu(x.view(2, 3, 2, 4))), t(2, 3, 8),
                      rules=[RELU_OF_PAIRS], dynamic=False, expect={"fxrtest.relu_relu": 1, "aten.unflatten": 1})  # fmt: skip
    assert reasons(r) == ["`view_1` shape: literal 4 != 2"]


# -- replacement checks -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replacement", "why"),
    [(lambda x: torch.relu(x).to(torch.float64), "is torch.float64, the pattern's torch.float32"),
     (lambda x: torch.sum(torch.relu(x), -1), "replacement output shape (s77,) != pattern's (s77, s27)"),
     # a method canonicalize leaves as written: its node gets no fake value (sum now gets one)
     (lambda x: torch.relu(x).prod(-1), "has no fake value")],
    ids=["dtype", "shape", "unknown"],
)  # fmt: skip
def test_replacement_with_other_dtype_or_shape_is_rejected(replacement: Any, why: str) -> None:
    rule = Rule("bad_replacement", lambda x: torch.relu(torch.exp(x)), replacement)
    r = check_rewrite(lambda x: torch.relu(torch.exp(x)), t(), rules=[rule], expect={"aten.relu": 1, "aten.exp": 1})
    assert not r.report.sites
    (rejected,) = r.report.rejected
    assert rejected.rule == "bad_replacement" and why in rejected.reason


# -- cost -------------------------------------------------------------------------------------


def test_one_pass_tries_each_anchor_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Anchors are indexed by target: the matcher starts only at relu nodes, once each."""
    tried: list[fx.Node] = []
    real = fxrewrite.rewrite.match_at

    def counting(rule: Rule, anchor: fx.Node) -> Any:
        tried.append(anchor)
        return real(rule, anchor)

    monkeypatch.setattr(fxrewrite.rewrite, "match_at", counting)

    def blocks(x, y):
        for _ in range(16):
            x = torch.relu(x * 2 + y) * 0.5
        return x

    r = check_rewrite(blocks, t(), t(), rules=[ADD_RELU], expect={"fxrtest.add_relu": 16, "aten.relu": 0})
    assert r.counts_before()["torch.relu"] == 16
    assert len(tried) == 16 and len(set(tried)) == 16


# -- a value written in place inside the matched span ---------------------------------------------


def _norm_of(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


def write_between(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x * 1.0
    var = h.pow(2).mean(-1, keepdim=True)
    h.mul_(2)  # the norm's statistic read h before the write, its product after
    return w * (h * torch.rsqrt(var + 1e-6))


def write_through_a_view_between(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x * 1.0
    var = h.pow(2).mean(-1, keepdim=True)
    h.view(-1).mul_(2)
    return w * (h * torch.rsqrt(var + 1e-6))


def write_before(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x * 1.0
    h.mul_(2)
    return _norm_of(h, w)


def write_after(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x * 1.0
    out = _norm_of(h, w)
    h.mul_(2)
    return out, h


def write_to_what_only_the_anchor_reads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h, w2 = x * 1.0, w * 1.0
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    w2.mul_(2)  # inside the matched span, but the weight is read once, by the last node
    return w2 * normed


@pytest.mark.parametrize(("fn", "fused"), [(write_between, False), (write_through_a_view_between, False),
                                           (write_before, True), (write_after, True),
                                           (write_to_what_only_the_anchor_reads, True)])  # fmt: skip
def test_a_value_written_in_place_between_its_reads_is_not_matched(fn: Callable[..., Any], fused: bool) -> None:
    """An RMSNorm whose input is overwritten (directly or through a view) between the mean that
    reads it and the product that reads it again is not one norm of one value: the match is
    refused with the writer named, and the output equals eager; written before or after the
    norm's reads, or where only the last node reads it (its weight), it fuses."""
    r = compile_once(fn, torch.randn(4, 64), torch.randn(64))
    assert r.report.rules() == ({"rms_norm": 1} if fused else {})
    torch.testing.assert_close(r.output, r.eager, rtol=1e-5, atol=1e-5)  # a tensor, or (norm, h)
    if not fused:
        why = [n.reason for n in r.report.near_misses if n.rule == "rms_norm"]
        assert why == ["`h` is written in place by `mul_` between the nodes that read it (the fused op would read it "
                       "once, at `mul_2`)"], why  # fmt: skip
