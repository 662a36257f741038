"""Where fxrewrite's first call goes, on the 8B-shaped engine Llama: Dynamo, our passes (the
GEMM pass and verification apart), building the CUDA-graph runner, capture; with the Triton
kernels of the ``select_gemm`` pass built ahead in parallel (``providers.prebuild``, the default)
and without (Triton's JIT builds each at its first call, one after another).

    source .devkit/setup.sh && python3 bench/profile_first_call.py [--modes piecewise,full] [--shape 8b]

Each row runs in a fresh process with empty Triton and fxrewrite caches, a machine's first start, as
bench_e2e's rows do: after the process's one-time imports and the attention op's kernels
(bench_e2e's ``_warm_process`` and ``_warm_attention``), the first call of decode 1 after 1024
cached tokens (bench_e2e's first column; 64 on the tiny model), capture sizes 1, 8, 64, 512. Columns, seconds:
``first call`` (the call, device synced, as bench_e2e's "first call"), ``backend`` (inside
``Backend.__call__``: passes and ``build_runner``), ``select_gemm`` (that pass, verification
and builds included), ``verify`` (all verification), ``build_runner``, ``capture``, and ``rest``
(first call minus backend and capture: Dynamo's tracing and guards, the step itself). On a
machine without CUDA the model is the tiny one and nothing is built.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_model import SPLITTING_OPS, build_model, llama_8b, make_batch, mark_static_metadata, tiny  # noqa: E402

COLUMNS = ("first call", "backend", "select_gemm", "verify", "build_runner", "capture", "rest")


def child(mode: str, prebuild: bool, shape: str, profile: int) -> dict[str, Any]:
    """One first call in this process; the columns, and the report's prebuild line. With
    ``profile`` > 0, the backend's call under cProfile, its top functions to stderr."""
    import bench_e2e

    import fxrewrite
    from fxrewrite import verify
    from fxrewrite.runtime import cudagraph, providers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    big = shape == "8b" and device.type == "cuda"
    cfg, context = (llama_8b(), 1024) if big else (tiny(num_layers=32), 64)
    model = build_model(cfg, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.allocate_kv_cache(8, 2 * context)
    batch = mark_static_metadata(make_batch(cfg, "decode", 1, context, max_len=2 * context, device=device))
    bench_e2e._warm_process(device, inductor=False)
    if device.type == "cuda":
        bench_e2e._warm_attention(model, {"decode 1": batch})
    if not prebuild:
        providers.prebuild = lambda calls: None  # each kernel built at its first call instead
    seconds: dict[str, float] = {"backend": 0.0, "build_runner": 0.0}
    backend_call, build_runner = fxrewrite.Backend.__call__, cudagraph.build_runner

    def timed_backend(self: Any, gm: Any, example_inputs: Any) -> Any:
        prof = cProfile.Profile() if profile else None
        t = time.perf_counter()
        try:
            return prof.runcall(backend_call, self, gm, example_inputs) if prof else backend_call(self, gm, example_inputs)
        finally:
            seconds["backend"] += time.perf_counter() - t
            if prof:
                pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(profile)

    def timed_build_runner(*args: Any) -> Any:
        t = time.perf_counter()
        try:
            return build_runner(*args)
        finally:
            seconds["build_runner"] += time.perf_counter() - t

    fxrewrite.Backend.__call__, cudagraph.build_runner = timed_backend, timed_build_runner
    backend = fxrewrite.Backend(mode=mode, splitting_ops=SPLITTING_OPS, capture_sizes=(1, 8, 64, 512), progress=False)
    step = backend.compile(model)
    verify.clear_cache()
    with torch.no_grad():
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step(**batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t
    report = backend.report.graphs[0]
    gemm = sum(p.ms for p in report.passes if p.name == "select_gemm") / 1e3
    capture = sum(getattr(r, "capture_s", 0.0) for r in backend.runners)
    row = {"first call": first, "backend": seconds["backend"], "select_gemm": gemm, "verify": verify.stats().seconds,
           "build_runner": seconds["build_runner"], "capture": capture,
           "rest": first - seconds["backend"] - capture}  # fmt: skip
    notes = [n for n in report.notes if "kernels built ahead" in n]
    return {"row": row, "note": notes[0] if notes else "-", "fused": dict(report.fused_ops)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="piecewise,full", help="comma-separated: piecewise, full")
    p.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    p.add_argument("--repeat", type=int, default=1, help="rounds of all rows, one after another")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="print the top N functions of each row's backend call (cProfile) to stderr")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        mode, built = args.child.split(":")
        print(json.dumps(child(mode, built == "ahead", args.shape, args.cprofile)))
        return
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.repeat):
            for mode in args.modes.split(","):
                for built in ("ahead", "at first call"):
                    key = f"{mode}:{'ahead' if built == 'ahead' else 'first'}"
                    row_dir = Path(work) / f"{key.replace(':', '-')}-{r}"  # every cache empty, ours too
                    env = {**os.environ, "TRITON_CACHE_DIR": str(row_dir / "triton"), "FXREWRITE_CACHE_DIR": str(row_dir)}
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--shape", args.shape, "--child", key,
                           "--cprofile", str(args.cprofile)]  # fmt: skip
                    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
                    name = f"fxrewrite {mode}, kernels built {built}" + (f", round {r + 1}" if args.repeat > 1 else "")
                    rows[name] = json.loads(out.strip().splitlines()[-1])
                    print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"first call of decode 1, {args.shape} shape, fresh process and Triton cache per row (seconds)")
    print("| row | " + " | ".join(COLUMNS) + " | built ahead |\n|---|" + "---|" * (len(COLUMNS) + 1))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r['row'][c]:.2f}" for c in COLUMNS) + f" | {r['note']} |")


if __name__ == "__main__":
    main()
