"""``fxr.linear_fp8`` (runtime/ops/linear.py): an FP8 linear with per-tensor scales, as static FP8
checkpoints run it. The reference is ``torch._scaled_mm``; the Triton kernel (the decode GEMM's
``FP8`` switch, runtime/triton_gemm.py) runs here under Triton's interpreter, and compiled for
sm90 to check what it lowers to; tests/runtime/test_linear_fp8_gpu.py runs it on the GPU."""

from __future__ import annotations

import types
import zlib

import pytest
import torch

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.runtime.ops import linear as linear_ops

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def operands(gen: torch.Generator, rows: tuple[int, ...], k: int, n: int) -> tuple[torch.Tensor, ...]:
    """e4m3 input and weight spread over e4m3's range, per-tensor float32 scales."""
    x = (torch.randn(*rows, k, generator=gen) * 40).clamp(-448, 448).to(FP8)
    w = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(FP8)
    return x, w, torch.tensor(0.013), torch.tensor(0.0021)


def test_the_reference_is_scaled_mm_over_the_rows(gen: torch.Generator) -> None:
    x, w, sa, sb = operands(gen, (2, 3), 64, 32)
    got = torch.ops.fxr.linear_fp8(x, w, sa, sb, BF16)
    want = torch._scaled_mm(x.reshape(6, 64), w.t(), scale_a=sa, scale_b=sb, out_dtype=BF16).reshape(2, 3, 32)
    assert got.dtype == BF16 and got.shape == (2, 3, 32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    exact = (x.double() @ w.double().T) * (sa.double() * sb.double())
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)


def test_the_checks_refuse_what_the_kernel_cannot_serve(gen: torch.Generator) -> None:
    x, w, sa, sb = operands(gen, (4,), 64, 32)
    check = linear_ops.fp8_skinny_check
    assert check(x, w, sa, sb, BF16) is None
    assert "not float8_e4m3fn" in check(x.to(torch.float8_e5m2), w, sa, sb, BF16)
    assert "not float8_e4m3fn" in check(x.to(BF16), w.to(BF16), sa, sb, BF16)
    assert "not one float32 scale per tensor" in check(x, w, sa.expand(4, 1), sb, BF16)
    assert "not one float32 scale per tensor" in check(x, w, sa, sb.double(), BF16)
    assert "output dtype" in check(x, w, sa, sb, FP8)
    assert "17 rows" in check(torch.cat([x] * 5)[:17], w, sa, sb, BF16)
    assert "unit stride" in check(x, w.t().contiguous().t(), sa, sb, BF16)
    assert "shapes" in check(x[:, :32], w, sa, sb, BF16)


@pytest.mark.parametrize(("rows", "k", "n", "out_dtype"), [((1,), 256, 48, BF16), ((5,), 200, 96, torch.float32),
                                                           ((2, 8), 512, 64, torch.float16)])  # fmt: skip
def test_kernel_matches_scaled_mm(triton_gemm: types.ModuleType, gen: torch.Generator, rows: tuple[int, ...], k: int,
                                  n: int, out_dtype: torch.dtype) -> None:  # fmt: skip
    """Each product exact (the tiles widened to float16), summed in float32 in another order than
    the reference's: within one rounding of the output, float32's a few ulps; k not a multiple of
    the block (200) takes the masked loads."""
    x, w, sa, sb = operands(gen, rows, k, n)
    got = triton_gemm.linear_fp8(x, w, sa, sb, out_dtype)
    want = linear_ops.linear_fp8_reference(x, w, sa, sb, out_dtype)
    assert got.dtype == out_dtype and got.shape == want.shape
    tol = {BF16: 2**-8, torch.float16: 2**-11, torch.float32: 1e-5}[out_dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-5)


