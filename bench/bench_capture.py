"""Piecewise CUDA graphs on the 8B-shaped serving Llama: capture of 32 sizes, pool memory, and the
decode step at 8 tokens against eager (issue 5). GPU only.

    source .devkit/setup.sh && python3 bench/bench_capture.py [--out capture.md]

One process: the model (random bf16 weights, 32 layers, hidden 4096) compiled with
``Backend(mode="piecewise")`` and 32 capture sizes (2, 4, 8, 16, ..., 240), the first call
captures every size (time and pool memory from the runner's statistics); then eager and the
replayed graphs are timed on the same decode batch (8 sequences, 1024 cached tokens each) with
CUDA events, median of many steps after warm-up, and compared on fresh inputs.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fxrewrite  # noqa: E402
from engine_model import SPLITTING_OPS, build_model, llama_8b, make_batch, mark_static_metadata  # noqa: E402

# 32 sizes, all >= 2: Dynamo compiles the token symbol as s0 >= 2 (1 gets a graph of its own)
SIZES = (2, 4) + tuple(range(8, 8 * 31, 8))
CONTEXT, MAX_LEN, ROWS = 1024, 1088, 64


def _time_ms(fn, steps: int = 50) -> float:  # type: ignore[no-untyped-def]
    for _ in range(5):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    assert len(SIZES) == 32
    cfg = llama_8b()
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16)
    model.allocate_kv_cache(ROWS, MAX_LEN)
    model.fill_kv_cache_random(0)
    batch = mark_static_metadata(make_batch(cfg, "decode", 8, CONTEXT, max_len=MAX_LEN, device="cuda", seed=1))
    config = fxrewrite.Config(mode="piecewise", splitting_ops=SPLITTING_OPS, capture_sizes=SIZES,
                              max_capture_size=SIZES[-1], pad_inputs=False)  # fmt: skip
    backend = fxrewrite.Backend(config)
    compiled = backend.compile(model)
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        compiled(**batch)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        stats = backend.runners[-1].stats()
        eager_ms = _time_ms(lambda: model(**batch))
        graph_ms = _time_ms(lambda: compiled(**batch))
        model.fill_kv_cache_random(2)
        fresh = mark_static_metadata(make_batch(cfg, "decode", 8, CONTEXT, max_len=MAX_LEN, device="cuda", seed=3))
        ref = model(**fresh).float()
        out = compiled(**fresh).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
    rows = [
        ("capture sizes", f"{len(stats['capture_sizes'])} ({SIZES[0]}..{SIZES[-1]})"),
        ("first call (Dynamo + rewrite + capture), s", f"{first_s:.1f}"),
        ("capture of all sizes, s", f"{stats['capture_s']:.2f}"),
        ("CUDA graphs captured", str(stats["graphs"])),
        ("pool memory, MiB", f"{stats['pool_bytes'] / 2**20:.0f}"),
        ("static input buffers, MiB", f"{stats.get('buffer_bytes', 0) / 2**20:.0f}"),
        ("decode 8 tokens, eager, ms", f"{eager_ms:.2f}"),
        ("decode 8 tokens, piecewise replay, ms", f"{graph_ms:.2f}"),
        ("speedup over eager", f"{eager_ms / graph_ms:.2f}x"),
        ("max rel err vs eager (fresh inputs)", f"{err:.1e}"),
        ("fused ops", str(backend.report.fused_ops())),
    ]
    head = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.date.today()}, "
            "command: python3 bench/bench_capture.py")  # fmt: skip
    table = "\n".join([head, "", "| measure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
