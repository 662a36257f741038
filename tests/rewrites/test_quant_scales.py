"""Static FP8 where several projections quantize one normed value (rewrites/quant.py's
``other_scales``; fxrewrite/cse.py): with one shared input scale the quantizations are one value,
``cse`` leaves one, and the norm + quant rule fuses it; with a scale per projection they are
three values, which one fused op cannot write, and each site's near miss says so, naming the
other projections. Both orders of the norm (Llama's and torch.rms_norm's), float32 and bf16,
bit for bit (the fused ops' CPU references are the unfused formulas).
"""

from __future__ import annotations

import pytest
import torch
from helpers.rewrites import BF16, DTYPE_MODES, F32, check, misses, quant_static, sites

HIDDEN = 64


class Quantize(torch.nn.Module):
    """An FP8 linear's input side: its static scale, the quantization of what it reads."""

    def __init__(self, scale: torch.nn.Parameter) -> None:
        super().__init__()
        self.input_scale = scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return quant_static(h, self.input_scale)


class Projections(torch.nn.Module):
    """RMSNorm (or add + RMSNorm), then q, k and v each quantizing the normed value with its
    input scale (``shared``: one scale parameter for the three), as FP8 linears do."""

    def __init__(self, shared: bool, add: bool = False, cast_last: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.add, self.cast_last = add, cast_last
        one = torch.nn.Parameter(torch.tensor(0.05), requires_grad=False)
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            scale = one if shared else torch.nn.Parameter(torch.tensor(0.05 * 2**i), requires_grad=False)
            self.register_module(name, Quantize(scale))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s = x + residual if self.add else x
        f = s.float()
        normed = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = (self.weight * normed).to(s.dtype) if self.cast_last else self.weight * normed.to(s.dtype)
        out = (self.q_proj(h), self.k_proj(h), self.v_proj(h))
        return (*out, s) if self.add else out


def model(shared: bool, add: bool, cast_last: bool, dtype: torch.dtype) -> Projections:
    """The norm weight in ``dtype``; the scales stay float32, as FP8 checkpoints hold them."""
    m = Projections(shared, add, cast_last)
    m.weight.data = m.weight.data.to(dtype)
    return m


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(5, HIDDEN).to(dtype), torch.randn(5, HIDDEN).to(dtype)


FUSED = {(False, False): ("rms_norm_quant_fp8", "rms_norm_quant_fp8"),
         (True, False): ("fused_add_rms_norm_quant_fp8", "add_rms_norm_quant_fp8"),
         (False, True): ("rms_norm_quant_fp8", "rms_norm_cast_last_quant_fp8"),
         (True, True): ("fused_add_rms_norm_quant_fp8", "add_rms_norm_cast_last_quant_fp8")}  # fmt: skip
IDS = ["norm", "add-norm", "norm-cast-last", "add-norm-cast-last"]


@pytest.mark.parametrize(("add", "cast_last"), list(FUSED), ids=IDS)
@DTYPE_MODES
def test_one_shared_scale_is_one_quantization_and_fuses(add: bool, cast_last: bool, dtype: torch.dtype,
                                                       dynamic: bool | str) -> None:  # fmt: skip
    op, rule = FUSED[(add, cast_last)]
    if dtype == F32:
        rule = rule.replace("_cast_last", "")  # in float32 the two orders are one computation: the first rule takes it
    r = check(model(True, add, cast_last, dtype), *inputs(dtype), expect={op: 1}, dynamic=dynamic, exact=True)
    assert [s.rule for s in sites(r)] == [rule]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("add", "cast_last"), list(FUSED), ids=IDS)
def test_a_scale_per_projection_says_why_per_site(add: bool, cast_last: bool, dtype: torch.dtype) -> None:
    """Negative twin: three scales, three quantized values: no norm + quant op; each
    quantization's near miss names the other two projections; the norm fuses alone."""
    op, rule = FUSED[(add, cast_last)]
    if dtype == F32:
        rule = rule.replace("_cast_last", "")
    plain = "fused_add_rms_norm" if add else "rms_norm"
    r = check(model(False, add, cast_last, dtype), *inputs(dtype), expect={plain: 1}, exact=True)
    got = sorted(m.reason for m in misses(r, rule))
    why = "one quantized value per scale: {} and {} quantize the normed value with other scales than {}"
    sites_ = (("q_proj", "k_proj", "v_proj"), ("k_proj", "q_proj", "v_proj"), ("v_proj", "q_proj", "k_proj"))
    assert got == sorted(why.format(a, b, p) for p, a, b in sites_), got
