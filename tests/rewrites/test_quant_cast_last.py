"""RMSNorm in torch.rms_norm's order (the weight applied in float32, one rounding: ``cast_last``)
followed by each quantizer: static per-tensor FP8, dynamic per-token FP8, block FP8, NVFP4
(rewrites/quant.py, quant_block.py, quant_nvfp4.py: the cast-last twins of the norm + quant rules).

The norm is spelled by hand, ``(w * normed(x)).to(x.dtype)`` (OLMo2, gpt-oss), and as the library
call, ``torch.nn.RMSNorm`` / ``F.rms_norm`` (canonicalized into that arithmetic). Each fuses into
the quant op with ``cast_last=True``; FP8 bytes, scales and NVFP4 codes equal eager bit for bit
(``exact=True``). Negative twins: the round-then-scale (Llama) order stays ``cast_last=False``;
a float64 weight (the product would not run in float32) and a cast to another dtype are refused
by the guard, and only the normed value fuses, weightless, in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, DYNAMIC, F32, check, fused_nodes, quant_per_token, quant_static, reasons, sites

from fxrewrite.runtime.ops.quant_block import quant_fp8_block
from fxrewrite.runtime.ops.quant_nvfp4 import quant_nvfp4

HIDDEN = 256


def cast_last_norm(h: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    f = h.to(torch.float32)
    return (w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps))).to(h.dtype)


def library_norm(h: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(h, (HIDDEN,), w, eps)


def llama_norm(h: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    f = h.to(torch.float32)
    return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


NORMS: dict[str, Callable[..., torch.Tensor]] = {"by-hand": cast_last_norm, "torch.rms_norm": library_norm}
SCALE, GLOBAL_SCALE = torch.tensor(0.02), torch.tensor(300.0)
QUANTS: dict[str, Callable[[torch.Tensor], Any]] = {
    "static": lambda y: quant_static(y, SCALE),
    "per-token": quant_per_token,
    "block": quant_fp8_block,
    "nvfp4": lambda y: quant_nvfp4(y, GLOBAL_SCALE),
}
# a quantizer left alone (its norm refused): the op it fuses into by itself (static: none, a plain chain)
ALONE = {"static": None, "per-token": "dynamic_quant_fp8", "block": "block_quant_fp8", "nvfp4": "quant_nvfp4"}
# quantizer: (norm op, add + norm op, rule of the norm, rule of the add + norm)
FUSED = {
    "static": ("rms_norm_quant_fp8", "fused_add_rms_norm_quant_fp8", "rms_norm_cast_last_quant_fp8",
               "add_rms_norm_cast_last_quant_fp8"),
    "per-token": ("rms_norm_dynamic_quant_fp8", "fused_add_rms_norm_dynamic_quant_fp8",
                  "rms_norm_cast_last_dynamic_quant_fp8", "add_rms_norm_cast_last_dynamic_quant_fp8"),
    "block": ("rms_norm_block_quant_fp8", "fused_add_rms_norm_block_quant_fp8", "rms_norm_cast_last_block_quant_fp8",
              "add_rms_norm_cast_last_block_quant_fp8"),
    "nvfp4": ("rms_norm_quant_nvfp4", "fused_add_rms_norm_quant_nvfp4", "rms_norm_cast_last_quant_nvfp4",
              "add_rms_norm_cast_last_quant_nvfp4"),
}  # fmt: skip


def as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


class NormQuant(torch.nn.Module):
    """A norm (``add``: after a residual add, the sum returned too), then the quantizer."""

    def __init__(self, quant: str, norm: Callable[..., torch.Tensor] = cast_last_norm, add: bool = False) -> None:
        super().__init__()
        self.quant, self.norm, self.add = QUANTS[quant], norm, add
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        if not self.add:
            return self.quant(self.norm(a, self.weight))
        s = a * 2 + b
        return (*as_tuple(self.quant(self.norm(s, self.weight))), s)


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(6, HIDDEN) * torch.logspace(-2, 1, 6).unsqueeze(-1)
    a[2] = 0
    return a.to(dtype), torch.randn(6, HIDDEN).to(dtype)


def cast_last_of(r: Any, op: str) -> bool:
    (node,) = fused_nodes(r, op)
    return node.args[-1] is True


@DYNAMIC
@pytest.mark.parametrize("add", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("quant", list(FUSED))
def test_cast_last_norm_then_quant_fuses(quant: str, norm: str, add: bool, dynamic: bool | str) -> None:
    """bf16: the fused op with ``cast_last=True``, bytes equal to eager's."""
    op, add_op, rule, add_rule = FUSED[quant]
    model = NormQuant(quant, NORMS[norm], add).to(BF16)
    r = check(model, *inputs(BF16), expect={add_op if add else op: 1}, dynamic=dynamic, exact=True)
    assert [s.rule for s in sites(r)] == [add_rule if add else rule]
    assert cast_last_of(r, add_op if add else op)


