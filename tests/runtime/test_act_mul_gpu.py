"""``fxr.act_mul`` on CUDA: the Triton kernel compiled, against the torch reference, at every
layout of tests/runtime/act_mul_samples.py (Mamba's transposed gate, a view's halves, permuted
heads, an expanded operand), in the output layout eager gives, and two dtypes promoted.

    python3 -m pytest -q tests/runtime/test_act_mul_gpu.py -m gpu
"""

from __future__ import annotations

import pytest
import torch
from helpers.gpu import force, fresh_counts, gen  # noqa: F401  (fresh_counts, gen: pytest fixtures of this module)

from act_mul_samples import LAYOUTS, mamba  # this folder
from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import activation

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# One rounding step of the output dtype: the GPU's approximate exp / erf may move the rounded
# activation by one step, which the product carries (the activation ops' GPU tolerance).
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def served_by_triton(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[got.dtype], atol=TOL[got.dtype])
    assert providers.served()["act_mul"] == {"fallbacks": {}, "triton": 1}


@pytest.mark.parametrize("act_first", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("act", activation.ACT_MUL_ACTIVATIONS)
def test_triton_act_mul_at_every_layout(act: str, layout: str, dtype: torch.dtype, act_first: bool,
                                        gen: torch.Generator) -> None:  # fmt: skip
    force("triton")
    a, b = LAYOUTS[layout](gen, dtype)
    want = activation.act_mul_reference(a, b, act, act_first)
    served_by_triton(torch.ops.fxr.act_mul(a, b, act, act_first), want)


@pytest.mark.parametrize("tokens", [1, 16, 4096])
def test_triton_act_mul_bf16_gate_times_float32_scan(tokens: int, gen: torch.Generator) -> None:
    """A bf16 Mamba mixer: the gate bf16, the scan output float32, the product float32."""
    force("triton")
    gate, scan = mamba(gen, torch.bfloat16, tokens)
    scan = scan.float()
    want = activation.act_mul_reference(gate, scan, "silu", False)
    assert want.dtype == torch.float32
    served_by_triton(torch.ops.fxr.act_mul(gate, scan, "silu", False), want)
