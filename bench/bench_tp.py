"""Step latency of the serving-engine Llama at tensor parallel 2: with and without the all-reduce
fusion, NCCL against flashinfer, piecewise and full CUDA graphs; one run, one table.

    source .devkit/setup.sh && NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/bench_tp.py \\
        --layers 16 --out tp.md                     # bench/tp_gpu.sh runs this with the tests
    torchrun --nproc-per-node 2 bench/bench_tp.py --shape tiny --device cpu   # a CPU smoke test (gloo)

Every rank builds the full model from one seed (``engine_model.build_model``), keeps its shard
(``tp_model.shard``) and a KV cache of its heads filled with random values. Rows, in the order
they run (the comparisons first, in case ``--budget-s`` runs out):

    eager                         the TP model as written (funcol all-reduce = NCCL)
    piecewise, AR fused: flashinfer   default rules; ``fxr.all_reduce_add_rms_norm`` served by
                                  flashinfer's trtllm_allreduce_fusion (one-shot / two-shot by size)
    piecewise, AR fused: NCCL     the same graph, the op's NCCL path forced
                                  (``provider="all_reduce_add_rms_norm=torch"``)
    piecewise, AR not fused       default rules without ``fuse_collective``: NCCL all-reduce, then
                                  the in-place fused add + RMSNorm kernel
    full, ... (the same three)    one CUDA graph per decode step
    full, ... (prefill too)       today's fusion and SP + async TP with every column, prefill too,
                                  in one CUDA graph per step (no host launches between pieces)
    piecewise, AR fused + SP      sequence parallelism from ``--sp-min-tokens`` rows on
                                  (``fxr.sp_reduce_add_rms_norm``: NCCL reduce-scatter, add +
                                  RMSNorm on this rank's rows, all-gather); below it the same
                                  flashinfer fused all-reduce as "piecewise, AR fused: flashinfer"
    piecewise, SP + async TP      the same, with each site's GEMMs fused with its collectives
                                  (``Config.async_tp``, over symmetric memory): below
                                  ``Config.async_tp_overlap_min_tokens`` rows whole GEMMs around
                                  one kernel that sums, norms and exchanges the rows over NVLink;
                                  from there each GEMM split by the ranks' rows, the rows copied
                                  on the copy engines while the GEMM halves run
    ..., exchange / overlap only  each of those two paths at every sharded size (pw-atp-x, -o)

Columns: decode of 8 and 64 sequences after ``--context`` cached tokens, prefill of 512 and 2048
tokens; ``--decode`` and ``--prefill`` name others. Every column up to ``--max-capture`` tokens
(default 512) is a capture size of every compiled system; beyond it the graph runs eagerly, as
engines do beyond theirs. Today's fusion, sequence parallelism and async TP, every column
replayed from CUDA graphs (bench/tp_sp_gpu.sh):

    torchrun --nproc-per-node 2 bench/bench_tp.py --systems pw-fi,pw-sp,pw-atp --decode 1,8,64 \
        --prefill 512,2048,4096 --max-capture 4096

A cell is
the median step time of rank 0 (CUDA events, from an idle device, every step started by both
ranks together after a barrier; both ranks run the same fixed number of steps: a collective
needs both); "first call" includes Dynamo, the passes,
workspace creation and captures; "rel err" is the largest ``max|y - ref| / max|ref|`` against
the unsharded model computed in float32 (``engine_model.float32_reference``, one block at a
time) on fresh inputs with no cached context (each step's new tokens attend to themselves: the
random caches play no part, so the reference needs none of them). Rank 0 writes the markdown to ``--out`` after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import FILL_SEED, CHECK_SEED, Clock, Scenario, _short, rel_err  # noqa: E402
from engine_model import (SPLITTING_OPS, build_model, float32_reference, llama_8b, make_batch,  # noqa: E402
                          mark_static_metadata, tiny)
from tp_model import shard  # noqa: E402

AR_OP = "all_reduce_add_rms_norm"
SP_OP = "sp_reduce_add_rms_norm"
ATP_OPS = ("sp_linear_reduce_add_rms_norm_linear", "sp_linear_reduce_add_rms_norm", "sp_all_gather_linear")
WARMUP = {"decode": (3, 50), "prefill": (2, 10)}  # (warm-up calls, timed steps): the same on every rank


@dataclasses.dataclass(frozen=True)
class System:
    """One row: how fxrewrite is configured (mode None: eager, no compile)."""

    key: str
    label: str
    mode: str | None
    provider: str = ""
    collective: bool = True
    kinds: tuple[str, ...] = ("decode", "prefill")
    sequence_parallel: bool = False
    async_tp: bool = False
    overlap: int | None = None  # Config.async_tp_overlap_min_tokens (None: its default)


SYSTEMS = (
    System("eager", "eager (NCCL)", None),
    System("pw-fi", "piecewise, AR fused: flashinfer", "piecewise"),
    System("pw-nccl", "piecewise, AR fused: NCCL", "piecewise", f"{AR_OP}=torch"),
    System("pw-none", "piecewise, AR not fused (NCCL + add-norm)", "piecewise", collective=False),
    # SP + async TP before SP alone: the comparison with today's pw-fi first, in case --budget-s runs out
    System("pw-atp", "piecewise, SP + async TP", "piecewise", sequence_parallel=True, async_tp=True),
    # the site op's two symm-mem paths at every sharded size: the exchange kernel between whole
    # GEMMs, the GEMMs split by the ranks' rows (Config.async_tp_overlap_min_tokens)
    System("pw-atp-x", "piecewise, SP + async TP, exchange only", "piecewise", sequence_parallel=True, async_tp=True,
           overlap=1 << 30),
    System("pw-atp-o", "piecewise, SP + async TP, overlap only", "piecewise", sequence_parallel=True, async_tp=True,
           overlap=1),
    System("pw-sp", "piecewise, AR fused + sequence parallelism", "piecewise", sequence_parallel=True),
    System("full-fi", "full, AR fused: flashinfer", "full", kinds=("decode",)),
    System("full-nccl", "full, AR fused: NCCL", "full", f"{AR_OP}=torch", kinds=("decode",)),
    System("full-none", "full, AR not fused (NCCL + add-norm)", "full", collective=False, kinds=("decode",)),
    # prefill in one CUDA graph too: no host launches between the pieces, so neither rank waits in a
    # collective for the other's host (piecewise prefill 512 moved 20-30% from run to run)
    System("full-fi-all", "full, AR fused: flashinfer (prefill too)", "full"),
    System("full-atp", "full, SP + async TP", "full", sequence_parallel=True, async_tp=True),
)


def columns(shape: str, context: int, decode: str | None = None, prefill_sizes: str | None = None) -> list[Scenario]:
    """Decode 8 and 64; prefill 512 and 2048 (not 4096 by default, as bench_e2e: the KV cache
    rows grow with it, and full graphs save and restore the cache around each capture); or the
    comma-separated sizes given."""
    prefill = (512, 2048) if shape == "8b" else (64, 256)
    prefill = tuple(int(t) for t in prefill_sizes.split(",")) if prefill_sizes else prefill
    ctx = context if shape == "8b" else min(context, 64)
    batches = tuple(int(b) for b in decode.split(",")) if decode else (8, 64)
    return [Scenario(f"decode {b}", "decode", b, ctx) for b in batches] + [
        Scenario(f"prefill {t}", "prefill", t, 0) for t in prefill
    ]


def rules(collective: bool) -> list[Any] | None:
    """The default library, or the default library without ``fuse_collective``."""
    if collective:
        return None
    from fxrewrite.backend import default_rule_groups

    return [r for name, group in default_rule_groups() if name != "fuse_collective" for r in group]


@dataclasses.dataclass
class Row:
    cells: dict[str, str] = dataclasses.field(default_factory=dict)
    label: str = ""
    back_to_back: dict[str, float] = dataclasses.field(default_factory=dict)
    first_call_s: float | None = None
    max_err: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


COLLECTIVE_KERNELS = ("allreduce", "all_reduce", "reducescatter", "reduce_scatter", "allgather", "all_gather", "nccl",
                      "lamport", "oneshot", "twoshot", "multimem", "ptop", "barrier", "symm", "signal")  # fmt: skip
KERNEL_KINDS = (  # (kind, substrings of the kernel's name), first match wins; lower case
    ("collective", COLLECTIVE_KERNELS),
    ("copy", ("memcpy", "memset", "copy")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "matmul", "_mm_", "linear")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def profile_steps(step: Any, batch: dict, steps: int = 3, trace: Path | None = None) -> dict[str, float]:
    """Milliseconds per step by kernel kind (``kernel_kind``), from ``torch.profiler`` over
    ``steps`` steps (every rank steps; each reads its own), with ``busy``: the time at least one
    kernel or copy ran (the union over streams). A collective's time counts its wait for the
    other rank too: ``collective`` is the most that overlapping it with compute could take off a
    step (issue 32's floor); ``busy`` below the step's time is the host's share. ``trace``: the
    chrome trace is written there too."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(**batch)
        torch.cuda.synchronize()
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    ms: dict[str, float] = {}
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(e.name)
            ms[kind] = ms.get(kind, 0.0) + e.time_range.elapsed_us() / steps / 1e3
            spans.append((e.time_range.start, e.time_range.end))
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    ms["busy"] = busy / steps / 1e3
    return ms


def run_system(system: System, model: Any, cols: list[Scenario], batches: dict, checks: dict, refs: dict,
               clock: Clock, deadline: float, sp_min_tokens: int = 512, max_capture: int = 512,
               share: bool = False, trace_dir: Path | None = None) -> Row:  # fmt: skip
    import fxrewrite
    from fxrewrite.runtime import providers

    row = Row()
    if _past(deadline):
        return Row(cells={c.name: "skipped" for c in cols}, notes=["skipped, past --budget-s"])
    torch._dynamo.reset()
    providers.reset_counts()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    backend = None
    if system.mode is None:
        step = model
    else:
        capture = tuple(sorted({c.size for c in cols if c.size <= max_capture and c.kind in system.kinds}))
        backend = fxrewrite.Backend(mode=system.mode, splitting_ops=SPLITTING_OPS, capture_sizes=capture,
                                    max_capture_size=max((512, *capture)), provider=system.provider,
                                    rules=rules(system.collective), progress=False, async_tp=system.async_tp,
                                    **({} if system.overlap is None else {"async_tp_overlap_min_tokens": system.overlap}),
                                    sequence_parallel_min_tokens=sp_min_tokens if system.sequence_parallel else None)  # fmt: skip
        step = backend.compile(model)
    errors = []
    for col in cols:
        if col.kind not in system.kinds:
            row.cells[col.name] = "n/a"
            continue
        if _past(deadline):
            row.cells[col.name] = "skipped"
            continue
        batch = batches[col.name]
        warm, reps = WARMUP[col.kind]
        first = clock.wall(lambda: step(**batch))
        row.first_call_s = first if row.first_call_s is None else row.first_call_s
        for _ in range(warm - 1):
            step(**batch)
        # every step started after a barrier: a rank that starts late would otherwise bill its
        # lateness to the other's first collective (piecewise mode launches pieces from the host)
        ms = clock.median_ms(lambda: step(**batch), reps, before=dist.barrier)
        dist.barrier()
        row.back_to_back[col.name] = clock.back_to_back_ms(lambda: step(**batch), reps)
        if share and clock.cuda:
            name = f"{system.key}_{col.name.replace(' ', '')}_rank{dist.get_rank()}.json"
            trace = trace_dir / name if trace_dir else None
            kinds = profile_steps(step, batch, trace=trace)
            comm, busy = kinds.pop("collective", 0.0), kinds.pop("busy")
            rest = ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
            row.notes.append(f"{col.name}: collective kernels {comm:.2f} ms a step ({100 * comm / ms:.1f}% of its "
                             f"{ms:.2f} ms); other kernels by kind: {rest}; the device busy {busy:.2f} ms")  # fmt: skip
        model.fill_kv_cache_random(FILL_SEED)
        errors.append(rel_err(step(**checks[col.name]), refs[col.name]))
        row.cells[col.name] = f"{ms:.2f}"
        _log(f"  {system.label:44s} {col.name:13s} {ms:8.3f} ms (back to back {row.back_to_back[col.name]:8.3f})  "
             f"rel err {errors[-1]:.1e}")  # fmt: skip
    row.max_err = max(errors) if errors else None
    if row.back_to_back:
        row.notes.append("back to back (rank 0, ms a step, steps issued one after another): " +
                         ", ".join(f"{k} {v:.2f}" for k, v in row.back_to_back.items()))  # fmt: skip
    if backend is not None:
        backend.refresh_runtime()
        served = providers.served().get(AR_OP)
        fused = sum(g.fused_ops.get(AR_OP, 0) for g in backend.report.graphs)
        runs = [g.runtime or {} for g in backend.report.graphs]
        eager = sum(r.get("eager_calls", 0) for r in runs)
        row.notes.append(f"{AR_OP} sites {fused} in {len(backend.report.graphs)} graphs; served (Python calls: "
                         f"eager steps, warm-ups, captures) {served}; replays {sum(r.get('replays', 0) for r in runs)}, "
                         f"eager calls {eager}")  # fmt: skip
        if torch.cuda.is_available():
            row.notes.append(f"memory reserved at peak {torch.cuda.max_memory_reserved() / 1e9:.1f} GB")
        failed = [p for r in runs for p in r.get("eager_pieces", []) if p.get("reason")]
        if failed:  # a piece that could not be captured at some size (a capture that raised, say)
            row.notes.append(f"pieces run eagerly: {len(failed)}, first: {failed[0]}")
        if system.sequence_parallel:
            row.notes += site_notes(backend, system.async_tp)
        misses = [f"{m.rule}: {m.reason}" for m in backend.report.near_misses
                  if m.rule in (AR_OP, "sequence_parallel", "async_tp")]  # fmt: skip
        if misses:
            row.notes.append(f"near misses: {misses[:3]}")
    del step, backend
    torch._dynamo.reset()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return row


def site_notes(backend: Any, async_tp: bool) -> list[str]:
    """The collective pattern of the sequence-parallel (async-TP) sites: each distinct pattern
    (layer indices and the graphs' row symbols as ``*``) with its count and the sites (modules)
    that got it, and the calls each op's paths served."""
    import collections
    import re

    from fxrewrite.runtime import providers
    from fxrewrite.runtime.ops import async_tp as atp

    rule = "async_tp" if async_tp else "sequence_parallel"
    patterns: dict[str, list[str]] = collections.defaultdict(list)
    for site in (s for s in backend.report.sites if s.rule == rule):
        patterns[re.sub(r"\.\d+\.", ".*.", re.sub(r"rows s\d+", "rows s*", site.note))].append(site.module)
    notes = [f"{rule} sites {sum(map(len, patterns.values()))} in {len(backend.report.graphs)} graphs"]
    for note, modules in sorted(patterns.items(), key=lambda kv: -len(kv[1])):
        shown = sorted(set(modules))
        notes.append(f"{len(modules)}x {note} (at {', '.join(shown[:3])}{', ...' if len(shown) > 3 else ''})")
    for op in (*ATP_OPS,) if async_tp else (SP_OP,):
        notes.append(f"{op} served (Python calls) {providers.served().get(op)}")
    if async_tp and atp.refusals():
        notes.append(f"symm-mem refused: {atp.refusals()}")
    return notes


def _past(deadline: float) -> bool:
    """Whether any rank is past the deadline (all ranks must agree, or one would wait alone)."""
    late = torch.tensor([1.0 if time.time() > deadline else 0.0], device=_DEVICE[0])
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


_DEVICE: list[torch.device] = [torch.device("cpu")]


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def render(header: list[str], rows: dict[str, Row], cols: list[Scenario]) -> str:
    names = [c.name for c in cols]
    out = [*header, "", "| system | " + " | ".join(f"{n} ms" for n in names) + " | first call s | rel err |",
           "|" + "---|" * (len(names) + 3)]  # fmt: skip
    for r in rows.values():
        first = f"{r.first_call_s:.1f}" if r.first_call_s is not None else "-"
        err = f"{r.max_err:.1e}" if r.max_err is not None else "-"
        out.append(f"| {r.label} | " + " | ".join(r.cells.get(n, "-") for n in names) + f" | {first} | {err} |")
    notes = [f"- {r.label}: {n}" for r in rows.values() for n in r.notes]
    return "\n".join(out + ["", "Notes:", *(notes or ["- none"])]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    p.add_argument("--layers", type=int, default=None, help="override the layer count")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per sequence in decode")
    p.add_argument("--systems", default=None, help="comma-separated keys: " + ", ".join(s.key for s in SYSTEMS))
    p.add_argument("--decode", default=None, help="comma-separated decode batch sizes (default 8,64)")
    p.add_argument("--prefill", default=None, help="comma-separated prefill token counts (default 512,2048)")
    p.add_argument("--sp-min-tokens", type=int, default=512, help="pw-sp, pw-atp: sequence parallelism from this many tokens")
    p.add_argument("--max-capture", type=int, default=512, help="columns up to this many tokens are capture sizes")
    p.add_argument("--budget-s", type=float, default=220.0, help="start no column after this many seconds")
    p.add_argument("--collective-share", action="store_true",
                   help="profile each column: the kernels' time per step by kind, the collectives' share (CUDA only)")
    p.add_argument("--trace-dir", type=Path, default=None,
                   help="with --collective-share: each rank's chrome trace of each column's profiled steps here")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    start = time.time()
    cuda = args.device.startswith("cuda")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
        _DEVICE[0] = torch.device("cuda", local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_grad_enabled(False)
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    device, dtype = _DEVICE[0], torch.bfloat16 if cuda else torch.float32
    cfg = llama_8b() if args.shape == "8b" else tiny()
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    cols = columns(args.shape, args.context, args.decode, args.prefill)
    max_seqs = max(c.size for c in cols if c.kind == "decode")
    max_len = max(c.context + (1 if c.kind == "decode" else c.size) for c in cols)
    _log(f"rank {rank}/{world}: building {cfg.num_layers} layers on {device}, sharding")
    full = build_model(cfg, device=device, dtype=dtype, seed=0)
    model = shard(full, rank, world, dist.group.WORLD.group_name)
    weight_gb = sum(t.numel() * t.element_size() for t in model.parameters()) / 1e9

    def batch(c: Scenario, seed: int, context: int, length: int) -> dict[str, torch.Tensor]:
        return mark_static_metadata(make_batch(cfg, c.kind, c.size, context, max_len=length, device=device, seed=seed))

    refs = {}  # the unsharded model in float32, with a cache just big enough for the step
    for c in cols:
        seqs, length = (c.size, 1) if c.kind == "decode" else (1, c.size)
        full.allocate_kv_cache(seqs, length)
        refs[c.name] = float32_reference(full, batch(c, CHECK_SEED, 0, length))
    del full
    torch.cuda.empty_cache() if cuda else None
    model.allocate_kv_cache(max_seqs, max_len)
    batches = {c.name: batch(c, 0, c.context, max_len) for c in cols}
    checks = {c.name: batch(c, CHECK_SEED, 0, max_len) for c in cols}
    clock = Clock(device)
    deadline = start + args.budget_s
    keys = args.systems.split(",") if args.systems else [s.key for s in SYSTEMS]
    header = [
        f"# TP={world}: serving-engine Llama ({args.shape}, {cfg.num_layers} layers), all-reduce fusion",
        "",
        f"- command: `torchrun --nproc-per-node {world} bench/bench_tp.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"- device: {torch.cuda.get_device_name(device) if cuda else 'CPU'} x{world}; torch {torch.__version__}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}",
        f"- model per rank: hidden {cfg.hidden_size}, {cfg.num_heads // world}/{cfg.num_kv_heads // world} heads/KV heads, "
        f"MLP {cfg.intermediate_size // world}, {dtype}, {weight_gb:.2f} GB of weights; KV cache {max_seqs} x {max_len}",
        f"- decode: one new token per sequence after {cols[0].context} cached; prefill: one sequence from position 0; "
        f"step ms: rank 0's median of {WARMUP['decode'][1]} (decode) / {WARMUP['prefill'][1]} (prefill) steps",
        f"- rel err: against the unsharded model in float32, on steps without cached context; "
        f"sequence parallelism (pw-sp, pw-atp) from {args.sp_min_tokens} tokens",
        f"- capture sizes: the columns up to {args.max_capture} tokens "
        f"({', '.join(str(c.size) for c in cols if c.size <= args.max_capture)}); larger columns run eagerly",
    ]
    rows: dict[str, Row] = {}
    by_key = {s.key: s for s in SYSTEMS}
    for i, key in enumerate(keys):  # in the order given; a key given twice runs twice (its rows in order)
        system = by_key[key]
        if key in rows:
            system = dataclasses.replace(system, key=f"{key}-{i}", label=f"{system.label} (again)")
        _log(f"{system.label} ...")
        try:
            rows[system.key] = run_system(system, model, cols, batches, checks, refs, clock, deadline, args.sp_min_tokens,
                                          args.max_capture, args.collective_share, args.trace_dir)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a row that fails says why; the others still run
            rows[system.key] = Row(cells={c.name: "failed" for c in cols}, notes=[f"failed: {_short(e)}"])
            _log(traceback.format_exc(limit=-8))
            torch._dynamo.reset()
        rows[system.key].label = system.label
        text = render(header, rows, cols)
        if rank == 0 and args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
    if rank == 0:
        print(text, flush=True)
    dist.barrier()
    # no destroy_process_group: its teardown with the IPC and symmetric-memory workspaces alive
    # outlived the run's time limit on the H200s (bench/RESULTS.md, issues 7 and 32)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
