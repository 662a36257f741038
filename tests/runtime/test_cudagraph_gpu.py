"""CUDA graphs for real: every captured size replays what the eager graph computes.

Run: ``python -m pytest -q -m gpu tests/runtime/test_cudagraph_gpu.py`` (skipped without CUDA).
Each test compares the Runner against the same Dynamo graph run eagerly, at exact and padded
token counts, in piecewise and full modes, on a tiny transformers Llama and on toy models with
F.scaled_dot_product_attention or custom attention ops (functional and ``out=``).
"""

from __future__ import annotations

import functools
import random
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from fxrewrite.config import Config
from fxrewrite.runtime.cudagraph import Runner, build_runner, copy_all
from fxrewrite.runtime.dispatch import ShapeError
from fxrewrite.runtime.hazards import CaptureHazardError
from helpers.graphs import (
    CachedAttention,
    Recorded,
    TinyLlama,
    ToyAttention,
    args_for,
    check_state_written_by_splitting_op,
    copy_all_case,
    llama_inputs,
    record,
    seeded,
    toy_inputs,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = (2, 4, 8, 16, 32)
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}
MODELS = {
    "llama": lambda: TinyLlama(),
    "sdpa": lambda: ToyAttention("sdpa"),
    "custom": lambda: ToyAttention("custom"),
    "custom_out": lambda: ToyAttention("custom_out"),
}
SPLITTING = {"custom": ("fxrtest::attn",), "custom_out": ("fxrtest::attn_out",)}


@functools.lru_cache(maxsize=None)  # one Dynamo compile per model for the whole file
def recorded(name: str, dtype: torch.dtype = torch.float32, dynamic: bool = True, sizes: tuple[int, ...] = (8, 5)) -> Recorded:
    if name == "llama":
        pytest.importorskip("transformers")
        inputs = llama_inputs(sizes, "cuda")
    else:
        inputs = [(x.to(dtype),) for (x,) in toy_inputs(sizes, "cuda")]
    return record(seeded(MODELS[name], "cuda", dtype), inputs, dynamic=dynamic)


def make_runner(rec: Recorded, name: str, mode: str, **config: Any) -> Runner:
    config.setdefault("capture_sizes", SIZES)
    config.setdefault("splitting_ops", SPLITTING.get(name, Config().splitting_ops))
    return build_runner(rec.gm, rec.example_inputs, Config(mode=mode, progress=False, **config))


def assert_matches_eager(runner: Runner, rec: Recorded, n: int, dtype: torch.dtype = torch.float32) -> Any:
    args = args_for(runner, rec.calls[0], n)
    out = runner(*args)
    torch.testing.assert_close(out, rec.gm(*args), **TOL[dtype])
    return out


