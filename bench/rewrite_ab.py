"""Rewrite time of this checkout against another git revision, side by side on CPU.

    python bench/rewrite_ab.py --base main [--layers 32] [--rounds 16]

One package cannot be imported twice in a process (its custom ops register once), so each side
runs in a live worker process of its own: ``--base`` exported with ``git archive`` to a temporary
directory, and this checkout. Both capture the same HF Llama graph (``models.build("llama")``,
tiny widths: node count is what costs), rewrite it once to warm up, then take turns: each round
rewrites a fresh deep copy of the graph in one worker, then in the other (the order swapped every
round), all default passes with the compile cache off. On a shared, loaded machine the step
times move by 2x from second to second; the per-round ratio (two rewrites a second apart) is
the figure to read, its median and range, with each side's median and minimum beside it. The
last lines are the median time of each pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import copy, json, sys, time, torch, fxrewrite
from fxrewrite import models
model = models.build("llama", layers=int(sys.argv[1]))
graphs = []
def keep(gm, example_inputs):
    graphs.append((gm, example_inputs))
    return gm.forward
with torch.no_grad():
    torch.compile(model, backend=keep, fullgraph=True, dynamic=True)(*models.example_inputs(model))
gm, example_inputs = graphs[0]
off = {"cache": False} if "cache" in fxrewrite.Config.__dataclass_fields__ else {}  # older revisions: no cache
def rewrite():
    backend = fxrewrite.Backend(**off)
    graph = copy.deepcopy(gm)
    t0 = time.perf_counter()
    backend(graph, example_inputs)
    report = backend.report.graphs[0]
    return {"ms": (time.perf_counter() - t0) * 1e3, "passes": {p.name: p.ms for p in report.passes}, "fused": report.fused_ops}
rewrite()
print(json.dumps({"package": fxrewrite.__file__, "nodes": len(gm.graph.nodes)}), flush=True)
for _ in sys.stdin:
    print(json.dumps(rewrite()), flush=True)
"""


def export(rev: str | None, into: Path) -> Path:
    """The package of git revision ``rev`` (None: this checkout's files as they are, edits
    included) laid out as installed (``fxrewrite/``, ``fxrewrite/rewrites``, ``fxrewrite/runtime``)
    under ``into``; returns the directory to put on PYTHONPATH."""
    into.mkdir()
    if rev is None:
        for sub in ("fxrewrite", "rewrites", "runtime"):
            shutil.copytree(ROOT / sub, into / sub, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "fxrewrite", "rewrites", "runtime"],
                                 check=True, capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for sub in ("rewrites", "runtime"):
        (into / "fxrewrite" / sub).symlink_to(into / sub, target_is_directory=True)
    return into


def start(layers: int, path: Path, cwd: str) -> subprocess.Popen[str]:
    # PYTHONPATH comes before an editable install of the package
    env = {**os.environ, "FXREWRITE_CACHE": "0", "PYTHONPATH": str(path)}
    return subprocess.Popen([sys.executable, "-c", WORKER, str(layers)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, cwd=cwd)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--base", default="main", help="git revision to compare this checkout with")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=16)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fxrewrite-ab-") as tmp:
        sides = {args.base: export(args.base, Path(tmp) / "base"), "this checkout": export(None, Path(tmp) / "this")}
        workers = {name: start(args.layers, path, tmp) for name, path in sides.items()}
        ready = {name: json.loads(w.stdout.readline()) for name, w in workers.items()}  # type: ignore[union-attr]
        print(f"# rewrite time, {args.layers} layers ({ready['this checkout']['nodes']} nodes), {args.rounds} rounds", flush=True)
        for name, r in ready.items():
            print(f"- {name}: {r['package']}")
        runs: dict[str, list[dict]] = {name: [] for name in workers}
        names = list(workers)
        for i in range(args.rounds):
            for name in names if i % 2 == 0 else names[::-1]:
                w = workers[name]
                w.stdin.write("go\n")  # type: ignore[union-attr]
                w.stdin.flush()  # type: ignore[union-attr]
                runs[name].append(json.loads(w.stdout.readline()))  # type: ignore[union-attr]
            print(f"  round {i + 1}: " + ", ".join(f"{n} {runs[n][-1]['ms']:.0f} ms" for n in names), file=sys.stderr)
        for w in workers.values():
            w.stdin.close()  # type: ignore[union-attr]
            w.wait()
    if runs[names[0]][-1]["fused"] != runs[names[1]][-1]["fused"]:
        print(f"note: the two fuse different ops: {runs[names[0]][-1]['fused']} / {runs[names[1]][-1]['fused']}")
    ratios = [b["ms"] / a["ms"] for a, b in zip(runs[names[0]], runs[names[1]])]
    print("\n| | median ms | min ms |\n|---|---|---|")
    for name in names:
        ms = [r["ms"] for r in runs[name]]
        print(f"| {name} | {statistics.median(ms):.1f} | {min(ms):.1f} |")
    print(f"\nthis checkout / {args.base}, per round: median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    passes = list(runs[names[1]][-1]["passes"])
    print("\n| pass | " + " | ".join(f"{n} ms" for n in names) + " |\n|---|---|---|")
    for pass_name in passes:
        cells = [f"{statistics.median(r['passes'].get(pass_name, 0.0) for r in runs[n]):.1f}" for n in names]
        print(f"| {pass_name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
