"""``act(a) * b`` of two tensors of one shape -> ``fxr.act_mul`` (rewrites/activation.py, after the
one-tensor GLU rules): a gate multiplying a value that is not the other half of its row.

Each positive case names the op's arguments it expects (activation, operand order) and compares
with eager in float32 and bf16 under each ``dynamic`` setting; each negative twin names the
near miss (or its absence, where the product is no gated activation at all).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, DYNAMIC, F32, check, fused_nodes, reasons, sites

from fxrewrite.rewrites import activation

Act = Callable[[torch.Tensor], torch.Tensor]


def gelu_tanh(g: torch.Tensor) -> torch.Tensor:
    return F.gelu(g, approximate="tanh")


# (activation as model code writes it, the op's activation name)
ACTS = {
    "F.silu": (F.silu, "silu"),
    "nn.SiLU": (torch.nn.SiLU(), "silu"),
    "g*sigmoid(g)": (lambda g: g * torch.sigmoid(g), "silu"),
    "F.gelu": (F.gelu, "gelu"),
    "nn.GELU": (torch.nn.GELU(), "gelu"),
    "gelu-tanh": (gelu_tanh, "gelu_tanh"),
}
DTYPE_DYNAMIC = pytest.mark.parametrize(
    ("dtype", "dynamic"), [(F32, True), (F32, False), (BF16, "lifted"), (BF16, False)],
    ids=["f32-dynamic", "f32-static", "bf16-lifted", "bf16-static"],
)  # fmt: skip


class GatedValue(torch.nn.Module):
    """``act(gate(x)) * v`` (or ``v * act(gate(x))``): the gate a projection of ``x``, the value
    another input (a recurrent branch, a per-layer input), never the other half of one GEMM."""

    def __init__(self, act: Act, act_first: bool = True) -> None:
        super().__init__()
        self.act, self.act_first = act, act_first
        self.gate = torch.nn.Linear(32, 48, bias=False)

    def forward(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = self.act(self.gate(x))
        return g * v if self.act_first else v * g


def act_mul_misses(r: object) -> list[tuple[str, str]]:
    """The near misses of the two-operand rules (the one-tensor rules report what they report)."""
    names = {rule.name for rule in activation.TWO_TENSOR_RULES}
    return [(m.rule, m.reason) for m in r.report.near_misses if m.rule in names]  # type: ignore[attr-defined]


def only_act_mul(r: object, activation_name: str, act_first: bool) -> None:
    (node,) = fused_nodes(r, "act_mul")
    assert list(node.args[2:]) == [activation_name, act_first]  # the order spelled out either way
    rule = {"silu": "silu_mul", "gelu": "gelu_mul", "gelu_tanh": "gelu_tanh_mul"}[activation_name]
    fusions = [s.rule for s in sites(r) if s.rule != "merge_siblings"]  # two projections of x: one GEMM
    assert fusions == [rule if act_first else f"{rule}_reversed"]
    assert not r.report.near_misses  # type: ignore[attr-defined]


@DTYPE_DYNAMIC
@pytest.mark.parametrize("act_first", [True, False], ids=["act-first", "act-second"])
@pytest.mark.parametrize("act", list(ACTS))
def test_act_of_one_tensor_times_another(act: str, act_first: bool, dtype: torch.dtype, dynamic: bool) -> None:
    fn, name = ACTS[act]
    model = GatedValue(fn, act_first).to(dtype)
    x, v = torch.randn(2, 3, 32, dtype=dtype), torch.randn(2, 3, 48, dtype=dtype)
    r = check(model, x, v, expect={"act_mul": 1}, dynamic=dynamic)
    assert r.counts()["aten.mul"] == 0 and r.counts()["aten.silu"] + r.counts()["aten.gelu"] == 0
    only_act_mul(r, name, act_first)


@DTYPE_DYNAMIC
def test_scan_output_times_gate_chunked_off_channels(dtype: torch.dtype, dynamic: bool) -> None:
    """A Mamba mixer: in_proj(x).transpose(1, 2) is [B, 2D, L] and chunks along the channels;
    the product ``scan * silu(gate)`` takes the scan output's layout in eager: so does the op."""
    in_proj = torch.nn.Linear(16, 2 * 24, bias=False).to(dtype)

    def mixer(x: torch.Tensor, scan: torch.Tensor) -> torch.Tensor:
        hidden, gate = in_proj(x).transpose(1, 2).chunk(2, dim=1)
        return (scan + hidden) * F.silu(gate)

    x, scan = torch.randn(2, 5, 16, dtype=dtype), torch.randn(2, 24, 5, dtype=dtype)
    r = check(mixer, x, scan, expect={"act_mul": 1}, dynamic=dynamic)
    only_act_mul(r, "silu", act_first=False)
    assert r.output.stride() == r.eager.stride() == (120, 5, 1)


