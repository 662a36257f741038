"""Fused-op kernels against the unfused torch code and the HBM floor, bf16, on one GPU.

    python bench/bench_ops.py [--out bench/ops.md] [--tokens 1,8,64,512,4096] [--hidden 4096]
                              [--mlp-hidden 4096] [--ops rms_norm,silu_and_mul] [--provider SPEC]
                              [--no-compare] [--norm-affine-dtype float32]

For each ``fxr`` op and token count T (hidden 4096; the gated activations take [T, 2 * 4096]
and give [T, 4096], i.e. d = hidden, change with --mlp-hidden, e.g. 14336 for Llama-3-8B):

- check:      the op's output on fresh random bf16 inputs against its reference run in float32
              on the same values (one bf16 rounding; FP8 one e4m3 step; NVFP4 one e2m1 step and
              one e4m3 scale step), before any timing;
- provider:   who served the call (``providers.served()``): "sgl_kernel", "flashinfer",
              "...+torch" (part of the op in plain torch), or "torch" (no kernel could);
- fused:      ``torch.ops.fxr.<op>`` per call;
- unfused:    the torch code the op replaces (its reference; for an in-place op, the functional
              twin's, as the model spells it) per call;
- block FP8 (``*_block_quant_fp8``): groups of 128; "unfused" is the torch code, and the
              forced ``sgl_kernel`` column the two-kernel pair (sgl-kernel's norm or activation,
              then its per-token-group quantization);
- ``linear_block_fp8``: [T, hidden] x [hidden, hidden] (FP8 operands, groups of 128 and 128 x
              128 tiles); "unfused" is its dequantizing float32 reference, not a bf16 GEMM;
- floor:      bytes that must move (each tensor argument read once, each output written once)
              over the device-to-device copy bandwidth measured in this run (read + write);
- launch:     (``--ops launch_floor``, or every run without ``--ops``) the floor of any kernel:
              an empty Triton kernel and one that reads and writes one element, timed as the ops
              are (back to back in a CUDA graph). Below a few hundred KiB every op's HBM floor is
              under it (8 x 4096 bf16 = 64 KiB: ~0.02 us), so at small T an op is bounded by the
              launch, not by HBM: the report gives each op's time there against both floors.

Then, for every op that more than one importable provider has a kernel for, the same check and
fused timing with each provider forced in turn (``providers.configure("<op>=<provider>")``),
side by side on the same inputs: the table the op modules' kernel order is set from.

Timing: K back-to-back calls captured in one CUDA graph, rotating over enough input sets that
they exceed twice the L2 cache (at most K sets), replayed after warm-up; the median over the
replays divided by K. CUDA graphs take launch overhead out of both columns: what remains is
GPU time, as in piecewise-graph serving. Total runtime is about a minute on an H100.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the launch floor needs Triton; the ops' rows do not
    triton = None

import fxrewrite.runtime.ops as ops
from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import quant
from fxrewrite.runtime.ops.linear_block_fp8 import quant_weight_block
from fxrewrite.runtime.ops.quant_block import quant_fp8_block
from fxrewrite.runtime.providers import OpDef

DTYPE = torch.bfloat16
EPS = 1e-6
REPLAYS = 15


@dataclass
class Forced:
    """One provider forced for one op: who served (its label, or "torch" on a fallback), check, time."""

    served: str
    check: str
    fused_us: float


@dataclass
class Row:
    op: str
    tokens: int
    provider: str
    check: str
    fused_us: float
    unfused_us: float
    bytes_moved: int
    floor_us: float
    forced: dict[str, Forced] = field(default_factory=dict)

    def cells(self) -> list[str]:
        return [
            self.op,
            str(self.tokens),
            self.provider,
            self.check,
            f"{self.fused_us:.2f}",
            f"{self.unfused_us:.2f}",
            f"{self.unfused_us / self.fused_us:.1f}x",
            f"{self.bytes_moved / 2**20:.2f}",
            f"{self.floor_us:.2f}",
            f"{self.fused_us / self.floor_us:.2f}",
        ]


HEADER = ["op", "T", "provider", "check", "fused us", "unfused us", "speedup", "MiB moved", "floor us", "fused / floor"]


# --------------------------------------------------------------------------- inputs


def is_activation(op: OpDef) -> bool:
    return not {"weight", "w"} & set(inspect.signature(op.reference).parameters) and op.name != "l2_norm"


def make_args(op: OpDef, tokens: int, hidden: int, mlp_hidden: int, dtype: torch.dtype = DTYPE,
              norm_affine: torch.dtype | None = None) -> list[Any]:  # fmt: skip
    """Fresh random arguments for ``op``; ``x`` is [T, 2 * mlp_hidden] for gated activations; a
    norm's weight and bias of ``norm_affine`` (default: ``dtype``: flashinfer's LayerNorm takes
    float32 ones only); other arguments at their defaults."""
    width = 2 * mlp_hidden if is_activation(op) else hidden
    params = inspect.signature(op.reference).parameters
    affine = norm_affine if norm_affine is not None and "eps" in params else dtype
    values: dict[str, Callable[[], Any]] = {
        "x": lambda: torch.randn(tokens, width, device="cuda", dtype=dtype),
        # fxr.act_mul: two [T, mlp_hidden] operands, the two halves silu_and_mul reads in one
        "a": lambda: torch.randn(tokens, mlp_hidden, device="cuda", dtype=dtype),
        "b": lambda: torch.randn(tokens, mlp_hidden, device="cuda", dtype=dtype),
        # a lone quantizer (fxr.dynamic_quant_fp8, block_quant_fp8, quant_nvfp4): o_proj's [T, hidden] input
        "y": lambda: torch.randn(tokens, hidden, device="cuda", dtype=dtype),
        "residual": lambda: torch.randn(tokens, width, device="cuda", dtype=dtype),
        "weight": lambda: (torch.rand(hidden, device="cuda") + 0.5).to(affine),
        "w": lambda: (torch.randn(hidden, hidden, device="cuda") * hidden**-0.5).to(dtype),  # fxr.linear
        "bias": lambda: torch.randn(hidden, device="cuda").to(affine),
        "eps": lambda: EPS,
        "scale": lambda: torch.tensor([0.02], device="cuda"),
        "global_scale": lambda: torch.tensor([300.0], device="cuda"),  # NVFP4: block scales of about 150
        "approximate": lambda: "none",
        # the plain norms in the order the library kernels compute exactly; the norm + quant ops in
        # Llama's, as their rows were timed before they took the flag (the GPU tests check both)
        "cast_last": lambda: "quant" not in op.name,
        "round_scale": lambda: False,
        "gate": lambda: torch.randn(tokens, width, device="cuda", dtype=dtype),  # fxr.rms_norm_gated: one group
        "group_size": lambda: None,
        "gate_first": lambda: False,
        "activation": lambda: "silu",
        "group": lambda: 128,  # block FP8: per-token groups of 128 (DeepSeek-V3, Qwen3-FP8)
        **block_fp8_gemm_args(tokens, hidden, dtype),
    }
    return [values[name]() if name in values else p.default for name, p in params.items()]


def block_fp8_gemm_args(tokens: int, hidden: int, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    """``fxr.linear_block_fp8``: [T, hidden] activations quantized per group of 128, a [hidden,
    hidden] weight per 128 x 128 tile (made once per call of this function), output ``dtype``."""
    made: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if not made:
            x = torch.randn(tokens, hidden, device="cuda")
            made["a_q"], made["a_scale"] = quant_fp8_block(x)
            made["w_q"], made["w_scale"] = quant_weight_block(torch.randn(hidden, hidden, device="cuda") * hidden**-0.5)
        return made[name]

    makers: dict[str, Callable[[], Any]] = {n: functools.partial(get, n) for n in ("a_q", "a_scale", "w_q", "w_scale")}
    return {**makers, "out_dtype": lambda: dtype}


def tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    return []


def outputs(op: OpDef, result: Any, args: Sequence[Any]) -> list[torch.Tensor]:
    """Returned tensors, or for an in-place op the arguments it overwrites."""
    return list(args[:2]) if op.mutates_args else tensors(result)


def bytes_moved(op: OpDef, args: Sequence[Any]) -> int:
    result = op.reference(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    read = sum(t.nbytes for t in tensors(list(args)))
    written = sum(t.nbytes for t in outputs(op, result, args))
    return read + written


# --------------------------------------------------------------------------- check


def check(op: OpDef, tokens: int, hidden: int, mlp_hidden: int, norm_affine: torch.dtype | None = None) -> tuple[str, str]:
    """(provider that served, "ok" or what differs) on fresh inputs vs the float32 reference."""
    args = make_args(op, tokens, hidden, mlp_hidden, norm_affine=norm_affine)
    ref_args = [a.float() if isinstance(a, torch.Tensor) and a.dtype == DTYPE else a for a in args]
    providers.reset_counts()
    got = outputs(op, getattr(torch.ops.fxr, op.name)(*args), args)
    want = outputs(op, op.reference(*ref_args), ref_args)
    served = [name for name in providers.served().get(op.name, {}) if name != "fallbacks"]
    problems, rest = quant.quantized_output_mismatches(got, want, quant.fp8_scale_rtol(DTYPE))
    for i in rest:
        g, w = got[i].float(), want[i].float()
        bad = ~torch.isclose(g, w, rtol=2e-2, atol=2e-2)
        if bad.any():
            problems.append(f"out{i}: {int(bad.sum())} of {bad.numel()} off, max err {float((g - w).abs().max()):.3g}")
    return ",".join(served) or "?", "; ".join(problems) or "ok"


# --------------------------------------------------------------------------- timing


def graph_time_us(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], calls: int) -> float:
    """Median time per call of ``calls`` back-to-back ``fn`` calls in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in arg_sets[:3]:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write, of a 1 GiB copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = graph_time_us(lambda: dst.copy_(src), [()], calls=5) * 1e-6
    del src, dst
    return 2 * 2**30 / seconds


