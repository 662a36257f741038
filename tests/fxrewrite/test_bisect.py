"""Bisection: a wrong rule planted among the defaults is named with its first bad site, by the
library call and by ``python -m fxrewrite bisect``; drift that needs two rules, drift that only a
late site causes, and drift no rule causes are each told apart. A wrong fusion pass (a
``GraphPass(fusion=True)`` such as ``fuse_moe``) is named as a rule is, with its first bad site;
on an MoE model a right ``fuse_moe`` is blamed for nothing."""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import pytest
import torch

import fxrewrite.runtime.ops  # noqa: F401  (torch.ops.fxr.*)
import fxrewrite.rewrites as library
from fxrewrite import Rule, models
from fxrewrite.__main__ import main
from fxrewrite.bisect import BadSite, BisectError, bisect, load_model, load_rules, output_error
from fxrewrite.passes import GraphPass, RuleGroup, Step
from fxrewrite.rewrites import activation, norm
from planted import EPS_OFF, MOE_OFF, moe_off  # this folder


def sigmoid_pattern(x):
    return torch.sigmoid(x)


def sigmoid_plus(x):
    return torch.sigmoid(x) + 0.006


def tanh_pattern(x):
    return torch.tanh(x)


def tanh_plus(x):
    return torch.tanh(x) + 0.006


# each off by 0.006: within a tolerance of 0.01 alone, past it together (wrong, slightly)
SIGMOID_OFF = Rule("sigmoid_off", sigmoid_pattern, sigmoid_plus)
TANH_OFF = Rule("tanh_off", tanh_pattern, tanh_plus)


def _norm_return_line() -> str:
    """``modeling_llama.py:N``, N the line of LlamaRMSNorm's ``return self.weight * ...`` (the
    pattern's anchor) in the installed transformers: it moves between releases."""
    from transformers.models.llama import modeling_llama

    src, start = inspect.getsourcelines(modeling_llama.LlamaRMSNorm.forward)
    n = next(start + i for i, text in enumerate(src) if text.strip().startswith("return"))
    return f"modeling_llama.py:{n}"


def test_planted_rule_among_the_defaults_is_named_with_its_first_site() -> None:
    model = models.build("llama", layers=2)
    inputs = models.example_inputs(model)
    rules = [*norm.RULES[:1], EPS_OFF, *norm.RULES[1:], *activation.RULES]
    r = bisect(model, inputs, rules=rules, tol=1e-4)

    assert r.rules == ["eps_off_rms_norm"]
    line = _norm_return_line()
    assert r.site == ("eps_off_rms_norm", 0, line)
    assert isinstance(r.site, BadSite) and r.site.source == line
    assert r.module.endswith("layers.0.input_layernorm")
    assert r.sites == 5
    assert r.error > 1e-4 and r.full_error > 1e-4 and r.baseline_error <= 1e-4
    assert all(e <= 1e-4 for name, e in r.alone.items() if name != "eps_off_rms_norm")
    assert "first bad site: rule eps_off_rms_norm site 0 of 5" in r.summary()
    assert r.trials < 15


# -- fusion passes ----------------------------------------------------------------------------------


def _library_with(monkeypatch: pytest.MonkeyPatch, name: str, step: Step) -> None:
    """The default pipeline with its step ``name`` replaced by ``step`` (for this test)."""
    assert name in [s.name for s in library.PIPELINE]
    monkeypatch.setattr(library, "PIPELINE", tuple(step if s.name == name else s for s in library.PIPELINE))


def _router_topk_line(source: str) -> str:
    """The text of ``modeling_mixtral.py:N`` in the installed transformers."""
    from transformers.models.mixtral import modeling_mixtral

    file, _, n = source.partition(":")
    assert file == "modeling_mixtral.py"
    return Path(modeling_mixtral.__file__).read_text().splitlines()[int(n) - 1]


