"""Gated activations: ``fxr::silu_and_mul`` and ``fxr::gelu_and_mul`` ([..., 2d] -> [..., d]), and
``fxr::act_mul`` (two operands of one shape, not the halves of one tensor).

    # before (HF LlamaMLP, gate and up projections merged)   # after
    gate, up = gate_up[..., :d], gate_up[..., d:]           h = torch.ops.fxr.silu_and_mul(gate_up)
    h = F.silu(gate) * up

    # before (a Mamba mixer's output gate: two kernels)      # after (one)
    y = scan_output * F.silu(gate)                          y = torch.ops.fxr.act_mul(gate, scan_output, "silu", False)
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


ACT_MUL_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu", "gelu_tanh")


def activate(a: Tensor, activation: str) -> Tensor:
    """``F.silu(a)``, ``F.gelu(a)`` or ``F.gelu(a, approximate="tanh")`` by name."""
    if activation == "silu":
        return F.silu(a)
    if activation in ("gelu", "gelu_tanh"):
        return F.gelu(a, approximate="tanh" if activation == "gelu_tanh" else "none")
    raise ValueError(f"activation {activation!r}: expected one of {list(ACT_MUL_ACTIVATIONS)}")


def act_mul_reference(a: Tensor, b: Tensor, activation: str = "silu", act_first: bool = True) -> Tensor:
    """``act(a) * b`` (or ``b * act(a)`` without ``act_first``: the same values; eager takes the
    output's layout from the operands in that order), ``act`` named by ``activation`` ("silu",
    "gelu", "gelu_tanh"), each step as model code computes it: the activation in ``a``'s dtype,
    the product in the promoted dtype (a bf16 gate times a float32 scan output is float32)."""
    h = activate(a, activation)
    return h * b if act_first else b * h


def _silu_and_mul_fake(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _gelu_and_mul_fake(x: Tensor, approximate: str = "none") -> Tensor:
    return _silu_and_mul_fake(x)


# The spec on fake tensors: eager's shape, dtype and strides (the layout of a product of two
# differently strided operands is TensorIterator's choice; the Triton launcher asks for the same).
_act_mul_fake = act_mul_reference

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


def _act_mul_triton_check(a: Tensor, b: Tensor, activation: str = "silu", act_first: bool = True) -> str | None:
    """Our kernel only (no library has one for two operands): one shape (no broadcasting), 16- or
    32-bit floats (of two dtypes: the product is computed in float32 as eager's promoted product
    is), one device, a layout of at most ``constraints.LEADING_DIMS`` + 1 dims once the output's
    memory order collapses it."""
    if activation not in ACT_MUL_ACTIVATIONS:
        return f"activation {activation!r}"
    for t in (a, b):
        if reason := constraints.check_float(t):
            return reason
    if a.shape != b.shape:
        return f"shape {tuple(b.shape)} != {tuple(a.shape)}"
    if a.device != b.device:
        return f"{b.device} != {a.device}"
    if a.numel() == 0:
        return "empty input"
    plan = act_mul_plan(tuple(a.shape), a.stride(), b.stride(), out_strides(a, b, activation, act_first))
    return plan if isinstance(plan, str) else None


@functools.lru_cache(maxsize=1024)
def _out_strides(shape: tuple[int, ...], a_stride: tuple[int, ...], b_stride: tuple[int, ...],
                 a_dtype: torch.dtype, b_dtype: torch.dtype, activation: str, act_first: bool) -> tuple[int, ...]:  # fmt: skip
    a, b = (torch.empty_strided(shape, s, dtype=t, device="meta") for s, t in ((a_stride, a_dtype), (b_stride, b_dtype)))
    return tuple(act_mul_reference(a, b, activation, act_first).stride())


def out_strides(a: Tensor, b: Tensor, activation: str, act_first: bool) -> tuple[int, ...]:
    """The strides eager gives ``act(a) * b`` (or ``b * act(a)``) at these operands' strides."""
    return _out_strides(tuple(a.shape), a.stride(), b.stride(), a.dtype, b.dtype, activation, act_first)


@functools.lru_cache(maxsize=1024)
def act_mul_plan(shape: tuple[int, ...], a_stride: tuple[int, ...], b_stride: tuple[int, ...],
                 out_stride: tuple[int, ...]) -> tuple[int, list[int], list[int], list[int]] | str:  # fmt: skip
    """How a strided elementwise kernel walks equally shaped ``a``, ``b`` and a dense output in
    the output's memory order: ``(n, [d0, d1, d2], a's strides, b's strides)``, ``n`` the
    innermost (output-contiguous) dim, each tensor's strides those of the three leading dims
    (collapsed where all allow, :func:`constraints.leading_dims`) then of the innermost; or the
    reason it cannot (more leading dims, offsets past 32 bits)."""
    dims = sorted((i for i in range(len(shape)) if shape[i] != 1), key=lambda i: -out_stride[i]) or [None]
    sizes = [shape[i] if i is not None else 1 for i in dims]
    metas = [torch.empty_strided(sizes, [s[i] if i is not None else 1 for i in dims], device="meta")
             for s in (a_stride, b_stride)]  # fmt: skip
    layout = constraints.leading_dims(*metas)
    if layout is None:
        return f"more than {constraints.LEADING_DIMS} leading dims at independent strides"
    lead, (sa, sb) = layout
    n, col = sizes[-1], [m.stride(-1) for m in metas]
    if n * max(col) >= 2**31:
        return f"{n} columns at stride {max(col)}: offsets past 32 bits"
    return n, lead, [*sa, col[0]], [*sb, col[1]]


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
# No library has a kernel for two operands (sgl-kernel 0.4.6 and flashinfer 0.7.2 take [..., 2d] only).
TRITON_ACT_MUL = "fxrewrite.runtime.triton_act_mul"
ACT_MUL_KERNELS = (providers.triton_kernel("act_mul", _act_mul_triton_check, module=TRITON_ACT_MUL),)

# --------------------------------------------------------------------------- the ops

DEFS: tuple[OpDef, ...] = (
    OpDef("silu_and_mul", silu_and_mul_reference, _silu_and_mul_fake, SILU_AND_MUL_KERNELS),
    OpDef("gelu_and_mul", gelu_and_mul_reference, _gelu_and_mul_fake, GELU_AND_MUL_KERNELS),
    OpDef("act_mul", act_mul_reference, _act_mul_fake, ACT_MUL_KERNELS),
)
OPS: tuple[str, ...] = providers.define_all(DEFS)
