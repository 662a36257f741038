"""``fxr.act_mul`` (runtime/ops/activation.py): the reference is model code (values, dtype and the
layout eager gives the product), the Triton kernel (interpreted on CPU) gives the spec at every
layout a model hands it, and its check refuses what it cannot serve. On the GPU:
tests/runtime/test_act_mul_gpu.py."""

from __future__ import annotations

import types
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers.activations import ACT2FN

from act_mul_samples import LAYOUTS, mamba, rand  # this folder
from fxrewrite.runtime.ops import activation

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HF = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="module")
def triton_act_mul(triton_kernels: types.ModuleType) -> types.ModuleType:
    """The kernel module, interpreted, with the GPU's rounding (the ``triton_kernels`` fixture)."""
    return pytest.importorskip(activation.TRITON_ACT_MUL)


def model_code(a: torch.Tensor, b: torch.Tensor, act: str, act_first: bool) -> torch.Tensor:
    h = ACT2FN[HF[act]](a)
    return h * b if act_first else b * h


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same values (bit for bit), dtype, shape and strides."""
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("act_first", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["rows", "mamba", "view-halves"])
@pytest.mark.parametrize("act", activation.ACT_MUL_ACTIVATIONS)
def test_reference_is_model_code(gen: torch.Generator, act: str, layout: str, dtype: torch.dtype, act_first: bool) -> None:
    a, b = LAYOUTS[layout](gen, dtype)
    same(torch.ops.fxr.act_mul(a, b, act, act_first), model_code(a, b, act, act_first))


PROMOTIONS = [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize(("a_dtype", "b_dtype"), PROMOTIONS, ids=["bf16-f32", "f32-bf16", "f16-bf16"])
@pytest.mark.parametrize("act", activation.ACT_MUL_ACTIVATIONS)
def test_two_dtypes_promote_as_eager(gen: torch.Generator, act: str, a_dtype: torch.dtype, b_dtype: torch.dtype) -> None:
    """The activation rounded to ``a``'s dtype, the product in the promoted one (float32 here)."""
    gate, scan = mamba(gen, a_dtype)
    scan = scan.to(b_dtype)
    same(torch.ops.fxr.act_mul(gate, scan, act, False), model_code(gate, scan, act, False))
    assert activation._act_mul_triton_check(gate, scan, act, False) is None


@pytest.mark.parametrize(("a_dtype", "b_dtype"), PROMOTIONS, ids=["bf16-f32", "f32-bf16", "f16-bf16"])
def test_triton_kernel_promotes_as_eager(triton_act_mul: types.ModuleType, gen: torch.Generator, a_dtype: torch.dtype,
                                         b_dtype: torch.dtype) -> None:  # fmt: skip
    gate, scan = mamba(gen, a_dtype)
    scan = scan.to(b_dtype)
    close(triton_act_mul.act_mul(gate, scan, "silu", False), activation.act_mul_reference(gate, scan, "silu", False))


def test_operand_order_picks_eager_layout_not_values(gen: torch.Generator) -> None:
    gate, scan = mamba(gen, torch.bfloat16)
    first, second = torch.ops.fxr.act_mul(gate, scan, "silu"), torch.ops.fxr.act_mul(gate, scan, "silu", False)
    assert first.stride() == (120, 1, 24) and second.stride() == (120, 5, 1)  # gate's order, scan's order
    assert torch.equal(first, second)


def test_unknown_activation_raises(gen: torch.Generator) -> None:
    x = rand(gen, 2, 8)
    with pytest.raises(ValueError, match=r"activation 'relu': expected one of \['silu', 'gelu', 'gelu_tanh'\]"):
        torch.ops.fxr.act_mul(x, x, "relu")


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The spec's layout and values: the kernel rounds where it rounds, but its float32 activation
    (``exp``, ``erf``, division) may differ from torch's in the last bit, which moves a rare
    rounding of the activation by one step of the dtype, two in the product (the activation ops' Triton tests allow one:
    tests/runtime/test_triton_kernels.py)."""
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    f32 = got.dtype == torch.float32  # GELU's erf near 0: the interpreter's and torch's differ by ~1e-6
    torch.testing.assert_close(got, want, rtol=2 * torch.finfo(got.dtype).eps, atol=1e-5 if f32 else 1e-6)
    if not f32:
        assert (got != want).sum() <= max(1, 0.01 * got.numel())


@pytest.mark.parametrize("act_first", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("act", activation.ACT_MUL_ACTIVATIONS)
def test_triton_kernel_gives_the_spec_at_any_layout(triton_act_mul: types.ModuleType, gen: torch.Generator, act: str,
                                                    layout: str, dtype: torch.dtype, act_first: bool) -> None:  # fmt: skip
    a, b = LAYOUTS[layout](gen, dtype)
    assert activation._act_mul_triton_check(a, b, act, act_first) is None
    close(triton_act_mul.act_mul(a, b, act, act_first), activation.act_mul_reference(a, b, act, act_first))


def test_plan_walks_the_output_order(gen: torch.Generator) -> None:
    """Mamba's product in the scan output's layout: rows over (B, D), L innermost; the gate read
    at its channel stride 1 across rows and its token stride 2D along them."""
    gate, scan = mamba(gen, torch.bfloat16)
    out = activation.out_strides(gate, scan, "silu", False)
    assert out == (120, 5, 1)
    assert activation.act_mul_plan(tuple(gate.shape), gate.stride(), scan.stride(), out) == (
        5, [1, 2, 24], [0, 240, 1, 48], [0, 120, 5, 1])  # fmt: skip


CHECK_REFUSALS: list[tuple[str, Callable[[torch.Generator], tuple[Any, ...]], str]] = [
    ("broadcast", lambda g: (rand(g, 4, 64), rand(g, 4, 1)), "shape (4, 1) != (4, 64)"),
    ("integer", lambda g: (rand(g, 4, 64), torch.ones(4, 64, dtype=torch.int32)),
     "dtype int32 is not a float of 16 or 32 bits"),
    ("float64", lambda g: (rand(g, 4, 64, dtype=torch.float64),) * 2, "dtype float64 is not a float of 16 or 32 bits"),
    ("empty", lambda g: (rand(g, 0, 64),) * 2, "empty input"),
    ("five-dims", lambda g: (rand(g, 2, 3, 4, 5, 64).permute(3, 1, 0, 2, 4), rand(g, 5, 3, 2, 4, 64)),
     "more than 3 leading dims at independent strides"),
    ("relu", lambda g: (rand(g, 4, 64), rand(g, 4, 64), "relu"), "activation 'relu'"),
]


@pytest.mark.parametrize(("args", "reason"), [c[1:] for c in CHECK_REFUSALS], ids=[c[0] for c in CHECK_REFUSALS])
def test_check_refuses_what_the_kernel_cannot_serve(gen: torch.Generator, args: Callable[..., tuple[Any, ...]],
                                                    reason: str) -> None:  # fmt: skip
    assert activation._act_mul_triton_check(*args(gen)) == reason


def test_no_library_serves_act_mul() -> None:
    """sgl-kernel and flashinfer take one [..., 2d] tensor: Triton, else the torch reference."""
    (op,) = [op for op in activation.DEFS if op.name == "act_mul"]
    assert [k.provider for k in op.kernels] == ["triton"]
