"""All-reduce + residual add + RMSNorm at tensor parallel 2, by token count: flashinfer's fused
kernel one-shot and two-shot against NCCL followed by the in-place add + RMSNorm kernel (what a
graph without the fusion runs). One run, one table: which should serve at which size.

    source .devkit/setup.sh && NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/bench_allreduce.py --out ar.md

Each cell: ``--inner`` back-to-back calls captured in one CUDA graph, replayed ``--reps`` times
(ranks aligned by a barrier before each replay), median per call from CUDA events on rank 0.
hidden 4096, bf16. A cell is "-" where the path refuses the size (two-shot needs more tokens than
ranks); the served counts are checked, so a cell never times a silent fallback.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import collective

TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096)
OP = "all_reduce_add_rms_norm"


def per_call_us(fn: Callable[[], object], inner: int, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(times)


def fused(oneshot: bool, x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, group: str) -> Callable[[], object] | None:
    """The fused op with one strategy forced; None when that kernel does not serve this size."""
    os.environ[collective.ONESHOT_ENV] = "1" if oneshot else "0"
    providers.configure(f"{OP}=flashinfer")
    providers.reset_counts()
    torch.ops.fxr.all_reduce_add_rms_norm(x, res, w, 1e-6, group)
    served = providers.served()[OP]
    if served.get("flashinfer-oneshot" if oneshot else "flashinfer-twoshot") != 1:
        return None
    return lambda: torch.ops.fxr.all_reduce_add_rms_norm(x, res, w, 1e-6, group)


def unfused(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, group: str) -> Callable[[], object]:
    """NCCL all-reduce, then the in-place add + RMSNorm kernel (the residual drifts: timing only)."""
    providers.configure(None)

    def run() -> object:
        y = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group))
        return torch.ops.fxr.fused_add_rms_norm_(y, res, w, 1e-6)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    group = dist.group.WORLD.group_name
    providers.preload()
    rows = []
    for tokens in TOKENS:
        g = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, args.hidden, device="cuda", generator=g, dtype=torch.bfloat16)
        res = torch.randn_like(x)
        w = torch.rand(args.hidden, device="cuda", generator=g, dtype=torch.bfloat16) + 0.5
        cells = []
        for fn in (fused(True, x, res, w, group), fused(False, x, res, w, group), unfused(x, res, w, group)):
            cells.append(None if fn is None else per_call_us(fn, args.inner, args.reps))
        os.environ.pop(collective.ONESHOT_ENV, None)
        default = "one-shot" if collective.use_oneshot(tokens, args.hidden, x.dtype, world) else "two-shot"
        names = ("flashinfer one-shot", "flashinfer two-shot", "NCCL + add-norm")
        best = min((c, n) for c, n in zip(cells, names) if c is not None)[1]
        mib = tokens * args.hidden * x.element_size() / 2**20
        rows.append(f"| {tokens} | {mib:.2f} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + f" | {best} | {default} |")
        if rank == 0:
            print(rows[-1], flush=True)
    if rank == 0:
        head = [
            f"# All-reduce + add + RMSNorm at TP={world}, hidden {args.hidden}, bf16 (us per call)",
            "",
            f"- device: {torch.cuda.get_device_name()} x{world}; torch {torch.__version__}; "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}",
            f"- command: `torchrun --nproc-per-node {world} bench/bench_allreduce.py`; CUDA graph of {args.inner} calls, median of {args.reps} replays, rank 0",
            "",
            "| tokens | MiB | flashinfer one-shot | flashinfer two-shot | NCCL + add-norm | fastest | fused op picks now |",
            "|---|---|---|---|---|---|---|",
        ]
        text = "\n".join(head + rows) + "\n"
        print(text)
        if args.out:
            args.out.write_text(text)
    collective.release_workspaces()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
