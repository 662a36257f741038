"""Shared fixtures of the runtime tests: a fresh provider registry, and the Triton provider's
kernels under Triton's interpreter (CPU tensors), skipped where Triton is not installed."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest

from fxrewrite.runtime import providers
from helpers.triton import interpreted as _interpreted


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> providers._Registry:
    """A fresh registry, no override, on an sm90 'device' (CPU tensors stand in for CUDA)."""
    reg = providers._Registry()
    monkeypatch.setattr(providers, "_REGISTRY", reg)
    monkeypatch.delenv(providers.ENV_VAR, raising=False)
    monkeypatch.setattr(providers, "device_capability", lambda device: (9, 0))
    return reg


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
def triton_nvfp4() -> Iterator[types.ModuleType]:
    """``fxrewrite.runtime.triton_nvfp4`` interpreted (tests/runtime/test_quant_nvfp4_gpu.py runs it compiled)."""
    yield from _interpreted("fxrewrite.runtime.triton_nvfp4", "_nvfp4_kernel")


@pytest.fixture(scope="module")
def triton_quant_block() -> Iterator[types.ModuleType]:
    """``fxrewrite.runtime.triton_quant_block`` interpreted (tests/runtime/test_quant_block_ops.py's GPU tests run it compiled)."""
    yield from _interpreted("fxrewrite.runtime.triton_quant_block", "_block_quant_kernel")


@pytest.fixture(scope="module")
def triton_linear_block_fp8() -> Iterator[types.ModuleType]:
    """``fxrewrite.runtime.triton_linear_block_fp8`` interpreted (its GPU tests run it compiled)."""
    yield from _interpreted("fxrewrite.runtime.triton_linear_block_fp8", "_linear_block_fp8_kernel")


@pytest.fixture(scope="module")
def triton_gemm() -> Iterator[types.ModuleType]:
    """``fxrewrite.runtime.triton_gemm`` interpreted (tests/runtime/test_ops_gpu.py runs it compiled)."""
    yield from _interpreted("fxrewrite.runtime.triton_gemm", "_skinny_linear_kernel")


@pytest.fixture(scope="module")
def triton_rows() -> Iterator[types.ModuleType]:
    """``fxrewrite.runtime.triton_rows`` interpreted (tests/runtime/test_linear_fused_gpu.py runs it compiled)."""
    yield from _interpreted("fxrewrite.runtime.triton_rows", "_hand_off_rows_kernel")


@pytest.fixture(scope="module")
def triton_rotary() -> Iterator[types.ModuleType]:
    """``fxrewrite.runtime.triton_rotary`` interpreted (tests/runtime/test_rotary_gpu.py runs it compiled)."""
    yield from _interpreted("fxrewrite.runtime.triton_rotary", "_rotary_kernel")
