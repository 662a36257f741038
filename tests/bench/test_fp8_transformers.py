"""FP8 linears in transformers decoders (tiny Llama; Qwen2, whose q/k/v projections carry a bias),
converted by the bench's own code (``bench/fp8_linears.py``: ``to_fp8_linears``, static per-tensor,
and ``BlockFp8Linear``, block FP8, the classes the FP8 engine models use; any ``nn.Linear``), then
compiled with fxrewrite on CPU in float32.

What holds today, asserted: the compiled model equals the eager quantized model bit for bit; it
fuses no quantization; per layer the report says why for block FP8: each of q/k/v (and of gate and
up) quantizes the normed hidden state itself, so the norm's output has other users beside the one
quantization a rule would take. What the issue asks (a norm + quant and an activation + quant op per
layer) is the strict xfail below: it needs the quantizations of one tensor deduplicated or the
quantized sibling linears merged (one input scale for q/k/v, as serving engines load them), and an
``act_mul`` + quant rule (gate and up stay two GEMMs). Negative twin: the plain model's report has
no quantization either, and its norms and activation fuse as without quantization.

transformers' own ``FP8Linear`` (``integrations.finegrained_fp8``) is not used: its forward calls the
hub kernel, which on CPU raises ``ImportError: finegrained-fp8 kernel unavailable: `kernels` is either
not installed or uses an incompatible version`` (and quantizes the activation inside the GEMM kernel,
so no quantization would be left in the graph to fuse).
"""

from __future__ import annotations

import collections
import functools
import re

import pytest
import torch
from helpers.families import family_param
from helpers.rewrites import fused

from fp8_linears import BlockFp8Linear, Fp8Linear, replace_linears, to_fp8_linears
from fxrewrite import models
from fxrewrite.testing import Compiled, compile_once

LAYERS = 2
# every dim a multiple of 128 (block FP8): heads of 64, k/v projections 2 x 64 wide
SHAPE = {"layers": LAYERS, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512}
FAMILIES = [family_param("llama"), family_param("qwen2")]
QUANTS = ("fp8", "block-fp8", "none")
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def quantized(family: str, quant: str) -> tuple[torch.nn.Module, torch.Tensor]:
    model = models.build(family, **SHAPE)
    (ids,) = models.example_inputs(model, tokens=8)
    with torch.no_grad():
        if quant == "fp8":
            assert to_fp8_linears(model.layers, lambda: model(ids)) == LINEARS_PER_LAYER * LAYERS
        elif quant == "block-fp8":
            assert replace_linears(model.layers, lambda _name, linear: BlockFp8Linear(linear)) == LINEARS_PER_LAYER * LAYERS
    return model, ids


@functools.cache
def compiled(family: str, quant: str) -> Compiled:
    model, ids = quantized(family, quant)
    return compile_once(model, ids, dynamic=True)


def per_layer(r: Compiled, rule: str) -> dict[int, int]:
    """The report's sites of rules whose name contains ``rule``, per decoder layer."""
    found: collections.Counter[int] = collections.Counter()
    for item in r.report.sites:
        if rule in item.rule and (m := re.match(r"layers\.(\d+)\.", item.module)):
            found[int(m.group(1))] += 1
    return dict(found)


def quant_ops(r: Compiled) -> dict[str, int]:
    return {op: n for op, n in fused(r.counts()).items() if "quant" in op}


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_equals_the_eager_quantized_model(family: str, quant: str) -> None:
    """Bit for bit in float32 (as the quant rules' tests: the same CPU formulas on both sides);
    the block-FP8 GEMMs are ``fxr.linear_block_fp8`` calls, one per linear."""
    r = compiled(family, quant)
    out, ref = models.hidden_states(r.output), models.hidden_states(r.eager)
    assert torch.isfinite(ref).all() and torch.equal(out, ref), float((out - ref).abs().max())
    assert fused(r.counts()).get("linear_block_fp8", 0) == (LINEARS_PER_LAYER * LAYERS if quant == "block-fp8" else 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_linear_is_converted(family: str) -> None:
    for quant, cls in (("fp8", Fp8Linear), ("block-fp8", BlockFp8Linear)):
        model, _ = quantized(family, quant)
        assert not [n for n, m in model.layers.named_modules() if isinstance(m, torch.nn.Linear)]
        assert sum(isinstance(m, cls) for m in model.layers.modules()) == LINEARS_PER_LAYER * LAYERS
        biased = [n for n, m in model.layers.named_modules() if isinstance(m, cls) and m.bias is not None]
        assert biased == ([f"{i}.self_attn.{p}_proj" for i in range(LAYERS) for p in "qkv"] if family == "qwen2" else [])


@pytest.mark.parametrize("family", FAMILIES)
def test_block_fp8_each_layer_says_why_its_quantizations_stay(family: str) -> None:
    """Per layer, the block-quant norm rules anchor at each of q/k/v and gate/up (the first
    layer's plain norm at q/k/v is an add + norm near miss with no add) and refuse: the normed
    hidden state is quantized once per projection."""
    r = compiled(family, "block-fp8")
    assert quant_ops(r) == {}, quant_ops(r)
    misses = [m for m in r.report.near_misses if "norm_block_quant_fp8" in m.rule]
    shared = [m for m in misses if re.search(r"has \d user\(s\) outside the match", m.reason)]
    layers = {int(re.match(r"layers\.(\d+)\.", m.module).group(1)) for m in shared}  # type: ignore[union-attr]
    assert layers == set(range(LAYERS)), [(m.module, m.reason) for m in misses]
    assert {m.module.rsplit(".", 1)[1] for m in shared} >= {"gate_proj", "up_proj"}


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_linears_fuse_no_quantization(family: str) -> None:
    """The negative twin: the same model with plain linears fuses its norms and its activation,
    and no op or report site names a quantization."""
    r = compiled(family, "none")
    assert quant_ops(r) == {} and per_layer(r, "quant") == {}
    assert fused(r.counts()).get("fused_add_rms_norm_", 0) == 2 * LAYERS


@pytest.mark.xfail(strict=True, reason="not fused yet: q/k/v and gate/up each quantize the normed hidden state "
                   "(no dedup or merge of quantized siblings), and no act_mul + quant rule")  # fmt: skip
@pytest.mark.parametrize("quant", ["fp8", "block-fp8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_report_shows_the_quant_fusions_per_layer(family: str, quant: str) -> None:
    """What issue 31 asks of a transformers model: per layer, two norm + quant sites (the input
    norm, add + norm after the first layer; the post-attention add + norm) and one activation +
    quant site."""
    r = compiled(family, quant)
    want = dict.fromkeys(range(LAYERS), 2)
    assert per_layer(r, "norm_quant") == want or per_layer(r, "norm_block_quant") == want, r.report.table()
    assert per_layer(r, "mul_quant") == dict.fromkeys(range(LAYERS), 1) or \
        per_layer(r, "mul_block_quant") == dict.fromkeys(range(LAYERS), 1), r.report.table()
