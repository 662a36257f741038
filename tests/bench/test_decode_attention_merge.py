"""The split-KV decode kernel's in-launch merge (bench/decode_attention.py): the program that
stores the last slice of a (sequence, KV head) merges the slices, so the attention is one launch.
In Triton's interpreter on CPU (programs run one after another: the merge's arithmetic and the
arrival counts), and on the GPU under CUDA graph replays (programs concurrent; the counts must be
zero again after every launch)."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest
import torch

from helpers.triton import interpreted


@pytest.fixture
def kernels() -> Iterator[types.ModuleType]:
    yield from interpreted("decode_attention", "_partial_kernel")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, length: int) -> torch.Tensor:
    import engine_model

    kv_range = torch.arange(length, dtype=torch.int32, device=q.device)
    return engine_model._decode(q.double(), k.double(), v.double(), lens, kv_range)


def _case(batch: int, heads: int, kv_heads: int, dim: int, length: int, device: str, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(batch, length + 4, kv_heads, dim, generator=g, device=device)
    v = torch.randn(batch, length + 4, kv_heads, dim, generator=g, device=device)
    q = torch.randn(batch, heads, dim, generator=g, device=device)
    lens = torch.randint(1, length + 1, (batch,), generator=g, device=device, dtype=torch.int32)
    return q, k, v, lens


@pytest.mark.parametrize("per_sm", [32, 1], ids=["five-splits", "one-split"])
def test_merged_in_the_launch_matches_sdpa(kernels: types.ModuleType, per_sm: int) -> None:
    q, k, v, lens = _case(2, 8, 2, 64, 300, "cpu")
    tuning = kernels.Tuning(per_sm=per_sm)
    splits, _ = kernels.split_plan(2, 2, 300, q.device, tuning)
    assert (splits > 1) == (per_sm == 32)
    got = kernels.decode_attention(q, k, v, lens, 300, tuning)
    torch.testing.assert_close(got.double(), _reference(q, k, v, lens, 300), atol=2e-5, rtol=2e-5)
    assert not kernels._ARRIVALS[q.device].any(), "every merging program zeroes its count"


def test_fp8_output_merged_in_the_launch(kernels: types.ModuleType) -> None:
    q, k, v, lens = _case(2, 8, 2, 64, 300, "cpu", seed=1)
    scale = torch.tensor([0.01])
    got = kernels.decode_attention(q, k, v, lens, 300, kernels.Tuning(per_sm=32), out_scale=scale)
    want = (_reference(q, k, v, lens, 300).float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert got.dtype == torch.float8_e4m3fn
    # one e4m3 step at most: the reference rounds once from float64, the kernel from float32
    steps = (got.float() - want.float()).abs() / want.float().abs().clamp_min(2**-6)
    assert steps.max().item() <= 0.125 + 1e-6


@pytest.mark.gpu
def test_graph_replays_find_the_counts_zeroed() -> None:
    pytest.importorskip("triton")
    import decode_attention

    q, k, v, lens = _case(8, 32, 8, 128, 1025, "cuda")
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    assert decode_attention.split_plan(8, 8, 1025, q.device)[0] > 1
    decode_attention.decode_attention(q, k, v, lens, 1025)  # warm-up: builds, makes the counts
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention.decode_attention(q, k, v, lens, 1025)
    for seed in range(20):  # fresh queries each replay: a stale count would merge too early or never
        q.copy_(torch.randn(q.shape, generator=torch.Generator("cuda").manual_seed(seed), device="cuda"))
        graph.replay()
        torch.testing.assert_close(out.double(), _reference(q, k, v, lens, 1025), atol=2e-2, rtol=2e-2)
    assert not decode_attention._ARRIVALS[q.device].any()


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("quant", [False, True])
def test_the_kernel_compiles_for_hopper(splits: int, quant: bool) -> None:
    """The kernel compiled for sm90: with slices to merge, one atomic add and one exchange,
    each acquire-release at GPU scope, and the other slices' stores read past L1; with one slice,
    neither."""
    import re

    from helpers.triton import compile_for_hopper

    ptr = {"lens_ptr": "*i32", "slots_ptr": "*i64", "count_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32",
           "scale_ptr": "*fp32", "scale": "fp32"}  # fmt: skip
    types = {n: ptr.get(n, "*bf16") if n.endswith("_ptr") or n == "scale" else "i32"
             for n in ("q_ptr", "k_ptr", "v_ptr", "lens_ptr", "o_ptr", "lse_ptr", "nk_ptr", "nv_ptr", "slots_ptr",
                       "out_ptr", "scale_ptr", "count_ptr", "scale")}  # fmt: skip
    if quant:
        types["out_ptr"] = "*fp8e4nv"
    ptx = compile_for_hopper("decode_attention", "_partial_kernel", types,
                             dict(GROUP=4, GROUP_PAD=16, DIM=128, BLOCK=64, SPLITS=splits, PRECISION="tf32",
                                  STORE=True, QUANT=quant, PDL=False, PREFETCH=False), num_warps=4, num_stages=2)  # fmt: skip
    atomics = re.findall(r"atom\.global\.gpu\.acq_rel\.(\w+)", ptx)
    assert atomics == ([] if splits == 1 else ["add", "exch"]), atomics
    assert (splits == 1) == ("ld.global.cg" not in ptx)


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_pdl_kernel_waits_before_it_reads_the_step(prefetch: bool) -> None:
    """Under PDL the kernel waits for the kernel before (griddepcontrol.wait) before it loads q
    and the step's key and value, prefetches the cached ones into L2 before that where asked, and
    lets the next kernel launch after its walk, before its stores."""
    import re

    from helpers.triton import compile_for_hopper

    types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "nk_ptr", "nv_ptr", "out_ptr")}
    types.update(lens_ptr="*i32", slots_ptr="*i64", count_ptr="*i32", o_ptr="*fp32", lse_ptr="*fp32",
                 scale_ptr="*fp32", scale="fp32")  # fmt: skip
    ptx = compile_for_hopper("decode_attention", "_partial_kernel", types,
                             dict(GROUP=4, GROUP_PAD=16, DIM=128, BLOCK=64, SPLITS=4, PRECISION="tf32", STORE=True,
                                  QUANT=False, PDL=True, PREFETCH=prefetch), num_warps=4, num_stages=2)  # fmt: skip
    wait, go = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert wait < go < ptx.index("atom.global")  # the count (after the stores) comes after the go
    assert re.findall(r"ld\.global\S*", ptx[:wait]) == ["ld.global.b32"]  # the sequence's length alone
    assert ("prefetch.global.L2" in ptx[:wait]) == prefetch
    plain = compile_for_hopper("decode_attention", "_partial_kernel", types,
                               dict(GROUP=4, GROUP_PAD=16, DIM=128, BLOCK=64, SPLITS=4, PRECISION="tf32", STORE=True,
                                    QUANT=False, PDL=False, PREFETCH=False), num_warps=4, num_stages=2)  # fmt: skip
    assert "griddepcontrol" not in plain and "prefetch.global" not in plain


def test_launch_options_follow_the_device_and_the_bench_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """PDL where fxrewrite launches its GEMMs so, the prefetch where the step's keys and values fit
    the bound, neither on CPU, inside ``launched("plain")`` or fxrewrite's ``without_pdl()``."""
    decode_attention = pytest.importorskip("decode_attention", reason="triton is not installed")
    from fxrewrite.runtime import triton_gemm

    q, k = torch.empty(1, 32, 128, dtype=torch.bfloat16), torch.empty(1, 1040, 8, 128, dtype=torch.bfloat16)
    tuning = decode_attention.Tuning(prefetch_bytes=8 << 20)

    def options(batch: int) -> dict[str, bool]:
        return decode_attention._launch(q, k, batch, 1025, tuning)

    assert options(1) == {}  # CPU
    monkeypatch.setattr(triton_gemm, "pdl", lambda device: True)
    assert options(1) == {"PDL": True, "launch_pdl": True, "PREFETCH": True}  # 4.2 MB of keys and values
    assert options(8) == {"PDL": True, "launch_pdl": True, "PREFETCH": False}  # 33.6 MB
    with decode_attention.launched("pdl"):
        assert options(1)["PDL"] and not options(1)["PREFETCH"]
    with decode_attention.launched("plain"):
        assert options(1) == {}
    with triton_gemm.without_pdl():
        assert options(1) == {}
    with pytest.raises(ValueError, match="one of"), decode_attention.launched("fast"):
        pass
