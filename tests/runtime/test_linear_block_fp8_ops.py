"""``fxr.linear_block_fp8`` (runtime/ops/linear_block_fp8.py): the block-FP8 GEMM's spec (the
dequantizing reference), its constraints, and our Triton kernel in Triton's interpreter against
that reference; on the GPU (marked ``gpu``) each provider compiled, forced in turn.

The kernel is not bit exact with the reference: it sums each 128-wide K block's products in the
MMA, scales that partial sum, and adds the blocks in order, where the reference dequantizes and
lets one GEMM sum everything. Both are float32 sums of the same products, so they agree within a
few float32 roundings of the sum of magnitudes (``BOUND``); rounded to bf16 they agree but where
a value lies within that of a bf16 rounding boundary.
"""

from __future__ import annotations

import types

import pytest
import torch

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import linear_block_fp8 as lb
from fxrewrite.runtime.ops.quant_block import dequant_fp8_block, quant_fp8_block

F32, BF16 = torch.float32, torch.bfloat16
BOUND = 2**-20  # relative to sum_k |a_k w_k|: a few float32 roundings over K <= 2048, either order


def operands(m: int | tuple[int, ...], n: int, k: int, device: str = "cpu", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(a_q, a_scale, w_q, w_scale): activations with rows of scales 1e-2 .. 1e1 (one zero row) and
    a weight whose 128 x 128 tiles differ in scale, both quantized by the formats' own quantizers."""
    g = torch.Generator().manual_seed(seed)
    lead = (m,) if isinstance(m, int) else m
    x = torch.randn(*lead, k, generator=g) * torch.logspace(-2, 1, lead[-1]).unsqueeze(-1)
    x.view(-1, k)[0] = 0
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, -1, n // 128).repeat_interleave(128).unsqueeze(-1)
    a_q, a_s = quant_fp8_block(x)
    w_q, w_s = lb.quant_weight_block(w)
    return tuple(t.to(device) for t in (a_q, a_s, w_q, w_s))


def magnitude(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """``sum_k |a_k w_k|`` per output (float64): what a float32 summation error scales with."""
    a, w = dequant_fp8_block(a_q, a_s).double().abs(), lb.dequant_weight_block(w_q, w_s).double().abs()
    return a @ w.t()


def assert_close_to_reference(got: torch.Tensor, args: tuple[torch.Tensor, ...], out_dtype: torch.dtype) -> None:
    want = lb.linear_block_fp8_reference(*args, out_dtype)
    assert got.shape == want.shape and got.dtype == want.dtype == out_dtype
    args = tuple(t.cpu() for t in args)
    bound = BOUND * magnitude(*args) + 1e-30
    if out_dtype != F32:  # and the output's own rounding, one step either way
        bound = bound + want.cpu().double().abs() * torch.finfo(out_dtype).eps
    err = (got.cpu().double() - want.cpu().double()).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


# -- the spec -----------------------------------------------------------------------------------


def test_reference_is_the_dequantized_product() -> None:
    a_q, a_s, w_q, w_s = operands(5, 256, 384)
    want = dequant_fp8_block(a_q, a_s) @ lb.dequant_weight_block(w_q, w_s).t()
    assert torch.equal(lb.linear_block_fp8_reference(a_q, a_s, w_q, w_s, F32), want)
    assert torch.equal(lb.linear_block_fp8_reference(a_q, a_s, w_q, w_s, BF16), want.to(BF16))


def test_each_scale_reaches_its_block() -> None:
    """The twin: doubling one activation group's scale changes that row only, by that group's share;
    doubling one weight tile's scale changes that tile's 128 outputs only."""
    a_q, a_s, w_q, w_s = operands(4, 256, 256)
    base = lb.linear_block_fp8_reference(a_q, a_s, w_q, w_s, F32)
    a2 = a_s.clone()
    a2[2, 1] *= 2
    moved = (lb.linear_block_fp8_reference(a_q, a2, w_q, w_s, F32) != base).any(-1)
    assert moved.tolist() == [False, False, True, False]
    w2 = w_s.clone()
    w2[1, 0] *= 2
    moved = (lb.linear_block_fp8_reference(a_q, a_s, w_q, w2, F32) != base).any(0)
    assert not moved[:128].any() and moved[128:].all()


def test_checks_refuse_what_the_kernels_cannot_take() -> None:
    a_q, a_s, w_q, w_s = operands(3, 256, 256)
    check = lb.check_formats
    assert check(a_q, a_s, w_q, w_s, BF16) is None
    assert check(a_q.float(), a_s, w_q, w_s, BF16) == "operands torch.float32, torch.float8_e4m3fn are not float8_e4m3fn"
    assert check(a_q, a_s.to(BF16), w_q, w_s, BF16) == "scales torch.bfloat16, torch.float32 are not float32"
    assert check(a_q, a_s, w_q, w_s, torch.int32) == "output dtype torch.int32"
    assert check(a_q, a_s, w_q[:, :128], w_s, BF16) == "shapes (3, 256) x (256, 128)"
    assert check(a_q, a_s.repeat_interleave(2, -1), w_q, w_s, BF16).startswith("activation scales (3, 4)")  # groups of 64
    assert check(a_q, a_s, w_q, w_s[:1], BF16).startswith("weight scales (1, 2)")
    assert check(a_q[:, :192], a_s, w_q[:, :192], w_s, BF16) == "K 192 and N 256 are not multiples of 128"
    wide = operands(4, 256, 256)
    assert check(wide[0].t().contiguous().t(), *wide[1:], BF16) == "operand or scales not contiguous"


def test_cublaslt_is_hoppers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    args = operands(3, 256, 256)
    for cap, want in (((9, 0), None), ((10, 0), "sm100: cuBLASLt's 1x128 x 128x128 block scaling is Hopper's")):
        monkeypatch.setattr(providers, "device_capability", lambda device, cap=cap: cap)
        assert lb._cublaslt_check(*args, BF16) == want


# -- the Triton kernel, interpreted --------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 256, 256), (7, 384, 512), ((2, 9), 256, 384), (130, 128, 256)])
def test_triton_kernel_is_the_reference_within_float32_roundings(
    triton_linear_block_fp8: types.ModuleType, m: int | tuple[int, ...], n: int, k: int, out_dtype: torch.dtype
) -> None:
    """Tiles of 16, 32 and 128 rows, 64- and 128-wide column tiles, partial tiles, leading dims."""
    args = operands(m, n, k)
    assert lb.check_formats(*args, out_dtype) is None
    assert_close_to_reference(triton_linear_block_fp8.linear_block_fp8(*args, out_dtype), args, out_dtype)


def test_triton_kernel_applies_the_scales(triton_linear_block_fp8: types.ModuleType) -> None:
    """The twin of the test above: the unscaled FP8 product (what a kernel that dropped the
    scales would give) is far from the reference, the kernel's is not."""
    args = operands(8, 256, 256)
    assert_close_to_reference(triton_linear_block_fp8.linear_block_fp8(*args, F32), args, F32)
    with pytest.raises(AssertionError):
        assert_close_to_reference(args[0].float() @ args[2].float().t(), args, F32)


@pytest.mark.parametrize("rows", [1, 64, 512])
def test_triton_kernel_compiles_for_hopper(rows: int) -> None:
    """Compiled for sm90 without a GPU, in each row tiling: 64 rows and more are Hopper's FP8 MMA
    (``wgmma`` e4m3 x e4m3 into float32); 16-row tiles ``mma.sync`` on the values as fp16 (exact)."""
    from helpers.triton import compile_for_hopper

    tk = pytest.importorskip("fxrewrite.runtime.triton_linear_block_fp8", reason="triton is not installed")

    bm, bn, warps = tk.tiles(rows)
    types = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "c_ptr": "*bf16"}
    ptx = compile_for_hopper("fxrewrite.runtime.triton_linear_block_fp8", "_linear_block_fp8_kernel", types,
                             {"BM": bm, "BN": bn, "BK": 128}, num_warps=warps, num_stages=3)  # fmt: skip
    mma = "wgmma.mma_async.sync.aligned.m64n" if bm >= 64 else "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    assert mma in ptx and (bm < 64 or ".f32.e4m3.e4m3" in ptx)


# -- GPU: each provider compiled, against the reference ------------------------------------------


GPU_SHAPES = [(1, 4096, 4096), (8, 6144, 4096), (64, 4096, 4096), (512, 28672, 4096), (4096, 4096, 14336)]


def assert_gpu_result(got: torch.Tensor, args: tuple[torch.Tensor, ...]) -> None:
    """Within 2^-13 of the sum of magnitudes (Hopper's FP8 MMA may sum a block's 128 products in
    less than float32) and one bf16 rounding of the float32 reference."""
    cpu = tuple(t.cpu() for t in args)
    want = lb.linear_block_fp8_reference(*cpu, F32).double()
    bound = 2**-13 * magnitude(*cpu) + want.abs() * torch.finfo(BF16).eps + 1e-30
    err = (got.cpu().double() - want).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize(("m", "n", "k"), GPU_SHAPES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_op_is_served_by_triton(m: int, n: int, k: int) -> None:
    """Through ``torch.ops.fxr`` in the default order: our Triton kernel serves (sm89+), bf16 output."""
    providers.configure(None)
    providers.reset_counts()
    args = operands(m, n, k, "cuda")
    got = torch.ops.fxr.linear_block_fp8(*args, BF16)
    assert providers.served()["linear_block_fp8"] == {"fallbacks": {}, "triton": 1}, providers.served()
    assert_gpu_result(got, args)


@pytest.mark.parametrize(("m", "n", "k"), GPU_SHAPES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cublaslt_block_scaled_gemm(m: int, n: int, k: int) -> None:
    """``torch._scaled_mm`` with the 1x128 x 128x128 recipe (the second kernel, called directly: an
    override cannot pick it, "torch" forces the reference): on Hopper it runs and agrees with the
    reference; elsewhere its check refuses it. A failure here says what this torch lacks."""
    args = operands(m, n, k, "cuda")
    reason = lb._cublaslt_check(*args, BF16)
    if torch.cuda.get_device_capability()[0] != 9:
        assert reason is not None and "Hopper" in reason
        pytest.skip(reason)
    if reason is not None:  # refused by the probe: said, and the op served by Triton
        assert "lacks the block-scaled recipe" in reason
        pytest.skip(reason)
    assert_gpu_result(lb._cublaslt(*args, BF16), args)
