"""The compile cache (fxrewrite/cache.py, fxrewrite/fingerprint.py): a second process that gets the
same Dynamo graph loads the rewritten graph and runs no pass; any change of rules, configuration,
versions or inputs misses; damaged entries are ignored and written again; writers never leave a
partial entry."""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import fxrewrite
from fxrewrite import cache as fxcache
from fxrewrite import fingerprint, models
from fxrewrite.fingerprint import Uncacheable
from fxrewrite.rule import Rule
from fxrewrite.testing import assert_close

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def cached(tmp_path: Path, **kw: Any) -> fxrewrite.Backend:
    return fxrewrite.Backend(cache=True, cache_dir=str(tmp_path), progress=False, **kw)


def run(backend: fxrewrite.Backend, model: torch.nn.Module, *args: Any) -> torch.Tensor:
    torch._dynamo.reset()
    with torch.no_grad():
        return models.hidden_states(backend.compile(model)(*args))


def entries(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "graphs").glob("*/*.json"))


# --------------------------------------------------------------------------- a second process

CHILD = textwrap.dedent("""
    import json, sys, torch, fxrewrite
    from fxrewrite import models, passes, verify
    runs = []
    original = passes.PassManager.run
    passes.PassManager.run = lambda self, gm: runs.append(1) or original(self, gm)
    model = models.build("llama", layers=1)
    x = models.example_inputs(model)
    backend = fxrewrite.Backend(cache=True, cache_dir=sys.argv[1], mode=sys.argv[2], capture_sizes=(8,), progress=False)
    with torch.no_grad():
        out = models.hidden_states(backend.compile(model)(*x))
        eager = models.hidden_states(model(*x))
    print(json.dumps({"cache": backend.report.cache, "passes_run": len(runs), "verified": verify.stats().checked,
                      "out": out.flatten().tolist(), "eager": eager.flatten().tolist(),
                      "fused": backend.report.fused_ops(), "table": backend.report.table()}))
""")


