"""Triton's interpreter as the tests use it (imported as ``helpers.triton``): casts rounded as the
GPU rounds them."""

from __future__ import annotations

import functools
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
    if (fault := interpreter_fault()) is not None:
        pytest.skip(fault)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_convert_float", round_as_gpu)
        yield module


@functools.cache
def interpreter_fault() -> str | None:
    """Why this Triton's interpreter cannot run the kernels here, else None. Triton 3.6's turns a
    runtime loop bound into a Python int with ``int()`` of a one-element array, which NumPy 2.4
    refuses (``range(0, k, BK)`` over an argument: every GEMM kernel's k loop)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _count(out_ptr, n):
        total = 0
        for _ in range(0, n):
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        _count[(1,)](out, 3)
    except Exception as e:  # noqa: BLE001 - the interpreter wraps what it hit
        if "0-dimensional" not in str(e):
            raise
        return (f"Triton {triton.__version__}'s interpreter cannot loop over a runtime bound with NumPy "
                f"{np.__version__}: {e}")  # fmt: skip
    assert int(out) == 3, f"the interpreter's loop ran {int(out)} times, not 3"
    return None


# The compiler's process: one per test process, started at the first request and kept (each
# request in a new process cost ~2 s of imports, torch's among them, for a ~0.5 s compile; 21 of
# them in the suite). A request per line on stdin (sys.path, then what compile_for_hopper got),
# the PTX or the traceback as one JSON line on the descriptor stdout had (fd 1 itself goes to
# stderr: nothing a compile prints can break a reply). It ends at the end of its stdin.
_SERVE = """
import importlib, inspect, json, os, sys, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
for line in sys.stdin:
    try:
        path, (module, kernel, types, constexprs, options) = json.loads(line)
        sys.path[:] = path
        fn = getattr(importlib.import_module(module), kernel)
        params = inspect.signature(fn.fn).parameters
        names = list(params)
        for n, p in params.items():  # a constexpr switch not named takes its default (off)
            if n not in constexprs and "constexpr" in str(p.annotation) and p.default is not p.empty:
                constexprs[n] = p.default.value if hasattr(p.default, "value") else p.default
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
        reply = {"ptx": triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]}
    except Exception:
        reply = {"error": traceback.format_exc()}
    replies.write(json.dumps(reply) + "\\n")
    replies.flush()
"""


class _Compiler:
    """The compiler's process (``_SERVE``) and its stderr, a file (a pipe nobody reads would fill)."""

    def __init__(self) -> None:
        import os
        import subprocess
        import sys
        import tempfile

        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True)  # fmt: skip

    def compile(self, request: list[object], timeout: float) -> dict[str, str]:
        """The reply to ``request``; past ``timeout`` seconds, or if the process ended, an error."""
        import json
        import selectors
        import sys

        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps([[p for p in sys.path if p], request]) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # ended: said below
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = self.proc.stdout.readline() if sel.select(timeout) else ""
        if line:
            return json.loads(line)
        self.close()
        self.stderr.seek(0)
        return {"error": f"the compiler's process ended or took over {timeout:.0f} s:\n{self.stderr.read()[-3000:]}"}

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


_compiler: list[_Compiler] = []


def compile_for_hopper(module: str, kernel: str, types: dict[str, str], constexprs: dict[str, object],
                       **options: int) -> str:  # fmt: skip
    """Compile ``module.kernel`` (a ``@triton.jit`` function) for sm90 on this machine, GPU or
    not, and return its PTX: the front end and the NVIDIA backend check what the interpreter lets
    through (this Triton's; the GPU machine's may refuse more). In a process of its own, without
    ``TRITON_INTERPRET`` (under it the kernels are the interpreter's), kept for the next call
    (``_SERVE``). ``types``: each non-constexpr parameter's Triton type (``"*bf16"``, ``"fp32"``);
    unnamed ones are ``i32``, and unnamed constexprs with a default take it. Skipped without
    Triton, or where it cannot build for a GPU (no ``ptxas``, another API)."""
    import atexit

    pytest.importorskip("triton")
    if not _compiler or _compiler[0].proc.poll() is not None:
        _compiler[:] = [_Compiler()]
        atexit.register(_compiler[0].close)
    reply = _compiler[0].compile([module, kernel, types, constexprs, options], timeout=300)
    if "error" in reply:
        error = reply["error"]
        if "ImportError" in error or "ptxas" in error:
            pytest.skip(f"this Triton cannot build for sm90 here: {error.strip().splitlines()[-1]}")
        raise AssertionError(f"{module}.{kernel} does not compile for sm90:\n{error[-3000:]}")
    return reply["ptx"]
