"""The FP8 engine model (bench/engine_fp8.py): its attention output's quantization fuses into
``fxbench::attention_quant_fp8`` per layer, the fused model equals the unfused one on CPU (the
torch path quantizes after SDPA), the graph still splits at attention; the Triton decode
kernel's quantizing epilogue against the unfused pair (interpreted on CPU; compiled on GPU)."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest
import torch

import fxrewrite
from engine_fp8 import ATTENTION_QUANT, float32_reference, to_fp8
from engine_model import SPLITTING_OPS, _decode, build_model, make_batch, mark_static_metadata, tiny
from fxrewrite.runtime import providers
from fxrewrite.runtime.ops.quant import FP8_DTYPE, fp8_mismatch, quant_fp8_static
from fxrewrite.testing import op_counts
from helpers.triton import interpreted

CFG = tiny()
MAX_SEQS, MAX_LEN = 8, 64
RULE = "attention_quant_fp8"
FP8_FUSIONS = {"rms_norm_quant_fp8": 1, "fused_add_rms_norm_quant_fp8": 3, "silu_and_mul_quant_fp8": 2}


def fp8_model(dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> torch.nn.Module:
    model = build_model(CFG, dtype=dtype, device=device)
    model.allocate_kv_cache(MAX_SEQS, MAX_LEN)
    to_fp8(model, make_batch(CFG, "prefill", 24, num_seqs=3, max_len=MAX_LEN, device=device))
    return model


def batch(kind: str, size: int, context: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    return mark_static_metadata(make_batch(CFG, kind, size, context, max_len=MAX_LEN, device=device))


def compiled(model: torch.nn.Module, declared: bool, **config: object) -> tuple[object, fxrewrite.Backend]:
    torch._dynamo.reset()
    backend = fxrewrite.Backend(splitting_ops=SPLITTING_OPS, attention_quant=ATTENTION_QUANT if declared else (),
                                **config)  # fmt: skip
    return backend.compile(model, dynamic=True), backend


def counts(backend: fxrewrite.Backend, name: str) -> int:
    return sum(op_counts(g)[name] for g in backend.graphs)


@pytest.mark.parametrize("kind,size,context", [("prefill", 8, 0), ("decode", 4, 20)])
def test_report_shows_fused_attention_per_layer(kind: str, size: int, context: int) -> None:
    model = fp8_model()
    model.fill_kv_cache_random()
    step, backend = compiled(model, declared=True)
    step(**batch(kind, size, context))
    report = backend.report
    layers = [s.module for s in report.sites if s.rule == RULE]
    assert layers == [f"layers.{i}.self_attn" for i in range(CFG.num_layers)], report.table()
    assert counts(backend, "fxbench.attention_quant_fp8") == CFG.num_layers
    assert counts(backend, "fxbench.attention") == 0
    assert not [m for m in report.near_misses if m.rule == RULE], report.table()
    assert {k: report.fused_ops().get(k) for k in FP8_FUSIONS} == FP8_FUSIONS, report.fused_ops()


def test_without_the_declaration_each_layer_says_why() -> None:
    model = fp8_model()
    step, backend = compiled(model, declared=False)
    step(**batch("prefill", 8))
    misses = [m for m in backend.report.near_misses if m.rule == RULE]
    assert [m.module for m in misses] == [f"layers.{i}.self_attn" for i in range(CFG.num_layers)]
    assert all("`fxbench::attention` has no declared FP8-output twin" in m.reason for m in misses)
    assert counts(backend, "fxbench.attention") == CFG.num_layers


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("kind,size,context", [("prefill", 8, 0), ("decode", 4, 20)])
def test_outputs_equal_the_unfused_pair(kind: str, size: int, context: int) -> None:
    """CPU, torch path: the fused model's output is the unfused model's bit for bit, so its
    error against the float32 model is the same (and small: the quantizations are sane)."""
    model = fp8_model()
    model.fill_kv_cache_random()
    inputs = batch(kind, size, context)
    ref = float32_reference(model, inputs)
    unfused_step, _ = compiled(model, declared=False)
    unfused = unfused_step(**inputs)
    fused_step, backend = compiled(model, declared=True)
    fused = fused_step(**inputs)
    assert counts(backend, "fxbench.attention_quant_fp8") == CFG.num_layers
    assert torch.equal(fused, unfused)
    assert max_error(fused, ref) <= max_error(unfused, ref) < 0.1


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_runner_splits_at_the_fused_attention(mode: str) -> None:
    """Piecewise: one splitting piece per layer, each the fused op alone; full: none. CPU
    emulation of the CUDA-graph runner; outputs equal the unfused model's."""
    model = fp8_model()
    model.fill_kv_cache_random()
    inputs = batch("decode", 8, 20)
    want = compiled(model, declared=False)[0](**inputs)  # type: ignore[operator]
    step, backend = compiled(model, declared=True, mode=mode, capture_sizes=(8,))
    got = step(**inputs)
    assert torch.equal(got, want)
    runtime = backend.report.graphs[0].runtime
    assert runtime["splitting_pieces"] == (CFG.num_layers if mode == "piecewise" else 0), runtime
    if mode == "piecewise":
        split = backend.runners[0].split
        ops = [[n.target for n in p.submodule.graph.nodes if n.op == "call_function"] for p in split.pieces if p.is_splitting]
        assert ops == [[torch.ops.fxbench.attention_quant_fp8.default]] * CFG.num_layers


# --------------------------------------------------------------------------- the Triton decode kernel


