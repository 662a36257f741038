"""The async-TP ops (runtime/ops/async_tp.py) on two ranks against what they fuse:
``fxr.sp_linear_reduce_add_rms_norm`` against ``fxr.linear`` then ``fxr.all_reduce_add_rms_norm``,
``fxr.sp_all_gather_linear`` against ``fxr.linear`` (``fxr.linear_silu_and_mul``) of the whole
input, above the threshold and below it, at row counts that are and are not a multiple of the
two ranks. CPU: gloo, the reference (NCCL's steps). GPU (marked; two devices): the symm-mem paths
(the rows exchanged through symmetric memory while the GEMMs run) against the reference, eagerly,
three back to back, and replayed from a CUDA graph.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.rewrites import fake_process_group

from fxrewrite.runtime.ops import async_tp
from fxrewrite.runtime.ops.sequence_parallel import sharded
from fxrewrite.testing import run_ranks

REDUCE, GATHER = torch.ops.fxr.sp_linear_reduce_add_rms_norm.default, torch.ops.fxr.sp_all_gather_linear.default
SITE = torch.ops.fxr.sp_linear_reduce_add_rms_norm_linear.default
AR, LINEAR = torch.ops.fxr.all_reduce_add_rms_norm.default, torch.ops.fxr.linear.default
GATED = torch.ops.fxr.linear_silu_and_mul.default
EPS, K, H, N = 1e-6, 32, 64, 48
CASES = ((5, 4), (8, 4), (1, 2), (3, 100), (2, 3, 1))  # (rows..., min_tokens): the last has 3-D input [2, 3, H]


def _args(rank: int, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The row-parallel input and weight differ per rank; the residual, the norm weight and the
    next GEMM's weights are the same on every rank here (each rank's column shard in a model)."""
    mine, shared = torch.Generator().manual_seed(100 + rank), torch.Generator().manual_seed(7)
    t = {"a": torch.randn(*shape, K, generator=mine), "w": torch.randn(H, K, generator=mine) * K**-0.5,
         "residual": torch.randn(*shape, H, generator=shared), "weight": 1 + 0.1 * torch.randn(H, generator=shared),
         "w2": torch.randn(N, H, generator=shared) * H**-0.5, "w2g": torch.randn(2 * N, H, generator=shared) * H**-0.5}  # fmt: skip
    return {k: v.to(device=device, dtype=dtype) for k, v in t.items()}


