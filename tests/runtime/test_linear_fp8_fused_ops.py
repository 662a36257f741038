"""The FP8 GEMMs with the norm's hand-off (runtime/ops/linear_fp8_fused.py): the pair computes
what ``fused_add_rms_norm_quant_fp8`` then ``linear_fp8`` compute; the Triton kernel (the decode
GEMM's ``FP8``, ``HAND_OFF`` and ``QUANT_A`` switches) against the references under Triton's
interpreter, and compiled for sm90; tests/runtime/test_linear_fp8_gpu.py runs them on the GPU."""

from __future__ import annotations

import types
import zlib

import pytest
import torch

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.runtime.ops import linear_fp8_fused as ops

FP8, BF16, F16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
FXR = torch.ops.fxr


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def e4m3(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * 40).clamp(-448, 448).to(FP8)


def layer(gen: torch.Generator, rows: int, k: int, n: int, dtype: torch.dtype = BF16) -> dict[str, torch.Tensor]:
    """o_proj's e4m3 input and weight with their scales, the residual stream and the next norm's
    weight, the next GEMM's weight (gate and up rows, 2 * 64) with its scales: values as a static
    FP8 layer sees them (the norm's output spans e4m3's range at scale 2^-6)."""
    return dict(a=e4m3(gen, rows, k), w_o=e4m3(gen, n, k), sa=torch.tensor(2e-3), sb=torch.tensor(1.5e-3),
                r=torch.randn(rows, n, generator=gen).to(dtype), g=(1 + 0.2 * torch.randn(n, generator=gen)).to(dtype),
                w=e4m3(gen, 128, n), sq=torch.tensor(2**-6), sw=torch.tensor(3e-3), so=torch.tensor(0.05))  # fmt: skip


EPS = 1e-6


def unfused(t: dict[str, torch.Tensor], dtype: torch.dtype = BF16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec: ``linear_fp8`` (o_proj), ``fused_add_rms_norm_quant_fp8``, then the next GEMM,
    plain and gated: ``(sum, y, gated)``."""
    o = FXR.linear_fp8(t["a"], t["w_o"], t["sa"], t["sb"], dtype)
    q, s = FXR.fused_add_rms_norm_quant_fp8(o, t["r"], t["g"], EPS, t["sq"])
    y = FXR.linear_fp8(q, t["w"], t["sq"], t["sw"], dtype)
    return s, y, FXR.linear_fp8_silu_and_mul_quant(q, t["w"], t["sq"], t["sw"], dtype, t["so"])


def fused(t: dict[str, torch.Tensor], dtype: torch.dtype = BF16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s, sg, parts = FXR.linear_fp8_add_rms_parts(t["a"], t["w_o"], t["sa"], t["sb"], dtype, t["r"], t["g"])
    y = FXR.rms_norm_quant_linear_fp8(sg, parts, EPS, t["sq"], t["w"], t["sw"], dtype)
    return s, y, FXR.rms_norm_quant_linear_fp8_silu_and_mul_quant(sg, parts, EPS, t["sq"], t["w"], t["sw"], dtype, t["so"])


def exact(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The next GEMM's output in float64, its input the norm's unquantized output."""
    s = t["a"].double() @ t["w_o"].double().T * (t["sa"] * t["sb"]).double() + t["r"].double()
    n = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + EPS) * t["g"].double()
    return n @ t["w"].double().T * t["sw"].double()


