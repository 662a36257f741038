"""Bad input gets a clear answer: each case asserts the message the user sees (the README's
table "input -> what the user sees" is built from these tests).

Rules are checked when the Backend is built (every rule is traced then), so a broken rule fails
before Dynamo runs; a guard runs per match, so its exception surfaces through Dynamo's
``BackendCompilerFailed`` with the RuleError's message.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxrewrite
import fxrewrite.runtime.ops  # noqa: F401  (torch.ops.fxr.*)
from fxrewrite import Backend, InPlace, Rule, RuleError, Scalar
from fxrewrite.passes import DumpError
from fxrewrite.testing import compile_once


def relu_pattern(x):
    return torch.relu(x)


def relu_replacement(x):
    return torch.clamp(x, min=0.0)


def relu_on(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * 2) + 1


# -- rules --------------------------------------------------------------------------------------


def untraceable_pattern(x):
    if x.sum() > 0:  # data-dependent control flow: symbolic tracing cannot follow it
        return torch.relu(x)
    return x


def test_untraceable_pattern_is_a_rule_error_naming_the_rule() -> None:
    rule = Rule("branchy", untraceable_pattern, relu_replacement)
    with pytest.raises(RuleError, match=r"^rule 'branchy': the pattern cannot be traced by torch\.fx\.symbolic_trace: "):
        Backend(rules=[rule])


def test_untraceable_replacement_is_a_rule_error_naming_the_rule() -> None:
    rule = Rule("branchy_replacement", relu_pattern, untraceable_pattern)
    with pytest.raises(RuleError, match=r"^rule 'branchy_replacement': the replacement cannot be traced"):
        Backend(rules=[rule])


def two_outputs(x):
    return torch.relu(x), x


def test_replacement_returning_a_different_number_of_values_is_a_rule_error() -> None:
    def sum_and_relu(x, y):
        s = x + y
        return torch.relu(s), s

    def only_relu(x, y):
        return torch.relu(x + y)

    with pytest.raises(RuleError, match=r"^rule 'count': the replacement returns 1 value\(s\), the pattern 2$"):
        Backend(rules=[Rule("count", sum_and_relu, only_relu)])


def test_inplace_replacement_returning_a_different_number_of_values_is_a_rule_error() -> None:
    rule = Rule("count_inplace", relu_pattern, relu_replacement, inplace=InPlace(two_outputs, ("x",)))
    with pytest.raises(RuleError, match=r"^rule 'count_inplace': the in-place replacement returns 2 value\(s\), the pattern 1$"):
        Backend(rules=[rule])


def test_replacement_taking_an_argument_the_pattern_does_not_bind() -> None:
    def needs_w(x, w):
        return torch.relu(x) * w

    with pytest.raises(RuleError, match=r"^rule 'unbound': replacement takes \['w'\], which the pattern does not bind$"):
        Backend(rules=[Rule("unbound", relu_pattern, needs_w)])


def test_scalar_wildcard_that_is_not_a_pattern_argument() -> None:
    with pytest.raises(RuleError, match=r"^rule 'wild': scalars \['eps'\] are not pattern arguments$"):
        Backend(rules=[Rule("wild", relu_pattern, relu_replacement, scalars={"eps": Scalar(float)})])


def half_replacement(x):
    return torch.relu(x).half()


def halves_replacement(x):
    return torch.relu(x)[..., ::2]


@pytest.mark.parametrize(
    ("replacement", "reason"),
    [
        (half_replacement, r"replacement output `.+` is torch\.float16, the pattern's torch\.float32"),
        (halves_replacement, r"replacement output shape \(4, 4\) != pattern's \(4, 8\)"),
    ],
)
def test_replacement_whose_output_meta_differs_is_rejected_not_applied(replacement, reason: str) -> None:
    r = compile_once(relu_on, torch.randn(4, 8), rules=[Rule("meta", relu_pattern, replacement)], dynamic=False,
                     verify=False)  # fmt: skip
    (rej,) = r.report.rejected
    assert rej.rule == "meta" and rej.source.startswith("test_bad_input.py:")
    assert re.fullmatch(reason, rej.reason), rej.reason
    assert r.report.rules() == {}
    torch.testing.assert_close(r.output, r.eager)
    assert "REJECTED meta at " in r.report.table()


def test_with_verify_the_meta_check_still_gives_the_reason() -> None:
    """Verification leaves dtype / shape differences that fake values show to the rewrite step."""
    r = compile_once(relu_on, torch.randn(4, 8), rules=[Rule("meta", relu_pattern, half_replacement)], dynamic=False,
                     verify=True)  # fmt: skip
    (rej,) = r.report.rejected
    assert re.fullmatch(r"replacement output `.+` is torch\.float16, the pattern's torch\.float32", rej.reason)


def raising_guard(b):
    return b["x"].shape[5] > 0  # IndexError: the pattern's x has 2 dims


def test_guard_that_raises_is_a_rule_error_naming_the_rule() -> None:
    rule = Rule("bad_guard", relu_pattern, relu_replacement, raising_guard)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as ei:
        compile_once(relu_on, torch.randn(4, 8), rules=[rule])
    assert isinstance(ei.value.inner_exception, RuleError)
    assert "RuleError: guard of rule 'bad_guard' raised IndexError: " in str(ei.value)


# -- the model ---------------------------------------------------------------------------------------


def prints(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    print("tracing", y.shape)  # a graph break
    return y + 1


def branches(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:  # data-dependent control flow: a graph break
        return x + 1
    return x - 1


@pytest.mark.parametrize(("fn", "says", "line"), [
    (prints, "Failed to trace builtin operator", 'print("tracing", y.shape)'),
    (branches, "Data-dependent branching", "if x.sum() > 0:"),
])  # fmt: skip
def test_graph_break_under_fullgraph_names_the_break_and_its_line(fn, says: str, line: str) -> None:
    """Dynamo's own message is clear (what broke, the user's file and line): passed through as is."""
    torch._dynamo.reset()
    compiled, _ = fxrewrite.compile(fn)
    with pytest.raises(torch._dynamo.exc.Unsupported) as ei:
        compiled(torch.randn(3))
    msg = str(ei.value)
    assert says in msg and "from user code:" in msg and "test_bad_input.py" in msg and line in msg


# -- configuration -----------------------------------------------------------------------------------


def test_splitting_op_not_in_the_graph_is_reported() -> None:
    """Not an error (a model may have no attention): the runtime stats name the missing op."""
    torch._dynamo.reset()
    compiled, backend = fxrewrite.compile(relu_on, mode="piecewise", splitting_ops=("nope::attention",),
                                          capture_sizes=(2, 4), progress=False)  # fmt: skip
    with torch.no_grad():
        compiled(torch.randn(4, 8))
    backend.refresh_runtime()
    runtime = backend.report.graphs[0].runtime
    assert runtime["missing_splitting_ops"] == ["nope::attention"]
    assert runtime["splitting_pieces"] == 0 and runtime["pieces"] == 1
    assert "missing_splitting_ops=['nope::attention']" in backend.report.table()


@pytest.mark.parametrize(("sizes", "says"), [
    ((), r"capture_sizes is empty"),
    ((8, 4, 16), r"capture_sizes must be in increasing order: \(8, 4, 16\)"),
    ((8, 1024), r"capture size 1024 is above max_capture_size 512"),
])  # fmt: skip
def test_bad_capture_sizes_are_refused_when_the_backend_is_built(sizes: tuple[int, ...], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Backend(mode="piecewise", capture_sizes=sizes)


def _importable(provider: str) -> bool:
    from fxrewrite.runtime import providers

    return providers.available(provider)


@pytest.mark.parametrize("provider", ["sgl_kernel", "flashinfer"])
def test_provider_override_naming_a_library_that_is_not_installed(provider: str) -> None:
    if _importable(provider):
        pytest.skip(f"{provider} is installed here")
    with pytest.raises(ValueError, match=rf"^provider '{provider}' requested \(FXREWRITE_PROVIDER or config: "
                                         rf"'rms_norm={provider}'\), but {provider} is not importable: "):  # fmt: skip
        Backend(provider=f"rms_norm={provider}")


def test_provider_override_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    if _importable("flashinfer"):
        pytest.skip("flashinfer is installed here")
    monkeypatch.setenv("FXREWRITE_PROVIDER", "flashinfer")
    with pytest.raises(ValueError, match=r"^provider 'flashinfer' requested .* not importable"):
        Backend()


@pytest.mark.parametrize(("spec", "says"), [
    ("cutlass", r"^unknown provider 'cutlass' in 'cutlass'; expected one of \('sgl_kernel', 'flashinfer', 'triton', 'torch'\)"),
    ("group_norm=torch", r"^unknown op 'group_norm' in 'group_norm=torch'; known ops: rms_norm, "),
])  # fmt: skip
def test_provider_override_with_an_unknown_name(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Backend(provider=spec)


def test_dumps_into_a_directory_that_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    target = blocker / "dumps"
    with pytest.raises(DumpError, match=rf"^cannot write graph dumps to '{re.escape(str(target))}': Not a directory$"):
        Backend(dump_dir=str(target))


def test_dumps_from_the_environment_into_a_directory_that_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("FXREWRITE_DUMP_DIR", str(blocker))
    with pytest.raises(DumpError, match=r"^cannot write graph dumps to '.+a_file': "):
        Backend()


def test_dump_error_is_an_oserror() -> None:
    """Callers that handle file errors generally catch it too."""
    assert issubclass(DumpError, OSError)


def test_a_rule_list_with_a_non_rule_in_it() -> None:
    with pytest.raises(TypeError, match=r"silu"):
        Backend(rules=[F.silu])  # type: ignore[list-item]
