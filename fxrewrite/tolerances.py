"""Per-dtype tolerances: how close a rewritten graph's values must be to the code it replaced.

Verification (:mod:`fxrewrite.verify`) judges every matched site with them at compile time; the
test helpers (:mod:`fxrewrite.testing`) compare whole outputs with eager by the same numbers::

    compare(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]))
    # 'max abs error 0.5 > tol 3e-05 (fp32)'
    compare(x.bfloat16(), x)
    # 'dtype bf16 != fp32'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

# (rtol, atol) per dtype for comparing a rewritten graph with eager; other dtypes: :func:`tolerance`.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}

_SHORT = {
    torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "bool",
    torch.float8_e4m3fn: "fp8e4m3", torch.float8_e5m2: "fp8e5m2",
}  # fmt: skip


def tolerance(dtype: torch.dtype, tolerances: Mapping[torch.dtype, tuple[float, float]] = TOLERANCES) -> tuple[float, float]:
    """(rtol, atol) for ``dtype``: from ``tolerances``; another floating dtype (FP8) gets two
    units of its precision, ``2 * finfo(dtype).eps``, for both; integers and bool compare exactly."""
    if dtype in tolerances:
        return tolerances[dtype]
    if dtype.is_floating_point:
        eps = 2 * torch.finfo(dtype).eps
        return eps, eps
    return 0.0, 0.0


def compare(
    actual: Any, expected: Any, tolerances: Mapping[torch.dtype, tuple[float, float]] = TOLERANCES
) -> str | None:
    """None if ``actual`` matches ``expected`` (allclose with the dtype's rtol/atol, NaN where
    NaN), else what differs."""
    if not isinstance(expected, torch.Tensor):
        if isinstance(actual, torch.Tensor) or actual != expected:
            return f"value {actual!r} != {expected!r}"
        return None
    if not isinstance(actual, torch.Tensor):
        return f"a {type(actual).__name__} where the subgraph gives a tensor"
    if actual.dtype != expected.dtype:
        return f"dtype {dtype_name(actual.dtype)} != {dtype_name(expected.dtype)}"
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    rtol, atol = tolerance(expected.dtype, tolerances)
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    if not torch.equal(nan_a, nan_e):
        return f"NaN at {int((nan_a ^ nan_e).sum())} position(s) where the other has a number"
    a, e = a.masked_fill(nan_a, 0.0), e.masked_fill(nan_e, 0.0)
    same_inf = torch.isinf(e) & (a == e)
    err = (a - e).abs().masked_fill(same_inf, 0.0)
    allowed = atol + rtol * e.abs().masked_fill(torch.isinf(e), 0.0)
    excess = err - allowed
    if excess.numel() == 0 or not bool((excess > 0).any()):
        return None
    worst = int(excess.argmax())
    max_err = float(err.max())
    return f"max abs error {_num(max_err)} > tol {_num(float(allowed.reshape(-1)[worst]))} ({dtype_name(expected.dtype)})"


def dtype_name(dtype: torch.dtype) -> str:
    """The short name messages use: ``fp32``, ``bf16``, ``i64``, ``fp8e4m3``."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.2g}"
