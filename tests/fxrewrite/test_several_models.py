"""Several models compiled in one process, as a serving process holds them (a draft and a target
model of one family, another family beside them): each with its own backend and mode, called in
turn, each equals its eager model, compiles once, and reports only its own graph.

Two models of one family run the same transformers code object: Dynamo keeps one cache of
compiled entries per code object, so a backend must not serve the other model's weights nor
recompile for it on every switch.
"""

from __future__ import annotations

import pytest
import torch

import fxrewrite
from fxrewrite import models
from fxrewrite.testing import assert_close


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def test_models_called_in_turn_keep_their_own_graphs_and_reports() -> None:
    draft, target = models.build("llama", layers=2, seed=0), models.build("llama", layers=2, seed=1)
    moe = models.build("mixtral", layers=2)
    backends = {
        "draft": fxrewrite.Backend(progress=False),
        "target": fxrewrite.Backend(mode="piecewise", capture_sizes=(8,), progress=False),
        "moe": fxrewrite.Backend(progress=False),
    }
    eager = {"draft": draft, "target": target, "moe": moe}
    compiled = {name: backends[name].compile(m) for name, m in eager.items()}
    inputs = {name: models.example_inputs(m) for name, m in eager.items()}
    with torch.no_grad():
        want = {name: models.hidden_states(m(*inputs[name])) for name, m in eager.items()}
        assert not torch.allclose(want["draft"], want["target"])  # different weights, one code object
        for _ in range(3):
            for name in ("draft", "target", "moe", "target", "draft"):
                assert_close(models.hidden_states(compiled[name](*inputs[name])), want[name])

    for name, backend in backends.items():
        assert len(backend.graphs) == 1, f"{name} recompiled: {len(backend.graphs)} graphs"
    fused = {name: backend.report.fused_ops() for name, backend in backends.items()}
    assert "moe" in fused["moe"] and "moe" not in fused["draft"] and "moe" not in fused["target"]
    assert fused["draft"]["rotary_embedding"] == fused["target"]["rotary_embedding"] == 2
    backends["target"].refresh_runtime()
    [runtime] = [g.runtime for g in backends["target"].report.graphs]
    assert runtime["mode"] == "piecewise" and runtime["replays"] == runtime["calls"] == 6
    backends["draft"].refresh_runtime()
    assert [g.runtime for g in backends["draft"].report.graphs] == [{}]  # mode none: no runner of its own