@pytest.mark.parametrize("mode", ["piecewise", "full"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_captured_size_replays_like_eager(name: str, mode: str) -> None:
    rec = recorded(name)
    runner = make_runner(rec, name, mode)
    runner.capture()
    s = runner.stats()
    assert s["cudagraphs"] and s["captured"] and s["capture_sizes"] == list(SIZES), s
    assert s["graphs"] == s["captured_pieces"] * len(SIZES) and s["pool_bytes"] > 0 and s["capture_s"] > 0
    assert s["splitting_pieces"] == (2 if mode == "piecewise" else 0) and s["missing_splitting_ops"] == []
    for size in SIZES:
        assert_matches_eager(runner, rec, size)  # exact
        if size - 1 >= 2:
            assert_matches_eager(runner, rec, size - 1)  # padded
    assert_matches_eager(runner, rec, 40)  # beyond the largest size: eager
    s = runner.stats()
    assert s["replays"] == 2 * len(SIZES) - 1 and s["padded_calls"] == len(SIZES) - 1
    assert s["eager_reasons"] == {"beyond_max": 1}


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_sizes_replayed_in_any_order_share_the_pool_safely(mode: str) -> None:
    rec = recorded("llama")
    runner = make_runner(rec, "llama", mode)
    order = [n for n in range(2, 33)] * 2
    random.Random(0).shuffle(order)
    kept = [(n, assert_matches_eager(runner, rec, n)) for n in order]
    for n, out in kept[:5]:  # earlier outputs are not overwritten by later replays
        torch.testing.assert_close(out, rec.gm(*args_for(runner, rec.calls[0], n)), **TOL[torch.float32])


def test_pool_memory_is_shared_across_sizes() -> None:
    """Each size's activations are dead before another size runs: later captures reuse them."""
    rec = record(seeded(lambda: ToyAttention(hidden=1024, heads=8), "cuda"), toy_inputs((64,), "cuda", 1024),
                 dynamic=True)
    pools = {}
    for sizes in ((512,), (64, 128, 256, 384, 512)):
        runner = make_runner(rec, "sdpa", "piecewise", capture_sizes=sizes)
        runner.capture()
        pools[sizes] = runner.stats()["pool_bytes"]
        assert_matches_eager(runner, rec, 200)
        del runner
        torch.cuda.empty_cache()
    print(f"pool bytes: {pools}")
    # Separate pools would need about sum(sizes) / 512 = 2.6x the largest size's pool; measured on
    # an H100 (2026-11-22): 30 MiB against 20 MiB, 1.5x (the allocator rounds segments up).
    assert pools[(64, 128, 256, 384, 512)] < 2.0 * pools[(512,)], pools


@pytest.mark.parametrize("enabled", [True, False], ids=["collector-on", "collector-off"])
def test_capture_leaves_the_collector_as_the_caller_had_it(enabled: bool) -> None:
    """A serving engine freezes its heap once its model is loaded (``gc.freeze``): after the
    capture those objects are still frozen, and the collector is on or off as it was. (The
    capture used to unfreeze every object, the caller's too.)"""
    import gc

    rec = record(seeded(lambda: ToyAttention(), "cuda"), toy_inputs((8,), "cuda"), dynamic=True)
    runner = make_runner(rec, "sdpa", "piecewise")
    was = gc.isenabled()
    gc.freeze()
    frozen = gc.get_freeze_count()
    (gc.enable if enabled else gc.disable)()
    try:
        runner.capture()
        assert gc.get_freeze_count() > frozen // 2 > 0  # objects freed meanwhile leave the count; unfrozen, it is 0
        assert gc.isenabled() == enabled
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()
    assert_matches_eager(runner, rec, 8)


def test_copies_per_step() -> None:
    cases = {("llama", "piecewise"): (1, 2), ("llama", "full"): (1, 0), ("sdpa", "piecewise"): (1, 2),
             ("custom_out", "piecewise"): (1, 0)}
    for (name, mode), expected in cases.items():
        rec = recorded(name)
        runner = make_runner(rec, name, mode)
        assert_matches_eager(runner, rec, 8)
        s = runner.stats()
        assert (s["static_input_copies_last"], s["activation_copies_last"]) == expected, (name, mode, s)
    # an engine writing its inputs into the static buffers makes no copy
    args = list(args_for(runner, rec.calls[0], 6))
    i = next(i for i, spec in enumerate(runner.dispatch.inputs) if spec.kind == "token")
    view = runner.static_inputs(6)[i].narrow(0, 0, 6)
    view.copy_(args[i])
    expected_out = rec.gm(*args)
    args[i] = view
    torch.testing.assert_close(runner(*args), expected_out, **TOL[torch.float32])
    assert runner.stats()["static_input_copies_last"] == 0


def test_copy_all_takes_one_launch_per_dtype() -> None:
    dst, src = copy_all_case("cuda")
    copy_all(dst, src)  # warm-up
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        copy_all(dst, src)
        torch.cuda.synchronize()
    for d, s in zip(dst, src):
        assert torch.equal(d, s.to(d.dtype))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # int64 x3 and int32 x2 in one launch each, then the two converting pairs: 4, not 7
    assert len(kernels) == 4, [e.name for e in kernels]


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_state_written_by_attention_survives_capture(mode: str) -> None:
    """Warm-ups and captures must not write the KV caches; padded replays match eager."""
    x = toy_inputs((8,), "cuda")[0][0]
    rec = record(seeded(CachedAttention, "cuda"), [(x, torch.arange(1, 9, device="cuda"))], dynamic=True)
    runner = check_state_written_by_splitting_op(rec, mode, "cuda")
    assert runner.stats()["cudagraphs"]


def test_bf16_llama() -> None:
    pytest.importorskip("transformers")
    rec = record(seeded(TinyLlama, "cuda", torch.bfloat16), llama_inputs((8, 5), "cuda"), dynamic=True)
    for mode in ("piecewise", "full"):
        runner = make_runner(rec, "llama", mode, capture_sizes=(4, 8, 16))
        for n in (3, 4, 8, 13):
            assert_matches_eager(runner, rec, n, torch.bfloat16)


def test_static_shape_graph() -> None:
    rec = recorded("sdpa", dynamic=False, sizes=(8,))
    runner = make_runner(rec, "sdpa", "piecewise")
    args = rec.calls[0]
    torch.testing.assert_close(runner(*args), rec.gm(*args), **TOL[torch.float32])
    s = runner.stats()
    assert s["static_shape"] and s["graphs"] == 3 and s["replays"] == 1
    other = [torch.randn(9, 32, device="cuda") if isinstance(a, torch.Tensor) and a.shape == (8, 32) else a
             for a in args]
    with pytest.raises(ShapeError, match=r"expected shape \(8, 32\).*got \(9, 32\)"):
        runner(*other)


def test_host_scalar_change_runs_eagerly() -> None:
    rec = recorded("llama")
    runner = make_runner(rec, "llama", "piecewise")
    args = list(args_for(runner, rec.calls[0], 8))
    host = [i for i, spec in enumerate(runner.dispatch.inputs) if spec.kind == "host"]
    assert host, "Dynamo lifted the RMSNorm eps to CPU scalars"
    runner(*args)
    args[host[-1]] = torch.tensor(0.5)
    torch.testing.assert_close(runner(*args), rec.gm(*args), **TOL[torch.float32])
    assert runner.stats()["eager_reasons"] == {"host_scalar_changed": 1}


def test_hazards_raise_before_capture() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).cpu().cuda() + 1

    rec = record(f, [(torch.randn(8, device="cuda"),)], dynamic=False)
    with pytest.raises(CaptureHazardError, match="call_method cpu"):
        make_runner(rec, "f", "full")


def test_through_torch_compile() -> None:
    pytest.importorskip("transformers")
    model = seeded(TinyLlama, "cuda")
    runners: list[Runner] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Runner:
        runners.append(build_runner(gm, example_inputs, Config(mode="piecewise", capture_sizes=SIZES, progress=False)))
        return runners[-1]

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for (ids,) in llama_inputs((8, 5, 16, 31, 40), "cuda"):
            torch.testing.assert_close(compiled(ids), model(ids), **TOL[torch.float32])
    s = runners[0].stats()
    assert len(runners) == 1 and s["replays"] == 4 and s["eager_calls"] == 1


# A process of its own: before the fix, the replay faults and poisons the CUDA context.
CUBLAS_CLEARED = """
import sys, torch
from fxrewrite.config import Config
from fxrewrite.runtime import cudagraph, pieces

if sys.argv[1] == "unfixed":
    pieces._clear_cublas_workspaces = lambda: None
torch.manual_seed(0)
w1 = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16) / 64
w2 = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) / 128

def mlp(x):
    return torch.nn.functional.silu(x @ w1) @ w2

gm = torch.fx.symbolic_trace(mlp)
x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
runner = cudagraph.build_runner(gm, [x], Config(mode="full", capture_sizes=(8,), progress=False))
with torch.no_grad():
    runner(x)  # warm-up and capture
    # what Inductor's CUDA-graph trees do around every recording, then memory handed to others
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    filler = [torch.full((8 << 20,), float("nan"), device="cuda") for _ in range(32)]
    fresh = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        out = runner(fresh)
    torch.cuda.synchronize()
    assert runner.stats()["replays"] == 4, runner.stats()
    err = ((out.float() - mlp(fresh).float()).abs().max() / mlp(fresh).float().abs().max()).item()
    print(f"rel err {err:.2e}")
    assert err < 2e-2, err
"""


def test_replay_survives_cublas_workspaces_cleared_by_others() -> None:
    """Inductor's CUDA-graph trees clear cuBLAS's cached workspaces around each recording: a
    graph captured with a workspace from the cache would write freed memory at its next replay
    (illegal memory access, found running fxrewrite and ``mode="reduce-overhead"`` in one
    process). The runner captures GEMMs with workspaces from its own pool. The script's
    ``unfixed`` argument switches that off: on the H100 it then dies of the illegal memory access
    (bench/RESULTS.md, seventh run); not asserted here, since whether a GEMM uses its workspace
    is cuBLAS's choice per device and shape."""
    done = subprocess.run([sys.executable, "-c", CUBLAS_CLEARED, "fixed"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rel err" in done.stdout


def test_replay_is_faster_than_eager() -> None:
    """Not a benchmark (bench/ has those): a guard against per-call overhead eating the gain."""
    rec = recorded("llama")
    runner = make_runner(rec, "llama", "piecewise")
    args = args_for(runner, rec.calls[0], 8)

    def per_call(fn: Any) -> float:
        for _ in range(3):
            fn(*args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn(*args)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 50

    with torch.no_grad():
        eager, replay = per_call(rec.gm), per_call(runner)
    print(f"tiny llama, 8 tokens: eager {eager * 1e6:.0f} us, piecewise replay {replay * 1e6:.0f} us")
    assert replay < eager
