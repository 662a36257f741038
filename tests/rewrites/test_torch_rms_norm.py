"""``torch.nn.RMSNorm`` / ``F.rms_norm`` / ``torch.rms_norm``: canonicalized into the arithmetic
ATen's decomposition computes (fxrewrite/canonicalize_norm.py ``rms_norm``), so each RMSNorm rule
(plain, weightless, add + norm) takes the library call as it takes the hand-written norm,
with outputs bit for bit equal to eager's on CPU. Negative twins: the call is kept as written
where the decomposition would not be its arithmetic (several normalized dims, float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, DTYPE_MODES, F32, check

N = 64


class Norm(torch.nn.Module):
    def __init__(self, affine: bool, eps: float | None) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(N, eps=eps, elementwise_affine=affine)
        if affine:
            with torch.no_grad():
                self.norm.weight.copy_(1 + 0.1 * torch.randn(N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


@DTYPE_MODES
@pytest.mark.parametrize("affine", [True, False], ids=["weight", "weightless"])
@pytest.mark.parametrize("eps", [1e-6, None], ids=["eps", "eps-none"])
def test_nn_rms_norm_fuses(affine: bool, eps: float | None, dtype: torch.dtype, dynamic: bool | str) -> None:
    m = Norm(affine, eps).to(dtype)
    check(m, torch.randn(5, N, dtype=dtype) * 3, expect={"rms_norm": 1}, dynamic=dynamic, exact=True)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_functional_spellings_and_add_norm(dtype: torch.dtype) -> None:
    """Positional and keyword arguments, the shape as ``x.shape[-1:]``; a residual add before
    the call fuses with it (the add + norm rules see the decomposed norm)."""
    w = (1 + 0.1 * torch.randn(N)).to(dtype)

    def fn(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s = x + r
        return (F.rms_norm(s, x.shape[-1:], w, 1e-5), s, torch.rms_norm(x, [N], weight=w, eps=1e-5),
                F.rms_norm(input=x, normalized_shape=(N,), eps=1e-5))  # fmt: skip

    x, r = torch.randn(3, N, dtype=dtype), torch.randn(3, N, dtype=dtype)
    check(fn, x, r, expect={"fused_add_rms_norm": 1, "rms_norm": 2}, exact=True)


# -- negative twins: kept as the library call ---------------------------------------------------


def test_several_normalized_dims_are_kept() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (4, N // 4), None, 1e-6)

    r = check(fn, torch.randn(3, 4, N // 4), expect={})
    assert r.counts()["aten.rms_norm"] + r.counts()["torch.rms_norm"] == 1, r.counts()


def test_float64_is_kept() -> None:
    """float64 computes in float64, not float32: the decomposition is not its arithmetic."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (N,), None, 1e-6)

    r = check(fn, torch.randn(3, N, dtype=torch.float64), expect={})
    assert r.counts()["aten.rms_norm"] + r.counts()["torch.rms_norm"] == 1, r.counts()
