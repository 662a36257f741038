"""Every causal-LM family transformers ships, compiled with fxrewrite on CPU: what fuses, what is
left unfused and why, and the numerics against eager (issue 29).

    python3 bench/coverage.py [--families llama,gpt2] [--jobs 2] [--json coverage.json] [--dtypes float32,bfloat16]
    python3 bench/coverage.py --markdown coverage.json     # the README's table from a JSON run

Families: every entry of transformers' causal-LM auto mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``).
Each is built from its default config shrunk to a tiny shape (:func:`shrunk_config`: hidden 64,
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
  whose text decoder has an entry of its own).

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
import dataclasses
import datetime
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.fx as fx

BATCH, TOKENS = 2, 16
BF16_RATIO = 1.10  # the goal: fxrewrite's bf16 error at most this times eager bf16's
MARK = "ROW "

@dataclasses.dataclass(frozen=True)
class Shape:
    """The shrunk shape every family is built at (``hidden`` = ``heads * head_dim``)."""

    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256
    experts: int = 8
    top_k: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = Shape()


def _sizes(shape: Shape) -> dict[str, int]:
    """Config fields, by name, and the value of each at ``shape``. Fields a config lacks are not
    added. Names that several families share; a family-specific name is still a size."""
    HIDDEN, HEADS, HEAD_DIM, VOCAB, EXPERTS = shape.hidden, shape.heads, shape.head_dim, shape.vocab, shape.experts
    return {
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "dim": HIDDEN, "embed_dim": HIDDEN,
    "word_embed_proj_dim": HIDDEN, "hidden_dim": HIDDEN,
    "intermediate_size": 2 * HIDDEN, "ffn_hidden_size": 2 * HIDDEN, "n_inner": 2 * HIDDEN, "ffn_dim": 2 * HIDDEN,
    "intermediate_size_mlp": 2 * HIDDEN, "decoder_ffn_dim": 2 * HIDDEN, "encoder_ffn_dim": 2 * HIDDEN,
    "moe_intermediate_size": HIDDEN // 2, "shared_expert_intermediate_size": HIDDEN, "expert_intermediate_size": HIDDEN // 2,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "decoder_attention_heads": HEADS, "encoder_attention_heads": HEADS,
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "attention_head_dim": HEAD_DIM,
    "vocab_size": VOCAB, "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256,
    "num_experts": EXPERTS, "n_routed_experts": EXPERTS, "num_local_experts": EXPERTS, "moe_num_experts": EXPERTS,
    # multi-head latent attention (DeepSeek)
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 24,
    # linear attention and state-space layers
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "mamba_dt_rank": 8, "time_step_rank": 8, "mamba_d_head": 16, "mamba_n_heads": 8, "mamba_head_dim": 16,
    "ssm_state_size": 16, "mamba_d_state": 16, "state_size": 16,
    "attention_chunk_size": 256, "sliding_window": 256, "attention_window_size": 256, "window_size": 256,
    }  # fmt: skip
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k", "moe_k", "num_experts_per_token")
# Periodic layer patterns: every ``period``-th layer from ``offset`` is of the other kind
# (Jamba's attention and experts): period 2, offset 1 keeps both kinds in two layers.
_PERIODS = ("attn_layer_period", "expert_layer_period", "decoder_sparse_step", "moe_layer_freq",
            "interleave_moe_layer_step", "no_rope_layer_interval", "moe_every_k_layers")  # fmt: skip
_OFFSETS = ("attn_layer_offset", "expert_layer_offset")
_FIRST_DENSE = ("first_k_dense_replace", "first_dense_layers", "num_dense_layers", "moe_layer_start_index")


def family_names() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _layer_count(cfg: Any) -> tuple[str, int] | None:
    for name in _LAYERS:
        v = getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return name, v
    return None


def _kept_layers(cfg: Any, n: int) -> list[int]:
    """Which of ``n`` layers to keep: the first of each kind its per-layer lists give (a layer's
    kind: its entry in every list of length ``n``), at least two."""
    lists = [v for v in vars(cfg).values() if isinstance(v, (list, tuple)) and len(v) == n and n > 2
             and not _is_index_list(v, n)]  # fmt: skip
    seen: dict[Any, int] = {}
    for i in range(n):
        seen.setdefault(tuple(repr(v[i]) for v in lists), i)
    keep = sorted(seen.values())
    for i in range(n):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep = sorted(keep + [i])
    return keep


def _is_index_list(v: Any, n: int) -> bool:
    return bool(v) and all(isinstance(i, int) and not isinstance(i, bool) for i in v) and list(v) == sorted(set(v)) \
        and max(v) < n and (len(v) < n or list(v) == list(range(n)))  # fmt: skip


def _shrink(cfg: Any, shape: Shape) -> None:
    """Shrink ``cfg`` in place to ``shape`` (see the module docstring)."""
    d = vars(cfg)
    heads_before = d.get("num_attention_heads", d.get("n_head"))
    VOCAB = shape.vocab
    for name, value in _sizes(shape).items():
        if isinstance(d.get(name), int) and not isinstance(d.get(name), bool):
            setattr(cfg, name, value)
    for name in _KV_HEADS:
        v = d.get(name)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(cfg, name, shape.heads if v == heads_before else (1 if v == 1 else shape.kv_heads))
    for name in _TOP_K:
        if isinstance(d.get(name), int) and not isinstance(d.get(name), bool):
            setattr(cfg, name, min(d[name], shape.top_k))
    if isinstance(d.get("n_group"), int) and d["n_group"] > 1:  # group-limited routing: 4 groups, 2 picked
        cfg.n_group, cfg.topk_group = 4, min(2, d.get("topk_group") or 2)
    for name in _PERIODS:
        if isinstance(d.get(name), int) and d[name] > 1:
            setattr(cfg, name, 2)
    for name in _OFFSETS:
        if isinstance(d.get(name), int):
            setattr(cfg, name, 1)
    for name in _FIRST_DENSE:
        if isinstance(d.get(name), int) and d[name] > 1:
            setattr(cfg, name, 1)
    for name, v in list(d.items()):
        if name.endswith("token_id") and isinstance(v, int) and v >= VOCAB:
            setattr(cfg, name, VOCAB - 1)
        elif name.endswith("token_id") and isinstance(v, list):
            setattr(cfg, name, [min(t, VOCAB - 1) if isinstance(t, int) else t for t in v])
    found = _layer_count(cfg)
    if found is not None:
        name, n = found
        keep = _kept_layers(cfg, n)
        for k, v in list(d.items()):
            if isinstance(v, (list, tuple)) and n > 2:
                if _is_index_list(v, n):
                    setattr(cfg, k, type(v)(j for j, i in enumerate(keep) if i in v))
                elif len(v) == n:
                    setattr(cfg, k, type(v)(v[i] for i in keep))
        setattr(cfg, name, len(keep))
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False


def shrunk_config(family: str, shape: Shape = TINY) -> Any:
    """The family's default config at ``shape`` (text sub-configs shrunk too)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[family]()
    _shrink(cfg, shape)
    for sub in getattr(cfg, "sub_configs", {}) or {}:
        sc = getattr(cfg, sub, None)
        if sc is not None and hasattr(sc, "to_dict"):
            _shrink(sc, shape)
    return cfg


