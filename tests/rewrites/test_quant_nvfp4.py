"""NVFP4 rules (rewrites/quant_nvfp4.py): RMSNorm, add + RMSNorm, SiLU- and GELU-and-mul followed
by NVFP4 quantization.

The quantization is spelled two ways in the models below: by calling the runtime's
``quant_nvfp4`` (the spec), and inline as other model code could write it (``reshape`` into
blocks, ``torch.clamp`` with keywords, ``.to(torch.float32)``, scalar-first products), which
canonicalizes to the same graph. The fused ops' CPU references are the same formulas as the
unfused code, so values and scales must equal eager bit for bit (``exact=True``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from helpers.rewrites import BF16, DYNAMIC, DTYPE_MODES, F32, check, fake_process_group, reasons, sites

from fxrewrite.runtime.ops.quant_nvfp4 import quant_e2m1_blocks, quant_nvfp4


def rms_norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    f = h.to(torch.float32)
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return w * f.to(h.dtype)


def nvfp4_inline(y: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's computation in other spellings."""
    blocks = y.to(torch.float32).reshape(*y.shape[:-1], -1, 16)
    amax = torch.abs(blocks).amax(dim=-1)
    scales = torch.clamp(global_scale * (amax * (1 / 6)), min=-448.0, max=448.0).to(torch.float8_e4m3fn)
    t = scales.to(torch.float32) * (1.0 / global_scale)
    v = torch.clamp(blocks * torch.unsqueeze(torch.where(t == 0, 0.0, 1.0 / t), -1), -6.0, 6.0)
    a = torch.abs(v)
    code = torch.where(a < 2, torch.round(2 * a), torch.where(a < 4, torch.round(a) + 2, torch.round(a / 2) + 4))
    code = code + 8 * (v < 0)
    return (code[..., ::2] + 16 * code[..., 1::2]).flatten(-2).to(torch.uint8), scales


