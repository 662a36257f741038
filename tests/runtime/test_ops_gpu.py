"""GPU tests of the fused ops: every provider installed here against the reference, for every op.

Run on the GPU machine (devkit carried as .devkit):
    source .devkit/setup.sh && python3 -m pytest -q tests/runtime/test_ops_gpu.py -m gpu

Each case forces one provider, runs ``torch.ops.fxr.<op>`` on CUDA tensors and checks:
- the provider's kernel served the call exactly when its constraint check accepts the
  arguments, else the call fell back with that reason (never silently wrong);
- outputs match the torch reference on the same inputs within one rounding step of the output
  dtype (kernels round once where the bf16 reference rounds twice); FP8 outputs by
  ``quant.fp8_mismatch``: every value within one e4m3 step of the spec's after dequantization,
  per-token scales within two roundings of the input dtype, whatever the token count.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from helpers.gpu import force, fresh_counts, gen  # noqa: F401  (fresh_counts, gen: pytest fixtures of this module)

import fxrewrite.runtime.ops as ops
from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import (activation, async_tp, collective, linear, linear_block_fp8, linear_fp8_fused, moe,
                                   moe_route, norm, norm_variants, quant, quant_act_mul, quant_block, quant_nvfp4,
                                   rotary, sequence_parallel)
from fxrewrite.runtime.providers import Kernel, OpDef

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EPS = 1e-6
FP8 = torch.float8_e4m3fn
LIBRARIES = ("sgl_kernel", "flashinfer")
KERNEL_PROVIDERS = (*LIBRARIES, "triton")
DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
# (tokens, hidden): hidden 4096 over token counts, then odd sizes: hidden 33 (vectors of 1),
# 3420 (Qwen2.5-VL MLP half: not 16-byte rows), 5120.
# Ops whose arguments are [tokens, hidden] activations; the rotary ops (q/k per head, a cache)
# have tests/runtime/test_rotary_gpu.py, the all-reduce ops (a process group) test_collective_ops.py and
# test_sequence_parallel_ops.py and test_async_tp_ops.py,
# fxr.moe (routing and stacked experts) test_moe_gpu.py, fxr.moe_route (router logits [tokens,
# experts] with no two equal in a row, the router's kind; its ids compared exactly)
# test_moe_route_gpu.py; the NVFP4 ops (packed values, block scales) test_quant_nvfp4_gpu.py; the
# block FP8 ops (a group argument, per-group scales) test_quant_block_ops.py, the block-FP8 GEMM
# (FP8 operands and scales) test_linear_block_fp8_ops.py, the FP8 GEMMs with per-tensor scales
# (e4m3 operands) test_linear_fp8_gpu.py; the qkv GEMM that rotates its output (positions, a
# cache) test_linear_fused_gpu.py.
# act_mul + block FP8 / NVFP4 (a group or a global scale, packed outputs): test_quant_act_mul_ops.py
QUANT_ACT_MUL_OWN = tuple(op for op in quant_act_mul.DEFS if op.name in ("act_mul_block_quant_fp8", "act_mul_quant_nvfp4"))
GENERIC = [op for op in ops.DEFS
           if op not in rotary.DEFS + collective.DEFS + sequence_parallel.DEFS + async_tp.DEFS + moe.DEFS + moe_route.DEFS
           + quant_nvfp4.DEFS + quant_block.DEFS + linear_block_fp8.DEFS + linear_fp8_fused.DEFS + QUANT_ACT_MUL_OWN
           and op.name not in ("rms_norm_linear_rotary", "linear_fp8", "linear_fp8_silu_and_mul_quant")]
SHAPES = [(1, 4096), (7, 4096), (64, 4096), (513, 4096), (4096, 4096), (3, 33), (5, 3420), (2, 5120)]


def is_activation(op: OpDef) -> bool:
    return not {"weight", "w"} & set(inspect.signature(op.reference).parameters) and op not in norm_variants.DEFS


def make_args(op: OpDef, tokens: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> list[Any]:
    """Fresh random arguments; ``x`` is [tokens, 2 * hidden] for gated activations, ``w`` [2 *
    hidden, hidden] for the gated linear. Row 0 of
    ``x`` (and ``residual``) is zero when tokens > 1: the padding rows of a CUDA graph."""
    x_shape = (tokens, 2 * hidden if is_activation(op) else hidden)
    rows = 2 * hidden if op.name.endswith("linear_silu_and_mul") else hidden  # a linear's w: gate and up halves

    def activation() -> torch.Tensor:
        t = torch.randn(x_shape, device="cuda", generator=gen).to(dtype)
        if tokens > 1:
            t[0] = 0
        return t

    values = {
        "x": activation,
        "residual": activation,
        "a": activation,  # act_mul: two operands of one shape
        "b": activation,
        "y": activation,  # the per-token quantizer alone
        "act_first": lambda: False,
        "weight": lambda: (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(dtype),
        "norm_weight": lambda: (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(dtype),
        "w": lambda: (torch.randn(rows, hidden, device="cuda", generator=gen) * hidden**-0.5).to(dtype),
        "bias": lambda: torch.randn(rows, device="cuda", generator=gen).to(dtype),
        "eps": lambda: EPS,
        "scale": lambda: torch.tensor([0.02], device="cuda"),
        "approximate": lambda: "none",
        "cast_last": lambda: True,  # the order the libraries' kernels compute exactly
        "round_scale": lambda: False,
        # gated norms: a gate of x's shape, groups of half the row (when even), gate first
        "gate": activation,
        "group_size": lambda: x_shape[-1] // 2 if x_shape[-1] % 2 == 0 else None,
        "gate_first": lambda: True,
        "activation": lambda: "silu",
        "parts": lambda: None,  # the norm GEMMs without a hand-off (with one: test_linear_fused_gpu.py)
    }
    return [values[name]() for name in inspect.signature(op.reference).parameters]


def clone(args: list[Any]) -> list[Any]:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def outputs(op: OpDef, result: Any, args: list[Any]) -> tuple[torch.Tensor, ...]:
    """What to compare: the returned tensors, or for in-place ops the overwritten arguments."""
    if op.mutates_args:
        # the registered op returns the overwritten tensors (aliased: one, or a tuple); kernels
        # and references called directly return nothing
        names = list(inspect.signature(op.reference).parameters)
        written = tuple(args[names.index(m)] for m in op.mutates_args)
        assert result is None or all(r is a for r, a in zip(result if isinstance(result, tuple) else (result,), written))
        return written
    return result if isinstance(result, tuple) else (result,)


def assert_matches(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], dtype: torch.dtype,
                   gemm: bool = False) -> None:  # fmt: skip
    """Within ``TOL``; ``gemm``: the absolute part scaled by the output's largest value. Two GEMMs
    (kernel and cuBLAS reference) round their sums differently; an op that multiplies such a
    sum by another (SiLU(gate) * up) carries that difference, an ulp of the factors, into
    outputs near zero."""
    assert len(got) == len(want)
    assert [(g.shape, g.dtype, g.device) for g in got] == [(w.shape, w.dtype, w.device) for w in want]
    problems, rest = quant.quantized_output_mismatches(got, want, quant.fp8_scale_rtol(dtype))
    assert not problems, problems
    for i in rest:
        atol = TOL[dtype] * (max(1.0, want[i].abs().max().item()) if gemm else 1.0)
        torch.testing.assert_close(got[i].float(), want[i].float(), rtol=TOL[dtype], atol=atol)


def kernel_of(op: OpDef, provider: str) -> Kernel | None:
    return next((k for k in op.kernels if k.provider == provider), None)


def expected_server(op: OpDef, provider: str, args: list[Any]) -> tuple[str, str | None]:
    """(label that must serve, fallback reason or None), decided by the kernel's own check."""
    kernel = kernel_of(op, provider)
    if kernel is None:
        return "torch", f"{provider} has no kernel for {op.name}"
    cap = torch.cuda.get_device_capability()
    if cap < kernel.min_capability:
        return "torch", None  # reason text checked by the CPU tests
    reason = kernel.check(*args)
    return (kernel.name, None) if reason is None else ("torch", reason)


