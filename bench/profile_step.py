"""Decode step of the 8B-shaped engine Llama, fxrewrite full against Inductor + CUDA graphs, in
one process: steps back to back between two CUDA events, steps one at a time from an idle device
(bench_e2e's method: host time before the replay counts), and with ``--profile`` the kernels of
5 steps by ``torch.profiler`` (GPU only). ``--host`` splits the first row's idle-device step
into where its host time goes (:func:`host_breakdown`).

Rows: fxrewrite (``--mode`` full or piecewise) through ``Backend.compile`` (Python floats are
graph constants), the same graph through ``Backend.unguarded`` (no Dynamo frame evaluation),
the same with the attention op's torch path instead of its Triton kernels (piecewise only:
``engine_model.KERNELS`` switched between calls; the op runs eagerly), the same through
plain ``torch.compile`` (Dynamo lifts the 65 eps floats to tensors built every call), and
Inductor + CUDA graphs (``mode="reduce-overhead"``; ``--no-inductor`` skips it). ``--quant``
quantizes the model's linears as ``bench_e2e.py --quant`` does (``e2e_model.quantize``; the
fxrewrite rows get the same ``Config`` fields). ``--profile``
adds the kernels and the host-side CUDA calls of 5 steps of the first row and of the Inductor row, and their kernels per layer (:func:`kernels_per_layer`; ``--gemm-fusion``
adds and profiles a row with ``Config.gemm_fusion``: norms, residual adds and RoPE in the GEMMs, issue 30; with
``--floor``, its floor table too); ``--pyprofile`` the
Python functions of the unguarded row's host time (:func:`python_profile`).

    source .devkit/setup.sh && python3 bench/profile_step.py [--seqs 8] [--context 1024] [--mode full] [--profile] [--host] [--pyprofile] [--gemm-fusion [--fp8-norm-prologue]] [--floor 1,8,64] [--quant block-fp8]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_model  # noqa: E402
from e2e_model import QUANTS, make_plan, quantize  # noqa: E402
from engine_model import SPLITTING_OPS, build_model, fused_twin, llama_8b, make_batch, mark_static_metadata  # noqa: E402

import fxrewrite  # noqa: E402
from fxrewrite.runtime import providers  # noqa: E402


def measure(label: str, step: Any, batch: dict[str, torch.Tensor], profile: bool, reps: int = 50,
            layers: int = 32) -> tuple[float, float]:  # fmt: skip
    """(back-to-back ms per step, median ms of single steps from an idle device); ``profile``:
    the kernels of 5 steps, by time and per layer of the ``layers``."""
    with torch.no_grad():
        t = time.perf_counter()
        for _ in range(3):
            step(**batch)
        torch.cuda.synchronize()
        print(f"{label}: warm-up {time.perf_counter() - t:.1f} s", flush=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step(**batch)
        end.record()
        end.synchronize()
        b2b = start.elapsed_time(end) / reps
        single = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s.record()
            step(**batch)
            e.record()
            e.synchronize()
            single.append(s.elapsed_time(e))
        idle = statistics.median(single)
        print(f"{label}: {b2b:.3f} ms per step back to back, {idle:.3f} ms from an idle device", flush=True)
        if profile:
            acts = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(5):
                    step(**batch)
                torch.cuda.synchronize()
            table = prof.key_averages()
            print(table.table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))
            print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
            print(kernels_per_layer(prof.events(), steps=5, layers=layers))
    return b2b, idle


def kernels_per_layer(events: Any, steps: int, layers: int) -> str:
    """The device's work per step from profiler ``events``: every kernel launch, memcpy and
    memset (device-side events, CUDA-graph replays included), by name, with launches and time
    per step; the total over ``layers`` is the step's kernels per layer (the per-step work
    outside the layers, embedding and final norm, counted in)."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            launches, us = by_name.setdefault(e.name, [0, 0.0])
            by_name[e.name] = [launches + 1, us + e.time_range.elapsed_us()]
    total = sum(n for n, _ in by_name.values()) / steps
    lines = [f"\nkernels per step: {total:.0f} ({total / layers:.2f} per layer over {layers} layers), "
             f"{sum(us for _, us in by_name.values()) / steps / 1e3:.3f} ms of kernel time",
             "| kernel | launches per step | per layer | us per step |", "|---|---|---|---|"]  # fmt: skip
    for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name[:70]} | {n / steps:.0f} | {n / steps / layers:.2f} | {us / steps:.1f} |")
    return "\n".join(lines)


