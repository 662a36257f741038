"""Gated activation rules (rewrites/activation.py): SiLU-and-mul, GELU-and-mul (erf and tanh).

The gate/up tensor comes out of one merged linear, as in vLLM-style model code (its last dim
is static under dynamic=True too); how HF's two projections reach these rules is test_merge.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, DYNAMIC, F32, check, fused_nodes, reasons, sites

from fxrewrite.canonicalize import MAX
from fxrewrite.rewrites import activation

Act = Callable[[torch.Tensor], torch.Tensor]


def chunk(gu: torch.Tensor, act: Act) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return act(gate) * up


def split(gu: torch.Tensor, act: Act) -> torch.Tensor:
    gate, up = torch.split(gu, gu.shape[-1] // 2, dim=-1)
    return up * act(gate)  # up first


def slices(gu: torch.Tensor, act: Act) -> torch.Tensor:
    d = gu.shape[-1] // 2
    return act(gu[..., :d]) * gu[..., d:]


def split_sections(gu: torch.Tensor, act: Act) -> torch.Tensor:
    gate, up = gu.split([64, 64], -1)
    return act(gate) * up


SPLITS = {"chunk": chunk, "split": split, "slices": slices, "split-sections": split_sections}


class GatedMLP(torch.nn.Module):
    """``down(act(gate) * up)`` over a merged gate_up projection, halves taken by ``halves``."""

    def __init__(self, act: Act, halves: Callable[[torch.Tensor, Act], torch.Tensor] = chunk, inter: int = 64):
        super().__init__()
        self.act, self.halves = act, halves
        self.gate_up_proj = torch.nn.Linear(32, 2 * inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.halves(self.gate_up_proj(x), self.act))


SILUS: dict[str, Act] = {"F.silu": F.silu, "nn.SiLU": torch.nn.SiLU(), "g*g.sigmoid()": lambda g: g * g.sigmoid()}
DTYPE_DYNAMIC = pytest.mark.parametrize(
    ("dtype", "dynamic"), [(F32, True), (F32, False), (BF16, "lifted")], ids=["f32-dynamic", "f32-static", "bf16-lifted"]
)


@DTYPE_DYNAMIC
@pytest.mark.parametrize("halves", list(SPLITS))
def test_silu_and_mul_over_every_way_to_take_halves(halves: str, dtype: torch.dtype, dynamic: bool) -> None:
    model = GatedMLP(F.silu, SPLITS[halves]).to(dtype)
    r = check(model, torch.randn(2, 3, 32, dtype=dtype), expect={"silu_and_mul": 1}, dynamic=dynamic)
    assert [s.rule for s in sites(r)] == ["silu_and_mul"]
    assert not r.report.near_misses


@pytest.mark.parametrize("silu", list(SILUS))
def test_silu_and_mul_silu_spellings(silu: str) -> None:
    check(GatedMLP(SILUS[silu], slices), torch.randn(5, 32), expect={"silu_and_mul": 1})


@pytest.mark.parametrize(
    "silu", [lambda g: g * torch.sigmoid(g), lambda g: torch.sigmoid(g) * g], ids=["g*sigmoid(g)", "sigmoid(g)*g"]
)
@DYNAMIC
def test_silu_spelled_x_times_sigmoid(silu: Act, dynamic: bool) -> None:
    """Canonicalized to silu (the orphaned sigmoid erased at once, or `g` looks used outside)."""
    r = check(GatedMLP(silu), torch.randn(5, 32), expect={"silu_and_mul": 1}, dynamic=dynamic)
    assert "aten.sigmoid" not in r.counts()


def gelu_tanh(g: torch.Tensor) -> torch.Tensor:
    return F.gelu(g, approximate="tanh")


# nn.GELU modules once; the functional forms under every dtype and dynamic setting.
GELUS = [
    pytest.param(gelu, approx, dtype, dynamic, id=f"{name}-{dt_id}")
    for name, gelu, approx in (("F.gelu", F.gelu, "none"), ("F.gelu-tanh", gelu_tanh, "tanh"))
    for dtype, dynamic, dt_id in ((F32, True, "f32-dynamic"), (F32, False, "f32-static"), (BF16, True, "bf16-dynamic"))
] + [
    pytest.param(torch.nn.GELU(), "none", F32, True, id="nn.GELU"),
    pytest.param(torch.nn.GELU(approximate="tanh"), "tanh", F32, True, id="nn.GELU-tanh"),
]


@pytest.mark.parametrize(("gelu", "approximate", "dtype", "dynamic"), GELUS)
def test_gelu_and_mul_erf_and_tanh(gelu: Act, approximate: str, dtype: torch.dtype, dynamic: bool) -> None:
    r = check(GatedMLP(gelu).to(dtype), torch.randn(4, 32, dtype=dtype), expect={"gelu_and_mul": 1}, dynamic=dynamic)
    (node,) = fused_nodes(r, "gelu_and_mul")
    assert (node.args[1:] or ("none",))[0] == approximate
    assert [s.rule for s in sites(r)] == ["gelu_tanh_and_mul" if approximate == "tanh" else "gelu_and_mul"]


@DTYPE_DYNAMIC
def test_halves_inside_a_wider_row_fuse_on_a_slice(dtype: torch.dtype, dynamic: bool) -> None:
    """q, k, v, gate and up merged into one GEMM (attention and MLP read one norm output): the
    gate starts past q/k/v; the op reads the slice [a:e] (the Triton kernel takes its row stride)."""
    proj = torch.nn.Linear(32, 160, bias=False).to(dtype)  # [qkv 0:32 | gate 32:96 | up 96:160]

    def block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = proj(x)
        return y[..., :32], F.silu(y[..., 32:96]) * y[..., 96:160]

    r = check(block, torch.randn(2, 3, 32, dtype=dtype), expect={"silu_and_mul": 1}, dynamic=dynamic)
    (node,) = fused_nodes(r, "silu_and_mul")
    assert node.args[0].target is torch.ops.aten.slice.Tensor and node.args[0].args[2:4] == (32, MAX)  # to the end
    assert not r.report.near_misses


# -- negative twins -----------------------------------------------------------------------------


def overlapping(gu: torch.Tensor, act: Act) -> torch.Tensor:
    return act(gu[..., :64]) * gu[..., 32:96]


def gaps(gu: torch.Tensor, act: Act) -> torch.Tensor:
    return act(gu[..., :48]) * gu[..., 80:]


def swapped(gu: torch.Tensor, act: Act) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return act(up) * gate  # activation on the second half: not what silu_and_mul computes


def along_tokens(gu: torch.Tensor, act: Act) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=0)
    return act(gate) * up


@pytest.mark.parametrize(
    ("halves", "reason"),
    [
        (overlapping, "32 != bound b 64"),
        (gaps, "80 != bound b 48"),
        (swapped, "0 != bound b end"),
        (along_tokens, "`gate` dim: literal -2 != -1"),
    ],
    ids=["overlapping-slices", "slices-with-gap", "activation-on-second-half", "chunk-along-tokens"],
)
def test_silu_and_mul_negative_twins(halves: Callable[[torch.Tensor, Act], torch.Tensor], reason: str) -> None:
    """Not the halves of one row: the one-tensor rule says why; the library then takes the two
    equally shaped operands as ``fxr.act_mul`` (tests/rewrites/test_activation_act_mul.py)."""
    gate_up = torch.nn.Linear(32, 128, bias=False)
    r = check(lambda x: halves(gate_up(x), F.silu), torch.randn(4, 32), expect={}, dynamic=False,
              rules=activation.ONE_TENSOR_RULES)  # fmt: skip
    assert reasons(r, "silu_and_mul") == [reason]
    check(lambda x: halves(gate_up(x), F.silu), torch.randn(4, 32), expect={"act_mul": 1}, dynamic=False)


@pytest.mark.parametrize(("gelu", "rule"), [(F.gelu, "gelu_and_mul"), (gelu_tanh, "gelu_tanh_and_mul")])
def test_gelu_and_mul_negative_twin_activation_on_second_half(gelu: Act, rule: str) -> None:
    gate_up = torch.nn.Linear(32, 128, bias=False)
    r = check(lambda x: swapped(gate_up(x), gelu), torch.randn(4, 32), expect={}, dynamic=False,
              rules=activation.ONE_TENSOR_RULES)  # fmt: skip
    assert reasons(r, rule) == ["0 != bound b end"]
    check(lambda x: swapped(gate_up(x), gelu), torch.randn(4, 32), expect={"act_mul": 1}, dynamic=False)


def test_slices_at_a_quarter_fail_the_halves_guard() -> None:
    """``act(x[..., :d]) * x[..., d:]`` with d not half the last dim (a size-1 gate broadcasts):
    structurally the pattern, rejected by the guard."""

    def quarter(x: torch.Tensor) -> torch.Tensor:
        return F.silu(x[..., :1]) * x[..., 1:]

    r = check(quarter, torch.randn(4, 4), expect={}, dynamic=False)
    assert reasons(r, "silu_and_mul") == ["guard: gate [0:1] and up [1:4] differ in width (last dim 4)"]


def test_relu_gate_is_not_silu_and_mul() -> None:
    """Not even a near miss: the walk fails at the activation, one pattern op in (under the
    default near_miss_min of 0.5)."""
    r = check(GatedMLP(torch.relu), torch.randn(4, 32), expect={}, dynamic=False)
    assert not r.report.near_misses


def test_gelu_erf_rule_does_not_take_tanh_and_back() -> None:
    """The erf and tanh forms differ by a keyword: each rule takes only its own."""
    r = check(GatedMLP(lambda g: F.gelu(g, approximate="tanh")), torch.randn(4, 32), expect={"gelu_and_mul": 1})
    assert [s.rule for s in sites(r)] == ["gelu_tanh_and_mul"]
    assert activation.ONE_TENSOR_RULES == [activation.SILU_AND_MUL, activation.GELU_AND_MUL, activation.GELU_TANH_AND_MUL]
    assert activation.RULES == activation.ONE_TENSOR_RULES + activation.TWO_TENSOR_RULES


@DYNAMIC
def test_chunk_of_a_symbolic_last_dim_is_a_near_miss_not_a_silent_one(dynamic: bool) -> None:
    """A graph input's last dim is symbolic under dynamic=True: ``chunk`` along it stays a
    ``getitem`` of the chunk (canonicalization needs static sizes to write slices) and the report
    says so; the library then fuses the two equal halves as ``fxr.act_mul``. Static: silu_and_mul.
    Model code chunks a projection's output, whose last dim is static."""
    expect = {} if dynamic else {"silu_and_mul": 1}
    r = check(lambda x: chunk(x, F.silu), torch.randn(4, 64), expect=expect, dynamic=dynamic,
              rules=activation.ONE_TENSOR_RULES)  # fmt: skip
    assert reasons(r, "silu_and_mul") == (["expected `slice`, found `getitem` (`gate`)"] if dynamic else [])
    expect = {"act_mul": 1} if dynamic else {"silu_and_mul": 1}
    check(lambda x: chunk(x, F.silu), torch.randn(4, 64), expect=expect, dynamic=dynamic)
