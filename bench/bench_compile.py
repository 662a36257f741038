"""Compile time of fxrewrite against Dynamo alone and Inductor, on the serving-engine model.

    python -m pytest bench/bench_compile.py --benchmark-only [--benchmark-json=compile.json]

Two families of benchmarks, on a narrow model (``engine_model.tiny`` widths: what costs compile
time is the node count, so the layer count is the variable):

``test_first_call``  the first call of ``torch.compile(model, backend=..., fullgraph=True,
                     dynamic=True)`` on a 16-token prefill, after ``torch._dynamo.reset()``, at
                     2, 8 and 32 layers, for: ``fxrewrite`` (``fxrewrite.Backend()``, default
                     rules, no CUDA graphs), ``dynamo-eager`` (``backend="eager"``: the Dynamo
                     floor every system pays), ``inductor`` (default mode) and, on GPU only,
                     ``inductor-max-autotune`` (``mode="max-autotune-no-cudagraphs"``). Inductor
                     runs cold: ``force_disable_caches`` gives every compile fresh on-disk and
                     in-memory caches (a first model start, not a restart).
``test_rewrite_only`` the fxrewrite backend alone on a graph Dynamo has already captured (a
                     deep copy per round), at 2, 8, 32 and 128 layers: the time our passes add.

Environment:
    FXREWRITE_BENCH_INDUCTOR  1 runs the Inductor rows; default 1 on GPU, 0 on CPU (Inductor on
                              CPU compiles C++ and takes about a minute at 32 layers).
    FXREWRITE_BENCH_ROUNDS    rounds per benchmark; default 3 on GPU, 2 on CPU.
    FXREWRITE_BENCH_INDUCTOR_ROUNDS  rounds of the Inductor rows; default 1 (a cold compile
                              varies little next to its length, and max-autotune takes minutes).

The node counts before and after rewriting, and the fused ops, go to ``extra_info`` of each
fxrewrite benchmark (see ``--benchmark-json``).
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fxrewrite  # noqa: E402
from engine_model import EngineLlama, build_model, make_batch, mark_static_metadata, tiny  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
ROUNDS = int(os.environ.get("FXREWRITE_BENCH_ROUNDS", "3" if ON_GPU else "2"))
INDUCTOR_ROUNDS = int(os.environ.get("FXREWRITE_BENCH_INDUCTOR_ROUNDS", "1"))
RUN_INDUCTOR = os.environ.get("FXREWRITE_BENCH_INDUCTOR", "1" if ON_GPU else "0") not in ("", "0")
LAYERS = (2, 8, 32)
REWRITE_LAYERS = (2, 8, 32, 128)
TOKENS, MAX_LEN = 16, 64

Compiler = Callable[[torch.nn.Module], Callable[..., Any]]


def _inductor(mode: str | None) -> Compiler:
    def compile_(model: torch.nn.Module) -> Callable[..., Any]:
        return torch.compile(model, mode=mode, fullgraph=True, dynamic=True)

    return compile_


def _with_backend(backend: Any) -> Compiler:
    def compile_(model: torch.nn.Module) -> Callable[..., Any]:
        return backend.compile(model)

    return compile_


def _systems() -> dict[str, Compiler | str]:
    """Name -> a function that compiles a model, or the reason the system is skipped here."""
    systems: dict[str, Compiler | str] = {
        "fxrewrite": lambda model: _with_backend(fxrewrite.Backend())(model),
        "dynamo-eager": _with_backend("eager"),
    }
    off = "Inductor rows off (FXREWRITE_BENCH_INDUCTOR=0; default on CPU)"
    systems["inductor"] = _inductor(None) if RUN_INDUCTOR else off
    if not ON_GPU:
        systems["inductor-max-autotune"] = "max-autotune-no-cudagraphs runs on GPU only"
    else:
        systems["inductor-max-autotune"] = _inductor("max-autotune-no-cudagraphs") if RUN_INDUCTOR else off
    return systems


SYSTEMS = _systems()


@functools.cache
def _model(layers: int) -> tuple[EngineLlama, dict[str, torch.Tensor]]:
    cfg = tiny(num_layers=layers)
    model = build_model(cfg, device=DEVICE, dtype=DTYPE, seed=0)
    model.allocate_kv_cache(1, MAX_LEN)
    return model, mark_static_metadata(make_batch(cfg, "prefill", TOKENS, max_len=MAX_LEN, device=DEVICE))


def _sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


@pytest.fixture(scope="module", autouse=True)
def _cold_inductor_and_warm_process() -> Any:
    """Cold Inductor caches for every compile; one throwaway compile per backend family first
    (Dynamo, fxrewrite, default Inductor), so the first measured round does not also pay the
    process's one-time imports and compile-worker startup."""
    with torch._inductor.config.patch(force_disable_caches=True):
        model, batch = _model(2)
        for name in ("dynamo-eager", "fxrewrite", "inductor"):
            compile_ = SYSTEMS[name]
            if callable(compile_):
                torch._dynamo.reset()
                compile_(model)(**batch)
        torch._dynamo.reset()
        yield


@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("system", list(SYSTEMS))
def test_first_call(benchmark: Any, system: str, layers: int) -> None:
    """Seconds from a fresh Dynamo to the end of the first call (capture + backend + run)."""
    compile_ = SYSTEMS[system]
    if not callable(compile_):
        pytest.skip(compile_)
    model, batch = _model(layers)

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        torch._dynamo.reset()
        _sync()
        return (), {}

    def first_call() -> None:
        compile_(model)(**batch)  # the backend's construction counts too
        _sync()

    rounds = INDUCTOR_ROUNDS if system.startswith("inductor") else ROUNDS
    benchmark.pedantic(first_call, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(layers=layers, device=DEVICE, dtype=str(DTYPE))
    torch._dynamo.reset()


@functools.cache
def _captured(layers: int) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The Dynamo graph of the model at ``layers`` layers and its example inputs, captured once."""
    model, batch = _model(layers)
    captured: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        captured.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=keep, fullgraph=True, dynamic=True)(**batch)
    torch._dynamo.reset()
    return captured[0]


@pytest.mark.parametrize("layers", REWRITE_LAYERS)
def test_rewrite_only(benchmark: Any, layers: int) -> None:
    """Seconds the fxrewrite backend takes on an already captured graph (default rules, no
    CUDA graphs): canonicalize, match and replace, cleanup."""
    gm, example_inputs = _captured(layers)
    backends: list[fxrewrite.Backend] = []

    def setup() -> tuple[tuple[fxrewrite.Backend, torch.fx.GraphModule], dict[str, Any]]:
        backends.append(fxrewrite.Backend())
        return (backends[-1], copy.deepcopy(gm)), {}

    def rewrite(backend: fxrewrite.Backend, graph: torch.fx.GraphModule) -> None:
        backend(graph, example_inputs)

    benchmark.pedantic(rewrite, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    report = backends[-1].report.graphs[0]
    benchmark.extra_info.update(
        layers=layers,
        nodes_before=report.nodes_before,
        nodes_after=report.nodes_after,
        fused_ops=dict(report.fused_ops),
    )
    fused = dict(report.fused_ops)
    add_norm = sum(n for op, n in fused.items() if op.startswith("fused_add_rms_norm"))  # in place or not
    assert (add_norm, fused.get("rms_norm"), fused.get("silu_and_mul")) == (2 * layers, 1, layers), fused