GEMM_KERNELS = ("linear", "gemm", "nvjet", "cutlass", "xmma", "sm90")  # kernel names of the step's GEMMs
ATTENTION_KERNELS = ("_partial_kernel", "_combine_kernel", "attention", "fmha", "flash_fwd", "flash_attn")


def kernel_classes(events: Any, steps: int) -> dict[str, float]:
    """Device microseconds per step from profiler ``events``, by class: the GEMMs, the
    attention, everything else (norms, rotary, activations, copies)."""
    out = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.lower()
            cls = ("gemm" if any(k in name for k in GEMM_KERNELS)
                   else "attention" if any(k in name for k in ATTENTION_KERNELS) else "other")  # fmt: skip
            out[cls] += e.time_range.elapsed_us() / steps
    return out


def design_chain(model: Any, batch: dict[str, torch.Tensor], attention: bool = True,
                 before_attention: Callable[[Any], None] | None = None) -> Callable[[], torch.Tensor]:  # fmt: skip
    """The step's GEMMs and attention alone, on the model's own weights and caches: per layer
    ``fxr.linear`` (qkv), the attention op (with its write of the step's keys and values),
    ``fxr.linear`` (o), ``fxr.linear_silu_and_mul`` (gate_up) and ``fxr.linear`` (down), the
    kernels and launches the compiled step runs, and nothing else: no norm, no rotary, no residual
    add. ``attention=False``: the GEMMs alone. The least step a design of one kernel per
    projection and one attention kernel per layer can reach (issue 30). ``before_attention``:
    called with each layer between its qkv GEMM and its attention (a probe's extra launch)."""
    fxr, bench = torch.ops.fxr, torch.ops.fxbench
    with torch.no_grad():
        x0 = model.embed_tokens(batch["input_ids"])
    args = (batch["slots"], batch["seq_lens"], batch["kv_range"])

    def chain() -> torch.Tensor:
        x = x0
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv = fxr.linear.default(x, a.qkv_proj.weight)
            q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            out = qkv[:, : a.q_size]
            if before_attention is not None:
                before_attention(layer)
            if attention:
                out = bench.attention.default(q.view(-1, a.num_heads, a.head_dim), k.view(-1, a.num_kv_heads, a.head_dim),
                                              v.view(-1, a.num_kv_heads, a.head_dim), a.k_cache, a.v_cache, *args)  # fmt: skip
            o = fxr.linear.default(out.reshape(-1, a.q_size), a.o_proj.weight)
            x = fxr.linear.default(fxr.linear_silu_and_mul.default(o, mlp.gate_up_proj.weight), mlp.down_proj.weight)
        return x

    return chain


def replay_b2b_ms(fn: Callable[[], Any], reps: int = 50) -> float:
    """``fn`` captured in one CUDA graph, replayed ``reps`` times back to back: ms per replay."""
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / reps