def build(family: str, shape: Shape = TINY, seed: int = 0) -> tuple[torch.nn.Module, str]:
    """The family's causal LM at ``shape``, float32, eval mode, and the attention it runs
    (SDPA where the family has it, else its eager attention)."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]
    if "ConditionalGeneration" in cls_name:
        raise NotImplementedError(f"{cls_name} is a multimodal model, not a text decoder")
    cls = getattr(tf, cls_name)
    last: Exception | None = None
    for attn in ("sdpa", "eager"):
        cfg = shrunk_config(family, shape)
        torch.manual_seed(seed)
        try:
            model = cls._from_config(cfg, attn_implementation=attn)
            return model.eval(), attn
        except (ValueError, ImportError) as e:
            if "attn" not in str(e).lower() and "attention" not in str(e).lower():
                raise
            last = e
    assert last is not None
    raise last


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
    ``stack`` whose first operand is a negation), ``router`` (``topk``). On a rewritten graph:
    what is left unfused."""
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
        elif name == "topk":
            kind = "router"
        if kind is not None:
            found.append({"kind": kind, "node": n.name, "module": meta.module_path(n), "source": meta.source_line(n)})
    return found


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


def _explained(site: dict[str, str], misses: list[Any]) -> str | None:
    """The near miss that explains an unfused site: one in its module or a module around it."""
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
    left = []
    for s in after:
        left.append(dict(s, why=_explained(s, misses)))
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=None, help="comma-separated (default: every causal-LM family)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--timeout", type=float, default=600, help="seconds per family before its worker is killed")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--markdown", default=None, metavar="JSON", help="print the table of an earlier --json run")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    dtypes = tuple(getattr(torch, d) for d in args.dtypes.split(","))
    if args.worker:
        return _worker(dtypes)
    if args.markdown:
        with open(args.markdown) as f:
            rows = json.load(f)["rows"]
    else:
        families = args.families.split(",") if args.families else family_names()
        rows = _run_all(families, args.jobs, args.timeout, args.dtypes, not args.quiet)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"summary": summary(rows), "rows": rows, "torch": torch.__version__,
                           "transformers": _tf_version(),
                           "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"}, f, indent=1)
    print(markdown(rows))
    s = summary(rows)
    print(f"\ntorch {torch.__version__}, transformers {_tf_version()}: " + ", ".join(f"{k} {v if not isinstance(v, float) else f'{v:.0%}'}" for k, v in s.items()))
    return 1 if s["fxrewrite fails"] else 0


def _tf_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    sys.exit(main())