def int4_blocks(y: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same block scales, values rounded to integers (an int4-like grid 0..6): not e2m1."""
    blocks = y.float().unflatten(-1, (-1, 16))
    amax = blocks.abs().amax(-1)
    scales = (global_scale * (amax * (1 / 6))).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    t = scales.float() * (1.0 / global_scale)
    v = (blocks * torch.unsqueeze(torch.where(t == 0, 0.0, 1.0 / t), -1)).clamp(-6.0, 6.0)
    code = torch.round(v.abs()) + (v < 0) * 8
    return (code[..., 0::2] + code[..., 1::2] * 16).flatten(-2).to(torch.uint8), scales


def mxfp4_sized(y: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe over blocks of 32 (MXFP4's block size)."""
    return quant_e2m1_blocks(y, global_scale, 32)


SPELLINGS: dict[str, Callable[..., Any]] = {"runtime": quant_nvfp4, "inline": nvfp4_inline}
KINDS = ["norm", "add-norm", "silu", "gelu", "gelu-tanh"]


class Nvfp4Block(torch.nn.Module):
    """``kind`` picks what precedes the quantization."""

    def __init__(self, kind: str, quantize: Callable[..., Any] = quant_nvfp4, hidden: int = 64) -> None:
        super().__init__()
        self.kind, self.quantize = kind, quantize
        # a norm's blocks from tiny to large: some scales underflow to 0, some saturate at 448
        blocks = torch.logspace(-6, 1, hidden // 16).repeat_interleave(16)
        self.weight = torch.nn.Parameter((1 + 0.1 * torch.randn(hidden)) * blocks)
        self.gate_up_proj = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.eps = 1e-6
        self.register_buffer("global_scale", torch.tensor([150.0]))

    def to_dtype(self, dtype: torch.dtype) -> Nvfp4Block:
        """Weights in ``dtype``; the global scale stays one float32 element."""
        self.to(dtype)
        self.global_scale = self.global_scale.float()
        return self

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        if self.kind == "norm":
            return self.quantize(rms_norm(a, self.weight, self.eps), self.global_scale)
        if self.kind == "add-norm":
            s = a * 2 + (b + 1)
            return (*self.quantize(rms_norm(s, self.weight, self.eps), self.global_scale), s)
        gate, up = self.gate_up_proj(a).chunk(2, -1)
        if self.kind == "silu":
            act = F.silu(gate)
        else:
            act = F.gelu(gate, approximate="tanh" if self.kind == "gelu-tanh" else "none")
        return self.quantize(act * up, self.global_scale)


FUSED = {
    # kind: (fused op, rules that fire)
    "norm": ("rms_norm_quant_nvfp4", ["rms_norm_quant_nvfp4"]),
    "add-norm": ("fused_add_rms_norm_quant_nvfp4", ["add_rms_norm_quant_nvfp4"]),
    "silu": ("silu_and_mul_quant_nvfp4", ["silu_and_mul", "silu_and_mul_quant_nvfp4"]),
    "gelu": ("gelu_and_mul_quant_nvfp4", ["gelu_and_mul", "gelu_and_mul_quant_nvfp4"]),
    "gelu-tanh": ("gelu_and_mul_quant_nvfp4", ["gelu_tanh_and_mul", "gelu_and_mul_quant_nvfp4"]),
}
# kind -> what fuses when the quantization does not
FALLBACK = {"norm": "rms_norm", "add-norm": "fused_add_rms_norm_", "silu": "silu_and_mul", "gelu": "gelu_and_mul",
            "gelu-tanh": "gelu_and_mul"}  # fmt: skip


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # rows from tiny to large: an activation's scales underflow to 0 in some, saturate in others
    rows = torch.logspace(-4, 1.5, 6).unsqueeze(-1)
    return (torch.randn(6, 64) * rows).to(dtype), torch.randn(6, 64).to(dtype)


def nvfp4_misses(r: Any) -> list[tuple[str, str]]:
    return [(m.rule, m.reason) for m in r.report.near_misses if "nvfp4" in m.rule]


@pytest.mark.parametrize("kind", KINDS)
@DTYPE_MODES
def test_nvfp4_fusions(kind: str, dtype: torch.dtype, dynamic: bool | str) -> None:
    op, rules = FUSED[kind]
    r = check(Nvfp4Block(kind).to_dtype(dtype), *inputs(dtype), expect={op: 1}, dynamic=dynamic, exact=True)
    assert [s.rule for s in sites(r)] == rules
    assert nvfp4_misses(r) == []
    q, s = r.output[:2]
    assert q.dtype == torch.uint8 and q.shape == (6, 32) and s.dtype == torch.float8_e4m3fn and s.shape == (6, 4)
    assert 0 < int((s.float() == 448).sum()) < s.numel() and int((s.float() == 0).sum()) > 0  # both ends exercised


@pytest.mark.parametrize("kind", KINDS)
@DYNAMIC
def test_nvfp4_spelled_inline_fuses(kind: str, dynamic: bool | str) -> None:
    op, rules = FUSED[kind]
    model = Nvfp4Block(kind, nvfp4_inline).to_dtype(BF16)
    r = check(model, *inputs(BF16), expect={op: 1}, dynamic=dynamic, exact=True)
    assert [s.rule for s in sites(r)] == rules


# -- negative twins -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@DYNAMIC
def test_blocks_of_32_are_not_nvfp4(kind: str, dynamic: bool | str) -> None:
    """The block size binds and the guard refuses anything but 16 (MXFP4's 32 takes power-of-two
    scales: another format); the norm or activation still fuses."""
    op, rules = FUSED[kind]
    model = Nvfp4Block(kind, mxfp4_sized).to_dtype(BF16)
    r = check(model, *inputs(BF16), expect={FALLBACK[kind]: 1}, dynamic=dynamic, exact=True)
    assert set(reasons(r, rules[-1])) == {"guard: blocks of 32 values: NVFP4 scales blocks of 16"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_another_grid_is_not_fused(kind: str, dtype: torch.dtype) -> None:
    """Values rounded to integers (an int4-like grid) under the same scales: the walk back from the
    packing stops at the rounding, a few ops in, too early to be a near miss (silent)."""
    op, rules = FUSED[kind]
    r = check(Nvfp4Block(kind, int4_blocks).to_dtype(dtype), *inputs(dtype), expect={FALLBACK[kind]: 1},
              dynamic=False, exact=True)  # fmt: skip
    assert rules[-1] not in [s.rule for s in sites(r)]
    assert reasons(r, rules[-1]) == []


class BadGlobalScale(Nvfp4Block):
    """A global scale that is not one float32 element (a plain attribute: ``to_dtype`` keeps it)."""

    def __init__(self, kind: str, scale: torch.Tensor) -> None:
        super().__init__(kind)
        self.bad = scale

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        self.global_scale = self.bad
        return super().forward(a, b)


@pytest.mark.parametrize(
    ("scale", "got"),
    [(torch.full((4,), 150.0), "torch.float32(4,)"), (torch.tensor([150.0], dtype=BF16), "torch.bfloat16(1,)")],
    ids=["per-block", "bf16"],
)
@pytest.mark.parametrize("kind", ["norm", "add-norm", "silu"])
def test_global_scale_not_one_float32_element_is_not_fused(kind: str, scale: torch.Tensor, got: str) -> None:
    model = BadGlobalScale(kind, scale).to_dtype(BF16)
    r = check(model, *inputs(BF16), expect={FALLBACK[kind]: 1}, dynamic=False, exact=True)
    assert set(reasons(r, FUSED[kind][1][-1])) == {f"guard: global scale must be one float32 element, got {got}"}


def test_quantized_norm_whose_output_is_also_used_fuses_the_norm_and_the_quantizer_apart() -> None:
    """The norm's output read besides the quantization: the fused op would not produce it; the
    norm and the quantizer alone fuse, each its own op."""

    def both(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = rms_norm(x, w, 1e-6)
        return (*quant_nvfp4(y, g), y)

    x, w = inputs(BF16)[0], torch.randn(64, dtype=BF16)
    r = check(both, x, w, torch.tensor([150.0]), expect={"rms_norm": 1, "quant_nvfp4": 1}, dynamic=False, exact=True)
    assert reasons(r, "rms_norm_quant_nvfp4") == ["internal node `y` has 1 user(s) outside the match (`output`)"]


# -- all-reduce + add + RMSNorm + NVFP4 (tensor parallel) ----------------------------------------


@pytest.fixture
def fake_group() -> Iterator[None]:
    with fake_process_group():
        yield


def all_reduce_model(w: torch.Tensor, block: int = 16) -> Callable[..., Any]:
    g = torch.tensor(300.0)

    def fn(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
        return (*quant_e2m1_blocks(rms_norm(h, w, 1e-6), g, block), h)

    return fn


@DTYPE_MODES
@pytest.mark.usefixtures("fake_group")
def test_all_reduce_add_rms_norm_nvfp4(dtype: torch.dtype, dynamic: bool | str) -> None:
    """The all-reduce that ends a row-parallel linear, the residual add, the norm and NVFP4: one op."""
    w = (1 + 0.1 * torch.randn(64)).to(dtype)
    x, r = torch.randn(4, 64).to(dtype), torch.randn(4, 64).to(dtype)
    res = check(all_reduce_model(w), x, r, expect={"all_reduce_add_rms_norm_quant_nvfp4": 1}, dynamic=dynamic,
                exact=True)  # fmt: skip
    assert [s.rule for s in sites(res)] == ["all_reduce_add_rms_norm_quant_nvfp4"]


@pytest.mark.usefixtures("fake_group")
def test_all_reduce_then_blocks_of_32_fuse_without_the_quantizer() -> None:
    """The twin: MXFP4-sized blocks are refused with the reason; the all-reduce + add + norm
    still fuses (collective.RULES after it)."""
    w = torch.randn(64).to(BF16)
    x, r = torch.randn(4, 64).to(BF16), torch.randn(4, 64).to(BF16)
    res = check(all_reduce_model(w, 32), x, r, expect={"all_reduce_add_rms_norm": 1}, dynamic=False, exact=True)
    assert reasons(res, "all_reduce_add_rms_norm_quant_nvfp4") == ["guard: blocks of 32 values: NVFP4 scales blocks of 16"]
