"""FP8 linears written as model code, for any ``nn.Linear``: the engine model's
(``bench/engine_fp8.py``, ``bench/engine_model_fp8.py``) and a transformers model's alike.

- :class:`Fp8Linear`: static per-tensor FP8, as FP8 checkpoints with per-tensor scales are
  served: the weight quantized offline (``amax / 448``), the input with a calibrated static scale
  (``quant_fp8_static``), one ``torch._scaled_mm``.
- :class:`BlockFp8Linear`: block FP8 (DeepSeek-V3's and Qwen3-FP8's format): the weight per
  128 x 128 tile, the input per token and group of 128 (``quant_fp8_block``), the GEMM
  ``fxr.linear_block_fp8`` or the dequantizing reference.
- :class:`Nvfp4Linear`: NVFP4 (Blackwell's FP4 format): the weight per block of 16 along K with
  e4m3 block scales and a float32 global scale, the input quantized with ``quant_nvfp4`` and a
  calibrated global scale; the GEMM a dequantizing reference (FP4 GEMMs need Blackwell).
- :func:`replace_linears`: every ``nn.Linear`` under a module replaced by what ``make`` builds
  from it; :func:`to_fp8_linears` / :func:`to_nvfp4_linears`: the same with :class:`Fp8Linear` /
  :class:`Nvfp4Linear`, input scales calibrated on one call of the model.

Either way the quantization is the model's own code at each linear's input, so the graph holds
``norm -> quant`` and ``silu_and_mul -> quant`` (or, gate and up two GEMMs, ``act_mul -> quant``),
which the rewriter fuses::

    # before                            # after to_fp8_linears (Fp8Linear.forward, inlined)
    h = norm(x)                         h = norm(x)
    y = self.q_proj(h)                  xq = quant_fp8_static(h, input_scale)          # [..., K] e4m3
                                        y = torch._scaled_mm(xq.flatten(0, -2), w_fp8.t(), scale_a=input_scale,
                                                             scale_b=weight_scale, out_dtype=h.dtype).unflatten(0, h.shape[:-1])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fxrewrite.runtime.ops.linear_block_fp8 import dequant_weight_block, quant_weight_block
from fxrewrite.runtime.ops.quant import FP8_DTYPE, FP8_MAX, quant_fp8_static
from fxrewrite.runtime.ops.quant_block import GROUP, dequant_fp8_block, quant_fp8_block
from fxrewrite.runtime.ops.quant_nvfp4 import E2M1_MAX, dequant_nvfp4, quant_nvfp4

__all__ = ["BLOCK", "GEMMS", "BlockFp8Linear", "Fp8Linear", "Nvfp4Linear", "replace_linears", "to_fp8_linears",
           "to_nvfp4_linears"]

BLOCK = GROUP  # weights: 128 x 128 blocks; activations: groups of 128 along the hidden dim
GEMMS = ("fp8", "dequant")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the 2-D matrix a GEMM takes (the engine model's activations are 2-D already)."""
    return x if x.dim() == 2 else x.flatten(0, -2)


def _with_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