def test_a_wrong_fusion_pass_is_named_with_its_first_bad_site(monkeypatch: pytest.MonkeyPatch) -> None:
    """MOE_OFF is right in layer 0, off by 1% from layer 1 on: it is the culprit among the
    defaults, its site 1 (layer 1's router) the first bad one."""
    _library_with(monkeypatch, "fuse_moe", MOE_OFF)
    model = models.build("mixtral", layers=3)
    r = bisect(model, models.example_inputs(model), tol=1e-4)

    assert r.rules == ["fuse_moe_off"] and r.alone["fuse_moe_off"] > 1e-4
    assert r.site is not None and (r.site.rule, r.site.index) == ("fuse_moe_off", 1)
    assert "torch.topk(" in _router_topk_line(r.site.source)
    assert r.module == "layers.1.mlp"  # the block, as the report names it, not its router
    assert r.sites == 3 and r.error > 1e-4 and r.baseline_error <= 1e-4
    assert "first bad site: rule fuse_moe_off site 1 of 3" in r.summary()


def test_a_right_moe_model_bisects_to_nothing() -> None:
    """The default pipeline (fuse_moe among the units) on Mixtral: within the tolerance."""
    model = models.build("mixtral", layers=2)
    r = bisect(model, models.example_inputs(model), tol=1e-4)
    assert not r.found and r.site is None and r.note == ""
    assert r.full_error <= 1e-4 and r.trials == 2


def test_a_wrong_rule_on_an_moe_model_is_not_blamed_on_fuse_moe(monkeypatch: pytest.MonkeyPatch) -> None:
    """fuse_moe is tried (alone, first in pipeline order) and found right; the wrong norm is named."""
    _library_with(monkeypatch, "fuse_norm", RuleGroup("fuse_norm", (EPS_OFF, *norm.RULES)))
    model = models.build("mixtral", layers=2)
    r = bisect(model, models.example_inputs(model), tol=1e-4)
    assert list(r.alone)[0] == "fuse_moe" and r.alone["fuse_moe"] <= 1e-4
    assert r.rules == ["eps_off_rms_norm"]
    assert r.site is not None and (r.site.rule, r.site.index) == ("eps_off_rms_norm", 0)
    assert r.module.startswith("layers.0.")


def test_fusion_passes_are_dropped_with_the_library() -> None:
    """``rules=`` replaces the library's fusion passes too: bisection does not try them."""
    model = models.build("mixtral", layers=1)
    r = bisect(model, models.example_inputs(model), rules=[EPS_OFF], tol=1e-4)
    assert r.rules == ["eps_off_rms_norm"] and list(r.alone) == ["eps_off_rms_norm"]


def test_a_fusion_pass_must_take_a_site_filter() -> None:
    with pytest.raises(TypeError, match="fusion pass 'no_filter'.*site_filter"):
        GraphPass("no_filter", lambda gm: None, fusion=True)
    assert GraphPass("fine", moe_off, fusion=True).fusion


