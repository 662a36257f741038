"""Precompiled artifacts (fxrewrite.precompile): a new process loads Dynamo's guards and bytecode
with the rewritten graph and runs without tracing or passes, bit for bit as the cold compile;
every kind of miss misses (configuration, rules, versions, traced source, values read); guard
failures compile with Dynamo or raise."""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import torch_at_least

import fxrewrite
from fxrewrite import fingerprint, models, precompile
from fxrewrite.rule import Rule
from fxrewrite.testing import assert_close

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(precompile.SerializableCallable is object, reason="torch without AOT precompile")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def backend(tmp_path: Path, **kw: Any) -> fxrewrite.Backend:
    kw.setdefault("cache", False)
    return fxrewrite.Backend(cache_dir=str(tmp_path / "cache"), progress=False, **kw)


def llama() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model = models.build("llama", layers=1)
    return model, models.example_inputs(model)


def saved(tmp_path: Path, model: torch.nn.Module, x: tuple[Any, ...], **kw: Any) -> tuple[Path, torch.Tensor]:
    """``model`` precompiled and saved; its (cold) output."""
    with torch.no_grad():
        step = backend(tmp_path, **kw).aot_compile(model, x)
        out = models.hidden_states(step(*x))
    return step.save(tmp_path / "model.fxr"), out


@pytest.fixture(scope="module")
def _artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch._dynamo.reset()
    model, x = llama()
    path, _ = saved(tmp_path_factory.mktemp("artifact"), model, x)
    return path


@pytest.fixture
def artifact(_artifact: Path, tmp_path: Path) -> Path:
    """The default configuration's artifact of ``llama()`` (its weights seeded alike), compiled
    once for the tests that only load it (each compile ~3 s on a CI core): a copy of its own."""
    return Path(shutil.copy(_artifact, tmp_path / "model.fxr"))


# --------------------------------------------------------------------------- a new process

CHILD = textwrap.dedent("""
    import json, sys, torch, fxrewrite
    from fxrewrite import models, passes, verify
    from torch._dynamo import convert_frame
    traced = []
    for name in ("fullgraph_capture", "_compile"):  # AOT precompile's trace and Dynamo's per-frame one
        original = getattr(convert_frame, name)
        setattr(convert_frame, name, lambda *a, _f=original, _n=name, **k: traced.append(_n) or _f(*a, **k))
    runs = []
    original_run = passes.PassManager.run
    passes.PassManager.run = lambda self, gm: runs.append(1) or original_run(self, gm)
    path, mode = sys.argv[1:3]
    model = models.build("llama", layers=1)
    backend = fxrewrite.Backend(mode=mode, capture_sizes=(8,), cache=False, progress=False)
    outs = []
    with torch.no_grad():
        step = fxrewrite.load(path, model, backend)
        for tokens in (8, 5):  # the traced size, then another (dynamic: the same graph)
            x = models.example_inputs(model, tokens=tokens)
            outs.append(models.hidden_states(step(*x)).flatten().tolist())
            outs.append(models.hidden_states(model(*x)).flatten().tolist())
    print(json.dumps({"traced": traced, "passes_run": len(runs), "verified": verify.stats().checked, "outs": outs,
                      "fused": backend.report.fused_ops(), "frames": torch._dynamo.utils.counters["frames"]["total"],
                      "runtime": backend.report.graphs[0].runtime}))
""")


