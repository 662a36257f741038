"""Every causal-LM family transformers ships, compiled with fxrewrite on CPU: what fuses, what is
left unfused and why, and the numerics against eager (issue 29).

    python3 bench/coverage.py [--families llama,gpt2] [--jobs 2] [--json coverage.json] [--dtypes float32,bfloat16]
    python3 bench/coverage.py --markdown coverage.json     # the README's table from a JSON run

Families: every entry of transformers' causal-LM auto mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``).
Each is built from its default config shrunk to a tiny shape (bench/shrink.py: hidden 64,
4 heads of 16, 2 KV heads, vocabulary 256, 8 experts of which 2 per token; one layer of each
kind its layer pattern has, at least 2), with random weights, SDPA attention where the family
has it and its eager attention otherwise, and called on input ids ``[2, 16]`` without a cache.

Per family, in float32 and in bf16: ``Backend().compile(model)`` (``fullgraph=True``,
``dynamic=True``) next to Dynamo's own ``eager`` backend. Status:

* ``fused``: every candidate site fused, in every dtype;
* ``partial``: some candidate site left unfused (each listed, with the near miss that explains it
  when there is one: ``unexplained`` counts the others);
* ``fxrewrite fails``: Dynamo's eager backend runs the model and fxrewrite does not (an exception,
  a pass that raised and was skipped, or outputs off eager's);
* ``dynamo fails``: Dynamo's eager backend cannot run it under ``fullgraph=True``;
* ``no build``: the family does not build from its shrunk config (or is a multimodal wrapper
  whose text decoder has an entry of its own, or a draft model that needs its target's states).

Candidate sites (:func:`candidates`, found in the graph after canonicalization and again in the
rewritten graph): norms (``rsqrt`` of a mean, ``layer_norm``, ``rms_norm``), gated activations
(``act(a) * b`` with SiLU or GELU), rotations (``cat(-x2, x1)``, the ``rotate_half`` of RoPE, and
its interleaved form), top-k routers (``topk``). A site is fused when the rewritten graph no longer
holds it. Numerics: float32 output within the verification tolerances of eager's; bf16's error
against the float32 eager output (the mean absolute error over every logit; the largest error
over one small batch is one rounding's luck, kept in the JSON as ``max_err``) at most 1.10x
eager bf16's.

Each family runs in a worker process (``--jobs`` of them) that imports torch once; a family that
crashes or hangs its worker (``--timeout``) costs only its own row.
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

BATCH, TOKENS = 2, 16
BF16_RATIO = 1.10  # the goal: fxrewrite's bf16 error at most this times eager bf16's
MARK = "ROW "

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shrink import TINY, Shape, build, shrunk_config  # noqa: E402, F401 - the shrinker, for scripts that import it from here


def family_names() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# --- candidate sites ---------------------------------------------------------------------------

def _target_name(n: fx.Node) -> str:
    t = n.target
    if n.op == "call_method":
        return str(t)
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def candidates(gm: fx.GraphModule) -> list[dict[str, str]]:
    """The sites in ``gm`` a fused op could serve, each as ``{"kind", "node", "module", "source"}``:
    ``norm`` (an ``rsqrt``, a ``layer_norm`` or ``rms_norm`` call), ``gated_act`` (``silu`` /
    ``gelu`` read by a ``mul`` whose other operand is a tensor), ``rotary`` (a ``cat`` or
    ``stack`` whose first operand is a negation), ``router`` (a ``topk`` over a dimension of
    fixed size: a router picks among a fixed number of experts or expert groups; a top-k over a
    dynamic dimension picks tokens or keys, as sparse attention's indexers do, and is no router).
    On a rewritten graph: what is left unfused."""
    from fxrewrite import meta

    found = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        name = _target_name(n)
        kind = None
        if name in ("rsqrt", "layer_norm", "native_layer_norm", "rms_norm", "group_norm") and not _is_fxr(n):
            kind = "norm"
        elif name in ("silu", "gelu") and any(_is_gate_mul(u, n) for u in n.users):
            kind = "gated_act"
        elif name in ("cat", "stack") and _first_negated(n):
            kind = "rotary"
        elif name == "topk" and _over_fixed_size(n):
            kind = "router"
        if kind is not None:
            found.append({"kind": kind, "node": n.name, "module": meta.module_path(n), "source": meta.source_line(n)})
    return found


def _over_fixed_size(n: fx.Node) -> bool:
    """``n``, a top-k, picks along a dimension whose size is an int (not a symbol of the
    sequence, under ``dynamic=True``)."""
    x = _value(n.args[0]) if n.args else None
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return True
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", -1)
    return isinstance(x.shape[dim], int)


def _is_fxr(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "fxr"


def _is_gate_mul(u: fx.Node, act: fx.Node) -> bool:
    if _target_name(u) not in ("mul", "__mul__"):
        return False
    other = [a for a in u.args if a is not act]
    return len(other) == 1 and isinstance(other[0], fx.Node) and isinstance(_value(other[0]), torch.Tensor) \
        and _value(other[0]).dim() > 0  # fmt: skip


def _value(n: fx.Node) -> Any:
    from fxrewrite import meta

    return meta.value(n)


def _first_negated(n: fx.Node) -> bool:
    seq = n.args[0] if n.args else n.kwargs.get("tensors")
    if not isinstance(seq, (list, tuple)) or len(seq) != 2 or not isinstance(seq[0], fx.Node):
        return False
    return _target_name(seq[0]) in ("neg", "__neg__")


# --- one family ------------------------------------------------------------------------------

def _logits(out: Any) -> torch.Tensor:
    from fxrewrite import models

    return models.hidden_states(out).float()


class _Capture:
    """A backend that records the canonicalized graph's candidate sites before handing the graph on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.before: list[list[dict[str, str]]] = []
        if hasattr(inner, "backend_ctx_ctor"):
            self.backend_ctx_ctor = inner.backend_ctx_ctor

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        from fxrewrite.canonicalize import canonicalize

        seen = copy.deepcopy(gm)
        for a, b in zip(gm.graph.nodes, seen.graph.nodes):
            b.meta = dict(a.meta)
        canonicalize(seen)
        self.before.append(candidates(seen))
        return self.inner(gm, example_inputs)


def _explained(site: dict[str, str], misses: list[Any], rejected: Sequence[Any] = (),
               near: frozenset[str] | set[str] = frozenset()) -> str | None:  # fmt: skip
    """What explains an unfused site: a match at it, or at a node that reads it (``near``), that
    was rejected (verification could not check it, ...); else the near miss in its module or a
    module around it."""
    for r in rejected:
        if r.site == site["node"] or r.site in near:
            return f"{r.rule} rejected: {r.reason}"
    mod = site["module"]
    for m in misses:
        mm = getattr(m, "module", "") or ""
        if mod and mm and (mod == mm or mod.startswith(mm + ".") or mm.startswith(mod + ".")):
            return f"{m.rule}: {m.reason}"
        if site["source"] and m.source == site["source"]:
            return f"{m.rule}: {m.reason}"
    return None


def run_dtype(model: torch.nn.Module, ids: torch.Tensor, ref32: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """One dtype of one family: compile with the backend, compare, list the sites."""
    import fxrewrite
    from fxrewrite.tolerances import TOLERANCES

    m = copy.deepcopy(model).to(dtype)
    with torch.no_grad():
        eager = _logits(m(ids))
    torch._dynamo.reset()
    backend = fxrewrite.Backend()
    capture = _Capture(backend)
    compiled = torch._dynamo.optimize(capture, nopython=True, dynamic=True)(m)
    row: dict[str, Any] = {"dtype": str(dtype).split(".")[-1]}
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            out = _logits(compiled(ids))
    except Exception as e:  # noqa: BLE001 - the row says what broke
        row.update(ok=False, error=f"{type(e).__name__}: {_first_line(e)}", trace=traceback.format_exc()[-2000:])
        return row
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    report = backend.report
    before = [s for g in capture.before for s in g]
    after = [s for g in backend.graphs for s in candidates(g)]
    misses = report.near_misses
    readers = {n.name: {u.name for u in n.users} for g in backend.graphs for n in g.graph.nodes}
    left = []
    for s in after:
        left.append(dict(s, why=_explained(s, misses, report.rejected, readers.get(s["node"], set()))))
    row.update(
        ok=True,
        graphs=len(backend.graphs),
        candidates=dict(collections.Counter(s["kind"] for s in before)),
        unfused=dict(collections.Counter(s["kind"] for s in after)),
        left=left,
        fused=report.fused_ops(),
        rules=report.rules(),
        near_misses=[f"{m.rule} at {m.site} ({m.source}): {m.reason}" for m in misses],
        rejected=[f"{r.rule} at {r.site} ({r.source}): {r.reason}" for r in report.rejected],
        pass_errors=[n for g in report.graphs for n in getattr(g, "pass_errors", [])],
    )
    if dtype == torch.float32:
        rtol, atol = TOLERANCES[torch.float32]
        err = (out - eager).abs().max().item()
        row["err_vs_eager"] = err
        row["numerics_ok"] = bool(torch.allclose(out, eager, rtol=rtol, atol=atol))
    else:
        # the mean over every logit: a largest error over one small batch is one rounding's luck
        err = (out - ref32).abs().mean().item()
        err_eager = (eager - ref32).abs().mean().item()
        row["err"], row["err_eager"] = err, err_eager
        row["max_err"], row["max_err_eager"] = (out - ref32).abs().max().item(), (eager - ref32).abs().max().item()
        row["ratio"] = err / err_eager if err_eager else (1.0 if err == 0 else float("inf"))
        row["numerics_ok"] = row["ratio"] <= BF16_RATIO
    return row


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines() or [""])[0][:300]


def run_family(family: str, dtypes: tuple[torch.dtype, ...]) -> dict[str, Any]:
    row: dict[str, Any] = {"family": family}
    try:
        model, attn = build(family)
    except Exception as e:  # noqa: BLE001
        return dict(row, status="no build", error=f"{type(e).__name__}: {_first_line(e)}")
    row["attention"] = attn
    row["params"] = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    vocab = getattr(model.config, "vocab_size", None) or getattr(model.config.get_text_config(), "vocab_size", TINY.vocab)
    ids = torch.randint(0, min(vocab, TINY.vocab), (BATCH, TOKENS), generator=g)
    try:
        with torch.no_grad():
            ref32 = _logits(model(ids))
    except Exception as e:  # noqa: BLE001
        return dict(row, status="no build", error=f"eager forward: {type(e).__name__}: {_first_line(e)}")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model, backend="eager", fullgraph=True, dynamic=True)(ids)
    except Exception as e:  # noqa: BLE001
        return dict(row, status="dynamo fails", error=f"{type(e).__name__}: {_first_line(e)}")
    row["dtypes"] = [run_dtype(model, ids, ref32, dt) for dt in dtypes]
    row["status"] = status(row)
    return row