def child(cache_dir: Path, mode: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "FXREWRITE_CACHE"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(cache_dir), mode], env=env, check=True,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def here(cache_dir: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What :data:`CHILD` prints, run in this process (the process that stores need not be new:
    the one that loads must, and is)."""
    from fxrewrite import passes, verify

    runs: list[int] = []
    original = passes.PassManager.run
    monkeypatch.setattr(passes.PassManager, "run", lambda self, gm: runs.append(1) or original(self, gm))
    monkeypatch.delenv("FXREWRITE_CACHE", raising=False)
    verify.clear_cache()  # as in a new process: no verdict of an earlier test reused
    torch._dynamo.reset()
    model = models.build("llama", layers=1)
    x = models.example_inputs(model)
    backend = fxrewrite.Backend(cache=True, cache_dir=str(cache_dir), mode=mode, capture_sizes=(8,), progress=False)
    with torch.no_grad():
        out = models.hidden_states(backend.compile(model)(*x))
    torch._dynamo.reset()
    return {"cache": backend.report.cache, "passes_run": len(runs), "verified": verify.stats().checked,
            "out": out.flatten().tolist(), "fused": backend.report.fused_ops()}


@pytest.mark.slow
def test_a_second_process_loads_the_graph_and_runs_no_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Piecewise: the runner (split, dispatch, emulated capture) is built on the loaded graph."""
    first, second = here(tmp_path, "piecewise", monkeypatch), child(tmp_path, "piecewise")
    assert first["cache"]["hits"] == 0 and first["cache"]["stored"] == 1 and first["passes_run"] == 1
    assert first["verified"] > 0
    assert second["cache"]["hits"] == 1 and second["cache"]["stored"] == 0
    assert second["passes_run"] == 0 and second["verified"] == 0
    assert second["out"] == first["out"]  # the same graph: bit for bit
    assert_close(torch.tensor(second["out"]), torch.tensor(second["eager"]))
    assert second["fused"] == first["fused"] and first["fused"]["linear_silu_and_mul"] == 1
    assert "cache hit: 1 graphs, saved" in second["table"]
    assert len(entries(tmp_path)) == 1


# --------------------------------------------------------------------------- in one process


def test_hit_rebuilds_merged_weights_from_this_models_parameters(tmp_path: Path) -> None:
    """The key holds no weight values: another model of the same architecture hits, and its
    merged q/k/v and gate/up weights are made from its own parameters."""
    a, b = models.build("llama", layers=1, seed=0), models.build("llama", layers=1, seed=1)
    x = models.example_inputs(a)
    run(cached(tmp_path), a, *x)
    backend = cached(tmp_path)
    out = run(backend, b, *x)
    assert backend.report.cache["hits"] == 1
    with torch.no_grad():
        assert_close(out, models.hidden_states(b(*x)))
    q = b.layers[0].self_attn.q_proj.weight
    assert q.untyped_storage().data_ptr() == b.layers[0].self_attn.k_proj.weight.untyped_storage().data_ptr()


def test_a_changed_value_the_passes_read_misses(tmp_path: Path) -> None:
    """RoPE tables are folded from ``inv_freq``: another rope theta, same graph, is a miss."""
    model = models.build("llama", layers=1)
    x = models.example_inputs(model)
    run(cached(tmp_path), model, *x)
    model.rotary_emb.inv_freq.mul_(1.5)
    backend = cached(tmp_path)
    out = run(backend, model, *x)
    assert backend.report.cache["hits"] == 0 and backend.report.cache["misses"] == 1
    # the miss says which value changed: the entry was found under the key and not used
    [why] = backend.report.cache["not_used"]
    assert re.fullmatch(r"the value of \w*inv_freq\w* differs from the one the passes read", why), why
    assert f"cache: entry found, not used (1x): {why}" in backend.report.cache_lines()
    with torch.no_grad():
        assert_close(out, models.hidden_states(model(*x)))
    again = cached(tmp_path)
    run(again, model, *x)
    assert again.report.cache["hits"] == 1 and not again.report.cache["not_used"]  # stored over the old entry


def test_hint_changes_hit_but_dtype_and_static_shape_changes_miss(tmp_path: Path) -> None:
    model = models.build("llama", layers=1)
    run(cached(tmp_path), model, *models.example_inputs(model, tokens=8))
    backend = cached(tmp_path)
    run(backend, model, *models.example_inputs(model, tokens=12))  # dynamic: another traced size, one graph
    assert backend.report.cache["hits"] == 1
    fn = lambda x, w: torch.relu(x @ w.t())  # noqa: E731
    for args in [(torch.randn(8, 16), torch.randn(4, 16)), (torch.randn(8, 16).double(), torch.randn(4, 16).double())]:
        be = cached(tmp_path)
        torch._dynamo.reset()
        torch.compile(fn, backend=be, dynamic=False)(*args)
        assert be.report.cache["hits"] == 0
    assert len(entries(tmp_path)) == 3


def test_damaged_entries_are_ignored_with_a_warning_and_written_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = models.build("llama", layers=1)
    x = models.example_inputs(model)
    expected = run(cached(tmp_path), model, *x)
    [entry] = entries(tmp_path)
    tensors = entry.with_suffix(".pt")
    for damage in (lambda: entry.write_text(entry.read_text()[:1000]),
                   lambda: tensors.write_bytes(tensors.read_bytes()[:100])):  # fmt: skip
        damage()
        backend = cached(tmp_path)
        with caplog.at_level(logging.WARNING, logger="fxrewrite"):
            out = run(backend, model, *x)
        assert "ignoring the unreadable entry" in caplog.text
        assert [why.split(" (")[0] for why in backend.report.cache["not_used"]] == ["unreadable"]
        caplog.clear()
        assert backend.report.cache == {**backend.report.cache, "hits": 0, "stored": 1}
        assert torch.equal(out, expected)
        again = cached(tmp_path)
        assert torch.equal(run(again, model, *x), expected) and again.report.cache["hits"] == 1


def test_concurrent_writers_leave_whole_entries(tmp_path: Path) -> None:
    model = models.build("llama", layers=1)
    x = models.example_inputs(model)
    backend = cached(tmp_path)
    handles: list[Any] = []
    original = fxcache.CachedGraph.store
    fxcache.CachedGraph.store = lambda self, report: handles.append((self, report)) or original(self, report)
    try:
        run(backend, model, *x)
    finally:
        fxcache.CachedGraph.store = original
    [(handle, report)] = handles
    [entry] = entries(tmp_path)
    stop, seen = threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            seen.append(json.loads(entry.read_text())["key"])  # never a partial file

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=lambda: [handle.store(report) for _ in range(5)]) for _ in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert seen and set(seen) == {handle.key}
    assert not list(entry.parent.glob(".*.tmp"))  # no temporary file left behind


