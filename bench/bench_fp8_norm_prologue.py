"""The FP8 norm's quantization in the reading GEMM (``Config.fp8_norm_prologue``, issue 30 item 5)
against what it replaces, on the 8B layer's qkv and gate_up weights, on one GPU.

    source .devkit/setup.sh && python3 bench/bench_fp8_norm_prologue.py [--rows 1,8] [--sweep]

Per row count and GEMM: 32 e4m3 weights of that shape (one per layer), each system's 32 calls
captured in one CUDA graph, the median of 20 replays (ms per 32 calls):

- ``widened``: the norm-quant kernel's e4m3 output read by ``fxr.linear_fp8``'s Triton kernel
  (today's FP8 layer), and the norm-quant kernel (``fxr.rms_norm_quant_fp8``) timed alone;
- ``prologue``: ``fxr.rms_norm_quant_linear_fp8`` (gate_up: ``..._silu_and_mul_quant``) on the
  hand-off ``s * g`` and its slots, which quantizes every A tile itself;
- ``--sweep``: every (BN, BK, warps, stages) of the prologue kernel, the best four printed.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fxrewrite.runtime.ops  # noqa: E402, F401  (registers torch.ops.fxr.*)
from fxrewrite.runtime import providers  # noqa: E402
from fxrewrite.runtime.ops import linear as linear_ops  # noqa: E402
from fxrewrite.runtime.ops.linear_fused import hand_off  # noqa: E402

LAYERS, K = 32, 4096
SHAPES = {"qkv": (6144, False), "gate_up + SiLU-and-mul + quant": (28672, True)}
SWEEP = list(itertools.product((32, 64), (128, 256, 512, 1024), ((4, 3), (4, 4), (8, 4), (8, 3))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8")
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    kernels = providers.library(linear_ops.TRITON_GEMM)
    if not torch.cuda.is_available() or kernels is None:
        print("bench_fp8_norm_prologue needs CUDA and Triton", file=sys.stderr)
        return 2
    from bench_attention import graph_ms

    torch.manual_seed(0)
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    sq, sw, so = (torch.tensor(v, device="cuda") for v in (2**-6, 2e-3, 0.05))
    g = torch.ones(K, device="cuda", dtype=bf16)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {LAYERS} weights per shape, ms per {LAYERS} calls\n")
    print("| GEMM | rows | widened GEMM | norm-quant kernel | sum | prologue | prologue / sum |\n|---|---|---|---|---|---|---|")
    for name, (n, gated) in SHAPES.items():
        ws = [(torch.randn(n, K, device="cuda") * 40).clamp(-448, 448).to(fp8) for _ in range(LAYERS)]
        out_scale = so if gated else None
        for rows in (int(r) for r in args.rows.split(",")):
            s = torch.randn(rows, K, device="cuda", dtype=bf16)
            _, sg, parts = hand_off(s, g)
            q = torch.ops.fxr.rms_norm_quant_fp8.default(s, g, 1e-6, sq)
            widened = kernels.Fusion(scales=(sq, sw), out_dtype=bf16, gated=gated, out_scale=out_scale)
            prologue = kernels.Fusion(norm=True, eps=1e-6, parts=parts, scales=(sq, sw), out_dtype=bf16,
                                      quant_input=True, gated=gated, out_scale=out_scale)  # fmt: skip
            gemm = graph_ms(lambda: [kernels.skinny(q, w, None, widened) for w in ws])
            norm = graph_ms(lambda: [torch.ops.fxr.rms_norm_quant_fp8.default(s, g, 1e-6, sq) for _ in ws])
            fused = graph_ms(lambda: [kernels.skinny(sg, w, None, prologue) for w in ws])
            print(f"| {name} | {rows} | {gemm:.3f} | {norm:.3f} | {gemm + norm:.3f} | {fused:.3f} | "
                  f"{fused / (gemm + norm):.3f} |", flush=True)  # fmt: skip
            if args.sweep:
                timed = []
                for bn, bk, (warps, stages) in SWEEP:
                    try:
                        cfg = (bn, bk, warps, stages)
                        timed.append((graph_ms(lambda cfg=cfg: [kernels.skinny(sg, w, None, prologue, cfg) for w in ws]), cfg))
                    except Exception as e:  # noqa: BLE001 - too much shared memory: not a candidate
                        print(f"  {cfg}: {type(e).__name__}", file=sys.stderr)
                print(f"  best: {', '.join(f'{ms:.3f} {cfg}' for ms, cfg in sorted(timed)[:4])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