def child(path: Path, mode: str) -> dict[str, Any]:
    """:data:`CHILD`: a new process loads the artifact at ``path`` and runs it."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), mode], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))  # fmt: skip
    assert done.returncode == 0, done.stderr  # the whole traceback, not pytest's cut of it
    return json.loads(done.stdout.strip().splitlines()[-1])


def saved_here(path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What :data:`CHILD` reports, for the process that compiles and saves the artifact: run in
    this one (the process that saves need not be new: the one that loads must, and is)."""
    from torch._dynamo import convert_frame

    from fxrewrite import passes, verify

    traced: list[str] = []
    for name in ("fullgraph_capture", "_compile"):
        original = getattr(convert_frame, name)
        monkeypatch.setattr(convert_frame, name, lambda *a, _f=original, _n=name, **k: traced.append(_n) or _f(*a, **k))
    runs: list[int] = []
    original_run = passes.PassManager.run
    monkeypatch.setattr(passes.PassManager, "run", lambda self, gm: runs.append(1) or original_run(self, gm))
    verify.clear_cache()  # as in a new process: no verdict of an earlier test reused
    torch._dynamo.reset()
    # a process that built another transformers model first, as a test worker may have: the
    # classes in transformers' global registry then differ from the loading process's
    models.build("qwen2", layers=1)
    model = models.build("llama", layers=1)
    b = fxrewrite.Backend(mode=mode, capture_sizes=(8,), cache=False, progress=False)
    outs = []
    with torch.no_grad():
        step = b.aot_compile(model, models.example_inputs(model))
        for tokens in (8, 5):
            x = models.example_inputs(model, tokens=tokens)
            outs.append(models.hidden_states(step(*x)).flatten().tolist())
            outs.append(models.hidden_states(model(*x)).flatten().tolist())
    step.save(path)
    torch._dynamo.reset()
    return {"traced": traced, "passes_run": len(runs), "verified": verify.stats().checked, "outs": outs,
            "fused": b.report.fused_ops(), "runtime": b.report.graphs[0].runtime}


@pytest.mark.slow
def test_a_new_process_runs_the_artifact_without_tracing_or_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Piecewise: the runner (split, dispatch, emulated capture) is rebuilt from the loaded graph;
    the outputs are the cold process's, bit for bit, at the traced size and another."""
    path = tmp_path / "llama.fxr"
    cold = saved_here(path, "piecewise", monkeypatch)
    warm = child(path, "piecewise")
    assert cold["traced"] == ["fullgraph_capture"] and cold["passes_run"] == 1 and cold["verified"] > 0
    assert warm["traced"] == [] and warm["frames"] == 0  # no Dynamo trace of any kind
    assert warm["passes_run"] == 0 and warm["verified"] == 0
    assert warm["outs"] == cold["outs"]  # bit for bit, both sizes
    for out, eager in zip(warm["outs"][::2], warm["outs"][1::2]):
        assert_close(torch.tensor(out), torch.tensor(eager))
    assert warm["fused"] == cold["fused"] and cold["fused"]["linear_silu_and_mul"] == 1
    assert warm["runtime"] == cold["runtime"]  # the runner as built from Dynamo's graph
    assert warm["runtime"]["mode"] == "piecewise" and not warm["runtime"]["static_shape"]  # the token dim found


# --------------------------------------------------------------------------- in one process


