"""Every transformers family of the CLI on the GPU in bf16, in every mode: what fused, which
provider served each fused op, every fallback to the torch reference, and the error against a
float32 reference next to eager bf16's (issue 19). GPU only.

    source .devkit/setup.sh && python3 bench/gpu_families.py [--families llama,qwen3] [--modes none,full]
        [--capture-sizes 1,2,4,8,16,24,32] [--jobs 4] [--json out.json] [--no-all | --no-own] [--no-poison]
    python3 bench/gpu_families.py --child llama:none,llama:piecewise   # cases in this process, rows as JSON
    python3 bench/gpu_families.py --device cpu --families falcon --jobs 1  # a check of this script on CPU
    python3 bench/gpu_families.py --gemm-fusion --modes piecewise,full     # with Config.gemm_fusion

Cases: each family of ``fxrewrite.models.MODELS``, the MoE families included (tiny config: hidden
512, 8 heads of 64, 2 KV heads, 2 layers, vocab 1024, random weights), and the families of
:data:`COVERAGE_FAMILIES` (GPT-NeoX, StarCoder2, Falcon, Phi, gpt-oss, GLM-4.5-MoE, Llama 4, OLMo,
Qwen3-Next, Bamba, nanochat: other shapes of model code), built as ``bench/coverage.py`` builds every transformers family (its
``build(family, Shape(...))`` at the same hidden size, heads and vocabulary; one layer of each
kind, at least two; SDPA where the family has it, else its eager attention, as gpt-oss), in each
mode (none, piecewise, full), compiled with ``Backend(mode=...).compile(model)`` (``dynamic=True``,
``fullgraph=True``) and called with input ids of shapes (1, 9), (4, 17), (1, 1), (8, 1), each twice
(the second call replays); modes piecewise and full capture the token counts ``--capture-sizes`` (a
graph whose batch and sequence are both dynamic runs eagerly: the runner captures one dynamic
dimension; the table says how many graphs replayed), and how many pieces were captured: a piece
that is not (a capture hazard, a capture that failed) runs eagerly, and the lines above the table
say which piece, which op, its source line and why (``Runner.stats()["eager_pieces"]``).

Processes: every case first runs in a process of its own (a sticky CUDA error costs one row),
then one process runs every case one after another, as a serving process compiling several
models does, with ``torch._dynamo.reset()`` between cases and the caching allocator poisoned
before each (blocks filled with a large integer pattern and freed: an index read before it was
written then points far out of bounds and the device asserts). Rows: fused ops, the providers
that served the model's calls (captures and eager runs; replays do not pass through the
dispatcher), fallbacks to the torch reference among them (verification's own calls at compile
time are counted apart, ``providers.counting``, and listed above the table), the runners' CUDA graphs (graphs captured / graphs), and the largest error over the calls relative
to the float32 reference's largest value, for the compiled model and for eager bf16, and their
ratio (the goal: at most 1.10). In an MoE family a token whose top-k routing is a near-tie
(``fxrewrite.testing.routing_near_ties``) may pick another expert under any rounding order, and
attention carries that jump to the later tokens of its sequence: both errors are taken over the
other tokens, and the row says how many were left out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import datetime
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

FAMILY_SHAPE = dict(layers=2, hidden=512, heads=8, kv_heads=2, vocab=1024)
# families that are not Llama-shaped, built by bench/coverage.py at FAMILY_SHAPE's size (issue 34),
# and those of issue 29's mechanisms: LayerNorm without weight or bias (olmo), the gated RMSNorm
# after Gated DeltaNet (qwen3_next) and Mamba2's over groups (bamba), the weightless RMSNorm (nanochat)
COVERAGE_FAMILIES = ("gpt_neox", "starcoder2", "falcon", "phi", "gpt_oss", "glm4_moe", "llama4_text", "olmo",
                     "qwen3_next", "bamba", "nanochat")
SHAPES = ((1, 9), (4, 17), (1, 1), (8, 1))
MODES = ("none", "piecewise", "full")
MARK = "RESULT "


def _rel(out: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor | None = None) -> float:
    """Largest error relative to the reference's largest value, over the tokens ``keep`` ([batch, seq])."""
    diff = (out.float() - ref).abs()
    diff = diff if keep is None else diff[keep]
    return (diff.max() / ref.abs().max()).item() if diff.numel() else 0.0


