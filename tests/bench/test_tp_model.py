"""The tensor-parallel Llama (``bench/tp_model.py``) on two ranks against the single-device model
with the same weights: eagerly, and compiled by fxrewrite with the all-reduce fused into the
add + RMSNorm that follows it, eager, piecewise and full CUDA graphs.

CPU: two gloo processes, float32, CUDA graphs emulated (the Runner's CPU path). GPU (marked
``gpu``; needs two devices): two NCCL processes, bf16, the flashinfer all-reduce kernel and the
NCCL fallback, each inside captured pieces. One spawn runs every system of the CPU tests, one
per GPU test its own; each step runs twice (capture, then replay) and the output of both is checked.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine_model import SPLITTING_OPS, build_model, float32_reference, make_batch, mark_static_metadata, tiny
from tp_model import local_config, shard, shard_kv_cache

from fxrewrite.testing import op_counts, run_ranks

CPU_CFG = tiny()
# wide enough for the flashinfer kernel (hidden >= 1024 in bf16); still a toy
GPU_CFG = tiny(hidden_size=1024, intermediate_size=2048, num_heads=8, num_kv_heads=4, head_dim=128, vocab_size=512)
MAX_SEQS, MAX_LEN = 4, 64
STEPS = (("prefill", 12, 0), ("decode", 4, 20))  # the decode reads the prefill's keys in row 0
SIZES = (4, 12)  # the steps' token counts: nothing padded (a padded row would write KV slot 0)
AR_OP = "all_reduce_add_rms_norm"
SP_OP = "sp_reduce_add_rms_norm"
REDUCE_OP, GATHER_OP = "sp_linear_reduce_add_rms_norm", "sp_all_gather_linear"  # async TP
SITE_OP = "sp_linear_reduce_add_rms_norm_linear"  # async TP where both GEMMs move in
NCCL = f"{AR_OP}=torch"  # the op's NCCL path (its reference), forced

# name: (mode, provider override, with the collective rule[, sequence_parallel_min_tokens[, async_tp]]). On CPU
# piecewise alone, beside its negative twin: the rewrite, the split at attention and the emulated
# capture; "none" and "full" run the same rewritten graph there (with less of that machinery), and
# each system costs both CI cores ~7 s. The GPU runs every mode.
CPU_SYSTEMS = {
    "piecewise": ("piecewise", "", True),
    "unfused": ("piecewise", "", False),
}
GPU_SYSTEMS = {
    "none": ("none", "", True),
    **CPU_SYSTEMS,
    "full": ("full", "", True),
    "piecewise-nccl": ("piecewise", NCCL, True),
    "full-nccl": ("full", NCCL, True),
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def _rules(collective: bool) -> list[Any] | None:
    """The default library, or the default library without the collective rules."""
    if collective:
        return None
    from fxrewrite.backend import default_rule_groups

    return [r for name, rules in default_rule_groups() if name != "fuse_collective" for r in rules]


def tp_worker(rank: int, world: int, device: str, dtype: torch.dtype, cfg: Any, systems: dict,
              steps: tuple = STEPS, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:  # fmt: skip
    """One rank: the full model (seeded like every rank's), its shard, the ``steps`` eagerly on
    both, then each system compiled on the shard (capture ``sizes``). Errors are relative to the
    float32 reference of the full model (``float32_reference``); ``single`` is the full model's
    own error; ``reduce_scatters``: the reduce-scatter calls of each step's second run (a replay)."""
    import torch.distributed as dist

    import fxrewrite
    from fxrewrite.runtime import providers

    device = device.format(rank=rank)
    torch.set_grad_enabled(False)
    group = dist.group.WORLD.group_name
    full = build_model(cfg, device=device, dtype=dtype, seed=0)
    full.allocate_kv_cache(MAX_SEQS, MAX_LEN)
    full.fill_kv_cache_random(7)
    model = shard(full, rank, world, group)
    shard_kv_cache(full, model, rank, world)
    batches = [mark_static_metadata(make_batch(cfg, k, n, c, max_len=MAX_LEN, device=device, seed=i))
               for i, (k, n, c) in enumerate(steps)]  # fmt: skip
    refs, single, eager = [], [], []
    for b in batches:  # in order: each step sees the cache the previous one wrote
        single.append(rel_err(full(**b), ref := float32_reference(full, b)))
        refs.append(ref)
        eager.append(rel_err(model(**b), ref))
    out: dict[str, Any] = {"single": single, "eager": eager}
    for name, (mode, provider, collective, *sp) in systems.items():
        torch._dynamo.reset()
        providers.reset_counts()
        backend = fxrewrite.Backend(mode=mode, splitting_ops=SPLITTING_OPS, capture_sizes=sizes, provider=provider,
                                    rules=_rules(collective), progress=False, sequence_parallel_min_tokens=(sp or [None])[0],
                                    async_tp=sp[1:] == [True])  # fmt: skip
        step = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
        errs = [rel_err(step(**b), ref) for b, ref in zip(batches, refs)]  # compile and capture
        scatters = []
        for b, ref in zip(batches, refs):  # replay
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                errs.append(rel_err(step(**b), ref))
            scatters.append(sum(e.count for e in prof.key_averages() if e.key == "_c10d_functional::reduce_scatter_tensor"))
        backend.refresh_runtime()
        counts = [op_counts(g) for g in backend.graphs]
        out[name] = {
            "errs": errs,
            "fused": [c[f"fxr.{AR_OP}"] + c[f"fxr.{SP_OP}"] + c[f"fxr.{REDUCE_OP}"] + c[f"fxr.{SITE_OP}"] for c in counts],
            "sp": [c[f"fxr.{SP_OP}"] + c[f"fxr.{REDUCE_OP}"] + c[f"fxr.{SITE_OP}"] for c in counts],
            "atp": [(c[f"fxr.{SITE_OP}"], c[f"fxr.{REDUCE_OP}"], c[f"fxr.{GATHER_OP}"]) for c in counts],
            "reduce_scatters": scatters,
            "all_reduce": [c["_c10d_functional.all_reduce"] for c in counts],
            "near_misses": [m.reason for m in backend.report.near_misses if m.rule in (AR_OP, "sequence_parallel", "async_tp")],
            "served": providers.served().get(AR_OP, {}),
            "served_atp": {op: providers.served().get(op, {}) for op in (SITE_OP, REDUCE_OP, GATHER_OP)},
            "replays": sum((g.runtime or {}).get("replays", 0) for g in backend.report.graphs),
        }
    torch._dynamo.reset()
    return out


def check_results(results: list[dict[str, Any]], systems: dict, tol: float, cfg: Any) -> None:
    """Every rank, every system: output within ``tol`` of the reference (relative to its max),
    2 fused sites per layer in each graph (attention and MLP all-reduces), no all-reduce left
    over (the collective rule's absence leaves one per site), CUDA graphs replayed."""
    layers = cfg.num_layers
    for rank, res in enumerate(results):
        assert max(res["eager"]) < tol, (rank, res["eager"], res["single"])
        for name, (mode, _, collective, *_sp) in systems.items():
            r = res[name]
            assert max(r["errs"]) < tol, (rank, name, r["errs"], res["single"])
            assert r["fused"] == ([2 * layers] * len(r["fused"]) if collective else [0] * len(r["fused"])), (name, r)
            assert r["all_reduce"] == ([0] * len(r["fused"]) if collective else [2 * layers] * len(r["fused"])), (name, r)
            assert r["near_misses"] == [], (name, r["near_misses"])
            assert r["sp"] == (r["fused"] if len(systems[name]) > 3 else [0] * len(r["fused"])), (name, r)
            if mode != "none":
                assert r["replays"] > 0, (name, r)


def test_local_config_and_shards_cover_the_full_weights() -> None:
    """Each rank's shapes are the full ones divided; the two shards of every split weight
    concatenate back to the full weight."""
    full = build_model(CPU_CFG, seed=0)
    shards = [shard(full, r, 2, "unused") for r in range(2)]
    local = local_config(CPU_CFG, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    a, b = (s.layers[1] for s in shards)
    w = full.layers[1]
    torch.testing.assert_close(torch.cat([a.self_attn.o_proj.weight, b.self_attn.o_proj.weight], 1), w.self_attn.o_proj.weight)
    torch.testing.assert_close(torch.cat([a.mlp.down_proj.weight, b.mlp.down_proj.weight], 1), w.mlp.down_proj.weight)
    q = CPU_CFG.num_heads * CPU_CFG.head_dim // 2
    torch.testing.assert_close(torch.cat([a.self_attn.qkv_proj.weight[:q], b.self_attn.qkv_proj.weight[:q]]),
                               w.self_attn.qkv_proj.weight[: 2 * q])
    with pytest.raises(ValueError, match="num_kv_heads=2 is not divisible by the 4 ranks"):
        local_config(CPU_CFG, 4)


def groups_worker(rank: int, world: int, device: str, dtype: torch.dtype, cfg: Any,
                  groups: dict[str, tuple[dict, tuple, tuple[int, ...]]]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """``tp_worker`` for each group of ``(systems, steps, sizes)``, one after the other in this rank."""
    return {name: tp_worker(rank, world, device, dtype, cfg, *group) for name, group in groups.items()}


# odd token counts: a prefill of 7 above the threshold of 5 (padded to 8 rows inside the op, 4 a
# rank), a decode of 3 below it (the fused all-reduce); captured at exactly these sizes
SP_STEPS, SP_SIZES, SP_MIN = (("prefill", 7, 0), ("decode", 3, 20)), (3, 7), 5
SP_SYSTEMS = {"sp-none": ("none", "", True, SP_MIN), "sp-piecewise": ("piecewise", "", True, SP_MIN)}
ATP_SYSTEMS = {"atp-none": ("none", "", True, SP_MIN, True), "atp-piecewise": ("piecewise", "", True, SP_MIN, True)}
CPU_GROUPS = {"tp": (CPU_SYSTEMS, STEPS, SIZES), "sp": ({"sp-piecewise": SP_SYSTEMS["sp-piecewise"]}, SP_STEPS, SP_SIZES),
              "async-tp": ({"atp-piecewise": ATP_SYSTEMS["atp-piecewise"]}, SP_STEPS, SP_SIZES)}  # fmt: skip


@pytest.fixture(scope="module")
def cpu_results() -> dict[str, list[dict[str, Any]]]:
    """Every CPU test's systems in one spawn of two gloo ranks (a spawn's imports and process
    group cost ~3 s of each rank): per group of ``CPU_GROUPS``, each rank's results."""
    ranks = run_ranks(groups_worker, "cpu", torch.float32, CPU_CFG, CPU_GROUPS, backend="gloo", timeout=600)
    return {name: [r[name] for r in ranks] for name in CPU_GROUPS}


@pytest.mark.slow  # slow tests run first, in file order: the three CPU tests stay on one worker
def test_tp2_equals_single_device_on_cpu(cpu_results: dict[str, list[dict[str, Any]]]) -> None:
    """Two gloo ranks, float32: the TP model eager and compiled (no CUDA graphs on CPU: the
    Runner's emulation) equals the single-device model; 2 sites per layer fused."""
    check_results(cpu_results["tp"], CPU_SYSTEMS, 1e-5, CPU_CFG)


def check_async_tp(results: list[dict[str, Any]], systems: dict, cfg: Any) -> None:
    """Every site sharded with its GEMM before it (2 a layer); the GEMM after it too, both in one
    op, at every site but the final norm's (its output is the graph's): 2 a layer less one."""
    layers = cfg.num_layers
    for res in results:
        for name in systems:
            assert res[name]["atp"] == [(2 * layers - 1, 1, 0)] * len(res[name]["atp"]), (name, res[name])


@pytest.mark.slow  # beside the test above: one worker computes the module's fixture (two ranks, ~50 s)
@pytest.mark.parametrize("group", ["sp", "async-tp"])
def test_sequence_parallel_tp2_equals_single_device_on_cpu(cpu_results: dict[str, list[dict[str, Any]]], group: str) -> None:
    """Two gloo ranks, float32: with sequence parallelism (and async TP) the TP model equals the
    single-device model at a prefill above the threshold (reduce-scatter, 2 a layer; with async
    TP inside the GEMM + reduce-scatter op, every site's GEMMs moved in) and a decode below it
    (none), at token counts that are not multiples of the two ranks; every site sharded."""
    systems, results = CPU_GROUPS[group][0], cpu_results[group]
    check_results(results, systems, 1e-5, CPU_CFG)
    if group == "async-tp":
        check_async_tp(results, systems, CPU_CFG)
    for res in results:
        for name in systems:
            assert res[name]["reduce_scatters"] == [2 * CPU_CFG.num_layers, 0], (name, res[name])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_equals_single_device_on_two_gpus() -> None:
    """Two NCCL ranks, bf16: eager, piecewise and full CUDA graphs with the all-reduce inside
    captured pieces, through flashinfer's fused kernel and through NCCL; within bf16 error of
    the float32 reference (as the single-GPU bf16 model is)."""
    results = run_ranks(tp_worker, "cuda:{rank}", torch.bfloat16, GPU_CFG, GPU_SYSTEMS, backend="nccl", timeout=400)
    for rank, res in enumerate(results):
        print(f"rank {rank}: single {res['single']}, eager {res['eager']}")
        for name in GPU_SYSTEMS:
            print(f"  {name}: errs {['%.1e' % e for e in res[name]['errs']]} served {res[name]['served']}")
    check_results(results, GPU_SYSTEMS, 3e-2, GPU_CFG)
    for res in results:
        for name in ("none", "piecewise", "full"):
            served = res[name]["served"]
            assert served.get("flashinfer-oneshot", 0) > 0 and not served["fallbacks"], (name, served)
        for name in ("piecewise-nccl", "full-nccl"):
            assert res[name]["served"].get("torch", 0) > 0, res[name]["served"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_sequence_parallel_tp2_equals_single_device_on_two_gpus() -> None:
    """Two NCCL ranks, bf16: the sequence-parallel op inside captured pieces (piecewise) and
    one whole-graph capture (full), at the odd token counts of the CPU test; the decode's
    sites served by flashinfer's fused all-reduce, the prefill's by NCCL's reduce-scatter and
    all-gather around the in-place add + norm kernel."""
    run_sharded_on_two_gpus({**SP_SYSTEMS, "sp-full": ("full", "", True, SP_MIN)}, "served")


def run_sharded_on_two_gpus(systems: dict, served: str) -> list[dict[str, Any]]:
    """The SP steps of ``systems`` on two NCCL ranks in bf16, each rank's errors and ``served``
    counts printed, within bf16 error of the reference; the results."""
    results = run_ranks(tp_worker, "cuda:{rank}", torch.bfloat16, GPU_CFG, systems, SP_STEPS, SP_SIZES, backend="nccl",
                        timeout=400)  # fmt: skip
    for rank, res in enumerate(results):
        for name in systems:
            print(f"rank {rank} {name}: errs {['%.1e' % e for e in res[name]['errs']]} {served} {res[name][served]}")
    check_results(results, systems, 3e-2, GPU_CFG)
    return results


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_async_tp_tp2_equals_single_device_on_two_gpus() -> None:
    """Two NCCL ranks, bf16: the async-TP ops inside captured pieces (piecewise) and one
    whole-graph capture (full); the prefill's calls served through symmetric memory (the site
    op's exchange kernel between whole GEMMs; the final norm's reduce), the decode's by the
    fused all-reduce and the GEMMs alone."""
    systems = {**ATP_SYSTEMS, "atp-full": ("full", "", True, SP_MIN, True)}
    results = run_sharded_on_two_gpus(systems, "served_atp")
    check_async_tp(results, systems, GPU_CFG)
    for res in results:
        for name in systems:
            for op, above in ((SITE_OP, "symm-mem exchange"), (REDUCE_OP, "symm-mem")):
                served = res[name]["served_atp"][op]
                assert served.get(above, 0) > 0 and served.get("all-reduce", 0) > 0 and not served["fallbacks"], (name, op, served)