def _mine(rows: int, rank: int, world: int, min_tokens: int) -> slice:
    """The rows this rank's sharded outputs hold (every row below the threshold)."""
    if not sharded(rows, min_tokens):
        return slice(0, rows)
    chunk = -(-rows // world)
    return slice(min(rank * chunk, rows), min((rank + 1) * chunk, rows))


def _poisoned(x: torch.Tensor, keep: slice) -> torch.Tensor:
    """``x`` with every row but ``keep`` NaN: a reader of another rank's rows would show it."""
    rows = x.reshape(-1, x.shape[-1]).clone()
    keep_rows = rows[keep].clone()
    rows.fill_(float("nan"))
    rows[keep] = keep_rows
    return rows.view(x.shape)


def ops_worker(rank: int, world: int, device: str = "cpu", dtypes: tuple = (torch.float32, torch.bfloat16),
               cases: tuple = CASES) -> dict[str, Any]:  # fmt: skip
    """Per case and dtype: each op's outputs and what they fuse, computed on this rank."""
    group = dist.group.WORLD.group_name
    device = device.format(rank=rank)
    out: dict[str, Any] = {}
    for *shape, min_tokens in cases:
        rows = int(torch.tensor(shape).prod())
        for dtype in dtypes:
            t = _args(rank, tuple(shape), dtype, device)
            ref_out, ref_sum = AR(LINEAR(t["a"], t["w"]), t["residual"], t["weight"], EPS, group)
            res = {"ref": (ref_out, ref_sum), "ref_linear": LINEAR(ref_out, t["w2"]), "ref_gated": GATED(ref_out, t["w2g"])}
            for gather in (True, False):
                res[f"reduce/{gather}"] = REDUCE(t["a"], t["w"], t["residual"], t["weight"], EPS, min_tokens, gather, group)
            res["reduce/no-gemm"] = REDUCE(LINEAR(t["a"], t["w"]), None, t["residual"], t["weight"], EPS, min_tokens,
                                           False, group)  # fmt: skip
            # the all-gather reads this rank's rows of its input only: the others are NaN here
            x = _poisoned(res["reduce/False"][0], _mine(rows, rank, world, min_tokens))
            res["gather"] = GATHER(x, t["w2"], min_tokens, False, group)
            res["gather/gated"] = GATHER(x, t["w2g"], min_tokens, True, group)
            for gated, w2 in ((False, t["w2"]), (True, t["w2g"])):
                res[f"site/{gated}"] = SITE(t["a"], t["w"], t["residual"], t["weight"], EPS, w2, gated, min_tokens,
                                            2048, group)  # fmt: skip
            out[f"{tuple(shape)}/{min_tokens}/{dtype}"] = (rows, min_tokens, res)
    return out


def check_ops(results: list[dict[str, Any]], world: int = 2, tol: dict | None = None) -> None:
    for rank, res in enumerate(results):
        for key, (rows, min_tokens, r) in res.items():
            mine = _mine(rows, rank, world, min_tokens)
            ref_out, ref_sum = (t.reshape(rows, -1) for t in r["ref"])

            def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
                kw = (tol or {}).get(want.dtype, {})
                torch.testing.assert_close(got.float(), want.float(), **kw, msg=lambda m: f"rank {rank} {key} {what}: {m}")

            for name in ("reduce/True", "reduce/False", "reduce/no-gemm"):
                out, total = (t.reshape(rows, -1) for t in r[name])
                assert out.shape == ref_out.shape and total.shape == ref_sum.shape, (key, name)
                close(total[mine], ref_sum[mine], f"{name} sum")
                close(out if name == "reduce/True" else out[mine], ref_out if name == "reduce/True" else ref_out[mine],
                      f"{name} out")  # fmt: skip
            for name, want in (("gather", r["ref_linear"]), ("gather/gated", r["ref_gated"])):
                assert r[name].shape == want.shape, (key, name)
                close(r[name], want, name)
            for name, want in (("site/False", r["ref_linear"]), ("site/True", r["ref_gated"])):
                y, total = r[name]
                assert y.shape == want.shape and total.shape == r["ref"][1].shape, (key, name)
                close(y, want, f"{name} y")
                close(total.reshape(rows, -1)[mine], ref_sum[mine], f"{name} sum")


def test_the_ops_equal_what_they_fuse_on_two_ranks() -> None:
    """gloo, float32 and bf16: every rank's outputs equal the unfused ops' (``sum``, and ``out``
    without the gather, in this rank's rows where the call shards), the all-gather's inputs
    NaN outside this rank's rows; the site op's ``y`` on every row."""
    check_ops(run_ranks(ops_worker, backend="gloo", timeout=120))


@pytest.fixture
def fake_group() -> Any:
    with fake_process_group():
        yield dist.group.WORLD.group_name


def test_fake_impls_keep_the_unsharded_shapes(fake_group: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, w, v = torch.empty(7, K), torch.empty(H, K), torch.empty(H)
        r = torch.empty(7, H)
        for min_tokens in (4, 100):
            for gather in (True, False):
                out, total = REDUCE(a, w, r, v, EPS, min_tokens, gather, fake_group)
                assert out.shape == total.shape == (7, H)
            assert GATHER(r, torch.empty(N, H), min_tokens, False, fake_group).shape == (7, N)
            assert GATHER(r, torch.empty(2 * N, H), min_tokens, True, fake_group).shape == (7, N)
            for gated, n in ((False, N), (True, 2 * N)):
                y, total = SITE(a, w, r, v, EPS, torch.empty(n, H), gated, min_tokens, 2048, fake_group)
                assert y.shape == (7, N) and total.shape == (7, H)


def test_below_the_threshold_no_symm_mem_path_is_asked_for(fake_group: str) -> None:
    """The symm-mem kernels' checks: a call below the threshold is not theirs (not a refusal)."""
    x, w = torch.empty(3, H), torch.empty(N, H)
    assert async_tp._gather_symm_check(x, w, 4, False, fake_group) == "3 rows < 4"
    # the site op's two symm-mem paths: its rows pick one before anything else is asked
    a, v = torch.empty(4096, K), torch.empty(H)
    site_args = (torch.empty(H, K), torch.empty(4096, H), v, EPS, w, False, 512, 2048, fake_group)
    assert async_tp._site_check(False, a, *site_args) == "4096 rows >= 2048"
    assert async_tp._site_check(True, a[:3], *site_args) == "3 rows < 2048"
    assert async_tp.refusals() == {}


def test_a_residual_of_another_dtype_is_refused_before_any_symmetric_memory(
        fake_group: str, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The reduce's one kernel stores the sum in the input's dtype: a float32 residual under bf16
    GEMMs takes the reference's path, with the reason counted (the GPU test is the twin: no
    refusal where the dtypes agree)."""
    monkeypatch.setattr(async_tp, "_REFUSALS", collections.Counter())
    bf16 = torch.bfloat16
    a, w, v = torch.empty(8, K, dtype=bf16), torch.empty(H, K, dtype=bf16), torch.empty(H, dtype=bf16)
    reason = async_tp._reduce_symm_check(a, w, torch.empty(8, H), v, EPS, 4, False, fake_group)
    assert reason is not None and "float32" in reason, reason
    assert async_tp.refusals() == {"sp_linear_reduce_add_rms_norm": {reason: 1}}


# --------------------------------------------------------------------------- two GPUs

GPU_CASES = ((1, 512), (64, 512), (512, 512), (1023, 512), (4096, 512))


def gpu_worker(rank: int, world: int) -> dict[str, Any]:
    """bf16 on two GPUs, hidden 4096 (the 8B shape): each op through its CUDA dispatch (symm-mem
    from 512 rows) against the reference (NCCL), the path each call took, and one CUDA graph of
    both ops at 4096 rows replayed on new inputs against eager calls."""
    from fxrewrite.runtime import providers

    group = dist.group.WORLD.group_name
    dev = f"cuda:{rank}"
    out: dict[str, Any] = {}

    def inputs(rows: int, seed: int) -> list[torch.Tensor]:
        g = torch.Generator(device=dev).manual_seed(seed + rank)
        shared = torch.Generator(device=dev).manual_seed(seed)

        def rnd(*s: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*s, generator=gen, device=dev) * scale).to(torch.bfloat16)

        return [rnd(rows, 2048, gen=g), rnd(4096, 2048, gen=g, scale=2048**-0.5), rnd(rows, 4096, gen=shared),
                1 + rnd(4096, gen=shared, scale=0.1), rnd(3072, 4096, gen=shared, scale=4096**-0.5)]  # fmt: skip

    def step(a: torch.Tensor, w: torch.Tensor, res: torch.Tensor, v: torch.Tensor, w2: torch.Tensor,
             min_tokens: int, ref: bool = False) -> tuple[torch.Tensor, ...]:  # fmt: skip
        reduce = async_tp.sp_linear_reduce_add_rms_norm_reference if ref else REDUCE
        gather = async_tp.sp_all_gather_linear_reference if ref else GATHER
        o, s = reduce(a, w, res, v, EPS, min_tokens, False, group)
        return o, s, gather(o, w2, min_tokens, False, group)

    def site(a: torch.Tensor, w: torch.Tensor, res: torch.Tensor, v: torch.Tensor, w2: torch.Tensor,
             min_tokens: int, overlap: int, ref: bool = False) -> tuple[torch.Tensor, ...]:  # fmt: skip
        op = async_tp.sp_linear_reduce_add_rms_norm_linear_reference if ref else SITE
        return op(a, w, res, v, EPS, w2, False, min_tokens, overlap, group)

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.float() - want.float()).abs().max() / want.float().abs().max())

    for rows, min_tokens in GPU_CASES:
        providers.reset_counts()
        a, w, res, v, w2 = inputs(rows, rows)
        got, want = step(a, w, res, v, w2, min_tokens), step(a, w, res, v, w2, min_tokens, ref=True)
        mine = _mine(rows, rank, world, min_tokens)
        out[f"{rows}/{min_tokens}"] = {
            "sum": rel(got[1][mine], want[1][mine]), "y": rel(got[2], want[2]),
            "served": {op: providers.served().get(op, {}) for op in async_tp.OPS},
        }  # fmt: skip
    # three sharded reductions back to back, nothing between them: each call's stores into the
    # peers' partials must wait until the peers have summed the call before's
    chain = [inputs(1024, 10 + i) for i in range(3)]
    got = [REDUCE(a, w, res, v, EPS, 512, False, group) for a, w, res, v, _ in chain]
    want = [async_tp.sp_linear_reduce_add_rms_norm_reference(a, w, res, v, EPS, 512, False, group)
            for a, w, res, v, _ in chain]  # fmt: skip
    mine = _mine(1024, rank, world, 512)
    out["chain"] = max(rel(g[k][mine], r[k][mine]) for g, r in zip(got, want) for k in (0, 1))
    # the site op: each path by its rows, then back to back with the two ops between (the
    # exchange has no first barrier: the calls around it must leave its buffers free)
    for rows, min_tokens in GPU_CASES:
        for overlap in (2048, 10**9):
            providers.reset_counts()
            a, w, res, v, w2 = inputs(rows, rows)
            got, want = site(a, w, res, v, w2, min_tokens, overlap), site(a, w, res, v, w2, min_tokens, overlap, ref=True)
            mine = _mine(rows, rank, world, min_tokens)
            out[f"site/{rows}/{min_tokens}/{overlap}"] = {
                "sum": rel(got[1][mine], want[1][mine]), "y": rel(got[0], want[0]),
                "served": providers.served().get("sp_linear_reduce_add_rms_norm_linear", {})}  # fmt: skip
    mixed = [inputs(1024, 20 + i) for i in range(4)]
    got, want, mine = [], [], _mine(1024, rank, world, 512)
    for i, (a, w, res, v, w2) in enumerate(mixed):
        if i == 2:  # the two ops' symm-mem paths between the exchanges
            got.append(step(a, w, res, v, w2, 512)[1:])
            want.append(step(a, w, res, v, w2, 512, ref=True)[1:])
        else:
            got.append(site(a, w, res, v, w2, 512, 2048 if i < 3 else 512)[::-1])
            want.append(site(a, w, res, v, w2, 512, 2048, ref=True)[::-1])
    out["mixed"] = max(max(rel(g[0][mine], r[0][mine]), rel(g[1], r[1])) for g, r in zip(got, want))
    static, small = inputs(4096, 1), inputs(1024, 3)
    eager = step(*static, 512)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*static, 512)
        captured_site = site(*small, 512, 2048)
    for t, new in zip([*static, *small], [*inputs(4096, 2), *inputs(1024, 4)]):
        t.copy_(new)
    graph.replay()
    again, again_site = step(*static, 512), site(*small, 512, 2048)
    mine, mine_small = _mine(4096, rank, world, 512), _mine(1024, rank, world, 512)
    out["graph"] = {"y": rel(captured[2], again[2]), "sum": rel(captured[1][mine], again[1][mine]),
                    "changed": rel(eager[2], again[2]), "site y": rel(captured_site[0], again_site[0]),
                    "site sum": rel(captured_site[1][mine_small], again_site[1][mine_small])}  # fmt: skip
    out["refusals"] = async_tp.refusals()
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_symm_mem_paths_on_two_gpus() -> None:
    """bf16: the fused GEMM + collective paths within a rounding of the NCCL reference; each call
    served by the path its rows pick (symm-mem from 512 rows, none refused; the site op's
    exchange below its overlap threshold, its overlap from there); three reductions back to
    back each right, and site ops with the two ops between them; a CUDA graph of both ops and
    of a site op replays to what eager calls give on the same inputs."""
    results = run_ranks(gpu_worker, backend="nccl", timeout=300)
    for rank, res in enumerate(results):
        print(f"rank {rank}: refusals {res['refusals']}; graph {res['graph']}")
        assert res["refusals"] == {}, res["refusals"]
        g = res["graph"]
        assert max(g["y"], g["sum"], g["site y"], g["site sum"]) < 2e-2 and g["changed"] > 0.1, g
        assert res["chain"] < 2e-2 and res["mixed"] < 2e-2, (res["chain"], res["mixed"])
        for case, r in ((k, v) for k, v in res.items() if k.startswith("site/")):
            print(f"rank {rank} {case}: {r}")
            assert r["sum"] < 2e-2 and r["y"] < 2e-2, (rank, case, r)
            rows, min_tokens, overlap = map(int, case.split("/")[1:])
            label = "all-reduce" if rows < min_tokens else f"symm-mem {'overlap' if rows >= overlap else 'exchange'}"
            assert r["served"].get(label) == 1 and not r["served"]["fallbacks"], (case, r["served"])
        for case, r in ((k, v) for k, v in res.items() if "/" in k and not k.startswith("site/")):
            print(f"rank {rank} {case}: {r}")
            assert r["sum"] < 2e-2 and r["y"] < 2e-2, (rank, case, r)
            rows, min_tokens = map(int, case.split("/"))
            want = ("symm-mem", "symm-mem") if rows >= min_tokens else ("all-reduce", "linear")
            for op, label in zip(async_tp.OPS, want):
                served = r["served"][op]
                assert served.get(label) == 1 and not served["fallbacks"], (case, op, served)
