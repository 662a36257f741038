"""FP8 (float8_e4m3fn, max 448) quantization fused with RMSNorm, add + RMSNorm and SiLU-and-mul,
and the dynamic per-token quantizer alone.

Two quantizers, each written once: static per-tensor (:func:`quant_fp8_static`, scale given)
and dynamic per-token (:func:`quant_fp8_per_token`, scale computed per row, shape [..., 1]).
Every op is a norm or activation reference followed by one of them, or (``fxr.dynamic_quant_fp8``,
whose reference is :func:`quant_fp8_per_token` itself) the per-token quantizer of any value, one
kernel for the five to seven torch kernels of its unfused code:

    # before                                              # after
    y = rms_norm(x, w, eps)                               q = torch.ops.fxr.rms_norm_quant_fp8(x, w, eps, scale)
    q = (y.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)

CUDA: one Triton kernel per op (``fxrewrite.runtime.triton_kernels``, when Triton imports);
flashinfer's ``rmsnorm_quant`` (static, one kernel); sgl-kernel's ``rmsnorm`` or
``silu_and_mul`` then ``sgl_per_token_quant_fp8`` (dynamic, two kernels); labels with "+torch"
mark where part of the op (the residual add, a static quantization) runs as plain torch.

A kernel may round differently from the spec (e.g. multiply the weight in float32 where the spec
rounds the normed value to bf16 first): it is correct when every FP8 value lies within one e4m3
step of the spec's after dequantization and its per-token scales are within two roundings of
the input dtype (:func:`fp8_mismatch`, what the GPU tests and the benchmark check).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops.activation import (
    check_act_and_mul,
    flashinfer_silu_and_mul,
    silu_and_mul_reference,
    sgl_silu_and_mul,
)
from fxrewrite.runtime.ops.norm import (
    add_then_norm,
    as_rows,
    check_norm,
    check_norm_args,
    fake_sum,
    rms_norm_reference,
    sgl_rms_norm,
)
from fxrewrite.runtime.providers import Kernel, OpDef

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12
FP8_CAPABILITY = (8, 9)  # Ada / Hopper and newer convert to FP8 in hardware
# The smallest per-token scale the spec yields, as float32 computes it: clamp(amax, 1e-12) / 448.
SCALE_FLOOR = float(torch.tensor(AMAX_FLOOR, dtype=torch.float32) / FP8_MAX)


# --------------------------------------------------------------------------- quantizers (the spec)


def quant_fp8_static(y: Tensor, scale: Tensor) -> Tensor:
    """Static per-tensor: ``(y.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``."""
    return (y.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quant_fp8_per_token(y: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per token (last dim), returns ``(q, s)`` with ``s`` of shape [..., 1] float32:

    ``y = y.float(); s = y.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0;
    q = (y / s).clamp(-448, 448).to(torch.float8_e4m3fn)``
    """
    y = y.float()
    s = y.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    return (y / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


# --------------------------------------------------------------------------- what a kernel may differ by


def _fp8_neighbours(q: Tensor) -> tuple[Tensor, Tensor]:
    """The e4m3 values one step below and one above each element of ``q`` (float32; +-448
    saturate). e4m3fn bytes are sign | magnitude with magnitudes ordered as their values, so
    stepping is +-1 on the signed magnitude (+0 and -0 are one point)."""
    byte = q.view(torch.uint8).to(torch.int16)
    signed = torch.where(byte >= 128, 128 - byte, byte)
    top = int(torch.tensor(FP8_MAX, dtype=FP8_DTYPE).view(torch.uint8))  # 0x7E: 0x7F is NaN

    def value(m: Tensor) -> Tensor:
        m = m.clamp(-top, top)
        return torch.where(m < 0, 128 - m, m).to(torch.uint8).view(FP8_DTYPE).float()

    return value(signed - 1), value(signed + 1)


def fp8_scale_rtol(dtype: torch.dtype) -> float:
    """How far a kernel's per-token scale may be from the spec's, relatively: the amax of values
    one rounding of ``dtype`` apart, i.e. one ``eps`` step, twice for float32 slack."""
    return 2 * torch.finfo(dtype).eps


def fp8_mismatch(
    q: Tensor, q_ref: Tensor, s: Tensor | None = None, s_ref: Tensor | None = None, *, scale_rtol: float = 0.0,
    q_exact: Tensor | None = None,
) -> str | None:
    """None when ``q`` (FP8) is as good as the spec's ``q_ref``, else what differs: every scale
    ``s`` within ``scale_rtol`` of ``s_ref`` (per-token [..., 1]; None for a static scale, the
    same for both), and every value ``q * s`` within one e4m3 step of ``q_ref`` in the
    reference's grid: between its neighbours times ``s_ref``, widened by ``scale_rtol``. Scales
    of a group of columns each (``[..., H / G]``, block FP8) apply to their group.

    ``q_exact`` (a static scale only): the exact result quantized, e.g. the spec run in float64.
    A value off the spec's passes when it is within one step of that: where a sum the spec rounds
    cancels (a gate near zero), the spec's own value may be steps from the exact one."""
    if s is None or s_ref is None:
        s = s_ref = torch.ones((), device=q.device)
    else:
        if s.shape[-1] not in (1, q.shape[-1]):  # one scale per group of columns (block FP8)
            s, s_ref = (t.repeat_interleave(q.shape[-1] // t.shape[-1], -1) for t in (s, s_ref))
        rel = (s - s_ref).abs() / s_ref
        if not bool((rel <= scale_rtol).all()):
            n = int((~(rel <= scale_rtol)).sum())
            return f"{n} of {rel.numel()} scales off by more than {scale_rtol:.2g} (max {float(rel.max()):.3g})"
    got, want = q.float() * s, q_ref.float() * s_ref
    below, above = _fp8_neighbours(q_ref)
    slack = got.abs() * scale_rtol
    bad = ~((got >= below * s_ref - slack) & (got <= above * s_ref + slack))  # NaN is bad
    if q_exact is not None and bool(bad.any()):
        if s is not s_ref or q_exact.shape != q.shape or q_exact.dtype != FP8_DTYPE:
            raise ValueError("q_exact: an FP8 tensor of q's shape, with a static scale")
        below, above = _fp8_neighbours(q_exact)
        bad &= ~((got >= below) & (got <= above))
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0])
        worst = f"{float(got.flatten()[i]):.4g} where the spec has {float(want.flatten()[i]):.4g}"
        return f"{int(bad.sum())} of {bad.numel()} FP8 values more than one e4m3 step off (first: {worst})"
    return None


def _scales_of(s: Tensor, q: Tensor) -> bool:
    """Whether ``s`` has the shape of ``q``'s per-token or per-group scales: ``q``'s leading
    dims and a last dim that divides ``q``'s and is smaller (a float32 value of ``q``'s own
    shape, such as the updated residual of an add + norm, is not)."""
    return (s.dim() == q.dim() and s.shape[:-1] == q.shape[:-1] and 0 < s.shape[-1] < q.shape[-1]
            and q.shape[-1] % s.shape[-1] == 0)  # fmt: skip


def quantized_output_mismatches(
    got: Sequence[Tensor], want: Sequence[Tensor], scale_rtol: float,
    exact: Callable[[int], Any] | None = None,
) -> tuple[list[str], list[int]]:
    """The quantized outputs of an op judged as quantizations, not as numbers: an FP8 output
    (followed by its per-token or per-group float32 scales, if any) by :func:`fp8_mismatch`, an
    NVFP4 pair (packed uint8 values, then e4m3 scales of a sixteenth of their count, twice as
    many bytes apart) by :func:`quant_nvfp4.nvfp4_mismatch`, both in ``got`` and ``want`` of one
    dtype and shape. ``exact(i)``: output i of the spec run exactly (float64), asked for only
    where a statically scaled FP8 output is off the spec's (``fp8_mismatch``'s ``q_exact``).
    Returns (what differs, indices of the outputs left to the caller)."""
    from fxrewrite.runtime.ops.quant_nvfp4 import BLOCK, SCALE_DTYPE, nvfp4_mismatch

    def alike(j: int, dtype: torch.dtype) -> bool:
        return j < len(got) and got[j].dtype == want[j].dtype == dtype and got[j].shape == want[j].shape

    problems, rest, i = [], [], 0
    while i < len(got):
        if alike(i, torch.uint8) and alike(i + 1, SCALE_DTYPE) and got[i].shape[-1] * 2 == got[i + 1].shape[-1] * BLOCK:
            # the shared global scale cancels from every comparison: judged with 1
            problem = nvfp4_mismatch((got[i], got[i + 1]), (want[i], want[i + 1]), torch.ones((), device=got[i].device))
            problems += [f"out{i}: {problem}"] if problem else []
            i += 2
            continue
        if not alike(i, FP8_DTYPE):
            rest.append(i)
            i += 1
            continue
        dynamic = alike(i + 1, torch.float32) and _scales_of(got[i + 1], got[i])
        scales = (got[i + 1], want[i + 1]) if dynamic else (None, None)
        problem = fp8_mismatch(got[i], want[i], *scales, scale_rtol=scale_rtol)
        if problem and not dynamic and exact is not None:
            q_exact = exact(i)
            if isinstance(q_exact, Tensor) and q_exact.dtype == FP8_DTYPE and q_exact.shape == got[i].shape:
                problem = fp8_mismatch(got[i], want[i], scale_rtol=scale_rtol, q_exact=q_exact.to(got[i].device))
        problems += [f"out{i}: {problem}"] if problem else []
        i += 2 if dynamic else 1
    return problems, rest


# --------------------------------------------------------------------------- references (the spec)


def rms_norm_quant_fp8_reference(x: Tensor, weight: Tensor, eps: float, scale: Tensor, cast_last: bool = False) -> Tensor:
    """``quant_fp8_static(rms_norm_reference(x, weight, eps, cast_last), scale)``, i.e.
    ``(rms_norm(x, w, eps).float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``
    (``cast_last``: the norm's weight applied in float32, rounded once, as ``torch.rms_norm``)."""
    return quant_fp8_static(rms_norm_reference(x, weight, eps, cast_last), scale)


def rms_norm_dynamic_quant_fp8_reference(
    x: Tensor, weight: Tensor, eps: float, cast_last: bool = False
) -> tuple[Tensor, Tensor]:
    """``(q, s) = quant_fp8_per_token(rms_norm_reference(x, weight, eps, cast_last))``."""
    return quant_fp8_per_token(rms_norm_reference(x, weight, eps, cast_last))


def fused_add_rms_norm_quant_fp8_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor, cast_last: bool = False
) -> tuple[Tensor, Tensor]:
    """Returns ``(q, sum)``: ``sum = x + residual; q = rms_norm_quant_fp8_reference(sum, weight, eps, scale, cast_last)``."""
    norm = functools.partial(rms_norm_quant_fp8_reference, scale=scale, cast_last=cast_last)
    return add_then_norm(norm, x, residual, weight, eps)


def fused_add_rms_norm_dynamic_quant_fp8_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, cast_last: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(q, s, sum)``: ``sum = x + residual;
    q, s = rms_norm_dynamic_quant_fp8_reference(sum, weight, eps, cast_last)``."""
    (q, s), total = add_then_norm(rms_norm_dynamic_quant_fp8_reference, x, residual, weight, eps, cast_last)
    return q, s, total


def silu_and_mul_quant_fp8_reference(x: Tensor, scale: Tensor) -> Tensor:
    """``quant_fp8_static(silu_and_mul_reference(x), scale)``: [..., 2d] -> fp8 [..., d]."""
    return quant_fp8_static(silu_and_mul_reference(x), scale)


def silu_and_mul_dynamic_quant_fp8_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(q, s) = quant_fp8_per_token(silu_and_mul_reference(x))``: [..., 2d] -> fp8 [..., d], [..., 1]."""
    return quant_fp8_per_token(silu_and_mul_reference(x))


# --------------------------------------------------------------------------- fake impls


def _q(x: Tensor, shape: torch.Size | tuple[int, ...] | None = None) -> Tensor:
    return x.new_empty(x.shape if shape is None else shape, dtype=FP8_DTYPE)


def _s(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def _rms_norm_quant_fake(x: Tensor, weight: Tensor, eps: float, scale: Tensor, cast_last: bool = False) -> Tensor:
    return _q(x)


def _rms_norm_dynamic_quant_fake(x: Tensor, weight: Tensor, eps: float, cast_last: bool = False) -> tuple[Tensor, Tensor]:
    return _q(x), _s(x)


def _fused_add_quant_fake(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor, cast_last: bool = False
) -> tuple[Tensor, Tensor]:
    total = fake_sum(x, residual)
    return _q(total), total


def _fused_add_dynamic_quant_fake(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, cast_last: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    total = fake_sum(x, residual)
    return _q(total), _s(total), total


def _half_shape(x: Tensor) -> tuple[int, ...]:
    return (*x.shape[:-1], x.shape[-1] // 2)


def _silu_quant_fake(x: Tensor, scale: Tensor) -> Tensor:
    return _q(x, _half_shape(x))


def _silu_dynamic_quant_fake(x: Tensor) -> tuple[Tensor, Tensor]:
    q = _q(x, _half_shape(x))
    return q, _s(q)


def _dynamic_quant_fake(y: Tensor) -> tuple[Tensor, Tensor]:
    return _q(y), _s(y)


# --------------------------------------------------------------------------- kernel constraints


def check_scale(x: Tensor, scale: Tensor) -> str | None:
    """A static scale the kernels read in place: one float32 element on the input's device."""
    if scale.numel() != 1 or scale.dtype != torch.float32:
        return f"scale {tuple(scale.shape)} {scale.dtype} is not one float32"
    return constraints.check_same_device(x, scale)


def _hidden_multiple_of_4(d: int) -> str | None:
    return None if d % 4 == 0 else f"hidden {d} not a multiple of 4 (sgl_per_token_quant_fp8)"


# The libraries' norms scale in float32 and round once (``cast_last``) or not at all before the
# quantization (flashinfer's ``rmsnorm_quant``): either order is within fp8_mismatch's step of the spec.
def _static_check(x: Tensor, weight: Tensor, eps: float, scale: Tensor, cast_last: bool = False) -> str | None:
    return check_norm(x, weight) or check_scale(x, scale)


def _fused_add_static_check(x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor,
                            cast_last: bool = False) -> str | None:  # fmt: skip
    return check_norm_args(x, weight, residual) or check_scale(x, scale)


def _dynamic_check(x: Tensor, weight: Tensor, eps: float, cast_last: bool = False) -> str | None:
    return check_norm(x, weight, contiguous=True) or _hidden_multiple_of_4(x.shape[-1])


def _fused_add_dynamic_check(x: Tensor, residual: Tensor, weight: Tensor, eps: float, cast_last: bool = False) -> str | None:
    return check_norm_args(x, weight, residual) or _hidden_multiple_of_4(x.shape[-1])


def _silu_static_check(half_aligned: bool, x: Tensor, scale: Tensor) -> str | None:
    return check_act_and_mul(x, half_aligned=half_aligned) or check_scale(x, scale)


def _silu_dynamic_check(x: Tensor) -> str | None:
    return check_act_and_mul(x, half_aligned=True) or _hidden_multiple_of_4(x.shape[-1] // 2)


# The Triton kernels read rows at any stride and alignment (Triton specializes on both); they need
# what :func:`check_norm` / :func:`check_act_and_mul` ask of every provider, and a row that fits
# one program where the kernel reduces over it (the norms; dynamic SiLU-and-mul).
TRITON_MAX_ROW = constraints.TRITON_MAX_ROW
_fits_one_program = constraints.check_triton_row


def _triton_rows_check(x: Tensor, weight: Tensor, others: tuple[Tensor, ...], scale: Tensor | None) -> str | None:
    reason = check_norm(x, weight, *others) or _fits_one_program(x.shape[-1])
    return reason or (check_scale(x, scale) if scale is not None else None)


def _triton_static_check(x: Tensor, weight: Tensor, eps: float, scale: Tensor, cast_last: bool = False) -> str | None:
    return _triton_rows_check(x, weight, (), scale)


def _triton_dynamic_check(x: Tensor, weight: Tensor, eps: float, cast_last: bool = False) -> str | None:
    return _triton_rows_check(x, weight, (), None)


def _triton_fused_add_static_check(x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor,
                                   cast_last: bool = False) -> str | None:  # fmt: skip
    return _triton_rows_check(x, weight, (residual,), scale)


def _triton_fused_add_dynamic_check(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                    cast_last: bool = False) -> str | None:  # fmt: skip
    return _triton_rows_check(x, weight, (residual,), None)


def _triton_silu_check(x: Tensor, scale: Tensor | None = None) -> str | None:
    reason = check_act_and_mul(x, half_aligned=False)
    return reason or (check_scale(x, scale) if scale is not None else _fits_one_program(x.shape[-1] // 2))


def _triton_dynamic_quant_check(y: Tensor) -> str | None:
    """The quantizer alone: any float of 16 or 32 bits, rows at one stride, a row in one program."""
    return constraints.check_rows_at_one_stride(y) or _fits_one_program(y.shape[-1])


# --------------------------------------------------------------------------- kernels

P = functools.partial


def sgl_per_token_quant(y: Tensor) -> tuple[Tensor, Tensor]:
    """sgl-kernel ``sgl_per_token_quant_fp8`` on contiguous ``y``: ``s = amax / 448``, ``q = y * (1 / s)``
    (not finite for an all-zero row, so those rows are zeroed); ``s`` is then raised to the spec's floor (``1e-12 / 448``, in place on
    [rows, 1] floats), so a zero row gives ``q = 0``, ``s = floor`` as the reference does."""
    rows = as_rows(y)
    assert rows is not None
    q = torch.empty(rows.shape, dtype=FP8_DTYPE, device=y.device)
    s = torch.empty((rows.shape[0], 1), dtype=torch.float32, device=y.device)
    torch.ops.sgl_kernel.sgl_per_token_quant_fp8.default(rows, q, s)
    # an all-zero row: the kernel divides by a zero scale (seen on H100); fp8 has no masked_fill,
    # its bytes do (0x00 is +0.0 in e4m3)
    q.view(torch.uint8).masked_fill_(s == 0, 0)
    s.clamp_(min=SCALE_FLOOR)
    return q.view(y.shape), s.view(*y.shape[:-1], 1)


def _flashinfer_rms_norm_quant(x: Tensor, weight: Tensor, eps: float, scale: Tensor, cast_last: bool = False) -> Tensor:
    rows = as_rows(x)
    assert rows is not None
    out = torch.empty(rows.shape, dtype=FP8_DTYPE, device=x.device)
    fn = providers.library("flashinfer.norm").rmsnorm_quant  # type: ignore[union-attr]
    fn(out, rows, weight, scale, eps, enable_pdl=providers.enable_pdl(x.device))
    return out.view(x.shape)


def _sgl_rms_norm_dynamic_quant(x: Tensor, weight: Tensor, eps: float, cast_last: bool = False) -> tuple[Tensor, Tensor]:
    return sgl_per_token_quant(sgl_rms_norm(x, weight, eps))


def _fused_add_static(x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor,
                      cast_last: bool = False) -> tuple[Tensor, Tensor]:  # fmt: skip
    return add_then_norm(functools.partial(_flashinfer_rms_norm_quant, scale=scale), x, residual, weight, eps)


def _fused_add_dynamic(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                       cast_last: bool = False) -> tuple[Tensor, ...]:  # fmt: skip
    (q, s), total = add_then_norm(_sgl_rms_norm_dynamic_quant, x, residual, weight, eps)
    return q, s, total


def _silu_static(silu: functools.partial[Tensor], x: Tensor, scale: Tensor) -> Tensor:
    return quant_fp8_static(silu(x), scale)


def _sgl_silu_dynamic(x: Tensor) -> tuple[Tensor, Tensor]:
    return sgl_per_token_quant(sgl_silu_and_mul(x))


def _triton_kernel(op: str, check: Callable[..., str | None]) -> Kernel:
    return providers.triton_kernel(op, check, FP8_CAPABILITY)


FP8 = FP8_CAPABILITY
_FI = "flashinfer.norm"

# --------------------------------------------------------------------------- the ops

# Each op's kernels in order of preference (bench/bench_ops.py times them side by side): a
# single Triton kernel before the libraries' two; flashinfer's one kernel before Triton's.
DEFS: tuple[OpDef, ...] = (
    OpDef(
        "rms_norm_quant_fp8",
        rms_norm_quant_fp8_reference,
        _rms_norm_quant_fake,
        (
            Kernel("flashinfer", _flashinfer_rms_norm_quant, _static_check, FP8, module=_FI),
            _triton_kernel("rms_norm_quant_fp8", _triton_static_check),
        ),
    ),
    OpDef(
        "rms_norm_dynamic_quant_fp8",
        rms_norm_dynamic_quant_fp8_reference,
        _rms_norm_dynamic_quant_fake,
        (
            _triton_kernel("rms_norm_dynamic_quant_fp8", _triton_dynamic_check),
            Kernel("sgl_kernel", _sgl_rms_norm_dynamic_quant, _dynamic_check, FP8),
        ),
    ),
    OpDef(
        "fused_add_rms_norm_quant_fp8",
        fused_add_rms_norm_quant_fp8_reference,
        _fused_add_quant_fake,
        (
            _triton_kernel("fused_add_rms_norm_quant_fp8", _triton_fused_add_static_check),
            Kernel("flashinfer", _fused_add_static, _fused_add_static_check, FP8, "flashinfer+torch", _FI),
        ),
    ),
    OpDef(
        "fused_add_rms_norm_dynamic_quant_fp8",
        fused_add_rms_norm_dynamic_quant_fp8_reference,
        _fused_add_dynamic_quant_fake,
        (
            _triton_kernel("fused_add_rms_norm_dynamic_quant_fp8", _triton_fused_add_dynamic_check),
            Kernel("sgl_kernel", _fused_add_dynamic, _fused_add_dynamic_check, FP8, "sgl_kernel+torch"),
        ),
    ),
    OpDef(
        "silu_and_mul_quant_fp8",
        silu_and_mul_quant_fp8_reference,
        _silu_quant_fake,
        (
            _triton_kernel("silu_and_mul_quant_fp8", _triton_silu_check),
            Kernel(
                "sgl_kernel",
                P(_silu_static, sgl_silu_and_mul),
                P(_silu_static_check, True),
                label="sgl_kernel+torch",
            ),
            Kernel(
                "flashinfer",
                P(_silu_static, flashinfer_silu_and_mul),
                P(_silu_static_check, False),
                label="flashinfer+torch",
                module="flashinfer.activation",
            ),
        ),
    ),
    OpDef(
        "silu_and_mul_dynamic_quant_fp8",
        silu_and_mul_dynamic_quant_fp8_reference,
        _silu_dynamic_quant_fake,
        (
            _triton_kernel("silu_and_mul_dynamic_quant_fp8", _triton_silu_check),
            Kernel("sgl_kernel", _sgl_silu_dynamic, _silu_dynamic_check, FP8),
        ),
    ),
    # the per-token quantizer of a value no norm or activation produced (an attention output)
    OpDef(
        "dynamic_quant_fp8",
        quant_fp8_per_token,
        _dynamic_quant_fake,
        (_triton_kernel("dynamic_quant_fp8", _triton_dynamic_quant_check),),
    ),
)
OPS: tuple[str, ...] = providers.define_all(DEFS)
