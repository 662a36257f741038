"""One MoE layer at real shapes on one GPU: transformers' block eager, the same block under
Inductor, ``fxr.moe`` (what ``fuse_moe`` makes of the block), and the HBM floor.

    source .devkit/setup.sh && python3 bench/bench_moe.py [--quick] [--tokens 1,8,64,512,4096]
        [--shapes mixtral-8x7b,128-experts] [--reps 20] [--sweep] [--out moe.md]

Shapes (bf16, random weights): Mixtral-8x7B's layer (hidden 4096, 8 experts, top-2
renormalized, expert MLP 14336) and a many-experts layer at Qwen3-30B-A3B's shape (hidden 2048,
128 experts, top-8 renormalized, expert MLP 768). ``LAYERS`` copies of the layer, each with its
own weights, run one after another on the same hidden states (so a replay does not find the
experts in L2); times are per layer. The routing is the router's own on random hidden states:
the experts hit are those the tokens pick, none is forced.

Columns, per shape and token count T:

* ``HF eager``: the transformers block (``MixtralSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock``)
  with its default experts implementation, ``grouped_mm``; ``HF loop``: with ``eager`` (the loop
  over the experts hit: host syncs, so each call is timed alone, not in a CUDA graph);
* ``Inductor``: the ``grouped_mm`` block under ``torch.compile(fullgraph=True, dynamic=False)``
  (one compile per token count, default mode);
* ``fxr.moe``: the router's linear, then ``torch.ops.fxr.moe`` from the logits (the Triton
  provider; a fallback would be counted and fail the run);
* ``floor``: the bytes of the router, of the experts hit and of ``x`` and the output, over the
  device-to-device copy bandwidth (read + write) measured in this run.

Times: median of ``--reps`` replays of a CUDA graph of the ``LAYERS`` calls (CUDA events),
divided by ``LAYERS``. Check: on layer 0, ``fxr.moe``, HF eager and Inductor against
``moe_reference`` (bf16 tolerance of :mod:`fxrewrite.tolerances`), over the tokens whose k-th and
(k+1)-th router probabilities differ (a tie leaves the choice of expert to each implementation;
``ties`` counts the tokens left out). Exit status 1 when a check fails or a call fell back.
``--sweep`` also times alternative launch configurations of the Triton kernels (slow: one
build each) and prints the best per case beside :func:`triton_moe.config`'s choice.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fxrewrite.runtime.ops  # noqa: E402, F401  (registers torch.ops.fxr.*)
from fxrewrite.runtime import providers  # noqa: E402
from fxrewrite.runtime.ops.moe import TRITON_MOE, moe_reference  # noqa: E402
from fxrewrite.tolerances import TOLERANCES  # noqa: E402

LAYERS = 4
TOKENS = (1, 8, 64, 512, 4096)
QUICK_TOKENS = (1, 8, 64)
DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Shape:
    """An MoE layer: ``experts`` experts of width ``width``, ``top_k`` per token, hidden size
    ``hidden``; ``family`` names the transformers block that runs it."""

    family: str
    hidden: int
    experts: int
    top_k: int
    width: int
    renormalize: bool = True

    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.width * DTYPE.itemsize


SHAPES = {
    "mixtral-8x7b": Shape("mixtral", hidden=4096, experts=8, top_k=2, width=14336),
    "128-experts": Shape("qwen3_moe", hidden=2048, experts=128, top_k=8, width=768),
}


# --------------------------------------------------------------------------- the transformers block


def hf_blocks(shape: Shape, device: torch.device, count: int = 1) -> list[torch.nn.Module]:
    """``count`` transformers sparse MoE blocks of ``shape`` on ``device`` in bf16, random weights
    (router logits ~ N(0, 1) on unit hidden states; each expert GEMM keeps its input's
    magnitude), built from one config: Inductor's guards on it hold for every block, and
    :func:`set_experts_implementation` switches them all."""
    import transformers as tf

    if shape.family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        cfg = tf.MixtralConfig(hidden_size=shape.hidden, intermediate_size=shape.width,
                               num_local_experts=shape.experts, num_experts_per_tok=shape.top_k)  # fmt: skip
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = tf.Qwen3MoeConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.width, num_experts=shape.experts,
                                num_experts_per_tok=shape.top_k, norm_topk_prob=shape.renormalize)  # fmt: skip
    set_experts_implementation(cfg, "grouped_mm")
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(device):
            blocks = [Block(cfg).eval().requires_grad_(False) for _ in range(count)]
    finally:
        torch.set_default_dtype(default)
    for block in blocks:
        block.gate.weight.normal_(0.0, shape.hidden**-0.5)
        block.experts.gate_up_proj.normal_(0.0, shape.hidden**-0.5)
        block.experts.down_proj.normal_(0.0, shape.width**-0.5)
    return blocks


def set_experts_implementation(cfg: Any, name: str) -> None:
    """How transformers runs the experts of every block built from ``cfg`` (read per call)."""
    cfg._experts_implementation = name


def hf_call(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block on ``x`` [T, H] (as a batch of one sequence), [T, H] out."""
    out = block(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)


