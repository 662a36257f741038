"""bench/warm_start.py end to end on CPU (tiny model): every row that runs there in its own
process, the table with ratios to Dynamo alone and the goal lines. A smoke test of the harness
(and of the cache directories each row gets), not a measurement."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import warm_start

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "warm_start.py"


def test_rows_table_and_goal_lines() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny", "--device", "cpu", "--repeat", "1"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    table = text[text.index("| row |") :]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| row")}  # fmt: skip
    assert list(rows) == ["Dynamo alone", "fxrewrite cold, every cache empty", "fxrewrite cold, Triton's cache warm",
                          "fxrewrite warm (precompiled)"]  # Inductor + CUDA graphs: CUDA only
    assert rows["Dynamo alone"][1:] == ["-", "1.00", "-"]
    for label, goal in (("fxrewrite cold, every cache empty", "1.6"), ("fxrewrite cold, Triton's cache warm", "1.25"),
                        ("fxrewrite warm (precompiled)", "0.5")):  # fmt: skip
        first, backend, ratio, line = rows[label]
        assert re.fullmatch(r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)", first) and re.fullmatch(r"\d+\.\d\d", backend)
        assert line == f"<= {goal}" and re.fullmatch(r"\d+\.\d\d", ratio)
        assert re.search(rf"^- {re.escape(label)} / Dynamo alone: \d+\.\d\d \(goal <= {goal}\): (met|NOT met)$", text, re.M)
    assert text.rstrip().splitlines()[-1].startswith("- fxrewrite warm (precompiled) / Dynamo alone")  # the table last


def test_cache_directories_of_a_round(tmp_path: Path) -> None:
    env = {row: warm_start.environment(row, tmp_path, 2) for row in ("cold", "cold-triton", "warm", "inductor-cg")}
    triton, ours = (lambda r: env[r]["TRITON_CACHE_DIR"]), (lambda r: env[r]["FXREWRITE_CACHE_DIR"])
    assert triton("cold") == triton("cold-triton") == triton("warm") != triton("inductor-cg")  # Triton's: the cold row's
    assert ours("cold") == ours("warm") != ours("cold-triton")  # ours: empty for cold-triton
    assert "TORCHINDUCTOR_CACHE_DIR" in env["inductor-cg"]
    assert warm_start.rows_for("cpu") == ["dynamo", "cold", "cold-triton", "warm"]
    assert warm_start.rows_for("cuda")[-1] == "inductor-cg"
