"""Triton's interpreter as the tests use it (imported as ``helpers.triton``): casts rounded as the
GPU rounds them."""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch

_TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8e4nv": torch.float8_e4m3fn,
    "fp8e5": torch.float8_e5m2,
}


def round_as_gpu(data: np.ndarray, src: object, dst: object, rounding_mode: object) -> np.ndarray:
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


def interpreted(module_name: str, kernel: str) -> Iterator[types.ModuleType]:
    """``module_name`` with its kernels interpreted (tests/conftest.py sets ``TRITON_INTERPRET=1``
    where there is no CUDA) and GPU rounding in the interpreter's casts. Skipped without Triton,
    and where the kernels are compiled (CUDA: the GPU tests run them)."""
    module = pytest.importorskip(module_name, reason="triton is not installed")
    interpreter = importlib.import_module("triton.runtime.interpreter")
    if not isinstance(getattr(module, kernel), interpreter.InterpretedFunction):
        pytest.skip("Triton kernels are compiled here, not interpreted: the GPU tests run them")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_convert_float", round_as_gpu)
        yield module


def compile_in_subprocess(script: str) -> str:
    """Run ``script`` (which compiles kernels for a GPU target, e.g. sm90, with Triton's compiler)
    in a process without ``TRITON_INTERPRET``; its stdout. Skipped without Triton, or where the
    CUDA toolchain (``ptxas``) is missing."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode and ("ptxas" in done.stderr or "No such file" in done.stderr):
        pytest.skip(f"no CUDA toolchain for Triton here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