def fused_call(block: torch.nn.Module, x: torch.Tensor, shape: Shape, cfg: Any = None) -> torch.Tensor:
    """What fuse_moe leaves of the block: the router's linear, then one fxr.moe from the logits."""
    logits = F.linear(x, block.gate.weight)
    args = (x, logits, None, None, block.experts.gate_up_proj, block.experts.down_proj, shape.top_k,
            shape.renormalize, "silu")  # fmt: skip
    if cfg is not None:  # a launch configuration of the sweep: the provider's entry point with it
        return providers.library(TRITON_MOE).moe(*args, cfg=cfg)  # type: ignore[union-attr]
    return torch.ops.fxr.moe(*args)


def reference_call(block: torch.nn.Module, x: torch.Tensor, shape: Shape) -> torch.Tensor:
    logits = F.linear(x, block.gate.weight)
    return moe_reference(x, logits, None, None, block.experts.gate_up_proj, block.experts.down_proj, shape.top_k,
                         shape.renormalize, "silu")  # fmt: skip


# --------------------------------------------------------------------------- floor and checks


def routing(block: torch.nn.Module, x: torch.Tensor, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts each token picks [T, k], tokens with a tie at the k-th place [T] bool)."""
    probs = torch.softmax(F.linear(x, block.gate.weight).float(), dim=-1)
    ranked = probs.topk(min(shape.top_k + 1, shape.experts), dim=-1)
    tie = ranked.values[:, shape.top_k - 1] == ranked.values[:, -1] if shape.top_k < shape.experts else None
    return ranked.indices[:, : shape.top_k], tie if tie is not None else torch.zeros_like(probs[:, 0], dtype=torch.bool)


def floor_bytes(block: torch.nn.Module, x: torch.Tensor, shape: Shape) -> tuple[int, int]:
    """(bytes one call must move at least, experts hit): the router, the experts the tokens
    pick, ``x`` read and the output written."""
    hit = int(routing(block, x, shape)[0].unique().numel())
    router = shape.experts * shape.hidden * DTYPE.itemsize
    return router + hit * shape.expert_bytes() + 2 * x.numel() * x.element_size(), hit


def check(got: torch.Tensor, want: torch.Tensor, keep: torch.Tensor) -> str:
    """"ok", or the largest error and how many elements lie outside the bf16 tolerance."""
    rtol, atol = TOLERANCES[DTYPE]
    g, w = got[keep].float(), want[keep].float()
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol)
    if not bool(bad.any()):
        return "ok"
    return f"max abs err {float((g - w).abs().max()):.3g}, {int(bad.sum())} of {bad.numel()} outside"


# --------------------------------------------------------------------------- timing


def graph_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of one replay of a CUDA graph of ``fn`` (built and warmed up first)."""
    from bench_attention import graph_ms as replay_ms

    return replay_ms(fn, reps)


def alone_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of single calls, each from an idle device (host syncs inside)."""
    from bench_e2e import Clock

    fn()
    return Clock(torch.device("cuda")).median_ms(fn, reps)


def configure_dynamo() -> None:
    """One compile per token count per shape; a recompile limit that is hit fails loudly rather
    than timing eager code under Inductor's name."""
    from torch import _dynamo

    _dynamo.config.recompile_limit = 64
    if hasattr(_dynamo.config, "fail_on_recompile_limit_hit"):
        _dynamo.config.fail_on_recompile_limit_hit = True


