"""Command line: ``python -m fxrewrite report --model llama --layers 2 [--json] [--dump DIR]``
and ``python -m fxrewrite bisect --model llama --rules pkg.module:RULES --tol 1e-4``.

Compiles a built-in model (transformers config, tiny widths, random weights, no download) with
the fxrewrite backend and prints the report: passes, fused sites, near misses, node counts, and
the compiled output's error against eager.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _report(args: argparse.Namespace) -> int:
    import fxrewrite
    from fxrewrite import models

    model = models.build(args.model, layers=args.layers, hidden=args.hidden, dtype=DTYPES[args.dtype])
    inputs = models.example_inputs(model, tokens=args.tokens)
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
        doc.update(model=args.model, layers=args.layers, dtype=args.dtype, compile_s=round(compile_s, 4),
                   max_abs_err=err, dynamic=not args.static)  # fmt: skip
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(f"{args.model}, {args.layers} layers, {args.dtype}, dynamic={not args.static}: "
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
    from fxrewrite.models import MODELS

    parser = argparse.ArgumentParser(prog="python -m fxrewrite", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="compile a built-in model and print what was fused and why not")
    rep.add_argument("--model", choices=MODELS, default="llama")
    _model_options(rep)
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
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
