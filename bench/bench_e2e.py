"""End-to-end step latency of the serving-engine Llama under every system: one run, one table.

On the GPU machine (the devkit serves the fused ops with sgl-kernel), then a CPU smoke test:

    source .devkit/setup.sh && python bench/bench_e2e.py --shape 8b --out bench/e2e.md
    python bench/bench_e2e.py --shape tiny --device cpu --out /tmp/e2e.md

Rows, in the order they run (what the goals compare first; each row's build is in
``bench/e2e_systems.py``, with the rows of one switch on or off that only ``--paired`` names):
    eager                   the model as written
    fxrewrite piecewise     ``fxrewrite.Backend()`` (default rules), mode "piecewise"
    hand-fused piecewise    the hand-fused twin under ``Backend(rules=[])``, piecewise: the ceiling
    fxrewrite full          default rules, mode "full" (one CUDA graph per step, attention inside)
    fxrewrite full, cache warm  the same in a second process that finds the compile cache (and the
                            Triton cache beside it) as "fxrewrite full" left them: a restart
    hand-fused full         the twin under ``Backend(rules=[])``, full: the ceiling where no host time hides
    fxrewrite full, unguarded  the same through ``Backend.unguarded`` after each shape's first
                            call: no Dynamo frame evaluation or guards per step
    inductor + CUDA graphs  ``torch.compile(model, mode="reduce-overhead")``
    full, no rewrites       ``Backend(rules=[])``, full: Dynamo, the runner and capture, no rewrites
    piecewise, no rewrites  ``Backend(rules=[])``, piecewise: a serving engine's eager compiler today
    inductor                ``torch.compile(model)``
    Dynamo alone            ``torch.compile(model, backend="eager")``: Dynamo's tracing and nothing
                            behind it, the least first call any Dynamo backend can have
    hand-fused eager        the twin as written
    attention op alone      the step's attention calls by themselves (eager): no row changes them
    HBM floor               (weight bytes + KV-cache bytes the step reads) / copy bandwidth
                            (device-to-device copy, read + write, measured in this run)

Columns: decode (one new token per sequence after ``--context`` cached tokens) at batch 1, 8,
64; prefill of 512 and 4096 tokens (``--prefill-seqs`` sequences); "first call" (seconds of the
system's first call: Dynamo, the backend, what it captures then); "start-up" (seconds all
warm-up calls took above the steady step time: first call, recompiles, CUDA-graph captures and
recordings); the largest ``max|y - ref| / max|ref|`` against a float32 eager reference on fresh
inputs. A step time is the median of many calls, each timed with CUDA events from an idle GPU
(launch overhead counts), after warm-up calls. Decode is also timed back to back (a second
table): calls issued one after another, so a call's host time hides behind the device work of
the one before, as in a serving engine's steady decode.

``--paired KEY,KEY,...`` adds one more process, run first, that builds those systems side by side (same
weights, same KV cache) and times them in alternating rounds, column by column: the goals that
compare two systems within a few percent are read from that table, since a system's step time
moves by a few percent from one process to the next.

``--quant fp8``, ``block-fp8`` or ``nvfp4``: every row runs the engine model with quantized
linears (``bench/e2e_model.py``: static per-tensor FP8 with calibrated input scales,
``torch._scaled_mm``; block FP8, ``fxr.linear_block_fp8``; NVFP4 with a dequantizing reference
GEMM, for its fusions and numerics: on Hopper its times are not NVFP4's). fxrewrite's rows are given the attention + FP8 declaration
(``engine_fp8.ATTENTION_QUANT``) and their notes list the quantization fusions per layer; there is no
hand-fused twin; the error column compares with the same quantized model in float32 (its FP8
values as stored), so the format's own error is not in it.

Each system runs in a fresh process (a crash or a sticky CUDA error costs its row only),
compiles cold (``force_disable_caches``, an empty Triton cache and an empty fxrewrite compile
cache of its own; the side-by-side process with fxrewrite's cache off) except the "cache warm"
row, which starts with the caches of the row it restarts (that row must be chosen too), and
reports failures as notes. The table is rewritten to ``--out`` after every system; nothing starts after
``--budget-s``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_model import (  # noqa: E402
    CHECK_SEED,
    FILL_SEED,
    QUANTS,
    Batch,
    Plan,
    Scenario,
    _short,
    log,
    make_plan,
    prepare,
    weight_bytes,
)
from e2e_systems import SYSTEM_BY_KEY, SYSTEMS, System, Unguarded  # noqa: E402
from engine_model import EngineLlama, float32_reference  # noqa: E402

MAX_REPS = 200
GRACE_S = 90.0  # a system still running this long past --budget-s is killed


@dataclasses.dataclass
class Paired:
    """What the side-by-side process measured: per column, per system, one median per round."""

    ms: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)
    first_call_s: dict[str, float] = dataclasses.field(default_factory=dict)  # per system: its first call
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Result:
    """What one system measured."""

    cells: dict[str, str] = dataclasses.field(default_factory=dict)
    ms: dict[str, float] = dataclasses.field(default_factory=dict)
    b2b: dict[str, float] = dataclasses.field(default_factory=dict)  # decode, back to back
    first_call_s: float | None = None
    startup_s: float = 0.0
    max_err: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------- timing


class Clock:
    """Wall time of single calls, and step latency: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def wall(self, fn: Callable[[], Any]) -> float:
        """Seconds of one call, from an idle device to its end."""
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def median_ms(self, fn: Callable[[], Any], reps: int, before: Callable[[], Any] | None = None) -> float:
        """Median milliseconds of ``reps`` calls, each started on an idle device (``before``
        each, untimed: bench_tp's barrier, so that every rank starts its step together)."""
        walls, events = [], []
        for _ in range(reps):
            if before is not None:
                before()
            if not self.cuda:
                walls.append(1e3 * self.wall(fn))
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            events.append((start, end))
        if not self.cuda:
            return statistics.median(walls)
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)

    def back_to_back_ms(self, fn: Callable[[], Any], reps: int) -> float:
        """Milliseconds per call of ``reps`` calls issued one after another (host time hides
        behind the device work of the call before, as in an engine's steady decode)."""
        self.sync()
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            return 1e3 * (time.perf_counter() - start) / reps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    def copy_bandwidth(self, device: torch.device, nbytes: int) -> float:
        """Bytes per second of a large device-to-device copy, counting read + write."""
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        ms = self.median_ms(lambda: dst.copy_(src), 20)
        return 2 * nbytes / (ms / 1e3)