def l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20))


def calls_for(tokens: int) -> int:
    return 200 if tokens <= 64 else 50 if tokens <= 512 else 20


def functional_twin(op: OpDef) -> OpDef:
    if not op.mutates_args:
        return op
    return ops.DEFS[ops.OPS.index(op.name.rstrip("_"))]


def kernel_providers(op: OpDef) -> list[str]:
    """Providers with a kernel for ``op`` whose library imports here, in ``PROVIDERS`` order."""
    usable = {k.provider for k in op.kernels if providers.library(k.module or k.provider) is not None}
    return [p for p in providers.PROVIDERS if p in usable]


def bench_op(
    op: OpDef, tokens: int, hidden: int, mlp_hidden: int, bandwidth: float, compare: Sequence[str], spec: str | None,
    norm_affine: torch.dtype | None = None,
) -> Row:
    """The op as configured (``spec``), then with each of ``compare`` forced, on the same inputs."""
    provider, verdict = check(op, tokens, hidden, mlp_hidden, norm_affine)
    first = make_args(op, tokens, hidden, mlp_hidden, norm_affine=norm_affine)
    moved = bytes_moved(op, first)
    calls = calls_for(tokens)
    n_sets = max(1, min(calls, math.ceil(2 * l2_bytes() / moved)))
    arg_sets = [first] + [make_args(op, tokens, hidden, mlp_hidden, norm_affine=norm_affine) for _ in range(n_sets - 1)]
    fn = getattr(torch.ops.fxr, op.name)
    fused = graph_time_us(fn, arg_sets, calls)
    unfused = graph_time_us(functional_twin(op).reference, arg_sets, calls)
    row = Row(op.name, tokens, provider, verdict, fused, unfused, moved, moved / bandwidth * 1e6)
    for name in compare:
        providers.configure(f"{op.name}={name}")
        served, forced_verdict = check(op, tokens, hidden, mlp_hidden, norm_affine)
        row.forced[name] = Forced(served, forced_verdict, graph_time_us(fn, arg_sets, calls))
    providers.configure(spec)
    del arg_sets, first
    torch.cuda.empty_cache()
    return row


