"""``hand_off_norm_quant`` (rewrites/norm_hand_off.py, ``Config.gemm_fusion``): in a static FP8
layer the add + RMSNorm + quantization between two FP8 GEMMs leaves the graph; the GEMM making the
sum hands off ``s * g`` and its squares, each GEMM reading the quantized norm quantizes it in its
prologue (runtime/ops/linear_fp8_fused.py).

On transformers' Llama and Qwen2 with the bench's static FP8 linears (``bench/fp8_linears.py``,
one input scale for q/k/v and one for gate/up: each its own ``_scaled_mm``), in float32 and
bf16, CPU; and on small blocks that show each reason a site keeps its norm."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from helpers.families import family_param
from helpers.rewrites import BF16, F32, fused, misses

from fxrewrite import models
from fxrewrite.runtime.ops.quant import quant_fp8_static
from fxrewrite.testing import Compiled, compile_once

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from fp8_linears import to_fp8_linears  # noqa: E402  (the bench's FP8 linears: model code)

RULE = "linear_fp8_add_rms_parts"
LAYERS = 2
SHAPE = {"layers": LAYERS, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256}
FAMILIES = [family_param("llama", id="llama"), family_param("qwen2", id="qwen2")]
DTYPES = [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16")]


@functools.cache
def fp8_model(family: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor, torch.nn.Module]:
    """The FP8 model, its input and the float32 model it was quantized from."""
    model = models.build(family, dtype=dtype, **SHAPE)
    reference = models.build(family, dtype=F32, **SHAPE)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    (ids,) = models.example_inputs(model, tokens=8)
    with torch.no_grad():
        to_fp8_linears(model.layers, lambda: model(ids), share_siblings=True)
    return model, ids, reference


@functools.cache
def compiled(family: str, dtype: torch.dtype, gemm_fusion: bool, mode: str = "piecewise") -> Compiled:
    model, ids, _ = fp8_model(family, dtype)
    return compile_once(model, ids, mode=mode, gemm_fusion=gemm_fusion, fp8_norm_prologue=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_add_and_norm_between_fp8_gemms_leaves_the_graph(family: str, dtype: torch.dtype) -> None:
    """Per layer after the first, the input norm; in every layer, the post-attention norm: each an
    o_proj's or down_proj's hand-off, read by q, k, v or gate, up quantizing it themselves. The
    first layer's input norm (of the embedding, no GEMM before it) and the final norm (no
    quantization) stay. Float32: bit for bit eager (the hand-off's roundings are float32's)."""
    r = compiled(family, dtype, True)
    got = fused(r.counts())
    assert got[RULE] == 2 * LAYERS - 1
    assert got["rms_norm_quant_linear_fp8"] == 3 * (LAYERS - 1) + 2 * LAYERS  # q, k, v; gate, up
    assert "fused_add_rms_norm_quant_fp8" not in got and got["rms_norm_quant_fp8"] == 1
    # the first layer's q, k, v (of the embedding's norm) and the last down_proj (before the final norm)
    assert got["linear_fp8"] == 4
    assert misses(r, RULE) == []
    if dtype == F32:
        assert torch.equal(models.hidden_states(r.output), models.hidden_states(r.eager))


def test_bf16_error_against_float32_is_the_unfused_ops(family: str = "llama") -> None:
    """bf16: the norm rounds in another order, so a value next to an e4m3 step may quantize to the
    neighbour: the output moves, but no further from the float32 model than without the hand-off
    (Llama; Qwen2's bf16 graph is the same but for the biases)."""
    _, ids, reference = fp8_model(family, BF16)
    with torch.no_grad():
        truth = models.hidden_states(reference(ids)).float()
    err = {on: (models.hidden_states(compiled(family, BF16, on).output).float() - truth).abs().mean().item()
           for on in (False, True)}  # fmt: skip
    assert err[True] <= 1.1 * err[False], err


class Block(torch.nn.Module):
    """An FP8 GEMM, the residual add, RMSNorm and its static quantization, an FP8 GEMM reading it:
    ``leak`` also returns the first GEMM's output (a second reader), ``other_scale`` hands the
    second GEMM a scale other than the quantization's."""

    def __init__(self, leak: bool = False, other_scale: bool = False) -> None:
        super().__init__()
        fp8 = torch.float8_e4m3fn
        self.w_o, self.w = (torch.randn(64, 64) * 20).clamp(-448, 448).to(fp8), (torch.randn(96, 64) * 20).to(fp8)
        self.g = torch.nn.Parameter(1 + 0.1 * torch.randn(64), requires_grad=False)
        self.s_a, self.s_o, self.s_q, self.s_w = (torch.tensor(v) for v in (0.01, 0.004, 0.02, 0.005))
        self.leak, self.other_scale = leak, other_scale

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        o = torch._scaled_mm(quant_fp8_static(torch.tanh(h), self.s_a), self.w_o.t(), scale_a=self.s_a,
                             scale_b=self.s_o, out_dtype=h.dtype)  # fmt: skip
        s = o + h
        v = s.float()
        n = self.g * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
        scale_a = self.s_q * 1.5 if self.other_scale else self.s_q
        y = torch._scaled_mm(quant_fp8_static(n, self.s_q), self.w.t(), scale_a=scale_a, scale_b=self.s_w,
                             out_dtype=h.dtype)  # fmt: skip
        return (y, s, o) if self.leak else (y, s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_block_takes_the_hand_off(dtype: torch.dtype) -> None:
    r = compile_once(Block().to(dtype), torch.randn(4, 64).to(dtype), mode="piecewise", gemm_fusion=True,
                     fp8_norm_prologue=True)  # fmt: skip
    assert fused(r.counts()) == {RULE: 1, "rms_norm_quant_linear_fp8": 1}
    for got, want in zip(r.output, r.eager):
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())


@pytest.mark.parametrize(("gemm_fusion", "mode"), [(True, "none"), (False, "piecewise")], ids=["eager", "no-gemm-fusion"])
def test_nothing_changes_where_graphs_run_eagerly_or_without_gemm_fusion(gemm_fusion: bool, mode: str) -> None:
    """Negative twins: mode ``none`` keeps the FP8 norm (the pass serves the CUDA-graph modes),
    and so does ``fp8_norm_prologue`` without ``gemm_fusion`` (it serves the decode sizes)."""
    r = compile_once(Block(), torch.randn(4, 64), mode=mode, gemm_fusion=gemm_fusion, fp8_norm_prologue=True)
    assert RULE not in fused(r.counts()) and fused(r.counts())["fused_add_rms_norm_quant_fp8"] == 1
    assert misses(r, RULE) == []


@pytest.mark.parametrize(("leak", "other_scale", "dtype", "reason"), [
    (True, False, F32, "the GEMM's output has readers besides the norm"),
    (False, True, F32, "input scale is not the quantization's scale"),
    (False, False, BF16, "norm weight torch.float32 is not a [n] vector of the sum's dtype"),
], ids=["gemm-read-twice", "other-scale", "float32-weight"])  # fmt: skip
def test_a_site_that_cannot_hand_off_keeps_its_norm_and_says_why(leak: bool, other_scale: bool, dtype: torch.dtype,
                                                                 reason: str) -> None:  # fmt: skip
    """Negative twins: the first GEMM's output read besides the norm (the hand-off stores only the
    sum), the second GEMM scaling its input by another scale than the quantization's, a float32
    norm weight on a bf16 sum (the hand-off stores ``s * g`` in the sum's dtype)."""
    r = compile_once(Block(leak, other_scale), torch.randn(4, 64).to(dtype), mode="piecewise", gemm_fusion=True,
                     fp8_norm_prologue=True)  # fmt: skip
    assert RULE not in fused(r.counts()) and fused(r.counts())["fused_add_rms_norm_quant_fp8"] == 1
    [why] = misses(r, RULE)
    assert reason in why.reason
    for got, want in zip(r.output, r.eager):
        assert torch.equal(got, want)
