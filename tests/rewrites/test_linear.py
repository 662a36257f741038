"""The linear rules (rewrites/linear.py) and where the default library applies them.

``fxr.linear`` computes ``F.linear`` (its CPU impl is ``F.linear`` itself, so float32 outputs are
bit-for-bit those of eager); which GEMM runs is the op's choice per call (tests/runtime).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import BF16, DYNAMIC, check, compile_modes, fused_nodes, reasons

from fxrewrite.backend import default_rule_groups
from fxrewrite.rewrites import linear
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


@pytest.mark.parametrize(("mode", "expect"), [("none", {}), ("piecewise", {"linear": 4}), ("full", {"linear": 4})])
def test_the_default_library_selects_gemms_for_replayed_graphs_only(mode: str, expect: dict[str, int]) -> None:
    """Eagerly each linear would pay the custom op's dispatch on the host; replays do not."""
    groups = [name for name, _ in default_rule_groups(mode)]
    assert ("select_gemm" in groups) == (mode != "none") and groups[-1] == ("select_gemm" if expect else "fuse_activation_quant")
    r = compile_once(Projections(), torch.randn(4, 32), mode=mode, capture_sizes=(4, 8), progress=False,
                     merge_siblings=False, **compile_modes(False))  # fmt: skip
    assert r.report.fused_ops() == expect
