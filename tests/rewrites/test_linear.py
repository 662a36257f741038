"""The linear rules (rewrites/linear.py) and where the default library applies them.

``fxr.linear`` computes ``F.linear`` (its CPU impl is ``F.linear`` itself, so float32 outputs are
bit-for-bit those of eager); which GEMM runs is the op's choice per call (tests/runtime).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, DYNAMIC, check, compile_modes, fused, fused_nodes, misses, reasons

from fxrewrite import meta
from fxrewrite.backend import default_rule_groups
from fxrewrite.rewrite import apply_rules, planned_calls
from fxrewrite.rewrites import activation, linear
from fxrewrite.runtime import providers
from fxrewrite.testing import compile_once


class Projections(torch.nn.Module):
    """Every way model code spells a linear: ``nn.Linear`` with and without a bias, ``F.linear``
    on a parameter, ``x @ w.T``. The last two read the same input: the tests turn sibling
    merging off, or they would be one GEMM (tests/rewrites/test_merge.py)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.up = torch.nn.Linear(32, 48, dtype=dtype)
        self.down = torch.nn.Linear(48, 32, bias=False, dtype=dtype)
        self.w = torch.nn.Parameter(torch.randn(24, 32, dtype=dtype) * 0.2)
        self.v = torch.nn.Parameter(torch.randn(16, 32, dtype=dtype) * 0.2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.down(torch.relu(self.up(x)))
        return h, F.linear(h, self.w), h @ self.v.T


@DYNAMIC
def test_every_spelling_becomes_fxr_linear(dynamic: bool | str) -> None:
    r = check(Projections(), torch.randn(5, 32), rules=linear.RULES, expect={"linear": 4}, dynamic=dynamic, exact=True,
              merge_siblings=False)  # fmt: skip
    biases = [n.args[2] if len(n.args) > 2 else n.kwargs.get("bias") for n in fused_nodes(r, "linear")]
    assert sum(b is not None for b in biases) == 1  # only `up` has a bias, and it is kept


def test_bf16_and_a_batch_of_rows() -> None:
    check(Projections(BF16), torch.randn(2, 3, 32).to(BF16), rules=linear.RULES, expect={"linear": 4},
          merge_siblings=False)  # fmt: skip


def test_a_vector_weight_is_a_near_miss() -> None:
    """Negative twin: ``F.linear`` with a 1-D weight is a dot product; the guard says why it stays."""
    v = torch.randn(32)
    r = check(lambda x: F.linear(x, v), torch.randn(4, 32), rules=linear.RULES, expect={}, dynamic=False)
    assert reasons(r, "linear") == ["guard: weight is 1-D, not a matrix"]


def test_a_matmul_without_transpose_stays() -> None:
    """Negative twin: ``x @ v`` reads ``v`` as [k, n]: no linear to rewrite."""
    v = torch.randn(32, 16)
    check(lambda x: x @ v, torch.randn(4, 32), rules=linear.RULES, expect={}, dynamic=False)


class GatedMLP(torch.nn.Module):
    """An MLP as LLMs write it: a merged gate and up projection (``nn.Linear``, or separate gate
    and up linears that ``merge_siblings`` merges), SiLU-and-mul, the down projection.
    ``leak``: the projection's output is returned as well (its value is needed, not only the
    activation's)."""

    def __init__(self, bias: bool = False, separate: bool = False, leak: bool = False) -> None:
        super().__init__()
        self.separate, self.leak = separate, leak
        if separate:
            self.gate, self.up = torch.nn.Linear(32, 48, bias=bias), torch.nn.Linear(32, 48, bias=bias)
        else:
            self.gate_up = torch.nn.Linear(32, 96, bias=bias)
        self.down = torch.nn.Linear(48, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.separate:
            h = F.silu(self.gate(x)) * self.up(x)
            return self.down(h)
        gate_up = self.gate_up(x)
        gate, up = gate_up.chunk(2, dim=-1)
        out = self.down(F.silu(gate) * up)
        return (out, gate_up) if self.leak else out


@DYNAMIC
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("separate", [False, True], ids=["merged", "separate"])
def test_gate_up_and_silu_and_mul_become_one_op(bias: bool, separate: bool, dynamic: bool | str) -> None:
    """The gate and up projection followed by SiLU-and-mul (after ``fuse_activation``) is one
    ``fxr.linear_silu_and_mul``; the down projection stays a plain ``fxr.linear``."""
    r = check(GatedMLP(bias, separate), torch.randn(5, 32), rules=activation.RULES + linear.RULES,
              expect={"linear_silu_and_mul": 1, "linear": 1}, dynamic=dynamic)  # fmt: skip
    (node,) = fused_nodes(r, "linear_silu_and_mul")
    assert (len(node.args) > 2 and node.args[2] is not None) == bias


def test_a_projection_read_elsewhere_keeps_its_own_linear() -> None:
    """Negative twin: when the projection's output is used beyond the activation, fusing would
    lose that value: the linear and SiLU-and-mul stay two ops."""
    check(GatedMLP(leak=True), torch.randn(5, 32), rules=activation.RULES + linear.RULES,
          expect={"silu_and_mul": 1, "linear": 2})  # fmt: skip


def test_the_gated_rule_wants_gate_and_up_halves() -> None:
    """Negative twin of the guard: SiLU-and-mul on an odd-width projection cannot split a
    [n, k] weight into gate and up rows."""
    assert linear.gate_up_weight({"w": torch.randn(7, 4)}) == "weight has 7 rows, not gate and up halves"
    assert linear.gate_up_weight({"w": torch.randn(4)}) == "weight is 1-D, not a matrix"
    assert linear.gate_up_weight({"w": torch.randn(8, 4)}) is True


def _fxr_call(target: object) -> bool:
    return providers.op_def(target) is not None


def _before_select_gemm(leak: bool) -> torch.fx.GraphModule:
    """The GatedMLP's graph as the select_gemm pass finds it (SiLU-and-mul fused), dynamic rows."""
    return compile_once(GatedMLP(leak=leak), torch.randn(5, 32), rules=activation.RULES, dynamic=True).backend.graphs[0]


@pytest.mark.parametrize("leak", [False, True], ids=["mlp", "projection_read_elsewhere"])
def test_planned_calls_are_the_calls_the_pass_will_make(leak: bool) -> None:
    """What the runtime builds ahead of the select_gemm pass: the gated op for the gate_up
    projection and the plain one for the down projection, on fake tensors at the traced sizes
    (no symbols, outside the graph's shape environment), from a scan that changes nothing and
    adds no guard. Negative twin: a projection read elsewhere is planned as a plain linear,
    as the pass will rewrite it."""
    gm = _before_select_gemm(leak)
    code, env = gm.code, meta.fake_mode_of(gm.graph).shape_env
    guards = len(env.guards)
    calls = planned_calls(gm, linear.RULES, _fxr_call)
    assert gm.code == code and len(env.guards) == guards
    got = [(providers.op_def(t).name, [tuple(a.shape) for a in args], kwargs) for t, args, kwargs in calls]
    gate_up = ("linear", [(5, 32), (96, 32)], {}) if leak else ("linear_silu_and_mul", [(5, 32), (96, 32)], {})
    assert sorted(got) == sorted([gate_up, ("linear", [(5, 48), (32, 48)], {})])
    graph_mode = meta.fake_mode_of(gm.graph)
    assert all(a.fake_mode is not graph_mode and all(isinstance(d, int) for d in a.shape) for _, args, _ in calls
               for a in args)  # fmt: skip


def test_planned_calls_walk_only_anchors_a_match_could_start_at(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan ahead of a pass tries a rule at an anchor only where the walk could get past the
    anchor (``_may_match``; on a 32-layer Llama 4,904 walks instead of 15,660): every library rule
    of the pipeline on a Llama layer's graph, and the same planned calls as walking every anchor gives."""
    from fxrewrite import rewrite

    from fxrewrite import models

    llama = models.build("llama", layers=1)
    gm = compile_once(llama, *models.example_inputs(llama), rules=[]).backend.graphs[0]  # canonicalized, no rule
    rules = [r for _, group in default_rule_groups("full") for r in group]
    walks: list[tuple[Any, Any]] = []
    original = rewrite.match_at
    monkeypatch.setattr(rewrite, "match_at", lambda rule, anchor: walks.append((rule, anchor)) or original(rule, anchor))
    calls = planned_calls(gm, rules, _fxr_call)
    index = rewrite.Anchors(gm.graph)
    skipped = [(r, a) for r in rules if r.via == "walk" for a in index.get(r.compiled.anchor_targets)
               if not rewrite._may_match(r.compiled.anchor, a)]  # fmt: skip
    assert walks and skipped  # rules were tried, and some anchors could not start a match
    assert all(rewrite._may_match(r.compiled.anchor, a) for r, a in walks)
    monkeypatch.setattr(rewrite, "_may_match", lambda p, g: True)  # every anchor walked: the same calls
    names = sorted(providers.op_def(t).name for t, _, _ in calls)
    assert names and names == sorted(providers.op_def(t).name for t, _, _ in planned_calls(gm, rules, _fxr_call))


def test_a_rules_pass_hands_its_planned_calls_to_prebuild_before_verifying() -> None:
    """``apply_rules`` gives the prebuild every planned call before the first match is verified
    and puts its line in the pass's notes."""
    gm, verified, seen = _before_select_gemm(False), [], {}

    class Recorder:
        def wants(self, target: object) -> bool:
            return _fxr_call(target)

        def __call__(self, calls: list) -> str:
            seen.update(calls=len(calls), verified=len(verified))
            return "0 kernels built ahead"

    result = apply_rules(gm, linear.RULES, verify=lambda m: verified.append(m.rule.name), prebuild=Recorder())
    assert seen == {"calls": 2, "verified": 0} and result.notes == ["0 kernels built ahead"]
    assert sorted(verified) == ["linear", "linear_silu_and_mul"] and result.matches == 2


@pytest.mark.parametrize(("mode", "expect"), [("none", {}), ("piecewise", {"linear": 4}), ("full", {"linear": 4})])
def test_the_default_library_selects_gemms_for_replayed_graphs_only(mode: str, expect: dict[str, int]) -> None:
    """Eagerly each linear would pay the custom op's dispatch on the host; replays do not."""
    groups = [name for name, _ in default_rule_groups(mode)]
    assert ("select_gemm" in groups) == (mode != "none") and groups[-1] == ("select_gemm" if expect else "fuse_quant")
    r = compile_once(Projections(), torch.randn(4, 32), mode=mode, capture_sizes=(4, 8), progress=False,
                     merge_siblings=False, **compile_modes(False))  # fmt: skip
    assert r.report.fused_ops() == expect


# --------------------------------------------------------------------------- FP8 (per-tensor scales)

FP8 = torch.float8_e4m3fn


class Fp8Projections(torch.nn.Module):
    """Static FP8 linears as checkpoints with per-tensor scales run them: the input quantized with
    a calibrated scale, ``torch._scaled_mm`` on the e4m3 weight's transpose, spelled ``.t()``,
    ``.T`` and ``permute(1, 0)``; ``scales``: "tensor" (one float32 each), "row" (one per row of the
    input and per column of the weight: another recipe)."""

    def __init__(self, out_dtype: torch.dtype = BF16, scales: str = "tensor") -> None:
        super().__init__()
        self.out_dtype, self.scales = out_dtype, scales
        self.w = torch.nn.Parameter((torch.randn(48, 32) * 0.5).to(FP8), requires_grad=False)
        self.v = torch.nn.Parameter((torch.randn(16, 48) * 0.5).to(FP8), requires_grad=False)
        self.sw = torch.nn.Parameter(torch.tensor(0.02), requires_grad=False)
        self.sv = torch.nn.Parameter(torch.tensor(0.03), requires_grad=False)
        self.sx = torch.nn.Parameter(torch.tensor(0.05), requires_grad=False)

    def quant(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() / self.sx).clamp(-448, 448).to(FP8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xq = self.quant(x)
        if self.scales == "row":
            sa = self.sx.expand(xq.shape[0], 1).contiguous()
            h = torch._scaled_mm(xq, self.w.t(), scale_a=sa, scale_b=self.sw.expand(1, 48).contiguous(),
                                 out_dtype=self.out_dtype)  # fmt: skip
        else:
            h = torch._scaled_mm(xq, self.w.t(), scale_a=self.sx, scale_b=self.sw, out_dtype=self.out_dtype)
        hq = self.quant(torch.relu(h))
        return h, torch._scaled_mm(hq, self.v.T, self.sx, self.sv, out_dtype=self.out_dtype), \
            torch._scaled_mm(hq, self.v.permute(1, 0), scale_a=self.sx, scale_b=self.sv, out_dtype=self.out_dtype)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("out_dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_an_fp8_linear_with_per_tensor_scales_becomes_fxr_linear_fp8(dynamic: bool, out_dtype: torch.dtype) -> None:
    """Every spelling of the weight's transpose, the scales as keywords or positional: one op each,
    bit for bit eager's on CPU (its CPU impl is ``_scaled_mm`` itself); the op keeps the weight
    as stored (no transposed copy) and the output dtype."""
    r = check(Fp8Projections(out_dtype), torch.randn(6, 32), rules=linear.RULES, expect={"linear_fp8": 3},
              dynamic=dynamic, exact=True, merge_siblings=False)  # fmt: skip
    for node in fused_nodes(r, "linear_fp8"):
        assert node.args[1].op == "placeholder" or node.args[1].op == "get_attr", node.args[1]
        assert node.args[4] == out_dtype


def test_an_fp8_linear_in_the_default_library_only_where_graphs_are_replayed() -> None:
    """The rule is in select_gemm: modes piecewise and full, not none (the op's host dispatch)."""
    names = {mode: [r.name for _, rules in default_rule_groups(mode) for r in rules] for mode in ("none", "full")}
    assert "linear_fp8" in names["full"] and "linear_fp8" not in names["none"]
    check(Fp8Projections(), torch.randn(6, 32), expect={"linear_fp8": 3}, mode="piecewise", merge_siblings=False)


def _row_wise_scaled_mm_runs_on_cpu() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (2.13's does; 2.11's raises)."""
    x, w = torch.ones(2, 16).to(FP8), torch.ones(16, 16).to(FP8)
    try:
        torch._scaled_mm(x, w.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 16), out_dtype=BF16)
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not _row_wise_scaled_mm_runs_on_cpu(), reason=f"torch {torch.__version__}'s CPU _scaled_mm refuses row-wise scales")
def test_row_wise_scales_are_a_near_miss() -> None:
    """Negative twin: scales per row of the input and per column of the weight (another recipe);
    the guard says why the first GEMM stays ``_scaled_mm``."""
    r = check(Fp8Projections(scales="row"), torch.randn(6, 32), rules=linear.RULES, expect={"linear_fp8": 2},
              dynamic=False, exact=True, merge_siblings=False)  # fmt: skip
    assert reasons(r, "linear_fp8") == ["guard: scale_a is (6, 1) torch.float32: not one float32 scale per tensor"]


def test_a_scaled_mm_with_a_bias_stays() -> None:
    """Negative twin: a bias inside ``_scaled_mm`` is not the pattern's (None); nothing is rewritten."""
    w, sx, sw = (torch.randn(48, 32) * 0.5).to(FP8), torch.tensor(0.05), torch.tensor(0.02)
    bias = torch.randn(48, dtype=BF16)

    def fn(x: torch.Tensor) -> torch.Tensor:
        xq = (x / sx).clamp(-448, 448).to(FP8)
        return torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=sw, bias=bias, out_dtype=BF16)

    check(fn, torch.randn(6, 32), rules=linear.RULES, expect={}, dynamic=False, exact=True)


class Fp8Mlp(torch.nn.Module):
    """An FP8 MLP as static FP8 checkpoints run it: the input quantized, the merged gate and up
    projection, SiLU-and-mul, the down projection's input quantized with its static scale, the down
    projection. ``leak``: the gate and up projection's output is returned too."""

    def __init__(self, leak: bool = False) -> None:
        super().__init__()
        self.leak = leak
        self.gate_up = torch.nn.Parameter((torch.randn(96, 32) * 0.5).to(FP8), requires_grad=False)
        self.down = torch.nn.Parameter((torch.randn(32, 48) * 0.5).to(FP8), requires_grad=False)
        self.scales = torch.nn.Parameter(torch.tensor([0.05, 0.02, 0.01, 0.03]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> Any:
        sx, sg, sh, sd = self.scales[0], self.scales[1], self.scales[2], self.scales[3]
        xq = (x.float() / sx).clamp(-448, 448).to(FP8)
        y = torch._scaled_mm(xq, self.gate_up.t(), scale_a=sx, scale_b=sg, out_dtype=BF16)
        h = F.silu(y[..., :48]) * y[..., 48:]
        hq = (h.float() / sh).clamp(-448, 448).to(FP8)
        out = torch._scaled_mm(hq, self.down.t(), scale_a=sh, scale_b=sd, out_dtype=BF16)
        return (out, y) if self.leak else out


FP8_MLP_OPS = {"linear_fp8_silu_and_mul_quant": 1, "linear_fp8": 1}


def test_an_fp8_mlp_takes_its_activation_and_quantization_into_the_gate_up_gemm() -> None:
    """The default library, piecewise: gate_up with SiLU-and-mul and the down projection's
    quantization is one op, the down projection another; bit for bit eager's on CPU."""
    r = check(Fp8Mlp(), torch.randn(6, 32, dtype=BF16), expect=FP8_MLP_OPS, mode="piecewise", exact=True)
    [node] = fused_nodes(r, "linear_fp8_silu_and_mul_quant")
    assert node.args[4] == BF16


def test_an_fp8_mlp_whose_projection_is_read_elsewhere_keeps_two_ops() -> None:
    """Negative twin: the gate and up output is also returned, so it must be stored: the GEMM
    stays ``fxr.linear_fp8`` beside ``fxr.silu_and_mul_quant_fp8``, and the near miss says why."""
    r = check(Fp8Mlp(leak=True), torch.randn(6, 32, dtype=BF16), mode="piecewise", exact=True,
              expect={**{k: v for k, v in FP8_MLP_OPS.items() if k != "linear_fp8_silu_and_mul_quant"},
                      "linear_fp8": 2, "silu_and_mul_quant_fp8": 1})  # fmt: skip
    assert misses(r, "linear_fp8_silu_and_mul_quant"), "the refused site is a near miss"