@DYNAMIC
def test_halves_of_one_view_split_off_the_last_dim_are_one_row(dynamic: bool) -> None:
    """``h.view(B, T, 2, -1)``: act of ``[..., 0, :]`` times ``[..., 1, :]`` is the halves of
    ``h``'s rows (canonicalize_shape: a piece of a split last dim is a last-dim slice): silu_and_mul.
    Pieces 1 and 0 the other way round: act_mul on the two slices."""
    fc1 = torch.nn.Linear(32, 128, bias=False)

    def gating(h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        y = fc1(h).view(b, t, 2, -1)
        return F.silu(y[..., 0, :]) * y[..., 1, :]

    def swapped(h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        y = fc1(h).view(b, t, 2, -1)
        return F.silu(y[..., 1, :]) * y[..., 0, :]

    r = check(gating, torch.randn(2, 3, 32), expect={"silu_and_mul": 1}, dynamic=dynamic)
    assert [s.rule for s in sites(r)] == ["silu_and_mul"]
    r = check(swapped, torch.randn(2, 3, 32), expect={"act_mul": 1}, dynamic=dynamic)
    only_act_mul(r, "silu", act_first=True)


@DYNAMIC
def test_gated_mlp_with_a_scaled_up_projection(dynamic: bool) -> None:
    """``up(x) * mult * silu(gate(x) * mult)``: a product of projections that never merge into one row."""
    gate, up = torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(32, 64, bias=False)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return (up(x) * 0.5) * F.silu(gate(x) * 2.0)

    r = check(mlp, torch.randn(5, 32), expect={"act_mul": 1}, dynamic=dynamic)
    only_act_mul(r, "silu", act_first=False)


def test_halves_of_one_row_still_take_silu_and_mul() -> None:
    """The one-tensor rules run first: a merged gate/up row is silu_and_mul (the libraries'
    kernels), not two operands of act_mul; their halves at unequal offsets fall to act_mul."""
    gate_up = torch.nn.Linear(32, 128, bias=False)

    def halves(x: torch.Tensor) -> torch.Tensor:
        g, u = gate_up(x).chunk(2, dim=-1)
        return u * F.silu(g)

    r = check(halves, torch.randn(4, 32), expect={"silu_and_mul": 1}, dynamic=False)
    assert [s.rule for s in sites(r)] == ["silu_and_mul"]
    assert activation.RULES[:3] == activation.ONE_TENSOR_RULES
    def overlapping(x: torch.Tensor) -> torch.Tensor:
        y = gate_up(x)
        return F.silu(y[..., :64]) * y[..., 32:96]

    r = check(overlapping, torch.randn(4, 32), expect={"act_mul": 1}, dynamic=False)
    assert [s.rule for s in sites(r)] == ["silu_mul"]


# -- negative twins -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value_shape", "why"),
    [((4, 1), "(4, 48) and (4, 1)"), ((48,), "(4, 48) and (48,)")],
    ids=["per-token-scale", "per-channel-vector"],
)
def test_broadcast_operand_is_a_near_miss(value_shape: tuple[int, ...], why: str) -> None:
    r = check(GatedValue(F.silu), torch.randn(4, 32), torch.randn(value_shape), expect={}, dynamic=False)
    assert reasons(r, "silu_mul") == [f"guard: operand shapes {why} differ (broadcast)"]


def test_broadcast_near_miss_is_reported_once_whatever_the_operand_order() -> None:
    r = check(GatedValue(F.silu, act_first=False), torch.randn(4, 32), torch.randn(4, 1), expect={}, dynamic=False)
    assert act_mul_misses(r) == [
        ("silu_mul", "guard: operand shapes (4, 48) and (4, 1) differ (broadcast)")
    ]


@DYNAMIC
def test_bf16_gate_times_float32_value_promotes_as_eager(dynamic: bool) -> None:
    """A bf16 model's Mamba mixer: the scan output is float32, the gate bf16; eager rounds the
    SiLU to bf16 and multiplies in float32: so does the op (bit for bit on CPU)."""
    gate = torch.nn.Linear(32, 48, bias=False).to(BF16)
    r = check(lambda x, v: v * F.silu(gate(x)), torch.randn(4, 32, dtype=BF16), torch.randn(4, 48), expect={"act_mul": 1},
              dynamic=dynamic, exact=True)  # fmt: skip
    assert r.output.dtype == F32
    only_act_mul(r, "silu", act_first=False)


def test_integer_operand_is_a_near_miss() -> None:
    """A 0/1 mask of integers is no gated value: the op multiplies floats."""
    r = check(lambda x, m: F.silu(x) * m, torch.randn(4, 48), torch.ones(4, 48, dtype=torch.int64), expect={},
              dynamic=False)  # fmt: skip
    assert reasons(r, "silu_mul") == ["guard: operand dtypes torch.float32 and torch.int64: not both floating point"]


@pytest.mark.parametrize("scalar", [2.0, "lifted"])
def test_activation_times_a_scalar_is_not_a_site(scalar: object) -> None:
    """A scaled activation is no gated activation: not fused, and no near miss."""

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.silu(x) * (self.scale if scalar == "lifted" else 2.0)

    r = check(Scaled(), torch.randn(4, 48), expect={}, dynamic="lifted" if scalar == "lifted" else False)
    assert act_mul_misses(r) == []


def test_activation_read_elsewhere_is_not_fused() -> None:
    """The activation is also returned: fusing would compute it twice (two kernels again), so the
    site stays as written and the near miss names the other reader."""

    def two_readers(x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.gelu(x)
        return h * v, h + 1

    r = check(two_readers, torch.randn(4, 48), torch.randn(4, 48), expect={}, dynamic=False)
    assert reasons(r, "gelu_mul") == ["internal node `h` has 1 user(s) outside the match (`add`)"]


def test_relu_gate_is_no_act_mul() -> None:
    r = check(GatedValue(torch.relu), torch.randn(4, 32), torch.randn(4, 48), expect={}, dynamic=False)
    assert act_mul_misses(r) == []
