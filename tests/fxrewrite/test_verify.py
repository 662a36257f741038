"""Verification (``Config(verify=True)`` / ``FXREWRITE_VERIFY=1``): every distinct matched site is
run against its replacement on random inputs; a wrong rule is refused, the defaults pass.

The planted wrong rule is the RMSNorm rule with an eps 100x too large: harmless on rows of
ordinary size, wrong on small rows, which verification draws on purpose.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fxrewrite.runtime.ops  # noqa: F401  (torch.ops.fxr.*)
from fxrewrite import Backend, InPlace, Rule, models, verify
from fxrewrite.rewrites import activation, norm
from fxrewrite.runtime.ops import quant
from planted import EPS_OFF, eps_off_replacement  # this folder
from fxrewrite.testing import assert_close, compile_once

# -- planted rules ------------------------------------------------------------------------------


def silu_pattern(x):
    return F.silu(x)


def gelu_replacement(x):
    return F.gelu(x)


# silu(x) -> gelu(x) (wrong)
SILU_TO_GELU = Rule("silu_to_gelu", silu_pattern, gelu_replacement)


def swapped_inplace(x, residual, weight, eps):
    out = torch.ops.fxr.fused_add_rms_norm_(x, residual, weight, eps)
    return out[1], out[0]


# add + RMSNorm whose functional form is right and whose in-place form swaps its outputs (wrong)
BAD_INPLACE = Rule(
    "bad_inplace_add_rms_norm", norm.add_rms_norm_pattern, norm.add_rms_norm_replacement, norm.add_norm_guard,
    norm.WILDCARDS, inplace=InPlace(swapped_inplace, norm.OVERWRITES),
)  # fmt: skip


@torch.library.custom_op("fxrtest_verify::boom", mutates_args=())
def boom(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("boom at run time")


boom.register_fake(lambda x: torch.empty_like(x))


def boom_replacement(x):
    return torch.ops.fxrtest_verify.boom(x)


# silu(x) -> an op that raises when it runs
RAISES = Rule("raises_at_run_time", silu_pattern, boom_replacement)

# -- models -------------------------------------------------------------------------------------


class RMSNorm(torch.nn.Module):
    """HF Llama's RMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class Norms(torch.nn.Module):
    """Norms of the given widths, each on its own input, each followed by a SiLU."""

    def __init__(self, *dims: int) -> None:
        super().__init__()
        self.norms = torch.nn.ModuleList(RMSNorm(d) for d in dims)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.silu(n(x)) for n, x in zip(self.norms, xs))


