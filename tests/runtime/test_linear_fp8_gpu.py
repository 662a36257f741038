"""``fxr.linear_fp8`` on the GPU at the 8B layer's shapes: the Triton kernel up to 16 rows and
cuBLASLt's ``_scaled_mm`` above, each no further from the float32 product than cuBLASLt; the
kernel captured in a CUDA graph (and, on Hopper, as a programmatic dependent launch) replays
with fresh inputs; the kernel built ahead is the one launched."""

from __future__ import annotations

import pytest
import torch
from helpers.gpu import fresh_counts, gen  # noqa: F401  (pytest fixtures of this module)

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import linear, quant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def e4m3(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randn(shape, device="cuda", generator=gen) * 40).clamp(-448, 448).to(FP8)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.fixture(autouse=True)
def needs_triton() -> None:
    if providers.library(linear.TRITON_GEMM) is None:
        pytest.skip("triton is not importable here")


@pytest.mark.parametrize("rows", [1, 8, 16, 17, 256])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_triton_at_decode_sizes_then_cublaslt(shape: str, rows: int, gen: torch.Generator) -> None:
    n, k = SHAPES[shape]
    x, w = e4m3(gen, rows, k), e4m3(gen, n, k)
    sa, sb = torch.tensor(0.013, device="cuda"), torch.tensor(0.0021, device="cuda")
    exact = (x.float() @ w.float().t()) * (sa * sb)
    got = torch.ops.fxr.linear_fp8(x, w, sa, sb, BF16)
    cublaslt = torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=BF16)
    assert providers.served()["linear_fp8"] == {"fallbacks": {}, "triton" if rows <= 16 else "cublaslt": 1}
    assert got.dtype == BF16 and got.shape == (rows, n)
    assert rel_err(got, exact) <= 1.05 * rel_err(cublaslt, exact) + 1e-3, (rel_err(got, exact), rel_err(cublaslt, exact))


def test_replays_in_a_cuda_graph_with_fresh_inputs(gen: torch.Generator) -> None:
    """Two FP8 GEMMs back to back in one graph (the second reads the first's output, requantized:
    under PDL the second waits for it), replayed with new inputs copied in."""
    n, k = SHAPES["o"]
    x, w1, w2 = e4m3(gen, 8, k), e4m3(gen, n, k), e4m3(gen, n, n)
    sa, sb = torch.tensor(0.013, device="cuda"), torch.tensor(0.0021, device="cuda")

    def step() -> torch.Tensor:
        h = torch.ops.fxr.linear_fp8(x, w1, sa, sb, BF16)
        return torch.ops.fxr.linear_fp8((h.float() / 0.05).clamp(-448, 448).to(FP8), w2, sa, sb, BF16)

    step()  # builds
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x.copy_(e4m3(gen, 8, k))
        graph.replay()
        h = torch._scaled_mm(x, w1.t(), scale_a=sa, scale_b=sb, out_dtype=BF16)
        want = torch._scaled_mm((h.float() / 0.05).clamp(-448, 448).to(FP8), w2.t(), scale_a=sa, scale_b=sb, out_dtype=BF16)
        # the first GEMM's bf16 output may round differently, moving a value across an e4m3 step
        assert rel_err(out, want.float()) < 0.05


def test_the_kernel_built_ahead_is_the_one_launched(gen: torch.Generator) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxrewrite.runtime import triton_gemm

    n, k = 1024, 4608  # a shape no other test builds
    args = [e4m3(gen, 8, k), e4m3(gen, n, k), torch.tensor(0.01, device="cuda"), torch.tensor(0.02, device="cuda"), BF16]
    with FakeTensorMode() as mode:
        fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    note = providers.prebuild([(torch.ops.fxr.linear_fp8.default, fake, {})])
    assert note is not None and note.startswith("1 kernel"), note
    cache = triton_gemm._skinny_linear_kernel.device_caches[torch.cuda.current_device()][0]
    built = len(cache)
    torch.ops.fxr.linear_fp8(*args)
    assert len(cache) == built


