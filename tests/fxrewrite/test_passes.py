"""A pass that raises (fxrewrite/passes.py): off strict, the graph goes on as the pass found it,
the passes before it still count, and the report names the pass, the error and the site; strict
(the suite's default, FXREWRITE_STRICT=1) raises."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import fxrewrite
import fxrewrite.runtime.ops  # noqa: F401  (torch.ops.fxr.*)
from fxrewrite import Rule
from fxrewrite.canonicalize import canonicalize
from fxrewrite.passes import Pass, PassManager
from fxrewrite.report import PassResult
from fxrewrite.rewrite import apply_rules
from fxrewrite.rewrites import norm
from fxrewrite.testing import compile_once, op_counts

EPS = 1e-6


def rms_then_relu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return torch.relu(w * h.to(x.dtype)) * 3


def relu_pattern(x):
    return torch.relu(x)


def relu_replacement(x):
    return torch.clamp(x, min=0.0)


def exploding_guard(b):
    return b["x"].shape[7] > 0  # IndexError: x has 2 dims


BAD = Rule("bad_guard", relu_pattern, relu_replacement, exploding_guard)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 64), torch.randn(64)


def test_a_rules_pass_that_raises_is_reported_with_its_site_and_the_others_still_fuse() -> None:
    r = compile_once(rms_then_relu, *_inputs(), extra_rules=[BAD], strict=False)
    torch.testing.assert_close(r.output, r.eager)
    (failure,) = r.report.failures
    assert failure.name == "user_rules"
    assert failure.error.startswith("RuleError: guard of rule 'bad_guard' raised IndexError")
    assert failure.site.startswith("relu (") and "test_passes.py:" in failure.site
    assert r.counts()["fxr.rms_norm"] == 1 and r.counts()["aten.relu"] == 1  # fuse_norm kept, user_rules not
    assert "PASS FAILED user_rules at relu (" in r.report.table()


def test_strict_raises_the_passes_error() -> None:
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="guard of rule 'bad_guard' raised IndexError"):
        compile_once(rms_then_relu, *_inputs(), extra_rules=[BAD], strict=True)


def test_strict_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXREWRITE_STRICT", "0")
    assert fxrewrite.Config().resolved().strict is False
    monkeypatch.setenv("FXREWRITE_STRICT", "1")
    assert fxrewrite.Config().resolved().strict is True
    assert fxrewrite.Config(strict=False).resolved().strict is False


# -- PassManager on a traced graph --------------------------------------------------------------


class Halfway:
    """A graph pass that registers a buffer, turns its last call into a negation and raises: it
    leaves the graph half changed."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        self.calls += 1
        gm.register_buffer("fxr_half", torch.ones(1), persistent=False)
        gm.meta["fxr_half"] = True
        last = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
        last.target, last.args, last.kwargs = torch.neg, (last.args[0],), {}
        raise ValueError("halfway")


def _traced() -> fx.GraphModule:
    def f(x, w):
        return F.silu(x * w) * 2

    gm = fx.symbolic_trace(f)
    canonicalize(gm)
    return gm


def _counter(gm: fx.GraphModule) -> PassResult:
    gm.meta["counted"] = gm.meta.get("counted", 0) + 1
    return PassResult()


def test_the_graph_goes_back_to_what_the_failing_pass_found_and_later_passes_run() -> None:
    gm = _traced()
    x, w = torch.randn(3, 8), torch.randn(8)
    want = gm(x, w)
    before = op_counts(gm)
    halfway = Halfway()
    report = PassManager([Pass("count", _counter), Pass("halfway", halfway), Pass("after", _counter)]).run(gm)
    assert halfway.calls == 1
    assert op_counts(gm) == before  # the half-done rewrite is gone
    torch.testing.assert_close(gm(x, w), want)
    assert "fxr_half" not in dict(gm.named_buffers()) and "fxr_half" not in gm.meta
    # the passes before it ran again on the restored graph; the pass after it ran once
    assert gm.meta["counted"] == 2
    assert [p.name for p in report.passes] == ["count", "after"]
    (failure,) = report.failures
    assert (failure.name, failure.error, failure.site) == ("halfway", "ValueError: halfway", "")
    gm.graph.lint()


def test_strict_manager_raises_and_a_clean_run_reports_no_failure() -> None:
    with pytest.raises(ValueError, match="halfway"):
        PassManager([Pass("halfway", Halfway())], strict=True).run(_traced())
    report = PassManager([Pass("count", _counter)]).run(_traced())
    assert report.failures == []


def test_fusions_of_the_passes_before_a_failure_survive_the_restore() -> None:
    """The passes before a failing one run again after the restore: their fusions stay."""
    passes = [Pass("canonicalize", lambda g: PassResult(matches=canonicalize(g))),
              Pass("fuse_norm", lambda g: apply_rules(g, norm.RULES)), Pass("halfway", Halfway())]  # fmt: skip
    reports = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
        reports.append(PassManager(passes).run(gm))
        return gm

    torch._dynamo.reset()
    x, w = _inputs()
    out = torch.compile(rms_then_relu, backend=backend, fullgraph=True)(x, w)
    torch.testing.assert_close(out, rms_then_relu(x, w))
    (report,) = reports
    assert [f.name for f in report.failures] == ["halfway"]
    assert report.fused_ops == {"rms_norm": 1}
