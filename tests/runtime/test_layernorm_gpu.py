"""GPU tests of the LayerNorm ops beyond the generic ones of test_ops_gpu.py (which run every op
with weights of the input's dtype): flashinfer served where it fits (bf16 rows, float32 weight
and bias), absent weight or bias, the rounded-first order, rows at any strides, the add.

Run on the GPU machine (devkit carried as .devkit):
    source .devkit/setup.sh && python3 -m pytest -q tests/runtime/test_layernorm_gpu.py -m gpu

Each case forces one provider and checks that the kernel served exactly when its check accepts
the arguments (else the call fell back with that reason) and that the outputs are the
reference's within one rounding step of the output dtype, and ``F.layer_norm``'s.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.gpu import fresh_counts, gen  # noqa: F401  (pytest fixtures of this module)

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import layernorm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EPS = 1e-5
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
TOL = {BF16: 2e-2, F16: 4e-3, F32: 1e-5}
SHAPES = [(1, 4096), (7, 4096), (513, 4096), (4096, 4096), (3, 33), (5, 3420), (2, 5120), (8, 14336)]
OPS = {op.name: op for op in layernorm.DEFS}


def force(provider: str) -> None:
    if not providers.available(provider):
        pytest.skip(f"{provider} is not importable here: {providers._REGISTRY.import_errors.get(provider)}")
    providers.configure(provider)


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, device="cuda", generator=gen) * scale + shift).to(dtype)


def served(name: str, provider: str, args: list[Any]) -> tuple[Any, str]:
    """Call ``fxr.<name>`` with ``provider`` forced; its result and the label that served it,
    checked against the kernel's own check (served exactly when it accepts, else a fallback
    with its reason)."""
    force(provider)
    kernel = next(k for k in OPS[name].kernels if k.provider == provider)
    reason = kernel.check(*args)
    result = getattr(torch.ops.fxr, name)(*args)
    entry = providers.served()[name]
    label = kernel.name if reason is None else "torch"
    assert entry.get(label) == 1, entry
    if reason is not None:
        assert any(reason in why for why in entry["fallbacks"]), entry
    return result, label


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    tol = TOL[got.dtype] if got.dtype in TOL else TOL[F32]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("tokens", "hidden"), SHAPES)
@pytest.mark.parametrize("affine_dtype", [F32, BF16], ids=["f32-affine", "bf16-affine"])
@pytest.mark.parametrize("provider", ["flashinfer", "triton"])
def test_layer_norm_bf16_rows(provider: str, affine_dtype: torch.dtype, tokens: int, hidden: int,
                              gen: torch.Generator) -> None:  # fmt: skip
    """flashinfer serves float32 weight and bias at 16-byte rows; the Triton kernel serves all;
    both compute what ``F.layer_norm`` computes."""
    x = rand(gen, tokens, hidden, dtype=BF16, scale=3.0, shift=1.0)
    x[0] = 0  # a padding row of a CUDA graph
    w, b = rand(gen, hidden, dtype=affine_dtype, shift=1.0), rand(gen, hidden, dtype=affine_dtype)
    args = [x, w, b, EPS, True]
    out, label = served("layer_norm", provider, args)
    if provider == "flashinfer":
        assert (label == "flashinfer") == (affine_dtype == F32 and hidden * 2 % 16 == 0)
    else:
        assert label == ("triton" if hidden <= 32768 else "torch")
    close(out, layernorm.layer_norm_reference(*args))
    if affine_dtype == BF16:
        close(out, F.layer_norm(x, (hidden,), w, b, EPS))
    else:  # CUDA's F.layer_norm takes no float32 weight for bf16 rows: what it computes in float32, rounded once
        close(out, F.layer_norm(x.float(), (hidden,), w, b, EPS).to(BF16))


@pytest.mark.parametrize("cast_last", [True, False], ids=["round-once", "round-first"])
@pytest.mark.parametrize("kind", ["none", "weight", "bias"])
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_triton_layer_norm_without_weight_or_bias(dtype: torch.dtype, kind: str, cast_last: bool,
                                                  gen: torch.Generator) -> None:  # fmt: skip
    """OLMo's norm (neither), ``nn.LayerNorm(bias=False)``; flashinfer needs both."""
    x = rand(gen, 64, 4096, dtype=dtype)
    w = rand(gen, 4096, dtype=dtype, shift=1.0) if kind == "weight" else None
    b = rand(gen, 4096, dtype=dtype) if kind == "bias" else None
    args = [x, w, b, EPS, cast_last]
    out, label = served("layer_norm", "triton", args)
    assert label == "triton"
    close(out, layernorm.layer_norm_reference(*args))
    _, fallback = served("layer_norm", "flashinfer", [x, w, b, EPS, cast_last])
    assert fallback == "torch"


@pytest.mark.parametrize("layout", ["per-head", "permuted"])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_triton_layer_norm_at_any_strides(dtype: torch.dtype, layout: str, gen: torch.Generator) -> None:
    """Per-head q/k norms (Persimmon, StableLM, Phi) read through a view of a merged projection."""
    t, h, d = 9, 8, 128
    if layout == "per-head":
        x = rand(gen, t, 3 * h * d, dtype=dtype)[:, : h * d].view(t, h, d)
    else:
        x = rand(gen, h, t, d, dtype=dtype).permute(1, 0, 2)
    w, b = rand(gen, d, dtype=dtype, shift=1.0), rand(gen, d, dtype=dtype)
    out, label = served("layer_norm", "triton", [x, w, b, EPS, True])
    assert label == "triton" and not x.is_contiguous()
    close(out, F.layer_norm(x, (d,), w, b, EPS))


@pytest.mark.parametrize(("tokens", "hidden"), [(1, 4096), (7, 4096), (513, 4096), (3, 33)])
@pytest.mark.parametrize("provider", ["triton", "flashinfer"])
def test_fused_add_layer_norm(provider: str, tokens: int, hidden: int, gen: torch.Generator) -> None:
    """Functional: one Triton launch, or torch's add then flashinfer's norm; in place: Triton."""
    x, r = (rand(gen, tokens, hidden, dtype=BF16) for _ in range(2))
    w, b = rand(gen, hidden, dtype=F32, shift=1.0), rand(gen, hidden, dtype=F32)
    args = [x, r, w, b, EPS, True]
    (out, total), _ = served("fused_add_layer_norm", provider, args)
    want_out, want_sum = layernorm.fused_add_layer_norm_reference(*args)
    assert torch.equal(total, want_sum)
    close(out, want_out)
    if provider == "triton":
        providers.reset_counts()
        served("fused_add_layer_norm_", "triton", args)
        assert torch.equal(r, want_sum)
        close(x, want_out)
