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
launch configuration of the Triton kernel too and prints the best per shape, the tables
``triton_gemm.skinny_config`` and ``gated_config`` are set from.

A second table takes the MLP's activation in: gate_up then SiLU-and-mul as cuBLAS +
``fxr.silu_and_mul``, as ``fxr.linear`` + ``fxr.silu_and_mul``, and as one
``fxr.linear_silu_and_mul``; and the step's GEMMs in layer order with the activation, each way.

``--fp8``: a third table, the same projections with e4m3 weights and per-tensor scales:
``torch._scaled_mm`` (cuBLASLt) against ``fxr.linear_fp8``'s Triton kernel, the floor the FP8
weights' bytes; ``--fp8-sweep``: with the FP8 kernel's launch configurations too.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import Clock  # noqa: E402
from engine_model import llama_8b  # noqa: E402

import fxrewrite.runtime.ops  # noqa: E402, F401  (registers torch.ops.fxr.*)
from fxrewrite.runtime import providers  # noqa: E402
from fxrewrite.runtime.ops import linear as linear_ops  # noqa: E402

LAYERS = 32
SWEEP = list(itertools.product((16, 32, 64, 128), (64, 128, 256, 512), ((4, 3), (4, 4), (8, 3))))


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


def activated(linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``linear`` followed by ``fxr.silu_and_mul`` (the library that serves it by default)."""
    return lambda x, w: torch.ops.fxr.silu_and_mul.default(linear(x, w))


def fxr_gated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.fxr.linear_silu_and_mul.default(x, w)


GATED_WAYS = {"cuBLAS + silu_and_mul": activated(cublas), "fxr.linear + silu_and_mul": activated(fxr_linear),
              "fxr.linear_silu_and_mul": fxr_gated}  # fmt: skip


def gated_table(args: argparse.Namespace, kernels: Any, shapes: dict[str, tuple[int, int]],
                weights: dict[str, list[torch.Tensor]], floor: dict[str, float], sweeps: list[Any]) -> list[str]:  # fmt: skip
    """gate_up with SiLU-and-mul, three ways; then the step's GEMMs with the activation."""
    from bench_attention import graph_ms

    ways = list(GATED_WAYS)
    lines = ["", "gate_up with SiLU-and-mul, and the step's GEMMs in layer order with it:", "",
             "| rows | what | floor ms | " + " | ".join(f"{w} ms" for w in ways) + " | gated / cuBLAS + act | "
             "gated / fxr.linear + act | err gated |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    dtype = weights["gate_up"][0].dtype
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {name: torch.randn(rows, k, device="cuda", dtype=dtype) for name, (n, k) in shapes.items()}
        x, ws = xs["gate_up"], weights["gate_up"]
        gate, up = (x.float() @ ws[0].float().t()).chunk(2, dim=-1)
        err = rel_err(fxr_gated(x, ws[0]), F.silu(gate) * up)
        t = [graph_ms(lambda fn=fn: [fn(x, w) for w in ws]) for fn in GATED_WAYS.values()]
        lines.append(f"| {rows} | gate_up + SiLU-and-mul | {floor['gate_up']:.3f} | " + " | ".join(f"{v:.3f}" for v in t)
                     + f" | {t[2] / t[0]:.3f} | {t[2] / t[1]:.3f} | {err:.1e} |")  # fmt: skip
        print(lines[-1], flush=True)
        plain = (cublas, fxr_linear, fxr_linear)

        def step(i: int) -> None:
            for layer in range(LAYERS):
                for name in shapes:
                    fn = GATED_WAYS[ways[i]] if name == "gate_up" else plain[i]
                    fn(xs[name], weights[name][layer])

        t = [graph_ms(lambda i=i: step(i)) for i in range(3)]
        total = sum(floor.values())
        lines.append(f"| {rows} | all, in layer order | {total:.3f} | " + " | ".join(f"{v:.3f}" for v in t)
                     + f" | {t[2] / t[0]:.3f} | {t[2] / t[1]:.3f} | |")  # fmt: skip
        print(lines[-1], flush=True)
        if args.sweep:
            for bn, bk, (warps, stages) in SWEEP:
                cfg = (bn, bk, warps, stages)  # a gated program takes bn gate and bn up rows
                try:
                    ms = graph_ms(lambda cfg=cfg: [kernels.skinny(x, w, None, kernels.Fusion(gated=True), cfg) for w in ws])
                except Exception as e:  # noqa: BLE001 - too much shared memory: not a candidate
                    print(f"{rows} gated {cfg}: {type(e).__name__}", file=sys.stderr)
                    continue
                sweeps.append((rows, "gate_up, gated", cfg, ms, floor["gate_up"]))
    return lines


Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def timed_row(rows: int, name: str, floor: float, x: torch.Tensor, ws: list[torch.Tensor], ref: torch.Tensor,
              base: Gemm, ours: Gemm) -> str:  # fmt: skip
    """One projection's row: ``base`` and ``ours`` over its weights in one CUDA graph each, against
    the floor and, on the first weight, against the float32 ``ref``."""
    from bench_attention import graph_ms

    errs = rel_err(ours(x, ws[0]), ref), rel_err(base(x, ws[0]), ref)
    t = [graph_ms(lambda fn=fn: [fn(x, w) for w in ws]) for fn in (base, ours)]
    line = (f"| {rows} | {name} | {floor:.3f} | {t[0]:.3f} | {t[1]:.3f} | {t[0] / floor:.3f} | {t[1] / floor:.3f} | "
            f"{t[1] / t[0]:.3f} | {errs[0]:.1e} | {errs[1]:.1e} |")  # fmt: skip
    print(line, flush=True)
    return line


def layer_order_row(rows: int, xs: dict[str, torch.Tensor], weights: dict[str, list[torch.Tensor]], floor: float,
                    base: Gemm, ours: Gemm) -> str:  # fmt: skip
    """The step's GEMMs: every projection of every layer in model order, one CUDA graph each way."""
    from bench_attention import graph_ms

    t = [graph_ms(lambda fn=fn: [fn(xs[name], weights[name][i]) for i in range(LAYERS) for name in weights])
         for fn in (base, ours)]  # fmt: skip
    line = (f"| {rows} | all, in layer order | {floor:.3f} | {t[0]:.3f} | {t[1]:.3f} | {t[0] / floor:.3f} | "
            f"{t[1] / floor:.3f} | {t[1] / t[0]:.3f} | | |")  # fmt: skip
    print(line, flush=True)
    return line


FP8_SWEEP = list(itertools.product((32, 64), (256, 512, 1024), ((4, 3), (4, 4), (8, 4))))


def fp8_table(args: argparse.Namespace, kernels: Any, shapes: dict[str, tuple[int, int]], bandwidth: float) -> list[str]:
    """cuBLASLt's FP8 GEMM against ``fxr.linear_fp8`` on e4m3 weights (module docstring)."""
    from bench_attention import graph_ms

    fp8 = torch.float8_e4m3fn
    weights = {name: [(torch.randn(n, k, device="cuda") * 40).clamp(-448, 448).to(fp8) for _ in range(LAYERS)]
               for name, (n, k) in shapes.items()}  # fmt: skip
    floor = {name: LAYERS * n * k / bandwidth * 1e3 for name, (n, k) in shapes.items()}
    sa, sb = torch.tensor(0.013, device="cuda"), torch.tensor(0.0021, device="cuda")

    def cublaslt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    def fxr_fp8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.fxr.linear_fp8.default(x, w, sa, sb, torch.bfloat16)

    lines = ["", "FP8 (e4m3 weights and input, per-tensor scales, bf16 out); floor: the e4m3 weights' bytes", "",
             "| rows | projection | floor ms | cuBLASLt ms | fxr.linear_fp8 ms | cuBLASLt / floor | fxr.linear_fp8 / floor | "
             "fxr.linear_fp8 / cuBLASLt | err triton | err cuBLASLt |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    sweeps = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {name: (torch.randn(rows, k, device="cuda") * 40).clamp(-448, 448).to(fp8) for name, (n, k) in shapes.items()}
        for name, ws in weights.items():
            x = xs[name]
            lines.append(timed_row(rows, name, floor[name], x, ws, (x.float() @ ws[0].float().t()) * (sa * sb), cublaslt, fxr_fp8))
            if args.fp8_sweep:
                f = kernels.Fusion(scales=(sa, sb), out_dtype=torch.bfloat16)
                for bn, bk, (warps, stages) in FP8_SWEEP:
                    cfg = (bn, bk, warps, stages)
                    try:
                        ms = graph_ms(lambda cfg=cfg: [kernels.skinny(x, w, None, f, cfg) for w in ws])
                    except Exception as e:  # noqa: BLE001 - too much shared memory: not a candidate
                        print(f"fp8 {rows} {name} {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    sweeps.append((rows, name, cfg, ms))
        lines.append(layer_order_row(rows, xs, weights, sum(floor.values()), cublaslt, fxr_fp8))
    if sweeps:
        lines += ["", "FP8 sweep (BN, BK, warps, stages), best per shape:", ""]
        for (rows, name), group in itertools.groupby(sweeps, key=lambda s: (s[0], s[1])):
            best = min(group, key=lambda s: s[3])
            lines.append(f"- {rows} rows, {name}: {best[2]} {best[3]:.3f} ms ({best[3] / floor[name]:.3f} of the floor)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16")
    p.add_argument("--sweep", action="store_true", help="also time every Triton launch configuration")
    p.add_argument("--out", help="also write the markdown table here")
    p.add_argument("--fp8", action="store_true", help="also the FP8 table (torch._scaled_mm against fxr.linear_fp8)")
    p.add_argument("--fp8-sweep", action="store_true", help="the FP8 table with its kernel's launch configurations")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm needs CUDA", file=sys.stderr)
        return 2
    kernels = providers.library(linear_ops.TRITON_GEMM)
    if kernels is None:
        print(f"bench_gemm needs Triton: {providers._REGISTRY.import_errors}", file=sys.stderr)
        return 2
    from bench_attention import graph_ms  # median ms of one replay of a captured call (imports Triton)

    # a call the kernel cannot take is a counted fallback
    providers.configure("linear=triton,linear_silu_and_mul=triton,linear_fp8=triton")
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
            lines.append(timed_row(rows, name, floor[name], x, ws, x.float() @ ws[0].float().t(), cublas, fxr_linear))
            if args.sweep:
                for bn, bk, (warps, stages) in SWEEP:
                    cfg = (bn, bk, warps, stages)
                    try:
                        ms = graph_ms(lambda cfg=cfg: [kernels.skinny(x, w, None, kernels.PLAIN, cfg) for w in ws])
                    except Exception as e:  # noqa: BLE001 - too much shared memory: not a candidate
                        print(f"{rows} {name} {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    sweeps.append((rows, name, cfg, ms, floor[name]))
        lines.append(layer_order_row(rows, xs, weights, sum(floor.values()), cublas, fxr_linear))
    lines += gated_table(args, kernels, shapes, weights, floor, sweeps)
    if args.fp8 or args.fp8_sweep:
        lines += fp8_table(args, kernels, shapes, bandwidth)
    lines += ["", f"fxr.linear served: {providers.served().get('linear', {})}",
              f"fxr.linear_silu_and_mul served: {providers.served().get('linear_silu_and_mul', {})}"]  # fmt: skip
    if sweeps:
        lines += ["", "Sweep (BN, BK, warps, stages): best and default per shape", "",
                  "| rows | projection | best config | best ms | best / floor | default ms |", "|---|---|---|---|---|---|"]  # fmt: skip
        for (rows, name), group in itertools.groupby(sweeps, key=lambda s: (s[0], s[1])):
            group = list(group)
            best = min(group, key=lambda s: s[3])
            sms = kernels._sms(torch.device("cuda", 0))
            n = shapes[name.split(",")[0]][0]
            tile = kernels.row_tile(rows)
            chosen = (kernels.gated_config(n // 2, sms, tile) if name.endswith("gated")
                      else kernels.skinny_config(n, sms, tile))  # fmt: skip
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
