"""The first call of a new process, by how much of it a cache spares: Dynamo alone, fxrewrite
cold (every cache empty), fxrewrite cold with Triton's cache warm, fxrewrite warm (a precompiled
artifact: no Dynamo trace, no pass), and Inductor + CUDA graphs (issue 33's rows).

    source .devkit/setup.sh && python bench/warm_start.py --shape 8b --repeat 3
    python bench/warm_start.py --shape tiny --device cpu --repeat 1      # a smoke test
    python bench/warm_start.py --shape mid --device cpu --repeat 3       # 32 layers: our costs on CPU

Each row runs in processes of its own, ``--repeat`` times, rows interleaved (round i runs every
row once); the median is printed. A process builds the serving-engine Llama (``engine_model.py``,
seeded), pays its one-time costs (imports, the kernel libraries, the attention kernels) and then
times its first call of a decode step of ``--batch`` sequences, to the device's result:

    dynamo       ``torch.compile(model, backend="eager", fullgraph=True, dynamic=True)``
    cold         ``Backend(mode=--mode)`` built, ``.aot_compile(model, (), batch)`` and its first
                 call, every cache empty: new fxrewrite and Triton cache directories; the artifact
                 is saved after the timing
    cold-triton  the same with the Triton cache round i's ``cold`` left (a restart after an
                 upgrade of fxrewrite or of the model: kernels built, graphs not) and a new
                 fxrewrite cache directory
    warm         ``Backend(...)`` built, ``fxrewrite.load(artifact, model, backend)`` and its first
                 call, with round i's artifact and Triton cache (a restart of the same machine)
    inductor-cg  bench_e2e's "inductor + CUDA graphs" row (its definition, imported), Inductor's
                 and Triton's caches off / empty as there; CUDA only. ``reduce-overhead`` records
                 its CUDA graph at the second call, not in this time

The goal lines (issue 33), against Dynamo alone's first call: warm <= 0.5x, cold with Triton's
cache warm <= 1.25x, cold with every cache empty <= 1.6x. The table is printed last, then the
first call of Dynamo alone and of the ``cold`` rows split by stage (:data:`STAGES`, medians;
nested stages indented; Python's garbage collector apart), then the goal lines. On the CPU the
table also gives each row's CPU time (the machine may be shared), and the split is in CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_model import SPLITTING_OPS, build_model, llama_8b, make_batch, mark_static_metadata, tiny  # noqa: E402

# (key, label, goal against Dynamo alone or None), in the order a round runs them
ROWS = (("dynamo", "Dynamo alone", None), ("cold", "fxrewrite cold, every cache empty", 1.6),
        ("cold-triton", "fxrewrite cold, Triton's cache warm", 1.25), ("warm", "fxrewrite warm (precompiled)", 0.5),
        ("inductor-cg", "Inductor + CUDA graphs", None))  # fmt: skip
INDUCTOR = "inductor-cg"  # bench_e2e's system key
SPLIT_ROWS = ("dynamo", "cold", "cold-triton")  # their first call split by stage
CONTEXT = 128
# The stages of a first call (rows dynamo, cold, cold-triton): (key, label, owner, attribute);
# the timed function is wrapped in the child (one this torch lacks is left out). ``run`` is the
# step after aot_compile returned (the runner's first call, capture). Dynamo alone compiles in
# its first call: all of it is ``run``, its trace and guards are also counted apart.
STAGES = (("construct", "fxrewrite.Backend() (ours)", None, None),
          ("trace", "Dynamo's trace (torch)", "torch._dynamo.convert_frame", "trace_frame"),
          ("backend", "Backend.__call__ (ours)", "fxrewrite.backend:Backend", "__call__"),
          ("fingerprint", "  graph fingerprints", "fxrewrite.fingerprint", "graph_fingerprint"),
          ("passes", "  the passes", "fxrewrite.passes:PassManager", "run"),
          ("verify", "    of which verification", None, None),
          ("prebuild", "    of which kernels built ahead", "fxrewrite.runtime.providers", "prebuild"),
          ("store", "  compile cache store", "fxrewrite.cache:CachedGraph", "store"),
          ("runner", "  build_runner", "fxrewrite.backend", "build_runner"),
          ("guards", "Dynamo's guards (torch)", "torch._dynamo.guards:CheckFunctionManager", "__init__"),
          ("guard_pickle", "  of which pickled for the artifact", "torch._dynamo.guards:CheckFunctionManager",
           "serialize_guards"),
          ("sources", "traced sources hashed (torch)", "torch._dynamo.package:SourceInfo", "add_code"),
          ("run", "the step (runner built, capture)", None, None),
          ("gc", "Python's garbage collector, in all of the above", None, None),
          ("gc_full", "  of which full collections (their count: the last row)", None, None))  # fmt: skip


def _time_stages(seconds: dict[str, float], clock: Any) -> None:
    """Wrap each stage's function so its calls add their time on ``clock`` to ``seconds[key]``."""
    import functools
    import importlib

    for key, _, owner, attr in STAGES:
        if owner is None:
            continue
        module, _, cls = owner.partition(":")
        target = importlib.import_module(module)
        target = getattr(target, cls) if cls else target
        fn = getattr(target, attr, None)
        if fn is None:
            continue

        def timed(*args: Any, _fn: Any = fn, _key: str = key, **kwargs: Any) -> Any:
            t = clock()
            try:
                return _fn(*args, **kwargs)
            finally:
                seconds[_key] = seconds.get(_key, 0.0) + clock() - t

        setattr(target, attr, functools.wraps(fn)(timed))