@functools.cache
def _coverage() -> Any:
    """bench/coverage.py, loaded by path: a ``coverage`` package (coverage.py, pytest-cov's) may own the name."""
    spec = importlib.util.spec_from_file_location("fxrewrite_bench_coverage", Path(__file__).with_name("coverage.py"))
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # type: ignore[arg-type,union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def build(family: str) -> torch.nn.Module:
    """``family`` in float32 at FAMILY_SHAPE: from ``fxrewrite.models`` (the CLI's families), else
    as bench/coverage.py builds it (:data:`COVERAGE_FAMILIES`, or any transformers family)."""
    from fxrewrite import models

    if family in models.MODELS:
        return models.build(family, dtype=torch.float32, **FAMILY_SHAPE)
    coverage = _coverage()
    shape = coverage.Shape(hidden=FAMILY_SHAPE["hidden"], heads=FAMILY_SHAPE["heads"], kv_heads=FAMILY_SHAPE["kv_heads"],
                           vocab=FAMILY_SHAPE["vocab"])  # fmt: skip
    model, _attention = coverage.build(family, shape)
    return model


def piece_counts(runtime: list[dict[str, Any]]) -> tuple[int, int, list[str]]:
    """Over a case's graphs: pieces captured, pieces to capture (splitting pieces run eagerly by
    design and are not counted), and why each piece that is not captured is not (a graph the
    runner does not capture at all counts all its pieces)."""
    captured, total, why = 0, 0, []
    for r in runtime:
        eager = r.get("eager_pieces", [])
        names = {e["piece"] for e in eager}
        n = r["captured_pieces"] + len(names)
        total += n
        if r.get("reason"):
            why.append(f"graph not captured: {r['reason']}")
            continue
        captured += r["captured_pieces"]
        why += [f"{e['piece']} ({'every size' if e['sizes'] == 'all' else 'sizes ' + str(e['sizes'])}): "
                f"{e['op']} at {e['source']}: {e['reason']}" for e in eager]  # fmt: skip
    return captured, total, sorted(set(why))


