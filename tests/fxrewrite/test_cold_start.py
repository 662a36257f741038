"""What a new process pays before its first graph (issue 33, part 2): a library rule is keyed by
its functions, not by tracing it, and is not traced at ``Backend()``: it is traced at its first
match (CI traces every one). Same keys where they must differ, same graphs and outputs as before."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import fxrewrite
from fxrewrite import fingerprint, models
from fxrewrite.backend import default_rule_groups
from fxrewrite.rewrites.norm import RMS_NORM
from fxrewrite.rule import Rule, RuleError, Scalar, all_of

pytest.importorskip("transformers")


def library() -> list[Rule]:
    return [r for _, rules in default_rule_groups("full") for r in rules]


def untrace(rules: list[Rule]) -> None:
    for r in rules:
        r.__dict__.pop("compiled", None)  # Rule.compiled is a cached_property


def traced(rules: list[Rule]) -> list[str]:
    return [r.name for r in rules if "compiled" in r.__dict__]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def test_a_key_traces_no_library_rule_and_a_user_rule_by_its_graphs() -> None:
    rules = library()
    assert rules and all(fingerprint.library_rule(r) for r in rules)
    untrace(rules)
    fingerprint.config_fingerprint(fxrewrite.Config(mode="full").resolved())
    assert traced(rules) == []
    user = Rule("relu", lambda x: torch.relu(x), lambda x: torch.clamp(x, min=0))
    assert not fingerprint.library_rule(user) and fingerprint.rule_code(user)[0] == "traced"
    assert fingerprint.rule_code(RMS_NORM)[0] == "source"


def test_a_library_rule_key_sees_its_closures_scalars_and_functions() -> None:
    def small(b: Any) -> bool:
        return True

    def large(b: Any) -> bool:
        return False

    fp = fingerprint.rule_fingerprint
    # fxrewrite's all_of closes over the user's guards: the key walks that closure (it did not)
    assert fp(dataclasses.replace(RMS_NORM, guard=all_of(small))) != fp(dataclasses.replace(RMS_NORM, guard=all_of(large)))
    assert fp(dataclasses.replace(RMS_NORM, guard=all_of(small))) == fp(dataclasses.replace(RMS_NORM, guard=all_of(small)))
    eps = {**RMS_NORM.scalars, "eps": Scalar(float, lambda v: v < 1e-3)}
    assert fp(dataclasses.replace(RMS_NORM, scalars=eps)) != fp(RMS_NORM)
    other = next(r for r in library() if r.pattern is not RMS_NORM.pattern)
    assert fp(dataclasses.replace(RMS_NORM, pattern=other.pattern)) != fp(RMS_NORM)
    assert fp(dataclasses.replace(RMS_NORM, replacement=other.replacement)) != fp(RMS_NORM)


def test_library_rules_are_traced_at_their_first_match_and_user_rules_at_construction() -> None:
    rules = library()
    untrace(rules)
    fxrewrite.Backend(cache=False, mode="full", progress=False)
    assert traced(rules) == []
    # a user rule is traced at construction: a broken one fails there, with its name
    with pytest.raises(RuleError, match="broken"):
        fxrewrite.Backend(cache=False, mode="full", progress=False,
                          extra_rules=[Rule("broken", lambda x: torch.relu(x), lambda x, y: x)])  # fmt: skip


def test_every_library_rule_traces() -> None:
    """What construction no longer checks, checked here: every rule of every mode's pipeline
    traces on this torch (a library rule that cannot would be a pass failure at its first match)."""
    from fxrewrite.passes import RuleGroup
    from fxrewrite.rewrites import PIPELINE

    rules = list({id(r): r for g in PIPELINE if isinstance(g, RuleGroup) for r in g.rules}.values())
    untrace(rules)
    assert all(r.compiled.traced() is r.compiled for r in rules)  # the replacements too
    assert len(traced(rules)) == len(rules)
    assert all(r.compiled.replacement is not None and (r.inplace is None) == (r.compiled.inplace is None) for r in rules)


def test_a_rule_traces_its_replacements_only_when_one_is_needed() -> None:
    """A tried rule traces its pattern (its anchor decides where it is tried); its replacements
    wait for a match: on a one-layer Llama most library rules are tried and few match."""
    rules = library()
    untrace(rules)
    model = models.build("llama", layers=1)
    backend = fxrewrite.Backend(cache=False, mode="none", progress=False)
    with torch.no_grad():
        backend.compile(model)(*models.example_inputs(model))
    tried = [r for r in rules if "compiled" in r.__dict__]
    applied = {s.rule for s in backend.report.sites} & {r.name for r in tried}  # rules' sites, not graph passes
    with_replacement = {r.name for r in tried if {"replacement", "inplace"} & set(r.compiled.__dict__)}
    assert applied and applied <= with_replacement  # every rule that matched traced its replacement
    assert len(with_replacement) < len(tried) / 2  # and most of those tried did not
    never = next(r for r in tried if r.name not in with_replacement)
    assert never.compiled.pattern is not None and not {"replacement", "inplace"} & set(never.compiled.__dict__)


@pytest.mark.parametrize("mode", ["none", "full"])
def test_rules_traced_at_their_first_match_give_the_same_graph_and_outputs(tmp_path: Path, mode: str) -> None:
    model = models.build("llama", layers=1)
    x = models.example_inputs(model)

    def compiled(backend: fxrewrite.Backend) -> tuple[str, torch.Tensor]:
        torch._dynamo.reset()
        with torch.no_grad():
            out = models.hidden_states(backend.compile(model)(*x))
        return backend.graphs[0].code, out

    rules = library()
    for r in rules:
        _ = r.compiled  # every rule traced before the compile, as construction once did
    before_code, before = compiled(fxrewrite.Backend(cache=False, mode=mode, capture_sizes=(8,), progress=False))
    untrace(rules)
    lazy = fxrewrite.Backend(cache=True, cache_dir=str(tmp_path), mode=mode, capture_sizes=(8,), progress=False)
    assert traced(rules) == []
    code, out = compiled(lazy)
    assert lazy.report.cache["misses"] == 1 and lazy.report.cache["stored"] == 1  # the passes ran
    assert traced(rules)  # the rules it matched with
    assert code == before_code and torch.equal(out, before)
    assert any(op.startswith("rms_norm") for op in lazy.report.fused_ops())  # alone, or in a GEMM (mode full)