def _time_collector(seconds: dict[str, float], clock: Any) -> None:
    """Add the collector's time to ``seconds["gc"]`` (full collections also to ``"gc_full"``,
    counted in ``"gc_fulls"``): a full collection walks the whole heap, and where one falls
    moves with what every stage allocates."""
    import gc

    began = [0.0]

    def collected(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = clock()
            return
        took = clock() - began[0]
        seconds["gc"] = seconds.get("gc", 0.0) + took
        if info["generation"] == 2:
            seconds["gc_full"] = seconds.get("gc_full", 0.0) + took
            seconds["gc_fulls"] = seconds.get("gc_fulls", 0) + 1

    gc.callbacks.append(collected)


def child(args: argparse.Namespace) -> dict[str, float]:
    import fxrewrite
    from bench_e2e import _warm_process
    from e2e_systems import SYSTEM_BY_KEY

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    cfg = {"8b": llama_8b, "tiny": tiny, "mid": lambda: tiny(num_layers=32)}[args.shape]()
    model = build_model(cfg, device=device, dtype=dtype, seed=0)
    model.allocate_kv_cache(args.batch, CONTEXT + 1)
    batch = mark_static_metadata(make_batch(cfg, "decode", args.batch, CONTEXT, max_len=CONTEXT + 1, device=device))
    inductor = args.row == INDUCTOR
    if inductor:
        torch._inductor.config.force_disable_caches = True  # a cold compile, as bench_e2e's rows
    _warm_process(device, inductor=inductor)
    stages: dict[str, float] = {}
    # on the CPU the process's CPU time: the machine may be shared (a GPU run waits on the device)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    split = args.row in SPLIT_ROWS
    if split:
        from fxrewrite import verify

        _time_stages(stages, clock)
    with torch.no_grad():
        model(**batch)  # the attention kernels built, as an engine builds them at start-up
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        if split:
            _time_collector(stages, clock)
        start, start_clock = time.perf_counter(), clock()
        backend_s = 0.0
        if args.row in ("cold", "cold-triton", "warm"):  # in the time: a restart builds its backend
            backend = fxrewrite.Backend(mode=args.mode, splitting_ops=SPLITTING_OPS, capture_sizes=(args.batch,),
                                        progress=False)  # fmt: skip
            backend_s = time.perf_counter() - start
            stages["construct"] = clock() - start_clock
        if args.row == "dynamo":
            step = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)
        elif inductor:
            step, _ = SYSTEM_BY_KEY[INDUCTOR].build(model, "no twin", {})
        elif args.row == "warm":
            step = fxrewrite.load(args.artifact, model, backend)
        else:
            step = backend.aot_compile(model, (), batch)
        compiled = clock()
        step(**batch)
        sync()
        seconds, end = time.perf_counter() - start, clock()
        if split:
            import gc

            gc.callbacks.pop()  # what save() collects is not in the time
    if split:
        stages.update(verify=verify.stats().seconds, run=end - compiled)
    if args.row == "cold":
        step.save(args.artifact)
    return {"first_call_s": seconds, "clock_s": end - start_clock, "backend_s": backend_s,
            **({f"stage_{k}": v for k, v in stages.items()} if split else {})}  # fmt: skip


def rows_for(device: str) -> list[str]:
    """The rows that run on ``device`` (Inductor + CUDA graphs needs CUDA)."""
    return [key for key, _, _ in ROWS if key != INDUCTOR or device.startswith("cuda")]