def run_case(family: str, mode: str, poison: bool, device: str = "cuda",
             capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32), gemm_fusion: bool = False) -> dict[str, Any]:
    """Compile ``family`` in ``mode`` and call it on every shape; the row of the table (on CPU
    the same, for a check of this script: piecewise and full emulate their graphs there)."""
    import fxrewrite
    from fxrewrite import models
    from fxrewrite.runtime import providers
    from fxrewrite.testing import poison_allocator, routing_near_ties

    device = torch.device(device)
    torch._dynamo.reset()
    providers.reset_counts()  # verification's calls are counted apart (providers.counting)
    if poison and device.type == "cuda":
        poison_allocator(device)
    ref32 = build(family).to(device)
    eager16 = copy.deepcopy(ref32).to(torch.bfloat16)
    model = copy.deepcopy(eager16)  # merge_siblings re-lays its weights
    backend = fxrewrite.Backend(mode=mode, capture_sizes=capture_sizes, max_capture_size=max(capture_sizes),
                                gemm_fusion=gemm_fusion)
    compiled = backend.compile(model)
    g = torch.Generator(device=device).manual_seed(0)
    err, err_eager, compile_s, ties = 0.0, 0.0, 0.0, 0
    with torch.no_grad():
        for i, shape in enumerate(SHAPES):
            ids = torch.randint(0, FAMILY_SHAPE["vocab"], shape, device=device, generator=g)
            near = routing_near_ties(ref32, eager16, ids, causal=shape)
            keep = None if near is None else ~near
            ties += 0 if near is None else int(near.sum())
            ref = models.hidden_states(ref32(ids)).float()
            base = models.hidden_states(eager16(ids))
            for call in range(2):
                t0 = time.perf_counter()
                out = models.hidden_states(compiled(ids))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if call == 0:
                    compile_s += time.perf_counter() - t0
                err = max(err, _rel(out, ref, keep))
            err_eager = max(err_eager, _rel(base, ref, keep))
    backend.refresh_runtime()
    report = backend.report
    served = providers.served()
    runtime = [g.runtime for g in report.graphs if g.runtime]
    pieces_captured, pieces_total, not_captured = piece_counts(runtime)
    return {
        "family": family, "mode": mode, "ok": True,
        "fused": report.fused_ops(),
        "near_misses": [f"{m.rule}: {m.reason}" for m in report.near_misses],
        "rejected": [f"{r.rule}: {r.reason}" for r in report.rejected],
        "served": {op: {k: v for k, v in e.items() if k != "fallbacks"} for op, e in served.items()},
        "fallbacks": {op: e["fallbacks"] for op, e in served.items() if e["fallbacks"]},
        "verification_fallbacks": {op: e["fallbacks"] for op, e in providers.served("verification").items()
                                   if e["fallbacks"]},
        "graphs": len(report.graphs),
        # graphs replayed: CUDA graphs on the GPU, emulated ones on CPU (a graph with a reason runs eagerly)
        "captured": sum(1 for r in runtime if r.get("replays") and not r.get("reason")),
        "graph_reasons": sorted({r["reason"] for r in runtime if r.get("reason")}),
        "eager_calls": sum(r.get("eager_calls", 0) for r in runtime),
        "pieces_captured": pieces_captured, "pieces": pieces_total, "not_captured": not_captured,
        "err": err, "err_eager": err_eager, "ratio": err / err_eager if err_eager else float("inf"),
        "compile_s": compile_s, "routing_ties": ties,
    }


def _emit(row: dict[str, Any]) -> None:
    print(MARK + json.dumps(row, default=str), flush=True)


