"""The rule library on HF transformers' MoE decoders: Mixtral (top-k renormalized), Qwen2-MoE (a
shared expert beside the routed ones), OLMoE (weights as the softmax gives them).

Tiny configs with random weights (``fxrewrite.models.build``), CPU, ``fullgraph=True``, as in
test_families.py: exact fused-op counts as a function of the layer count L, compiled output
against eager, no near misses. Every experts implementation of transformers that compiles with
``fullgraph=True`` (``grouped_mm``, the default, and ``batched_mm``) fuses into one ``fxr.moe``
per layer; the eager loop does not compile (it iterates over a data-dependent ``nonzero``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from helpers.families import in_turn
from helpers.moe import run_bf16
from helpers.rewrites import BF16, F32, compile_modes, fused, fused_nodes, sites

from fxrewrite import meta, models
from fxrewrite.__main__ import main
from fxrewrite.testing import Compiled, compile_once

# family -> fused op -> (count per layer, count once per model). The add + norm after each MoE
# block runs functional: its residual is the block's output reshaped (a view), which the
# in-place check refuses; the one after attention overwrites in place.
TABLE: dict[str, dict[str, tuple[int, int]]] = {
    "mixtral": {"moe": (1, 0), "rms_norm": (0, 1), "fused_add_rms_norm_": (1, 0), "fused_add_rms_norm": (1, 0),
                "rotary_embedding": (1, 0)},
    # the shared expert: a plain MLP, its gate and up merged apart from the router beside them
    "qwen2_moe": {"moe": (1, 0), "rms_norm": (0, 1), "fused_add_rms_norm_": (1, 0), "fused_add_rms_norm": (1, 0),
                  "rotary_embedding": (1, 0), "silu_and_mul": (1, 0)},
    # q and k norms over the whole projection
    "olmoe": {"moe": (1, 0), "rms_norm": (2, 1), "fused_add_rms_norm_": (1, 0), "fused_add_rms_norm": (1, 0),
              "rotary_embedding": (1, 0)},
}  # fmt: skip
RENORMALIZE = {"mixtral": True, "qwen2_moe": False, "olmoe": False}

PAIRS = (
    (2, F32, True, "f32-dynamic", "grouped_mm"), (1, F32, False, "f32-static", "grouped_mm"),
    (1, BF16, "lifted", "bf16-lifted", "grouped_mm"), (1, BF16, True, "bf16-dynamic", "batched_mm"),
)
CASES = [  # the default run takes the pairs in turn (helpers.families.in_turn)
    pytest.param(family, layers, dtype, dynamic, experts, id=f"{family}-L{layers}-{name}-{experts}",
                 marks=in_turn(i, j, len(models.MOE_FAMILIES), len(PAIRS)))
    for i, family in enumerate(models.MOE_FAMILIES)
    for j, (layers, dtype, dynamic, name, experts) in enumerate(PAIRS)
]  # fmt: skip
TOLERANCE = {F32: 1e-5, BF16: 2e-2}  # max relative error against eager


def expected(family: str, layers: int) -> dict[str, int]:
    return {op: per_layer * layers + once for op, (per_layer, once) in TABLE[family].items()}


@functools.cache
def compiled(family: str, layers: int, dtype: torch.dtype, dynamic: bool | str, experts: str,
             tokens: int = 8) -> Compiled:  # fmt: skip
    model = models.build(family, layers=layers, dtype=dtype, experts_implementation=experts)
    return compile_once(model, *models.example_inputs(model, tokens=tokens), **compile_modes(dynamic))


def relative_error(r: Compiled) -> float:
    out, ref = models.hidden_states(r.output), models.hidden_states(r.eager)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize(("family", "layers", "dtype", "dynamic", "experts"), CASES)
def test_one_moe_per_layer_exact_counts_equal_eager_no_near_misses(
    family: str, layers: int, dtype: torch.dtype, dynamic: bool | str, experts: str
) -> None:
    r = compiled(family, layers, dtype, dynamic, experts)
    assert len(r.backend.graphs) == 1
    assert fused(r.counts_before()) == {}
    assert fused(r.counts()) == r.report.fused_ops() == expected(family, layers)
    assert relative_error(r) < TOLERANCE[dtype]
    assert r.report.near_misses == [] and r.report.rejected == []
    for node in fused_nodes(r, "moe"):
        top_k, renormalize, activation = node.args[6:9]
        assert (top_k, renormalize, activation) == (2, RENORMALIZE[family], "silu")
        assert node.args[1] is not None  # routed from the logits: softmax and top-k inside the op
    assert [s.module for s in sites(r, "moe")] == [f"layers.{i}.mlp" for i in range(layers)]
    # the experts module's stacked weights, as held: no copy
    assert [n.args[4].name for n in fused_nodes(r, "moe")] == [
        f"l_self_modules_layers_modules_{i}_modules_mlp_modules_experts_parameters_gate_up_proj_" for i in range(layers)
    ]


@pytest.mark.parametrize("family", models.MOE_FAMILIES)
def test_decode_step_fuses_as_prefill(family: str) -> None:
    r = compiled(family, 1, F32, True, "grouped_mm", tokens=1)
    assert fused(r.counts()) == expected(family, 1)
    assert relative_error(r) < TOLERANCE[F32] and r.report.near_misses == []


@pytest.mark.parametrize("renormalize", [True, False])
def test_norm_topk_prob_becomes_the_renormalize_flag(renormalize: bool) -> None:
    model = models.build("olmoe", layers=1)
    model.layers[0].mlp.gate.norm_topk_prob = renormalize
    r = compile_once(model, *models.example_inputs(model))
    assert [n.args[7] for n in fused_nodes(r, "moe")] == [renormalize]
    assert relative_error(r) < TOLERANCE[F32]


def test_the_eager_experts_loop_does_not_compile_with_fullgraph() -> None:
    """Why the eager implementation has no rule: ``for expert in expert_hit`` iterates over a
    data-dependent ``nonzero``, which Dynamo cannot trace into one graph. Should it ever
    compile, this fails and the pass must be checked on it."""
    model = models.build("mixtral", layers=1, experts_implementation="eager")
    with pytest.raises(Exception, match="data-dependent"):
        compile_once(model, *models.example_inputs(model))


def test_the_cli_reports_each_family(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m fxrewrite report --model <moe family>``: the built-in MoE models compile and
    the report names one fxr.moe per layer and no near miss."""
    for family in models.MOE_FAMILIES:
        assert main(["report", "--model", family, "--layers", "2", "--static", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["fused_ops"]["moe"] == 2 and doc["near_misses"] == [], family
        assert doc["max_abs_err"] < TOLERANCE[F32]


def test_the_cli_refuses_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["report", "--model", "mixtral-8x7b"])
    assert "invalid choice: 'mixtral-8x7b'" in capsys.readouterr().err


def test_the_readme_table_matches() -> None:
    """The README's MoE table ("family | moe | ...", one row per family) is TABLE's first column."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| MoE family |"))
    ops = [c.strip() for c in header.strip("|").split("|")][1:]
    rows = {cells[0]: cells[1:] for line in text.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]] if cells[0] in models.MOE_FAMILIES}  # fmt: skip
    assert set(rows) == set(TABLE)
    for family, cells in rows.items():
        want = {op: TABLE[family].get(op, (0, 0)) for op in ops}
        got = {op: cell for op, cell in zip(ops, cells)}
        assert got == {op: f"{n}" + (f" (+{once})" if once else "") for op, (n, once) in want.items()}, family


def run_on(device: str, family: str, mode: str) -> tuple[float, dict[str, object], float, float, int, int]:
    """A 2-layer ``family`` run by :func:`helpers.moe.run_bf16` on ``device`` in ``mode``: (fxr.moe
    per graph, what served fxr.moe, the compiled output's largest error and eager bf16's on the
    tokens no routing near-tie reaches, the tokens compared, the tokens left out)."""
    ref32 = models.build(family, layers=2, hidden=256, heads=4, kv_heads=2, vocab=512).to(device)
    r = run_bf16(ref32, mode)
    moe_per_graph = r.backend.report.fused_ops()["moe"] / len(r.backend.report.graphs)
    return moe_per_graph, r.served.get("moe", {}), r.err, r.err_eager, r.kept, r.left_out


def test_the_end_to_end_check_runs_on_cpu() -> None:
    """The GPU test's body on CPU (the reference serves fxr.moe): its counts and errors hold."""
    per_graph, moe_served, err, err_eager, kept, left_out = run_on("cpu", "olmoe", "none")
    assert per_graph == 2 and set(moe_served) <= {"torch", "fallbacks"}
    assert err <= max(2 * err_eager, TOLERANCE[BF16]) and kept >= 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["none", "piecewise"])
