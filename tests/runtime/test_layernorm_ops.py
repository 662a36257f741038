"""CPU tests of the LayerNorm ops (runtime/ops/layernorm.py): each reference against torch's
``F.layer_norm`` and the unfused code it replaces, in-place semantics, fake impls, the kernels'
constraint checks, and the Triton kernel under Triton's interpreter (skipped without Triton)."""

from __future__ import annotations

import types
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from fxrewrite.runtime.ops import layernorm
from samples import rand  # this folder

EPS = 1e-5
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [F32, BF16, F16]
SHAPES = [(33,), (1, 33), (7, 64), (3, 4096), (5, 4, 128), (2, 3, 4, 64)]
AFFINE = ["weight-bias", "weight", "none", "bias"]


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def affine(gen: torch.Generator, kind: str, n: int, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    w = rand(gen, n, dtype=dtype) * 0.5 + 1 if kind in ("weight-bias", "weight") else None
    b = rand(gen, n, dtype=dtype) if kind in ("weight-bias", "bias") else None
    return w, b


def one_step(got: torch.Tensor, want: torch.Tensor, share: float = 0.01) -> None:
    """Equal dtype and shape, values within one rounding step of a half dtype (float32: the
    last digits the order of the row sums moves), and in half dtypes at most ``share`` of them
    off at all (the row sums run in another order than torch's)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    step = torch.finfo(got.dtype).eps if got.dtype != F32 else 1e-5
    torch.testing.assert_close(got, want, rtol=step, atol=step)
    if got.dtype != F32:
        assert (got != want).float().mean() <= share


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize("kind", AFFINE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_is_torch_layer_norm(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype,
                                        kind: str) -> None:  # fmt: skip
    """Computed in float32 and rounded once, as ``F.layer_norm`` computes half inputs."""
    x = rand(gen, *shape, dtype=dtype) * 3 + 1
    w, b = affine(gen, kind, shape[-1], dtype)
    out = torch.ops.fxr.layer_norm(x, w, b, EPS)
    one_step(out, F.layer_norm(x, shape[-1:], w, b, EPS))
    exact = F.layer_norm(x.double(), shape[-1:], None if w is None else w.double(), None if b is None else b.double(), EPS)
    torch.testing.assert_close(out.double(), exact, rtol=torch.finfo(dtype).eps, atol=torch.finfo(dtype).eps * 4)


def test_float32_weight_and_bias_keep_the_input_dtype(gen: torch.Generator) -> None:
    """A bf16 input with float32 weight and bias (a model that keeps its norms in float32): the
    output is bf16, as torch's mixed-dtype layer_norm gives it."""
    x, w, b = rand(gen, 4, 64), rand(gen, 64, dtype=F32), rand(gen, 64, dtype=F32)
    out = torch.ops.fxr.layer_norm(x, w, b, EPS)
    assert out.dtype == BF16
    one_step(out, F.layer_norm(x, (64,), w, b, EPS))


@pytest.mark.parametrize("kind", AFFINE)
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_rounded_first_is_the_code_that_casts_before_the_weight(gen: torch.Generator, dtype: torch.dtype,
                                                               kind: str) -> None:  # fmt: skip
    """``cast_last=False``: the normalized value rounded to the input dtype, then scaled and
    shifted there (DeBERTa's order), to the bit."""
    x = rand(gen, 5, 64, dtype=dtype)
    w, b = affine(gen, kind, 64, dtype)
    h = x.float()
    d = h - h.mean(-1, keepdim=True)
    y = (d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    y = y * w if w is not None else y
    y = y + b if b is not None else y
    torch.testing.assert_close(torch.ops.fxr.layer_norm(x, w, b, EPS, False), y, rtol=0, atol=0)


def test_rounded_first_promotes_as_torch_does(gen: torch.Generator) -> None:
    x, w = rand(gen, 3, 64), rand(gen, 64, dtype=F32)
    assert torch.ops.fxr.layer_norm(x, w, None, EPS, False).dtype == F32
    assert torch.ops.fxr.layer_norm(x, w, None, EPS, True).dtype == BF16


@pytest.mark.parametrize("kind", ["weight-bias", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_layer_norm_is_add_then_norm(gen: torch.Generator, dtype: torch.dtype, kind: str) -> None:
    x, r = rand(gen, 2, 5, 64, dtype=dtype), rand(gen, 2, 5, 64, dtype=dtype)
    w, b = affine(gen, kind, 64, dtype)
    out, total = torch.ops.fxr.fused_add_layer_norm(x, r, w, b, EPS)
    assert torch.equal(total, x + r)
    assert torch.equal(out, torch.ops.fxr.layer_norm(x + r, w, b, EPS))


@pytest.mark.parametrize("cast_last", [True, False])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_inplace_add_layer_norm_overwrites_both(gen: torch.Generator, dtype: torch.dtype, cast_last: bool) -> None:
    x, r = rand(gen, 2, 3, 64, dtype=dtype), rand(gen, 2, 3, 64, dtype=dtype)
    w, b = affine(gen, "weight-bias", 64, dtype)
    x0, r0 = x.clone(), r.clone()
    out_x, out_r = torch.ops.fxr.fused_add_layer_norm_(x, r, w, b, EPS, cast_last)
    assert out_x is x and out_r is r  # returns the tensors it overwrote, aliased
    assert torch.equal(r, x0 + r0)
    assert torch.equal(x, torch.ops.fxr.layer_norm(x0 + r0, w, b, EPS, cast_last))


def test_inplace_op_is_mutable_and_impure() -> None:
    g = torch.fx.Graph()
    x, r = g.placeholder("x"), g.placeholder("r")
    op = torch.ops.fxr.fused_add_layer_norm_.default
    assert [a.name for a in op._schema.arguments if a.is_write] == ["x", "residual"]
    assert g.call_function(op, (x, r, None, None, EPS)).is_impure()
    assert not g.call_function(torch.ops.fxr.fused_add_layer_norm.default, (x, r, None, None, EPS)).is_impure()


@pytest.mark.parametrize(("kind", "cast_last"), [("none", True), ("weight", False), ("bias", True)])
def test_fake_impls_with_absent_weight_or_bias(gen: torch.Generator, kind: str, cast_last: bool) -> None:
    x = rand(gen, 3, 64)
    w, b = affine(gen, kind, 64, F32)
    for name, args in (("layer_norm", (x, w, b, EPS, cast_last)),
                       ("fused_add_layer_norm", (x, x.clone(), w, b, EPS, cast_last))):  # fmt: skip
        real = getattr(torch.ops.fxr, name)(*args)
        with FakeTensorMode() as mode:
            fake = getattr(torch.ops.fxr, name)(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        real, fake = (t if isinstance(t, tuple) else (t,) for t in (real, fake))
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
    torch.library.opcheck(torch.ops.fxr.layer_norm.default, (x, w, b, EPS, cast_last),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))  # fmt: skip


# --------------------------------------------------------------------------- kernel checks


def check(kernels: tuple, provider: str) -> object:
    return next(k for k in kernels if k.provider == provider).check


def test_flashinfer_takes_bf16_rows_with_float32_weight_and_bias(gen: torch.Generator) -> None:
    fi = check(layernorm.LAYER_NORM_KERNELS, "flashinfer")
    x, w, b = rand(gen, 4, 64), rand(gen, 64, dtype=F32), rand(gen, 64, dtype=F32)
    assert fi(x, w, b, EPS) is None
    assert fi(rand(gen, 2, 3, 64), w, b, EPS) is None  # rows of a 3D input
    assert fi(x, w, None, EPS) == "flashinfer needs both weight and bias"
    assert fi(x, None, None, EPS) == "flashinfer needs both weight and bias"
    assert fi(x, w.to(BF16), b, EPS) == "weight dtype bfloat16 not float32"  # a bf16 checkpoint's weight
    assert fi(x, w, b.to(BF16), EPS) == "bias dtype bfloat16 not float32"
    assert fi(x.to(F16), w, b, EPS) == "dtype float16 not bf16"
    assert fi(x.float(), w, b, EPS) == "dtype float32 not bf16"
    assert fi(x, w, b, EPS, False) == "rounded before the scale: flashinfer rounds once"
    assert fi(rand(gen, 4, 33), rand(gen, 33, dtype=F32), rand(gen, 33, dtype=F32), EPS) == \
        "row of 66 bytes not 16-byte aligned"  # fmt: skip
    assert fi(rand(gen, 4, 128)[:, :64], w, b, EPS) == "input not contiguous"
    assert fi(rand(gen, 4 * 64 + 1)[1:].view(4, 64), w, b, EPS) == "input address not 16-byte aligned"
    assert fi(x, rand(gen, 128, dtype=F32)[::2], b, EPS) == "weight (64,) is not a contiguous [64] vector"
    assert fi(x[:0], w, b, EPS) == "empty input"
    add = check(layernorm.FUSED_ADD_KERNELS, "flashinfer")
    strided = rand(gen, 4, 128)[:, :64]
    assert add(strided, strided.clone(), w, b, EPS) is None  # torch's sum is a fresh contiguous tensor
    assert add(x, x.float(), w, b, EPS) == "residual torch.float32(4, 64) != input torch.bfloat16(4, 64)"


def test_triton_checks(gen: torch.Generator) -> None:
    ln, add = check(layernorm.LAYER_NORM_KERNELS, "triton"), check(layernorm.FUSED_ADD_KERNELS, "triton")
    inplace = check(layernorm.INPLACE_KERNELS, "triton")
    x, w, b = rand(gen, 4, 64), rand(gen, 64), rand(gen, 64)
    assert ln(x, None, None, EPS) is None and ln(x, w.float(), b, EPS) is None and ln(x.float(), w, None, EPS) is None
    assert ln(x.double(), w, b, EPS).startswith("dtype float64")
    assert ln(x, rand(gen, 32), b, EPS) == "weight (32,) is not a contiguous [64] vector"
    assert ln(x, w, b.double(), EPS) == "bias dtype float64 is not a float of 16 or 32 bits"
    assert ln(x, w, b.float(), EPS, False) == "bias torch.float32 widens the product of input torch.bfloat16 and weight torch.bfloat16"
    assert ln(x, w.float(), b.float(), EPS, False) is None
    assert add(x, x.float(), w, b, EPS) == "residual torch.float32 != input torch.bfloat16"
    assert add(x, x, w, b, EPS) == "inputs share memory"
    assert inplace(x, x.clone(), w.float(), None, EPS, False) == \
        "the normed value is torch.float32, written over an input of torch.bfloat16"  # fmt: skip
    assert inplace(x, x.clone(), w.float(), None, EPS, True) is None


# --------------------------------------------------------------------------- the Triton kernel, interpreted


def per_head(gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """q of a merged q/k/v projection, [B, T, H, D]: rows at the qkv row stride."""
    return rand(gen, 2, 5, 3 * 4 * 64, dtype=dtype)[..., : 4 * 64].view(2, 5, 4, 64)


def permuted(gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """[T, B, H, D] read from a [B, H, T, D] buffer: three leading dims at independent strides."""
    return rand(gen, 2, 4, 5, 64, dtype=dtype).permute(2, 0, 1, 3)


LAYOUTS = {"rows": lambda gen, dtype: rand(gen, 7, 64, dtype=dtype) * 2 + 1, "per-head": per_head, "permuted": permuted}


@pytest.mark.parametrize("cast_last", [True, False], ids=["round-once", "round-first"])
@pytest.mark.parametrize("kind", AFFINE)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_layer_norm_gives_the_spec(triton_layernorm: types.ModuleType, gen: torch.Generator, dtype: torch.dtype,
                                          layout: str, kind: str, cast_last: bool) -> None:  # fmt: skip
    x = LAYOUTS[layout](gen, dtype)
    w, b = affine(gen, kind, 64, dtype)
    assert check(layernorm.LAYER_NORM_KERNELS, "triton")(x, w, b, EPS, cast_last) is None
    one_step(triton_layernorm.layer_norm(x, w, b, EPS, cast_last), layernorm.layer_norm_reference(x, w, b, EPS, cast_last))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_fused_add_functional_and_in_place(triton_layernorm: types.ModuleType, gen: torch.Generator,
                                                  dtype: torch.dtype, layout: str) -> None:  # fmt: skip
    x, r = LAYOUTS[layout](gen, dtype), LAYOUTS[layout](gen, dtype)
    w, b = affine(gen, "weight-bias", 64, dtype)
    want_out, want_sum = layernorm.fused_add_layer_norm_reference(x, r, w, b, EPS)
    out, total = triton_layernorm.fused_add_layer_norm(x, r, w, b, EPS)
    assert torch.equal(total, want_sum)
    one_step(out, want_out)
    triton_layernorm.fused_add_layer_norm_(x, r, w, b, EPS)
    assert torch.equal(r, want_sum)
    one_step(x, want_out)


def test_triton_float32_weight_on_bf16_rows(triton_layernorm: types.ModuleType, gen: torch.Generator) -> None:
    """The call flashinfer would serve (float32 weight and bias), and a long row."""
    x, w, b = rand(gen, 3, 5000), rand(gen, 5000, dtype=F32), rand(gen, 5000, dtype=F32)
    one_step(triton_layernorm.layer_norm(x, w, b, EPS), F.layer_norm(x, (5000,), w, b, EPS))