def attention_ms(model: EngineLlama, batch: Batch, clock: Clock, reps: int = 20) -> float:
    """Milliseconds of the step's attention ops alone (one call per layer, eager, random q/k/v on
    layer 0's cache): the part of every row that no compiler here changes."""
    cfg, cache = model.config, model.layers[0].self_attn
    tokens, like = batch["input_ids"].numel(), model.embed_tokens.weight
    q = torch.randn(tokens, cfg.num_heads, cfg.head_dim, dtype=like.dtype, device=like.device)
    k, v = (torch.randn(tokens, cfg.num_kv_heads, cfg.head_dim, dtype=like.dtype, device=like.device) for _ in range(2))
    meta = (batch["slots"], batch["seq_lens"], batch["kv_range"], batch.get("query_start"))

    def run() -> None:
        for _ in range(cfg.num_layers):
            torch.ops.fxbench.attention.default(q, k, v, cache.k_cache, cache.v_cache, *meta)

    run()
    return clock.median_ms(run, reps)


def hbm_floor_ms(model: EngineLlama, batch: Batch, bandwidth: float) -> float:
    """Milliseconds to read the step's bytes once: all weights (the embedding's used rows only;
    each at its own element size, ``weight_bytes``) and every cached key and value the step
    attends to."""
    cfg = model.config
    elt = model.embed_tokens.weight.element_size()
    tokens = batch["input_ids"].numel()
    kv = int(batch["seq_lens"].sum()) * 2 * cfg.num_kv_heads * cfg.head_dim * cfg.num_layers
    return 1e3 * (weight_bytes(model) + (tokens * cfg.hidden_size + kv) * elt) / bandwidth


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|`` (NaN or inf in ``out`` gives inf)."""
    diff = (out.float() - ref).abs().max()
    return float("inf") if not torch.isfinite(diff) else float(diff / ref.abs().max())


PAIRED = "paired"  # the child that runs the --paired systems side by side


RUNTIME_KEYS = ("reason", "capture_s", "graphs", "replays", "eager_calls", "eager_reasons",
                "static_input_copies_last", "activation_copies_last")


def _backend_notes(backend: Any, layers: int) -> list[str]:
    """What the fxrewrite report says, in short: fused ops and the CUDA-graph runtime per graph,
    and the quantization fusions per layer (``layers``: the model's). The whole report goes to stderr."""
    if backend is None:
        return []
    with contextlib.suppress(Exception):
        backend.refresh_runtime()
    report = getattr(backend, "report", None)
    with contextlib.suppress(Exception):
        log(report.table())
    notes = []
    for i, g in enumerate(getattr(report, "graphs", [])):
        fused = ", ".join(f"{k} x{v}" for k, v in sorted(getattr(g, "fused_ops", {}).items())) or "none"
        serves = f" (serves {g.serves})" if getattr(g, "serves", "") else ""
        line = f"graph {i}{serves}: {getattr(g, 'nodes_before', '?')} -> {getattr(g, 'nodes_after', '?')} nodes, fused: {fused}"
        for v in getattr(g, "variants", ()):  # the second rewrite, for the other token counts
            line += f"; rewritten for {v.serves}: " + (", ".join(f"{k} x{n}" for k, n in sorted(v.fused_ops.items())) or "none")
        runtime = getattr(g, "runtime", None) or {}
        kept = [f"{k}={runtime[k]:.2f}" if isinstance(runtime[k], float) else f"{k}={runtime[k]}" for k in RUNTIME_KEYS if runtime.get(k)]
        notes.append(line + ("; " + ", ".join(kept) if kept else ""))
    return notes + _quant_notes(report, layers)


def _per_layer(counts: collections.Counter[int | None], layers: int) -> str:
    """``x1 layer 0, x2 layers 1-31``: a count per decoder layer, equal neighbours joined
    (sites outside the layers, e.g. the final norm, as ``outside``)."""
    runs: list[list[int]] = []  # [first, last, count]
    for i in range(layers):
        if runs and runs[-1][2] == counts[i]:
            runs[-1][1] = i
        else:
            runs.append([i, i, counts[i]])
    text = [f"x{n} layer{f' {a}' if a == b else f's {a}-{b}'}" for a, b, n in runs]
    return ", ".join(text + ([f"x{counts[None]} outside"] if counts[None] else []))


def _quant_notes(report: Any, layers: int) -> list[str]:
    """The report's quantization fusions (rules named ``*quant*``: norm + quant, activation +
    quant, attention + quant, the quantizer alone) per decoder layer, and the attention + quant
    near misses with the first reason (why the attention does not take the quantization after
    it); one line per distinct graph report (``graphs 0,1,2``: the same in each)."""
    by_text: dict[str, list[int]] = {}
    for i, g in enumerate(getattr(report, "graphs", [])):
        per_rule: dict[str, collections.Counter[int | None]] = collections.defaultdict(collections.Counter)
        for site in g.sites:
            if "quant" in site.rule:
                found = re.match(r"layers\.(\d+)(\.|$)", site.module)
                per_rule[site.rule][int(found.group(1)) if found else None] += 1
        parts = [f"{rule} {_per_layer(c, layers)}" for rule, c in sorted(per_rule.items())]
        misses = collections.Counter(m.rule for m in g.near_misses if m.rule.startswith("attention_quant"))
        parts += [f"near miss {rule} x{n} ({next(m.reason for m in g.near_misses if m.rule == rule)})"
                  for rule, n in sorted(misses.items())]  # fmt: skip
        if parts:
            by_text.setdefault("; ".join(parts), []).append(i)
    return [f"graph{'s' if len(ids) > 1 else ''} {','.join(map(str, ids))}: quant fusions per layer: {text}"
            for text, ids in by_text.items()]  # fmt: skip


def run_system(system: System, cols: list[Scenario], ctx: RunContext, save: Callable[[Result], None]) -> Result:
    """Warm up, time, and check one system on every column it runs; failures become notes.
    ``save`` gets the result after every column (a child killed later keeps what it measured)."""
    res = Result()
    counters = torch._dynamo.utils.counters
    counters.clear()
    torch._dynamo.reset()
    try:
        step, backend = system.build(ctx.model, ctx.twin, ctx.capture, ctx.fx_options)
    except Exception as e:  # noqa: BLE001  (a row that cannot be built says why, the run goes on)
        res.notes.append(f"not built: {_short(e)}")
        res.cells = {c.name: "failed" for c in cols}
        save(res)  # the parent reads the row from what was saved
        return res
    errors = []
    for col in cols:
        if col.kind not in system.kinds:
            res.cells[col.name] = "n/a"
            continue
        if time.time() > ctx.args.deadline:
            res.cells[col.name] = "skipped"
            res.notes.append(f"{col.name}: skipped, past --budget-s")
            save(res)
            continue
        batch = ctx.batches[col.name]
        try:
            warm = [ctx.clock.wall(lambda: step(**batch)) for _ in range(ctx.args.warmup)]
            if res.first_call_s is None:
                res.first_call_s = warm[0]
            reps = max(ctx.args.min_reps, min(MAX_REPS, int(ctx.args.target_s / max(warm[-1], 1e-5))))
            ms = ctx.clock.median_ms(lambda: step(**batch), reps)
            res.startup_s += max(0.0, sum(warm) - len(warm) * ms / 1e3)
            if col.kind == "decode":
                res.b2b[col.name] = ctx.clock.back_to_back_ms(lambda: step(**batch), reps)
            ctx.model.fill_kv_cache_random(FILL_SEED)  # undo what captures wrote with dummy inputs
            errors.append(rel_err(step(**ctx.checks[col.name]), ctx.refs[col.name]))
            res.ms[col.name] = ms
            res.cells[col.name] = f"{ms:.2f}"
            log(f"  {system.label:24s} {col.name:13s} {ms:9.3f} ms  ({reps} runs)  rel err {errors[-1]:.1e}")
        except Exception as e:  # noqa: BLE001
            res.cells[col.name] = "failed"
            res.notes.append(f"{col.name}: {_short(e)}")
            log(traceback.format_exc(limit=-6))
            _free_memory()
        res.max_err = max(errors) if errors else None
        save(res)
    graphs = counters["stats"].get("unique_graphs", 0)
    if graphs:
        res.notes.append(f"Dynamo graphs: {graphs}")
    if counters["inductor"].get("cudagraph_skips"):
        skips = counters["inductor"]["cudagraph_skips"]
        res.notes.append(f"Inductor skipped CUDA graphs {skips} time(s) (TORCH_LOGS=perf_hints says why)")
    res.notes += _backend_notes(backend, ctx.model.config.num_layers)
    with contextlib.suppress(Exception):
        res.notes += backend.report.cache_lines()  # "cache hit: N graphs, saved X s"
    if isinstance(step, Unguarded):
        res.notes.append(f"unguarded: {len(step.graphs)} step shapes called without Dynamo after their first call")
    save(res)
    del step, backend
    torch._dynamo.reset()
    _free_memory()
    return res


def run_paired(keys: list[str], cols: list[Scenario], ctx: RunContext, save: Callable[[Paired], None]) -> Paired:
    """Build every system of ``keys`` in this process, then per column: warm each up, and time
    them in ``--rounds`` rounds, each round every system once (``median_ms``, the table's
    measure), the order rotated from round to round. A system that fails on a column is
    left out of that column with a note."""
    res, steps = Paired(), {}
    torch._dynamo.reset()
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, 64)  # several systems compile the same forward
    for key in keys:
        system = SYSTEM_BY_KEY[key]
        try:
            steps[key] = system.build(ctx.model, ctx.twin, ctx.capture, ctx.fx_options)[0]
        except Exception as e:  # noqa: BLE001
            res.notes.append(f"{system.label}: not built: {_short(e)}")
    for col in cols:
        if time.time() > ctx.args.deadline:
            res.notes.append(f"{col.name}: skipped, past --budget-s")
            continue
        batch, live, warm = ctx.batches[col.name], {}, 0.0
        for key, step in steps.items():
            if col.kind not in SYSTEM_BY_KEY[key].kinds:
                continue
            try:
                for _ in range(ctx.args.warmup):
                    warm = ctx.clock.wall(lambda: step(**batch))
                    res.first_call_s.setdefault(key, warm)
                live[key] = step
            except Exception as e:  # noqa: BLE001
                res.notes.append(f"{SYSTEM_BY_KEY[key].label}, {col.name}: {_short(e)}")
                _free_memory()
        reps = max(ctx.args.min_reps, min(MAX_REPS, int(ctx.args.target_s / max(warm, 1e-5))))
        times: dict[str, list[float]] = {key: [] for key in live}
        for r in range(ctx.args.rounds):
            order = list(live)[r % max(len(live), 1):] + list(live)[: r % max(len(live), 1)]
            for key in order:
                times[key].append(ctx.clock.median_ms(lambda: live[key](**batch), reps))
        log(f"  paired {col.name}: " + ", ".join(f"{k} {statistics.median(v):.3f} ms" for k, v in times.items()))
        res.ms[col.name] = times
        ctx.model.fill_kv_cache_random(FILL_SEED)
        save(res)
    return res


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass
class RunContext:
    """Everything the systems share: the model, its inputs, the references, the clock."""

    args: argparse.Namespace
    clock: Clock
    model: EngineLlama
    twin: EngineLlama | str
    capture: dict[str, tuple[int, ...]]
    batches: dict[str, Batch]
    checks: dict[str, Batch]
    refs: dict[str, torch.Tensor]
    fx_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # Plan.fx_options