# --------------------------------------------------------------------------- the key


def keyed(fn: Any, *args: torch.Tensor, config: fxrewrite.Config | None = None) -> str:
    """The cache key of ``fn``'s Dynamo graph under ``config``."""
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append(fingerprint.key(gm, example_inputs, (config or fxrewrite.Config()).resolved())[0])
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=False)(*args)
    return seen[0]


def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


X, W = torch.randn(4, 32), torch.randn(32)


def test_the_key_is_stable_and_sees_every_config_field() -> None:
    base = keyed(norm, X, W)
    assert keyed(norm, X, W) == base
    assert keyed(norm, X, W, config=fxrewrite.Config(dump_dir="/tmp/ignored", progress=False)) == base
    for change in [dict(verify=False), dict(merge_siblings=False), dict(mode="full"), dict(max_positions=64),
                   dict(near_miss_min=0.7), dict(provider="torch"), dict(capture_sizes=(1, 2)), dict(rules=[])]:  # fmt: skip
        assert keyed(norm, X, W, config=fxrewrite.Config(**change)) != base, change


def test_the_key_sees_literals_and_input_metadata() -> None:
    base = keyed(norm, X, W)
    assert keyed(lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)), X, W) != base
    assert keyed(norm, X.double(), W.double()) != base
    assert keyed(norm, torch.randn(4, 16), torch.randn(16)) != base
    assert keyed(norm, X, torch.nn.Parameter(W)) != base  # a parameter, not an input


def test_the_key_sees_versions_and_fxrewrites_source(monkeypatch: pytest.MonkeyPatch) -> None:
    base = keyed(norm, X, W)
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert keyed(norm, X, W) != base
    monkeypatch.undo()
    monkeypatch.setattr(fingerprint, "source_digest", lambda: "edited")
    assert keyed(norm, X, W) != base
    monkeypatch.undo()
    monkeypatch.setattr(fingerprint, "_library_version", lambda module, dist: f"{dist} 99")
    assert keyed(norm, X, W) != base


