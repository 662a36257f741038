"""Shared fixtures of the runtime tests: a fresh provider registry, and the Triton provider's
kernels under Triton's interpreter (CPU tensors), skipped where Triton is not installed."""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from fxrewrite.runtime import providers


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> providers._Registry:
    """A fresh registry, no override, on an sm90 'device' (CPU tensors stand in for CUDA)."""
    reg = providers._Registry()
    monkeypatch.setattr(providers, "_REGISTRY", reg)
    monkeypatch.delenv(providers.ENV_VAR, raising=False)
    monkeypatch.setattr(providers, "device_capability", lambda device: (9, 0))
    return reg


_TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8e4nv": torch.float8_e4m3fn,
    "fp8e5": torch.float8_e5m2,
}


def _round_as_gpu(data: np.ndarray, src: object, dst: object, rounding_mode: object) -> np.ndarray:
    """Triton's interpreter casts between float formats bit by bit; in 3.6 it truncates float32 to
    bf16 and rounds float32 to e4m3 without carrying into the exponent (7.96 -> 4.0). The GPU
    rounds to nearest even (``cvt.rn``), as torch does: convert with torch (same signature as the
    interpreter's ``_convert_float``; returns the output's bits)."""
    assert rounding_mode is None or "RTNE" in str(rounding_mode), rounding_mode
    src_t, dst_t = _TORCH_DTYPES[src.name], _TORCH_DTYPES[dst.name]  # type: ignore[attr-defined]
    flat = np.ascontiguousarray(data).reshape(-1)
    if flat.size == 0:
        return np.zeros(data.shape, dtype=f"uint{dst.primitive_bitwidth}")  # type: ignore[attr-defined]
    values = torch.frombuffer(bytearray(flat.tobytes()), dtype=src_t).to(dst_t)
    bits = values.view(torch.uint8).numpy().view(f"uint{dst.primitive_bitwidth}")  # type: ignore[attr-defined]
    return bits.reshape(data.shape)


def _interpreted(module_name: str, kernel: str) -> Iterator[types.ModuleType]:
    """``module_name`` with its kernels interpreted (tests/conftest.py sets ``TRITON_INTERPRET=1``
    where there is no CUDA) and GPU rounding in the interpreter's casts. Skipped without Triton,
    and where the kernels are compiled (CUDA: the GPU tests run them)."""
    module = pytest.importorskip(module_name, reason="triton is not installed")
    interpreter = importlib.import_module("triton.runtime.interpreter")
    if not isinstance(getattr(module, kernel), interpreter.InterpretedFunction):
        pytest.skip("Triton kernels are compiled here, not interpreted: the GPU tests run them")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_convert_float", _round_as_gpu)
        yield module


@pytest.fixture(scope="module")
def triton_kernels() -> Iterator[types.ModuleType]:
    """``fxrewrite.runtime.triton_kernels`` interpreted (tests/runtime/test_ops_gpu.py runs it compiled)."""
    yield from _interpreted(providers.TRITON_MODULE, "_rms_norm_quant_kernel")


@pytest.fixture(scope="module")
def triton_moe() -> Iterator[types.ModuleType]:
    """``fxrewrite.runtime.triton_moe`` interpreted (tests/runtime/test_moe_gpu.py runs it compiled)."""
    yield from _interpreted("fxrewrite.runtime.triton_moe", "_moe_gemm_kernel")


@pytest.fixture(scope="module")
def triton_layernorm() -> Iterator[types.ModuleType]:
    """``fxrewrite.runtime.triton_layernorm`` interpreted (tests/runtime/test_layernorm_gpu.py runs it compiled)."""
    yield from _interpreted("fxrewrite.runtime.triton_layernorm", "_layer_norm_kernel")


@pytest.fixture(scope="module")
def triton_route() -> Iterator[types.ModuleType]:
    """``fxrewrite.runtime.triton_route`` interpreted (tests/runtime/test_moe_route_gpu.py runs it compiled)."""
    yield from _interpreted("fxrewrite.runtime.triton_route", "_moe_route_kernel")


@pytest.fixture(scope="module")
def triton_quant_block() -> Iterator[types.ModuleType]:
    """``fxrewrite.runtime.triton_quant_block`` interpreted (tests/runtime/test_quant_block_ops.py's GPU tests run it compiled)."""
    yield from _interpreted("fxrewrite.runtime.triton_quant_block", "_block_quant_kernel")