@dataclasses.dataclass
class Row:
    shape: str
    tokens: int
    hit: float
    floor_ms: float
    times: dict[str, float | None]
    checks: dict[str, str]
    ties: int

    def cells(self) -> list[str]:
        def ms(name: str) -> str:
            t = self.times.get(name)
            return "-" if t is None else f"{1e3 * t:.1f}"

        def ratio(a: str, b: str) -> str:
            ta, tb = self.times.get(a), self.times.get(b)
            return "-" if ta is None or tb is None else f"{ta / tb:.2f}"

        fxr = self.times.get("fxr.moe")
        to_floor = "-" if fxr is None else f"{fxr / self.floor_ms:.2f}"
        bad = [f"{k}: {v}" for k, v in self.checks.items() if v != "ok"]
        return [self.shape, str(self.tokens), f"{self.hit:.1f}", f"{1e3 * self.floor_ms:.1f}", ms("HF eager"),
                ms("HF loop"), ms("Inductor"), ms("fxr.moe"), to_floor, ratio("HF eager", "fxr.moe"),
                ratio("Inductor", "fxr.moe"), "ok" if not bad else "; ".join(bad), str(self.ties)]  # fmt: skip


HEADER = ["shape", "T", "experts hit", "floor us", "HF eager us", "HF loop us", "Inductor us", "fxr.moe us",
          "fxr / floor", "HF eager / fxr", "Inductor / fxr", "check", "ties"]  # fmt: skip


def measure(name: str, shape: Shape, blocks: list[torch.nn.Module], tokens: int, reps: int, bandwidth: float,
            compiled: Callable[..., torch.Tensor], sweeps: list[str] | None) -> Row:  # fmt: skip
    """One table row: check every way on layer 0, then time it over all layers; with ``sweeps``
    (a list) the sweep's line for this case is appended to it."""
    block, cfg = blocks[0], blocks[0].experts.config
    device = block.gate.weight.device
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn((tokens, shape.hidden), generator=gen, device=device).to(DTYPE)
    moved = [floor_bytes(b, x, shape) for b in blocks]
    floor_ms = sum(m[0] for m in moved) / bandwidth * 1e3 / len(blocks)
    tie = routing(block, x, shape)[1]
    keep = ~tie
    with torch.no_grad():
        want = reference_call(block, x, shape)
        checks = {"fxr.moe": check(fused_call(block, x, shape), want, keep)}
        times: dict[str, float | None] = {}
        ways: dict[str, tuple[Callable[[torch.nn.Module], torch.Tensor], str]] = {
            "HF eager": (lambda b: hf_call(b, x), "grouped_mm"),
            "Inductor": (lambda b: compiled(b, x), "grouped_mm"),
            "fxr.moe": (lambda b: fused_call(b, x, shape), "grouped_mm"),
            "HF loop": (lambda b: hf_call(b, x), "eager"),
        }
        for way, (fn, experts) in ways.items():
            set_experts_implementation(cfg, experts)
            try:
                if way != "fxr.moe":
                    checks[way] = check(fn(block), want, keep)
                timer = alone_ms if way == "HF loop" else graph_ms
                times[way] = timer(lambda fn=fn: [fn(b) for b in blocks], reps) / len(blocks)
            except Exception as e:  # noqa: BLE001 - a baseline that fails is reported, not fatal
                times[way] = None
                checks[way] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                print(f"{name} T={tokens} {way}: {checks[way]}", file=sys.stderr)
        set_experts_implementation(cfg, "grouped_mm")
        if sweeps is not None:
            sweeps += sweep(name, shape, blocks, x, reps)
    row = Row(name, tokens, sum(m[1] for m in moved) / len(moved), floor_ms, times, checks, int(tie.sum()))
    print("| " + " | ".join(row.cells()) + " |", flush=True)
    return row


