"""Gated activations: ``fxr::silu_and_mul`` and ``fxr::gelu_and_mul`` ([..., 2d] -> [..., d]).

    # before (HF LlamaMLP, gate and up projections merged)   # after
    gate, up = gate_up[..., :d], gate_up[..., d:]           h = torch.ops.fxr.silu_and_mul(gate_up)
    h = F.silu(gate) * up
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
import torch.nn.functional as F

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.providers import Kernel, OpDef

GELU_APPROXIMATIONS: tuple[str, ...] = ("none", "tanh")

# --------------------------------------------------------------------------- references (the spec)


def silu_and_mul_reference(x: Tensor) -> Tensor:
    """``d = x.shape[-1] // 2; return F.silu(x[..., :d]) * x[..., d:]``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul_reference(x: Tensor, approximate: str = "none") -> Tensor:
    """``d = x.shape[-1] // 2; return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]``;
    ``approximate`` is "none" (erf) or "tanh"."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]


def _silu_and_mul_fake(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _gelu_and_mul_fake(x: Tensor, approximate: str = "none") -> Tensor:
    return _silu_and_mul_fake(x)


# --------------------------------------------------------------------------- kernel constraints


def check_act_and_mul(x: Tensor, *, half_aligned: bool) -> str | None:
    """Both libraries: bf16/fp16, contiguous (no strides taken), even non-empty last dim, 16-byte
    aligned address. ``half_aligned`` (sgl-kernel 0.4.6, fixed 16-byte vectors): each half row
    ``d * itemsize`` a multiple of 16 bytes; flashinfer 0.7.2 narrows its vectors to divide d."""
    reason = constraints.check_half(x)
    if reason:
        return reason
    if x.numel() == 0:
        return "empty input"
    if x.shape[-1] % 2:
        return f"odd last dim {x.shape[-1]}"
    if not x.is_contiguous():
        return "input not contiguous"
    if not constraints.is_aligned(x, 16):
        return "address not 16-byte aligned"
    half_bytes = x.shape[-1] // 2 * x.element_size()
    if half_aligned and half_bytes % 16:
        return f"half row {half_bytes} bytes, not a multiple of 16"
    return None


def _gelu_kernel_name(approximate: str) -> str:
    return "gelu_tanh_and_mul" if approximate == "tanh" else "gelu_and_mul"


def _silu_check(half_aligned: bool, x: Tensor) -> str | None:
    return check_act_and_mul(x, half_aligned=half_aligned)


def _gelu_check(half_aligned: bool, x: Tensor, approximate: str = "none") -> str | None:
    if approximate not in GELU_APPROXIMATIONS:
        return f"approximate={approximate!r}"
    return check_act_and_mul(x, half_aligned=half_aligned)


# --------------------------------------------------------------------------- kernels


def _new_out(x: Tensor) -> Tensor:
    return torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)


def sgl_act_and_mul(kernel: str, x: Tensor) -> Tensor:
    """sgl-kernel's registered op ``kernel`` ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul")."""
    out = _new_out(x)
    getattr(torch.ops.sgl_kernel, kernel).default(out, x)
    return out


def flashinfer_act_and_mul(kernel: str, x: Tensor) -> Tensor:
    """flashinfer ``activation.<kernel>(x, out=..., enable_pdl=...)``."""
    out = _new_out(x)
    getattr(providers.library("flashinfer.activation"), kernel)(x, out=out, enable_pdl=providers.enable_pdl(x.device))
    return out


def _sgl_gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return sgl_act_and_mul(_gelu_kernel_name(approximate), x)


def _flashinfer_gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return flashinfer_act_and_mul(_gelu_kernel_name(approximate), x)


P = functools.partial
_FI = "flashinfer.activation"
sgl_silu_and_mul = P(sgl_act_and_mul, "silu_and_mul")
flashinfer_silu_and_mul = P(flashinfer_act_and_mul, "silu_and_mul")

# Order from measurement (bench/RESULTS.md, H100): flashinfer's SiLU-and-mul is the faster at
# every T (1.28 against 1.59 us at T=1, 34.9 against 35.4 at 4096); sgl-kernel's GELU is the
# faster up to T=64, so GELU keeps sgl-kernel first.
def _triton_check(x: Tensor, approximate: str = "none") -> str | None:
    if approximate not in GELU_APPROXIMATIONS:
        return f"approximate={approximate!r}"
    if x.dim() and x.shape[-1] % 2:
        return f"odd last dim {x.shape[-1]}"
    return constraints.check_strided_rows(x)


# Triton last: rows at any strides (a gate/up slice of a wider GEMM's output) and any float dtype.
SILU_AND_MUL_KERNELS = (
    Kernel("flashinfer", flashinfer_silu_and_mul, P(_silu_check, False), module=_FI),
    Kernel("sgl_kernel", sgl_silu_and_mul, P(_silu_check, True)),
    providers.triton_kernel("silu_and_mul", _triton_check),
)
GELU_AND_MUL_KERNELS = (
    Kernel("sgl_kernel", _sgl_gelu, P(_gelu_check, True)),
    Kernel("flashinfer", _flashinfer_gelu, P(_gelu_check, False), module=_FI),
    providers.triton_kernel("gelu_and_mul", _triton_check),
)

# --------------------------------------------------------------------------- the ops

DEFS: tuple[OpDef, ...] = (
    OpDef("silu_and_mul", silu_and_mul_reference, _silu_and_mul_fake, SILU_AND_MUL_KERNELS),
    OpDef("gelu_and_mul", gelu_and_mul_reference, _gelu_and_mul_fake, GELU_AND_MUL_KERNELS),
)
OPS: tuple[str, ...] = providers.define_all(DEFS)