def environment(row: str, work: Path, i: int) -> dict[str, str]:
    """Round ``i``'s cache directories for ``row``: ``cold`` makes them, ``warm`` reuses both,
    ``cold-triton`` Triton's alone; Inductor gets empty ones."""
    env = dict(os.environ)
    ours = {"cold": f"cache-{i}", "cold-triton": f"cache-{i}-triton-warm", "warm": f"cache-{i}"}
    if row in ours:
        env["FXREWRITE_CACHE_DIR"] = str(work / ours[row])
        env["TRITON_CACHE_DIR"] = str(work / f"triton-{i}")
    elif row == INDUCTOR:
        env["TRITON_CACHE_DIR"] = str(work / f"triton-{i}-inductor")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-{i}")
    return env


def run(row: str, args: argparse.Namespace, work: Path, i: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", row, "--artifact", str(work / f"model-{i}.fxr"), "--shape", args.shape,
           "--device", args.device, "--dtype", args.dtype, "--mode", args.mode, "--batch", str(args.batch)]  # fmt: skip
    done = subprocess.run(cmd, env=environment(row, work, i), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{row} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    """The medians, each row's ratio to Dynamo alone, and the goal lines."""
    med = {row: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in set().union(*rs)} for row, rs in runs.items() if rs}
    dynamo = med["dynamo"]["first_call_s"]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    cpu = not args.device.startswith("cuda")
    lines = [f"{device}, torch {torch.__version__}: {args.shape} {args.dtype}, mode {args.mode}, decode batch {args.batch}; "
             f"first call of a new process, median of {args.repeat} processes per row (seconds; of it, "
             "fxrewrite.Backend() construction" + ("; the process's CPU seconds, and their ratio" if cpu else "") + ")",
             "| row | first call s (min-max) | Backend() s | / Dynamo alone | goal |" + (" CPU s | CPU / Dynamo |" if cpu else ""),
             "|---|---|---|---|---|" + ("---|---|" if cpu else "")]  # fmt: skip
    goals = []
    for key, label, goal in ROWS:
        if key not in med:
            continue
        firsts = [r["first_call_s"] for r in runs[key]]
        ratio = med[key]["first_call_s"] / dynamo
        backend = f"{med[key]['backend_s']:.2f}" if key in ("cold", "cold-triton", "warm") else "-"
        lines.append(f"| {label} | {med[key]['first_call_s']:.2f} ({min(firsts):.2f}-{max(firsts):.2f}) | {backend} "
                     f"| {ratio:.2f} | {'-' if goal is None else f'<= {goal}'} |"
                     + (f" {med[key]['clock_s']:.2f} | {med[key]['clock_s'] / med['dynamo']['clock_s']:.2f} |" if cpu else ""))  # fmt: skip
        if goal is not None:
            goals.append(f"- {label} / Dynamo alone: {ratio:.2f} (goal <= {goal}): {'met' if ratio <= goal else 'NOT met'}")
    split_rows = [k for k in SPLIT_ROWS if k in med and "stage_run" in med[k]]
    if split_rows:  # the first call by stage
        lines += ["", f"The first call by stage ({'CPU ' if cpu else ''}seconds, medians; indented: part of the line "
                  "above; Dynamo alone compiles inside its step, so its run holds its trace and guards)", "",
                  "| stage (s) | " + " | ".join(split_rows) + " |", "|---|" + "---|" * len(split_rows)]
        lines += [f"| {label} | " + " | ".join(f"{med[k].get('stage_' + key, 0.0):.3f}" for k in split_rows) + " |"
                  for key, label, _, _ in STAGES]  # fmt: skip
        lines.append("| full collections (count) | " + " | ".join(f"{med[k].get('stage_gc_fulls', 0):g}" for k in split_rows) + " |")
    return "\n".join(lines + [""] + goals)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--shape", choices=("8b", "tiny", "mid"), default="8b", help="mid: the tiny model with 32 layers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--mode", choices=("none", "piecewise", "full"), default="full")
    p.add_argument("--batch", type=int, default=8, help="decode sequences (one capture size)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rows", default=None, help="comma-separated row keys (default: all that run on the device)")
    p.add_argument("--child", choices=[key for key, _, _ in ROWS], help=argparse.SUPPRESS)
    p.add_argument("--artifact", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.child:
        args.row = args.child
        print(json.dumps(child(args)))
        return 0
    keys = rows_for(args.device) if args.rows is None else args.rows.split(",")
    need = {"cold-triton": "cold", "warm": "cold"}  # they start from what round i's cold left
    keys = [k for k, _, _ in ROWS if k in keys or k == "dynamo" or any(need.get(o) == k for o in keys)]
    runs: dict[str, list[dict[str, float]]] = {row: [] for row in keys}
    with tempfile.TemporaryDirectory(prefix="fxr-warm-") as tmp:
        for i in range(args.repeat):
            for row in keys:
                runs[row].append(run(row, args, Path(tmp), i))
                print(f"{row} #{i}: {runs[row][-1]}", flush=True)
    print("\n" + table(runs, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
