"""LayerNorm rules (rewrites/layernorm.py): the library call, LayerNorm written out, weight and
bias, the cast back, the residual add before it, in place.

Each rule: positive tests over the spellings model code uses, and negative twins whose one defect
must keep the rule off (and show as a near miss where the rule says why).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, DYNAMIC, F32, check, fused_nodes, reasons, sites

from fxrewrite.rewrites import layernorm, norm, norm_variants
from fxrewrite.rewrites import PIPELINE

DTYPE_DYNAMIC = pytest.mark.parametrize(
    ("dtype", "dynamic"), [(F32, True), (F32, False), (BF16, "lifted")], ids=["f32-dynamic", "f32-static", "bf16-lifted"]
)
N = 64


def affine(n: int = N, bias: bool = True) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
    w = torch.nn.Parameter(1 + 0.1 * torch.randn(n))
    return w, torch.nn.Parameter(0.1 * torch.randn(n)) if bias else None


# -- the library call: spellings ---------------------------------------------------------------


class Functional(torch.nn.Module):
    """``F.layer_norm`` and ``torch.layer_norm`` as model code calls them."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.spelling = spelling
        self.weight, self.bias = affine()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.spelling == "positional":
            return F.layer_norm(x, (N,), w, b, 1e-5)
        if self.spelling == "keywords":
            return F.layer_norm(x, normalized_shape=[N], weight=w, bias=b, eps=1e-6)
        if self.spelling == "torch.layer_norm":
            return torch.layer_norm(x, [N], w, b, 1e-5)
        if self.spelling == "default-eps":
            return F.layer_norm(x, x.shape[-1:], w, b)
        raise AssertionError(self.spelling)


SPELLINGS: dict[str, Callable[[], torch.nn.Module]] = {
    "nn.LayerNorm": lambda: torch.nn.LayerNorm(N),
    "nn.LayerNorm-no-bias": lambda: torch.nn.LayerNorm(N, bias=False),
    "nn.LayerNorm-no-affine": lambda: torch.nn.LayerNorm(N, elementwise_affine=False),
    **{s: (lambda s=s: Functional(s)) for s in ("positional", "keywords", "torch.layer_norm", "default-eps")},
}


@DTYPE_DYNAMIC
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_library_layer_norm_spellings(spelling: str, dtype: torch.dtype, dynamic: bool | str) -> None:
    model = SPELLINGS[spelling]().to(dtype)
    with torch.no_grad():  # a bias that is not zero, a weight that is not one
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    r = check(model, torch.randn(2, 5, N, dtype=dtype), expect={"layer_norm": 1}, dynamic=dynamic)
    assert [s.rule for s in sites(r)] == ["layer_norm"]
    assert not r.report.near_misses
    ((x, w, b, eps, cast_last),) = [n.args for n in fused_nodes(r, "layer_norm")]
    assert cast_last is True and (w is None) == (spelling == "nn.LayerNorm-no-affine")
    assert (b is None) == spelling.startswith(("nn.LayerNorm-no", ))


def test_olmo_weightless_layer_norm_in_float32_rounds_once() -> None:
    """OLMo: ``F.layer_norm(x.float(), shape, None, None).to(dtype)``: the library call on the
    upcast input, then the cast taken in; the op computes it and rounds once, as the graph does."""

    def olmo(x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.to(dtype=torch.float32), (N,), None, None, eps=1e-5).to(x.dtype)

    x = torch.randn(3, N, dtype=BF16)
    r = check(olmo, x, expect={"layer_norm": 1}, exact=True)
    assert [s.rule for s in sites(r)] == ["layer_norm", "layer_norm_cast"]
    ((arg, w, b, eps, cast_last),) = [n.args for n in fused_nodes(r, "layer_norm")]
    assert arg.meta["example_value"].dtype == BF16 and (w, b, cast_last) == (None, None, True)
    assert not r.report.near_misses


# -- the library call: negative twins ----------------------------------------------------------


def test_layer_norm_over_two_dims_is_not_fused() -> None:
    def two_dims(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (4, N), w, None, 1e-5)

    r = check(two_dims, torch.randn(2, 4, N), torch.randn(4, N), expect={}, dynamic=False)
    assert reasons(r, "layer_norm") == ["guard: normalizes over 2 dims [4, 64]: the op normalizes the last"]