# --------------------------------------------------------------------------- the launch floor

LAUNCH_FLOOR = "launch_floor"
LAUNCH_CALLS = 200  # as calls_for(T) for T <= 64

if triton is not None:

    @triton.jit
    def _empty_kernel(ptr):
        pass

    @triton.jit
    def _one_element_kernel(ptr):
        tl.store(ptr, tl.load(ptr) + 1.0)


def launch_floor_kernels() -> dict[str, Callable[[torch.Tensor], Any]]:
    """The two kernels whose launch is the floor of any op: an empty one and a one-element
    read-modify-write, each one program (one CTA), as a callable of a float32 tensor."""
    return {
        "empty Triton kernel": lambda t: _empty_kernel[(1,)](t),
        "one-element Triton kernel": lambda t: _one_element_kernel[(1,)](t),
    }


def launch_floor_us() -> dict[str, float]:
    """Each launch-floor kernel's time per call, timed as the ops are (:func:`graph_time_us`)."""
    if triton is None:
        return {}
    t = torch.zeros(1, dtype=torch.float32, device="cuda")
    return {name: graph_time_us(fn, [(t,)], LAUNCH_CALLS) for name, fn in launch_floor_kernels().items()}


def launch_report(launch: dict[str, float], rows: Sequence[Row]) -> list[str]:
    """The launch floor, and at each T up to 64 every op's time against it and against the HBM floor."""
    if not launch:
        return []
    floor = max(launch.values())
    lines = ["Launch floor (the same timing: "
             f"{LAUNCH_CALLS} back-to-back launches in one CUDA graph, median of {REPLAYS} replays, per launch): "
             + ", ".join(f"{name} {us:.2f} us" for name, us in launch.items()) + "."]  # fmt: skip
    small = [r for r in rows if r.tokens <= 64]
    if small:
        cells = [[r.op, str(r.tokens), f"{r.fused_us:.2f}", f"{r.floor_us:.2f}", f"{floor:.2f}",
                  f"{r.fused_us / max(r.floor_us, floor):.2f}"] for r in small]  # fmt: skip
        lines += ["", markdown(["op", "T", "fused us", "HBM floor us", "launch floor us",
                                "fused / max(HBM, launch)"], cells)]  # fmt: skip
    return lines + [""]


