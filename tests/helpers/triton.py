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



_COMPILE = """
import importlib, inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, kernel, types, constexprs, options = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), kernel)
names = list(inspect.signature(fn.fn).parameters)
signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
sys.stdout.write(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"])
"""


def compile_for_hopper(module: str, kernel: str, types: dict[str, str], constexprs: dict[str, object],
                       **options: int) -> str:  # fmt: skip
    """Compile ``module.kernel`` (a ``@triton.jit`` function) for sm90 on this machine, GPU or
    not, and return its PTX: the front end and the NVIDIA backend check what the interpreter lets
    through (this Triton's; the GPU machine's may refuse more). In a process of its own, without
    ``TRITON_INTERPRET`` (under it the kernels are the interpreter's). ``types``: each
    non-constexpr parameter's Triton type (``"*bf16"``, ``"fp32"``); unnamed ones are ``i32``.
    Skipped without Triton, or where it cannot build for a GPU (no ``ptxas``, another API)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    args = json.dumps([module, kernel, types, constexprs, options])
    done = subprocess.run([sys.executable, "-c", _COMPILE, args], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        if "ImportError" in done.stderr or "ptxas" in done.stderr:
            pytest.skip(f"this Triton cannot build for sm90 here: {done.stderr.strip().splitlines()[-1]}")
        raise AssertionError(f"{module}.{kernel} does not compile for sm90:\n{done.stderr[-3000:]}")
    return done.stdout