def test_layer_norm_of_integers_is_not_a_case() -> None:
    """The guard's dtype check, called directly: no model can run layer_norm on integers."""
    from fxrewrite.rule import Bindings

    class Fake:
        dtype, shape = torch.int32, (2, N)

    why = layernorm.layer_norm_guard(Bindings({"x": Fake(), "shape": [N], "weight": None, "bias": None}))
    assert why == "input dtype int32 is not floating point"


# -- written out: spellings --------------------------------------------------------------------


class Written(torch.nn.Module):
    """LayerNorm with its computation written out, the ways model code writes it (``spelling``)."""

    def __init__(self, spelling: str, n: int = N, eps: float = 1e-5) -> None:
        super().__init__()
        self.spelling, self.eps = spelling, eps
        self.weight, self.bias = affine(n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, w, b, eps = self.spelling, self.weight, self.bias, self.eps
        if s == "cohere":  # the deviation written twice, weight in float32, then the cast
            h = x.to(torch.float32)
            m = h.mean(-1, keepdim=True)
            v = (h - m).pow(2).mean(-1, keepdim=True)
            h = (h - m) * torch.rsqrt(v + eps)
            return (w.to(torch.float32) * h).to(x.dtype)
        if s == "deberta":  # / sqrt, the cast, then weight and bias in the input dtype
            h = x.float()
            m = h.mean(-1, keepdim=True)
            v = (h - m).pow(2).mean(-1, keepdim=True)
            h = (h - m) / torch.sqrt(v + eps)
            return w * h.to(x.dtype) + b
        if s == "deviation-once":  # d computed once, d * d
            h = x.float()
            d = h - torch.mean(h, dim=-1, keepdim=True)
            h = d * torch.rsqrt(torch.mean(d * d, dim=-1, keepdim=True) + eps)
            return (h * w + b).type_as(x)
        if s == "var-unbiased-false":  # var of the input, rounded, then weight and bias
            h = x.float()
            y = (h - h.mean(dim=-1, keepdim=True)) * torch.rsqrt(h.var(dim=-1, keepdim=True, unbiased=False) + eps)
            return y.to(x.dtype) * w + b
        if s == "torch.var-correction-0":  # no casts: written for float32
            m = x.mean(-1, keepdim=True)
            return (x - m) / torch.sqrt(torch.var(x, -1, keepdim=True, correction=0) + eps) * w + b
        raise AssertionError(s)


WRITTEN = {
    # spelling: (rules of the sites in float32, in bf16)
    "cohere": (["layer_norm_mean_sq", "layer_norm_weight"], ["layer_norm_mean_sq", "layer_norm_weight", "layer_norm_cast"]),
    "deberta": (["layer_norm_mean_sq", "layer_norm_weight", "layer_norm_bias"],
                ["layer_norm_mean_sq", "layer_norm_cast", "layer_norm_weight_rounded", "layer_norm_bias_rounded"]),
    "deviation-once": (["layer_norm_mean_sq_once", "layer_norm_weight", "layer_norm_bias"],
                       ["layer_norm_mean_sq_once", "layer_norm_weight", "layer_norm_bias", "layer_norm_cast"]),
    "var-unbiased-false": (["layer_norm_var", "layer_norm_weight", "layer_norm_bias"],
                           ["layer_norm_var", "layer_norm_cast", "layer_norm_weight_rounded", "layer_norm_bias_rounded"]),
}  # fmt: skip


@DTYPE_DYNAMIC
@pytest.mark.parametrize("spelling", list(WRITTEN))
def test_written_layer_norm_spellings(spelling: str, dtype: torch.dtype, dynamic: bool | str) -> None:
    """One op for the whole norm, whichever side of the weight the cast falls: the steps compute
    exactly what they replace, so in bf16 the output is eager's to the bit."""
    model = Written(spelling).to(dtype)
    r = check(model, torch.randn(2, 5, N, dtype=dtype), expect={"layer_norm": 1}, dynamic=dynamic,
              exact=dtype == BF16 and spelling != "deberta")  # fmt: skip
    assert [s.rule for s in sites(r)] == WRITTEN[spelling][dtype == BF16]
    assert not r.report.near_misses
    left = r.counts()
    assert left["aten.mean"] == left["aten.rsqrt"] == left["aten.mul"] == left["aten.add"] == 0
    ((x, w, b, eps, cast_last),) = [n.args for n in fused_nodes(r, "layer_norm")]
    assert (b is None) == (spelling == "cohere")
    if dtype == BF16:  # where the rounding to bf16 falls
        assert cast_last is (spelling in ("cohere", "deviation-once"))


def test_written_layer_norm_without_casts_in_float32() -> None:
    check(Written("torch.var-correction-0"), torch.randn(3, N), expect={"layer_norm": 1})


@pytest.mark.parametrize("bias", [True, False], ids=["weight-bias", "weight"])
def test_library_and_written_norms_compute_the_same(bias: bool) -> None:
    """The op the written form becomes is the op nn.LayerNorm becomes (float32)."""
    ln = torch.nn.LayerNorm(N, bias=bias)
    written = Written("deviation-once")
    with torch.no_grad():
        written.weight.copy_(ln.weight)
        written.bias.copy_(ln.bias if bias else torch.zeros(N))
    x = torch.randn(4, N)
    torch.testing.assert_close(written(x), ln(x), rtol=1e-5, atol=1e-5)
    check(written, x, expect={"layer_norm": 1})


# -- written out: negative twins ---------------------------------------------------------------


class Defective(torch.nn.Module):
    """A LayerNorm written out in float32 with one defect planted (``kind``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.weight = torch.nn.Parameter(torch.randn((4, N) if kind == "weight-shape" else N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, h = self.kind, x.float()
        if k == "bf16-math":  # no upcast: the code rounds at every step
            h = x
        dims = (-2, -1) if k == "two-dims" else -1
        m = h.mean(dims, keepdim=True)
        if k == "biased-var":
            v = h.var(-1, keepdim=True)
        else:
            v = (h - m).pow(2).mean(dims, keepdim=True)
        eps = 0.5 if k == "eps-too-large" else 1e-5
        return self.weight * ((h - m) * torch.rsqrt(v + eps)).to(x.dtype)


@pytest.mark.parametrize(
    ("kind", "dtype", "rule", "reason", "left"),
    [
        ("biased-var", F32, "layer_norm_var", "`v` correction: literal 1 != 0", {}),
        ("eps-too-large", F32, "layer_norm_mean_sq", "eps: 0.5 fails the predicate of this wildcard", {}),
        ("bf16-math", BF16, "layer_norm_mean_sq", "guard: computed in bfloat16: the op computes in float32 and rounds once",
         {}),
        # the norm fuses, the weight (4, 64) stays a multiply
        ("weight-shape", F32, "layer_norm_weight", "guard: weight shape (4, 64) != normalized dim (64,)", {"layer_norm": 1}),
    ],
)  # fmt: skip
@DYNAMIC
def test_written_layer_norm_negative_twins(kind: str, dtype: torch.dtype, rule: str, reason: str,
                                           left: dict[str, int], dynamic: bool | str) -> None:  # fmt: skip
    model = Defective(kind).to(dtype)
    r = check(model, torch.randn(2, 4, N, dtype=dtype), expect=left, dynamic=dynamic)
    assert reasons(r, rule) == [reason]


def test_norm_over_two_dims_is_not_fused() -> None:
    """The mean over (-2, -1): the shortest written pattern gets half-way and says so."""
    r = check(Defective("two-dims"), torch.randn(2, 4, N), expect={})
    assert r.counts()["aten.mean"] == 2
    assert reasons(r, "layer_norm_var") == ["`m` dim: expected 1 values, found [-2, -1]"]


def test_weight_applied_before_the_rounding_and_bias_after_is_not_one_op() -> None:
    """``(w * norm).to(bf16) + b``: the op rounds once after both or before both; the bias stays
    an add, and the step says why."""

    def odd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = x.float()
        d = h - h.mean(-1, keepdim=True)
        return (w * (d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5))).to(x.dtype) + b

    args = torch.randn(3, N, dtype=BF16), torch.randn(N, dtype=BF16), torch.randn(N, dtype=BF16)
    r = check(odd, *args, expect={"layer_norm": 1})
    assert reasons(r, "layer_norm_bias_rounded") == [
        "guard: scaled in float32 before the rounding to bfloat16, shifted after it"]
    assert r.counts()["aten.add"] == 1


def test_cast_back_to_another_dtype_stays_a_cast() -> None:
    """The cast step says nothing (in float32 every site would be its near miss): the norm fuses
    in float32 and the cast to float16 stays."""

    def to_half(x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        d = h - h.mean(-1, keepdim=True)
        return (d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.float16)

    r = check(to_half, torch.randn(3, N, dtype=BF16), expect={"layer_norm": 1})
    ((x, *_),) = [n.args for n in fused_nodes(r, "layer_norm")]
    assert x.meta["example_value"].dtype == F32 and not r.report.near_misses


# -- residual add + LayerNorm ------------------------------------------------------------------


def library_norm(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.layer_norm(h, (h.shape[-1],), w, b, 1e-5)


def written_norm(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    f = h.float()
    m = f.mean(-1, keepdim=True)
    f = (f - m) * torch.rsqrt((f - m).pow(2).mean(-1, keepdim=True) + 1e-5)
    return (w.float() * f).to(h.dtype)


class AddNorm(torch.nn.Module):
    """``x`` and ``residual`` are intermediates (``a * 2``, ``b + 1``) unless ``kind`` says
    otherwise; the sum flows on as the next residual (pre-norm) unless ``kind`` is post-norm."""

    def __init__(self, kind: str = "dead", written: bool = False) -> None:
        super().__init__()
        self.kind, self.norm = kind, written_norm if written else library_norm
        self.weight, self.bias = affine()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        k, w, bias, norm_ = self.kind, self.weight, self.bias, self.norm
        x, residual = a * 2, b + 1
        if k == "dead":
            s = x + residual
            return norm_(s, w, bias), s
        if k == "post-norm":  # BERT: LayerNorm(h + input), the sum read by nothing else
            return norm_(x + residual, w, bias) * 3
        if k == "residual-first":
            s = torch.add(residual, x)
            return norm_(s, w, bias), s
        if k == "parallel":  # GPT-J, Falcon, Phi: one norm read by attention and MLP
            s = x + residual
            h = norm_(s, w, bias)
            return torch.relu(h) + torch.sigmoid(h) + s
        if k == "two-norms":  # Falcon's new decoder: two norms of one sum
            s = x + residual
            return norm_(s, w, bias) + norm_(s, 2 * w, bias), s
        if k == "residual-is-input":
            s = x + b
            return norm_(s, w, bias), s
        if k == "x-read-later":
            s = x + residual
            return norm_(s, w, bias) + x, s
        if k == "residual-read-later":
            s = x + residual
            return norm_(s, w, bias), s, residual * 3
        if k == "x-is-view":
            x = x.reshape(-1, x.shape[-1])
            s = x + residual.reshape(-1, x.shape[-1])
            return norm_(s, w, bias), s
        if k == "sum-read-before-norm-ends":
            s = x + residual
            t = s.sum(-1, keepdim=True)
            return norm_(s, w, bias) + t, s
        if k == "broadcast-residual":
            s = x + residual[..., :1, :]
            return norm_(s, w, bias), s
        raise AssertionError(k)


INPLACE = {
    # kind: (fused ops, in place, note pattern)
    "dead": ({"fused_add_layer_norm_": 1}, True, ""),
    "post-norm": ({"fused_add_layer_norm_": 1}, True, ""),
    "residual-first": ({"fused_add_layer_norm_": 1}, True, ""),
    "parallel": ({"fused_add_layer_norm_": 1}, True, ""),
    "two-norms": ({"fused_add_layer_norm_": 1, "layer_norm": 1}, True, ""),
    "residual-is-input": ({"fused_add_layer_norm": 1}, False, r"functional: residual \(`l_b_`\) is a graph input"),
    "x-read-later": ({"fused_add_layer_norm": 1}, False, r"functional: x \(`x`\) is read later by `\w+`"),
    "residual-read-later": ({"fused_add_layer_norm": 1}, False,
                            r"functional: residual \(`residual`\) is read later by `\w+`"),
    "x-is-view": ({"fused_add_layer_norm": 1}, False, r"functional: x \(`\w+`\) may alias other storage"),
}  # fmt: skip


@pytest.mark.parametrize("written", [False, True], ids=["library", "written"])
@pytest.mark.parametrize("kind", list(INPLACE))
def test_add_layer_norm_in_place_only_where_proven_safe(kind: str, written: bool) -> None:
    ops, inplace, note = INPLACE[kind]
    a, b = torch.randn(2, 3, N), torch.randn(2, 3, N)
    a0, b0 = a.clone(), b.clone()
    r = check(AddNorm(kind, written), a, b, expect=ops)
    (site,) = sites(r, "add_layer_norm")
    assert site.inplace is inplace
    assert re.fullmatch(note, site.note), site.note
    assert torch.equal(a, a0) and torch.equal(b, b0), "graph inputs must never be overwritten"
    assert not r.report.near_misses


@pytest.mark.parametrize("written", [False, True], ids=["library", "written"])
@pytest.mark.parametrize(("dtype", "dynamic"), [(BF16, True), (BF16, False), (F32, "lifted")],
                         ids=["bf16-dynamic", "bf16-static", "f32-lifted"])  # fmt: skip
def test_add_layer_norm_numerics(dtype: torch.dtype, dynamic: bool | str, written: bool) -> None:
    a, b = torch.randn(5, N, dtype=dtype), torch.randn(5, N, dtype=dtype)
    r = check(AddNorm("dead", written).to(dtype), a, b, expect={"fused_add_layer_norm_": 1}, dynamic=dynamic)
    assert r.output[0].dtype == dtype


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("sum-read-before-norm-ends", r"output `\w+` is read by `\w+` before the match ends at `\w+` \(replacing it "
                                      r"would need reordering or form a cycle\)"),
        ("broadcast-residual", r"guard: residual float32\(2, 1, 64\) != input float32\(2, 3, 64\)"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("written", [False, True], ids=["library", "written"])
def test_add_layer_norm_negative_twins_fuse_only_the_norm(kind: str, reason: str, written: bool) -> None:
    r = check(AddNorm(kind, written), torch.randn(2, 3, N), torch.randn(2, 3, N), expect={"layer_norm": 1},
              dynamic=False)  # fmt: skip
    assert "add_layer_norm" not in r.report.rules()
    (why,) = reasons(r, "add_layer_norm")
    assert re.fullmatch(reason, why), why


def test_add_of_another_dtype_is_not_fused() -> None:
    """Mixed dtypes: a bf16 input and a float32 residual sum to float32; the kernel rounds the sum
    to the input's dtype, so the add stays."""

    def mixed(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x * 2 + r * 2
        return F.layer_norm(s, (N,), w, None, 1e-5), s

    r = check(mixed, torch.randn(3, N, dtype=BF16), torch.randn(3, N), torch.randn(N), expect={"layer_norm": 1},
              dynamic=False)  # fmt: skip
    assert reasons(r, "add_layer_norm") == ["guard: residual float32(3, 64) != input bfloat16(3, 64)"]


# -- the rule list -----------------------------------------------------------------------------


def test_rule_order_and_place_in_the_pipeline() -> None:
    L = layernorm
    assert L.RULES == [L.LAYER_NORM, L.LAYER_NORM_MEAN_SQ, L.LAYER_NORM_MEAN_SQ_ONCE, L.LAYER_NORM_VAR,
                       L.LAYER_NORM_WEIGHT, L.LAYER_NORM_BIAS, L.LAYER_NORM_CAST, L.LAYER_NORM_WEIGHT_ROUNDED,
                       L.LAYER_NORM_BIAS_ROUNDED, L.ADD_LAYER_NORM]  # fmt: skip
    (group,) = [s for s in PIPELINE if getattr(s, "name", None) == "fuse_norm"]
    assert list(group.rules) == L.RULES + norm_variants.RULES + norm.RULES  # before RMSNorm: it would take the second half
    assert L.ADD_LAYER_NORM.inplace is not None and L.ADD_LAYER_NORM.inplace.overwrites == ("x", "residual")


def test_rmsnorm_of_centered_values_is_taken_by_the_layer_norm_rules() -> None:
    """A LayerNorm's second half is an RMSNorm of ``h - mean``: with the LayerNorm rules first the
    whole norm is one op; with the RMSNorm rules alone, half of it would be."""

    def centered(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        d = x - x.mean(-1, keepdim=True)
        return w * (d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5))

    x, w = torch.randn(3, N), torch.randn(N)
    check(centered, x, w, expect={"layer_norm": 1})
    r = check(centered, x, w, expect={"rms_norm": 1}, rules=norm.RULES)
    assert r.counts()["aten.mean"] == 1 and r.counts()["aten.sub"] == 1