# --------------------------------------------------------------------------- report


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def table(rows: Sequence[Row]) -> str:
    return markdown(HEADER, [r.cells() for r in rows])


def side_by_side(rows: Sequence[Row]) -> str:
    """Per op and T: each forced provider's time and its ratio to the floor; the fastest that
    passed its check. A cell names who served when that was not the provider itself."""
    names = [p for p in providers.PROVIDERS if any(p in r.forced for r in rows)]
    header = ["op", "T", "floor us", "unfused us", *(f"{p} us (/ floor)" for p in names), "fastest", "order now"]
    lines = []
    for r in rows:
        if not r.forced:
            continue
        cells = []
        for p in names:
            f = r.forced.get(p)
            if f is None:
                cells.append("-")
                continue
            note = "" if f.served == p else f" [{f.served}]"
            note += "" if f.check == "ok" else f" CHECK: {f.check}"
            cells.append(f"{f.fused_us:.2f} ({f.fused_us / r.floor_us:.2f}x){note}")
        ok = {p: f.fused_us for p, f in r.forced.items() if f.check == "ok" and f.served.startswith(p)}
        fastest = min(ok, key=ok.__getitem__) if ok else "?"
        order = " > ".join(dict.fromkeys(k.provider for k in ops.DEFS[ops.OPS.index(r.op)].kernels))
        lines.append([r.op, str(r.tokens), f"{r.floor_us:.2f}", f"{r.unfused_us:.2f}", *cells, fastest, order])
    return markdown(header, lines)


