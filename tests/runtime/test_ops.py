"""CPU tests of the fused ops: each reference against the unfused code it replaces (HF modules
where they exist), fake impls, opcheck, in-place semantics, re-import."""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable, Iterator

import inspect

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.activations import ACT2FN
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import fxrewrite.runtime.ops as ops
from samples import op_args  # this folder
from fxrewrite.runtime.ops import activation, linear, norm, quant
from fxrewrite.runtime.providers import OpDef

EPS = 1e-6
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# hidden 33 (odd), 1 token, 3D per-head and 4D [batch, seq, heads, head_dim]
NORM_SHAPES = [(33,), (1, 33), (7, 64), (3, 4096), (5, 4, 128), (2, 3, 4, 64)]
ACT_SHAPES = [(1, 66), (7, 128), (3, 2, 2 * 33), (8, 2 * 1024)]
MATH_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test id: fresh inputs per case, the same on every run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == FP8:
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def near_math(actual: torch.Tensor, expected64: torch.Tensor) -> None:
    """Within the rounding of ``actual``'s dtype of the float64 result."""
    tol = MATH_TOL[actual.dtype]
    torch.testing.assert_close(actual.double(), expected64, rtol=tol, atol=tol)


# --------------------------------------------------------------------------- the unfused code


def hf_norm(cls: type[torch.nn.Module], x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    module = cls(w.shape[0], eps=eps).to(w.dtype)
    with torch.no_grad():
        module.weight.copy_(w)
        return module(x)


def llama_norm(x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return hf_norm(LlamaRMSNorm, x, w, eps)


def gemma_norm(x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return hf_norm(GemmaRMSNorm, x, w, eps)


def math_norm(x: torch.Tensor, w: torch.Tensor, eps: float = EPS, bias: float = 0.0) -> torch.Tensor:
    h = x.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (bias + w.double())


def gated(act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return act(gate) * up


def unfused_static_quant(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(y.to(torch.float32) / scale, min=-FP8_MAX, max=FP8_MAX).to(FP8)


def unfused_per_token_quant(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = y.to(torch.float32).abs().max(dim=-1, keepdim=True)[0]
    s = torch.clamp(amax, min=1e-12) / FP8_MAX
    return torch.clamp(y.to(torch.float32) / s, min=-FP8_MAX, max=FP8_MAX).to(FP8), s


# --------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_is_llama_rms_norm(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, w = rand(gen, *shape, dtype=dtype), rand(gen, shape[-1], dtype=dtype)
    out = torch.ops.fxr.rms_norm(x, w, EPS)
    exact(out, llama_norm(x, w))
    near_math(out, math_norm(x, w))


@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_rms_norm_mixed_dtypes_promote(gen: torch.Generator, x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    x, w = rand(gen, 4, 64, dtype=x_dtype), rand(gen, 64, dtype=w_dtype)
    out = torch.ops.fxr.rms_norm(x, w, EPS)
    assert out.dtype == torch.float32
    exact(out, llama_norm(x, w))


@settings(max_examples=30, deadline=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    hidden=st.integers(1, 300),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
    seed=st.integers(0, 2**31 - 1),
)
def test_rms_norm_any_shape(lead: list[int], hidden: int, eps: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, w = rand(g, *lead, hidden), rand(g, hidden)
    exact(torch.ops.fxr.rms_norm(x, w, eps), llama_norm(x, w, eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_gemma_rms_norm_is_hf_gemma(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, w = rand(gen, *shape, dtype=dtype), rand(gen, shape[-1], dtype=dtype, scale=0.1)
    out = torch.ops.fxr.gemma_rms_norm(x, w, EPS)
    exact(out, gemma_norm(x, w))
    near_math(out, math_norm(x, w, bias=1.0))


def test_gemma_rms_norm_float32_weight_keeps_input_dtype(gen: torch.Generator) -> None:
    x, w = rand(gen, 3, 64, dtype=torch.bfloat16), rand(gen, 64, scale=0.1)
    exact(torch.ops.fxr.gemma_rms_norm(x, w, EPS), gemma_norm(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 33), (7, 64), (5, 4, 128)])
@pytest.mark.parametrize(("name", "hf"), [("fused_add_rms_norm", llama_norm), ("gemma_fused_add_rms_norm", gemma_norm)])
def test_fused_add_rms_norm_is_add_then_norm(
    gen: torch.Generator, name: str, hf: Callable[..., torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    x, r, w = rand(gen, *shape, dtype=dtype), rand(gen, *shape, dtype=dtype), rand(gen, shape[-1], dtype=dtype)
    out, total = getattr(torch.ops.fxr, name)(x, r, w, EPS)
    exact(total, x + r)
    exact(out, hf(x + r, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 33), (7, 64), (2, 3, 4, 64)])
@pytest.mark.parametrize(
    ("name", "hf"), [("fused_add_rms_norm_", llama_norm), ("gemma_fused_add_rms_norm_", gemma_norm)]
)
def test_inplace_add_rms_norm_overwrites_both(
    gen: torch.Generator, name: str, hf: Callable[..., torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    x, r, w = rand(gen, *shape, dtype=dtype), rand(gen, *shape, dtype=dtype), rand(gen, shape[-1], dtype=dtype)
    x0, r0 = x.clone(), r.clone()
    out_x, out_r = getattr(torch.ops.fxr, name)(x, r, w, EPS)
    assert out_x is x and out_r is r  # returns the tensors it overwrote, aliased
    exact(r, x0 + r0)
    exact(x, hf(x0 + r0, w))


def test_inplace_ops_are_mutable_and_impure() -> None:
    g = torch.fx.Graph()
    x, r, w = g.placeholder("x"), g.placeholder("r"), g.placeholder("w")
    for name in ("fused_add_rms_norm_", "gemma_fused_add_rms_norm_"):
        op = getattr(torch.ops.fxr, name).default
        assert op._schema.is_mutable
        assert [a.name for a in op._schema.arguments if a.is_write] == ["x", "residual"]
        assert g.call_function(op, (x, r, w, EPS)).is_impure()
    assert not g.call_function(torch.ops.fxr.fused_add_rms_norm.default, (x, r, w, EPS)).is_impure()


# --------------------------------------------------------------------------- norm variants


def hf_class(path: str, name: str) -> type[torch.nn.Module]:
    """transformers' ``models.<path>.<name>`` (skipped where this transformers lacks it)."""
    module = pytest.importorskip(f"transformers.models.{path}")
    if not hasattr(module, name):
        pytest.skip(f"{path}.{name} is not in this transformers")
    return getattr(module, name)


def hf(path: str, name: str, *args: object, weight: torch.Tensor | None = None) -> torch.nn.Module:
    """transformers' ``models.<path>.<name>(*args)`` (skipped where this transformers lacks it),
    its weight set to ``weight``."""
    m = hf_class(path, name)(*args)
    if weight is not None:
        m = m.to(weight.dtype)
        with torch.no_grad():
            m.weight.copy_(weight)
    return m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_without_weight_is_the_weightless_norm(gen: torch.Generator, shape: tuple[int, ...],
                                                        dtype: torch.dtype) -> None:  # fmt: skip
    x = rand(gen, *shape, dtype=dtype)
    out = torch.ops.fxr.rms_norm(x, None, EPS)
    exact(out, hf("nanochat.modeling_nanochat", "NanoChatRMSNorm", EPS)(x))
    exact(torch.ops.fxr.rms_norm(x, None, EPS, True), out)  # no weight: both orders are one computation
    near_math(out, math_norm(x, torch.ones(shape[-1])))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_rounded_scale_is_deepseek_v4_unweighted_norm(gen: torch.Generator, shape: tuple[int, ...],
                                                               dtype: torch.dtype) -> None:  # fmt: skip
    x, w = rand(gen, *shape, dtype=dtype), rand(gen, shape[-1], dtype=dtype)
    out = torch.ops.fxr.rms_norm(x, None, EPS, False, True)
    exact(out, hf("deepseek_v4.modeling_deepseek_v4", "DeepseekV4UnweightedRMSNorm", EPS)(x))
    exact(torch.ops.fxr.rms_norm(x, w, EPS, False, True), w * out)
    near_math(out, math_norm(x, torch.ones(shape[-1])))


def test_rounded_scale_differs_from_the_plain_norm_in_bf16(gen: torch.Generator) -> None:
    x = rand(gen, 64, 64, dtype=torch.bfloat16)
    assert not torch.equal(torch.ops.fxr.rms_norm(x, None, EPS, False, True), torch.ops.fxr.rms_norm(x, None, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_l2_norm_is_the_unit_sphere_projection(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = rand(gen, *shape, dtype=dtype)
    out = torch.ops.fxr.l2_norm(x, EPS)
    exact(out, hf("dory.modeling_dory", "DoryL2Norm", EPS)(x))
    h = x.double()
    near_math(out, h / torch.sqrt(h.pow(2).sum(-1, keepdim=True) + EPS))


# (transformers module, class, extra constructor args, group size, gate first, activation, scaled in float32)
GATED = {
    "qwen3-next": ("qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNormGated", (), None, False, "silu", False),
    "lara-mini": ("lara_mini.modeling_lara_mini", "LaraMiniRMSNormGated", (), None, False, "silu", True),
    "kimi-linear": ("kimi_linear.modeling_kimi_linear", "KimiLinearRMSNormGated", (), None, False, "sigmoid", True),
    "bamba-groups": ("bamba.modeling_bamba", "BambaRMSNormGated", (16,), 16, True, "silu", False),
    "bamba-one-group": ("bamba.modeling_bamba", "BambaRMSNormGated", (64,), None, True, "silu", False),
}


@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (2, 3, 4, 64)])
@pytest.mark.parametrize("case", list(GATED))
def test_rms_norm_gated_is_hf_gated_norms(gen: torch.Generator, case: str, shape: tuple[int, ...],
                                          x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:  # fmt: skip
    path, name, extra, group, gate_first, act, cast_last = GATED[case]
    x, z, w = rand(gen, *shape, dtype=x_dtype), rand(gen, *shape, dtype=x_dtype), rand(gen, 64, dtype=w_dtype)
    if extra and "group_size" not in inspect.signature(hf_class(path, name)).parameters:
        # transformers before 5.20: Bamba's gated norm has no groups, the whole row is one
        if group is not None:
            pytest.skip(f"{name} of this transformers normalizes whole rows (no group_size)")
        extra = ()
    module = hf(path, name, 64, *extra, weight=w)
    out = torch.ops.fxr.rms_norm_gated(x, z, w, EPS, group, gate_first, act, cast_last)
    exact(out, module.to(w_dtype)(x, z))


def test_rms_norm_gated_refuses_groups_that_do_not_divide_and_other_activations(gen: torch.Generator) -> None:
    x = rand(gen, 3, 64)
    with pytest.raises(ValueError, match="group size 24 does not divide the last dim 64"):
        torch.ops.fxr.rms_norm_gated(x, x, torch.ones(64), EPS, 24, True)
    with pytest.raises(ValueError, match=r"activation 'gelu': expected one of \['sigmoid', 'silu'\]"):
        torch.ops.fxr.rms_norm_gated(x, x, torch.ones(64), EPS, None, False, "gelu")


# --------------------------------------------------------------------------- activations


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ACT_SHAPES)
def test_silu_and_mul_is_llama_mlp_gate(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = rand(gen, *shape, dtype=dtype)
    out = torch.ops.fxr.silu_and_mul(x)
    exact(out, gated(ACT2FN["silu"], x))
    exact(out, F.silu(x[..., : shape[-1] // 2]) * x[..., shape[-1] // 2 :])
    g64, u64 = x.double().chunk(2, dim=-1)
    near_math(out, F.silu(g64) * u64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ACT_SHAPES)
@pytest.mark.parametrize(("approximate", "hf_act"), [("none", "gelu"), ("tanh", "gelu_pytorch_tanh")])
def test_gelu_and_mul_is_hf_gelu_gate(
    gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, approximate: str, hf_act: str
) -> None:
    x = rand(gen, *shape, dtype=dtype)
    exact(torch.ops.fxr.gelu_and_mul(x, approximate), gated(ACT2FN[hf_act], x))


def test_gelu_and_mul_defaults_to_erf(gen: torch.Generator) -> None:
    x = rand(gen, 3, 64)
    exact(torch.ops.fxr.gelu_and_mul(x), gated(F.gelu, x))


# --------------------------------------------------------------------------- FP8


def fp8_scale(value: float = 0.02) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 33), (7, 64), (5, 4, 128)])
def test_norm_quant_fp8_is_norm_then_quant(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, r, w = rand(gen, *shape, dtype=dtype), rand(gen, *shape, dtype=dtype), rand(gen, shape[-1], dtype=dtype)
    scale = fp8_scale()
    exact(torch.ops.fxr.rms_norm_quant_fp8(x, w, EPS, scale), unfused_static_quant(llama_norm(x, w), scale))
    q, s = torch.ops.fxr.rms_norm_dynamic_quant_fp8(x, w, EPS)
    q_ref, s_ref = unfused_per_token_quant(llama_norm(x, w))
    exact(q, q_ref)
    exact(s, s_ref)
    q, total = torch.ops.fxr.fused_add_rms_norm_quant_fp8(x, r, w, EPS, scale)
    exact(total, x + r)
    exact(q, unfused_static_quant(llama_norm(x + r, w), scale))
    q, s, total = torch.ops.fxr.fused_add_rms_norm_dynamic_quant_fp8(x, r, w, EPS)
    q_ref, s_ref = unfused_per_token_quant(llama_norm(x + r, w))
    exact(total, x + r)
    exact(q, q_ref)
    exact(s, s_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ACT_SHAPES)
def test_silu_and_mul_quant_fp8_is_silu_then_quant(
    gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    x, scale = rand(gen, *shape, dtype=dtype), fp8_scale(0.01)
    y = gated(ACT2FN["silu"], x)
    exact(torch.ops.fxr.silu_and_mul_quant_fp8(x, scale), unfused_static_quant(y, scale))
    q, s = torch.ops.fxr.silu_and_mul_dynamic_quant_fp8(x)
    q_ref, s_ref = unfused_per_token_quant(y)
    exact(q, q_ref)
    exact(s, s_ref)
    assert s.shape == (*shape[:-1], 1)


def test_static_quant_saturates_and_dynamic_reaches_max(gen: torch.Generator) -> None:
    x, w = rand(gen, 4, 64), torch.ones(64)
    q = torch.ops.fxr.rms_norm_quant_fp8(x, w, EPS, fp8_scale(1e-4))
    assert q.float().abs().max() == FP8_MAX
    q, _ = torch.ops.fxr.rms_norm_dynamic_quant_fp8(x, w, EPS)
    assert torch.equal(q.float().abs().amax(-1), torch.full((4,), FP8_MAX))


def test_dynamic_quant_of_zero_rows_has_floor_scale() -> None:
    """Padding tokens are zeros: q = 0 and s = 1e-12 / 448 (never 0, never NaN)."""
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    q, s = torch.ops.fxr.rms_norm_dynamic_quant_fp8(x, torch.ones(64, dtype=torch.bfloat16), EPS)
    assert torch.equal(q.float(), torch.zeros(3, 64))
    assert torch.equal(s, torch.full((3, 1), quant.SCALE_FLOOR))
    q, s = torch.ops.fxr.silu_and_mul_dynamic_quant_fp8(torch.zeros(2, 128))
    assert torch.equal(q.float(), torch.zeros(2, 64)) and torch.equal(s, torch.full((2, 1), quant.SCALE_FLOOR))


# --------------------------------------------------------------------------- generic: every op


@pytest.fixture(scope="module", autouse=True)
def fake_group() -> Iterator[None]:
    """A fake 2-rank default group (rank 0; its all-reduce returns the input) for the collective
    ops (runtime/ops/collective.py); their sums over real ranks: tests/runtime/test_collective_ops.py."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()



def make_args(op: OpDef, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> tuple[object, ...]:
    """Arguments for ``op`` by parameter name (:func:`samples.op_args`); ``shape`` is that of
    ``x`` (even last dim; rounded up to a multiple of 32 for the NVFP4 ops, which quantize
    blocks of 16 of a gated activation's half)."""
    if "global_scale" in inspect.signature(op.reference).parameters:  # NVFP4 (the all-reduce one too)
        shape = (*shape[:-1], -(-shape[-1] // 32) * 32)
    return tuple(op_args(op, shape, gen, dtype))


def as_tuple(out: object) -> tuple[torch.Tensor, ...]:
    return () if out is None else out if isinstance(out, tuple) else (out,)  # type: ignore[return-value]


def test_linear_reference_is_f_linear(gen: torch.Generator) -> None:
    x, w, b = rand(gen, 2, 3, 64), rand(gen, 32, 64), rand(gen, 32)
    exact(torch.ops.fxr.linear(x, w, b), F.linear(x, w, b))
    exact(torch.ops.fxr.linear(x, w), F.linear(x, w))


def test_linear_triton_kernel_constraints(gen: torch.Generator) -> None:
    """What the Triton kernel takes (the cuBLAS kernel after it takes everything)."""
    bf16 = torch.bfloat16
    x, w = rand(gen, 8, 64, dtype=bf16), rand(gen, 32, 64, dtype=bf16)
    assert linear.skinny_check(x, w) is None
    assert linear.skinny_check(rand(gen, 2, 8, 64, dtype=bf16), w, rand(gen, 32, dtype=bf16)) is None  # 16 rows
    assert linear.skinny_check(rand(gen, 17, 64, dtype=bf16), w) == "17 rows: cuBLAS serves outside 1..16"
    assert linear._tall_check(rand(gen, 4, 16, 64, dtype=bf16), w) is None  # 64 rows: the tallest tile
    assert linear._tall_check(rand(gen, 65, 64, dtype=bf16), w) == "65 rows: cuBLAS serves outside 1..64"
    assert linear.skinny_check(x.float(), w.float()) == "dtype float32 not bf16/fp16"
    assert linear.skinny_check(x, rand(gen, 64, 32, dtype=bf16).t()) == "weight has no unit stride along k"
    assert linear.skinny_check(x, w, rand(gen, 64, dtype=bf16)[::2]) == "bias not a contiguous vector"
    assert linear.skinny_check(x, rand(gen, 64, dtype=bf16)) == "shapes (8, 64) x (64,)"


def test_linear_silu_and_mul_reference_is_the_unfused_mlp_code(gen: torch.Generator) -> None:
    """``fxr.linear_silu_and_mul(x, w, b)`` is ``F.silu(gate) * up`` of ``F.linear(x, w, b)``."""
    x, w, b = rand(gen, 2, 3, 64), rand(gen, 48, 64), rand(gen, 48)
    for bias in (b, None):
        gate, up = F.linear(x, w, bias).chunk(2, dim=-1)
        exact(torch.ops.fxr.linear_silu_and_mul(x, w, bias), F.silu(gate) * up)
    with pytest.raises(ValueError, match=r"must be \[2d, k\] \(gate rows, then up rows\), got \(47, 64\)"):
        torch.ops.fxr.linear_silu_and_mul(x, w[:47])


def test_linear_silu_and_mul_triton_kernel_constraints(gen: torch.Generator) -> None:
    """The gated kernel takes what the plain one takes, with gate and up halves of rows."""
    bf16 = torch.bfloat16
    x, w = rand(gen, 8, 64, dtype=bf16), rand(gen, 32, 64, dtype=bf16)
    assert linear.gated_check(x, w) is None
    assert linear.gated_check(x, w, rand(gen, 32, dtype=bf16)) is None
    assert linear.gated_check(x, rand(gen, 31, 64, dtype=bf16)) == "odd weight rows 31"
    assert linear.gated_check(rand(gen, 17, 64, dtype=bf16), w) == "17 rows: cuBLAS serves outside 1..16"


def test_ops_lists_every_definition() -> None:
    assert ops.OPS == tuple(op.name for op in ops.DEFS)
    assert len(set(ops.OPS)) == len(ops.OPS) == 62
    for name in ops.OPS:
        assert hasattr(torch.ops.fxr, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 34), (3, 5, 128)])
@pytest.mark.parametrize("op", ops.DEFS, ids=lambda op: op.name)
def test_fake_impl_matches_real_outputs(
    gen: torch.Generator, op: OpDef, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    args = make_args(op, shape, dtype, gen)
    real = as_tuple(getattr(torch.ops.fxr, op.name)(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = as_tuple(getattr(torch.ops.fxr, op.name)(*fake_args))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


@pytest.mark.parametrize("op", ops.DEFS, ids=lambda op: op.name)
def test_opcheck(gen: torch.Generator, op: OpDef) -> None:
    # In-place ops return the tensors they overwrite (aliased outputs, like aten.add_): that
    # cannot be functionalized, which only AOTAutograd/Inductor would need; fxrewrite never does.
    utils = ("test_schema", "test_faketensor") if op.mutates_args else ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    for shape in [(2, 34), (2, 3, 64)]:
        args = make_args(op, shape, torch.float32, gen)
        # FP8 inputs (fxr.linear_block_fp8): the schema test compares them with arithmetic that
        # float8 has no CPU kernel for; the op declares no mutation, and the other tests run
        fp8 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
        torch.library.opcheck(getattr(torch.ops.fxr, op.name).default, args,
                              test_utils=tuple(u for u in utils if not (fp8 and u == "test_schema")))  # fmt: skip


@pytest.mark.parametrize("op", [op for op in ops.DEFS if not op.mutates_args], ids=lambda op: op.name)
def test_dynamo_traces_with_dynamic_shapes(gen: torch.Generator, op: OpDef) -> None:
    torch._dynamo.reset()  # each op is a new guard on one shared code object
    fn = getattr(torch.ops.fxr, op.name)
    compiled = torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)
    for tokens in (3, 5):
        args = make_args(op, (tokens, 64), torch.float32, gen)
        for got, want in zip(as_tuple(compiled(*args)), as_tuple(fn(*args))):
            exact(got, want)


def test_reimport_redefines_ops_in_place(gen: torch.Generator) -> None:
    x, w = rand(gen, 2, 64), rand(gen, 64)
    before = torch.ops.fxr.silu_and_mul.default  # what compiled rules and graphs hold
    for module in (norm, activation, quant, ops):
        importlib.reload(module)
    assert torch.ops.fxr.silu_and_mul.default is before
    exact(torch.ops.fxr.rms_norm(x, w, EPS), llama_norm(x, w))
    exact(torch.ops.fxr.silu_and_mul(x), gated(F.silu, x))
    assert importlib.reload(ops).OPS == ops.OPS
