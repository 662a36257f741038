"""RMSNorm rules (rewrites/norm.py): plain, Gemma ``(1 + w)``, residual add + norm, in place.

Each rule: positive tests over the spellings model code uses, and negative twins whose one
defect must keep the rule off (and show as a near miss where the rule got far enough).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.fx as fx
from helpers.rewrites import BF16, DYNAMIC, F32, LlamaRMSNorm, check, fused_nodes, reasons, sites

from fxrewrite.rewrites import norm

# -- plain RMSNorm: spellings ------------------------------------------------------------------


class WeightRightTorchMean(torch.nn.Module):
    """Weight on the right, ``x * x``, ``torch.mean(..., dim=-1, keepdim=True)``, ``.float()``."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        variance = torch.mean(h * h, dim=-1, keepdim=True)
        return (h * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class LiteralEpsReciprocalSqrt(torch.nn.Module):
    """eps a literal, ``torch.square``, ``1 / torch.sqrt``, ``.type(...)`` and ``.type_as``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.type(torch.float32)
        h = h * (1 / torch.sqrt(torch.square(h).mean(dim=-1, keepdim=True) + 1e-6))
        return self.weight * h.type_as(x)


def functional_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A free function, weight a graph input, ``h ** 2``, positional keepdim."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt((h**2).mean(-1, True) + 1e-6)
    return w * h.to(x.dtype)


class VarianceOfTheCastProductOfX(torch.nn.Module):
    """CPM-Ant's: the variance of ``x.float()``, the product with ``x`` itself (promotion casts it)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(dim=-1, keepdim=True)
        return (x * torch.rsqrt(variance + 1e-6)).to(x.dtype) * self.weight


SPELLINGS: dict[str, Callable[[int], torch.nn.Module]] = {
    "hf-llama": LlamaRMSNorm,
    "variance-of-the-cast-product-of-x": VarianceOfTheCastProductOfX,
    "weight-right-x*x-torch.mean": WeightRightTorchMean,
    "literal-eps-1/sqrt-type_as": LiteralEpsReciprocalSqrt,
}

DTYPE_DYNAMIC = pytest.mark.parametrize(
    ("dtype", "dynamic"), [(F32, True), (F32, False), (BF16, "lifted")], ids=["f32-dynamic", "f32-static", "bf16-lifted"]
)


@DTYPE_DYNAMIC
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_rms_norm_spellings(spelling: str, dtype: torch.dtype, dynamic: bool) -> None:
    model = SPELLINGS[spelling](64).to(dtype)
    r = check(model, torch.randn(2, 5, 64, dtype=dtype), expect={"rms_norm": 1}, dynamic=dynamic)
    assert [s.rule for s in sites(r)] == ["rms_norm"]
    assert not r.report.near_misses
    assert r.counts()["aten.mean"] == 0 and r.counts()["aten.rsqrt"] == 0


@DTYPE_DYNAMIC
def test_rms_norm_free_function_weight_as_input(dtype: torch.dtype, dynamic: bool) -> None:
    x, w = torch.randn(6, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    check(functional_norm, x, w, expect={"rms_norm": 1}, dynamic=dynamic)


@DYNAMIC
@pytest.mark.parametrize("specialize", [True, False], ids=["floats constant", "floats lifted"])
def test_eps_attribute_binds_a_literal_or_a_symbolic_float(dynamic: bool, specialize: bool) -> None:
    """Under dynamic=True with ``specialize_floats=False`` (or plain ``torch.compile``) HF's float
    attribute eps is lifted and read with ``.item()``; the rule binds that SymFloat node.
    Otherwise (``Backend.compile``'s default, or dynamic=False) it is the literal."""
    r = check(LlamaRMSNorm(64, eps=1e-5), torch.randn(4, 64), expect={"rms_norm": 1}, dynamic=dynamic,
              specialize_floats=specialize)  # fmt: skip
    lifted = dynamic and not specialize
    assert ("method.item" in r.counts_before()) is lifted
    ((x, w, eps),) = [n.args for n in fused_nodes(r, "rms_norm")]
    if lifted:
        assert isinstance(eps, fx.Node) and eps.target == "item"
    else:
        assert eps == pytest.approx(1e-5)


@pytest.mark.parametrize("specialize", [True, False], ids=["floats constant", "floats lifted"])
def test_large_eps_attribute_under_dynamic_fails_the_predicate(specialize: bool) -> None:
    """The eps predicate (0 < eps < 0.1) judges the literal, and a lifted SymFloat by the value it
    has at compile time: the negative twin of the test above."""
    r = check(LlamaRMSNorm(64, eps=0.5), torch.randn(4, 64), expect={}, dynamic=True, specialize_floats=specialize)
    what = "0.5" if specialize else "`item` (= 0.5 at compile time)"
    assert reasons(r, "rms_norm") == [f"eps: {what} fails the predicate of this wildcard"]


@pytest.mark.parametrize("rank", [3, 4], ids=["tokens-heads-dim", "batch-seq-heads-dim"])
@DYNAMIC
def test_qwen3_per_head_qk_norm(rank: int, dynamic: bool) -> None:
    """Qwen3 normalizes q and k per head: the projection viewed as [..., heads, head_dim] and an
    RMSNorm whose weight spans head_dim."""

    class QKNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(64, 64, bias=False)
            self.k_proj = torch.nn.Linear(64, 32, bias=False)
            self.q_norm, self.k_norm = LlamaRMSNorm(16), LlamaRMSNorm(16)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (*x.shape[:-1], -1, 16)
            q = self.q_norm(self.q_proj(x).view(shape)).transpose(-3, -2)
            k = self.k_norm(self.k_proj(x).view(shape)).transpose(-3, -2)
            return q, k

    x = torch.randn(*(5,) if rank == 3 else (2, 5), 64)
    r = check(QKNorm(), x, expect={"rms_norm": 2}, dynamic=dynamic)  # q/k projections merged first
    assert [len(n.meta["example_value"].shape) for n in fused_nodes(r, "rms_norm")] == [rank, rank]


# -- plain RMSNorm: negative twins -------------------------------------------------------------


class Defective(torch.nn.Module):
    """HF's RMSNorm with one defect planted (``kind``)."""

    def __init__(self, kind: str, hidden: int = 64) -> None:
        super().__init__()
        self.kind = kind
        self.weight = torch.nn.Parameter(torch.randn((4, hidden) if kind == "weight-shape" else hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        eps = 0.5 if self.kind == "eps-too-large" else 1e-6
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        back = torch.float16 if self.kind == "wrong-cast-back" else x.dtype
        return self.weight * h.to(back)


@pytest.mark.parametrize(
    ("kind", "dtype", "reason", "inner"),
    [
        ("wrong-cast-back", BF16, "guard: casts back to torch.float16, input is torch.bfloat16",
         "rms_norm_float32"),
        ("weight-shape", F32, "guard: weight shape (4, 64) != normalized dim (64,)", "rms_norm_unweighted"),
        ("eps-too-large", F32, "eps: 0.5 fails the predicate of this wildcard", None),
    ],
)  # fmt: skip
@DYNAMIC
def test_rms_norm_negative_twins(kind: str, dtype: torch.dtype, reason: str, inner: str | None, dynamic: bool) -> None:
    """The weighted rule refuses; the norm before the weight (computed in float32, what the
    weightless rules take) still fuses where it is a norm."""
    model = Defective(kind).to(dtype)
    r = check(model, torch.randn(4, 64, dtype=dtype), expect={"rms_norm": 1} if inner else {}, dynamic=dynamic)
    assert reasons(r, "rms_norm") == [reason]
    assert [s.rule for s in sites(r)] == ([inner] if inner else [])


def test_rms_norm_variance_read_elsewhere_is_not_fused() -> None:
    def norm_and_variance(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True)
        return w * (h * torch.rsqrt(variance + 1e-6)).to(x.dtype), variance

    r = check(norm_and_variance, torch.randn(4, 64), torch.randn(64), expect={})
    (reason,) = reasons(r, "rms_norm")
    assert re.fullmatch(r"internal node `\w+` has 1 user\(s\) outside the match \(`output`\)", reason)


def test_rms_norm_spelled_as_division_by_sqrt() -> None:
    # canonicalization turns h / sqrt(v) into h * rsqrt(v), equal up to rounding
    def div_sqrt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return w * (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    check(div_sqrt, torch.randn(4, 64), torch.randn(64), expect={"rms_norm": 1}, dynamic=False)


def test_rms_norm_over_another_dim_is_not_fused() -> None:
    def norm_dim0(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)).to(x.dtype)

    r = check(norm_dim0, torch.randn(64, 64), torch.randn(64), expect={}, dynamic=False)
    assert reasons(r, "rms_norm") == ["`mean` dim: literal -2 != -1"]


# -- scaled in float32, rounded once: (w * h).to(dtype) -----------------------------------------


class CastLast(torch.nn.Module):
    """The orders of cast and multiply that round once, as model code spells them: OLMo2 and
    gpt-oss ``(w * h).to(dtype)``, Nemotron ``(w.to(float32) * h).to(dtype)``, Gemma 4
    ``(h * w.float()).type_as(x)``."""

    def __init__(self, spelling: str, hidden: int = 64, weight_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.spelling, self.weight_dtype = spelling, weight_dtype
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # keep a float32 weight float32
        out = super()._apply(fn, recurse)
        if self.weight_dtype is not None:
            self.weight.data = self.weight.data.to(self.weight_dtype)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.spelling == "olmo2":
            return (self.weight * h).to(x.dtype)
        if self.spelling == "nemotron":
            return (self.weight.to(torch.float32) * h).to(x.dtype)
        return (h * self.weight.float()).type_as(x)


CAST_LAST = ["olmo2", "nemotron", "gemma4"]


@pytest.mark.parametrize("weight_dtype", [None, F32], ids=["weight-bf16", "weight-f32"])
@pytest.mark.parametrize("spelling", CAST_LAST)
@DYNAMIC
def test_rms_norm_cast_last_spellings_bf16(spelling: str, weight_dtype: torch.dtype | None, dynamic: bool) -> None:
    """One rule for every spelling (canonicalize drops the upcasts promotion makes anyway); the op
    computes the same order, so the output is eager's to the bit."""
    model = CastLast(spelling, weight_dtype=weight_dtype).to(BF16)
    r = check(model, torch.randn(2, 5, 64, dtype=BF16), expect={"rms_norm": 1}, dynamic=dynamic, exact=True)
    assert [s.rule for s in sites(r)] == ["rms_norm_cast_last"]
    ((x, w, eps, cast_last),) = [n.args for n in fused_nodes(r, "rms_norm")]
    assert cast_last is True and w.meta["example_value"].dtype == (weight_dtype or BF16)
    assert not r.report.near_misses


@pytest.mark.parametrize("spelling", CAST_LAST)
def test_rms_norm_cast_last_in_float32_is_the_plain_norm(spelling: str) -> None:
    r = check(CastLast(spelling), torch.randn(2, 5, 64), expect={"rms_norm": 1})
    assert [s.rule for s in sites(r)] == ["rms_norm"]  # no cast to place: one computation


def test_llama_order_keeps_rounding_before_the_scale() -> None:
    r = check(LlamaRMSNorm(64).to(BF16), torch.randn(4, 64, dtype=BF16), expect={"rms_norm": 1}, exact=True)
    ((x, w, eps),) = [n.args for n in fused_nodes(r, "rms_norm")]  # cast_last left at False


@pytest.mark.parametrize(
    ("weight_dtype", "back", "reason"),
    [(torch.float64, None, "guard: weight dtype torch.float64: the product would not run in float32"),
     (None, torch.float16, "guard: casts back to torch.float16, input is torch.bfloat16")],
    ids=["float64-weight", "wrong-cast-back"],
)  # fmt: skip
def test_rms_norm_cast_last_negative_twins(weight_dtype: torch.dtype | None, back: torch.dtype | None,
                                           reason: str) -> None:  # fmt: skip
    def norm_(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (w * h).to(back or x.dtype)

    w = torch.randn(64, dtype=weight_dtype or BF16)
    r = check(norm_, torch.randn(4, 64, dtype=BF16), w, expect={"rms_norm": 1}, dynamic=False)
    # one miss for the site, not a second at the product with its cast taken as elided
    assert reasons(r, "rms_norm_cast_last") == [reason]
    # the norm before the weight, in float32, is what the weightless rule for that form takes
    assert [s.rule for s in sites(r)] == ["rms_norm_float32"]


# -- Gemma: (1 + w), computed in float32 --------------------------------------------------------


class GemmaRMSNorm(torch.nn.Module):
    """HF transformers' GemmaRMSNorm as written there: scale by ``1 + w`` in float32."""

    def __init__(self, dim: int, eps: float = 1e-6, swapped: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.swapped = swapped
        self.weight = torch.nn.Parameter(0.1 * torch.randn(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self._norm(x.float())
        if self.swapped:  # scale first, `.to(dtype)` instead of `type_as`
            return ((1 + self.weight.float()) * output).to(x.dtype)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


@pytest.mark.parametrize(
    ("dtype", "weight_dtype", "dynamic"),
    [(BF16, BF16, True), (BF16, BF16, False), (BF16, F32, True), (F32, F32, True), (F32, F32, False)],
    ids=["bf16-dynamic", "bf16-static", "bf16-input-f32-weight", "f32-dynamic", "f32-static"],
)
def test_gemma_rms_norm(dtype: torch.dtype, weight_dtype: torch.dtype, dynamic: bool) -> None:
    check_gemma(GemmaRMSNorm(64).to(weight_dtype), dtype, dynamic)


@pytest.mark.parametrize(("dtype", "dynamic"), [(BF16, True), (F32, False)], ids=["bf16-dynamic", "f32-static"])
def test_gemma_rms_norm_scale_first(dtype: torch.dtype, dynamic: bool) -> None:
    check_gemma(GemmaRMSNorm(64, swapped=True).to(dtype), dtype, dynamic)


def check_gemma(model: torch.nn.Module, dtype: torch.dtype, dynamic: bool) -> None:
    r = check(model, torch.randn(3, 64, dtype=dtype), expect={"gemma_rms_norm": 1}, dynamic=dynamic)
    assert [s.rule for s in sites(r)] == ["gemma_rms_norm"]
    assert not r.report.near_misses
    assert r.output.dtype == dtype


def test_one_plus_w_in_the_input_dtype_is_a_plain_norm_with_weight_1_plus_w() -> None:
    """Scaling by ``1 + w`` after the cast back (in bf16) is what rms_norm(x, 1 + w) computes:
    the plain rule takes it, binding the `1 + w` node as its weight; not the Gemma op."""

    def late_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h.to(x.dtype) * (1 + w)

    x, w = torch.randn(4, 64, dtype=BF16), 0.1 * torch.randn(64, dtype=BF16)
    r = check(late_scale, x, w, expect={"rms_norm": 1})
    (node,) = fused_nodes(r, "rms_norm")
    assert node.args[1].target == torch.ops.aten.add.Tensor


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_gemma_negative_twin_two_plus_w(dtype: torch.dtype) -> None:
    def two_plus_w(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (2.0 + w.float())).to(x.dtype)

    x, w = torch.randn(4, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    # Not Gemma's norm; a plain one whose weight is w' = 2 + w, computed in float32: in float32
    # the casts are elided and the plain rule takes it, in bf16 the cast-last one (exactly)
    r = check(two_plus_w, x, w, expect={"rms_norm": 1}, exact=dtype == BF16)
    assert [s.rule for s in sites(r)] == ["rms_norm" if dtype == F32 else "rms_norm_cast_last"]


# -- residual add + RMSNorm -------------------------------------------------------------------


def hf_norm(h: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    f = h.to(torch.float32)
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return w * f.to(h.dtype)


def gemma_norm(h: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    f = h.float()
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return (f * (1.0 + w.float())).type_as(h)


class AddNorm(torch.nn.Module):
    """``x`` and ``residual`` are intermediates (``a * 2``, ``b + 1``) unless ``kind`` says
    otherwise; the sum flows on as the next residual, as in a decoder layer."""

    def __init__(self, kind: str = "dead", gemma: bool = False, hidden: int = 64) -> None:
        super().__init__()
        self.kind, self.norm = kind, gemma_norm if gemma else hf_norm
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        k, w = self.kind, self.weight
        x, residual = a * 2, b + 1
        if k == "dead":
            s = x + residual
            return self.norm(s, w), s
        if k == "residual-first":
            s = torch.add(residual, x)
            return self.norm(s, w), s
        if k == "sum-read-after":  # the next layer's residual: still in place
            s = x + residual
            return self.norm(s, w) * s
        if k == "residual-is-input":
            s = x + b
            return self.norm(s, w), s
        if k == "x-read-later":
            s = x + residual
            return self.norm(s, w) + x, s
        if k == "residual-read-later":
            s = x + residual
            return self.norm(s, w), s, residual * 3
        if k == "x-is-view":
            x = x.reshape(-1, x.shape[-1])
            s = x + residual.reshape(-1, x.shape[-1])
            return self.norm(s, w), s
        if k == "sum-read-before-norm-ends":
            s = x + residual
            t = s.sum(-1, keepdim=True)  # read between the add and the end of the norm
            return self.norm(s, w) + t, s
        if k == "broadcast-residual":
            s = x + residual[..., :1, :]
            return self.norm(s, w), s
        raise AssertionError(k)


INPLACE = {
    # kind: (in place, note pattern)
    "dead": (True, ""),
    "residual-first": (True, ""),
    "sum-read-after": (True, ""),
    "residual-is-input": (False, r"functional: residual \(`l_b_`\) is a graph input"),
    "x-read-later": (False, r"functional: x \(`x`\) is read later by `\w+`"),
    "residual-read-later": (False, r"functional: residual \(`residual`\) is read later by `\w+`"),
    "x-is-view": (False, r"functional: x \(`\w+`\) may alias other storage"),
}


# In-place analysis does not depend on shapes being symbolic: every kind under dynamic=True,
# the Gemma twin and dynamic=False on the two kinds that decide in-place vs functional.
INPLACE_CASES = [(k, False, True) for k in INPLACE] + [
    ("dead", True, False), ("residual-is-input", True, False), ("dead", False, False)
]  # fmt: skip


@pytest.mark.parametrize(("kind", "gemma", "dynamic"), INPLACE_CASES)
def test_add_rms_norm_in_place_only_where_proven_safe(kind: str, gemma: bool, dynamic: bool) -> None:
    inplace, note = INPLACE[kind]
    op = ("gemma_" if gemma else "") + "fused_add_rms_norm" + ("_" if inplace else "")
    a, b = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    a0, b0 = a.clone(), b.clone()
    r = check(AddNorm(kind, gemma), a, b, expect={op: 1}, dynamic=dynamic)
    (site,) = sites(r)
    assert site.rule == ("gemma_" if gemma else "") + "add_rms_norm"
    assert site.inplace is inplace
    assert re.fullmatch(note, site.note), site.note
    assert torch.equal(a, a0) and torch.equal(b, b0), "graph inputs must never be overwritten"


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_add_rms_norm_in_place_numerics_bf16(dtype: torch.dtype) -> None:
    a, b = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    check(AddNorm("dead").to(dtype), a, b, expect={"fused_add_rms_norm_": 1})


@pytest.mark.parametrize("kind", ["sum-read-before-norm-ends", "broadcast-residual"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_add_norm_negative_twins_fuse_only_the_norm(kind: str, gemma: bool) -> None:
    """sum read before the norm ends: replacing add + norm would move that read after the fused
    op (a cycle), so the rule refuses. Broadcast residual: the guard wants equal shapes. The plain
    norm rule then takes the norm (so the site lists no near miss)."""
    prefix = "gemma_" if gemma else ""
    r = check(AddNorm(kind, gemma), torch.randn(4, 64), torch.randn(4, 64), expect={prefix + "rms_norm": 1})
    assert [s.rule for s in sites(r)] == [prefix + "rms_norm"]


def cast_last_norm(h: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    f = h.to(torch.float32)
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return (w * f).to(h.dtype)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_add_rms_norm_cast_last_in_place(dtype: torch.dtype) -> None:
    model = AddNorm("dead").to(dtype)
    model.norm = cast_last_norm
    r = check(model, torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype),
              expect={"fused_add_rms_norm_": 1}, exact=dtype == BF16)  # fmt: skip
    (site,) = sites(r)
    assert site.inplace and site.rule == ("add_rms_norm_cast_last" if dtype == BF16 else "add_rms_norm")


def test_rule_order_puts_add_norm_before_norm_and_gemma_before_plain() -> None:
    assert norm.RULES == [norm.GEMMA_ADD_RMS_NORM, norm.GEMMA_ADD_RMS_NORM_F32_SUM, norm.ADD_RMS_NORM,
                          norm.ADD_RMS_NORM_F32_SUM, norm.ADD_RMS_NORM_CAST_LAST, norm.ADD_RMS_NORM_UNWEIGHTED,
                          norm.GEMMA_RMS_NORM, norm.RMS_NORM, norm.RMS_NORM_CAST_LAST, norm.RMS_NORM_UNWEIGHTED,
                          norm.RMS_NORM_ROUNDED_SCALE, norm.RMS_NORM_FLOAT32]  # fmt: skip
    assert norm.ADD_RMS_NORM.inplace is not None and norm.ADD_RMS_NORM.inplace.overwrites == ("x", "residual")


def test_near_miss_of_add_norm_names_the_first_difference() -> None:
    """An add + norm with eps out of the predicate's range: the near miss says which binding."""

    def off(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = a * 2 + b
        return hf_norm(s, torch.ones(64), eps=2.0), s

    r = check(off, torch.randn(4, 64), torch.randn(4, 64), expect={})
    assert reasons(r, "add_rms_norm") == ["eps: 2.0 fails the predicate of this wildcard"]