def run_and_check(op: OpDef, provider: str, args: list[Any], dtype: torch.dtype) -> str:
    ref_args = clone(args)
    label, reason = expected_server(op, provider, args)
    result = getattr(torch.ops.fxr, op.name)(*args)
    want = outputs(op, op.reference(*ref_args), ref_args)
    assert_matches(outputs(op, result, args), want, dtype, gemm="w" in inspect.signature(op.reference).parameters)
    entry = providers.served()[op.name]
    assert entry.get(label) == 1, entry
    if reason is not None:
        assert any(reason in why for why in entry["fallbacks"]), entry
    elif label != "torch":
        assert entry["fallbacks"] == {}, entry
    return label


# --------------------------------------------------------------------------- every op, every provider


@pytest.mark.parametrize(("tokens", "hidden"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("provider", KERNEL_PROVIDERS)
@pytest.mark.parametrize("op", GENERIC, ids=lambda op: op.name)
def test_op_against_reference(
    op: OpDef, provider: str, dtype: torch.dtype, tokens: int, hidden: int, gen: torch.Generator
) -> None:
    force(provider)
    run_and_check(op, provider, make_args(op, tokens, hidden, dtype, gen), dtype)


@pytest.mark.parametrize(("rows", "label"), [(1, "triton"), (16, "triton"), (17, "triton"), (48, "triton"),
                                             (64, "triton"), (65, "cublas"), (512, "cublas")])  # fmt: skip
def test_linear_takes_triton_up_to_64_rows_then_cublas(rows: int, label: str, gen: torch.Generator) -> None:
    """Default order: the Triton kernel at decode sizes (tiles of 16, 32 and 64 rows), cuBLAS
    above (not a fallback); the qkv, o and gate_up weights of the 8B layer reach every launch
    configuration of each tile."""
    if providers.library(providers.TRITON_MODULE) is None:
        pytest.skip("triton is not importable here")
    for n in (6144, 4096, 28672):
        providers.reset_counts()
        x = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, 4096, device="cuda", generator=gen) * 4096**-0.5).to(torch.bfloat16)
        out = torch.ops.fxr.linear(x, w)
        assert providers.served()["linear"] == {"fallbacks": {}, label: 1}
        torch.testing.assert_close(out.float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("rows", "label"), [(1, "triton"), (16, "triton"), (17, "triton"), (64, "triton"),
                                             (65, "cublas+silu_and_mul")])  # fmt: skip
