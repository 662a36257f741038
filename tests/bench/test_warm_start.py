"""bench/warm_start.py end to end on CPU (tiny model): every row that runs there in its own
process, the table with ratios to Dynamo alone and the goal lines. A smoke test of the harness
(and of the cache directories each row gets), not a measurement."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import warm_start

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "warm_start.py"


# ~50 s of CI's test stage (a process per row): exhaustive. What the rows run is tested in
# tests/fxrewrite (test_precompile's new process, test_cold_start); the rows' cache directories
# below; run it with -m exhaustive after a change to warm_start.py
@pytest.mark.exhaustive
@pytest.mark.slow
def test_rows_table_and_goal_lines() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny", "--device", "cpu", "--repeat", "1"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    table = text[text.index("| row |") :].split("\n\n")[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| row")}  # fmt: skip
    assert list(rows) == ["Dynamo alone", "fxrewrite cold, every cache empty", "fxrewrite cold, Triton's cache warm",
                          "fxrewrite warm (precompiled)"]  # Inductor + CUDA graphs: CUDA only
    assert rows["Dynamo alone"][1:4] == ["-", "1.00", "-"] and rows["Dynamo alone"][5] == "1.00"  # on the CPU: its CPU time too
    for label, goal in (("fxrewrite cold, every cache empty", "1.6"), ("fxrewrite cold, Triton's cache warm", "1.25"),
                        ("fxrewrite warm (precompiled)", "0.5")):  # fmt: skip
        first, backend, ratio, line, cpu, cpu_ratio = rows[label]
        assert re.fullmatch(r"\d+\.\d\d", cpu) and re.fullmatch(r"\d+\.\d\d", cpu_ratio)
        assert re.fullmatch(r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)", first) and re.fullmatch(r"\d+\.\d\d", backend)
        assert line == f"<= {goal}" and re.fullmatch(r"\d+\.\d\d", ratio)
        assert re.search(rf"^- {re.escape(label)} / Dynamo alone: \d+\.\d\d \(goal <= {goal}\): (met|NOT met)$", text, re.M)
    assert text.rstrip().splitlines()[-1].startswith("- fxrewrite warm (precompiled) / Dynamo alone")  # the table last
    # the first call by stage: a column per split row, a line per stage, the times add up
    split = text[text.index("| stage (s) |") :].split("\n\n")[0].splitlines()
    assert split[0] == "| stage (s) | dynamo | cold | cold-triton |"
    stages = {line.split("|")[1].strip(): [float(c) for c in line.split("|")[2:-1]] for line in split[2:]}
    assert len(stages) == len(warm_start.STAGES) + 1 and "full collections (count)" in stages
    ours = stages["Backend.__call__ (ours)"]
    assert ours[0] == 0 and all(v > 0 for v in ours[1:]) and stages["Dynamo's trace (torch)"][0] > 0
    assert all(stages["the passes"][i] <= ours[i] for i in (1, 2))


def test_cache_directories_of_a_round(tmp_path: Path) -> None:
    env = {row: warm_start.environment(row, tmp_path, 2) for row in ("cold", "cold-triton", "warm", "inductor-cg")}
    triton, ours = (lambda r: env[r]["TRITON_CACHE_DIR"]), (lambda r: env[r]["FXREWRITE_CACHE_DIR"])
    assert triton("cold") == triton("cold-triton") == triton("warm") != triton("inductor-cg")  # Triton's: the cold row's
    assert ours("cold") == ours("warm") != ours("cold-triton")  # ours: empty for cold-triton
    assert "TORCHINDUCTOR_CACHE_DIR" in env["inductor-cg"]
    assert warm_start.rows_for("cpu") == ["dynamo", "cold", "cold-triton", "warm"]
    assert warm_start.rows_for("cuda")[-1] == "inductor-cg"