@pytest.mark.parametrize("mode", ["none", "full"])
def test_loaded_equals_cold_bit_for_bit_and_runs_no_pass(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = llama()
    path, cold = saved(tmp_path, model, x, mode=mode, capture_sizes=(8,))
    runs: list[int] = []
    original = fxrewrite.passes.PassManager.run
    monkeypatch.setattr(fxrewrite.passes.PassManager, "run", lambda self, gm: runs.append(1) or original(self, gm))
    b = backend(tmp_path, mode=mode, capture_sizes=(8,))
    with torch.no_grad():
        step = fxrewrite.load(path, model, b)
        assert torch.equal(models.hidden_states(step(*x)), cold)
    assert runs == [] and step.loaded
    assert b.report.fused_ops()["rotary_embedding"] == 1
    assert any("precompiled artifact" in n for n in b.report.graphs[0].notes)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_for_the_whole_aot_compile_and_restored(tmp_path: Path, enabled: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Dynamo's trace, the passes and the guards' pickling run with Python's cyclic collector
    off (two full collections of a cold 8B compile, 0.6 s on the H100 machine, gone); after,
    the collector is as the caller had it, on or off."""
    import gc

    seen: dict[str, bool] = {}
    trace = torch._dynamo.guards.CheckFunctionManager.__init__

    def guards(self: Any, *args: Any, **kwargs: Any) -> None:
        seen["guards"] = gc.isenabled()
        trace(self, *args, **kwargs)

    monkeypatch.setattr(torch._dynamo.guards.CheckFunctionManager, "__init__", guards)
    model, x = llama()
    (gc.enable if enabled else gc.disable)()
    try:
        with torch.no_grad():
            step = backend(tmp_path).aot_compile(model, x)
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
    assert seen == {"guards": False}
    with torch.no_grad():  # a plain torch.compile: Dynamo's guards are built with the collector as it is
        torch._dynamo.reset()
        backend(tmp_path).compile(model)(*x)
    assert seen == {"guards": True}
    assert step is not None


def test_merged_weights_are_made_from_the_loading_models_parameters(tmp_path: Path, artifact: Path) -> None:
    """The artifact holds no weights: another model of the same architecture loads it, and its
    merged q/k/v and gate/up weights are views of its own parameters."""
    (_, x), path = llama(), artifact
    b = models.build("llama", layers=1, seed=1)
    step = fxrewrite.load(path, b, backend(tmp_path))
    names = [n for n, recipe in step.graph.state["recipes"].items() if recipe is not None]
    assert len(names) == 2 and all(getattr(step.graph.gm, n).numel() == 0 for n in names)  # not stored
    with torch.no_grad():
        assert_close(models.hidden_states(step(*x)), models.hidden_states(b(*x)))
    ptrs = {p.untyped_storage().data_ptr() for p in b.parameters()}
    assert all(getattr(step.graph.gm, n).untyped_storage().data_ptr() in ptrs for n in names)


@pytest.mark.parametrize("cache", [True, False])
def test_the_header_holds_the_compile_caches_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: bool) -> None:
    """One key: the artifact's is the key under which the compile cache stores the same graph,
    from one fingerprint of the graph (the cache's, when it is on)."""
    fingerprints: list[int] = []
    original = fingerprint.graph_fingerprint
    monkeypatch.setattr(fingerprint, "graph_fingerprint", lambda gm: fingerprints.append(1) or original(gm))
    model, x = llama()
    path, _ = saved(tmp_path, model, x, cache=cache)
    assert len(fingerprints) == 1
    header, _ = precompile.read_header(path)
    entries = list((tmp_path / "cache" / "graphs").glob("*/*.json"))
    assert [e.stem for e in entries] == ([header["key"]] if cache else [])


def test_aot_compile_generates_the_graphs_code_when_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As under torch.compile (lazy GraphModules): no pass that edits the graph, nor the split,
    generates the Python code of the graph or of the runner's modules; what the first call runs
    generates its code then, once (in mode full the lone piece alone: capture calls it directly,
    as the calls after do), and the graph's code read later is the rewritten graph's. torch 2.11's
    ``split_module`` builds eager GraphModules (2.13's are lazy): there the split module and the
    pieces have their code when split, and only the rewritten graph's is checked."""
    made: list[torch.fx.Graph] = []
    in_backend: list[bool] = [False]
    compiled: list[bool] = []
    python_code, call = torch.fx.Graph.python_code, fxrewrite.Backend.__call__

    def counted(self: torch.fx.Graph, *a: Any, **k: Any) -> Any:
        if in_backend[0] or compiled:  # Dynamo generates the code of the graph it hands us: not ours
            made.append(self)
        return python_code(self, *a, **k)

    def compiling(self: Any, gm: Any, inputs: Any) -> Any:
        in_backend[0] = True
        try:
            return call(self, gm, inputs)
        finally:
            in_backend[0] = False

    monkeypatch.setattr(torch.fx.Graph, "python_code", counted)
    monkeypatch.setattr(fxrewrite.Backend, "__call__", compiling)
    model, x = llama()
    b = backend(tmp_path, mode="full", capture_sizes=(8,))
    with torch.no_grad():
        step = b.aot_compile(model, x)
        split = b.runners[0].split
        lazy_split = torch_at_least(2, 13)
        ours = [b.graphs[0].graph, *((split.module.graph, *(p.submodule.graph for p in split.pieces)) if lazy_split else ())]
        assert not [g for g in made if any(g is o for o in ours)]
        compiled.append(True)
        out = models.hidden_states(step(*x))
        assert torch.equal(models.hidden_states(step(*x)), out)
    generated = [g for g in made if any(g is o for o in ours)]
    assert not any(g is b.graphs[0].graph for g in generated)  # the runner calls the pieces, not the graph
    if lazy_split:
        [piece] = split.pieces
        assert any(g is piece.submodule.graph for g in generated)  # it ran
        assert len({id(g) for g in generated}) == len(generated)  # once each
        assert not any(g is split.module.graph for g in generated)  # nor, for a lone piece, the split module
    assert "torch.ops.fxr.rotary_embedding" in b.graphs[0].code
    assert_close(out, models.hidden_states(model(*x)))


# --------------------------------------------------------------------------- misses


@pytest.mark.parametrize("change", [dict(verify=False), dict(max_positions=64), dict(mode="piecewise"), dict(merge_siblings=False)],
                         ids=["verify", "max_positions", "mode", "merge_siblings"])  # fmt: skip
def test_a_changed_configuration_misses(tmp_path: Path, artifact: Path, change: dict[str, Any]) -> None:
    (model, _), path = llama(), artifact
    fxrewrite.load(path, model, backend(tmp_path))  # the same configuration: a hit
    with pytest.raises(fxrewrite.StaleArtifact, match="the configuration or rules"):
        fxrewrite.load(path, model, backend(tmp_path, **change))


def test_a_changed_rule_set_misses(tmp_path: Path, artifact: Path) -> None:
    (model, _), path = llama(), artifact
    relu = Rule("relu_clamp", lambda t: torch.relu(t), lambda t: torch.clamp(t, min=0))
    for b in (backend(tmp_path, extra_rules=[relu]), backend(tmp_path, rules=[relu])):
        with pytest.raises(fxrewrite.StaleArtifact, match="the configuration or rules"):
            fxrewrite.load(path, model, b)


@pytest.mark.parametrize("what", ["torch", "fxrewrite_source", "kernel_library"])
def test_a_changed_version_misses(tmp_path: Path, artifact: Path, monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    (model, _), path = llama(), artifact
    if what == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.1")
    elif what == "fxrewrite_source":
        monkeypatch.setattr(fingerprint, "source_digest", lambda: "edited")
    else:
        monkeypatch.setattr(fingerprint, "_library_version", lambda module, dist: f"{dist} 99")
    with pytest.raises(fxrewrite.StaleArtifact, match="torch, fxrewrite, a kernel library"):
        fxrewrite.load(path, model, backend(tmp_path))


MODEL_V1 = '''
import torch

class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
'''


@pytest.fixture
def user_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A model of a module of its own (its source can be edited)."""
    (tmp_path / "user_model.py").write_text(MODEL_V1)
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_model

    yield importlib.reload(user_model)
    del sys.modules["user_model"]


def test_changed_model_source_misses(tmp_path: Path, user_model: Any) -> None:
    model, x = user_model.Norm(), torch.randn(4, 32)
    with torch.no_grad():
        step = backend(tmp_path).aot_compile(model, (x,))
    path = step.save(tmp_path / "norm.fxr")
    assert step.graph.report.fused_ops == {"rms_norm": 1}
    fxrewrite.load(path, model, backend(tmp_path))
    (tmp_path / "user_model.py").write_text(MODEL_V1.replace("1e-6", "1e-5"))
    importlib.reload(user_model)
    with pytest.raises(fxrewrite.StaleArtifact, match="the source of user_model"):
        fxrewrite.load(path, user_model.Norm(), backend(tmp_path))


def test_a_changed_value_read_compiles_with_dynamo_or_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """RoPE tables are folded from ``inv_freq``: another rope theta, same guards, is a miss at
    the first call; the call compiles with Dynamo (warned) or, with recompile=False, raises."""
    model, x = llama()
    path, _ = saved(tmp_path, model, x)
    model.rotary_emb.inv_freq.mul_(1.5)
    with torch.no_grad():
        with pytest.raises(fxrewrite.StaleArtifact, match="inv_freq"):
            fxrewrite.load(path, model, backend(tmp_path), recompile=False)(*x)
        step = fxrewrite.load(path, model, backend(tmp_path))
        with caplog.at_level(logging.WARNING, logger="fxrewrite"):
            out = models.hidden_states(step(*x))
        assert "compiling with Dynamo" in caplog.text
        assert_close(out, models.hidden_states(model(*x)))


def test_a_guard_failure_compiles_with_dynamo_or_raises(tmp_path: Path, user_model: Any, caplog: pytest.LogCaptureFixture) -> None:
    model, x = user_model.Norm(), torch.randn(4, 32)
    with torch.no_grad():
        path = backend(tmp_path).aot_compile(model, (x,)).save(tmp_path / "norm.fxr")
        strict = fxrewrite.load(path, model, backend(tmp_path), recompile=False)
        assert torch.equal(strict(torch.ones(7, 32)), model(torch.ones(7, 32)))  # another size: dynamic
        wide = x.double()
        assert not strict.guard_check(wide)
        with pytest.raises(fxrewrite.GuardFailure, match="dtype|float64|Double"):
            strict(wide)
        step = fxrewrite.load(path, model, backend(tmp_path))
        with caplog.at_level(logging.WARNING, logger="fxrewrite"):
            out = step(wide)
        assert "fail the precompiled graph's guards" in caplog.text
        assert out.dtype == torch.float64
        assert_close(out, model.double()(wide))
        with pytest.raises(fxrewrite.GuardFailure, match="grad"):  # grad mode is guarded too
            with torch.enable_grad():
                strict(x)


def test_inputs_marked_as_at_compile_time_pass_the_loaded_guards(tmp_path: Path, user_model: Any) -> None:
    """``mark_static`` on an input (what the CUDA-graph runner wants of every dimension but the
    token count): torch pickles guarded tensors without their marks, fxrewrite keeps them."""
    model, x = user_model.Norm(), torch.randn(8, 32)
    torch._dynamo.mark_static(x, 1)
    with torch.no_grad():
        path = backend(tmp_path).aot_compile(model, (), {"x": x}).save(tmp_path / "norm.fxr")
        step = fxrewrite.load(path, model, backend(tmp_path), recompile=False)
        assert step.guard_check(x=x) and torch.equal(step(x=x), model(x))
        y = torch.randn(5, 32)
        torch._dynamo.mark_static(y, 1)
        assert torch.equal(step(x=y), model(y))  # another token count, marked the same
        torch._dynamo.mark_static(y, 0)
        if not torch_at_least(2, 13):
            # torch 2.11 guards no mark that was not there at compile time (seen on the GPU machine)
            assert step.guard_check(x=y) and torch.equal(step(x=y), model(y))
        else:
            with pytest.raises(fxrewrite.GuardFailure, match="_dynamo_static_indices"):  # a new mark
                step(x=y)


def test_the_artifacts_guards_keep_the_key_order_of_argument_dicts_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Key order read by position is kept for the dicts reached from the model's arguments and
    dropped for those reached through a global (transformers' model registry, whose keys are
    this process's history); the set Dynamo keeps for its own guards is left alone."""
    from types import SimpleNamespace

    from torch._dynamo import guards
    from torch._dynamo.source import AttrSource, GlobalSource, LocalSource

    pickled: list[set[Any]] = []
    record = lambda state, *a: pickled.append(state.output_graph.guard_on_key_order) or b""  # noqa: E731
    monkeypatch.setattr(guards, "pickle_guards_state", record)
    local, registry = LocalSource("kwargs"), AttrSource(GlobalSource("output_capturing"), "_CAN_RECORD_REGISTRY")
    live = {local, registry}

    def state() -> Any:  # what torch pickles: a dump of the output graph, holding its set
        return SimpleNamespace(output_graph=SimpleNamespace(guard_on_key_order=live))

    with precompile._local_key_order():
        guards.pickle_guards_state(state(), None)
    assert pickled == [{local}] and live == {local, registry}
    guards.pickle_guards_state(state(), None)  # restored on exit: no filter
    assert pickled[-1] == {local, registry}


def test_damaged_artifacts_are_misses(tmp_path: Path, artifact: Path) -> None:
    (model, _), path = llama(), artifact
    data = path.read_bytes()
    for bad in (b"not an artifact", data[: len(data) // 2]):
        path.write_bytes(bad)
        with pytest.raises(fxrewrite.StaleArtifact):
            fxrewrite.load(path, model, backend(tmp_path))


def test_warm_start_compiles_saves_then_loads_and_compiles_again_on_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, x = llama()
    path = tmp_path / "serve" / "llama.fxr"
    with torch.no_grad():
        first = fxrewrite.warm_start(model, path, x, backend=backend(tmp_path))
        assert not first.loaded and path.exists()
        second = fxrewrite.warm_start(model, path, x, backend=backend(tmp_path))
        assert second.loaded
        assert torch.equal(models.hidden_states(second(*x)), models.hidden_states(first(*x)))
        with caplog.at_level(logging.WARNING, logger="fxrewrite"):
            third = fxrewrite.warm_start(model, path, x, backend=backend(tmp_path, verify=False))
        assert not third.loaded and "not used (the compile cache's key differs" in caplog.text
        assert fxrewrite.warm_start(model, path, x, backend=backend(tmp_path, verify=False)).loaded  # saved anew