def test_linear_silu_and_mul_in_one_triton_kernel_up_to_64_rows(rows: int, label: str, gen: torch.Generator) -> None:
    """The 8B layer's gate_up weight (28672 rows: many small programs) and a small one (one
    wave), with and without a bias, against the unfused code in float32."""
    if providers.library(providers.TRITON_MODULE) is None:
        pytest.skip("triton is not importable here")
    for n, with_bias in ((28672, False), (2048, True)):
        providers.reset_counts()
        x = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, 4096, device="cuda", generator=gen) * 4096**-0.5).to(torch.bfloat16)
        b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) if with_bias else None
        out = torch.ops.fxr.linear_silu_and_mul(x, w, b)
        assert providers.served()["linear_silu_and_mul"] == {"fallbacks": {}, label: 1}
        gate, up = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).chunk(2, dim=-1)
        torch.testing.assert_close(out.float(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)


def test_linear_kernels_built_ahead_are_the_ones_launched(gen: torch.Generator) -> None:
    """``providers.prebuild`` on fake tensors builds the Triton kernels the calls then launch:
    after the real calls the kernel's cache holds no new build, and the outputs are right.
    Negative twin: a call above 64 rows (cuBLAS) has nothing to build."""
    if providers.library(linear.TRITON_GEMM) is None:
        pytest.skip("triton is not importable here")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxrewrite.runtime import triton_gemm

    k = 4112  # not a multiple of any BK: a build no other test makes
    x = torch.randn(8, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(1536, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
    with FakeTensorMode():
        fx, fw, big = (torch.empty(*s, dtype=torch.bfloat16, device="cuda") for s in ((8, k), (1536, k), (65, k)))
    assert providers.prebuild([(torch.ops.fxr.linear.default, (big, fw), {})]) is None
    note = providers.prebuild([(torch.ops.fxr.linear.default, (fx, fw), {}),
                               (torch.ops.fxr.linear_silu_and_mul.default, (fx, fw), {}),
                               (torch.ops.fxr.linear.default, (fx[:1], fw), {})])  # fmt: skip
    assert note is not None and note.startswith("2 kernels built ahead"), note
    cache = triton_gemm._skinny_linear_kernel.device_caches[torch.cuda.current_device()][0]
    built = len(cache)
    assert [k for k in cache.values() if getattr(k, "module", 0) is None] == []  # loaded, launcher built
    plain, gated = torch.ops.fxr.linear(x, w), torch.ops.fxr.linear_silu_and_mul(x, w)
    assert len(cache) == built
    want = x.float() @ w.float().t()
    torch.testing.assert_close(plain.float(), want, rtol=2e-2, atol=2e-2)
    gate, up = want.chunk(2, dim=-1)
    torch.testing.assert_close(gated.float(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("provider", LIBRARIES)
def test_gelu_both_approximations(provider: str, approximate: str, gen: torch.Generator) -> None:
    force(provider)
    op = next(op for op in ops.DEFS if op.name == "gelu_and_mul")
    args = make_args(op, 64, 4096, torch.bfloat16, gen)
    args[1] = approximate
    assert run_and_check(op, provider, args, torch.bfloat16) == provider


@pytest.mark.parametrize("tokens", [1, 7, 512])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("provider", LIBRARIES)
def test_per_head_rms_norm(provider: str, dtype: torch.dtype, tokens: int, gen: torch.Generator) -> None:
    """Q/K norm on [T, heads, 128]: contiguous (both serve), and heads sliced out of a fused
    QKV output (rows not uniform: flashinfer's 3D kernel serves, sgl-kernel falls back)."""
    force(provider)
    op = ops.DEFS[ops.OPS.index("rms_norm")]
    w = (torch.rand(128, device="cuda", generator=gen) + 0.5).to(dtype)
    contiguous = torch.randn(tokens, 32, 128, device="cuda", generator=gen).to(dtype)
    assert run_and_check(op, provider, [contiguous, w, EPS], dtype) == provider
    providers.reset_counts()
    qkv = torch.randn(tokens, (32 + 2 * 8) * 128, device="cuda", generator=gen).to(dtype)
    q = qkv[:, : 32 * 128].view(tokens, 32, 128)
    served = run_and_check(op, provider, [q, w, EPS], dtype)
    # one token's heads are contiguous even when sliced: sgl-kernel serves that case too
    assert served == {"flashinfer": "flashinfer", "sgl_kernel": "sgl_kernel" if q.is_contiguous() else "torch"}[provider]


@pytest.mark.parametrize("provider", KERNEL_PROVIDERS)
def test_weight_dtype_mismatch_falls_back(provider: str, gen: torch.Generator) -> None:
    """A float32 weight with bf16 input must not reach a library kernel that reads it as bf16
    (vLLM issue 48330); the Triton kernel loads each operand in its own dtype and serves it."""
    force(provider)
    op = ops.DEFS[ops.OPS.index("rms_norm")]
    x = torch.randn(8, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.rand(4096, device="cuda", generator=gen) + 0.5
    assert run_and_check(op, provider, [x, w, EPS], torch.bfloat16) == ("triton" if provider == "triton" else "torch")


@pytest.mark.parametrize(("weighted", "round_scale"), [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("provider", KERNEL_PROVIDERS)
def test_norms_without_weight_or_with_the_scale_rounded(provider: str, weighted: bool, round_scale: bool,
                                                        gen: torch.Generator) -> None:  # fmt: skip
    """No weight, or the scale rounded to the input dtype first: the libraries' kernels compute
    neither (they fall back, saying why); the Triton kernel serves both, in place too."""
    force(provider)
    x = torch.randn(8, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.rand(4096, device="cuda", generator=gen) + 0.5).to(torch.bfloat16) if weighted else None
    op = ops.DEFS[ops.OPS.index("rms_norm")]
    assert run_and_check(op, provider, [x, w, EPS, False, round_scale], torch.bfloat16) == (
        "triton" if provider == "triton" else "torch")
    if not round_scale:
        providers.reset_counts()
        add = ops.DEFS[ops.OPS.index("fused_add_rms_norm_")]
        args = [x.clone(), torch.randn_like(x), None, EPS]
        assert run_and_check(add, provider, args, torch.bfloat16) == ("triton" if provider == "triton" else "torch")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("provider", KERNEL_PROVIDERS)
@pytest.mark.parametrize("op", [op for op in quant.DEFS if "cast_last" in inspect.signature(op.reference).parameters],
                         ids=lambda op: op.name)
def test_norm_quant_in_the_llama_order(op: OpDef, provider: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    """The FP8 norm ops with ``cast_last=False`` (the weight after the rounding; the generic test
    above runs ``True``, torch.rms_norm's order): every provider within an e4m3 step of the spec."""
    force(provider)
    args = make_args(op, 64, 4096, dtype, gen)
    args[list(inspect.signature(op.reference).parameters).index("cast_last")] = False
    run_and_check(op, provider, args, dtype)


@pytest.mark.parametrize("provider", KERNEL_PROVIDERS)
def test_dynamic_quant_zero_rows(provider: str) -> None:
    force(provider)
    x = torch.zeros(4, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    floor = torch.full((4, 1), quant.SCALE_FLOOR, device="cuda")
    for q, s in (
        torch.ops.fxr.rms_norm_dynamic_quant_fp8(x, w, EPS),
        torch.ops.fxr.fused_add_rms_norm_dynamic_quant_fp8(x, x, w, EPS)[:2],
        torch.ops.fxr.silu_and_mul_dynamic_quant_fp8(torch.cat([x, x], dim=-1)),
    ):
        assert torch.equal(q.float(), torch.zeros_like(x, dtype=torch.float32))
        assert torch.equal(s, floor)


TRITON_OPS = [op for op in GENERIC if any(k.provider == "triton" for k in op.kernels)]


@pytest.mark.parametrize("hidden", [14336, 28672, 32769])
@pytest.mark.parametrize("op", TRITON_OPS, ids=lambda op: op.name)
def test_triton_long_rows(op: OpDef, hidden: int, gen: torch.Generator) -> None:
    """Llama-3-8B's and 70B's MLP widths: one program holds the row (32 warps); beyond
    quant.TRITON_MAX_ROW the norms and dynamic SiLU-and-mul fall back, static SiLU-and-mul serves."""
    force("triton")
    run_and_check(op, "triton", make_args(op, 3, hidden, torch.bfloat16, gen), torch.bfloat16)


# --------------------------------------------------------------------------- graphs and tracing


@pytest.mark.parametrize("op", GENERIC, ids=lambda op: op.name)
def test_cuda_graph_capture_and_replay(op: OpDef, gen: torch.Generator) -> None:
    """Each op captures into a CUDA graph (no host sync, no allocation outside the pool) and
    replays on new inputs copied into the captured ones."""
    providers.configure(None)
    fn = getattr(torch.ops.fxr, op.name)
    static = make_args(op, 8, 4096, torch.bfloat16, gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: imports, JIT modules, plans
            fn(*clone(static))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn(*static)
    fresh = make_args(op, 8, 4096, torch.bfloat16, gen)
    for dst, src in zip(static, fresh):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    ref_args = clone(fresh)
    assert_matches(outputs(op, result, static), outputs(op, op.reference(*ref_args), ref_args), torch.bfloat16,
                   gemm="w" in inspect.signature(op.reference).parameters)  # fmt: skip


def test_dynamo_traces_cuda_calls(gen: torch.Generator) -> None:
    def block(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out, total = torch.ops.fxr.fused_add_rms_norm(x, r, w, EPS)
        return torch.ops.fxr.silu_and_mul(torch.cat([out, total], dim=-1))

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="eager", fullgraph=True, dynamic=True)
    for tokens in (3, 17):
        x, r = (torch.randn(tokens, 4096, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
        w = (torch.rand(4096, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
        torch.testing.assert_close(compiled(x, r, w), block(x, r, w), rtol=0, atol=0)


# --------------------------------------------------------------------------- Triton: rows at any strides

ROWS_OPS = [op for op in GENERIC if op in norm.DEFS + norm_variants.DEFS + activation.DEFS]


def strided(shape: tuple[int, ...], layout: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A [tokens, heads, dim] tensor read in place from a wider buffer: "per-head" (q of a merged
    q/k/v projection: rows at the qkv row stride), "permuted" (heads-major storage)."""
    t, h, d = shape
    if layout == "per-head":
        qkv = torch.randn(t, 3 * h * d, device="cuda", generator=gen).to(dtype)
        return qkv[:, : h * d].view(t, h, d)
    return torch.randn(h, t, d, device="cuda", generator=gen).to(dtype).permute(1, 0, 2)


@pytest.mark.parametrize("layout", ["per-head", "permuted"])
@pytest.mark.parametrize("tokens", [3, 9, 600])  # one token's heads are contiguous: the libraries serve it
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize("op", ROWS_OPS, ids=lambda op: op.name)
def test_triton_rows_kernels_at_any_strides(op: OpDef, dtype: torch.dtype, tokens: int, layout: str,
                                            gen: torch.Generator) -> None:  # fmt: skip
    """Per-head Q/K norms read through a view of a merged projection, a gate/up slice of a wider
    row, float32 models: what sgl-kernel and flashinfer refuse, the Triton kernels serve."""
    force("triton")
    width = 2 * 128 if op in activation.DEFS else 128
    args = make_args(op, tokens, 128, dtype, gen)
    args[0] = strided((tokens, 8, width), layout, dtype, gen)
    if op.name.startswith(("fused", "gemma_fused")) or {"gate", "b"} & set(inspect.signature(op.reference).parameters):
        args[1] = strided((tokens, 8, width), layout, dtype, gen)  # a residual, a gate, act_mul's other operand
    assert not args[0].is_contiguous()
    assert run_and_check(op, "triton", args, dtype).startswith("triton")
