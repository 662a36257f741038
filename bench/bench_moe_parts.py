"""The parts of ``fxr.moe``'s Triton provider at bench_moe's shapes, against what else could do
each part (issue 22: "whatever sgl-kernel / flashinfer offer for the routing and alignment steps
where faster"; a grouped GEMM of torch's for prefill sizes).

    source .devkit/setup.sh && python3 bench/bench_moe_parts.py [--tokens 1,8,64,512,4096]
        [--shapes mixtral-8x7b,128-experts] [--reps 30]

Tables (bf16, random weights and logits, microseconds):

* routing: :func:`triton_moe.route` (top-k of the softmax, renormalized, and alignment by expert
  in the blocks the GEMMs use) against sgl-kernel's ``topk_softmax`` + ``moe_align_block_size``
  (the same blocks; a column of "-" without sgl-kernel), each timed as a CUDA graph of 20 calls
  (median of ``--reps`` replays, divided by 20), and whether both picked the same experts;
* GEMMs: the whole ``fxr.moe`` call with the pointer kernel and with the TMA kernel (the same
  launch configuration otherwise, 128-row blocks only: the TMA kernel serves those), and torch's
  ``_grouped_mm`` for the two GEMMs alone on the same expert-sorted rows (no activation, no gather,
  no sum), each a CUDA graph of one call.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe import SHAPES, TOKENS, graph_ms  # noqa: E402

from fxrewrite.runtime import providers  # noqa: E402
from fxrewrite.runtime.ops.moe import TRITON_MOE  # noqa: E402

CALLS = 20  # calls per graph when one call is a few microseconds


def per_call_us(fn: Callable[[], Any], reps: int, calls: int = CALLS) -> float:
    return 1e3 * graph_ms(lambda: [fn() for _ in range(calls)], reps) / calls


def sgl_routing(logits: torch.Tensor, top_k: int, bm: int) -> tuple[Callable[[], Any], torch.Tensor] | None:
    """sgl-kernel's routing and alignment for ``logits`` (a call and its top-k ids), or None."""
    try:
        import sgl_kernel
    except ImportError:
        return None
    tokens, experts = logits.shape
    dev = logits.device
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=dev)
    most = tokens * top_k + experts * (bm - 1)
    sorted_ids = torch.empty(most, dtype=torch.int32, device=dev)
    block_experts = torch.empty(-(-most // bm), dtype=torch.int32, device=dev)
    padded = torch.empty(1, dtype=torch.int32, device=dev)
    cumsum = torch.zeros(experts + 1, dtype=torch.int32, device=dev)

    def call() -> None:
        sgl_kernel.topk_softmax(weights, ids, logits, True)
        sgl_kernel.moe_align_block_size(ids, experts, bm, sorted_ids, block_experts, padded, cumsum, True)

    return call, ids


def rows(name: str, tokens: int, reps: int) -> tuple[str, str | None]:
    """One line of each table for one shape and token count (the GEMM line only at 128-row blocks)."""
    kernels = providers.library(TRITON_MOE)
    s = SHAPES[name]
    dev = torch.device("cuda")
    x = torch.randn((tokens, s.hidden), device=dev, dtype=torch.bfloat16)
    logits = torch.randn((tokens, s.experts), device=dev, dtype=torch.bfloat16)
    gate_up = torch.randn((s.experts, 2 * s.width, s.hidden), device=dev, dtype=torch.bfloat16) * 0.02
    down = torch.randn((s.experts, s.hidden, s.width), device=dev, dtype=torch.bfloat16) * 0.02
    cfg = kernels.config(tokens, s.top_k, s.experts, s.width, s.hidden, kernels._sms(dev),
                         kernels.tma_ready(x, gate_up, down))  # fmt: skip

    def ours() -> Any:
        return kernels.route(tokens, s.experts, s.top_k, cfg.bm, logits, None, None, True, dev)

    theirs = sgl_routing(logits, s.top_k, cfg.bm)
    same = "-"
    if theirs is not None:
        theirs[0]()
        same = "yes" if torch.equal(ours().ids.sort(-1).values, theirs[1].sort(-1).values) else "no"
    their_us = f"{per_call_us(theirs[0], reps):.1f}" if theirs is not None else "-"
    routing = f"| {name} | {tokens} | {cfg.bm} | {per_call_us(ours, reps):.1f} | {their_us} | {same} |"
    if cfg.bm != 128:
        return routing, None
    r = ours()
    offs = r.ends[: s.experts].clone()
    a = torch.randn((r.blocks * r.bm, s.hidden), device=dev, dtype=torch.bfloat16)
    h = torch.randn((r.blocks * r.bm, s.width), device=dev, dtype=torch.bfloat16)

    def whole(tma: bool) -> float:
        c = dataclasses.replace(cfg, tma=tma)
        return 1e3 * graph_ms(lambda: kernels.moe(x, logits, None, None, gate_up, down, s.top_k, True, cfg=c), reps)

    gu = 1e3 * graph_ms(lambda: torch._grouped_mm(a, gate_up.transpose(1, 2), offs=offs), reps)
    dn = 1e3 * graph_ms(lambda: torch._grouped_mm(h, down.transpose(1, 2), offs=offs), reps)
    gemms = f"| {name} | {tokens} | {whole(False):.0f} | {whole(True):.0f} | {gu:.0f} | {dn:.0f} | {gu + dn:.0f} |"
    return routing, gemms


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--reps", type=int, default=30, help="CUDA graph replays per time")
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape {unknown[0]!r} (known: {', '.join(SHAPES)})")
    if not torch.cuda.is_available():
        print("bench_moe_parts needs CUDA", file=sys.stderr)
        return 2
    if providers.library(TRITON_MOE) is None:
        print(f"bench_moe_parts needs Triton: {providers._REGISTRY.import_errors}", file=sys.stderr)
        return 2
    routing = ["| shape | T | block rows | route + align (ours) us | topk_softmax + moe_align_block_size us | same experts |",
               "|---|---|---|---|---|---|"]  # fmt: skip
    gemms = ["| shape | T | fxr.moe, pointer kernel us | fxr.moe, TMA kernel us | _grouped_mm gate_up us | _grouped_mm down us | _grouped_mm both us |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in args.shapes.split(","):
        for t in (int(v) for v in args.tokens.split(",")):
            line, gemm = rows(name, t, args.reps)
            routing.append(line)
            if gemm is not None:
                gemms.append(gemm)
            print(line, gemm or "", flush=True)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {now}\n")
    print("\n".join(routing) + "\n\n" + "\n".join(gemms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
