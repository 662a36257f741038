"""Sibling block-FP8 linears (rewrites/merge.py): ``fxr.linear_block_fp8`` calls that read one
quantized input merge into one GEMM over the stacked FP8 weights and tile scales, so a gate and
up pair becomes the halves of one output and its SiLU-and-mul + block quantization fuses.

Each projection quantizes its input itself, as a block-FP8 checkpoint's linear does; the
``cse`` pass makes the repeated quantizations one first. The fused ops' CPU references are the
unfused formulas, and the merged GEMM computes each output column as the separate ones did:
bit for bit in float32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from typing import Any

from helpers.rewrites import BF16, DTYPE_MODES, F32, assert_same, compile_modes, fused, sites

from fxrewrite import Config
from fxrewrite.testing import Compiled, compile_once
from fxrewrite.runtime.ops.linear_block_fp8 import quant_weight_block
from fxrewrite.runtime.ops.quant_block import quant_fp8_block

HIDDEN, INTER = 256, 384


class BlockLinear(torch.nn.Module):
    """A block-FP8 linear: weight and tile scales as buffers, the input quantized per group."""

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        q, s = quant_weight_block(torch.randn(n, k) / k**0.5)
        self.register_buffer("weight_q", q)
        self.register_buffer("weight_scale", s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.fxr.linear_block_fp8(*quant_fp8_block(x), self.weight_q, self.weight_scale, x.dtype)


class Mlp(torch.nn.Module):
    """RMSNorm, then gate and up (``up_reads``: what up reads, "norm" or "other": the second
    input), SiLU-and-mul, down."""

    def __init__(self, up_reads: str = "norm") -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.gate_proj, self.up_proj = BlockLinear(INTER, HIDDEN), BlockLinear(INTER, HIDDEN)
        self.down_proj = BlockLinear(HIDDEN, INTER)
        self.up_reads = up_reads

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        f = x.float()
        h = self.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        up = self.up_proj(h if self.up_reads == "norm" else other)
        return self.down_proj(F.silu(self.gate_proj(h)) * up)


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(5, HIDDEN).to(dtype), torch.randn(5, HIDDEN).to(dtype)


def check(model: torch.nn.Module, x: tuple[torch.Tensor, torch.Tensor], expect: dict[str, int],
          dynamic: bool | str = True, **overrides: Any) -> Compiled:  # fmt: skip
    """Compile; the fused ops after are ``expect`` (the model calls ``linear_block_fp8`` itself:
    three as captured); outputs equal eager bit for bit."""
    r = compile_once(model, *x, **{**compile_modes(dynamic), **overrides})
    assert fused(r.counts_before()) == {"linear_block_fp8": 3}, r.counts_before()
    assert fused(r.counts()) == expect, fused(r.counts())
    assert_same(r.output, r.eager)
    return r


@DTYPE_MODES
def test_gate_and_up_merge_and_their_activation_fuses_with_its_quantization(dtype: torch.dtype,
                                                                         dynamic: bool | str) -> None:  # fmt: skip
    model = Mlp().to(dtype)
    r = check(model, inputs(dtype), dynamic=dynamic, expect={
        "rms_norm_block_quant_fp8": 1, "linear_block_fp8": 2, "silu_and_mul_block_quant_fp8": 1})  # fmt: skip
    assert [s.module for s in sites(r, "merge_siblings")] == ["gate_proj + up_proj"]
    assert {n: tuple(b.shape) for n, b in r.graph.named_buffers()} == {
        "fxr_merged_0": (2 * INTER, HIDDEN), "fxr_merged_0_scale": (2 * INTER // 128, HIDDEN // 128)}  # fmt: skip
    # the module's buffers are views into the merged ones: memory does not grow
    merged = dict(r.graph.named_buffers())["fxr_merged_0"]
    assert model.up_proj.weight_q.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_linears_reading_other_quantized_inputs_do_not_merge(dtype: torch.dtype) -> None:
    """Negative twin: up reads another input, gate the normed value: two quantizations, no siblings;
    gate and up stay two GEMMs, their product ``act_mul``, quantized by ``act_mul_block_quant_fp8``
    (rewrites/quant_act_mul.py) where the merged pair's halves would be ``silu_and_mul``'s; the
    other input's quantization fuses alone (``block_quant_fp8``)."""
    r = check(Mlp(up_reads="other").to(dtype), inputs(dtype),
              expect={"rms_norm_block_quant_fp8": 1, "block_quant_fp8": 1, "linear_block_fp8": 3,
                      "act_mul_block_quant_fp8": 1})  # fmt: skip
    assert not sites(r, "merge_siblings")


def test_without_merge_siblings_the_pair_stays_two_gemms() -> None:
    """Negative twin: ``merge_siblings=False`` keeps the two GEMMs (the norm still fuses with the
    one quantization ``cse`` left; the product is ``act_mul``'s, quantized by ``act_mul_block_quant_fp8``)."""
    r = check(Mlp(), inputs(F32), config=Config(merge_siblings=False),
              expect={"rms_norm_block_quant_fp8": 1, "linear_block_fp8": 3,
                      "act_mul_block_quant_fp8": 1})  # fmt: skip
    assert not sites(r, "merge_siblings")