def floor_table(model: Any, cfg: Any, step: Any, seqs: list[int], context: int) -> str:
    """Issue 30's floor: at each decode size, the step back to back against the HBM floor
    (weights and KV cache at this device's copy bandwidth, bench_e2e's definition), its kernel
    time by class, the gaps between kernels, and the floor of this design: the step's GEMMs and
    attention replayed alone (:func:`design_chain`), back to back, with and without the
    attention. Under programmatic dependent launch a kernel's wait for the one before counts in
    its duration, so the class columns are upper bounds and the gaps go negative; the chains
    are timed whole and have no such overlap to undo."""
    from bench_e2e import Clock, hbm_floor_ms

    clock = Clock(torch.device("cuda"))
    bandwidth = clock.copy_bandwidth(torch.device("cuda"), 2 << 30)
    big = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    read = big.numel() * big.element_size() / (clock.median_ms(lambda: big.amax(), 20) / 1e3)  # a pure read
    del big
    elt = model.embed_tokens.weight.element_size()
    lines = [f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write of a 2 GiB copy); read bandwidth "
             f"{read / 1e9:.0f} GB/s (torch.amax of 2 GiB)", "",
             "| decode | HBM floor ms (weights + KV) | step b2b ms | / floor | GEMMs ms (/ weight floor, / at the read "
             "rate) | attention ms (/ KV floor) | other kernels ms | gaps ms | GEMMs alone b2b ms (/ weight floor) "
             "| GEMMs + attention alone b2b ms (/ floor) | step / GEMMs + attention alone |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for n in seqs:
        batch = mark_static_metadata(make_batch(cfg, "decode", n, context, num_seqs=n, max_len=4096, device="cuda"))
        floor = hbm_floor_ms(model, batch, bandwidth)
        kv = 1e3 * int(batch["seq_lens"].sum()) * 2 * cfg.num_kv_heads * cfg.head_dim * cfg.num_layers * elt / bandwidth
        b2b, _ = measure(f"decode {n}", step, batch, False)
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step(**batch)
            torch.cuda.synchronize()
        us = kernel_classes(prof.events(), 5)
        gemm, attn, other = us["gemm"] / 1e3, us["attention"] / 1e3, us["other"] / 1e3
        gemms = replay_b2b_ms(design_chain(model, batch, attention=False))
        chain = replay_b2b_ms(design_chain(model, batch))
        lines.append(f"| {n} | {floor:.3f} ({floor - kv:.3f} + {kv:.3f}) | {b2b:.3f} | {b2b / floor:.3f} | "
                     f"{gemm:.3f} ({gemm / (floor - kv):.2f}, {gemm / ((floor - kv) * bandwidth / read):.2f}) | {attn:.3f} ({attn / kv:.2f}) | {other:.3f} | "
                     f"{b2b - gemm - attn - other:.3f} | {gemms:.3f} ({gemms / (floor - kv):.3f}) | {chain:.3f} ({chain / floor:.3f}) "
                     f"| {b2b / chain:.3f} |")  # fmt: skip
    return "\n".join(lines)