class Fp8Linear(nn.Module):
    """A linear with an FP8 weight and per-tensor scales: the input quantized with the static
    ``input_scale``, then ``torch._scaled_mm`` (module docstring); the bias, if any, added after."""

    def __init__(self, weight: torch.Tensor, input_scale: float, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax().clamp(min=1e-12) / FP8_MAX
        self.weight = nn.Parameter((w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(scale.reshape(()), requires_grad=False)
        self.input_scale = nn.Parameter(torch.tensor(input_scale, dtype=torch.float32, device=w.device),
                                        requires_grad=False)  # fmt: skip
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = quant_fp8_static(x, self.input_scale)
        y = torch._scaled_mm(_rows(xq), self.weight.t(), scale_a=self.input_scale, scale_b=self.weight_scale,
                             out_dtype=x.dtype)  # fmt: skip
        return _with_bias(y if x.dim() == 2 else y.unflatten(0, x.shape[:-1]), self.bias)


class BlockFp8Linear(nn.Module):
    """A linear of a block-FP8 checkpoint: the weight in FP8 with per-tile scales, as a checkpoint
    holds them; the input quantized per token and group of 128 in the forward, as model code
    does; the GEMM ``fxr.linear_block_fp8`` (``gemm="fp8"``) or the dequantizing reference
    (``gemm="dequant"``: the weight dequantized once, here). Both dims multiples of 128."""

    def __init__(self, linear: nn.Linear, gemm: str = "fp8") -> None:
        super().__init__()
        assert gemm in GEMMS, f"gemm {gemm!r} is not one of {GEMMS}"
        self.gemm = gemm
        q, s = quant_weight_block(linear.weight.detach())
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_scale", s)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        if gemm == "dequant":
            self.register_buffer("weight", dequant_weight_block(q, s).to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = quant_fp8_block(x, BLOCK)
        if self.gemm == "fp8":
            return _with_bias(torch.ops.fxr.linear_block_fp8(q, s, self.weight_q, self.weight_scale, x.dtype), self.bias)
        return F.linear(dequant_fp8_block(q, s).to(x.dtype), self.weight, self.bias)


@torch.library.custom_op("fxrbench::linear_nvfp4", mutates_args=())
def linear_nvfp4(q: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The dequantizing reference of an NVFP4 GEMM: ``F.linear(dequant_nvfp4(q, scales,
    global_scale, out_dtype), weight, bias)``, ``weight`` dequantized already. One opaque call, as
    an FP4 GEMM kernel is: the graph holds the activation's quantization and this, not a
    dequantization whose ``scales.float()`` canonicalization would share with the quantizer's."""
    return F.linear(dequant_nvfp4(q, scales, global_scale, out_dtype), weight, bias)


@linear_nvfp4.register_fake
def _linear_nvfp4_fake(q: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    return q.new_empty((*q.shape[:-1], weight.shape[0]), dtype=out_dtype)


class Nvfp4Linear(nn.Module):
    """A linear of an NVFP4 checkpoint: the weight quantized offline per block of 16 along K
    (e2m1 values two a byte, e4m3 block scales, a float32 global scale ``448 * 6 / amax``), the
    input quantized in the forward with the global scale ``input_global_scale``, as model code
    does (``quant_nvfp4``, the spec the NVFP4 rules match). The GEMM is a dequantizing reference,
    plainly (:func:`linear_nvfp4`: ``F.linear`` of the dequantized input and the weight dequantized
    once, here, in the input's dtype). NVFP4 GEMMs need Blackwell's FP4 tensor cores; this one exists for numerics
    (the quantization the rewriter fuses) and is not a speed to report. K a multiple of 16."""

    def __init__(self, linear: nn.Linear, input_amax: float) -> None:
        super().__init__()
        w = linear.weight.detach()
        global_scale = (E2M1_MAX * FP8_MAX / w.float().abs().amax().clamp(min=1e-12)).reshape(1)
        q, s = quant_nvfp4(w, global_scale)
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_scale", s)
        self.register_buffer("weight_global_scale", global_scale)
        self.register_buffer("weight", dequant_nvfp4(q, s, global_scale, w.dtype))
        self.input_global_scale = nn.Parameter(
            torch.tensor([E2M1_MAX * FP8_MAX / max(input_amax, 1e-6)], dtype=torch.float32, device=w.device),
            requires_grad=False)  # fmt: skip
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = quant_nvfp4(x, self.input_global_scale)
        return linear_nvfp4(q, s, self.input_global_scale, self.weight, self.bias, x.dtype)


def replace_linears(root: nn.Module, make: Callable[[str, nn.Linear], nn.Module]) -> int:
    """Replace every ``nn.Linear`` under ``root`` (its path relative to ``root``, the linear) by
    ``make(path, linear)``, in place; returns how many."""
    found = [(name, m) for name, m in root.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in found:
        parent, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent), attr, make(name, linear))
    return len(found)


def _calibrated(root: nn.Module, calibrate: Callable[[], object]) -> tuple[dict[str, float], dict[str, list[str]]]:
    """Each linear's input amax while ``calibrate()`` ran (one call of the model), and the linears
    that read the same tensor as it, itself included (q, k and v; gate and up), by path."""
    amax: dict[str, float] = {}
    read: dict[str, torch.Tensor] = {}  # the tensor each linear read last (held: ids stay unique)

    def hook(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def record(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), float(args[0].detach().abs().amax()))
            read[name] = args[0]

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in root.named_modules() if isinstance(m, nn.Linear)]
    try:
        calibrate()
    finally:
        for h in handles:
            h.remove()
    siblings: dict[int, list[str]] = {}
    for name, x in read.items():
        siblings.setdefault(id(x), []).append(name)
    return amax, {name: siblings[id(x)] for name, x in read.items()}


def _to_calibrated(root: nn.Module, calibrate: Callable[[], object], build: Callable[[nn.Linear, float], nn.Module],
                   scale: str, share_siblings: bool) -> int:  # fmt: skip
    """Replace every ``nn.Linear`` under ``root`` by ``build(linear, amax)``, ``amax`` that of its
    input while ``calibrate()`` ran (``share_siblings``: the largest of the linears that read its
    input, which then share the built module's parameter ``scale``: one object)."""
    amax, siblings = _calibrated(root, calibrate)
    shared: dict[str, nn.Parameter] = {}

    def make(name: str, linear: nn.Linear) -> nn.Module:
        if name not in amax:
            raise ValueError(f"linear {name!r} did not run during calibration: no input scale")
        group = siblings[name] if share_siblings else [name]
        module = build(linear, max(amax[n] for n in group))
        if share_siblings:
            setattr(module, scale, shared.setdefault(group[0], getattr(module, scale)))
        return module

    return replace_linears(root, make)


@torch.no_grad()
def to_fp8_linears(root: nn.Module, calibrate: Callable[[], object], headroom: float = 2.0,
                   share_siblings: bool = False) -> int:  # fmt: skip
    """Replace every ``nn.Linear`` under ``root`` by :class:`Fp8Linear`, in place; returns how many.

    Each input scale is ``headroom * amax / 448`` of what the linear read while ``calibrate()``
    ran (one call of the model; a prefill of a few sequences calibrates best), rounded up to a
    power of two: dividing by it is exact, as FP8 recipes choose. ``share_siblings``: linears that
    read one tensor (q, k and v; gate and up) share one input scale parameter, of their largest
    amax, as serving engines load a checkpoint's q/k/v scales for their merged projection."""

    def build(linear: nn.Linear, amax: float) -> Fp8Linear:
        scale = max(headroom * amax, 1e-6) / FP8_MAX
        return Fp8Linear(linear.weight, 2.0 ** math.ceil(math.log2(scale)), linear.bias)

    return _to_calibrated(root, calibrate, build, "input_scale", share_siblings)


@torch.no_grad()
def to_nvfp4_linears(root: nn.Module, calibrate: Callable[[], object], headroom: float = 2.0,
                     share_siblings: bool = False) -> int:  # fmt: skip
    """Replace every ``nn.Linear`` under ``root`` by :class:`Nvfp4Linear`, in place; returns how
    many. Each input's global scale is ``448 * 6 / (headroom * amax)`` of what the linear read
    while ``calibrate()`` ran; ``share_siblings`` as :func:`to_fp8_linears` (one global scale for
    q/k/v and one for gate/up, as NVFP4 checkpoints are served)."""
    return _to_calibrated(root, calibrate, lambda linear, amax: Nvfp4Linear(linear, headroom * amax),
                          "input_global_scale", share_siblings)  # fmt: skip
