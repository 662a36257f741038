"""The quantizers alone (``fuse_quant``: rewrites/quant.py, quant_block.py, quant_nvfp4.py's
``ALONE_RULES``): a dynamic per-token FP8, block FP8 or NVFP4 quantization of a value no norm or
activation produced (a GEMM's output, as o_proj's input is an attention's; a graph input) becomes
``fxr.dynamic_quant_fp8``, ``fxr.block_quant_fp8`` or ``fxr.quant_nvfp4``.

The quantization is spelled by calling the spec (448 and the floor read from module globals,
which Dynamo lifts under dynamic=True) and inline (``helpers.rewrites.quant_per_token``; the
group split as views). The ops' CPU references are the spec, so FP8 bytes, scales and NVFP4
codes equal eager bit for bit in float32 and bf16 (``exact=True``). Negative twins: after a
norm or an activation the fused norm / activation + quant rule takes the quantization (the
rules run last), another amax floor is no site, NVFP4's guard refuses blocks of 32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, DTYPE_MODES, check, fused_nodes, quant_per_token, reasons, sites

from fxrewrite import rewrites
from fxrewrite.runtime.ops.quant import quant_fp8_per_token
from fxrewrite.runtime.ops.quant_block import quant_fp8_block
from fxrewrite.runtime.ops.quant_nvfp4 import quant_e2m1_blocks, quant_nvfp4

HIDDEN = 256
GLOBAL = torch.tensor([150.0])


def inline_block(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of 128 as views of the shapes (vLLM's native group path spells it so)."""
    t = y.float()
    g = t.view(*t.shape[:-1], t.shape[-1] // 128, 128)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(*t.shape), s.view(*t.shape[:-1], t.shape[-1] // 128)


# spelling: (the quantization as model code writes it, the op it fuses into)
QUANTS: dict[str, tuple[Callable[[torch.Tensor], Any], str]] = {
    "per-token": (quant_fp8_per_token, "dynamic_quant_fp8"),
    "per-token-inline": (quant_per_token, "dynamic_quant_fp8"),
    "block": (quant_fp8_block, "block_quant_fp8"),
    "block-inline": (inline_block, "block_quant_fp8"),
    "nvfp4": (lambda y: quant_nvfp4(y, GLOBAL), "quant_nvfp4"),
}


class Projection(torch.nn.Module):
    """A GEMM whose output is quantized, as o_proj's input (an attention output) is."""

    def __init__(self, quantize: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.quantize = quantize
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> Any:
        return self.quantize(self.proj(x))


def rows(dtype: torch.dtype, *lead: int) -> torch.Tensor:
    """Rows from tiny to large (NVFP4 block scales underflow and saturate), one zero row."""
    n = int(torch.tensor(lead or (6,)).prod())
    x = torch.randn(n, HIDDEN) * torch.logspace(-4, 1.5, n).unsqueeze(-1)
    x[1] = 0
    return x.view(*(lead or (6,)), HIDDEN).to(dtype)


@pytest.mark.parametrize("spelling", ["per-token", "block", "nvfp4"])
@DTYPE_MODES
def test_a_quantized_gemm_output_fuses_into_the_quantizer_alone(spelling: str, dtype: torch.dtype,
                                                                 dynamic: bool | str) -> None:  # fmt: skip
    quantize, op = QUANTS[spelling]
    r = check(Projection(quantize).to(dtype), rows(dtype), expect={op: 1}, dynamic=dynamic, exact=True)
    assert [s.rule for s in sites(r)] == [op]
    (node,) = fused_nodes(r, op)
    if op == "block_quant_fp8":
        assert 128 in node.args  # the group the model used reaches the op


@pytest.mark.parametrize("spelling", ["per-token-inline", "block-inline"])
def test_inline_spellings_fuse(spelling: str) -> None:
    quantize, op = QUANTS[spelling]
    r = check(Projection(quantize).to(BF16), rows(BF16), expect={op: 1}, dynamic=False, exact=True)
    assert [s.rule for s in sites(r)] == [op]


def test_graph_inputs_of_any_rank_fuse() -> None:
    """An input [B, T, H] (and values of it) quantized by each quantizer: three ops, their scales
    [B, T, ...]. (Two quantizations of one bf16 value share its float32 cast, which neither
    match may then consume: each would be a near miss.)"""

    def fn(y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*quant_fp8_per_token(y), *quant_fp8_block(y + 1), *quant_nvfp4(y * 2, GLOBAL))

    expect = {"dynamic_quant_fp8": 1, "block_quant_fp8": 1, "quant_nvfp4": 1}
    r = check(fn, rows(BF16, 2, 3), expect=expect, dynamic=True, exact=True)
    assert [tuple(t.shape) for t in r.output[1::2]] == [(2, 3, 1), (2, 3, HIDDEN // 128), (2, 3, HIDDEN // 16)]


# -- negative twins -----------------------------------------------------------------------------


def rms_norm(h: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    f = h.to(torch.float32)
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return w * f.to(h.dtype)


# spelling: (the norm + quant op, the SiLU-and-mul + quant op) that take the quantization there
FUSED = {
    "per-token": ("rms_norm_dynamic_quant_fp8", "silu_and_mul_dynamic_quant_fp8"),
    "block": ("rms_norm_block_quant_fp8", "silu_and_mul_block_quant_fp8"),
    "nvfp4": ("rms_norm_quant_nvfp4", "silu_and_mul_quant_nvfp4"),
}


@pytest.mark.parametrize("spelling", list(FUSED))
def test_after_a_norm_or_an_activation_the_fused_rules_take_the_quantization(spelling: str) -> None:
    """The lone quantizer's rules run after every rule that fuses a quantization into what
    precedes it: a norm's and a SiLU-and-mul's quantizations are theirs, not the lone op's."""
    quantize, alone = QUANTS[spelling]
    w = (1 + 0.1 * torch.randn(HIDDEN)).to(BF16)
    gate_up = torch.nn.Linear(HIDDEN, 2 * HIDDEN, bias=False).to(BF16)

    def fn(x: torch.Tensor) -> tuple[Any, Any]:
        gate, up = gate_up(x).chunk(2, -1)
        return quantize(rms_norm(x, w)), quantize(F.silu(gate) * up)

    norm_op, act_op = FUSED[spelling]
    r = check(fn, rows(BF16), expect={norm_op: 1, act_op: 1}, dynamic=False, exact=True)
    assert alone not in [s.rule for s in sites(r)]


def floor_1e4(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token with flashinfer's floor (1e-4), not the spec's: another quantization."""
    f = y.float()
    s = f.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    return (f / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s


def block_floor_1e4(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = y.float().unflatten(-1, (-1, 128))
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    return (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).flatten(-2), s.flatten(-2)


@pytest.mark.parametrize(("quantize", "rule"), [(floor_1e4, "dynamic_quant_fp8"), (block_floor_1e4, "block_quant_fp8")],
                         ids=["per-token", "block"])  # fmt: skip
def test_another_amax_floor_is_not_fused(quantize: Callable[[torch.Tensor], Any], rule: str) -> None:
    r = check(Projection(quantize).to(BF16), rows(BF16), expect={}, dynamic=False, exact=True)
    assert reasons(r, rule) == ["`clamp` min: literal 0.0001 != 1e-12"]


def test_nvfp4_recipe_over_blocks_of_32_is_refused_by_the_guard() -> None:
    r = check(Projection(lambda y: quant_e2m1_blocks(y, GLOBAL, 32)).to(BF16), rows(BF16), expect={}, exact=True)
    assert reasons(r, "quant_nvfp4") == ["guard: blocks of 32 values: NVFP4 scales blocks of 16"]


def test_the_lone_quantizers_run_last_of_the_quant_rules_block_before_per_token() -> None:
    """``fuse_quant`` follows every step that fuses a quantization into its producer (attention,
    all-reduce + norm, norm, activation); in it the block rule precedes the per-token one, whose
    pattern lies inside the block pattern (a group is quantized as a row)."""
    names = [step.name for step in rewrites.PIPELINE]
    fusing = ["fuse_collective", "fuse_attention_quant", "fuse_norm_quant", "fuse_activation_quant"]
    assert all(names.index(name) < names.index("fuse_quant") for name in fusing)
    (group,) = [step for step in rewrites.PIPELINE if step.name == "fuse_quant"]
    lists = (rewrites.quant_block.ALONE_RULES, rewrites.quant.ALONE_RULES, rewrites.quant_nvfp4.ALONE_RULES)
    assert list(group.rules) == [rule for rules in lists for rule in rules]
    assert [r.name for r in group.rules] == ["block_quant_fp8", "dynamic_quant_fp8", "quant_nvfp4"]
