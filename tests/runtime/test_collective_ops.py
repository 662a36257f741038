"""The all-reduce fused ops (runtime/ops/collective.py): schema and fake impl, the spec's sum
over real ranks (gloo on CPU), the one-shot / two-shot size rule, and on two GPUs (marked
``gpu``) flashinfer's ``trtllm_allreduce_fusion`` against the NCCL path, one-shot and two-shot,
eager and inside a CUDA graph, and the counted fallback.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import collective
from fxrewrite.runtime.ops.norm import rms_norm_reference
from fxrewrite.runtime.ops.quant import quant_fp8_static
from fxrewrite.testing import run_ranks

AR, ARQ = torch.ops.fxr.all_reduce_add_rms_norm.default, torch.ops.fxr.all_reduce_add_rms_norm_quant_fp8.default
EPS = 1e-6


def _args(rank: int, tokens: int, hidden: int, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """x differs per rank (seeded by rank); residual and weight are the same on every rank."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, generator=g)
    shared = torch.Generator().manual_seed(7)
    residual, weight = torch.randn(tokens, hidden, generator=shared), 1 + 0.1 * torch.randn(hidden, generator=shared)
    return tuple(t.to(device, dtype) for t in (x, residual, weight))


@pytest.fixture
def fake_group() -> Iterator[str]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def test_opcheck(fake_group: str) -> None:
    """Schema, fake impl and tracing agree with the real impl (fake group: the sum is the input)."""
    x, residual, weight = _args(0, 6, 64, torch.float32)
    torch.library.opcheck(AR, (x, residual, weight, EPS, fake_group))
    torch.library.opcheck(ARQ, (x, residual, weight, EPS, torch.tensor(0.05), fake_group))


def sum_worker(rank: int, world: int) -> dict[str, torch.Tensor]:
    group = dist.group.WORLD.group_name
    x, residual, weight = _args(rank, 5, 64, torch.float32)
    out, total = AR(x, residual, weight, EPS, group)
    q, total_q = ARQ(x, residual, weight, EPS, torch.tensor(0.05), group)
    return {"out": out, "sum": total, "q": q, "sum_q": total_q}


def gloo_worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {"sum": sum_worker(rank, world), "quant": quant_worker(rank, world)}


@pytest.fixture(scope="module")
def gloo_results() -> dict[str, list[dict[str, Any]]]:
    """Both CPU tests' workers in one spawn of two gloo ranks (a spawn's imports and process group
    cost each rank ~3 s): per worker, each rank's results."""
    ranks = run_ranks(gloo_worker, backend="gloo")
    return {name: [r[name] for r in ranks] for name in ("sum", "quant")}


def test_spec_sums_over_the_ranks(gloo_results: dict[str, list[dict[str, Any]]]) -> None:
    """Two gloo ranks: ``sum = x_0 + x_1 + residual``, ``out = rms_norm(sum)``, ``q`` its static
    FP8 quantization; every rank gets the same."""
    results = gloo_results["sum"]
    (x0, residual, weight), (x1, _, _) = _args(0, 5, 64, torch.float32), _args(1, 5, 64, torch.float32)
    total = x0 + x1 + residual
    for res in results:
        torch.testing.assert_close(res["sum"], total)
        torch.testing.assert_close(res["out"], rms_norm_reference(total, weight, EPS))
        assert torch.equal(res["q"].float(), quant_fp8_static(rms_norm_reference(total, weight, EPS), torch.tensor(0.05)).float())
        torch.testing.assert_close(res["sum_q"], total)


ARB = torch.ops.fxr.all_reduce_add_rms_norm_block_quant_fp8.default
ARN = torch.ops.fxr.all_reduce_add_rms_norm_quant_nvfp4.default
GLOBAL_SCALE = torch.tensor([300.0])


def test_opcheck_block_fp8_and_nvfp4(fake_group: str) -> None:
    x, residual, weight = _args(0, 6, 64, torch.float32)
    torch.library.opcheck(ARB, (x, residual, weight, EPS, 32, fake_group))
    torch.library.opcheck(ARN, (x, residual, weight, EPS, GLOBAL_SCALE, fake_group))


def quant_worker(rank: int, world: int) -> dict[str, tuple[torch.Tensor, ...]]:
    group = dist.group.WORLD.group_name
    x, residual, weight = _args(rank, 5, 256, torch.bfloat16)
    return {"block": ARB(x, residual, weight, EPS, 128, group), "nvfp4": ARN(x, residual, weight, EPS, GLOBAL_SCALE, group)}


def test_block_fp8_and_nvfp4_sum_over_the_ranks(gloo_results: dict[str, list[dict[str, Any]]]) -> None:
    """Two gloo ranks, bf16: each op is its fused add + norm + quant op of ``x_0 + x_1``, bit for bit
    (values, scales, the new residual), on every rank."""
    from fxrewrite.runtime.ops.quant_block import fused_add_rms_norm_block_quant_fp8_reference
    from fxrewrite.runtime.ops.quant_nvfp4 import fused_add_rms_norm_quant_nvfp4_reference

    results = gloo_results["quant"]
    (x0, residual, weight), (x1, _, _) = _args(0, 5, 256, torch.bfloat16), _args(1, 5, 256, torch.bfloat16)
    want = {"block": fused_add_rms_norm_block_quant_fp8_reference(x0 + x1, residual, weight, EPS, 128),
            "nvfp4": fused_add_rms_norm_quant_nvfp4_reference(x0 + x1, residual, weight, EPS, GLOBAL_SCALE)}  # fmt: skip
    for res in results:
        for kind, outs in res.items():
            for got, ref in zip(outs, want[kind], strict=True):
                assert got.dtype == ref.dtype and torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), kind
    # the sum is over both ranks: one rank's x alone gives other bytes
    alone = fused_add_rms_norm_quant_nvfp4_reference(x0, residual, weight, EPS, GLOBAL_SCALE)
    assert not torch.equal(results[0]["nvfp4"][0], alone[0])


