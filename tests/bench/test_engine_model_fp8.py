"""CPU tests of the block-FP8 engine model (``bench/engine_model_fp8.py``): the conversion, and the
rewriter fusing each layer's norm + quant and activation + quant sites."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.rewrites import fused

from engine_model import SPLITTING_OPS, build_model, make_batch
from engine_model_fp8 import (
    BlockFp8Linear, dequant_weight_block, expected_fusions, quant_weight_block, tiny_fp8, to_block_fp8,
)  # fmt: skip
from fxrewrite.testing import compile_once

CFG = tiny_fp8()
MAX_SEQS, MAX_LEN = 4, 64


def _model(dtype: torch.dtype, gemm: str = "fp8") -> Any:
    model = to_block_fp8(build_model(CFG, dtype=dtype), gemm)
    model.allocate_kv_cache(MAX_SEQS, MAX_LEN)
    return model


def test_weight_blocks_have_their_own_scales() -> None:
    w = torch.randn(256, 384) * torch.logspace(-2, 1, 256).unsqueeze(-1)
    q, s = quant_weight_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    assert torch.equal(s[1, 2], w[128:, 256:].abs().amax() / 448.0)
    err = (dequant_weight_block(q, s) - w).abs()
    assert bool((err <= w.abs() * 2**-4 + 2**-9 * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).all())


def test_every_layer_linear_is_converted() -> None:
    model = _model(torch.bfloat16)
    kinds = {type(m).__name__ for m in model.layers.modules() if isinstance(m, (torch.nn.Linear, BlockFp8Linear))}
    assert kinds == {"BlockFp8Linear"}
    assert model.layers[0].mlp.down_proj.weight_q.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("gemm", ["fp8", "dequant"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(("kind", "size", "context"), [("decode", 3, 9), ("prefill", 6, 0)])
def test_rewriter_fuses_norm_and_activation_quant_sites_per_layer(kind: str, size: int, context: int,
                                                                  dtype: torch.dtype, gemm: str) -> None:  # fmt: skip
    """Per layer: the input norm (add + norm after the first layer), the post-attention add +
    norm and SiLU-and-mul, each with its block quantization, as one op, and the attention
    output's quantization alone (``block_quant_fp8``); bit for bit eager. Either GEMM
    (``fxr.linear_block_fp8``: four per layer)."""
    model = _model(dtype, gemm)
    batch = make_batch(CFG, kind, size, context, max_len=MAX_LEN)
    names = list(batch)

    def step(*args: torch.Tensor) -> torch.Tensor:
        return model(**dict(zip(names, args)))

    r = compile_once(step, *batch.values(), dynamic=True, splitting_ops=SPLITTING_OPS)
    got = fused(r.counts())
    for op, n in expected_fusions(CFG).items():
        assert got.get(op) == n, got
    # no quantization left as torch code: the attention output's (o_proj's input) is the lone op's
    assert sum(n for op, n in r.counts().items() if "amax" in op) == 0, r.counts()
    assert got.get("linear_block_fp8", 0) == (4 * CFG.num_layers if gemm == "fp8" else 0), got
    assert torch.equal(r.output, r.eager)
