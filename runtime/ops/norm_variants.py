"""Norm variants: ``fxr::l2_norm`` (a row divided by its L2 norm) and ``fxr::rms_norm_gated``
(RMSNorm and a gate: the linear-attention and Mamba2 output norms).

Each ``*_reference`` below is the op's spec and its CPU impl; the rules that produce these ops
(``rewrites/norm_variants.py``) match exactly the code it spells. On CUDA our Triton kernels
serve them (rows at any strides, any float dtype). No library kernel computes these: flashinfer
0.7.2's ``fused_rmsnorm_silu`` is ``silu(rmsnorm(x))`` (no gate), its ``rmsnorm_sigmoid_gate``
has no weight and takes head dim 64 on sm100 only, ``gated_residual_rmsnorm`` is
``alpha * residual + beta * rmsnorm(branch)``.

    # before (Qwen3-Next's RMSNormGated)             # after
    h = x.to(torch.float32)                          y = torch.ops.fxr.rms_norm_gated(x, z, w, eps)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = w * h.to(x.dtype)
    y = (h * F.silu(z.to(torch.float32))).to(x.dtype)

    # before (Mamba2's gated norm over groups)       # after
    h = x.float() * F.silu(z.float())                y = torch.ops.fxr.rms_norm_gated(x, z, w, eps, G, True)
    g = h.view(*lead, n // G, G)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    y = w * g.view(*lead, n).to(x.dtype)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops.norm import triton_weight_check
from fxrewrite.runtime.providers import OpDef

TRITON_NORMS = "fxrewrite.runtime.triton_norms"
ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}

# --------------------------------------------------------------------------- references (the spec)


def l2_norm_reference(x: Tensor, eps: float) -> Tensor:
    """``x`` over the L2 norm of its last dim, in float32, rounded once; dtype ``x.dtype``.

    ``h = x.float(); return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)``
    """
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_gated_reference(
    x: Tensor, gate: Tensor, weight: Tensor, eps: float, group_size: int | None = None, gate_first: bool = False,
    activation: str = "silu", cast_last: bool = False,
) -> Tensor:  # fmt: skip
    """RMSNorm of ``x`` with a gate ``act(gate.float())`` (``activation``: "silu" or "sigmoid").

    ``h = x.float(); a = act(gate.float())``; with ``gate_first``: ``h = h * a``. Then the norm
    over groups of ``group_size`` of the last dim (None: the whole last dim): ``h`` viewed as
    ``[..., n / G, G]``, ``h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)``, viewed back.
    The weight, in the order of :func:`~fxrewrite.runtime.ops.norm.rms_norm_reference`:
    ``y = weight * h.to(x.dtype)`` (dtype ``promote(weight, x)``), or ``y = weight * h``
    (``cast_last``: float32). Without ``gate_first``: ``return (y * a).to(x.dtype)`` (the gate
    in float32, rounded once); with it ``return y`` (``.to(x.dtype)`` under ``cast_last``).
    """
    n = x.shape[-1]
    size = n if group_size is None else group_size
    if size <= 0 or n % size:
        raise ValueError(f"group size {group_size} does not divide the last dim {n}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
    h = x.float()
    a = ACTIVATIONS[activation](gate.float())
    if gate_first:
        h = h * a
    groups = h if size == n else h.reshape(*h.shape[:-1], n // size, size)
    h = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).reshape(h.shape)
    y = weight * h if cast_last else weight * h.to(x.dtype)
    if not gate_first:
        return (y * a).to(x.dtype)
    return y.to(x.dtype) if cast_last else y


# --------------------------------------------------------------------------- fake impls


def _l2_norm_fake(x: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape)


def _rms_norm_gated_fake(
    x: Tensor, gate: Tensor, weight: Tensor, eps: float, group_size: int | None = None, gate_first: bool = False,
    activation: str = "silu", cast_last: bool = False,
) -> Tensor:  # fmt: skip
    if gate_first and not cast_last:
        return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    return x.new_empty(x.shape)


# --------------------------------------------------------------------------- kernel constraints


def _l2_check(x: Tensor, eps: float) -> str | None:
    return constraints.check_strided_rows(x)


def _gated_check(
    x: Tensor, gate: Tensor, weight: Tensor, eps: float, group_size: int | None = None, gate_first: bool = False,
    activation: str = "silu", cast_last: bool = False,
) -> str | None:  # fmt: skip
    """The Triton kernel: x and gate rows at any strides (equal shapes), a weight it can load,
    an activation it computes, groups that divide the row (each held by one program)."""
    if activation not in ACTIVATIONS:
        return f"activation {activation!r}"
    if reason := constraints.check_strided_rows(x, gate) or triton_weight_check(x, weight):
        return reason
    size = x.shape[-1] if group_size is None else group_size
    if size <= 0 or x.shape[-1] % size:
        return f"group size {group_size} does not divide the last dim {x.shape[-1]}"
    return None


# --------------------------------------------------------------------------- the ops


# l2_norm is the RMSNorm row kernel summing instead of averaging (runtime/triton_kernels.py); the
# gated norm has a kernel of its own (runtime/triton_norms.py).
DEFS: tuple[OpDef, ...] = (
    OpDef("l2_norm", l2_norm_reference, _l2_norm_fake, (providers.triton_kernel("l2_norm", _l2_check),)),
    OpDef("rms_norm_gated", rms_norm_gated_reference, _rms_norm_gated_fake,
          (providers.triton_kernel("rms_norm_gated", _gated_check, module=TRITON_NORMS),)),
)  # fmt: skip
OPS: tuple[str, ...] = providers.define_all(DEFS)
