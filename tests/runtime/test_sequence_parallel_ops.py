"""``fxr.sp_reduce_add_rms_norm`` (runtime/ops/sequence_parallel.py) on two gloo ranks against
``fxr.all_reduce_add_rms_norm``: above its threshold (reduce-scatter, add + norm on this rank's
rows, all-gather) and below it (the all-reduce op), at row counts that are and are not a
multiple of the two ranks; and its fake impl under symbolic shapes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.rewrites import fake_process_group

from fxrewrite.runtime.ops import sequence_parallel
from fxrewrite.testing import run_ranks

SP, AR = torch.ops.fxr.sp_reduce_add_rms_norm.default, torch.ops.fxr.all_reduce_add_rms_norm.default
EPS = 1e-6
CASES = ((5, 4), (8, 4), (1, 2), (3, 100), (2, 3, 1))  # (rows..., min_tokens): the last has 3-D input [2, 3, H]


def _args(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x differs per rank; residual and weight are the same on every rank (replicated)."""
    x = torch.randn(*shape, 64, generator=torch.Generator().manual_seed(100 + rank))
    shared = torch.Generator().manual_seed(7)
    residual, weight = torch.randn(*shape, 64, generator=shared), 1 + 0.1 * torch.randn(64, generator=shared)
    return tuple(t.to(dtype) for t in (x, residual, weight))


def sp_worker(rank: int, world: int) -> dict[str, Any]:
    group = dist.group.WORLD.group_name
    out: dict[str, Any] = {}
    for *shape, min_tokens in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            x, residual, weight = _args(rank, tuple(shape), dtype)
            got, ref = SP(x, residual, weight, EPS, min_tokens, group), AR(x, residual, weight, EPS, group)
            out[f"{shape}/{min_tokens}/{dtype}"] = (got, ref)
    return out


def test_sp_equals_the_all_reduce_op_on_two_ranks() -> None:
    """``out`` equals the all-reduce op's on every rank (bitwise: two addends sum the same in
    either order); ``sum`` equals it in this rank's rows when sharded (``ceil(rows / 2)`` rows
    each, the last rank's short by the padding), everywhere when not."""
    results = run_ranks(sp_worker, backend="gloo", timeout=120)
    for rank, res in enumerate(results):
        for key, ((out, total), (ref_out, ref_total)) in res.items():
            shape, min_tokens = key.split("/")[:2]
            rows = ref_out.numel() // 64
            assert out.shape == ref_out.shape and total.shape == ref_total.shape, key
            assert torch.equal(out, ref_out), (rank, key)
            if sequence_parallel.sharded(rows, int(min_tokens)):
                chunk = -(-rows // 2)
                mine = slice(rank * chunk, min((rank + 1) * chunk, rows))
                assert torch.equal(total.reshape(rows, 64)[mine], ref_total.reshape(rows, 64)[mine]), (rank, key)
            else:
                assert torch.equal(total, ref_total), (rank, key)


def test_sharded_by_rows() -> None:
    assert sequence_parallel.sharded(512, 512) and not sequence_parallel.sharded(511, 512)


@pytest.fixture
def fake_group() -> Any:
    with fake_process_group():
        yield dist.group.WORLD.group_name


def test_fake_impl_keeps_the_unsharded_shapes(fake_group: str) -> None:
    """Under fake tensors the outputs have the inputs' shapes (the graph's shapes stay the
    unsharded model's) and dtype, whichever path a call would take."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(7, 64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)
        for min_tokens in (4, 100):
            out, total = SP(x, x, w, EPS, min_tokens, fake_group)
            assert out.shape == x.shape and total.shape == x.shape and out.dtype == torch.bfloat16


def gpu_worker(rank: int, world: int) -> dict[str, Any]:
    """bf16 on two GPUs: each case against the all-reduce op, and the path each call took."""
    from fxrewrite.runtime import providers

    group = dist.group.WORLD.group_name
    out: dict[str, Any] = {}
    for rows, min_tokens in ((1, 512), (64, 512), (512, 512), (1023, 512), (4096, 512)):
        providers.reset_counts()
        x, residual, weight = (t.to(f"cuda:{rank}") for t in _args(rank, (rows,), torch.bfloat16))
        x, residual = x.repeat(1, 32), residual.repeat(1, 32)  # hidden 2048: flashinfer's fused kernel serves
        weight = weight.repeat(32)
        got, ref = SP(x, residual, weight, EPS, min_tokens, group), AR(x, residual, weight, EPS, group)
        chunk = -(-rows // world)
        # the sum is this rank's rows where the call shards; every row below the threshold
        mine = slice(rank * chunk, min((rank + 1) * chunk, rows)) if rows >= min_tokens else slice(0, rows)
        out[f"{rows}/{min_tokens}"] = {
            "out": float((got[0].float() - ref[0].float()).abs().max() / ref[0].float().abs().max()),
            "sum": float((got[1][mine].float() - ref[1][mine].float()).abs().max() / ref[1][mine].float().abs().max()),
            "served": providers.served().get("sp_reduce_add_rms_norm", {}),
        }
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_sp_against_the_all_reduce_op_on_two_gpus() -> None:
    """NCCL's reduce-scatter + the add + norm kernel + all-gather against flashinfer's fused
    all-reduce (bf16: within a rounding of the norm); each call served by the path its rows pick."""
    results = run_ranks(gpu_worker, backend="nccl", timeout=300)
    for rank, res in enumerate(results):
        for case, r in res.items():
            print(f"rank {rank} {case}: {r}")
            assert r["out"] < 2e-2 and r["sum"] < 2e-2, (rank, case, r)
            rows, min_tokens = map(int, case.split("/"))
            label = "reduce-scatter" if rows >= min_tokens else "all-reduce"
            assert r["served"].get(label) == 1 and not r["served"]["fallbacks"], (case, r)