def _warm_process(device: torch.device, inductor: bool) -> None:
    """Pay the process's one-time costs (Dynamo and Inductor imports, compile workers, the kernel
    libraries' imports: sgl-kernel and flashinfer take about 3.5 s each on the H100 machine, which
    an engine pays at start-up whatever it compiles with) before any measured first call."""
    from fxrewrite.runtime import providers

    if device.type == "cuda":
        providers.preload()
    x = torch.randn(64, device=device)
    torch.compile(lambda t: torch.sin(t) + 1, backend="eager")(x)
    if inductor:
        torch.compile(lambda t: torch.sin(t) + 2)(x)
    torch._dynamo.reset()


def _warm_attention(model: EngineLlama, batches: dict[str, Batch], fp8_output: bool = False) -> None:
    """Run the attention op once per step shape (random q, k, v on layer 0's cache, at the slots
    every timed step rewrites), so that its kernels (the Triton decode kernel's JIT compile) are
    built before any measured first call: the same for every row, as an engine builds its
    attention kernels at start-up. ``fp8_output``: its FP8-output twin too (``--quant fp8``)."""
    cfg, cache = model.config, model.layers[0].self_attn
    like = model.embed_tokens.weight
    with torch.no_grad():
        for batch in batches.values():
            tokens = batch["input_ids"].numel()
            q = torch.randn(tokens, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim, dtype=like.dtype,
                            device=like.device)  # fmt: skip
            k, v = q[:, cfg.num_heads : cfg.num_heads + cfg.num_kv_heads], q[:, cfg.num_heads + cfg.num_kv_heads :]
            meta = (batch["slots"], batch["seq_lens"], batch["kv_range"], batch.get("query_start"))
            torch.ops.fxbench.attention.default(q[:, : cfg.num_heads], k, v, cache.k_cache, cache.v_cache, *meta)
            if fp8_output:
                scale = torch.ones((), dtype=torch.float32, device=like.device)
                torch.ops.fxbench.attention_quant_fp8.default(q[:, : cfg.num_heads], k, v, cache.k_cache, cache.v_cache,
                                                              *meta[:3], scale, meta[3])  # fmt: skip
    model.fill_kv_cache_random(FILL_SEED)