def criteria(rows: Sequence[Row]) -> list[str]:
    """Issue 3's bar: at T=4096 within 1.3x of the floor; at T<=64 at least 3x the unfused code."""
    misses = []
    for r in rows:
        if r.tokens == 4096 and r.fused_us > 1.3 * r.floor_us:
            misses.append(f"- {r.op} T={r.tokens}: {r.fused_us / r.floor_us:.2f}x the floor ({r.provider})")
        if r.tokens <= 64 and r.unfused_us < 3 * r.fused_us:
            speedup = r.unfused_us / r.fused_us
            misses.append(f"- {r.op} T={r.tokens}: speedup {speedup:.1f}x over unfused ({r.provider})")
        if r.check != "ok":
            misses.append(f"- {r.op} T={r.tokens}: check {r.check}")
        for name, f in r.forced.items():
            if f.check != "ok":
                misses.append(f"- {r.op} T={r.tokens} forced to {name}: check {f.check}")
    return misses


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the markdown report to this file")
    parser.add_argument("--tokens", default="1,8,64,512,4096")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--mlp-hidden", type=int, default=4096, help="d of the gated activations: x is [T, 2d]")
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    parser.add_argument("--provider", default=None, help="override, as FXREWRITE_PROVIDER")
    parser.add_argument("--norm-affine-dtype", default=None, choices=["float32", "bfloat16"],
                        help="dtype of the norms' weight and bias (default: the input's); flashinfer's LayerNorm "
                             "serves float32 ones only")  # fmt: skip
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time each provider forced in turn, where more than one has a kernel (default: on)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ops needs CUDA", file=sys.stderr)
        return 2
    providers.configure(args.provider)
    token_counts = [int(t) for t in args.tokens.split(",")]
    chosen = [op for op in ops.DEFS if not args.ops or op.name in args.ops.split(",")]
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    launch = launch_floor_us() if not args.ops or LAUNCH_FLOOR in args.ops.split(",") else {}
    rows = []
    for op in chosen:
        compare = kernel_providers(op) if args.compare else []
        compare = compare if len(compare) > 1 else []
        for tokens in token_counts:
            affine = getattr(torch, args.norm_affine_dtype) if args.norm_affine_dtype else None
            rows.append(bench_op(op, tokens, args.hidden, args.mlp_hidden, bandwidth, compare, args.provider, affine))
            forced = ", ".join(f"{p} {f.fused_us:.2f} {f.check}" for p, f in rows[-1].forced.items())
            line = " | ".join(rows[-1].cells()) + (f" | forced: {forced}" if forced else "")
            print(line, file=sys.stderr, flush=True)
    importable = {name: providers.available(name) for name in providers.PROVIDERS[:-1]}
    misses = criteria(rows)
    report = "\n".join(
        [
            f"## Fused ops, {DTYPE}, hidden {args.hidden}, gated activations [T, 2 x {args.mlp_hidden}]",
            "",
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e9:.0f} GB/s "
            f"(read + write), L2 {l2_bytes() / 2**20:.0f} MiB; importable: {importable}; override: {args.provider!r}.",
            "Per-call times: CUDA graph of back-to-back calls, median of "
            f"{REPLAYS} replays; floor = bytes moved / copy bandwidth.",
            "",
            table(rows),
            "",
            *(
                ["Each provider forced in turn (same inputs; `fastest`: of those that served the op "
                 "themselves and passed the check; `order now`: the op's kernel order):", "", side_by_side(rows), ""]
                if any(r.forced for r in rows)
                else []
            ),
            *launch_report(launch, rows),
            "Issue 3 bar (T=4096 within 1.3x of floor; T<=64 at least 3x faster than unfused): "
            + ("all met." if not misses else "missed by"),
            *misses,
            "",
        ]
    )
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0 if all(r.check == "ok" and all(f.check == "ok" for f in r.forced.values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
