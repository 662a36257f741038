"""Decode step of the 8B-shaped engine Llama, fxrewrite full against Inductor + CUDA graphs, in
one process: steps back to back between two CUDA events, then the kernels of 5 steps by
``torch.profiler`` (GPU only).

    source .devkit/setup.sh && python3 bench/profile_step.py [--seqs 8] [--context 1024]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_model import SPLITTING_OPS, build_model, llama_8b, make_batch, mark_static_metadata  # noqa: E402

import fxrewrite  # noqa: E402
from fxrewrite.runtime import providers  # noqa: E402


def profile(label: str, step: Any, batch: dict[str, torch.Tensor], reps: int = 20) -> None:
    with torch.no_grad():
        t = time.perf_counter()
        for _ in range(3):
            step(**batch)
        torch.cuda.synchronize()
        print(f"{label}: warm-up {time.perf_counter() - t:.1f} s", flush=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step(**batch)
        end.record()
        end.synchronize()
        print(f"{label}: {start.elapsed_time(end) / reps:.3f} ms per step, back to back", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step(**batch)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    args = p.parse_args()
    providers.preload()
    cfg = llama_8b()
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16)
    model.allocate_kv_cache(64, 4096)
    model.fill_kv_cache_random(0)
    batch = mark_static_metadata(
        make_batch(cfg, "decode", args.seqs, args.context, num_seqs=args.seqs, max_len=4096, device="cuda")
    )
    torch._dynamo.reset()
    backend = fxrewrite.Backend(mode="full", splitting_ops=SPLITTING_OPS, capture_sizes=(args.seqs,), progress=False)
    profile("fxrewrite full", torch.compile(model, backend=backend, fullgraph=True, dynamic=True), batch)
    torch._dynamo.reset()
    profile("inductor + CUDA graphs", torch.compile(model, mode="reduce-overhead", fullgraph=True), batch)


if __name__ == "__main__":
    main()