def child_main(args: argparse.Namespace, plan: Plan) -> int:
    """Run one system (``--child KEY``) and leave its Result in ``<workdir>/KEY.json``."""
    model, twin, batches, checks = prepare(plan)
    refs = {k: v.to(plan.device) for k, v in torch.load(Path(args.workdir) / "refs.pt").items()}
    out = Path(args.workdir) / f"{args.child}.json"
    paired = args.child == PAIRED
    keys = args.paired.split(",") if paired else [args.child]
    _warm_process(plan.device, any(SYSTEM_BY_KEY[k].inductor for k in keys))
    _warm_attention(model, batches, fp8_output=plan.quant == "fp8")
    ctx = RunContext(args, Clock(plan.device), model, twin, plan.capture, batches, checks, refs, plan.fx_options)
    save = lambda r: out.write_text(json.dumps(dataclasses.asdict(r)))  # noqa: E731
    if paired:
        run_paired(keys, plan.cols, ctx, save)
    else:
        run_system(SYSTEM_BY_KEY[args.child], plan.cols, ctx, save)
    return 0


def child_argv(key: str, argv: list[str], args: argparse.Namespace) -> list[str]:
    """The command line of ``key``'s process (a system, or ``PAIRED``): the parent's, and which child."""
    return [*argv, "--child", key, "--workdir", args.workdir, "--deadline", str(args.deadline)]