def sweep(name: str, shape: Shape, blocks: list[torch.nn.Module], x: torch.Tensor, reps: int) -> list[str]:
    """The Triton kernels under alternative launch configurations: per BM, each GEMM's candidates
    with the other GEMM at the default; at 128-row blocks the TMA kernel's candidates too; the best
    against the default."""
    kernels = providers.library(TRITON_MOE)
    sms = kernels._sms(x.device)
    experts = blocks[0].experts
    tma = kernels.tma_ready(x, experts.gate_up_proj, experts.down_proj)
    default = kernels.config(x.shape[0], shape.top_k, shape.experts, shape.width, shape.hidden, sms, tma)
    gemms = [kernels.GemmConfig(bn, bk, w, s) for bn, bk, w, s in
             ((32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 256, 4, 2))]  # fmt: skip
    candidates = {default} | {dataclasses.replace(default, gate_up=dataclasses.replace(default.gate_up, group=g),
                                                  down=dataclasses.replace(default.down, group=g)) for g in (0, 4, 16)}
    for bm in (16, 32, 64, 128):  # the pointer kernel at every block size
        base = dataclasses.replace(default, bm=bm, tma=False)
        candidates |= {base} | {dataclasses.replace(base, gate_up=g) for g in gemms}
        candidates |= {dataclasses.replace(base, down=g) for g in gemms}
    if tma:
        base = kernels.config(x.shape[0], shape.top_k, shape.experts, shape.width, shape.hidden, sms, True)
        base = dataclasses.replace(base, bm=128, tma=True)
        tiles = [kernels.GemmConfig(bn, 64, 8, s, g) for bn, s, g in
                 ((128, 3, 0), (128, 4, 0), (128, 3, 8), (128, 4, 8), (128, 4, 16), (256, 3, 8), (256, 4, 8))]  # fmt: skip
        candidates |= {dataclasses.replace(base, gate_up=g) for g in tiles if g.bn == 128}
        candidates |= {dataclasses.replace(base, down=g) for g in tiles}
    timed = {}
    for cfg in candidates:
        try:
            timed[cfg] = graph_ms(lambda cfg=cfg: [fused_call(b, x, shape, cfg) for b in blocks], reps) / len(blocks)
        except Exception as e:  # noqa: BLE001 - out of shared memory: not a candidate
            print(f"sweep {name} T={x.shape[0]} {cfg}: {type(e).__name__}", file=sys.stderr)
    best = min(timed, key=timed.get)
    return [f"| {name} | {x.shape[0]} | {1e3 * timed[best]:.1f} | {best} | {1e3 * timed.get(default, float('nan')):.1f} |"]


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"tokens {','.join(map(str, QUICK_TOKENS))}, 5 replays")
    p.add_argument("--tokens", help=f"comma-separated token counts (default {','.join(map(str, TOKENS))})")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--reps", type=int, help="CUDA graph replays per time (default 20, 5 with --quick)")
    p.add_argument("--sweep", action="store_true", help="also time alternative Triton launch configurations")
    p.add_argument("--out", help="also write the markdown table here")
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(QUICK_TOKENS if args.quick else TOKENS)
    reps = args.reps or (5 if args.quick else 20)
    if not torch.cuda.is_available():
        print("bench_moe needs CUDA", file=sys.stderr)
        return 2
    if providers.library(TRITON_MOE) is None:
        print(f"bench_moe needs Triton: {providers._REGISTRY.import_errors}", file=sys.stderr)
        return 2
    from bench_e2e import Clock
    from torch import _dynamo

    providers.configure("moe=triton")  # a call the kernel cannot take is a counted fallback
    providers.reset_counts()
    configure_dynamo()
    device = torch.device("cuda")
    bandwidth = Clock(device).copy_bandwidth(device, 2 << 30)
    rows: list[Row] = []
    sweeps: list[str] = []
    print("| " + " | ".join(HEADER) + " |", flush=True)
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        torch.manual_seed(0)
        blocks = hf_blocks(shape, device, LAYERS)
        _dynamo.reset()
        compiled = torch.compile(hf_call, fullgraph=True, dynamic=False)
        before = _dynamo.utils.counters["stats"]["unique_graphs"]
        for t in tokens:
            rows.append(measure(name, shape, blocks, t, reps, bandwidth, compiled, sweeps if args.sweep else None))
        graphs = _dynamo.utils.counters["stats"]["unique_graphs"] - before
        print(f"{name}: Inductor compiled {graphs} graph(s) for {len(tokens)} token count(s)", file=sys.stderr)
        del blocks, compiled
        torch.cuda.empty_cache()
    served = providers.served().get("moe", {})
    lines = [
        "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; bf16; copy bandwidth "
        f"{bandwidth / 1e12:.3f} TB/s (read + write); {LAYERS} layers per replay, times per layer, median of "
        f"{reps} replays; fxr.moe served: {served}",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
        *("| " + " | ".join(r.cells()) + " |" for r in rows),
    ]  # fmt: skip
    if sweeps:
        lines += ["", "Sweep: best launch configuration per case against the default", "",
                  "| shape | T | best us | best config | default us |", "|---|---|---|---|---|", *sweeps]  # fmt: skip
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    failed = [r for r in rows if r.checks.get("fxr.moe") != "ok" or r.times.get("fxr.moe") is None]
    fell_back = served.get("fallbacks") or {}
    if failed or fell_back:
        print(f"FAILED: {len(failed)} case(s) where fxr.moe disagrees with the reference or did not run; "
              f"fallbacks {fell_back}", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