class Terms(torch.nn.Module):
    """``sigmoid(x) + tanh(y)``, and three norms whose outputs count 1e-6, 1e-6 and 1 in the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 16))

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        out = torch.sigmoid(x) + torch.tanh(y)
        for i, scale in enumerate((1e-6, 1e-6, 1.0)):
            h = z[i].float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            out = out + scale * (self.w[i] * h.to(z.dtype)).sum()
        return out


def terms_inputs() -> tuple[torch.Tensor, ...]:
    return torch.randn(4, 16), torch.randn(4, 16), torch.randn(3, 4, 16) * 1e-3


def test_defaults_alone_do_not_drift() -> None:
    r = bisect(Terms(), terms_inputs(), tol=1e-5)
    assert not r.found and r.rules == [] and r.site is None
    assert r.full_error <= 1e-5 and r.trials == 2
    assert "no rule moves the output past the tolerance" in r.summary()


def test_the_first_site_that_tips_the_output_is_found() -> None:
    """Sites 0 and 1 of the wrong norm hardly count; site 2 is the first bad one."""
    r = bisect(Terms(), terms_inputs(), rules=[EPS_OFF], tol=1e-3)
    assert r.rules == ["eps_off_rms_norm"]
    assert r.site is not None and (r.site.rule, r.site.index) == ("eps_off_rms_norm", 2)
    assert r.site.source.startswith("test_bisect.py:")
    assert r.sites == 3 and r.error > 1e-3


def test_drift_that_needs_two_rules_names_both() -> None:
    r = bisect(Terms(), terms_inputs(), extra_rules=[SIGMOID_OFF, TANH_OFF], tol=0.01)
    assert r.alone["sigmoid_off"] <= 0.01 and r.alone["tanh_off"] <= 0.01
    assert r.rules == ["sigmoid_off", "tanh_off"]
    assert r.rules_error == pytest.approx(0.012, abs=1e-6)
    assert r.site is not None and (r.site.rule, r.site.index) == ("tanh_off", 0)


def test_drift_with_no_rule_is_not_blamed_on_a_rule() -> None:
    """``x * sigmoid(x)`` becomes ``silu(x)`` (canonicalization): a last-bit change, over tol=0."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)

    x = torch.rand(4096) + 0.5
    r = bisect(f, (x,), tol=0.0)
    assert r.rules == [] and r.site is None
    assert r.baseline_error > 0.0
    assert "with no rule applied the output already differs" in r.note


def test_output_error() -> None:
    a = torch.tensor([1.0, float("nan")])
    assert output_error((a, 2), (a.clone(), 2)) == 0.0
    assert output_error(a, torch.tensor([1.5, float("nan")])) == 0.5
    assert output_error(a, torch.tensor([1.0, 2.0])) == float("inf")
    assert output_error((a,), (a, a)) == float("inf")


# -- loading and the command line ------------------------------------------------------------------

PLANTED = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from fxrewrite import Rule


    def silu(x):
        return F.silu(x)


    def gelu(x):
        return F.gelu(x)


    RULES = [Rule("silu_to_gelu", silu, gelu)]


    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(16, 32)
            self.down = torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.down(F.silu(self.gate(x)))


    def factory():
        torch.manual_seed(0)
        return Mlp(), (torch.randn(4, 16),)
    """
)


@pytest.fixture
def planted_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "fxr_planted.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fxr_planted"


def test_cli_names_the_planted_rule(planted_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bisect", "--model", f"{planted_module}:factory", "--rules", f"{planted_module}:RULES",
               "--tol", "1e-4", "--json"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert doc["rules"] == ["silu_to_gelu"]
    line = PLANTED.splitlines().index("        return self.down(F.silu(self.gate(x)))") + 1
    assert doc["site"] == {"rule": "silu_to_gelu", "index": 0, "source": f"fxr_planted.py:{line}"}


def test_cli_without_drift_exits_0(planted_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bisect", "--model", f"{planted_module}:factory", "--tol", "1e-4"]) == 0
    assert "no rule moves the output past the tolerance" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nosuchmodule:factory"], "cannot import 'nosuchmodule'"),
        (["--model", "gpt5"], "not a built-in"),
        (["--rules", "fxr_planted:NOPE"], "fxr_planted has no 'NOPE'"),
        (["--rules", "fxr_planted"], "expected 'pkg.module:name'"),
        (["--rules", "fxr_planted:factory"], "expected a Rule or a list of Rules"),
    ],
)
def test_cli_bad_arguments_exit_2_with_the_reason(
    planted_module: str, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["bisect", *argv]) == 2
    assert message in capsys.readouterr().err


def test_loaders(planted_module: str) -> None:
    (rule,) = load_rules(f"{planted_module}:RULES")
    assert rule.name == "silu_to_gelu"
    model, inputs = load_model(f"{planted_module}:factory")
    assert isinstance(model, torch.nn.Module) and inputs[0].shape == (4, 16)
    with pytest.raises(BisectError, match="must return \\(model, inputs\\)"):
        load_model(f"{planted_module}:RULES")