def test_the_source_digest_reads_the_engine_where_it_is(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A namespace directory named ``fxrewrite`` that ``find_spec`` reports instead of the engine
    (an editable install, a test tree earlier on sys.path) changes nothing: the engine's own
    files are digested. Its twin: the same shadow for the rules' package is followed (it is found
    through its spec), and the digest changes."""
    import importlib.machinery
    import importlib.util

    shadow = tmp_path / "fxrewrite"
    shadow.mkdir()
    (shadow / "other.py").write_text("x = 1\n")
    real, shadowed = importlib.util.find_spec, {"fxrewrite"}

    def find_spec(name: str, *a: Any) -> Any:
        if name in shadowed:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(shadow)]
            return spec
        return real(name, *a)

    want = fingerprint.source_digest.__wrapped__()
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert fingerprint.source_digest.__wrapped__() == want
    assert fingerprint._package_dirs("fxrewrite") == [Path(fingerprint.__file__).parent]
    shadowed.add("fxrewrite.rewrites")
    assert fingerprint.source_digest.__wrapped__() != want


RULES_V1 = '''
import torch
from fxrewrite import Rule

LIMIT = 64

def small(b):
    return b["x"].shape[-1] <= LIMIT

def guard(b):
    return small(b) or "too wide"

def pattern(x):
    return torch.relu(x) * 2

def replacement(x):
    return torch.clamp(x, min=0) * 2

RULE = Rule("relu_twice", pattern, replacement, guard=guard)
'''


@pytest.mark.parametrize("edit", [
    ("LIMIT = 64", "LIMIT = 32"),                                   # a global the guard's helper reads
    ("shape[-1] <= LIMIT", "shape[-1] < LIMIT"),                    # the helper's code
    ('or "too wide"', 'or "wide"'),                                 # the guard's constants
    ("torch.clamp(x, min=0) * 2", "torch.clamp(x, min=0) * 2.0"),   # the replacement
], ids=["global", "helper", "guard", "replacement"])  # fmt: skip
def test_the_key_sees_the_source_of_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: tuple[str, str]) -> None:
    (tmp_path / "user_rules.py").write_text(RULES_V1)
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_rules

    def key() -> str:
        return keyed(norm, X, W, config=fxrewrite.Config(extra_rules=(user_rules.RULE,)))

    before = key()
    importlib.reload(user_rules)
    assert key() == before  # the same source: the same key
    (tmp_path / "user_rules.py").write_text(RULES_V1.replace(*edit))
    importlib.reload(user_rules)
    assert key() != before
    del sys.modules["user_rules"]


def test_closures_are_keyed_by_value_and_opaque_state_is_uncacheable() -> None:
    def rule(limit: Any) -> Rule:
        return Rule("relu", lambda x: torch.relu(x), lambda x: torch.clamp(x, min=0), guard=lambda b: limit)

    fp = fingerprint.rule_fingerprint
    assert fp(rule(3)) == fp(rule(3)) and fp(rule(3)) != fp(rule(4))
    with pytest.raises(Uncacheable, match="no stable description"):
        fp(rule(object()))


def test_targets_round_trip_by_name_and_local_functions_are_uncacheable() -> None:
    import operator

    for t in (torch.ops.aten.add.Tensor, torch.ops.aten.add, torch.ops.fxr.rms_norm.default, operator.getitem,
              torch.nn.functional.scaled_dot_product_attention, torch.arange, getattr, "view"):  # fmt: skip
        assert fingerprint.resolve_target(fingerprint.target_ref(t)) is t
    with pytest.raises(Uncacheable):
        fingerprint.target_ref(lambda x: x)


def test_arguments_round_trip() -> None:
    import sys as system

    value = (1, 2.5, float("inf"), True, None, "s", [torch.float16, torch.device("cpu")], slice(0, system.maxsize, 2),
             Ellipsis, torch.Size([2, 3]), {"k": torch.contiguous_format}, torch.strided)  # fmt: skip
    assert fingerprint.decode(json.loads(json.dumps(fingerprint.encode(value))), {}) == value
    with pytest.raises(Uncacheable):
        fingerprint.encode(object())


# --------------------------------------------------------------------------- what is not stored, and the switch


def test_a_rewrite_that_adds_shape_guards_is_not_stored(tmp_path: Path) -> None:
    def exactly_eight(b: Any) -> bool:
        return bool(b["x"].shape[0] == 8)  # a guard on the symbolic token count

    rule = Rule("relu8", lambda x: torch.relu(x), lambda x: torch.clamp(x, min=0), guard=exactly_eight)
    backend = cached(tmp_path, rules=[rule])
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.relu(x) + 1, backend=backend, dynamic=True)
    fn(torch.randn(8, 4))
    assert backend.report.rules() == {"relu8": 1}
    assert backend.report.cache["stored"] == 0
    assert any("shape guard" in why for why in backend.report.cache["not_stored"])
    assert not entries(tmp_path)


def test_off_switch_and_triton_cache_beside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXREWRITE_CACHE", "0")
    assert fxrewrite.Config().resolved().cache is False
    backend = fxrewrite.Backend(cache_dir=str(tmp_path / "off"))
    assert backend.report.cache == {} and not (tmp_path / "off").exists()
    monkeypatch.setenv("FXREWRITE_CACHE", "1")
    monkeypatch.setenv("FXREWRITE_CACHE_DIR", str(tmp_path / "env"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    config = fxrewrite.Backend().config
    assert config.cache and config.cache_dir == str(tmp_path / "env")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "env" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    fxrewrite.Backend(cache_dir=str(tmp_path / "other"))
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere"  # the user's choice stands


def test_dumps_read_no_cache(tmp_path: Path) -> None:
    model = models.build("llama", layers=1)
    x = models.example_inputs(model)
    run(cached(tmp_path / "c"), model, *x)
    backend = cached(tmp_path / "c", dump_dir=str(tmp_path / "dumps"))
    run(backend, model, *x)
    assert backend.report.cache["hits"] == 0 and list((tmp_path / "dumps").glob("*.after.py"))