def child_env(key: str, args: argparse.Namespace) -> dict[str, str]:
    """What ``key``'s process finds in its environment besides the parent's."""
    # its own empty Triton cache: the kernels a system builds (Inductor's, fxr.linear's) are
    # built in its first call, as on a machine's first start (the attention op's are built
    # before it, for every row alike)
    # and an empty fxrewrite compile cache, except a restart, which starts with its row's caches;
    # the side-by-side process has fxrewrite's cache off (its systems would load each other's graphs)
    system = SYSTEM_BY_KEY.get(key)
    source = system.warm_from if system is not None and system.warm_from else key
    return {"TRITON_CACHE_DIR": str(Path(args.workdir) / f"triton-{source}"),
            "FXREWRITE_CACHE_DIR": str(Path(args.workdir) / f"fxcache-{source}"),
            "FXREWRITE_CACHE": "0" if key == PAIRED else "1"}


def run_child(key: str, argv: list[str], args: argparse.Namespace) -> tuple[dict[str, Any], str | None]:
    """One system (or the paired systems) in a fresh process: a crash, a hung capture or a
    sticky CUDA error costs that row only. Its stderr streams through; past the deadline (plus
    a grace) it is killed. Returns what it saved (a Result or Paired as a dict), and why it
    failed (None if it did not)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *child_argv(key, argv, args)]
    env = {**os.environ, **child_env(key, args)}
    # its own process group, so that a kill also ends the compile workers it started
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    timer = threading.Timer(max(1.0, args.deadline + GRACE_S - time.time()), os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    tail: collections.deque[str] = collections.deque(maxlen=5)
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        if line.strip():
            tail.append(line.strip())
    rc = proc.wait()
    killed = not timer.is_alive() and rc != 0
    timer.cancel()
    path = Path(args.workdir) / f"{key}.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    if rc == 0:
        return saved, None
    why = "killed past --budget-s" if killed else f"exited with {rc}"
    last = tail[-1].replace("|", "/")[:300] if tail else "none"
    return saved, f"process {why}; its last line: {last}"


def run_system_child(key: str, argv: list[str], args: argparse.Namespace, cols: list[Scenario]) -> Result:
    saved, failed = run_child(key, argv, args)
    res = Result(**saved)
    if failed:
        res.notes.append(failed)
        res.cells = {c.name: res.cells.get(c.name, "killed" if "killed" in failed else "failed") for c in cols}
    return res


def _ratio_line(what: str, value: float | None, goal: float) -> str:
    if value is None:
        return f"- {what}: not measured"
    verdict = "met" if value <= goal else f"missed by {100 * (value / goal - 1):.1f}%"
    return f"- {what}: {value:.3f} (goal <= {goal:g}): {verdict}"


def _ratios(paired: Paired, col: str, a: str, b: str) -> list[float]:
    """Per-round ratios a / b of the side-by-side table (empty where either is missing)."""
    times = paired.ms.get(col, {})
    return [x / y for x, y in zip(times.get(a, []), times.get(b, []))]


def goal_lines(results: dict[str, Result], floor: dict[str, float], cols: list[Scenario], paired: Paired) -> list[str]:
    """The issue's goals, checked on this run: decode 8 against the floor (from an idle device and
    back to back) and the hand-fused ceiling, fxrewrite against Inductor + CUDA graphs per column,
    first calls against Inductor's and against the same mode with no rewrites (cold, and the
    restart with the compile cache warm). Where the side-by-side table has both systems of a
    comparison, its median ratio is the verdict; the ratio across processes stays beside it.
    The floor counts fxrewrite's unguarded row too (an API of the library); the comparisons with
    Inductor use the rows that pay Dynamo's frame evaluation as Inductor does."""
    fx, full, full_ug, fused, fused_full, icg = (results.get(k, Result()) for k in (
        "fxrewrite", "fxrewrite-full", "fxrewrite-full-ug", "fused-piecewise", "fused-full", "inductor-cg"))

    def best(name: str, field: str = "ms", rows: tuple[Result, ...] = (fx, full)) -> float | None:
        return min((getattr(r, field)[name] for r in rows if name in getattr(r, field)), default=None)

    def over(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def compared(what: str, across: float | None, pairs: list[tuple[str, str]], col: str, goal: float) -> list[str]:
        """The side-by-side verdict where measured (the first pair found), else the cross-process one."""
        for a, b in pairs:
            if ratios := _ratios(paired, col, a, b):
                spread = f"rounds {min(ratios):.3f}-{max(ratios):.3f}"
                label = f"{what}, one process ({SYSTEM_BY_KEY[a].label} / {SYSTEM_BY_KEY[b].label}, {spread})"
                extra = f" [across processes: {across:.3f}]" if across is not None else ""
                return [_ratio_line(label, statistics.median(ratios), goal) + extra]
        return [_ratio_line(f"{what}, across processes", across, goal)]

    every = (fx, full, full_ug)
    lines = [
        _ratio_line("decode 8, best fxrewrite / HBM floor", over(best("decode 8", rows=every), floor.get("decode 8")), 1.15),
        _ratio_line("decode 8 back to back, best fxrewrite / HBM floor",
                    over(best("decode 8", "b2b", every), floor.get("decode 8")), 1.10),
        _ratio_line("decode 8, fxrewrite piecewise / hand-fused piecewise, across processes",
                    over(fx.ms.get("decode 8"), fused.ms.get("decode 8")), 1.02),
    ]
    lines += compared("decode 8, fxrewrite full / hand-fused full", over(full.ms.get("decode 8"), fused_full.ms.get("decode 8")),
                      [("fxrewrite-full", "fused-full")], "decode 8", 1.02)
    for c in cols:
        lines += compared(f"{c.name}, best fxrewrite / inductor + CUDA graphs", over(best(c.name), icg.ms.get(c.name)),
                          [("fxrewrite-full", "inductor-cg"), ("fxrewrite", "inductor-cg")], c.name, 1.0)
    firsts = {**paired.first_call_s, **{k: r.first_call_s for k, r in results.items() if r.first_call_s}}
    inductor_first = min((v for k, v in firsts.items() if SYSTEM_BY_KEY[k].inductor), default=None)
    lines.append(_ratio_line("first call, fxrewrite piecewise / fastest inductor", over(fx.first_call_s, inductor_first), 0.15))
    lines.append(_ratio_line("first call, fxrewrite full / fastest inductor", over(full.first_call_s, inductor_first), 0.15))
    dynamo = over(results["dynamo-eager"].first_call_s, inductor_first) if "dynamo-eager" in results else None
    if dynamo is not None:  # no goal: what any Dynamo backend pays before its own work
        lines.append(f"- first call, Dynamo alone (backend eager) / fastest inductor: {dynamo:.3f} (the floor of any Dynamo backend)")
    # what the rewrites add to a start, and what is left of it on a restart with the cache warm:
    # rows of their own processes only (the side-by-side process compiles several systems)
    own = {k: r.first_call_s for k, r in results.items() if r.first_call_s}
    for a, b, goal in (("fxrewrite", "piecewise-norewrite", 1.25), ("fxrewrite-full", "full-norewrite", 1.25),
                       ("fxrewrite-full-warm", "full-norewrite", 1.05)):
        lines.append(_ratio_line(f"first call, {SYSTEM_BY_KEY[a].label} / {SYSTEM_BY_KEY[b].label}",
                                 over(own.get(a), own.get(b)), goal))
    return lines


def paired_table(paired: Paired, cols: list[Scenario]) -> list[str]:
    """The side-by-side table: each system's median over rounds, and the first system's per-round
    ratio to each other one (median, min-max)."""
    keys = list(dict.fromkeys(k for c in cols for k in paired.ms.get(c.name, {})))
    if not keys:
        return []
    first, rest = keys[0], keys[1:]
    labels = [SYSTEM_BY_KEY[k].label for k in keys]
    rounds = max(len(v) for t in paired.ms.values() for v in t.values())
    out = ["", f"Side by side in one process ({rounds} rounds; step ms from an idle device, median of each "
               f"system's round medians; ratios: median of the per-round ratios, min-max):", "",
           "| column | " + " | ".join(f"{x} ms" for x in labels) + " | "
           + " | ".join(f"{labels[0]} / {SYSTEM_BY_KEY[k].label}" for k in rest) + " |",
           "|" + "---|" * (1 + len(keys) + len(rest))]
    for c in cols:
        times = paired.ms.get(c.name, {})
        if not times:
            continue
        cells = [f"{statistics.median(times[k]):.3f}" if times.get(k) else "-" for k in keys]
        for k in rest:
            r = _ratios(paired, c.name, first, k)
            cells.append(f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})" if r else "-")
        out.append(f"| {c.name} | " + " | ".join(cells) + " |")
    out.append("| first call s | " + " | ".join(f"{paired.first_call_s[k]:.1f}" if k in paired.first_call_s else "-" for k in keys)
               + " |" + " |" * len(rest))
    return out