def assert_as_good(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], dtype: torch.dtype,
                   t: dict[str, torch.Tensor]) -> None:  # fmt: skip
    """The sum within one rounding; the GEMM after the quantized norm within what inputs quantized
    to the neighbouring e4m3 step move it (the norm rounds in another order: one input in a few
    hundred lands on the other side of a step, worth up to an eighth of it over k = 64 here), and
    no further from the float64 result than the spec is; the same for the gated e4m3 output (a
    product of two such outputs: twice the reach)."""
    (s, y, h), (s_ref, y_ref, h_ref) = got, want
    step = torch.finfo(dtype).eps
    torch.testing.assert_close(s.float(), s_ref.float(), rtol=step, atol=step)
    truth = exact(t)
    gate, up = truth.chunk(2, dim=-1)
    truth_h = torch.nn.functional.silu(gate) * up / t["so"].double()
    assert h.dtype == FP8
    for got_, want_, true_, reach, steps in ((y, y_ref, truth, 0.02, 0.0), (h, h_ref, truth_h, 0.04, 0.125)):
        bound = reach * want_.float().abs().max() + steps * want_.float().abs()  # and an e4m3 step of e4m3's
        assert bool(((got_.float() - want_.float()).abs() <= bound).all())
        assert (got_.double() - true_).abs().mean() <= 1.25 * (want_.double() - true_).abs().mean()


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_the_references_compute_the_unfused_ops(gen: torch.Generator, dtype: torch.dtype) -> None:
    t = layer(gen, 4, 96, 64, dtype)
    got, want = fused(t, dtype), unfused(t, dtype)
    assert [x.dtype for x in got] == [dtype, dtype, FP8] and got[1].shape == (4, 128) and got[2].shape == (4, 64)
    assert_as_good(got, want, dtype, t)


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 96, 64), (5, 200, 96), (16, 256, 128)])
def test_kernels_match_the_references(triton_gemm: types.ModuleType, gen: torch.Generator, rows: int, k: int,
                                      n: int) -> None:  # fmt: skip
    """Interpreted, float16 (the interpreter's bf16 dot is wrong; the GPU test runs bf16): the
    producer's sum, ``s * g`` and slots, and both readers, against the references; k = 200 and
    n = 96 take the masked loads and a partial last slot."""
    t = layer(gen, rows, k, n, F16)
    s, sg, parts = triton_gemm.linear_fp8_add_rms_parts(t["a"], t["w_o"], t["sa"], t["sb"], F16, t["r"], t["g"])
    s_ref, sg_ref, parts_ref = ops.linear_fp8_add_rms_parts_reference(t["a"], t["w_o"], t["sa"], t["sb"], F16, t["r"],
                                                                      t["g"])  # fmt: skip
    step = torch.finfo(F16).eps
    torch.testing.assert_close(s.float(), s_ref.float(), rtol=step, atol=step)
    torch.testing.assert_close(sg.float(), sg_ref.float(), rtol=2 * step, atol=2 * step)
    torch.testing.assert_close(parts, parts_ref, rtol=4 * step, atol=1e-4)
    y = triton_gemm.rms_norm_quant_linear_fp8(sg_ref, parts_ref, EPS, t["sq"], t["w"], t["sw"], F16)
    h = triton_gemm.rms_norm_quant_linear_fp8_silu_and_mul_quant(sg_ref, parts_ref, EPS, t["sq"], t["w"], t["sw"], F16,
                                                                 t["so"])  # fmt: skip
    y_ref = ops.rms_norm_quant_linear_fp8_reference(sg_ref, parts_ref, EPS, t["sq"], t["w"], t["sw"], F16)
    h_ref = ops.rms_norm_quant_linear_fp8_silu_and_mul_quant_reference(sg_ref, parts_ref, EPS, t["sq"], t["w"],
                                                                       t["sw"], F16, t["so"])  # fmt: skip
    assert_as_good((s, y, h), (s_ref, y_ref, h_ref), F16, t)


def test_the_checks_refuse_what_the_kernel_cannot_serve(gen: torch.Generator) -> None:
    t = layer(gen, 4, 96, 64)
    s, sg, parts = fused(t)[0], *ops.linear_fp8_add_rms_parts_reference(t["a"], t["w_o"], t["sa"], t["sb"], BF16,
                                                                         t["r"], t["g"])[1:]  # fmt: skip
    hand_off = ops._hand_off_check
    assert hand_off(t["a"], t["w_o"], t["sa"], t["sb"], BF16, t["r"], t["g"]) is None
    assert "residual" in hand_off(t["a"], t["w_o"], t["sa"], t["sb"], BF16, t["r"].float(), t["g"])
    assert "norm weight" in hand_off(t["a"], t["w_o"], t["sa"], t["sb"], BF16, t["r"], t["g"][:32])
    assert "not float8_e4m3fn" in hand_off(t["a"].to(BF16), t["w_o"], t["sa"], t["sb"], BF16, t["r"], t["g"])
    reader = ops._reader_check
    assert reader(sg, parts, EPS, t["sq"], t["w"], t["sw"], BF16) is None
    assert "not bf16/fp16" in reader(sg.to(FP8), parts, EPS, t["sq"], t["w"], t["sw"], BF16)
    assert "not float8_e4m3fn" in reader(sg, parts, EPS, t["sq"], t["w"].to(BF16), t["sw"], BF16)
    assert "parts" in reader(sg, parts[:2], EPS, t["sq"], t["w"], t["sw"], BF16)
    assert "17 rows" in reader(torch.cat([sg] * 5)[:17], torch.cat([parts] * 5)[:17], EPS, t["sq"], t["w"], t["sw"], BF16)
    gated = ops._gated_reader_check
    assert gated(sg, parts, EPS, t["sq"], t["w"], t["sw"], BF16, t["so"]) is None
    assert "odd weight rows" in gated(sg, parts, EPS, t["sq"], t["w"][:127], t["sw"], BF16, t["so"])
    assert s.shape == (4, 64)


def test_the_quantizing_prologue_compiles_for_hopper() -> None:
    """Compiled for sm90: the A tiles quantized to e4m3 in registers (a float32 -> e4m3
    conversion), widened back for the float16 MMA; no square summed in the k loop (the scale
    comes from the slots)."""
    from helpers.triton import compile_for_hopper

    types_ = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "y_ptr": "*fp8e4nv"}
    types_.update({n: "*bf16" for n in ("b_ptr", "g_ptr", "r_ptr", "pos_ptr", "cs_ptr", "sg_ptr")})
    types_.update(parts_ptr="*fp32", sa_ptr="*fp32", sb_ptr="*fp32", qs_ptr="*fp32", eps="fp32")
    ptx = compile_for_hopper("fxrewrite.runtime.triton_gemm", "_skinny_linear_kernel", types_,
                             dict(BN=32, BK=512, HAS_BIAS=False, EVEN_K=True, GATED=True, NORM=True,
                                  NORM_WEIGHT=False, RESIDUAL=False, HALF=0, HAND_OFF=False, PARTS=256, PDL=False,
                                  FP8=True, QUANT_A=True), num_warps=4, num_stages=4)  # fmt: skip
    assert "e4m3x2.f32" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
    assert "mma.sync.aligned" in ptx and ".f16.f16" in ptx
