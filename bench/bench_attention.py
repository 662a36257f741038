"""Decode attention of the engine model alone: the Triton split-KV kernel (bench/decode_attention.py)
against torch SDPA over the same per-row cache, with the HBM floor (GPU).

    source .devkit/setup.sh && python3 bench/bench_attention.py [--context 1024]

8B shape (32 query heads, 8 KV heads, head dim 128, bf16), 32 layers each with its own cache (so
the step's keys come from HBM, not L2), one query token per sequence after ``--context`` cached
tokens. Time: one CUDA graph of the 32 layers' decode attention, median of 20 replays (CUDA
events); floor: the keys and values read / the copy bandwidth measured in the same run; error:
max |y - ref| / max |ref| of layer 0 against float64 SDPA; host us: the host time of one eager
call (layer 0), back to back. The attention op's decode step also writes the step's keys and
values: "store, then triton" does it as ``store_kv`` before the kernel (two launches), "store in
triton" inside the kernel's launch (what the op runs).

``--fp8``: a second table, attention + FP8 output quantization (an FP8 o_proj's input, static
scale): "pair" is the decode kernel then ``quant_fp8_static`` in torch (what the graph runs
unfused), "fused" the kernel quantizing in its epilogue (``fxbench::attention_quant_fp8``); both
write the step's keys and values. err: mean |q * scale - ref| / max |ref| against float64.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_attention  # noqa: E402
import engine_model  # noqa: E402
from fxrewrite.runtime.ops.quant import quant_fp8_static  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS = 32, 8, 128, 32


def graph_ms(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return statistics.median(replay_ms(graph) for _ in range(reps))


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """One replay of ``graph`` between two CUDA events, ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def host_us(fn, reps: int = 200) -> float:  # type: ignore[no-untyped-def]
    """Host microseconds per eager call, back to back (the launch path, not the kernels)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * host / reps


def copy_bandwidth() -> float:
    src = torch.empty(2**30 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * 2**30 / (graph_ms(lambda: dst.copy_(src)) / 1e3)


def decode(kernels: str, q, k, v, seq_lens, kv_range):  # type: ignore[no-untyped-def]
    if kernels == "triton":
        return decode_attention.decode_attention(q, k, v, seq_lens, kv_range.shape[0])
    return engine_model._decode(q, k, v, seq_lens, kv_range)


def sweep(batch, q, caches, seq_lens, length, floor) -> None:  # type: ignore[no-untyped-def]
    """Time each Tuning on the same inputs; print the default and the three fastest."""
    times = {}
    for block, per_sm, warps in itertools.product((32, 64, 128), (1, 2, 4, 8), (2, 4, 8)):
        t = decode_attention.Tuning(block=block, per_sm=per_sm, warps=warps)
        times[t] = graph_ms(lambda: [decode_attention.decode_attention(q, k, v, seq_lens, length, t) for k, v in caches])
    best = sorted(times, key=times.get)[:3]
    default = decode_attention.Tuning()
    print(f"  sweep at batch {batch}: default {times[default]:.3f} ms ({times[default] / floor:.2f}x floor); "
          + "; ".join(f"{t} {times[t]:.3f} ms ({times[t] / floor:.2f}x)" for t in best), flush=True)


def fp8_row(batch, q, caches, seq_lens, length, kv, slots, floor) -> str:  # type: ignore[no-untyped-def]
    """One row of the --fp8 table: the unfused pair and the fused kernel, timed and measured."""
    scale = torch.tensor(2.0**-6, device="cuda")  # outputs within +-448 * scale = 7 (randn values)
    store = (kv[:, 0], kv[:, 1], slots)

    def pair(k, v):  # type: ignore[no-untyped-def]
        return quant_fp8_static(decode_attention.decode_attention(q, k, v, seq_lens, length, store=store), scale)

    def fused(k, v):  # type: ignore[no-untyped-def]
        return decode_attention.decode_attention(q, k, v, seq_lens, length, store=store, out_scale=scale)

    times = {name: graph_ms(lambda: [fn(k, v) for k, v in caches]) for name, fn in (("pair", pair), ("fused", fused))}
    kv_range = torch.arange(length, dtype=torch.int32, device="cuda")
    ref = engine_model._decode(q.double(), caches[0][0].double(), caches[0][1].double(), seq_lens, kv_range)
    err = {name: ((fn(*caches[0]).double() * scale - ref).abs().mean() / ref.abs().max()).item()
           for name, fn in (("pair", pair), ("fused", fused))}  # fmt: skip
    return (f"| {batch} | {times['pair']:.3f} | {times['fused']:.3f} | {times['pair'] / times['fused']:.2f}x "
            f"| {floor:.3f} | {times['fused'] / floor:.2f}x | {err['pair']:.2e} | {err['fused']:.2e} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--sweep", action="store_true", help="also time other launch parameters (decode_attention.Tuning)")
    p.add_argument("--fp8", action="store_true", help="also time attention + FP8 output quantization, fused and not")
    args = p.parse_args()
    fp8_rows = []
    bandwidth = copy_bandwidth()
    length = args.context + 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.3f} TB/s, "
          f"decode after {args.context} cached tokens, {LAYERS} layers")  # fmt: skip
    print("| batch | triton ms | torch SDPA ms | SDPA / triton | floor ms | triton / floor | store, then triton ms "
          "| store in triton ms | triton err | SDPA err | triton host us | SDPA host us |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in (1, 8, 64):
        g = torch.Generator(device="cuda").manual_seed(batch)
        shape = (batch, length + 15, KV_HEADS, DIM)
        caches = [(torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16),
                   torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]  # fmt: skip
        q = torch.randn(batch, HEADS, DIM, generator=g, device="cuda", dtype=torch.bfloat16)
        seq_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        kv_range = torch.arange(length, dtype=torch.int32, device="cuda")
        row = {}
        for backend in ("triton", "torch"):
            row[backend] = graph_ms(lambda: [decode(backend, q, k, v, seq_lens, kv_range) for k, v in caches])
            ref = decode("torch", q.double(), caches[0][0].double(), caches[0][1].double(), seq_lens, kv_range)
            got = decode(backend, q, *caches[0], seq_lens, kv_range).double()
            row[backend + "_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
            row[backend + "_host"] = host_us(lambda: decode(backend, q, *caches[0], seq_lens, kv_range))
        kv = torch.randn(batch, 2, KV_HEADS, DIM, generator=g, device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(batch, device="cuda") * shape[1] + length - 1
        row["then"] = graph_ms(lambda: [(decode_attention.store_kv(kv[:, 0], kv[:, 1], k, v, slots),
                                         decode_attention.decode_attention(q, k, v, seq_lens, length)) for k, v in caches])  # fmt: skip
        row["in"] = graph_ms(lambda: [decode_attention.decode_attention(q, k, v, seq_lens, length, store=(kv[:, 0], kv[:, 1], slots))
                                      for k, v in caches])  # fmt: skip
        floor = 1e3 * LAYERS * batch * length * KV_HEADS * DIM * 2 * 2 / bandwidth
        if args.sweep:
            sweep(batch, q, caches, seq_lens, length, floor)
        if args.fp8:
            fp8_rows.append(fp8_row(batch, q, caches, seq_lens, length, kv, slots, floor))
        print(f"| {batch} | {row['triton']:.3f} | {row['torch']:.3f} | {row['torch'] / row['triton']:.2f}x | {floor:.3f} "
              f"| {row['triton'] / floor:.2f}x | {row['then']:.3f} | {row['in']:.3f} | {row['triton_err']:.1e} "
              f"| {row['torch_err']:.1e} | {row['triton_host']:.1f} | {row['torch_host']:.1f} |", flush=True)  # fmt: skip
        del caches
    if fp8_rows:
        print("\nattention + FP8 output (static scale), 32 layers in one CUDA graph")
        print("| batch | pair ms | fused ms | pair / fused | floor ms | fused / floor | pair err | fused err |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(fp8_rows), flush=True)


if __name__ == "__main__":
    main()