def test_prepare_keys_the_fp8_build_apart(triton_gemm: types.ModuleType) -> None:
    """The FP8 launch is a build of its own (its switch, its operands' dtypes, a k step twice as
    long where k allows), keyed apart from bf16's."""
    x, w = torch.empty(4, 4096, dtype=FP8), torch.empty(1024, 4096, dtype=FP8)
    sa = sb = torch.empty((), dtype=torch.float32)
    key, _ = triton_gemm.prepare("linear_fp8", x, w, sa, sb, BF16)
    plain, _ = triton_gemm.prepare("linear", x.to(BF16), w.to(BF16))
    assert key != plain and ("FP8", True) in key[-1] and ("FP8", True) not in plain[-1]
    assert dict(key[-1])["BK"] == 2 * dict(plain[-1])["BK"]


def test_the_fp8_kernel_widens_e4m3_tiles_on_hopper() -> None:
    """Compiled for sm90: the e4m3 tiles loaded as bytes and widened with the hardware's e4m3 ->
    f16 conversion, then the float16 MMA; the scales read once each."""
    from helpers.triton import compile_for_hopper

    types = {n: "*fp8e4nv" for n in ("x_ptr", "w_ptr")}
    types.update({n: "*bf16" for n in ("b_ptr", "y_ptr", "g_ptr", "r_ptr", "pos_ptr", "cs_ptr", "sg_ptr")})
    types.update(parts_ptr="*fp32", sa_ptr="*fp32", sb_ptr="*fp32", qs_ptr="*fp32", eps="fp32")
    ptx = compile_for_hopper("fxrewrite.runtime.triton_gemm", "_skinny_linear_kernel", types,
                             dict(BN=32, BK=512, HAS_BIAS=False, EVEN_K=True, GATED=False, NORM=False,
                                  NORM_WEIGHT=False, RESIDUAL=False, HALF=0, HAND_OFF=False, PARTS=0, PDL=False,
                                  FP8=True), num_warps=4, num_stages=4)  # fmt: skip
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "mma.sync.aligned" in ptx and ".f16.f16" in ptx


# --------------------------------------------------------------------------- with SiLU-and-mul and the quantization after it


def steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """e4m3 steps between two quantized tensors (2^-6: e4m3's smallest normal step's reach)."""
    return (got.float() - want.float()).abs() / want.float().abs().clamp_min(2**-6)


def test_the_gated_reference_is_the_unfused_ops(gen: torch.Generator) -> None:
    x, w, sa, sb = operands(gen, (2, 3), 64, 32)
    scale = torch.tensor(0.01)
    got = torch.ops.fxr.linear_fp8_silu_and_mul_quant(x, w, sa, sb, BF16, scale)
    want = torch.ops.fxr.silu_and_mul_quant_fp8(torch.ops.fxr.linear_fp8(x, w, sa, sb, BF16), scale)
    assert got.dtype == FP8 and got.shape == (2, 3, 16)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)
    check = linear_ops.fp8_gated_check
    assert check(x.reshape(6, 64), w, sa, sb, BF16, scale) is None
    assert "odd weight rows" in check(x, w[:31], sa, sb, BF16, scale)
    assert "not one float32 scale" in check(x, w, sa, sb, BF16, scale.expand(2))


@pytest.mark.parametrize(("rows", "k", "n"), [((1,), 256, 96), ((5,), 200, 64), ((16,), 512, 128)])
def test_kernel_gated_quant_matches_the_reference(triton_gemm: types.ModuleType, gen: torch.Generator,
                                                  rows: tuple[int, ...], k: int, n: int) -> None:  # fmt: skip
    """The gate and up sums in another order than the reference's may round to another bf16, and
    that to the neighbouring e4m3 value: at most one step, and rarely."""
    x, w, sa, sb = operands(gen, rows, k, n)
    scale = torch.tensor(0.01)
    got = triton_gemm.linear_fp8_silu_and_mul_quant(x, w, sa, sb, BF16, scale)
    want = linear_ops.linear_fp8_silu_and_mul_quant_reference(x, w, sa, sb, BF16, scale)
    assert got.dtype == FP8 and got.shape == want.shape == (*rows, n // 2)
    assert want.float().abs().max() > 16  # the outputs span e4m3's steps, not its few smallest values
    assert steps(got, want).max().item() <= 0.125 + 1e-6
    assert (got.float() == want.float()).float().mean().item() >= 0.9
