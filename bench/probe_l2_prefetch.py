"""Probe (issue 30): o_proj's weight prefetched into L2 while the decode attention runs. Tried, not kept.

    source .devkit/setup.sh && python3 bench/probe_l2_prefetch.py [--seqs 1,8]

At decode 1 the attention kernel is bound by latency, not bandwidth: HBM idles for most of its
7 us a layer. The idea was to have it fetch o_proj's weight meanwhile, so o_proj reads L2. The
chain is the step's GEMMs and attention alone (``profile_step.design_chain``: qkv, attention, o,
gate_up with SiLU-and-mul, down; every kernel a programmatic dependent launch), on the 8B engine
model after 1024 cached tokens. A variant adds one kernel between the qkv GEMM and the attention:

- ``lines``: a ``prefetch.global.L2`` per 128-byte line of the first N bytes of o's weight;
- ``bulk``: ``cp.async.bulk.prefetch.L2`` of 64 KiB ranges;
- ``empty``: the launch alone.

Each variant launches as a programmatic dependent launch: it issues its prefetches, lets the
attention launch, then waits for the qkv GEMM, so the attention's own wait still orders it after
that GEMM. ``no PDL`` is the chain with plain launches. Each chain is captured in a CUDA graph; the
variants' replays are interleaved, 3 rounds of 20, medians. Then the per-kernel times of one
layer under ``torch.profiler``, for the chain and the 32 MiB ``lines`` variant. The outputs of
every variant are checked equal to the chain's.

Result (bench/RESULTS.md, nineteenth session, H100): every prefetch made the chain slower, 1.015x
(32 MiB of lines) to 1.086x (bulk) at decode 1, 1.043x to 1.100x at decode 8. At decode 1 o_proj
read its weight in 13.3 us instead of 16.4, but the attention behind the prefetches took 11.9 us
instead of 8.1 and the prefetch kernel 5.6 us: the prefetches queue in front of the attention's
own loads, and the launch costs what it moves.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import replay_ms  # noqa: E402
from engine_model import build_model, llama_8b, make_batch, mark_static_metadata  # noqa: E402
from profile_step import design_chain  # noqa: E402

import fxrewrite.runtime.ops  # noqa: E402, F401  (torch.ops.fxr.*)
from fxrewrite.runtime import triton_gemm  # noqa: E402

CHUNK = 64 << 10  # bytes per bulk prefetch
LINE = 128


@triton.jit
def _bulk_kernel(ptr, nbytes, CHUNK: tl.constexpr, PER: tl.constexpr):
    i = tl.program_id(0) * PER + tl.arange(0, PER)
    off = i.to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - off, 0), CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr + off, size], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()


@triton.jit
def _lines_kernel(ptr, nbytes, LINE: tl.constexpr, PER: tl.constexpr):
    off = (tl.program_id(0) * PER + tl.arange(0, PER)).to(tl.int64) * LINE
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [tl.where(off < nbytes, ptr + off, ptr)],
                              dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()


def prefetcher(how: str, nbytes: int) -> Callable[[Any], None]:
    """A ``before_attention`` hook launching the ``how`` prefetch of the layer's o weight's first ``nbytes``."""

    def hook(layer: Any) -> None:
        w = layer.self_attn.o_proj.weight.view(-1).view(torch.uint8)
        n = min(nbytes, w.numel())
        if how == "bulk":
            _bulk_kernel[(triton.cdiv(n, CHUNK * 64),)](w, n, CHUNK=CHUNK, PER=64, num_warps=2, launch_pdl=True)
        else:  # lines; "empty" prefetches nothing
            _lines_kernel[(max(1, triton.cdiv(n, LINE * 1024)),)](w, n, LINE=LINE, PER=1024, num_warps=4, launch_pdl=True)

    return hook


def interleaved_ms(fns: list[Callable[[], Any]], reps: int = 20) -> list[float]:
    """Each of ``fns`` captured in a CUDA graph; replays interleaved; median ms of each."""
    graphs = []
    for fn in fns:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs.append(graph)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for graph, t in zip(graphs, times):
            t.append(replay_ms(graph))
    return [statistics.median(t) for t in times]


def layer_kernels_us(fn: Callable[[], Any], layers: int) -> str:
    """The median device time of each kernel position in a layer, over 5 replays of ``fn``'s graph."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)  # fmt: skip
    per = len(events) // (5 * layers)
    cols: dict[int, list[float]] = {}
    for i, e in enumerate(events[: 5 * layers * per]):
        cols.setdefault(i % per, []).append(e.time_range.elapsed_us())
    return "; ".join(f"{events[i].name[:24]} {statistics.median(v):.1f} us" for i, v in cols.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="1,8")
    p.add_argument("--context", type=int, default=1024)
    args = p.parse_args()
    cfg = llama_8b()
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16)
    model.allocate_kv_cache(8, 2048)
    model.fill_kv_cache_random(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
          f"PDL {triton_gemm.launch_pdl(torch.device('cuda'))}", flush=True)
    variants: dict[str, tuple[Callable[[Any], None] | None, bool]] = {
        "the chain": (None, True), "no PDL": (None, False), "empty kernel": (prefetcher("empty", 0), True),
        "lines 8 MiB": (prefetcher("lines", 8 << 20), True), "lines 32 MiB": (prefetcher("lines", 32 << 20), True),
        "bulk 8 MiB": (prefetcher("bulk", 8 << 20), True), "bulk 32 MiB": (prefetcher("bulk", 32 << 20), True),
    }  # fmt: skip
    for n in (int(s) for s in args.seqs.split(",")):
        batch = mark_static_metadata(make_batch(cfg, "decode", n, args.context, num_seqs=n, max_len=2048, device="cuda"))

        chains = {name: design_chain(model, batch, before_attention=hook) for name, (hook, _) in variants.items()}

        def run(name: str, chains: dict[str, Callable[[], torch.Tensor]] = chains) -> torch.Tensor:
            with torch.no_grad(), contextlib.nullcontext() if variants[name][1] else triton_gemm.without_pdl():
                return chains[name]()

        want = run("the chain")
        for name in variants:
            assert torch.equal(run(name), want), f"{name}: the output differs from the chain's"
        rounds = [interleaved_ms([lambda name=name: run(name) for name in variants]) for _ in range(3)]
        print(f"\ndecode {n} after {args.context}: ms per step of 32 layers, 3 rounds; / the chain: median of the rounds")
        print("| variant | ms | / the chain |\n|---|---|---|")
        for i, name in enumerate(variants):
            ms = [r[i] for r in rounds]
            ratio = statistics.median(m / r[0] for m, r in zip(ms, rounds))
            print(f"| {name} | {' / '.join(f'{m:.3f}' for m in ms)} | {ratio:.3f} |", flush=True)
        for name in ("the chain", "lines 32 MiB"):
            print(f"  {name}, one layer: {layer_kernels_us(lambda name=name: run(name), cfg.num_layers)}", flush=True)


if __name__ == "__main__":
    main()