def _child(cases: list[tuple[str, str]], poison: bool, sizes: tuple[int, ...], device: str, gemm_fusion: bool) -> int:
    for family, mode in cases:
        try:
            row = run_case(family, mode, poison, device, capture_sizes=sizes, gemm_fusion=gemm_fusion)
        except Exception as e:  # noqa: BLE001 - a row says what broke; a sticky CUDA error ends the process
            traceback.print_exc()
            row = {"family": family, "mode": mode, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        _emit(row)
    return 0


def _spawn(cases: list[tuple[str, str]], extra: list[str], timeout: int) -> list[dict[str, Any]]:
    args = [sys.executable, __file__, "--child", ",".join(f"{f}:{m}" for f, m in cases), *extra]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, err, code = e.stdout or "", (e.stderr or "") + "\ntimed out", -1
        out, err = (out.decode() if isinstance(out, bytes) else out), (err.decode() if isinstance(err, bytes) else err)
    rows = [json.loads(line[len(MARK):]) for line in out.splitlines() if line.startswith(MARK)]
    done = {(r["family"], r["mode"]) for r in rows}
    tail = " | ".join(err.strip().splitlines()[-3:])
    for family, mode in cases:
        if (family, mode) not in done:
            rows.append({"family": family, "mode": mode, "ok": False,
                         "error": f"process exited {code} before this case: {tail[-300:]}"})
    if code != 0 or any(not r["ok"] for r in rows):
        sys.stderr.write(err[-4000:])
    return rows


def _fmt_counts(d: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(d.items())) or "-"


def table(rows: list[dict[str, Any]]) -> str:
    head = ["process", "family", "mode", "status", "fused ops", "served by", "fallbacks", "graphs replayed",
            "pieces captured", "err fused", "err eager bf16", "ratio", "tokens left out (routing near-ties)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['process']} | {r['family']} | {r['mode']} | ERROR {r['error'][:160]} |" + " |" * 9)
            continue
        providers = sorted({p for e in r["served"].values() for p in e})
        fallbacks = sum(n for e in r["fallbacks"].values() for n in e.values())
        lines.append("| " + " | ".join([
            r["process"], r["family"], r["mode"], "ok" if not r["near_misses"] else f"{len(r['near_misses'])} near misses",
            _fmt_counts(r["fused"]), ", ".join(providers) or "-", str(fallbacks),
            f"{r['captured']}/{r['graphs']}" if r["mode"] != "none" else "-",
            (f"{r['pieces_captured']}/{r['pieces']}" + (" (see above)" if r["not_captured"] else ""))
            if r["mode"] != "none" else "-",
            f"{r['err']:.2e}", f"{r['err_eager']:.2e}", f"{r['ratio']:.2f}", str(r.get("routing_ties", 0))]) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=None,
                   help="comma-separated (default: fxrewrite.models.MODELS, then COVERAGE_FAMILIES)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--no-all", action="store_true", help="skip the all-in-one process")
    p.add_argument("--no-own", action="store_true", help="skip the own-process cases (run only the all-in-one)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per process")
    p.add_argument("--capture-sizes", default="1,2,4,8,16,24,32", help="token counts captured (modes piecewise, full)")
    p.add_argument("--jobs", type=int, default=4, help="own-process cases run at a time")
    p.add_argument("--no-poison", action="store_true", help="do not poison the allocator before each case")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a check of this script")
    p.add_argument("--gemm-fusion", action="store_true", help="Config.gemm_fusion on (its GEMMs serve up to 16 tokens: "
                   "a second rewrite the larger counts)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        sizes = tuple(int(v) for v in args.capture_sizes.split(","))
        cases = [tuple(c.split(":")) for c in args.child.split(",")]
        return _child(cases, not args.no_poison, sizes, args.device, args.gemm_fusion)  # type: ignore[arg-type]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (--device cpu checks this script: piecewise and full emulate their graphs)", file=sys.stderr)
        return 2
    from fxrewrite.models import MODELS

    families = args.families.split(",") if args.families else list(MODELS) + list(COVERAGE_FAMILIES)
    cases = [(f, m) for f in families for m in args.modes.split(",")]
    extra = ["--capture-sizes", args.capture_sizes, "--device", args.device] + (["--no-poison"] if args.no_poison else []) + (
        ["--gemm-fusion"] if args.gemm_fusion else [])
    rows = []
    if not args.no_own:
        finished = iter(range(1, len(cases) + 1))  # next() under the GIL: one number per case
        start = time.monotonic()

        def own_case(case: tuple[str, str]) -> list[dict[str, Any]]:
            rows_ = _spawn([case], extra, timeout=args.timeout)
            status = "ok" if all(r["ok"] for r in rows_) else "ERROR"
            print(f"[{next(finished)}/{len(cases)}, {time.monotonic() - start:.0f} s] own process {case[0]} {case[1]}: "
                  f"{status}", file=sys.stderr, flush=True)  # fmt: skip
            return rows_

        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:  # processes on one GPU, not timed
            own = list(pool.map(own_case, cases))
        rows = [dict(r, process="own") for rows_ in own for r in rows_]
    if not args.no_all:
        rows += [dict(r, process="all-in-one") for r in _spawn(cases, extra, timeout=args.timeout * len(cases))]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    for r in rows:
        if r["ok"] and (r["fallbacks"] or r["near_misses"] or r["rejected"] or r["graph_reasons"]
                        or r["verification_fallbacks"]):
            print(f"{r['process']} {r['family']} {r['mode']}: fallbacks {r['fallbacks']} near misses "
                  f"{r['near_misses']} rejected {r['rejected']} graphs not captured {r['graph_reasons']} "
                  f"verification's own fallbacks {r['verification_fallbacks']}")
        for why in r.get("not_captured", []) if r["ok"] else ():
            print(f"{r['process']} {r['family']} {r['mode']}: not captured: {why}")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (graphs emulated)"
    print(f"\n{device}, torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"FXREWRITE_PROVIDER={os.environ.get('FXREWRITE_PROVIDER', '')!r}")
    print(table(rows))
    bad = [r for r in rows if not r["ok"] or r["fallbacks"] or r["ratio"] > 1.10]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