def status(row: dict[str, Any]) -> str:
    rows = row["dtypes"]
    if any(not r["ok"] or r["pass_errors"] or not r["numerics_ok"] for r in rows):
        return "fxrewrite fails"
    if any(r["unfused"] for r in rows):
        return "partial"
    return "fused"


# --- workers ---------------------------------------------------------------------------------

def _worker(dtypes: tuple[torch.dtype, ...]) -> int:
    """Read family names from stdin, one per line; print each row as JSON after MARK."""
    import logging

    logging.disable(logging.WARNING)
    for line in sys.stdin:
        family = line.strip()
        if not family:
            continue
        try:
            row = run_family(family, dtypes)
        except Exception as e:  # noqa: BLE001
            row = {"family": family, "status": "fxrewrite fails", "error": f"{type(e).__name__}: {_first_line(e)}"}
        print(MARK + json.dumps(row, default=str), flush=True)
    return 0


def _run_all(families: list[str], jobs: int, timeout: float, dtypes: str, progress: bool) -> list[dict[str, Any]]:
    todo: queue.Queue[str] = queue.Queue()
    for f in families:
        todo.put(f)
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    bar = _Progress(len(families), progress)

    def serve() -> None:
        proc: subprocess.Popen[str] | None = None
        while True:
            try:
                family = todo.get_nowait()
            except queue.Empty:
                break
            if proc is None or proc.poll() is not None:
                proc = subprocess.Popen([sys.executable, __file__, "--worker", "--dtypes", dtypes], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
            row = _ask(proc, family, timeout)
            if row is None:
                proc.kill()
                proc.wait()
                proc = None
                row = {"family": family, "status": "fxrewrite fails", "error": f"worker died or timed out ({timeout:.0f} s)"}
            with lock:
                rows.append(row)
                bar.step(family, row.get("status", "?"))
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
            proc.wait()

    threads = [threading.Thread(target=serve) for _ in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.done()
    order = {f: i for i, f in enumerate(families)}
    return sorted(rows, key=lambda r: order[r["family"]])


def _ask(proc: subprocess.Popen[str], family: str, timeout: float) -> dict[str, Any] | None:
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(family + "\n")
        proc.stdin.flush()
    except BrokenPipeError:
        return None
    result: list[dict[str, Any]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(MARK):
                result.append(json.loads(line[len(MARK):]))
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    return result[0] if result else None


class _Progress:
    """One line per family on stderr: done/total, elapsed, the family and its status."""

    def __init__(self, total: int, on: bool) -> None:
        self.total, self.on, self.n, self.t0 = total, on, 0, time.monotonic()

    def step(self, family: str, status: str) -> None:
        self.n += 1
        if self.on:
            sys.stderr.write(f"[{self.n:3d}/{self.total}] {time.monotonic() - self.t0:6.0f} s  {family}: {status}\n")
            sys.stderr.flush()

    def done(self) -> None:
        if self.on:
            sys.stderr.write(f"{self.total} families in {time.monotonic() - self.t0:.0f} s\n")


# --- output ----------------------------------------------------------------------------------

def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = collections.Counter(r["status"] for r in rows)
    runs = [r for r in rows if r["status"] in ("fused", "partial", "fxrewrite fails")]
    unexplained = sum(1 for r in rows for d in r.get("dtypes", []) for s in d.get("left", []) if not s.get("why"))
    return {
        "families": len(rows), **{k: by.get(k, 0) for k in ("fused", "partial", "fxrewrite fails", "dynamo fails", "no build")},
        "fused_share": by.get("fused", 0) / len(runs) if runs else 0.0,
        "unexplained_unfused_sites": unexplained,
    }


def _cell_sites(d: dict[str, Any]) -> str:
    cand, left = d.get("candidates", {}), d.get("unfused", {})
    return " ".join(f"{k} {cand[k] - left.get(k, 0)}/{cand[k]}" for k in sorted(cand)) or "-"


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["family", "status", "attention", "float32: fused/candidates", "bf16: fused/candidates", "fused ops (bf16)",
            "bf16 error / eager's", "what is left, and why"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ds = {d["dtype"]: d for d in r.get("dtypes", [])}
        f32, b16 = ds.get("float32", {}), ds.get("bfloat16", {})
        if "dtypes" not in r:
            lines.append(f"| {r['family']} | {r['status']} | {r.get('attention', '-')} | | | | | {r.get('error', '')[:140]} |")
            continue
        why = sorted({(s.get("why") or f"UNEXPLAINED {s['kind']} at {s['source']}")[:120]
                      for d in r["dtypes"] for s in d.get("left", [])})  # fmt: skip
        errs = [f"{d['dtype']}: {d['error'][:100]}" for d in r["dtypes"] if not d.get("ok")]
        errs += [f"{d['dtype']} pass error: {e[:100]}" for d in r["dtypes"] for e in d.get("pass_errors", [])]
        errs += [f"float32 off eager by {d['err_vs_eager']:.1e}" for d in r["dtypes"]
                 if d.get("ok") and d["dtype"] == "float32" and not d["numerics_ok"]]  # fmt: skip
        lines.append("| " + " | ".join([
            r["family"], r["status"], r.get("attention", "-"), _cell_sites(f32), _cell_sites(b16),
            " ".join(f"{k} {v}" for k, v in sorted(b16.get("fused", {}).items())) or "-",
            f"{b16['ratio']:.2f}" if b16.get("ok") else "-",
            "; ".join(errs + why)[:400] or "-"]) + " |")
    return "\n".join(lines)


def _why(r: dict[str, Any]) -> list[str]:
    """What a row leaves unfused, by kind, with the reason (near miss) or UNEXPLAINED; errors."""
    if "dtypes" not in r:
        return [r.get("error", "")[:160]]
    out = [f"{d['dtype']}: {d['error'][:120]}" for d in r["dtypes"] if not d.get("ok")]
    out += [f"{d['dtype']}: PASS FAILED {e[:120]}" for d in r["dtypes"] for e in d.get("pass_errors", [])]
    out += [f"{d['dtype']} error {d['ratio']:.2f}x eager's" for d in r["dtypes"]
            if d.get("ok") and d["dtype"] != "float32" and not d["numerics_ok"]]  # fmt: skip
    out += [f"float32 off eager by {d['err_vs_eager']:.1e}" for d in r["dtypes"]
            if d.get("ok") and d["dtype"] == "float32" and not d["numerics_ok"]]  # fmt: skip
    left = collections.Counter((s["kind"], (s.get("why") or "UNEXPLAINED").split(" (", 1)[0][:110])
                               for d in r["dtypes"] for s in d.get("left", []))  # fmt: skip
    return out + [f"{kind}: {why}" for (kind, why), _ in sorted(left.items())]


def readme(rows: list[dict[str, Any]], when: str = "") -> str:
    """The README's coverage section: the summary, the fused families by name, a row for each
    other family with what it leaves and why."""
    s = summary(rows)
    runs = s["fused"] + s["partial"] + s["fxrewrite fails"]
    lines = [f"{s['families']} families{when}: {runs} run under Dynamo with `fullgraph=True`; of those {s['fused']} "
             f"({s['fused_share']:.0%}) fuse every candidate site in float32 and bf16, {s['partial']} leave some "
             f"unfused, {s['fxrewrite fails']} fail with fxrewrite; {s['dynamo fails']} do not run under Dynamo, "
             f"{s['no build']} do not build from a config. Unfused sites without a near miss: "
             f"{s['unexplained_unfused_sites']}.", "",
             "Every candidate site fused: " + ", ".join(r["family"] for r in rows if r["status"] == "fused") + ".", "",
             "| family | status | left unfused (kind: why), errors |", "|---|---|---|"]  # fmt: skip
    for r in rows:
        if r["status"] != "fused":
            lines.append(f"| {r['family']} | {r['status']} | {'; '.join(_why(r)) or '-'} |".replace("\n", " "))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=None, help="comma-separated (default: every causal-LM family)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--timeout", type=float, default=600, help="seconds per family before its worker is killed")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--markdown", default=None, metavar="JSON", help="print the table of an earlier --json run")
    p.add_argument("--readme", action="store_true", help="print the README's section instead of the full table")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    dtypes = tuple(getattr(torch, d) for d in args.dtypes.split(","))
    if args.worker:
        return _worker(dtypes)
    when = ""
    if args.markdown:
        with open(args.markdown) as f:
            data = json.load(f)
        rows, when = data["rows"], f" (transformers {data['transformers']}, torch {data['torch']}, {data['date']})"
    else:
        families = args.families.split(",") if args.families else family_names()
        rows = _run_all(families, args.jobs, args.timeout, args.dtypes, not args.quiet)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"summary": summary(rows), "rows": rows, "torch": torch.__version__,
                           "transformers": _tf_version(),
                           "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"}, f, indent=1)
    print(readme(rows, when) if args.readme else markdown(rows))
    s = summary(rows)
    print(f"\ntorch {torch.__version__}, transformers {_tf_version()}: " + ", ".join(f"{k} {v if not isinstance(v, float) else f'{v:.0%}'}" for k, v in s.items()))
    return 1 if s["fxrewrite fails"] else 0


def _tf_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    sys.exit(main())
