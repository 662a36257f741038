"""Each decode GEMM of ``Config.gemm_fusion`` (issue 30) against what it replaces, on the 8B
layer's weights, alone on the device: one CUDA graph of many back-to-back calls (bench_ops'
timing), median per call, with the time the weight read alone takes at the copy bandwidth.

    source .devkit/setup.sh && python3 bench/bench_gemm_fusion.py [--rows 8]

Rows (8B: hidden 4096, 32/8 heads of 128, MLP 14336): qkv (norm + GEMM + RoPE against norm,
GEMM, rotary), o_proj (GEMM + residual add against the GEMM alone: the add was in the fused add + norm),
gate_up (norm + GEMM + SiLU-and-mul against norm, gated GEMM), down (GEMM + add against GEMM).
The hand-off rows (``fxr.linear_add_rms_parts``: the GEMM that makes the residual stream's rows
also stores ``s * g`` and each row's sums of squares, so the next GEMM's k loop only streams):
o_proj with the add and the hand-off against the GEMM and the fused add + norm kernel it
replaces, and qkv / gate_up reading a hand-off against the norm kernel and their GEMMs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ops import copy_bandwidth, graph_time_us  # noqa: E402

import fxrewrite.runtime.ops  # noqa: E402,F401

fxr = torch.ops.fxr


def cases(rows: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[Callable[[], Any], Callable[[], Any], int]]:
    """name -> (fused call, unfused calls, weight bytes)."""
    d, hidden, heads, kv, dim, mlp = "cuda", 4096, 32, 8, 128, 14336
    qkv_n = (heads + 2 * kv) * dim
    x = torch.randn(rows, hidden, device=d, dtype=dtype)
    res = torch.randn(rows, hidden, device=d, dtype=dtype)
    g = torch.rand(hidden, device=d, dtype=dtype) + 0.5
    w = {k: torch.randn(n, kk, device=d, dtype=dtype) * 0.02
         for k, (n, kk) in {"qkv": (qkv_n, hidden), "o": (hidden, heads * dim), "gate_up": (2 * mlp, hidden),
                            "down": (hidden, mlp)}.items()}  # fmt: skip
    a_o = torch.randn(rows, heads * dim, device=d, dtype=dtype)
    a_down = torch.randn(rows, mlp, device=d, dtype=dtype)
    pos = torch.randint(0, 4096, (rows,), device=d)
    cache = torch.randn(8192, dim, device=d, dtype=torch.float32)

    eps = 1e-6
    s, sg, parts = fxr.linear_add_rms_parts(a_o, w["o"], res, g)
    res2 = res.clone()

    def o_unfused() -> Any:
        return fxr.fused_add_rms_norm(fxr.linear(a_o, w["o"]), res2, g, eps)

    def qkv_unfused() -> Any:
        y = fxr.linear(fxr.rms_norm(x, g, 1e-6), w["qkv"])
        q, k = y[:, : heads * dim], y[:, heads * dim : (heads + kv) * dim]
        return fxr.rotary_embedding(pos, q.reshape(rows, heads, dim), k.reshape(rows, kv, dim), cache, True)

    bytes_of = {k: t.numel() * t.element_size() for k, t in w.items()}
    return {
        "qkv: norm + GEMM + RoPE": (lambda: fxr.rms_norm_linear_rotary(x, g, 1e-6, w["qkv"], None, False, pos,
                                                                      cache, (heads + kv) * dim),  # fmt: skip
                                    qkv_unfused, bytes_of["qkv"]),
        "qkv: norm + GEMM": (lambda: fxr.rms_norm_linear(x, g, 1e-6, w["qkv"]),
                             lambda: fxr.linear(fxr.rms_norm(x, g, 1e-6), w["qkv"]), bytes_of["qkv"]),
        "qkv: unweighted norm + GEMM (the k loop's sum of squares alone)": (
            lambda: fxr.rms_norm_linear(x, None, 1e-6, w["qkv"]),
            lambda: fxr.linear(fxr.rms_norm(x, None, 1e-6), w["qkv"]), bytes_of["qkv"]),
        "gate_up: unweighted norm + GEMM + SiLU-and-mul": (
            lambda: fxr.rms_norm_linear_silu_and_mul(x, None, 1e-6, w["gate_up"]),
            lambda: fxr.linear_silu_and_mul(fxr.rms_norm(x, None, 1e-6), w["gate_up"]), bytes_of["gate_up"]),
        "o_proj: GEMM + add + the next norm's hand-off": (lambda: fxr.linear_add_rms_parts(a_o, w["o"], res, g),
                                                         o_unfused, bytes_of["o"]),
        "qkv: GEMM reading a hand-off + RoPE": (
            lambda: fxr.rms_norm_linear_rotary(sg, None, eps, w["qkv"], None, False, pos, cache, (heads + kv) * dim,
                                               parts),
            qkv_unfused, bytes_of["qkv"]),  # fmt: skip
        "gate_up: GEMM reading a hand-off + SiLU-and-mul": (
            lambda: fxr.rms_norm_linear_silu_and_mul(sg, None, eps, w["gate_up"], None, False, parts),
            lambda: fxr.linear_silu_and_mul(fxr.rms_norm(x, g, eps), w["gate_up"]), bytes_of["gate_up"]),
        "o_proj: GEMM + add": (lambda: fxr.linear_add(a_o, w["o"], res), lambda: fxr.linear(a_o, w["o"]), bytes_of["o"]),
        "gate_up: norm + GEMM + SiLU-and-mul": (lambda: fxr.rms_norm_linear_silu_and_mul(x, g, 1e-6, w["gate_up"]),
                                                lambda: fxr.linear_silu_and_mul(fxr.rms_norm(x, g, 1e-6), w["gate_up"]),
                                                bytes_of["gate_up"]),  # fmt: skip
        "down: GEMM + add": (lambda: fxr.linear_add(a_down, w["down"], res), lambda: fxr.linear(a_down, w["down"]),
                             bytes_of["down"]),  # fmt: skip
    }


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--calls", type=int, default=64)
    args = p.parse_args()
    bandwidth = copy_bandwidth()  # bytes per second, read + write
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, rows {args.rows}; us per call, "
          f"one CUDA graph of {args.calls} calls, median of the replays")  # fmt: skip
    print("| GEMM | fused us | unfused us | fused / unfused | weight read us at copy bandwidth |")
    print("|---|---|---|---|---|")
    for name, (fused, unfused, nbytes) in cases(args.rows).items():
        f = graph_time_us(lambda: fused(), [()], args.calls)
        u = graph_time_us(lambda: unfused(), [()], args.calls)
        print(f"| {name} | {f:.1f} | {u:.1f} | {f / u:.2f} | {nbytes / bandwidth * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