def render(header: list[str], results: dict[str, Result], labels: dict[str, str], extra: dict[str, dict[str, float]],
           cols: list[Scenario], paired: Paired) -> str:  # fmt: skip
    """Header, goals and notes, then the side-by-side and back-to-back tables, then the one table
    of every system (last); ``extra`` rows (attention alone, the HBM floor) close it."""
    floor = extra["HBM floor"]
    out = [*header, "", "Goals (issues 6 and 23), from this run:", *goal_lines(results, floor, cols, paired), "", "Notes:"]
    out += [f"- {labels[k]}: {n}" for k, r in results.items() for n in r.notes]
    out += [f"- side by side: {n}" for n in paired.notes]
    if out[-1] == "Notes:":
        out.append("- none")
    out += paired_table(paired, cols)
    decode = [c.name for c in cols if c.kind == "decode"]
    b2b = {k: r.b2b for k, r in results.items() if r.b2b}
    if b2b:
        out += ["", "Decode, calls back to back (ms per step):", "", "| system | " + " | ".join(decode) + " |",
                "|" + "---|" * (len(decode) + 1)]
        out += [f"| {labels[k]} | " + " | ".join(f"{v[n]:.2f}" if n in v else "-" for n in decode) + " |" for k, v in b2b.items()]
        out.append("| HBM floor | " + " | ".join(f"{floor[n]:.2f}" for n in decode) + " |")
    names = [c.name for c in cols]
    out += ["", "| system | " + " | ".join(f"{n} ms" for n in names) + " | first call s | start-up s | max rel err |"]
    out.append("|" + "---|" * (len(names) + 4))
    for key, r in results.items():
        started = r.first_call_s is not None
        err = f"{r.max_err:.1e}" if r.max_err is not None else "-"
        cells = " | ".join(r.cells.get(n, "-") for n in names)
        out.append(f"| {labels[key]} | {cells} | {f'{r.first_call_s:.1f}' if started else '-'} | {f'{r.startup_s:.1f}' if started else '-'} | {err} |")
    out += [f"| {label} | " + " | ".join(f"{row[n]:.2f}" for n in names) + " | - | - | - |" for label, row in extra.items()]
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--out", type=Path, default=None, help="write the markdown here (rewritten after every system)")
    p.add_argument("--systems", default=None, help="comma-separated keys: " + ", ".join(s.key for s in SYSTEMS))
    p.add_argument("--paired", default=None, help="comma-separated keys timed side by side in one more process "
                   "(the first against each other), e.g. fxrewrite-full,fused-full or fxrewrite-full,inductor-cg")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds of the --paired process")
    p.add_argument("--layers", type=int, default=None, help="override the layer count (quick runs)")
    p.add_argument("--quant", choices=tuple(QUANTS), default="none", help="the model's linears quantized: fp8 (static "
                   "per-tensor, torch._scaled_mm), block-fp8 (fxr.linear_block_fp8) or nvfp4 (a dequantizing reference GEMM: "
                   "fusions and numerics, not NVFP4's speed); every system runs the same model")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per sequence in decode (tiny: at most 64)")
    p.add_argument("--prefill-seqs", type=int, default=1, help="sequences per prefill step (>1 runs attention's host loop)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up calls per column (reduce-overhead records at call 2)")
    p.add_argument("--min-reps", type=int, default=10, help="timed calls per cell at least (the CPU smoke tests use 1)")
    p.add_argument("--target-s", type=float, default=1.0 if cuda else 0.3, help="timing seconds per cell")
    p.add_argument("--budget-s", type=float, default=450.0, help="start nothing after this many seconds")
    p.add_argument("--inductor", action="store_true", help="run the Inductor rows on CPU too (slow C++ compiles)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_grad_enabled(False)
    torch._inductor.config.force_disable_caches = True  # cold compiles: a first model start
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True  # never fall back to eager silently
    plan = make_plan(args)
    if args.child:
        return child_main(args, plan)
    keys = [k for k in args.systems.split(",") if k] if args.systems is not None else [s.key for s in SYSTEMS]
    paired_keys = [k for k in (args.paired or "").split(",") if k]
    if unknown := set(keys + paired_keys) - set(SYSTEM_BY_KEY):
        raise SystemExit(f"unknown systems {sorted(unknown)}; known: {list(SYSTEM_BY_KEY)}")
    chosen = [s for s in SYSTEMS if s.key in keys]
    for s in chosen:
        if s.warm_from and s.warm_from not in keys:
            raise SystemExit(f"{s.key} restarts {s.warm_from} with its caches: choose {s.warm_from} too")
    args.deadline = time.time() + args.budget_s
    args.workdir = tempfile.mkdtemp(prefix="fxrewrite-e2e-")
    device, cols = plan.device, plan.cols

    model, twin, batches, checks = prepare(plan)
    log("float32 references ...")
    refs = {c.name: float32_reference(model, checks[c.name]) for c in cols}
    torch.save({k: v.cpu() for k, v in refs.items()}, Path(args.workdir) / "refs.pt")
    clock = Clock(device)
    bandwidth = clock.copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (256 << 20))
    extra = {
        f"attention op alone (x{plan.cfg.num_layers})": {c.name: attention_ms(model, batches[c.name], clock) for c in cols},
        "HBM floor": {c.name: hbm_floor_ms(model, batches[c.name], bandwidth) for c in cols},
    }
    embedding = model.embed_tokens.weight
    weight_gb = (weight_bytes(model) + embedding.numel() * embedding.element_size()) / 1e9
    del model, twin, batches, checks, refs  # each system runs in a process of its own
    _free_memory()

    cfg = plan.cfg
    header = [
        f"# Serving-engine Llama ({args.shape}): step latency by system",
        "",
        f"- command: `python {' '.join(shlex.quote(a) for a in ['bench/bench_e2e.py', *argv])}`",
        f"- device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}; torch {torch.__version__}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, heads {cfg.num_heads}/{cfg.num_kv_heads} KV, "
        f"{args.dtype}, {weight_gb:.2f} GB of weights, LM head left out; KV cache {plan.max_seqs} rows x {plan.max_len} tokens",
        f"- decode: one new token per sequence after {cols[0].context} cached; prefill: {args.prefill_seqs} sequence(s) from position 0",
        f"- copy bandwidth (read + write): {bandwidth / 1e12:.3f} TB/s; CUDA graph capture sizes: {plan.capture['all']}; "
        "each system in a fresh process",
        "- step ms: median over many calls from an idle device after warm-up; first call and start-up in s; rel err vs float32 eager"
        + ("" if plan.quant == "none" else ": the same quantized model, eager, every value that is not quantized in float32 (its "
           "quantized weights as stored, its activations quantized as in the run): the format's own error is not in the column, eager's "
           "row is the floor"),
    ]
    if plan.quant != "none":
        header.insert(5, f"- quantization ({plan.quant}): {QUANTS[plan.quant]}; the fxrewrite rows with "
                         "`Config(attention_quant=engine_fp8.ATTENTION_QUANT)`; no hand-fused twin")
    labels = {s.key: s.label for s in chosen}
    results: dict[str, Result] = {}
    paired = Paired()

    def write() -> str:
        text = render(header, results, labels, extra, cols, paired)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        return text

    # the side-by-side process first: the goals that need it are read from it
    runnable = [k for k in paired_keys if not _cannot_run(SYSTEM_BY_KEY[k], device, args)]
    paired.notes += [f"{k}: {_cannot_run(SYSTEM_BY_KEY[k], device, args)}" for k in paired_keys if k not in runnable]
    if len(runnable) > 1:
        log(f"side by side: {', '.join(runnable)} ...")
        saved, failed = run_child(PAIRED, [*argv, "--paired", ",".join(runnable)], args)
        paired.ms, paired.first_call_s = saved.get("ms", {}), saved.get("first_call_s", {})
        paired.notes += saved.get("notes", []) + ([failed] if failed else [])
        write()
    for system in chosen:
        log(f"{system.label} ...")
        if why := _cannot_run(system, device, args):
            res = Result(cells={c.name: "n/a" if why != "skipped, past --budget-s" else "skipped" for c in cols}, notes=[why])
        else:
            res = run_system_child(system.key, argv, args, cols)
        results[system.key] = res
        write()
    print(write())
    return 0


def _cannot_run(system: System, device: torch.device, args: argparse.Namespace) -> str | None:
    """Why ``system`` does not run here (None if it does)."""
    if system.needs_cuda and device.type != "cuda":
        return "needs CUDA"
    if system.inductor and device.type != "cuda" and not args.inductor:
        return "Inductor rows off on CPU (--inductor runs them)"
    if time.time() > args.deadline:
        return "skipped, past --budget-s"
    return None


if __name__ == "__main__":
    sys.exit(main())
