"""Several models captured one after another in one process, on a poisoned allocator (issue 19).

A serving process compiles several models (a draft and a target, a model reloaded). Every buffer
that a warm-up, a capture or a replay reads must hold valid values by then: what the caching
allocator hands back is whatever an earlier model left there. Here the allocator is poisoned
before each compile (blocks filled with a large int64 pattern, then freed:
``fxrewrite.testing.poison_allocator``), so an index read before it was written goes far out of
bounds at once and the device asserts, in every run, not only after an unlucky earlier model.

The scenario runs in a process of its own (a device assert kills the CUDA context, and with it
every later GPU test of this process): HF Llama in bf16 compiled in mode "none", then the same
model object again, after ``torch._dynamo.reset()``, in "piecewise" and "full" with the default
capture sizes (1 .. 512), called at (1, 9), (4, 17), (1, 1), (8, 1); a causal LM with its KV cache
on, through plain ``torch.compile`` (floats lifted), piecewise and full; then the serving-engine model
of ``bench/engine_model.py`` (its own attention op, KV cache, flat tokens) piecewise and full,
prefill then decode. Every output is compared with eager.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCENARIO = """
import copy, sys, torch
sys.path.insert(0, sys.argv[1])  # bench/: the serving-engine model
import fxrewrite
from fxrewrite import models
from fxrewrite.testing import poison_allocator

def close(out, ref, what):
    rel = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert rel < 3e-2, f"{what}: relative error {rel:.3g}"

torch.manual_seed(0)
llama = models.build("llama", layers=2, hidden=512, heads=8, kv_heads=2, vocab=1024, dtype=torch.bfloat16).cuda()
eager = copy.deepcopy(llama)
shapes = ((1, 9), (4, 17), (1, 1), (8, 1))
with torch.no_grad():
    for mode in ("none", "piecewise", "full"):
        torch._dynamo.reset()
        poison_allocator()
        backend = fxrewrite.Backend(mode=mode, progress=False)
        compiled = backend.compile(llama)  # the same module each time, as a reloading server does
        for shape in shapes:
            ids = torch.randint(0, 1024, shape, device="cuda")
            for _ in range(2):
                close(models.hidden_states(compiled(ids)), models.hidden_states(eager(ids)), f"llama {mode} {shape}")
        torch.cuda.synchronize()
        print("ok llama", mode, [r.stats()["replays"] for r in backend.runners if hasattr(r, "stats")], flush=True)

    # as a new user writes it: plain torch.compile (floats lifted to host scalars), a causal LM
    # with its KV cache on (use_cache=True: the cache positions come from the cache)
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)
    lm = transformers.LlamaForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    lm_eager = copy.deepcopy(lm)
    for mode in ("piecewise", "full"):
        torch._dynamo.reset()
        poison_allocator()
        compiled = torch.compile(lm, backend=fxrewrite.Backend(mode=mode, progress=False), fullgraph=True, dynamic=True)
        for shape in shapes:
            ids = torch.randint(0, 1024, shape, device="cuda")
            close(compiled(ids).logits, lm_eager(ids).logits, f"causal lm {mode} {shape}")
        torch.cuda.synchronize()
        print("ok causal lm", mode, flush=True)

    from engine_model import SPLITTING_OPS, build_model, make_batch, mark_static_metadata, tiny
    cfg = tiny()
    for mode in ("piecewise", "full"):
        torch._dynamo.reset()
        poison_allocator()
        model = build_model(cfg, device="cuda", dtype=torch.bfloat16)
        model.allocate_kv_cache(4, 64)
        ref = build_model(cfg, device="cuda", dtype=torch.bfloat16)
        ref.allocate_kv_cache(4, 64)
        # sizes the steps take exactly: this engine keeps no dummy KV slot for padded rows to write;
        # a prefill of several sequences reads their lengths on the host, so in mode full (attention
        # inside the graph) only the decode sizes are captured and the prefill runs eagerly
        sizes = (3, 4, 9) if mode == "piecewise" else (3, 4)
        backend = fxrewrite.Backend(mode=mode, splitting_ops=SPLITTING_OPS, capture_sizes=sizes, progress=False)
        compiled = backend.compile(model)
        for kind, size, context in (("prefill", 9, 0), ("decode", 3, 9), ("decode", 4, 10)):
            batch = mark_static_metadata(make_batch(cfg, kind, size, context, num_seqs=min(size, 3), max_len=64, device="cuda"))
            close(compiled(**batch), ref(**batch), f"engine {mode} {kind} {size}")
        torch.cuda.synchronize()
        print("ok engine", mode, flush=True)
print("ALL OK")
"""


def test_models_captured_one_after_another_on_a_poisoned_allocator() -> None:
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(ROOT / "bench")], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-6000:]