@pytest.mark.parametrize("family", models.MOE_FAMILIES)
def test_on_the_gpu_the_triton_kernel_serves_every_moe_layer(family: str, mode: str) -> None:
    """bf16 on CUDA, eager and in piecewise CUDA graphs: one fxr.moe per layer, every call served
    by the Triton kernel (no fallback), the output as close to the float32 model as eager bf16's
    on the tokens no routing near-tie reaches (at least 4 of 22)."""
    per_graph, moe_served, err, err_eager, kept, left_out = run_on("cuda", family, mode)
    assert per_graph == 2
    assert moe_served.get("triton", 0) > 0 and moe_served.get("fallbacks") == {}, moe_served
    assert kept >= 4, (kept, left_out)
    assert err <= max(2 * err_eager, TOLERANCE[BF16]), (err, err_eager, kept, left_out)


def test_fuse_moe_asks_the_match_filter_for_each_block() -> None:
    """The contract of a fusion pass (``GraphPass.fusion``): each proven block goes to
    ``Config.match_filter`` as a ``FusionMatch`` (the pass, its router's top-k, the block's
    nodes) in graph order; a refused block stays as written, reported as rejected."""
    from fxrewrite.passes import FusionMatch

    seen: list[FusionMatch] = []

    def second_refused(m: FusionMatch) -> str | None:
        seen.append(m)
        return "refused by the test" if len(seen) == 2 else None

    model = models.build("mixtral", layers=2)
    r = compile_once(model, *models.example_inputs(model), match_filter=second_refused)
    moes = [m for m in seen if isinstance(m, FusionMatch)]
    assert [m.rule.name for m in moes] == ["fuse_moe", "fuse_moe"] and moes == seen[:2]
    assert all(m.anchor.target is torch.ops.aten.topk.default and m.anchor in m.nodes for m in moes)
    assert [meta.module_path(m.anchor).split(".mlp")[0] for m in moes] == ["layers.0", "layers.1"]
    assert [s.module for s in sites(r, "moe")] == ["layers.0.mlp"]
    assert [(x.rule, x.reason) for x in r.report.rejected] == [("moe", "refused by the test")]
    assert r.report.near_misses == [] and relative_error(r) < TOLERANCE[F32]