class AddNorm(torch.nn.Module):
    """``s = x + r; norm(s), s``; with ``scale`` x and r are intermediates (in place allowed),
    without they are graph inputs (in place refused)."""

    def __init__(self, dim: int, scale: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.scale = scale

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scale:
            x, r = x * 2, r * 3
        s = x + r
        return self.norm(s), s


def private_verifier() -> verify.Verifier:
    """A verifier with its own cache, passed as the match filter (``verify`` itself left off)."""
    return verify.Verifier()


# -- the planted rule on llama --------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "dynamic"), [(torch.float32, True), (torch.bfloat16, False)])
def test_verify_rejects_the_planted_rule_and_passes_the_defaults_on_llama(dtype: torch.dtype, dynamic: bool) -> None:
    model = models.build("llama", layers=2, dtype=dtype)
    (ids,) = models.example_inputs(model)
    rules = [EPS_OFF, *norm.RULES, *activation.RULES]  # planted first: it claims every norm site
    # dynamic: the floats lifted (plain torch.compile's spelling), so eps is reported symbolic
    r = compile_once(lambda i: model(i).last_hidden_state, ids, rules=rules, verify=True, dynamic=dynamic,
                     specialize_floats=not dynamic)  # fmt: skip

    rejected = r.report.rejected
    assert {x.rule for x in rejected} == {"eps_off_rms_norm"}
    assert len(rejected) == 5  # 2 layers x 2 norms + the final norm
    first = rejected[0]
    assert first.source.startswith("modeling_llama.py:")
    assert first.reason.startswith("verify: max abs error ")
    assert "> tol" in first.reason and ("(fp32)" if dtype == torch.float32 else "(bf16)") in first.reason
    assert f"x={'fp32' if dtype == torch.float32 else 'bf16'}[1, 8, 64]" in first.reason
    assert ("eps=1e-06 (symbolic)" if dynamic else "eps=1e-06") in first.reason
    # the defaults fused the sites the planted rule gave back, and nothing else was refused
    fused = r.report.rules()
    assert (fused["add_rms_norm"], fused["rms_norm"], fused["silu_and_mul"]) == (4, 1, 2)
    assert "eps_off_rms_norm" not in fused
    assert_close(r.output, r.eager)


def test_the_planted_rule_without_verify_changes_the_output() -> None:
    """The twin: with verify off the planted rule is applied and the output drifts."""
    mod = Norms(64)
    x = torch.randn(4, 64) * 1e-3
    r = compile_once(mod, x, rules=[EPS_OFF], verify=False)
    assert r.report.rules() == {"eps_off_rms_norm": 1}
    with pytest.raises(AssertionError):
        assert_close(r.output, r.eager)


def test_env_var_turns_verification_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXREWRITE_VERIFY", "1")
    assert Backend().config.verify is True
    r = compile_once(Norms(32), torch.randn(4, 32), rules=[EPS_OFF])
    assert [x.rule for x in r.report.rejected] == ["eps_off_rms_norm"]
    monkeypatch.setenv("FXREWRITE_VERIFY", "0")
    assert Backend().config.verify is False


def test_verification_counts_its_kernel_calls_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verification's own calls of the fused ops are not the model's (providers.served())."""
    from fxrewrite import backend
    from fxrewrite.runtime import providers

    scopes: list[str] = []

    def spy(m: object) -> None:
        scopes.append(providers._REGISTRY.scope)

    monkeypatch.setattr(backend, "verify_match", spy)
    r = compile_once(Norms(32), torch.randn(4, 32), rules=[norm.RMS_NORM], verify=True)
    assert r.report.rules() == {"rms_norm": 1}
    assert scopes == ["verification"] and providers._REGISTRY.scope == "model"


def test_silu_to_gelu_is_rejected_and_the_output_stays_eager() -> None:
    r = compile_once(Norms(16, 16), torch.randn(3, 16), torch.randn(3, 16), rules=[norm.RMS_NORM, SILU_TO_GELU],
                     verify=True)  # fmt: skip
    assert r.report.rules() == {"rms_norm": 2}
    assert [x.rule for x in r.report.rejected] == ["silu_to_gelu", "silu_to_gelu"]
    assert r.report.rejected[0].reason.startswith("verify: max abs error")
    assert_close(r.output, r.eager)


# -- what is checked, and how often ---------------------------------------------------------------


def test_one_check_per_distinct_signature() -> None:
    v = private_verifier()
    xs = [torch.randn(2, 5, 32) for _ in range(3)] + [torch.randn(2, 5, 64)]
    r = compile_once(Norms(32, 32, 32, 64), *xs, rules=[norm.RMS_NORM], match_filter=v, dynamic=False)
    assert r.report.rules() == {"rms_norm": 4}
    assert (v.stats.checked, v.stats.cached, v.stats.refused) == (2, 2, 0)  # widths 32 and 64
    assert not r.report.rejected


def test_the_shared_cache_keeps_rules_of_one_name_apart() -> None:
    """A wrong rule named like a right one does not inherit its verdict (the key holds the rule)."""
    impostor = Rule("rms_norm", norm.rms_norm_pattern, eps_off_replacement, norm.norm_guard, norm.WILDCARDS)
    verify.clear_cache()
    x = torch.randn(4, 32)
    good = compile_once(Norms(32), x, rules=[norm.RMS_NORM], verify=True)
    bad = compile_once(Norms(32), x, rules=[impostor], verify=True)
    assert not good.report.rejected
    assert [x.rule for x in bad.report.rejected] == ["rms_norm"]
    assert verify.stats().checked == 2


def test_the_inplace_form_is_checked_where_it_would_be_applied() -> None:
    a, b = torch.randn(2, 4, 32), torch.randn(2, 4, 32)
    # intermediates: the in-place form would run, and it swaps its outputs
    r = compile_once(AddNorm(32, scale=True), a, b, rules=[BAD_INPLACE], match_filter=private_verifier())
    assert len(r.report.rejected) == 1
    assert "in output 0" in r.report.rejected[0].reason
    assert_close(r.output, r.eager)
    # graph inputs: only the (right) functional form can run, and it is accepted
    r = compile_once(AddNorm(32, scale=False), a, b, rules=[BAD_INPLACE], match_filter=private_verifier())
    assert not r.report.rejected
    assert r.report.rules() == {"bad_inplace_add_rms_norm": 1}
    assert not any(s.inplace for s in r.report.sites)


def test_the_default_inplace_form_passes() -> None:
    a, b = torch.randn(2, 4, 32), torch.randn(2, 4, 32)
    r = compile_once(AddNorm(32, scale=True), a, b, rules=[norm.ADD_RMS_NORM], match_filter=private_verifier())
    assert not r.report.rejected
    assert [s.inplace for s in r.report.sites] == [True]
    assert_close(r.output, r.eager)


def test_a_replacement_that_raises_is_refused_with_its_error() -> None:
    r = compile_once(Norms(16), torch.randn(3, 16), rules=[RAISES], match_filter=private_verifier())
    (rej,) = r.report.rejected
    assert rej.reason.startswith("verify: the replacement raised RuntimeError: boom at run time on x=fp32[3, 16]")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_default_rules_pass_in_every_dtype(dtype: torch.dtype) -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(32)
            self.up = torch.nn.Linear(32, 64, bias=False)

        def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
            s = x * 2 + r
            h = self.up(self.norm(s))
            return F.silu(h[..., :32]) * h[..., 32:] + s

    x, res = torch.randn(2, 3, 32, dtype=dtype), torch.randn(2, 3, 32, dtype=dtype)
    r = compile_once(Block().to(dtype), x, res, match_filter=private_verifier())
    assert not r.report.rejected
    assert r.report.rules().get("add_rms_norm") == 1 and r.report.rules().get("silu_and_mul") == 1
    assert_close(r.output, r.eager)


# -- the pieces ---------------------------------------------------------------------------------


def test_verdicts_are_deterministic() -> None:
    """Seeded from the signature: two private verifiers agree to the character."""
    x = torch.randn(4, 32)
    reasons = []
    for _ in range(2):
        r = compile_once(Norms(32), x, rules=[EPS_OFF], match_filter=private_verifier())
        reasons.append(r.report.rejected[0].reason)
    assert reasons[0] == reasons[1]


def test_inplace_aliasing_is_reproduced() -> None:
    """x and residual bound to one tensor: the in-place kernel's aliasing shows, and is refused."""

    def f(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = -a
        s = h + h
        v = s.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * v.to(a.dtype), s

    r = compile_once(f, torch.randn(2, 8), torch.randn(8), rules=[norm.ADD_RMS_NORM], match_filter=private_verifier())
    assert_close(r.output, r.eager)
    if r.report.rejected:  # the matcher chose the in-place form; verification saw it clobber the sum
        (rej,) = r.report.rejected
        assert rej.reason.startswith("verify: max abs error") and "in output 1" in rej.reason
    else:  # the matcher refuses in place when x is residual: the functional form ran
        assert [s.inplace for s in r.report.sites] == [False]


@torch.library.custom_op("fxrtest_verify::lying", mutates_args=())
def lying(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).half()  # the fake below promises x's dtype


lying.register_fake(lambda x: torch.empty_like(x))


def relu_pattern(x):
    return torch.relu(x)


def lying_replacement(x):
    return torch.ops.fxrtest_verify.lying(x)


def test_a_fake_impl_that_lies_about_dtype_is_caught_at_run_time() -> None:
    rule = Rule("lying_fake", relu_pattern, lying_replacement)
    r = compile_once(lambda x: torch.relu(x * 2) + 1, torch.randn(4, 8), rules=[rule], match_filter=private_verifier())
    (rej,) = r.report.rejected
    assert rej.reason == "verify: dtype fp16 != fp32 at run time, while the fake values agree (a fake impl is wrong) on x=fp32[4, 8]"
    assert_close(r.output, r.eager)


def test_low_precision_output_is_judged_against_float64_where_the_code_cancels() -> None:
    """bf16 ``a*b - c*d`` with nearly equal products: the code (three roundings) and a kernel
    rounding once differ by more than bf16's tolerance of the small result; judged against the
    float64 result, the kernel is the more accurate and passes; a wrong result does not."""
    from fxrewrite.verify import _no_less_accurate

    g = torch.Generator().manual_seed(0)
    a, c = torch.randn(256, generator=g) * 30, torch.randn(256, generator=g) * 30
    b = torch.randn(256, generator=g)
    d = a * b / c + 1e-3 * torch.randn(256, generator=g)  # a*b - c*d is small
    bf = [t.bfloat16() for t in (a, b, c, d)]
    exact = bf[0].double() * bf[1].double() - bf[2].double() * bf[3].double()  # as verify runs it
    code = bf[0] * bf[1] - bf[2] * bf[3]
    once = exact.bfloat16()
    assert not torch.allclose(once.float(), code.float(), rtol=2e-2, atol=2e-2), "the case must need the fallback"
    assert _no_less_accurate(once, code, exact)
    assert not _no_less_accurate(bf[0] * bf[1] + bf[2] * bf[3], code, exact)  # a sign error
    assert not _no_less_accurate(once + 3.0, code, exact)


# -- quantized outputs ------------------------------------------------------------------------------


def silu_quant_pattern(x):
    return quant.quant_fp8_per_token(F.silu(x))


def scale_nudged(factor: float):  # noqa: ANN201 - a replacement
    def replacement(x):
        q, s = quant.quant_fp8_per_token(F.silu(x))
        return q, s * factor

    return replacement


def silu_then_quantize(x: torch.Tensor) -> torch.Tensor:
    q, s = quant.quant_fp8_per_token(F.silu(x))
    return q.float() * s


@pytest.mark.parametrize(("factor", "fused"), [(1 + 2**-7, True), (1.1, False)])
def test_fp8_scales_are_judged_by_the_input_dtype_not_by_float32(factor: float, fused: bool) -> None:
    """SiLU + per-token FP8 of bf16: a replacement whose scales are one bf16 rounding off
    (a kernel's ``exp`` one step away on the row's largest value: what the H100 gave) is a
    quantization as good as the code's and passes, where float32's tolerance on the scale
    output refused it; scales 10% off are refused, with what differs."""
    rule = Rule("silu_quant_nudged", silu_quant_pattern, scale_nudged(factor))
    x = torch.randn(32, 64, dtype=torch.bfloat16) * 4
    r = compile_once(silu_then_quantize, x, rules=[rule], verify=True)
    assert r.report.rules() == ({"silu_quant_nudged": 1} if fused else {})
    if not fused:
        [rejected] = r.report.rejected
        assert rejected.reason.startswith("verify: out0: 32 of 32 scales off by more than 0.016"), rejected.reason


# -- sizes read from data (unbacked symbols) ------------------------------------------------------


class _NormOfRows(torch.nn.Module):
    """RMSNorm of rows chosen at run time: ``pick(x, aux)`` gives rows of a size read from data."""

    def __init__(self, pick: Any) -> None:
        super().__init__()
        self.pick, self.w = pick, torch.nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        h = self.pick(x, aux)
        return self.w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


def _nonzero_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return x[keep.nonzero().squeeze(-1)]


def _split_rows(x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    a, b = sizes.tolist()
    torch._check(a + b == x.shape[0])  # the split's sizes sum to the rows: a tie the check must keep
    return torch.split(x, [a, b])[0]


def _rows_of_a_product(x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    a, b = sizes.tolist()
    torch._check(a * b == x.shape[0])  # a tie no equal shares satisfy
    return x[:a]


@pytest.mark.parametrize(("pick", "aux", "fused"), [
    (_nonzero_rows, torch.rand(10) > 0.3, True),
    (_split_rows, torch.tensor([4, 6]), True),
    (_rows_of_a_product, torch.tensor([2, 5]), False),
], ids=["nonzero", "split", "tied-by-a-product"])  # fmt: skip
def test_a_site_of_a_size_read_from_data_is_checked_at_stand_in_sizes(pick: Any, aux: torch.Tensor, fused: bool) -> None:
    """An unbacked size is checked at a stand-in value from its range, or solved from the
    runtime assert that ties it (a split's sizes summing to the rows); where no such values
    satisfy the graph's asserts, the site is refused and says so."""
    # config.patch, not monkeypatch: torch 2.11's config module loses the attribute when
    # monkeypatch restores it, and every later test in the process that reads it fails
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        r = compile_once(_NormOfRows(pick), torch.randn(10, 32), aux, rules=[norm.RMS_NORM], verify=True)
    assert r.report.rules() == ({"rms_norm": 1} if fused else {})
    reasons = [x.reason for x in r.report.rejected]
    assert len(reasons) == (not fused) and all(re.fullmatch(
        r"verify: cannot check this site: size u\d+ has no hint, and its symbols have no values the graph's "
        r"runtime asserts allow", why) for why in reasons)  # fmt: skip
    assert_close(r.output, r.eager)


def _fp8_gemm(x: torch.Tensor, w: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    a = torch.ops.aten
    return a._scaled_mm.default(x, a.t.default(w), sa, sb, None, None, torch.bfloat16, False)


def test_the_float64_reference_of_an_fp8_gemm_is_its_exact_product() -> None:
    """``_scaled_mm`` takes no float64 operands: the reference evaluates it as ``(a @ b) * sa * sb``,
    exact for e4m3 values. A kernel summing in another order than cuBLASLt's is then judged by
    accuracy where a cancelling row leaves a small output off by more than bf16's tolerance;
    a wrong value is still refused."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 256, generator=g) * 40).to(torch.float8_e4m3fn)
    w = (torch.randn(64, 256, generator=g) * 40).to(torch.float8_e4m3fn)
    sa, sb = torch.tensor(0.5), torch.tensor(1.5)
    gm = torch.fx.symbolic_trace(_fp8_gemm)
    [exact] = verify.run_float64(gm, [x, w, sa, sb])
    assert exact.dtype == torch.float64
    torch.testing.assert_close(exact, (x.double() @ w.double().T) * 0.75, rtol=0, atol=0)
    want = exact.to(torch.bfloat16)  # the GEMM's output, rounded once
    i = int(exact.abs().argmin())  # the most cancelled output: bf16's absolute tolerance there is smallest
    near = want.clone().view(-1)
    near[i] += 0.05 * float(exact.abs().max()) * 2**-7  # a float32-order difference, far below a bf16 step of the row's scale
    near = near.view_as(want)
    assert verify.compare(near, want) is not None  # the dtype tolerance alone would refuse it
    assert verify.agrees(near, want, lambda: exact) is None
    wrong = want.clone().view(-1)
    wrong[i] = -wrong[i] + float(exact.abs().max())
    assert verify.agrees(wrong.view_as(want), want, lambda: exact) is not None


# -- FP8 outputs where the code's own sum cancels ----------------------------------------------------


def shifted_quant_pattern(a, b, s):
    return quant.quant_fp8_static((a * 256 + b) - a * 256, s)


def shifted_quant_once(a, b, s):  # the sum in float32, rounded once: b, nearly exactly
    return quant.quant_fp8_static(((a.float() * 256 + b.float()) - a.float() * 256).to(torch.bfloat16), s)


def shifted_quant_doubled(a, b, s):  # wrong: twice the value
    return quant.quant_fp8_static(b * 2, s)


def shifted_quantized(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return quant.quant_fp8_static((a * 256 + b) - a * 256, s).float() * s


@pytest.mark.parametrize(("replacement", "fused"), [(shifted_quant_once, True), (shifted_quant_doubled, False)])
def test_an_fp8_output_off_the_code_where_its_sum_cancels_is_judged_against_float64(replacement: Any,
                                                                                      fused: bool) -> None:  # fmt: skip
    """bf16 ``(256 a + b) - 256 a`` quantized statically: the code rounds ``256 a + b`` to bf16, so
    its result is several e4m3 steps from ``b``; a kernel summing in float32 is then more than one
    step from the code's values, within one of the exact (float64) result's, and passes. A wrong
    value (twice the result) is more than one step from both and is refused, with the count."""
    a, b = (torch.randn(16, 64, dtype=torch.bfloat16) for _ in range(2))
    s = torch.tensor(0.01)
    code, once = shifted_quant_pattern(a, b, s), shifted_quant_once(a, b, s)
    assert quant.fp8_mismatch(once, code) is not None, "the case must need the float64 reference"
    assert quant.fp8_mismatch(once, code, q_exact=quant.quant_fp8_static(b.double(), s)) is None
    rule = Rule("shifted_quant", shifted_quant_pattern, replacement)
    r = compile_once(shifted_quantized, a, b, s, rules=[rule], verify=True)
    assert r.report.rules() == ({"shifted_quant": 1} if fused else {})
    if not fused:
        [rejected] = r.report.rejected
        assert re.match(r"verify: out0: \d+ of 1024 FP8 values more than one e4m3 step off", rejected.reason), rejected.reason
    assert_close(r.output, (once if fused else code).float() * s)


def test_the_exact_quantization_must_be_fp8_of_the_values_shape() -> None:
    q = torch.zeros(4, dtype=torch.float8_e4m3fn)
    far = torch.full((4,), 8.0).to(torch.float8_e4m3fn)
    assert quant.fp8_mismatch(far, q) is not None
    with pytest.raises(ValueError, match="q_exact"):
        quant.fp8_mismatch(far, q, q_exact=far.float())
    with pytest.raises(ValueError, match="q_exact"):
        quant.fp8_mismatch(far, q, torch.ones(4, 1), torch.ones(4, 1), q_exact=far)
