"""bench/bench_e2e.py runs end to end on CPU (tiny model): each system in a child process, the
side-by-side process, the tables, the goal lines; the quantized models' runs in the test's own
process. A smoke test of the harness, not a measurement."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_e2e.py"


# ~100 s of CI's test stage: exhaustive. Its library paths (the cache's restart, Backend.unguarded,
# the first call) have tests of their own in tests/fxrewrite, and the harness runs in CI through
# the quantized rows below; run it with -m exhaustive after a change to bench_e2e.py
@pytest.mark.exhaustive
@pytest.mark.slow
def test_full_graph_rows_of_fxrewrite_and_the_twin(tmp_path: Path) -> None:
    out = tmp_path / "e2e.md"
    # every system but Dynamo alone (its row is the same harness over a backend with nothing of
    # ours: ~10 s of the CI's test stage)
    argv = ["--shape", "tiny", "--device", "cpu", "--systems", "fxrewrite-full,fused-full,fxrewrite-full-ug,full-norewrite,fxrewrite-full-warm",
            "--budget-s", "400",
            "--target-s", "0.02", "--min-reps", "2", "--warmup", "2", "--paired", "fxrewrite-full,fused-full", "--rounds", "2",
            "--out", str(out)]  # fmt: skip
    # a process of its own: the script sets process-wide state (grad mode, Dynamo and Inductor config)
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    for system in ("fxrewrite full", "hand-fused full", "fxrewrite full, unguarded", "full, no rewrites",
                   "fxrewrite full, cache warm"):
        cells = [c.strip() for c in rows[system].split("|")[2:-1]]
        assert len(cells) == 8 and all(re.fullmatch(r"\d+\.\d+", c) for c in cells[:5]), rows[system]
        assert float(cells[7]) < 1e-3  # float32 on CPU: the rewritten graph computes what eager does
    # the 2% goal is read from the side-by-side process, the ratio across processes stays beside it
    assert re.search(r"- decode 8, fxrewrite full / hand-fused full, one process \(.*rounds [\d.]+-[\d.]+\): [\d.]+ "
                     r"\(goal <= 1.02\): .* \[across processes: [\d.]+\]", text)
    side = [c.strip() for c in rows["decode 8"].split("|")[2:-1]]
    assert len(side) == 3 and re.fullmatch(r"[\d.]+ \([\d.]+-[\d.]+\)", side[2]), rows["decode 8"]
    assert "Decode, calls back to back (ms per step):" in text and "- decode 8 back to back, best fxrewrite / HBM floor: " in text
    assert "fused: fused_add_rms_norm_ x4, linear x6, linear_silu_and_mul x2, rms_norm x1, rotary_embedding x2" in text
    # the unguarded row ran every column's steps after the first through Backend.unguarded
    assert "- fxrewrite full, unguarded: unguarded: 5 step shapes called without Dynamo" in text
    # the restart found every graph "fxrewrite full" stored, and the first calls are compared
    assert "- fxrewrite full: cache miss: 3 graphs, stored 3" in text
    assert re.search(r"- fxrewrite full, cache warm: cache hit: 3 graphs, saved [\d.]+ s", text)
    for what, goal in (("fxrewrite full / full, no rewrites", "1.25"), ("fxrewrite full, cache warm / full, no rewrites", "1.05")):
        assert re.search(rf"- first call, {re.escape(what)}: [\d.]+ \(goal <= {goal}\)", text), what
    # the negative twin of --quant (the default, none): no format, no quantized op
    assert "- quantization" not in text and "quant fusions per layer" not in text and "quant_fp8" not in text
    assert "rel err vs float32 eager\n" in text


SYSTEM_KEYS = {"eager": "eager", "fxrewrite full": "fxrewrite-full"}
QUANT_OPS = {
    "fp8": ("fused_add_rms_norm_quant_fp8 x3", "rms_norm_quant_fp8 x1", "linear_fp8_silu_and_mul_quant x2"),
    # the quantizers alone (the attention outputs'), named whole: "fused: " or ", " before them
    "block-fp8": ("fused_add_rms_norm_block_quant_fp8 x3", "rms_norm_block_quant_fp8 x1", "silu_and_mul_block_quant_fp8 x2",
                  "fused: block_quant_fp8 x2"),
    "nvfp4": ("fused_add_rms_norm_quant_nvfp4 x3", "rms_norm_quant_nvfp4 x1", "silu_and_mul_quant_nvfp4 x2",
              ", quant_nvfp4 x2"),
}
# the report's sites per decoder layer (2 layers), as the notes list them
PER_LAYER = {
    # the activation's quantization, then the gate_up GEMM taking it in (select_gemm): both rules' sites
    "fp8": "quant fusions per layer: add_rms_norm_quant_fp8 x1 layer 0, x2 layer 1; attention_quant_fp8 x1 layers 0-1; "
           "linear_fp8_silu_and_mul_quant x1 layers 0-1; rms_norm_quant_fp8 x1 layer 0, x0 layer 1; "
           "silu_and_mul_quant_fp8 x1 layers 0-1",
    "block-fp8": "quant fusions per layer: add_rms_norm_block_quant_fp8 x1 layer 0, x2 layer 1; block_quant_fp8 x1 "
                 "layers 0-1; rms_norm_block_quant_fp8 x1 layer 0, x0 layer 1; silu_and_mul_block_quant_fp8 x1 layers "
                 "0-1; near miss attention_quant_fp8 x2 (a dynamic quantization: its scale is reduced from the attention "
                 "output",
    "nvfp4": "quant fusions per layer: add_rms_norm_quant_nvfp4 x1 layer 0, x2 layer 1; quant_nvfp4 x1 layers 0-1; "
             "rms_norm_quant_nvfp4 x1 layer 0, x0 layer 1; silu_and_mul_quant_nvfp4 x1 layers 0-1; near miss "
             "attention_quant_fp8 x2 (a dynamic quantization: its scale is reduced from the attention output",
}


def run_quant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quant: str, systems: str) -> str:
    """The bench's command line in this process, each row's process too (``main`` with that
    child's arguments and environment): what a quantized row checks is its model, fusions and
    notes; the processes themselves are test_full_graph_rows_of_fxrewrite_and_the_twin's (a new
    process cost a CI worker 5-10 s: imports, Dynamo's first compile)."""
    import bench_e2e

    def run_child(key: str, argv: list[str], args: Any) -> tuple[dict[str, Any], None]:
        with monkeypatch.context() as m:
            for name, value in bench_e2e.child_env(key, args).items():
                m.setenv(name, value)
            assert bench_e2e.main(bench_e2e.child_argv(key, argv, args)) == 0
        return json.loads((Path(args.workdir) / f"{key}.json").read_text()), None

    monkeypatch.setattr(bench_e2e, "run_child", run_child)
    out = tmp_path / f"e2e-{quant}.md"
    argv = ["--shape", "tiny", "--device", "cpu", "--quant", quant, "--systems", systems, "--budget-s", "400",
            "--target-s", "0.01", "--min-reps", "1", "--warmup", "2", "--out", str(out)]  # fmt: skip
    # main sets these for its process: restored after the test. config.patch, not monkeypatch:
    # torch 2.11's config modules lose an attribute monkeypatch restores
    dynamo = ({"fail_on_recompile_limit_hit": torch._dynamo.config.fail_on_recompile_limit_hit}
              if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit") else {})  # fmt: skip
    with (torch.set_grad_enabled(torch.is_grad_enabled()),  # main turns it off
          torch._inductor.config.patch(force_disable_caches=torch._inductor.config.force_disable_caches),
          torch._dynamo.config.patch(**dynamo)):  # fmt: skip
        assert bench_e2e.main(argv) == 0
    return out.read_text()


def finite_rows(text: str, systems: tuple[str, ...]) -> None:
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    for system in systems:
        cells = [c.strip() for c in rows[system].split("|")[2:-1]]
        assert len(cells) == 8 and all(re.fullmatch(r"\d+\.\d+", c) for c in cells[:5]), rows[system]
        assert float(cells[7]) < 1e-3  # float32 on CPU against the same quantized model in float32


@pytest.mark.parametrize("quant", ["fp8", "block-fp8", "nvfp4"])
def test_quantized_model_in_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quant: str) -> None:
    """``--quant``: eager (FP8's run) and fxrewrite full time the same quantized model; the header
    names the format, the notes list the fused quantizations
    per layer (attention + FP8 for static FP8; for block FP8 and NVFP4 the attention output's
    dynamic quantization is the quantizer alone, and the near miss says why the attention does
    not take it)."""
    # the side-by-side process: test_full_graph_rows_of_fxrewrite_and_the_twin; the eager row once
    systems = ("eager", "fxrewrite full") if quant == "fp8" else ("fxrewrite full",)
    text = run_quant(tmp_path, monkeypatch, quant, ",".join(SYSTEM_KEYS[s] for s in systems))
    assert f"- quantization ({quant}): " in text and "no hand-fused twin" in text
    assert "rel err vs float32 eager: the same quantized model, eager, every value that is not quantized in float32" in text
    finite_rows(text, systems)
    notes = [line for line in text.splitlines() if line.startswith("- fxrewrite full: graph")]
    assert notes and all(op in " ".join(notes) for op in QUANT_OPS[quant]), notes
    assert any(PER_LAYER[quant] in line for line in notes), notes


def test_a_system_that_cannot_be_built_is_saved_failed_with_the_reason() -> None:
    """The child saves the row of a system whose build raises, so the table says ``failed`` and
    the notes why (it returned unsaved once: the row read "-" and the notes "none")."""
    import types

    import bench_e2e
    from e2e_systems import System

    def build(*_: Any) -> Any:
        raise ValueError("no kernel for this shape")

    saved: list[Any] = []
    cols = [types.SimpleNamespace(name="decode 1", kind="decode"), types.SimpleNamespace(name="prefill 64", kind="prefill")]
    ctx = types.SimpleNamespace(model=None, twin=None, capture={}, fx_options={})
    res = bench_e2e.run_system(System("broken", "broken row", build), cols, ctx, saved.append)  # type: ignore[arg-type]
    assert saved and saved[-1] is res
    assert res.cells == {"decode 1": "failed", "prefill 64": "failed"}
    assert res.notes == ["not built: ValueError: no kernel for this shape"]