@contextlib.contextmanager
def _marks(runner_cls: type, into: dict[str, list[float]]) -> Iterator[None]:
    """Record host times (perf_counter) at the runner's entry and around every graph replay, and
    a CUDA event just before each replay, into ``into`` (the last call's values are at [-1])."""
    call, replay = runner_cls.__call__, torch.cuda.CUDAGraph.replay

    def on_call(self: Any, *args: Any) -> Any:
        into["runner"].append(time.perf_counter())
        return call(self, *args)

    def on_replay(self: torch.cuda.CUDAGraph) -> None:
        into["replay"].append(time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        into["replay_event"].append(event)
        replay(self)
        into["replayed"].append(time.perf_counter())

    runner_cls.__call__, torch.cuda.CUDAGraph.replay = on_call, on_replay
    try:
        yield
    finally:
        runner_cls.__call__, torch.cuda.CUDAGraph.replay = call, replay


def host_breakdown(step: Callable[..., Any], batch: dict[str, torch.Tensor], reps: int = 100) -> dict[str, float]:
    """Where an idle-device step's time goes, medians over ``reps`` single steps (microseconds):
    ``dynamo`` (the call until the Runner starts: guards, Dynamo's frame, argument gathering),
    ``runner`` (Runner start to the first replay: dispatch, checks, input copies),
    ``launch`` (host time of the replay calls), ``after`` (last replay to the step's return:
    output copies), ``gpu_wait`` (the CUDA event at the step's start to the one before the first
    replay: how long the device waited for it), ``graph`` (that event to the step's end: the
    replayed work), ``step`` (the whole step, as bench_e2e times it)."""
    from fxrewrite.runtime.cudagraph import Runner

    rows: dict[str, list[float]] = {k: [] for k in ("dynamo", "runner", "launch", "after", "gpu_wait", "graph", "step")}
    marks: dict[str, list[Any]] = {k: [] for k in ("runner", "replay", "replay_event", "replayed")}
    with torch.no_grad(), _marks(Runner, marks):
        for _ in range(reps + 3):
            for v in marks.values():
                v.clear()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            step(**batch)
            end.record()
            t1 = time.perf_counter()
            end.synchronize()
            if not marks["replay"]:
                raise RuntimeError("no CUDA graph replayed: the step ran eagerly")
            rows["dynamo"].append(marks["runner"][0] - t0)
            rows["runner"].append(marks["replay"][0] - marks["runner"][0])
            rows["launch"].append(sum(b - a for a, b in zip(marks["replay"], marks["replayed"])))
            rows["after"].append(t1 - marks["replayed"][-1])
            rows["gpu_wait"].append(start.elapsed_time(marks["replay_event"][0]) / 1e3)
            rows["graph"].append(marks["replay_event"][0].elapsed_time(end) / 1e3)
            rows["step"].append(start.elapsed_time(end) / 1e3)
    return {k: 1e6 * statistics.median(v[3:]) for k, v in rows.items()}


def python_profile(step: Callable[..., Any], batch: dict[str, torch.Tensor], reps: int = 200) -> None:
    """Where the host's time of a step goes, by Python function: ``cProfile`` over ``reps`` steps,
    each from an idle device (synchronized before, as bench_e2e times them); the 25 functions
    with the most time of their own. Profiling slows every Python call, C calls less: read the
    shares, not the absolute times."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    with torch.no_grad():
        for _ in range(reps):
            torch.cuda.synchronize()
            prof.enable()
            step(**batch)
            prof.disable()
    torch.cuda.synchronize()
    print(f"\ncProfile of {reps} unguarded steps (host only, device idle before each):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--host", action="store_true", help="split the first row's idle-device step by stage (host_breakdown)")
    p.add_argument("--pyprofile", action="store_true", help="cProfile the unguarded step (python_profile)")
    p.add_argument("--mode", choices=("full", "piecewise"), default="full")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--no-lifted", action="store_true", help="skip the plain torch.compile row")
    p.add_argument("--twin", action="store_true", help="add the hand-fused twin's row (same mode, no rules)")
    p.add_argument("--gemm-fusion", action="store_true",
                   help="add a row with Config.gemm_fusion (norms, residual adds and RoPE in the GEMMs: issue 30), "
                        "profiled too with --profile")
    p.add_argument("--fp8-norm-prologue", action="store_true",
                   help="the --gemm-fusion row with Config.fp8_norm_prologue (static FP8: the norms' quantization in "
                        "the reading GEMMs)")
    p.add_argument("--floor", default=None, help="comma-separated decode sizes: the first row's floor table at each "
                   "(floor_table; capture sizes default to these)")
    p.add_argument("--capture-sizes", default=None, help="comma-separated (default: --seqs); bench_e2e uses 1,8,64,512")
    p.add_argument("--quant", choices=tuple(QUANTS), default="none", help="the linears quantized as bench_e2e.py --quant")
    args = p.parse_args()
    providers.preload()
    cfg = llama_8b()
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16)
    model.allocate_kv_cache(64, 4096)
    plan = make_plan(argparse.Namespace(shape="8b", layers=None, context=args.context, prefill_seqs=1, device="cuda",
                                        dtype="bf16", quant=args.quant))  # fmt: skip
    quantize(model, plan)
    model.fill_kv_cache_random(0)
    batch = mark_static_metadata(
        make_batch(cfg, "decode", args.seqs, args.context, num_seqs=args.seqs, max_len=4096, device="cuda")
    )
    rows = {}

    floor_seqs = [int(n) for n in args.floor.split(",")] if args.floor else []
    sizes = tuple(int(s) for s in (args.capture_sizes or args.floor or str(args.seqs)).split(","))

    def fx(rules: list[Any] | None = None, gemm_fusion: bool = False) -> fxrewrite.Backend:
        return fxrewrite.Backend(mode=args.mode, splitting_ops=SPLITTING_OPS, capture_sizes=sizes, progress=False,
                                 rules=rules, gemm_fusion=gemm_fusion, fp8_norm_prologue=args.fp8_norm_prologue,
                                 **plan.fx_options)  # fmt: skip

    label = f"fxrewrite {args.mode}"
    torch._dynamo.reset()
    backend = fx()
    step = backend.compile(model)
    rows[f"{label} (Backend.compile)"] = measure(label, step, batch, args.profile, layers=cfg.num_layers)
    print(f"{label}: fused {backend.report.fused_ops()}")
    if floor_seqs:
        print(f"\n{label}: the floor of the step (issue 30)\n" + floor_table(model, cfg, step, floor_seqs, args.context))
    with torch.no_grad():
        fast = backend.unguarded(step, **batch)
    rows[f"{label}, Backend.unguarded"] = measure(f"{label}, unguarded", fast, batch, False)
    if args.host:
        host = {"as compiled": host_breakdown(step, batch)}
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            host["`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`"] = host_breakdown(step, batch)
        host["`Backend.unguarded`"] = host_breakdown(fast, batch)
        print(f"\n{label}, decode {args.seqs}: one step from an idle device, us (median)")
        print("| | " + " | ".join(host["as compiled"]) + " |\n|---|" + "---|" * len(host["as compiled"]))
        for name, row in host.items():
            print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in row.values()) + " |")
    if args.pyprofile:
        python_profile(fast, batch)
    if args.mode == "piecewise":  # attention runs eagerly between the replays: its path is chosen per call
        engine_model.KERNELS = "torch"
        rows[f"{label}, attention op's torch path"] = measure(f"{label}, torch attention", step, batch, False)
        engine_model.KERNELS = "triton"
    if not args.no_lifted:
        torch._dynamo.reset()
        lifted = torch.compile(model, backend=fx(), fullgraph=True, dynamic=True)
        rows[f"{label} (torch.compile, floats lifted)"] = measure(f"{label}, floats lifted", lifted, batch, False)
    if args.gemm_fusion:
        torch._dynamo.reset()
        fused = fx(gemm_fusion=True)
        fused_step = fused.compile(model)
        rows[f"{label}, norms, adds and RoPE in the GEMMs"] = measure(f"{label}, gemm_fusion", fused_step, batch,
                                                                   args.profile, layers=cfg.num_layers)  # fmt: skip
        print(f"{label}, gemm_fusion: fused {fused.report.fused_ops()}")
        if floor_seqs:
            print(f"\n{label}, gemm_fusion: the floor of the step (issue 30)\n"
                  + floor_table(model, cfg, fused_step, floor_seqs, args.context))
    if args.twin:
        torch._dynamo.reset()
        twin = fused_twin(model)
        rows[f"hand-fused {args.mode}"] = measure(f"hand-fused {args.mode}", fx([]).compile(twin), batch, False)
        del twin
    if not args.no_inductor:
        torch._dynamo.reset()
        inductor = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        rows["inductor + CUDA graphs"] = measure("inductor + CUDA graphs", inductor, batch, args.profile,
                                                 layers=cfg.num_layers)  # fmt: skip
    quant = "" if args.quant == "none" else f", linears {args.quant}"
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, decode {args.seqs} after {args.context}{quant}")
    print("| system | back to back ms | idle-device ms |\n|---|---|---|")
    for name, (b2b, idle) in rows.items():
        print(f"| {name} | {b2b:.3f} | {idle:.3f} |")


if __name__ == "__main__":
    main()
