"""Quantization of ``fxr.act_mul`` (rewrites/quant_act_mul.py): gate and up from two linears,
``act(gate) * up`` (or ``up * act(gate)``) quantized to static / per-token / block FP8 or NVFP4,
fused into one ``fxr.act_mul_*quant*`` op.

The quantizers are spelled inline (``helpers.rewrites``) and by the runtime's own functions
(whose 448 Dynamo lifts under ``dynamic="lifted"``). The fused ops' references are the unfused
formulas, so values and scales equal eager bit for bit (``exact=True``), float32 and bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, DYNAMIC, F32, check, quant_per_token, quant_static, reasons, sites

from fxrewrite.runtime.ops.quant import quant_fp8_per_token, quant_fp8_static
from fxrewrite.runtime.ops.quant_block import quant_fp8_block
from fxrewrite.runtime.ops.quant_nvfp4 import quant_e2m1_blocks, quant_nvfp4

HIDDEN = 64
SCALE, GLOBAL = torch.tensor(0.02), torch.tensor([150.0])
# name: (quantizer of y, fused op)
QUANTS: dict[str, tuple[Callable[[torch.Tensor], Any], str]] = {
    "static": (lambda y: quant_static(y, SCALE), "act_mul_quant_fp8"),
    "static-runtime": (lambda y: quant_fp8_static(y, SCALE), "act_mul_quant_fp8"),
    "per-token": (quant_per_token, "act_mul_dynamic_quant_fp8"),
    "per-token-runtime": (quant_fp8_per_token, "act_mul_dynamic_quant_fp8"),
    "block": (lambda y: quant_fp8_block(y, 32), "act_mul_block_quant_fp8"),
    "nvfp4": (lambda y: quant_nvfp4(y, GLOBAL), "act_mul_quant_nvfp4"),
}
ACTS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    # activation as model code calls it: (function, the act_mul rule that forms it)
    "silu": (F.silu, "silu_mul"),
    "gelu": (F.gelu, "gelu_mul"),
    "gelu_tanh": (lambda g: F.gelu(g, approximate="tanh"), "gelu_tanh_mul"),
}


class TwoLinearMlp(torch.nn.Module):
    """Gate and up from two linears (as two FP8 GEMMs with their own weight scales compute them),
    the product quantized; ``up_first``: ``up * act(gate)``."""

    def __init__(self, quant: str, act: str = "silu", up_first: bool = False) -> None:
        super().__init__()
        self.quantize, self.act, self.up_first = QUANTS[quant][0], ACTS[act][0], up_first
        self.gate_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> Any:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.quantize(up * self.act(gate) if self.up_first else self.act(gate) * up)


# the two linears stay two GEMMs (merge_siblings would make them one, and its halves silu_and_mul:
# rewrites/quant.py's case), as two FP8 GEMMs with a weight scale each stay
TWO_GEMMS = {"merge_siblings": False}


def inputs(dtype: torch.dtype) -> torch.Tensor:
    # rows from small to large: per-token and block scales differ, the static scale saturates some
    return (torch.randn(6, HIDDEN) * torch.logspace(-1, 1.5, 6).unsqueeze(-1)).to(dtype)


@pytest.mark.parametrize("up_first", [False, True], ids=["act-first", "up-first"])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_act_mul_quantization_fuses(dtype: torch.dtype, quant: str, act: str, up_first: bool) -> None:
    op = QUANTS[quant][1]
    r = check(TwoLinearMlp(quant, act, up_first).to(dtype), inputs(dtype), expect={op: 1}, exact=True, **TWO_GEMMS)
    rule = ACTS[act][1] + ("_reversed" if up_first else "")
    assert [s.rule for s in sites(r)] == [rule, op]
    assert not [m for m in r.report.near_misses if "act_mul" in m.rule], r.report.near_misses


@pytest.mark.parametrize("quant", ["static-runtime", "per-token", "block", "nvfp4"])
@DYNAMIC
def test_every_dynamic_setting(quant: str, dynamic: bool | str) -> None:
    """Static, dynamic and lifted captures (the runtime quantizer's 448 lifted to a graph input)."""
    r = check(TwoLinearMlp(quant).to(BF16), inputs(BF16), expect={QUANTS[quant][1]: 1}, dynamic=dynamic, exact=True,
              **TWO_GEMMS)
    assert [s.rule for s in sites(r)] == ["silu_mul", QUANTS[quant][1]]


# -- negative twins -----------------------------------------------------------------------------


def test_a_scale_that_is_not_one_float32_element_is_not_fused() -> None:
    """A per-channel static scale: act_mul fuses, its quantization does not; the guard says why."""
    model = TwoLinearMlp("static").to(BF16)
    model.quantize = lambda y: quant_static(y, torch.full((HIDDEN,), 0.02))
    r = check(model, inputs(BF16), expect={"act_mul": 1}, exact=True, **TWO_GEMMS)
    assert set(reasons(r, "act_mul_quant_fp8")) == {"guard: scale must be one float32 element, got torch.float32(64,)"}


def test_blocks_of_32_are_not_nvfp4() -> None:
    """The NVFP4 recipe over blocks of 32 (MXFP4's size): not NVFP4; the guard says so."""
    model = TwoLinearMlp("nvfp4").to(BF16)
    model.quantize = lambda y: quant_e2m1_blocks(y, GLOBAL, 32)
    r = check(model, inputs(BF16), expect={"act_mul": 1}, exact=True, **TWO_GEMMS)
    assert set(reasons(r, "act_mul_quant_nvfp4")) == {"guard: blocks of 32 values: NVFP4 scales blocks of 16"}


def test_per_token_quant_with_another_floor_is_not_fused() -> None:
    def floor_1e6(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = y.float()
        s = y.abs().amax(-1, keepdim=True).clamp(min=1e-6) / 448.0
        return (y / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s

    model = TwoLinearMlp("per-token").to(BF16)
    model.quantize = floor_1e6
    r = check(model, inputs(BF16), expect={"act_mul": 1}, dynamic=False, exact=True, **TWO_GEMMS)
    assert "`clamp` min: literal 1e-06 != 1e-12" in reasons(r, "act_mul_dynamic_quant_fp8")


@pytest.mark.parametrize(("quant", "alone"), [("static", None), ("block", "block_quant_fp8"), ("nvfp4", "quant_nvfp4")])
def test_product_also_read_unquantized_fuses_act_mul_and_the_quantizer_apart(quant: str, alone: str | None) -> None:
    """The product read besides its quantization: the fused op would not produce it; the
    quantizer fuses alone (the static one is a plain elementwise chain: left as written)."""
    model = TwoLinearMlp(quant).to(BF16)
    quantize = model.quantize

    def both(y: torch.Tensor) -> Any:
        return quantize(y), y

    model.quantize = both
    check(model, inputs(BF16), expect={"act_mul": 1, **({alone: 1} if alone else {})}, exact=True, **TWO_GEMMS)


def test_broadcast_operand_forms_no_act_mul_and_no_quant_op() -> None:
    """``act(gate) * up`` with a broadcast up ([T, 1]): no act_mul, so nothing to quantize fused."""

    def f(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return quant_static(F.silu(gate) * up, SCALE)

    check(f, inputs(BF16), torch.randn(6, 1).to(BF16), expect={}, exact=True)
