"""Block FP8 rules (rewrites/quant_block.py): RMSNorm, add + RMSNorm, all-reduce + add + RMSNorm,
SiLU-, GELU- and GELU(tanh)-and-mul followed by per-token-group FP8 quantization.

The quantization is spelled two ways: by calling the spec, ``quant_fp8_block`` (``unflatten``,
``flatten``; 448 read from a module global, which Dynamo lifts under dynamic=True), and inline
with ``view``s of the shapes (vLLM's native group path writes it so). The fused ops' CPU
references are the unfused formulas, so FP8 bytes and scales equal eager bit for bit
(``exact=True``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from helpers.rewrites import (
    BF16, DYNAMIC, DTYPE_MODES, F32, FP8, check, fake_process_group, fused_nodes, quant_per_token, reasons, sites,
)  # fmt: skip

from fxrewrite.rewrites import quant_block
from fxrewrite.runtime.ops.quant_block import dequant_fp8_block, quant_fp8_block

HIDDEN = 256


def rms_norm(h: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    f = h.to(torch.float32)
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return w * f.to(h.dtype)


def inline_block(y: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The group quantization as vLLM's native path spells it: views of the shapes."""
    t = y.float()
    g = t.view(*t.shape[:-1], t.shape[-1] // group, group)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(*t.shape), s.view(*t.shape[:-1], t.shape[-1] // group)


QUANTS: dict[str, Callable[..., Any]] = {"spec": quant_fp8_block, "inline": inline_block}


class BlockFp8(torch.nn.Module):
    """``kind``: what precedes the quantization: "norm", "add-norm", "silu", "gelu", "gelu-tanh"."""

    def __init__(self, kind: str, quant: Callable[..., Any] = quant_fp8_block, group: int = 128) -> None:
        super().__init__()
        self.kind, self.quant, self.group = kind, quant, group
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.gate_up_proj = torch.nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        if self.kind == "norm":
            return self.quant(rms_norm(a, self.weight), self.group)
        if self.kind == "add-norm":
            s = a * 2 + b
            return (*self.quant(rms_norm(s, self.weight), self.group), s)
        gate, up = self.gate_up_proj(a).chunk(2, -1)
        act = {"silu": F.silu, "gelu": F.gelu, "gelu-tanh": lambda g: F.gelu(g, approximate="tanh")}[self.kind]
        return self.quant(act(gate) * up, self.group)


FUSED = {
    # kind: (fused op, rules that fire, in order)
    "norm": ("rms_norm_block_quant_fp8", ["rms_norm_block_quant_fp8"]),
    "add-norm": ("fused_add_rms_norm_block_quant_fp8", ["add_rms_norm_block_quant_fp8"]),
    "silu": ("silu_and_mul_block_quant_fp8", ["silu_and_mul", "silu_and_mul_block_quant_fp8"]),
    "gelu": ("gelu_and_mul_block_quant_fp8", ["gelu_and_mul", "gelu_and_mul_block_quant_fp8"]),
    "gelu-tanh": ("gelu_and_mul_block_quant_fp8", ["gelu_tanh_and_mul", "gelu_tanh_and_mul_block_quant_fp8"]),
}
# what still fuses when the block rule does not
UNFUSED = {"norm": "rms_norm", "add-norm": "fused_add_rms_norm", "silu": "silu_and_mul", "gelu": "gelu_and_mul",
           "gelu-tanh": "gelu_and_mul"}  # fmt: skip


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # rows from tiny to large, and a zero row: scales from the floor up
    rows = torch.logspace(-3, 1, 6).unsqueeze(-1)
    a = torch.randn(6, HIDDEN) * rows
    a[2] = 0
    return a.to(dtype), torch.randn(6, HIDDEN).to(dtype)


def compiled(kind: str, dtype: torch.dtype, dynamic: bool | str, expect: dict[str, int], **kw: Any) -> Any:
    model = BlockFp8(kind, **kw).to(dtype)
    return check(model, *inputs(dtype), expect=expect, dynamic=dynamic, exact=True)


@pytest.mark.parametrize("spelling", list(QUANTS))
@pytest.mark.parametrize("kind", list(FUSED))
@DTYPE_MODES
def test_block_fp8_fusions(kind: str, dtype: torch.dtype, spelling: str, dynamic: bool | str) -> None:
    op, rules = FUSED[kind]
    r = compiled(kind, dtype, dynamic, {op: 1}, quant=QUANTS[spelling])
    assert [s.rule for s in sites(r)] == rules
    q, s = r.output[:2]
    assert q.dtype == FP8 and s.dtype == F32 and tuple(s.shape) == (6, HIDDEN // 128)
    (node,) = fused_nodes(r, op)
    assert 128 in node.args  # the group the model used reaches the op


@pytest.mark.parametrize("group", [64, 32])
@DYNAMIC
def test_the_group_is_bound_not_assumed(group: int, dynamic: bool | str) -> None:
    """Groups of 64 (or 32) fuse into the op with that group: scales [..., H / group]."""
    for kind in ("norm", "silu"):
        op = FUSED[kind][0]
        r = compiled(kind, BF16, dynamic, {op: 1}, group=group)
        (node,) = fused_nodes(r, op)
        assert group in node.args and 128 not in node.args
        assert tuple(r.output[1].shape) == (6, HIDDEN // group)


class QuantizedLayer(torch.nn.Module):
    """A decoder layer as a block-FP8 checkpoint runs it, GEMMs on dequantized activations."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = (torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN)) for _ in range(2))
        self.o, self.down = (torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(2))
        self.gate_up = torch.nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.o(dequant_fp8_block(*quant_fp8_block(rms_norm(x, self.w1))).to(x.dtype))
        h = attn + residual
        g, u = self.gate_up(dequant_fp8_block(*quant_fp8_block(rms_norm(h, self.w2))).to(x.dtype)).chunk(2, -1)
        return self.down(dequant_fp8_block(*quant_fp8_block(F.silu(g) * u)).to(x.dtype)), h


@DYNAMIC
def test_each_quantized_site_of_a_layer_fuses(dynamic: bool | str) -> None:
    """The input norm, the post-attention add + norm and the MLP's SiLU-and-mul each fuse with
    their quantization: three sites, three fused ops."""
    expect = {"rms_norm_block_quant_fp8": 1, "fused_add_rms_norm_block_quant_fp8": 1, "silu_and_mul_block_quant_fp8": 1}
    res = check(QuantizedLayer().to(BF16), *inputs(BF16), dynamic=dynamic, exact=True, expect=expect)
    assert sorted(s.rule for s in sites(res)) == sorted(
        ["rms_norm_block_quant_fp8", "add_rms_norm_block_quant_fp8", "silu_and_mul", "silu_and_mul_block_quant_fp8"])


# -- negative twins -----------------------------------------------------------------------------


def per_token(y: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale over the whole row: per-token, not per group."""
    return quant_per_token(y)


@pytest.mark.parametrize("kind", ["norm", "silu"])
def test_a_scale_over_the_whole_row_is_not_a_block_quant(kind: str) -> None:
    """Per-token quantization fuses as such (rewrites/quant.py), never as a block quant."""
    op = {"norm": "rms_norm_dynamic_quant_fp8", "silu": "silu_and_mul_dynamic_quant_fp8"}[kind]
    r = compiled(kind, BF16, False, {op: 1}, quant=per_token)
    assert not [s for s in sites(r) if "block" in s.rule]


def padded(y: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A hidden size the group does not divide, padded to a whole group (vLLM's native path)."""
    n = y.shape[-1]
    pad = -n % group
    q, s = inline_block(F.pad(y.float(), (0, pad)), group)
    return q[..., :n], s


def test_a_group_that_does_not_divide_the_row_is_not_fused() -> None:
    """Padding sits between the norm and the split: the norm + block rule does not match, the
    norm fuses, and the padded row's quantization alone."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return padded(rms_norm(x, w))

    x, w = torch.randn(4, 200).to(BF16), (1 + 0.1 * torch.randn(200)).to(BF16)
    r = check(fn, x, w, expect={"rms_norm": 1, "block_quant_fp8": 1}, dynamic=False, exact=True)
    assert [s.rule for s in sites(r)] == ["rms_norm", "block_quant_fp8"]


def strided_groups(y: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of strided columns (column j in group j % G): another quantization."""
    t = y.float()
    g = t.unflatten(-1, (group, -1)).transpose(-1, -2)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.transpose(-1, -2).flatten(-2), s.flatten(-2)


@pytest.mark.parametrize("kind", ["norm", "silu"])
def test_strided_groups_are_not_fused(kind: str) -> None:
    """Not a block quantization: the rows of the transposed view are quantized per token, alone."""
    r = compiled(kind, BF16, False, {UNFUSED[kind]: 1, "dynamic_quant_fp8": 1}, quant=strided_groups)
    assert not [s for s in sites(r) if "block" in s.rule]


def floor_1e4(y: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """flashinfer's floor (1e-4), not the spec's."""
    g = y.float().unflatten(-1, (-1, group))
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    return (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).flatten(-2), s.flatten(-2)


@pytest.mark.parametrize("kind", list(FUSED))
def test_another_amax_floor_is_not_fused(kind: str) -> None:
    r = compiled(kind, BF16, False, {UNFUSED[kind]: 1}, quant=floor_1e4)
    rule = FUSED[kind][1][-1]
    assert reasons(r, rule) == ["`clamp` min: literal 0.0001 != 1e-12"]


def test_a_norm_whose_weight_does_not_span_the_row_is_refused_by_the_guard() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quant_fp8_block(rms_norm(x, w))

    x, w = torch.randn(4, HIDDEN).to(BF16), torch.randn(4, 1).to(BF16)  # a per-row "weight"
    r = check(fn, x, w, expect={"rms_norm": 1, "block_quant_fp8": 1}, dynamic=False, exact=True)
    # the normed value fuses without its weight (a per-row factor is not a norm weight), the quantizer alone
    assert [s.rule for s in sites(r)] == ["rms_norm_unweighted", "block_quant_fp8"]
    assert reasons(r, "rms_norm_block_quant_fp8") == ["guard: weight shape (4, 1) != normalized dim (256,)"]


def test_rule_order_in_the_pipeline() -> None:
    """Block rules share the quant groups; the all-reduce one precedes the plain all-reduce rules."""
    from fxrewrite.rewrites import PIPELINE, collective

    groups = {s.name: s.rules for s in PIPELINE if hasattr(s, "rules")}
    rules = groups["fuse_collective"]
    assert rules[-len(collective.RULES):] == collective.RULES
    assert quant_block.ALL_REDUCE_ADD_RMS_NORM_BLOCK_QUANT in rules[: -len(collective.RULES)]
    assert set(quant_block.NORM_RULES) <= set(groups["fuse_norm_quant"])
    assert set(quant_block.ACTIVATION_RULES) <= set(groups["fuse_activation_quant"])


# -- all-reduce + add + RMSNorm + block FP8 -----------------------------------------------------


@pytest.fixture
def fake_group() -> Iterator[None]:
    with fake_process_group():
        yield


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.usefixtures("fake_group")
def test_all_reduce_add_rms_norm_block_quant(dtype: torch.dtype) -> None:
    w = (1 + 0.1 * torch.randn(HIDDEN)).to(dtype)

    def fn(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
        return (*quant_fp8_block(rms_norm(h, w)), h)

    r = check(fn, *inputs(dtype), expect={"all_reduce_add_rms_norm_block_quant_fp8": 1}, dynamic=True, exact=True)
    assert [s.rule for s in sites(r)] == ["all_reduce_add_rms_norm_block_quant_fp8"]
