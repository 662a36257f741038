"""CPU tests of ``bench/gpu_families.py``'s plumbing: a family that is not Llama-shaped (Falcon, built
as bench/coverage.py builds it) through ``run_case`` on CPU (piecewise: captures emulated), its row
and table line, and how pieces not captured are counted and explained."""

from __future__ import annotations

import pytest
import torch

import gpu_families as gf
from helpers.families import family_param

pytest.importorskip("transformers")


def test_falcon_runs_piecewise_on_cpu_with_every_piece_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gf, "FAMILY_SHAPE", dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256))
    monkeypatch.setattr(gf, "SHAPES", ((1, 9), (1, 9)))
    row = gf.run_case("falcon", "piecewise", poison=False, device="cpu", capture_sizes=(4, 8, 16))
    assert type(gf.build("falcon")).__name__ == "FalconForCausalLM"
    # 2 layers: before, between and after the two attentions; Falcon's list indices are constants
    assert row["ok"] and (row["pieces_captured"], row["pieces"], row["not_captured"]) == (3, 3, [])
    # the 1.10x goal is the GPU's (its kernels); here only the plumbing of the errors
    assert row["fused"]["rotary_embedding"] == 2 and 0 < row["err_eager"] < 0.05 and 0 < row["err"] < 0.05
    assert row["ratio"] == row["err"] / row["err_eager"]
    line = gf.table([dict(row, process="own")]).splitlines()[-1]
    assert line.startswith("| own | falcon | piecewise | ok | ") and " | 3/3 | " in line


def test_pieces_not_captured_are_counted_with_their_reasons() -> None:
    hazard = {"piece": "submod_2", "sizes": "all", "op": "call_method item", "node": "item",
              "source": "File m.py, line 3", "reason": "syncs with the host"}
    failed = {"piece": "submod_4", "sizes": [8, 4], "op": "call_function fragile", "node": "fragile",
              "source": "File m.py, line 9", "reason": "capture failed: RuntimeError: no"}
    runtime = [{"captured_pieces": 1, "eager_pieces": [hazard, failed], "reason": None},
               {"captured_pieces": 2, "eager_pieces": [], "reason": "captured pieces read 2 dynamic dimensions"}]
    captured, total, why = gf.piece_counts(runtime)
    assert (captured, total) == (1, 5)
    assert why == ["graph not captured: captured pieces read 2 dynamic dimensions",
                   "submod_2 (every size): call_method item at File m.py, line 3: syncs with the host",
                   "submod_4 (sizes [8, 4]): call_function fragile at File m.py, line 9: capture failed: RuntimeError: no"]


@pytest.mark.parametrize("family", [family_param(f) for f in gf.COVERAGE_FAMILIES])
def test_each_new_family_builds_at_the_bench_shape(family: str) -> None:
    model = gf.build(family)
    vocab, hidden = model.get_input_embeddings().weight.shape
    assert (vocab, hidden) == (gf.FAMILY_SHAPE["vocab"], gf.FAMILY_SHAPE["hidden"])
    assert next(model.parameters()).dtype == torch.float32 and not model.training


def test_own_process_cases_report_progress_as_each_ends(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A long own-process run says which case ended, how many of how many and when, before the
    table (a run cut short by a time limit still shows how far it got); a case whose process
    failed says ERROR there and in the table, and the run exits 1."""
    ok = {"ok": True, "fused": {}, "served": {}, "fallbacks": {}, "near_misses": [], "rejected": [],
          "graph_reasons": [], "verification_fallbacks": {}, "err": 1e-3, "err_eager": 1e-3, "ratio": 1.0}  # fmt: skip

    def spawn(cases: list[tuple[str, str]], extra: list[str], timeout: int) -> list[dict[str, object]]:
        (family, mode), = cases
        return [dict(ok, family=family, mode=mode) if family == "llama" else
                {"family": family, "mode": mode, "ok": False, "error": "process exited -1 before this case"}]

    monkeypatch.setattr(gf, "_spawn", spawn)
    monkeypatch.setattr("sys.argv", ["gpu_families.py", "--device", "cpu", "--families", "llama,qwen3",
                                     "--modes", "none", "--no-all", "--jobs", "1"])  # fmt: skip
    assert gf.main() == 1
    out, err = capsys.readouterr()
    progress = [line for line in err.splitlines() if line.startswith("[")]
    assert [p.split(",")[0] for p in progress] == ["[1/2", "[2/2"]
    assert progress[0].endswith("own process llama none: ok") and progress[1].endswith("own process qwen3 none: ERROR")
    assert "| own | llama | none | ok |" in out and "| own | qwen3 | none | ERROR process exited -1" in out
