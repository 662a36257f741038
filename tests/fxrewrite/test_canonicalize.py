"""Each canonical form: the canonical op appears, the other spellings are gone, numerics equal eager.

One Dynamo capture per form: the function under test returns every spelling of the form (and the
negative twins that must stay as they are), so op counts before and after say what happened.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from fxrewrite import meta
from fxrewrite.canonicalize import CAST, FLATTEN, MAX, RESHAPE, UNFLATTEN
from fxrewrite.canonicalize_shape import args_as, reshape_sizes
from fxrewrite.rule import trace
from fxrewrite.testing import Compiled, assert_counts, check_rewrite

A = torch.ops.aten


def canon(
    fn: Callable[..., Any],
    *inputs: Any,
    before: Mapping[str, int] = {},
    expect: Mapping[str, int] = {},
    absent: Iterable[str] = (),
    dynamic: bool = True,
) -> Compiled:
    """Capture ``fn`` with no rules (canonicalize + cleanup only); check op counts as captured
    (``before``) and after (``expect``, ``absent``) and the outputs against eager."""
    r = check_rewrite(fn, *inputs, rules=[], expect=expect, absent=absent, dynamic=dynamic)
    assert_counts(r.counts_before(), before)
    return r


def overloads(r: Compiled) -> collections.Counter[Any]:
    """How often each call_function target (an OpOverload for canonical ops) appears."""
    return collections.Counter(n.target for n in r.graph.graph.nodes if n.op == "call_function")


def calls(r: Compiled, target: Any) -> list[fx.Node]:
    return [n for n in r.graph.graph.nodes if n.op == "call_function" and n.target is target]


def outputs(r: Compiled) -> list[Any]:
    out = next(n for n in r.graph.graph.nodes if n.op == "output")
    return list(out.args[0])


def placeholder(r: Compiled, name: str) -> fx.Node:
    return next(n for n in r.graph.graph.nodes if n.op == "placeholder" and name in n.name)


class Merged(torch.nn.Module):
    """A linear whose output last dim (16) is static under ``dynamic=True``, as in a merged
    gate/up projection; ``fn`` gets that output."""

    def __init__(self, fn: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16, bias=False)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> Any:
        return self.fn(self.proj(x))


def x2d(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape or (4, 8)).to(dtype)


# -- method / function / operator forms -------------------------------------------------------


def _arith(x, y):
    return (
        x.add(y), torch.add(x, y), x + y,
        x.sub(y), torch.sub(x, y), x - y,
        x.mul(y), torch.mul(x, y), x * y,
        x.div(y), torch.div(x, y), x / y, torch.true_divide(x, y),
        x.neg(), torch.neg(x), -x,
    )  # fmt: skip


def test_method_function_operator_forms_become_one_aten_overload() -> None:
    r = canon(
        _arith, x2d(), x2d().abs() + 1,
        before={"method.add": 1, "torch.add": 1, "_operator.add": 1, "_operator.truediv": 1, "_operator.neg": 1},
        absent=["method", "torch", "_operator"],
    )  # fmt: skip
    assert overloads(r) == {A.add.Tensor: 3, A.sub.Tensor: 3, A.mul.Tensor: 3, A.div.Tensor: 4, A.neg.default: 3}
    for n in calls(r, A.add.Tensor):
        assert n.kwargs == {}, "alpha=1 is the default and is not spelled out"


def _dunders(x, y):
    # what Dynamo records for explicit dunder calls, and in torch 2.11 for some operators (``t == 0``)
    return x.__eq__(0), y.__radd__(x), x.__rsub__(y), y.__rtruediv__(x), x.__mul__(y), x.__neg__(), x.__lt__(y)


def test_operator_dunder_methods_become_their_operators() -> None:
    """Each dunder call is its operator, the reflected ones with their operands swapped
    (``y.__rtruediv__(x)`` is ``x / y``): numerics against eager catch a swap done wrong, since
    subtraction and division are not symmetric."""
    r = canon(_dunders, x2d(), x2d().abs() + 1,
              before={"method.__eq__": 1, "method.__radd__": 1, "method.__rsub__": 1, "method.__rtruediv__": 1,
                      "method.__mul__": 1, "method.__lt__": 1},
              absent=["method"])  # fmt: skip
    assert overloads(r) == {operator.eq: 1, operator.lt: 1, A.add.Tensor: 1, A.sub.Tensor: 1, A.div.Tensor: 1,
                            A.mul.Tensor: 1, A.neg.default: 1}  # fmt: skip
    x, y = placeholder(r, "x"), placeholder(r, "y")
    assert [n.args[:2] for n in calls(r, A.sub.Tensor) + calls(r, A.div.Tensor)] == [(y, x), (x, y)]
    assert calls(r, A.add.Tensor)[0].args[:2] == (x, y)


def test_kwargs_and_positional_give_identical_args() -> None:
    r = canon(
        lambda x: (x.mean(-1, keepdim=True), x.mean(dim=-1, keepdim=True), torch.mean(x, -1, True), x.mean(-1)),
        x2d(),
        expect={"aten.mean": 4},
        absent=["method.mean", "torch.mean"],
    )
    means = calls(r, A.mean.dim)
    assert [(n.args[1:], n.kwargs) for n in means[:3]] == [(([-1], True), {})] * 3
    assert means[3].args[1:] == ([-1], False), "negative twin: keepdim defaults to False"


# -- casts ------------------------------------------------------------------------------------


def _casts(x):
    ref = torch.ones(1)
    return x.float(), x.to(torch.float32), x.to(dtype=torch.float32), x.type(torch.float32), x.type_as(ref), x.to(ref)


def test_casts_become_convert_element_type() -> None:
    r = canon(
        _casts, x2d(dtype=torch.bfloat16),
        before={"method.float": 1, "method.to": 3, "method.type": 1, "method.type_as": 1},
        expect={"prims.convert_element_type": 1},
        absent=["method"],
    )  # fmt: skip
    # six spellings of one value: one cast, which every output reads
    [cast] = calls(r, CAST)
    assert cast.args[1] is torch.float32 and outputs(r) == [cast] * 6


def test_noop_casts_are_removed() -> None:
    r = canon(_casts, x2d(), before={"method.to": 3}, absent=["prims.convert_element_type", "method"])
    x = placeholder(r, "x")
    assert outputs(r) == [x] * 6


def test_cast_to_another_dtype_stays() -> None:
    r = canon(lambda x: (x.half(), x.to(torch.bfloat16), x.bfloat16().float()), x2d(),
              expect={"prims.convert_element_type": 3}, absent=["method"])  # fmt: skip
    # x.to(bfloat16) and x.bfloat16() are one value: one cast
    assert [n.args[1] for n in calls(r, CAST)] == [torch.float16, torch.bfloat16, torch.float32]


def test_casts_of_one_value_are_one_cast() -> None:
    """``q.float()`` written twice in one expression (a rotation that upcasts q for each term)
    is one cast, so the rotary rules see one input."""

    def twice(q: torch.Tensor) -> torch.Tensor:
        return q.float() * 2 + q.float().flip(-1)

    r = canon(twice, x2d(dtype=torch.bfloat16), expect={"prims.convert_element_type": 1})
    [cast] = calls(r, CAST)
    assert all(u.args[0] is cast for u in cast.users)


def _written_between(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = x * 2
    a = q.float()
    q.add_(s)  # q changes between the two casts: they are two values
    return a, q.float()


def _cast_written_later(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = x * 2
    a, b = q.float(), q.float()
    b.view(-1).mul_(2)  # one of the two is written through a view: they are two tensors
    return a, b


@pytest.mark.parametrize("fn", [_written_between, _cast_written_later], ids=["written-between", "written-later"])
def test_casts_that_are_not_one_value_stay_two(fn: Callable[..., Any]) -> None:
    inputs = (x2d(dtype=torch.bfloat16),) if fn is _cast_written_later else (x2d(dtype=torch.bfloat16),
                                                                              x2d(dtype=torch.bfloat16))  # fmt: skip
    r = canon(fn, *inputs, expect={"prims.convert_element_type": 2})
    a, b = calls(r, CAST)
    assert a is not b


def _upcasts(h, w, v):
    # h float32, w and v bfloat16: the first three casts are what promotion does anyway
    return h * w.float(), w.float() * h, h - w.to(torch.float32), w.float() * v, h.bfloat16() * w


def test_a_widening_cast_that_promotion_makes_anyway_is_removed() -> None:
    r = canon(
        _upcasts, x2d(4, 16), torch.randn(16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16),
        before={"method.float": 3, "method.to": 1, "method.bfloat16": 1},
        expect={"prims.convert_element_type": 2, "aten.mul": 4, "aten.sub": 1}, absent=["method"],
    )  # fmt: skip
    h, w = placeholder(r, "h"), placeholder(r, "w")
    assert [n.args for n in calls(r, A.mul.Tensor)][:2] == [(h, w), (w, h)]
    assert calls(r, A.sub.Tensor)[0].args == (h, w)
    # negative twins: w.float() * v (the cast makes it float32) and h.bfloat16() (narrowing) stay
    assert sorted(str(n.args[1]) for n in calls(r, CAST)) == ["torch.bfloat16", "torch.float32"]


def test_of_two_widening_casts_one_stays() -> None:
    """``x.float() + y.float()`` with both bfloat16 (vLLM's residual add): promotion makes one
    cast, not both; dropping both would add in bfloat16."""
    bf = x2d(dtype=torch.bfloat16)
    r = canon(lambda x, y: x.float() + y.float(), bf, x2d(dtype=torch.bfloat16),
              expect={"prims.convert_element_type": 1, "aten.add": 1})  # fmt: skip
    [cast] = calls(r, CAST)
    assert calls(r, A.add.Tensor)[0].args == (placeholder(r, "x"), cast) and cast.args[0] is placeholder(r, "y")


def _norm_reads_x_and_its_cast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # CPM-Ant's RMSNorm: the variance of x.float(), the product with x (promotion casts it again)
    v = x.float().pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(v + 1e-6), x.double() * torch.rsqrt(v)  # the second: float64 casts x itself


def test_arithmetic_reads_the_widening_cast_the_code_already_made() -> None:
    """``x * r`` with ``x`` bfloat16 and ``r`` float32 computes ``x.float() * r``: where the code
    made that cast before (the norm's variance reads it), the product reads it too, so both reads
    of the norm's input are one node, as in the spelling that casts once and reads it twice."""
    r = canon(_norm_reads_x_and_its_cast, x2d(dtype=torch.bfloat16),
              expect={"prims.convert_element_type": 2, "aten.mul": 2})  # fmt: skip
    to32, to64 = sorted(calls(r, CAST), key=lambda c: str(c.args[1]))
    assert (to32.args[1], to64.args[1]) == (torch.float32, torch.float64)
    first, second = calls(r, A.mul.Tensor)
    assert first.args[0] is to32  # the promotion's cast, made explicit by the one computed before
    # negative twin: promotion with float64 is not the float32 cast's dtype; x.double() stays its own
    assert second.args[0] is to64 and to64.args[0] is placeholder(r, "x")


def test_a_cast_computed_after_the_arithmetic_is_not_read_by_it() -> None:
    """The cast must come before the product: one made after it stays the later reader's alone."""

    def later(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * r
        return y, x.float().pow(2)

    r = canon(later, x2d(dtype=torch.bfloat16), x2d(4, 1), expect={"prims.convert_element_type": 1})
    assert calls(r, A.mul.Tensor)[0].args[0] is placeholder(r, "x")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rotations(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # x, c bfloat16 (Ernie 4.5 / DeepSeek-V4 cast after rotating, with tables in x's dtype)
    hoisted = x.float() * c + _rotate_half(x).float() * c
    rotated = _rotate_half(x)
    read_elsewhere = x.float() * c + rotated.float() * c  # the bf16 rotation is returned too: it stays
    return hoisted, read_elsewhere, rotated, (x * 2).float()  # x * 2 rounds: its cast stays after it


def test_a_cast_after_a_rearrangement_goes_before_it_onto_the_cast_the_code_made() -> None:
    """``rotate_half(x).float()`` next to ``x.float()`` reads as ``rotate_half(x.float())``: the
    slices, negation, stack and flatten keep every value, so both are the same numbers, and the
    rotation rules see one form whichever side of it the code upcasts."""
    r = canon(_rotations, x2d(4, 8, dtype=torch.bfloat16), x2d(4, 8, dtype=torch.bfloat16))
    x = placeholder(r, "x")
    casts = calls(r, CAST)
    [of_x] = [c for c in casts if c.args[0] is x]  # x.float() three times: one cast
    flattens = calls(r, FLATTEN)
    assert len(flattens) == 2  # the hoisted rotation in float32, the returned one in bf16
    by_dtype = {meta.tensor(n).dtype: n for n in flattens}
    hoisted, kept = by_dtype[torch.float32], by_dtype[torch.bfloat16]
    assert not any(c.args[0] is hoisted for c in casts)  # the cast went before the rotation
    assert any(c.args[0] is kept for c in casts)  # negative twin: the bf16 rotation is read elsewhere
    assert any(n.target is A.slice.Tensor for n in of_x.users)  # the hoisted rotation slices the cast
    # negative twin: (x * 2).float() keeps its cast after the product (a product rounds)
    assert any(c.args[0].target is A.mul.Tensor for c in casts)


def test_the_cast_of_an_fp8_operand_stays() -> None:
    """``s.float() * x`` with ``s`` float8: float8 types do not promote (torch raises), so the cast
    is what makes the product legal, not something promotion would do (NVFP4's block scales)."""
    s = torch.randn(4, 16).to(torch.float8_e4m3fn)
    r = canon(lambda s, x: s.float() * x, s, x2d(4, 16), expect={"prims.convert_element_type": 1, "aten.mul": 1})
    assert calls(r, A.mul.Tensor)[0].args[0] is calls(r, CAST)[0]


# -- elementwise forms ------------------------------------------------------------------------


def test_square_forms_become_pow_2() -> None:
    r = canon(
        lambda x, y: (x**2, x.pow(2), x * x, torch.square(x), x.square(), torch.pow(x, 2.0), x * y, x**3),
        x2d(), x2d(),
        before={"_operator.pow": 2, "method.pow": 1, "_operator.mul": 2, "torch.square": 1},
        expect={"aten.pow": 7, "aten.mul": 1},
        absent=["method", "torch", "_operator"],
    )  # fmt: skip
    assert [n.args[1] for n in calls(r, A.pow.Tensor_Scalar)] == [2] * 6 + [3]


def _rsqrt(x):
    s = torch.sqrt(x)  # read twice: negative twin, stays sqrt + reciprocal
    return 1 / torch.sqrt(x), torch.reciprocal(torch.sqrt(x)), x.sqrt().reciprocal(), 1 / x**0.5, s, 1 / s


def test_one_over_sqrt_becomes_rsqrt() -> None:
    canon(
        _rsqrt, x2d().abs() + 0.1,
        before={"torch.sqrt": 3, "_operator.truediv": 3, "torch.reciprocal": 1},
        expect={"aten.rsqrt": 4, "aten.sqrt": 1, "aten.reciprocal": 1},
        absent=["aten.div", "method", "torch", "_operator"],
    )  # fmt: skip


def test_silu_forms_become_aten_silu() -> None:
    r = canon(
        lambda x, y: (F.silu(x), x * torch.sigmoid(x), torch.sigmoid(x) * x, x * x.sigmoid(), x * torch.sigmoid(y)),
        x2d(), x2d(),
        before={"torch.nn.functional.silu": 1, "torch.sigmoid": 3, "_operator.mul": 4},
        expect={"aten.silu": 4, "aten.sigmoid": 1, "aten.mul": 1},
    )  # fmt: skip
    (mul,) = calls(r, A.mul.Tensor)
    assert mul.args[1].target is A.sigmoid.default, "negative twin: x * sigmoid(y) is no silu"


def test_softplus_forms_become_aten_softplus_with_beta_and_threshold() -> None:
    """``F.softplus`` and ``nn.Softplus`` (DeepSeek-V4's router scoring under its sqrt) are one
    op with both arguments bound, so a rule reads beta and threshold whichever way they were set."""
    r = canon(lambda x: (F.softplus(x), torch.nn.Softplus()(x), F.softplus(x, beta=2.0), F.softplus(x, 1, 5)), x2d(),
              expect={"aten.softplus": 4})  # fmt: skip
    assert [n.args[1:] for n in calls(r, A.softplus.default)] == [(1, 20), (1.0, 20.0), (2.0, 20), (1, 5)]


def _matmuls(x, w, v, w3):
    return (
        x @ w.t(), x @ w.T, x @ w.mT, torch.matmul(x, w.transpose(0, 1)), x.matmul(w.transpose(-1, -2)),
        torch.mm(x, w.t()), x @ w.permute(1, 0),
        x @ v,  # negative twin: no transpose
        x @ w3.transpose(-1, -2),  # negative twin: a batch of matrices, not one
    )  # fmt: skip


def test_matmul_of_a_transposed_matrix_becomes_linear() -> None:
    r = canon(
        _matmuls, x2d(4, 8), x2d(5, 8), x2d(8, 5), x2d(2, 5, 8),
        before={"_operator.matmul": 6, "torch.matmul": 1, "method.matmul": 1, "torch.mm": 1},
        expect={"aten.linear": 7, "_operator.matmul": 2}, absent=["method.t", "method.permute", "torch.mm"],
    )  # fmt: skip
    w = placeholder(r, "w")
    assert all(n.args[:2] == (placeholder(r, "x"), w) for n in calls(r, A.linear.default))


def test_scalar_first_arithmetic_puts_the_tensor_first() -> None:
    r = canon(
        lambda x: (2 * x, 1 - x, 2 / x, 1 / x, 3 + x),
        x2d().abs() + 0.1,
        expect={"aten.mul": 2, "aten.rsub": 1, "aten.reciprocal": 2, "aten.add": 1},
        absent=["aten.div", "_operator"],
    )
    mul2, rsub, mul_recip, recip, add = outputs(r)
    x = placeholder(r, "x")
    assert mul2.args == (x, 2) and rsub.args[:2] == (x, 1) and add.args == (x, 3)
    assert mul_recip.args[0].target is A.reciprocal.default and mul_recip.args[1] == 2
    assert recip.target is A.reciprocal.default and recip.args == (x,)


def test_clamp_spellings_become_aten_clamp() -> None:
    r = canon(
        lambda x: (x.clamp(0, 1), torch.clamp(x, min=0, max=1), x.clip(0, 1), torch.clip(x, 0, 1),
                   x.clamp(min=0), x.clamp_min(0), torch.clamp_max(x, 1), x.clamp(max=1)),
        x2d(),
        before={"method.clamp": 3, "method.clip": 1, "torch.clamp": 1, "torch.clip": 1},
        expect={"aten.clamp": 8}, absent=["method", "torch"],
    )  # fmt: skip
    bounds = [n.args[1:] for n in calls(r, A.clamp.default)]
    assert bounds == [(0, 1)] * 4 + [(0, None)] * 2 + [(None, 1)] * 2


def test_positive_reduction_dims_become_negative() -> None:
    r = canon(lambda x: (x.mean(1), x.mean([0, 1]), x.mean(dim=(0,), keepdim=True)), x2d(2, 4, 8),
              expect={"aten.mean": 3})  # fmt: skip
    assert [n.args[1] for n in calls(r, A.mean.dim)] == [[-2], [-3, -2], [-3]]


def test_sum_over_dims_becomes_aten_sum_and_full_sums_stay() -> None:
    r = canon(lambda x: (x.sum(-1, keepdim=True), torch.sum(x, dim=1), x.sum(), x.sum(-1, dtype=torch.float64)),
              x2d(2, 4, 8), before={"method.sum": 3, "torch.sum": 1}, expect={"aten.sum": 2, "method.sum": 2})  # fmt: skip
    assert [n.args[1:] for n in calls(r, A.sum.dim_IntList)] == [([-1], True), ([-2], False)]


# -- routing: softmax and top-k ----------------------------------------------------------------


def _softmaxes(x):
    return (F.softmax(x, dim=-1), torch.softmax(x, 1), x.softmax(dim=-1), F.softmax(x, -1, dtype=torch.float32),
            torch.softmax(x, -1, torch.float32), x.float().softmax(-1))  # fmt: skip


def test_softmax_forms_become_aten_softmax_with_its_dtype_as_a_cast() -> None:
    """``softmax(x, dtype=float32)`` casts ``x`` first (so documented): the same nodes as
    ``softmax(x.float())``; the negative twins keep the input's dtype."""
    r = canon(_softmaxes, x2d(dtype=torch.bfloat16), before={"torch.nn.functional.softmax": 2, "torch.softmax": 2},
              expect={"aten.softmax": 6, "prims.convert_element_type": 1}, absent=["method", "torch"])  # fmt: skip
    soft = calls(r, A.softmax.int)
    assert [n.args[1:] for n in soft] == [(-1, None)] * 6
    inputs = [n.args[0] for n in soft]
    assert [i.target is CAST and i.args[1] is torch.float32 for i in inputs] == [False] * 3 + [True] * 3
    assert len({i for i in inputs if i.target is CAST}) == 1  # one cast of x, read by the three
    assert [meta_dtype(n) for n in soft] == [torch.bfloat16] * 3 + [torch.float32] * 3


def meta_dtype(n: fx.Node) -> torch.dtype:
    return n.meta["example_value"].dtype


def test_topk_forms_become_aten_topk_with_every_argument() -> None:
    r = canon(lambda x: (torch.topk(x, 2), x.topk(2, dim=1), torch.topk(x, k=3, dim=-1, largest=False, sorted=False)),
              x2d(), before={"torch.topk": 2, "method.topk": 1}, expect={"aten.topk": 3},
              absent=["method", "torch"])  # fmt: skip
    assert [n.args[1:] for n in calls(r, A.topk.default)] == [(2, -1, True, True), (2, -1, True, True),
                                                              (3, -1, False, False)]  # fmt: skip


# -- shapes and views -------------------------------------------------------------------------


def test_view_and_reshape_become_aten_reshape() -> None:
    r = canon(
        lambda x: (x.view(2, 16), x.reshape(2, 16), torch.reshape(x, (2, 16)), x.view(-1), x.t().reshape(32)),
        x2d(), dynamic=False,
        before={"method.view": 2, "method.reshape": 2, "torch.reshape": 1},
        expect={"aten.reshape": 5}, absent=["method.view", "method.reshape", "torch.reshape"],
    )  # fmt: skip
    assert [n.args[1] for n in calls(r, A.reshape.default)][:3] == [[2, 16]] * 3


def test_reshape_to_the_same_shape_is_removed() -> None:
    r = canon(lambda x: (x.view(4, 8) + 1, x.reshape(x.shape) + 1, x.reshape(8, 4) + 1), x2d(), dynamic=False,
              expect={"aten.reshape": 1}, absent=["method"])  # fmt: skip
    x = placeholder(r, "x")
    assert [o.args[0] for o in outputs(r)][:2] == [x, x]


def _slices(h):
    a, b = h.chunk(2, -1)
    c, d = torch.split(h, 8, dim=2)
    e, f = h.split([8, 8], -1)
    full = h[..., 0:16] + h[:, :, :] + h.chunk(1, -1)[0]
    return a, b, c, d, e, f, h[..., :8], h[:, :, 8:], full, h[..., ::2]


def test_chunk_split_and_getitem_become_slices_along_a_negative_dim() -> None:
    r = canon(
        Merged(_slices), x2d(2, 3, 8),
        before={"method.chunk": 2, "torch.functional.split": 1, "method.split": 1, "_operator.getitem": 12},
        expect={"aten.slice": 9},
        absent=["method", "torch", "_operator.getitem"],
    )  # fmt: skip
    halves = [tuple(n.args[1:5]) for n in calls(r, A.slice.Tensor)]
    assert halves == [(-1, 0, 8, 1), (-1, 8, MAX, 1)] * 4 + [(-1, 0, MAX, 2)], "stepped (GPT-J pairs) too"
    full = outputs(r)[8]
    assert full.target is A.add.Tensor and full.args[0].target is A.add.Tensor, "full-range slices removed"


class Pieces(torch.nn.Module):
    """``fc(x).view(B, T, n, d)`` read piece by piece along the split dim: ``[..., i, :]``."""

    def __init__(self, n: int, pieces: list[int], split: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.fc, self.n, self.pieces, self.split = torch.nn.Linear(8, 64, bias=False), n, pieces, split

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, _ = x.shape
        y = self.fc(x).view(b, t, *(self.split or (self.n, -1)))
        return tuple(y[..., i, :] + 1 for i in self.pieces)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_piece_of_a_split_last_dim_becomes_a_last_dim_slice(dynamic: bool) -> None:
    """``h.view(B, T, 2, d)[..., i, :]`` is ``h[..., i*d:(i+1)*d]`` (a merged gate/up projection
    split in two by a view): the slice the gated-activation rules read."""
    r = canon(Pieces(4, [0, 1, 3]), x2d(2, 3, 8), dynamic=dynamic, expect={"aten.slice": 3},
              absent=["_operator.getitem", "aten.reshape", "aten.unflatten"])  # fmt: skip
    assert [tuple(n.args[1:4]) for n in calls(r, A.slice.Tensor)] == [(-1, 0, 16), (-1, 16, 32), (-1, 48, MAX)]


@pytest.mark.parametrize(
    ("pieces", "split"), [([-1], ()), ([0], (2, 2, 16))], ids=["negative-index", "last-dim-split-in-three"]
)
def test_piece_of_a_split_negative_twins(pieces: list[int], split: tuple[int, ...]) -> None:
    """A negative index (its offset needs the piece count) and a split in three pieces stay getitems."""
    canon(Pieces(2, pieces, split), x2d(2, 3, 8), dynamic=False, expect={"_operator.getitem": 1}, absent=["aten.slice"])


def test_flatten_method_and_function_become_one_op_with_negative_dims() -> None:
    r = canon(lambda x: (x.flatten(1) + 1, torch.flatten(x, -2, -1) + 1, x.flatten(start_dim=0, end_dim=1) + 1),
              x2d(2, 3, 8), expect={"aten.flatten": 3}, absent=["method.flatten", "torch.flatten"])  # fmt: skip
    assert [tuple(n.args[1:]) for n in calls(r, A.flatten.using_ints)] == [(-2, -1), (-2, -1), (-3, -2)]


def test_flatten_that_keeps_the_shape_is_removed() -> None:
    r = canon(lambda p, x: (p.flatten() + 1, x.flatten() + 1), torch.arange(6), x2d(2, 3),
              before={"method.flatten": 2}, expect={"aten.flatten": 1})  # fmt: skip
    assert outputs(r)[0].args[0] is placeholder(r, "p"), "an engine's 1-d positions: nothing to flatten"
    assert calls(r, A.flatten.using_ints)[0].args[0] is placeholder(r, "x"), "negative twin: 2-d is flattened"


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_reshape_that_merges_the_last_dims_becomes_flatten(dynamic: bool) -> None:
    """RoFormer's interleave ``stack((-x2, x1), -1).reshape_as(x)`` is GPT-J's ``.flatten(-2)``:
    a reshape (``view``, ``reshape``, ``view_as``, ``reshape_as``) that merges trailing dims and
    keeps the leading ones is ``aten.flatten(x, start, -1)``, symbolic sizes included."""

    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1)
        return pairs.reshape_as(x) + 1, pairs.view_as(x) + 1, y.view(y.shape[0], y.shape[1], -1) + 1, y.reshape(y.shape[0], -1) + 1

    r = canon(f, x2d(3, 8), x2d(3, 4, 2, 8), dynamic=dynamic, before={"method.reshape_as": 1, "method.view_as": 1},
              expect={"aten.flatten": 4}, absent=["method.reshape_as", "method.view_as", "method.view", "method.reshape"])  # fmt: skip
    assert [tuple(n.args[1:]) for n in calls(r, A.flatten.using_ints)] == [(-2, -1), (-2, -1), (-2, -1), (-3, -1)]


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_reshape_that_splits_the_last_dim_becomes_unflatten(dynamic: bool) -> None:
    """Llama 4's ``x.reshape(*x.shape[:-1], -1, 2)`` before ``view_as_complex``: a reshape that
    keeps the leading dims and splits the last is ``aten.unflatten(x, -1, [-1, *rest])``, as
    ``x.unflatten`` of the last dim (any sizes, either dim spelling) is written."""

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.view(x.shape[0], x.shape[1], 4, 2) + 1, x.reshape(*x.shape[:-1], -1, 2) + 1,
                x.unflatten(-1, (4, 2)) + 1, torch.unflatten(x, 2, (2, 2, 2)) + 1)  # fmt: skip

    r = canon(f, x2d(2, 3, 8), dynamic=dynamic, before={"method.unflatten": 1, "torch.unflatten": 1},
              expect={"aten.unflatten": 4}, absent=["method", "torch.unflatten", "aten.reshape"])  # fmt: skip
    assert [tuple(n.args[1:]) for n in calls(r, A.unflatten.int)] == [(-1, [-1, 2])] * 3 + [(-1, [-1, 2, 2])]


def test_reshape_that_does_not_merge_or_split_the_last_dims_stays_a_reshape() -> None:
    """Negative twin of both: merging leading dims, flattening to 1-d, regrouping, inserting a
    dim of 1, and ``view_as`` of a non-contiguous tensor stay as they are; ``unflatten`` of
    another dim keeps its sizes."""
    r = canon(lambda x, y: (x.reshape(-1, 8) + 1, x.view(-1) + 1, x.view(6, 4, 2) + 1, x.view(2, 3, 1, 8) + 1,
                            x[..., ::2].view_as(y) + 1, x.unflatten(0, (1, 2)) + 1),
              x2d(2, 3, 8), x2d(2, 12), dynamic=False,
              expect={"aten.reshape": 4, "method.view_as": 1, "aten.unflatten": 1}, absent=["aten.flatten"])  # fmt: skip
    assert [tuple(n.args[1:]) for n in calls(r, A.unflatten.int)] == [(-3, [1, 2])]


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_each_canonical_reshape_reads_as_the_sizes_a_reshape_writes(dynamic: bool) -> None:
    """What the matcher pairs a pattern's ``reshape(x, sizes)`` with: ``flatten`` and ``unflatten``
    read as the size list ``aten.reshape`` would be written with (the input's sizes, SymInts where
    symbolic, the merged dims one -1), a reshape as its own list. Twin: another op is no reshape."""
    r = canon(lambda x: (x.view(x.shape[0], x.shape[1], 4, 2) + 1, x.view(x.shape[0], -1) + 1, x.reshape(-1, 8) + 1),
              x2d(2, 3, 8), dynamic=dynamic, expect={"aten.unflatten": 1, "aten.flatten": 1, "aten.reshape": 1})  # fmt: skip
    b, t = meta.tensor(placeholder(r, "x")).shape[:2]
    assert isinstance(b, torch.SymInt) == dynamic
    (un,), (flat,), (re,) = calls(r, UNFLATTEN), calls(r, FLATTEN), calls(r, RESHAPE)
    keys = lambda sizes: [meta.dim_key(s) for s in sizes]  # noqa: E731
    assert keys(reshape_sizes(un)) == keys([b, t, -1, 2]) and keys(reshape_sizes(flat)) == keys([b, -1])
    assert reshape_sizes(re) == [-1, 8] and args_as(RESHAPE, un) == [un.args[0], reshape_sizes(un)]
    add = next(iter(un.users))
    assert reshape_sizes(add) is None and args_as(RESHAPE, add) is None

def test_index_select_method_and_function_become_aten_index_select() -> None:
    cache, pos = x2d(16, 8), torch.tensor([3, 0, 7])
    r = canon(lambda c, i: (c.index_select(0, i), torch.index_select(c, dim=1, index=i)), cache, pos,
              before={"method.index_select": 1, "torch.index_select": 1}, expect={"aten.index_select": 2},
              absent=["method.index_select", "torch.index_select"])  # fmt: skip
    assert [n.args[1] for n in calls(r, A.index_select.default)] == [-2, -1]


def _cat_with_empty(x):
    empty = x[..., 16:]  # the pass-through part of a rotary that rotates the whole head
    return torch.cat((x * 2, empty), dim=-1), torch.cat((x, empty, x + 1), dim=-1), torch.cat((x, x), dim=-1)


def test_cat_drops_operands_empty_along_its_dim() -> None:
    r = canon(Merged(_cat_with_empty), x2d(2, 3, 8), before={"torch.cat": 3}, expect={"torch.cat": 2})
    first, second, third = outputs(r)
    assert first.target is A.mul.Tensor, "a cat of one non-empty tensor is that tensor"
    assert len(second.args[0]) == 2, "the empty operand is dropped"
    assert len(third.args[0]) == 2, "negative twin: nothing empty, nothing dropped"


def test_contiguous_on_contiguous_is_removed() -> None:
    r = canon(lambda x: (x.contiguous() + 1, x.t().contiguous()), x2d(),
              before={"method.contiguous": 2}, expect={"method.contiguous": 1})  # fmt: skip
    x = placeholder(r, "x")
    assert outputs(r)[0].args[0] is x
    assert outputs(r)[1].args[0].target == "t", "negative twin: a transposed tensor keeps contiguous()"


def _cats(x):
    # Phi-3's partial rotary with rotary_dim == head_dim: the pass-through slice is empty
    whole = torch.cat([x * 2, x[..., 8:]], dim=-1)
    part = torch.cat([x * 3, x[..., 4:]], dim=-1)  # negative twin: nothing empty, the cat stays
    written = torch.cat([x * 4, x[..., 8:]], dim=-1)
    written.add_(1)  # negative twin: written in place, so it stays a fresh tensor
    return whole, part, written


def _cache_cats(x):
    # a KV cache that starts as torch.tensor([]): cat skips the 1-D empty at any dim
    first = torch.cat([x.new_zeros(0), x * 5], dim=-2)
    rows = torch.cat([x.new_zeros(0, 8), x * 6], dim=0)
    # negative twin: the empty float32 operand makes the result float32; dropping it would not
    promoted = torch.cat([x.new_zeros(0, 8), x.to(torch.bfloat16) * 7], dim=0)
    return first, rows, promoted


def test_cat_drops_a_pass_through_slice_left_empty() -> None:
    r = canon(_cats, x2d(4, 8), before={"torch.cat": 3}, expect={"torch.cat": 2}, dynamic=False)  # static width
    cats = [n for n in r.graph.graph.nodes if n.target is torch.cat]
    assert [len(n.args[0]) for n in cats] == [2, 1]


def test_cat_drops_the_legacy_empty_operand_at_any_dim() -> None:
    r = canon(_cache_cats, x2d(4, 8), before={"torch.cat": 3}, expect={"torch.cat": 1}, dynamic=False)
    assert outputs(r)[2].meta["example_value"].dtype == torch.float32


def test_expand_to_the_same_shape_is_removed() -> None:
    r = canon(lambda x: (x.expand(4, 8) + 1, x.expand_as(x) + 1, x.expand(2, 4, 8)), x2d(), dynamic=False,
              before={"method.expand": 2, "method.expand_as": 1}, expect={"method.expand": 1})  # fmt: skip
    x = placeholder(r, "x")
    assert [o.args[0] for o in outputs(r)[:2]] == [x, x]


# -- patterns canonicalize like graphs --------------------------------------------------------


def _norm_as_pattern(x, eps):
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _norm_as_model(x):
    h = x.to(dtype=torch.float32)
    return h * (1 / torch.sqrt(torch.mean(h * h, dim=2, keepdim=True) + 1e-6))


def _signature(gm: fx.GraphModule) -> list[tuple[Any, ...]]:
    """Target and literal arguments of every call, in order; nodes and the eps the pattern
    binds (a node there, a float literal in the model) compare by position only."""
    return [
        (n.target, tuple("_" if isinstance(a, (fx.Node, float)) else a for a in n.args))
        for n in gm.graph.nodes
        if n.op == "call_function"
    ]


def test_a_traced_pattern_canonicalizes_like_a_captured_graph() -> None:
    pattern = trace("norm", "pattern", _norm_as_pattern, {"eps": None})
    assert all(n.op != "call_method" for n in pattern.graph.nodes)
    r = canon(_norm_as_model, x2d(2, 3, 8, dtype=torch.bfloat16), expect={"prims.convert_element_type": 1})
    got = _signature(r.graph)
    assert got == _signature(pattern)
    assert [t for t, _ in got] == [CAST, A.pow.Tensor_Scalar, A.mean.dim, A.add.Tensor, A.rsqrt.default, A.mul.Tensor]


def test_canonicalize_keeps_operator_arithmetic_on_sizes() -> None:
    """Negative twin of the binary forms: arithmetic on symbolic sizes stays Python."""
    r = canon(lambda x: x.reshape(x.shape[0] * 2, -1), x2d(), before={"_operator.mul": 1},
              expect={"_operator.mul": 1, "aten.reshape": 1})  # fmt: skip
    (mul,) = [n for n in r.graph.graph.nodes if n.target is operator.mul]
    assert isinstance(mul.args[0], fx.Node)


def test_permute_of_transpose_composes_and_identity_goes() -> None:
    x = torch.randn(2, 3, 4, 5)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.transpose(1, 2)
        back = torch.ops.aten.permute.default(t, [0, 2, 1, 3])  # undoes the transpose
        other = torch.ops.aten.permute.default(t, [3, 2, 1, 0])  # does not
        return back + 1, other + 1

    r = canon(fn, x, expect={"aten.permute": 1})
    (p,) = calls(r, A.permute.default)
    assert p.args[0] is placeholder(r, "x") and list(p.args[1]) == [3, 1, 2, 0]
    assert outputs(r)[0].args[0] is placeholder(r, "x"), "identity removed"