@pytest.fixture(scope="module")
def decode_kernel() -> Iterator[types.ModuleType]:
    """bench/decode_attention.py interpreted, casts rounded as the GPU rounds them."""
    yield from interpreted("decode_attention", "_partial_kernel")


def decode_case(batch: int, heads: int, kv_heads: int, dim: int, length: int, device: str, seed: int = 0,
                dtype: torch.dtype = torch.bfloat16):  # type: ignore[no-untyped-def]  # fmt: skip
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, length + 8, kv_heads, dim)
    k_cache, v_cache = (torch.randn(shape, generator=g, device=device).to(dtype) for _ in range(2))
    q = torch.randn(batch, heads, dim, generator=g, device=device).to(dtype)
    new_k, new_v = (torch.randn(batch, kv_heads, dim, generator=g, device=device).to(dtype) for _ in range(2))
    seq_lens = torch.randint(1, length + 1, (batch,), generator=g, device=device, dtype=torch.int32)
    slots = torch.arange(batch, device=device) * shape[1] + seq_lens.long() - 1
    return q, k_cache, v_cache, seq_lens, (new_k, new_v, slots)


def check_fused_epilogue(kernel: types.ModuleType, case: tuple, length: int) -> None:  # type: ignore[type-arg]
    """The fused FP8 output against the unfused pair (decode, then ``quant_fp8_static``): each
    value within one e4m3 step of the pair's, and its error against the float64 attention no
    larger in sum (it rounds the float32 result once, the pair rounds to bf16 first). In
    float32 both round the same value once: the same bytes."""
    q, k_cache, v_cache, seq_lens, store = case
    scale = torch.tensor(2.0**-8, device=q.device)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    pair = quant_fp8_static(kernel.decode_attention(q, *caches[0], seq_lens, length, store=store), scale)
    fused = kernel.decode_attention(q, *caches[1], seq_lens, length, store=store, out_scale=scale)
    assert fused.dtype == FP8_DTYPE and fused.shape == q.shape
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert fp8_mismatch(fused, pair) is None
    if q.dtype == torch.float32:
        assert torch.equal(fused.view(torch.uint8), pair.view(torch.uint8))
    kv_range = torch.arange(length, dtype=torch.int32, device=q.device)
    ref = _decode(q.double(), caches[0][0].double(), caches[0][1].double(), seq_lens, kv_range)
    err_fused = ((fused.double() * scale - ref).abs()).sum()
    err_pair = ((pair.double() * scale - ref).abs()).sum()
    assert err_fused <= err_pair, (float(err_fused), float(err_pair))


def test_fused_epilogue_interpreted(decode_kernel: types.ModuleType) -> None:
    """float32 only: Triton 3.9's interpreter gets bf16 ``tl.dot`` wrong here (errors of 1e8
    in the plain kernel too); the GPU test covers bf16."""
    check_fused_epilogue(decode_kernel, decode_case(3, 4, 2, 16, 40, "cpu", dtype=torch.float32), 40)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,length", [(1, 1025), (8, 1025), (64, 300)])
def test_fused_epilogue_gpu(batch: int, length: int) -> None:
    import decode_attention

    check_fused_epilogue(decode_attention, decode_case(batch, 32, 8, 128, length, "cuda", seed=batch), length)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_fp8_model_gpu(mode: str) -> None:
    """CUDA, Triton decode: the fused model's error against the float32 model is no larger than
    the unfused model's (5% slack for GEMM rounding order)."""
    model = fp8_model(device="cuda")
    model.fill_kv_cache_random()
    inputs = batch("decode", 8, 40, device="cuda")
    ref = float32_reference(model, inputs)
    unfused = compiled(model, declared=False, mode=mode, capture_sizes=(8,))[0](**inputs)  # type: ignore[operator]
    step, backend = compiled(model, declared=True, mode=mode, capture_sizes=(8,))
    fused = step(**inputs)
    assert counts(backend, "fxbench.attention_quant_fp8") == CFG.num_layers
    assert max_error(fused, ref) <= 1.05 * max_error(unfused, ref) + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("size", [1, 8])
def test_fp8_layers_hand_off_their_norms_gpu(size: int) -> None:
    """``gemm_fusion`` and ``fp8_norm_prologue`` on the FP8 model, mode full, decode: every add + norm + quantization between
    two FP8 GEMMs is a hand-off and quantizing prologues (``hand_off_norm_quant``), the Triton
    kernels serve them, and the error against the float32 model is no larger than without
    ``gemm_fusion`` (5% slack: the norm rounds in another order before its quantization)."""
    model = fp8_model(device="cuda")
    model.fill_kv_cache_random()
    inputs = batch("decode", size, 40, device="cuda")
    ref = float32_reference(model, inputs)
    plain = compiled(model, declared=True, mode="full", capture_sizes=(1, 8))[0](**inputs)  # type: ignore[operator]
    providers.reset_counts()
    step, backend = compiled(model, declared=True, mode="full", capture_sizes=(1, 8), gemm_fusion=True,
                             fp8_norm_prologue=True)
    got = step(**inputs)
    fused = backend.report.fused_ops()
    assert fused["linear_fp8_add_rms_parts"] == 2 * CFG.num_layers - 1
    assert "fused_add_rms_norm_quant_fp8" not in fused
    served = providers.served()
    for op in ("linear_fp8_add_rms_parts", "rms_norm_quant_linear_fp8", "rms_norm_quant_linear_fp8_silu_and_mul_quant"):
        assert served[op]["fallbacks"] == {} and served[op].get("triton", 0) > 0, served.get(op)
    assert max_error(got, ref) <= 1.05 * max_error(plain, ref) + 1e-6
