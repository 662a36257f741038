"""Decode-size linears of the 8B-shaped engine Llama: cuBLAS against ``fxr.linear``'s Triton
kernel, each against the weight bytes over the copy bandwidth, on one GPU.

    python bench/bench_gemm.py [--rows 1,8,16] [--sweep] [--out gemm.md]

For each projection of a layer (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down
4096 x 14336) and each row count: 32 weights of that shape (one per layer, together far larger
than L2, as in a step), 32 calls captured in one CUDA graph, the median of 20 replays. The last
row per row count replays the four projections of all 32 layers in model order: the step's
GEMMs. ``floor``: the weights' bytes over the device-to-device copy bandwidth (read + write)
measured in this run, as bench_e2e's HBM floor. ``err``: ``max|y - ref| / max|ref|`` of the
Triton kernel against float32 on fresh inputs (cuBLAS's beside it). ``--sweep`` times every
launch configuration of the Triton kernel too and prints the best per shape, the table
``triton_kernels.skinny_config`` is set from.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import Clock  # noqa: E402
from engine_model import llama_8b  # noqa: E402

from fxrewrite.runtime import providers  # noqa: E402

LAYERS = 32
SWEEP = list(itertools.product((16, 32, 64), (128, 256, 512), ((4, 3), (4, 4), (8, 3))))


def projections() -> dict[str, tuple[int, int]]:
    """name -> (n, k) of the 8B layer's weights."""
    cfg = llama_8b()
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "qkv": (q + 2 * kv, cfg.hidden_size),
        "o": (cfg.hidden_size, q),
        "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
        "down": (cfg.hidden_size, cfg.intermediate_size),
    }


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max())


def cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def fxr_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.fxr.linear.default(x, w)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16")
    p.add_argument("--sweep", action="store_true", help="also time every Triton launch configuration")
    p.add_argument("--out", help="also write the markdown table here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm needs CUDA", file=sys.stderr)
        return 2
    kernels = providers.library(providers.TRITON_MODULE)
    if kernels is None:
        print(f"bench_gemm needs Triton: {providers._REGISTRY.import_errors}", file=sys.stderr)
        return 2
    from bench_attention import graph_ms  # median ms of one replay of a captured call (imports Triton)

    providers.configure("linear=triton")  # a call the kernel cannot take is a counted fallback
    torch.manual_seed(0)
    dtype, shapes = torch.bfloat16, projections()
    bandwidth = Clock(torch.device("cuda")).copy_bandwidth(torch.device("cuda"), 2 << 30)  # as bench_e2e
    weights = {name: [torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5 for _ in range(LAYERS)]
               for name, (n, k) in shapes.items()}  # fmt: skip
    floor = {name: LAYERS * n * k * 2 / bandwidth * 1e3 for name, (n, k) in shapes.items()}
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write); bf16; {LAYERS} weights per shape",
        "",
        "| rows | projection | floor ms | cuBLAS ms | fxr.linear ms | cuBLAS / floor | fxr.linear / floor | fxr.linear / cuBLAS | err triton | err cuBLAS |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    sweeps = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {name: torch.randn(rows, k, device="cuda", dtype=dtype) for name, (n, k) in shapes.items()}
        for name, ws in weights.items():
            x = xs[name]
            ref = x.float() @ ws[0].float().t()
            errs = rel_err(fxr_linear(x, ws[0]), ref), rel_err(cublas(x, ws[0]), ref)
            t = [graph_ms(lambda fn=fn: [fn(x, w) for w in ws]) for fn in (cublas, fxr_linear)]
            lines.append(f"| {rows} | {name} | {floor[name]:.3f} | {t[0]:.3f} | {t[1]:.3f} | {t[0] / floor[name]:.3f} | "
                         f"{t[1] / floor[name]:.3f} | {t[1] / t[0]:.3f} | {errs[0]:.1e} | {errs[1]:.1e} |")  # fmt: skip
            print(lines[-1], flush=True)
            if args.sweep:
                for bn, bk, (warps, stages) in SWEEP:
                    cfg = (bn, bk, warps, stages)
                    try:
                        ms = graph_ms(lambda cfg=cfg: [kernels._skinny_linear(x, w, None, cfg) for w in ws])
                    except Exception as e:  # noqa: BLE001 - too much shared memory: not a candidate
                        print(f"{rows} {name} {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    sweeps.append((rows, name, cfg, ms, floor[name]))
        total = sum(floor.values())
        t = [graph_ms(lambda fn=fn: [fn(xs[name], weights[name][i]) for i in range(LAYERS) for name in shapes])
             for fn in (cublas, fxr_linear)]  # fmt: skip
        lines.append(f"| {rows} | all, in layer order | {total:.3f} | {t[0]:.3f} | {t[1]:.3f} | {t[0] / total:.3f} | "
                     f"{t[1] / total:.3f} | {t[1] / t[0]:.3f} | | |")  # fmt: skip
        print(lines[-1], flush=True)
    served = providers.served().get("linear", {})
    lines += ["", f"fxr.linear served: {served}"]
    if sweeps:
        lines += ["", "Sweep (BN, BK, warps, stages): best and default per shape", "",
                  "| rows | projection | best config | best ms | best / floor | default ms |", "|---|---|---|---|---|---|"]  # fmt: skip
        for (rows, name), group in itertools.groupby(sweeps, key=lambda s: (s[0], s[1])):
            group = list(group)
            best = min(group, key=lambda s: s[3])
            chosen = kernels.skinny_config(shapes[name][0], kernels._sms(torch.device("cuda", 0)))
            default = next((s[3] for s in group if s[2] == chosen), float("nan"))
            lines.append(f"| {rows} | {name} | {best[2]} | {best[3]:.3f} | {best[3] / best[4]:.3f} | {default:.3f} |")
        lines += ["", "All configurations (ms):", ""]
        lines += [f"{rows} {name} {cfg} {ms:.3f}" for rows, name, cfg, ms, _ in sweeps]
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