@pytest.mark.parametrize(
    ("tokens", "hidden", "world", "oneshot"),
    [(1, 4096, 2, True), (16384, 4096, 2, True), (16385, 4096, 2, False), (1024, 4096, 4, True),
     (1025, 4096, 4, False), (8, 4096, 16, False)],
)  # fmt: skip
def test_oneshot_by_size(tokens: int, hidden: int, world: int, oneshot: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """flashinfer's rule: one-shot while tokens * hidden * 2 * world * 2 bytes (bf16) are within
    512 MiB at 2 ranks, 64 at 4 (none listed for 16: two-shot)."""
    monkeypatch.delenv(collective.ONESHOT_ENV, raising=False)
    assert collective.use_oneshot(tokens, hidden, torch.bfloat16, world) is oneshot


def test_oneshot_forced_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(collective.ONESHOT_ENV, "0")
    assert not collective.use_oneshot(1, 4096, torch.bfloat16, 2)
    monkeypatch.setenv(collective.ONESHOT_ENV, "1")
    assert collective.use_oneshot(10**6, 4096, torch.bfloat16, 2) is False  # beyond MAX_COMM_SIZE: never
    assert collective.use_oneshot(16385, 4096, torch.bfloat16, 2)


def test_the_nccl_path_can_be_forced() -> None:
    """``FXREWRITE_PROVIDER=all_reduce_add_rms_norm=torch`` names the op (its reference is the
    NCCL path): accepted, and restored after."""
    try:
        providers.configure("all_reduce_add_rms_norm=torch")
        assert providers._override("all_reduce_add_rms_norm") == "torch"
    finally:
        providers.configure("")


# --------------------------------------------------------------------------- two GPUs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def gpu_worker(rank: int, world: int) -> dict[str, Any]:
    """flashinfer against the NCCL path (the reference run on the GPU), per case."""
    import os

    group = dist.group.WORLD.group_name
    device = f"cuda:{rank}"
    out: dict[str, Any] = {}
    ref_fn = collective.all_reduce_add_rms_norm_reference
    for tokens in (1, 5, 128, 1000):
        for forced in ("", "0"):
            if forced == "0" and tokens <= world:
                continue
            os.environ[collective.ONESHOT_ENV] = forced
            providers.reset_counts()
            x, residual, weight = _args(rank, tokens, 2048, torch.bfloat16, device)
            got, ref = AR(x, residual, weight, EPS, group), ref_fn(x, residual, weight, EPS, group)
            out[f"{tokens}/{'twoshot' if forced else 'auto'}"] = {
                "errs": [_rel(got[0], ref[0]), _rel(got[1], ref[1])],
                "served": providers.served()["all_reduce_add_rms_norm"],
            }
    os.environ[collective.ONESHOT_ENV] = ""
    # static FP8: at most one FP8 step apart, on few elements
    x, residual, weight = _args(rank, 64, 2048, torch.bfloat16, device)
    scale = torch.tensor([0.02], device=device)
    q, total = ARQ(x, residual, weight, EPS, scale, group)
    q_ref, _ = collective.all_reduce_add_rms_norm_quant_fp8_reference(x, residual, weight, EPS, scale, group)
    a, b = q.float() * scale, q_ref.float() * scale
    out["fp8"] = {"step_ok": bool(((a - b).abs() <= 0.126 * b.abs() + 2**-8 * scale).all()),
                  "differ": float((a != b).float().mean())}  # fmt: skip
    # inside a CUDA graph: captured on static inputs, replayed on new values
    for name, fn in (("graph/flashinfer", AR), ("graph/nccl", ref_fn)):
        x, residual, weight = _args(rank, 32, 2048, torch.bfloat16, device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(x, residual, weight, EPS, group)  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = fn(x, residual, weight, EPS, group)
        new = _args(rank + 10, 32, 2048, torch.bfloat16, device)
        x.copy_(new[0])
        residual.copy_(new[1])
        graph.replay()
        ref = ref_fn(x, residual, weight, EPS, group)
        out[name] = {"errs": [_rel(static[0], ref[0]), _rel(static[1], ref[1])]}
    # a call the kernel cannot serve: float32 falls back to NCCL, counted with its reason
    providers.reset_counts()
    x, residual, weight = _args(rank, 8, 2048, torch.float32, device)
    got, ref = AR(x, residual, weight, EPS, group), ref_fn(x, residual, weight, EPS, group)
    out["fp32"] = {"errs": [_rel(got[0], ref[0])], "served": providers.served()["all_reduce_add_rms_norm"]}
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_flashinfer_against_nccl_on_two_gpus() -> None:
    results = run_ranks(gpu_worker, backend="nccl", timeout=300)
    for rank, res in enumerate(results):
        for case, r in res.items():
            print(f"rank {rank} {case}: {r}")
        for case, r in res.items():
            if "errs" in r:
                assert max(r["errs"]) < 2e-2, (rank, case, r)
        for tokens in (1, 5, 128, 1000):
            assert res[f"{tokens}/auto"]["served"].get("flashinfer-oneshot") == 1, res[f"{tokens}/auto"]
        for tokens in (5, 128, 1000):
            assert res[f"{tokens}/twoshot"]["served"].get("flashinfer-twoshot") == 1, res[f"{tokens}/twoshot"]
        assert res["fp8"]["step_ok"] and res["fp8"]["differ"] < 0.02, res["fp8"]
        served = res["fp32"]["served"]
        assert served.get("torch") == 1 and any("dtype float32 not bf16/fp16" in k for k in served["fallbacks"]), served