@pytest.mark.parametrize("rows", [1, 8, 16, 17])
def test_gate_up_with_the_activation_and_its_quantization(rows: int, gen: torch.Generator) -> None:
    """The 8B layer's gate_up weight: one Triton kernel up to 16 rows, cuBLASLt and the
    activation's kernel above. Every value within one e4m3 step of the unfused ops' or of the
    exact result's (the product in float64, then the activation and the quantization: where a
    gate sum cancels, the two float32 orders may land steps apart), nearly all equal."""
    n, k = SHAPES["gate_up"]
    x, w = e4m3(gen, rows, k), e4m3(gen, n, k)
    sa, sb, scale = (torch.tensor(v, device="cuda") for v in (0.013, 0.0021, 0.01))
    got = torch.ops.fxr.linear_fp8_silu_and_mul_quant(x, w, sa, sb, BF16, scale)
    want = linear.linear_fp8_silu_and_mul_quant_reference(x, w, sa, sb, BF16, scale)
    label = "triton" if rows <= 16 else "cublaslt+silu_and_mul_quant_fp8"
    assert providers.served()["linear_fp8_silu_and_mul_quant"] == {"fallbacks": {}, label: 1}
    assert got.dtype == FP8 and got.shape == (rows, n // 2)
    assert want.float().abs().max() > 16
    exact = quant.silu_and_mul_quant_fp8_reference(((x.double() @ w.double().t()) * (sa * sb).double()), scale)
    assert quant.fp8_mismatch(got, want, q_exact=exact) is None
    assert (got.float() == want.float()).float().mean().item() >= 0.9


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_the_norms_hand_off_and_quantizing_prologue_at_the_8b_shapes(rows: int, gen: torch.Generator) -> None:
    """o_proj's FP8 GEMM handing off the add + norm, gate_up (with its activation) and qkv
    quantizing the norm in their prologues: the Triton kernels, no further from the float64
    result than the unfused ops (``fused_add_rms_norm_quant_fp8`` between ``linear_fp8``s) are,
    each value of the quantized activation within one e4m3 step of the unfused ops' or the exact
    one's (tests/runtime/test_linear_fp8_fused_ops.py has the CPU twin)."""
    n, k = SHAPES["o"]
    a, w_o = e4m3(gen, rows, k), e4m3(gen, n, k)
    sa, sb, sq, sw, so = (torch.tensor(v, device="cuda") for v in (0.01, 2e-3, 2**-6, 2e-3, 0.05))
    r = torch.randn(rows, n, device="cuda", generator=gen).to(BF16)
    g = (1 + 0.2 * torch.randn(n, device="cuda", generator=gen)).to(BF16)
    w_gu, w_qkv = e4m3(gen, *SHAPES["gate_up"]), e4m3(gen, *SHAPES["qkv"])
    s, sg, parts = torch.ops.fxr.linear_fp8_add_rms_parts(a, w_o, sa, sb, BF16, r, g)
    h = torch.ops.fxr.rms_norm_quant_linear_fp8_silu_and_mul_quant(sg, parts, 1e-6, sq, w_gu, sw, BF16, so)
    y = torch.ops.fxr.rms_norm_quant_linear_fp8(sg, parts, 1e-6, sq, w_qkv, sw, BF16)
    served = providers.served()
    for op in ("linear_fp8_add_rms_parts", "rms_norm_quant_linear_fp8_silu_and_mul_quant", "rms_norm_quant_linear_fp8"):
        assert served[op] == {"fallbacks": {}, "triton": 1}, served
    o = torch.ops.fxr.linear_fp8(a, w_o, sa, sb, BF16)
    q, s_ref = torch.ops.fxr.fused_add_rms_norm_quant_fp8(o, r, g, 1e-6, sq)
    torch.testing.assert_close(s, s_ref, rtol=2**-7, atol=2**-7)
    h_ref = torch.ops.fxr.linear_fp8_silu_and_mul_quant(q, w_gu, sq, sw, BF16, so)
    y_ref = torch.ops.fxr.linear_fp8(q, w_qkv, sq, sw, BF16)
    s64 = a.double() @ w_o.double().t() * (sa * sb).double() + r.double()
    normed = s64 * torch.rsqrt(s64.square().mean(-1, keepdim=True) + 1e-6) * g.double()
    y64 = normed @ w_qkv.double().t() * sw.double()
    gate, up = (normed @ w_gu.double().t() * sw.double()).chunk(2, dim=-1)
    h64 = torch.nn.functional.silu(gate) * up / so.double()
    for got, want, exact in ((y, y_ref, y64), (h, h_ref, h64)):
        assert (got.double() - exact).abs().mean() <= 1.05 * (want.double() - exact).abs().mean()