@pytest.mark.parametrize("add", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("quant", list(FUSED))
def test_in_float32_the_two_orders_are_one_and_the_first_rule_takes_it(quant: str, add: bool) -> None:
    """float32: no rounding between weight and norm, so the round-then-scale rule (first) fuses it."""
    op, add_op = FUSED[quant][:2]
    r = check(NormQuant(quant, library_norm, add), *inputs(F32), expect={add_op if add else op: 1}, exact=True)
    assert not cast_last_of(r, add_op if add else op)


# -- negative twins -----------------------------------------------------------------------------


@pytest.mark.parametrize("quant", list(FUSED))
def test_the_llama_order_stays_round_then_scale(quant: str) -> None:
    """The weight after the rounding: the op without ``cast_last`` (its own rule), never the twin."""
    op = FUSED[quant][0]
    r = check(NormQuant(quant, llama_norm).to(BF16), *inputs(BF16), expect={op: 1}, exact=True)
    assert not cast_last_of(r, op) and "cast_last" not in sites(r)[0].rule


@pytest.mark.parametrize("quant", list(FUSED))
def test_a_float64_weight_is_refused_by_the_guard(quant: str) -> None:
    """``(w64 * normed).to(bf16)`` runs the product in float64: no op computes that; the quant
    rule refuses it with the reason, and only the normed value fuses (weightless, in float32),
    and the quantizer alone (but the static one, a plain elementwise chain)."""
    model = NormQuant(quant).to(BF16)
    model.weight.data = model.weight.data.double()
    alone = [ALONE[quant]] if ALONE[quant] else []
    r = check(model, *inputs(BF16), expect={"rms_norm": 1, **dict.fromkeys(alone, 1)}, exact=True)
    why = "guard: weight dtype torch.float64: the product would not run in float32"
    assert reasons(r, FUSED[quant][2]) == [why]
    assert [s.rule for s in sites(r)] == ["rms_norm_float32", *alone]


@pytest.mark.parametrize("quant", list(FUSED))
def test_a_cast_to_another_dtype_is_refused_by_the_guard(quant: str) -> None:
    """A bf16 input normed into float16 before the quantizer: not the op's rounding."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> Any:
        f = x.float()
        return QUANTS[quant]((w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6))).to(torch.float16))

    x, w = inputs(BF16)[0], (1 + 0.1 * torch.randn(HIDDEN)).to(BF16)
    alone = [ALONE[quant]] if ALONE[quant] else []
    r = check(fn, x, w, expect={"rms_norm": 1, **dict.fromkeys(alone, 1)}, exact=True)
    assert reasons(r, FUSED[quant][2]) == ["guard: casts back to torch.float16, input is torch.bfloat16"]
    assert [s.rule for s in sites(r)] == ["rms_norm_float32", *alone]  # the normed value in float32, the quantizer
