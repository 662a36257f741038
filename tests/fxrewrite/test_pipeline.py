"""``fxrewrite.pipeline(config)``: the library's ordered steps (``fxrewrite.rewrites.PIPELINE``)
turned into passes for a Config, and the README's list of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import fxrewrite
from fxrewrite import Config, Rule, rewrites
from fxrewrite.backend import default_rule_groups
from fxrewrite.passes import GraphPass, RuleGroup
from fxrewrite.report import PassResult

README = Path(__file__).resolve().parents[2] / "README.md"
PASS_LIST = r"The pipeline \(`fxrewrite.pipeline\(config\)`\) is one ordered list of named passes:(.*?)\. Each pass"
LIBRARY_GROUPS = ["fuse_rotary", "fuse_collective", "fuse_norm_quant", "fuse_norm", "fuse_activation",
                  "fuse_activation_quant", "fuse_quant"]  # fmt: skip


def double_pattern(x):
    return x + x


def double_replacement(x):
    return x * 2


DOUBLE = Rule("double", double_pattern, double_replacement)  # x + x -> x * 2


def names(config: Config, **kw: object) -> list[str]:
    return [p.name for p in fxrewrite.pipeline(config, **kw)]


@pytest.mark.parametrize("mode", ["none", "piecewise", "full"])
def test_the_library_in_its_order_with_gemms_selected_for_replayed_graphs_only(mode: str) -> None:
    gemm = ["select_gemm"] if mode != "none" else []
    groups = [*LIBRARY_GROUPS[:2], "fuse_attention_quant", *LIBRARY_GROUPS[2:]]  # a graph pass among the groups
    want = ["canonicalize", "cse", "merge_siblings", "fuse_moe", *groups, *gemm, "fold_rotary", "fold_constants",
            "cleanup"]
    assert names(Config(mode=mode)) == want
    assert [name for name, _ in default_rule_groups(mode)] == LIBRARY_GROUPS + gemm


def test_gemm_fusion_puts_its_passes_around_select_gemm_in_the_replayed_modes() -> None:
    for mode in ("none", "piecewise", "full"):
        assert "hand_off_norm_quant" not in names(Config(mode=mode, gemm_fusion=True))  # its own switch
        # fuse_gemm_rotary, hand_off_norms listed, no-ops: no GEMM there took its norm; hand_off_norm_quant
        # (with fp8_norm_prologue) returns at once outside the replayed modes and without gemm_fusion
        got = names(Config(mode=mode, gemm_fusion=True, fp8_norm_prologue=True))
        after = ["fuse_gemm_rotary", "hand_off_norms", "hand_off_norm_quant"]
        if mode == "none":
            assert [n for n in got if n not in after] == names(Config(mode=mode))
            continue
        at = got.index("select_gemm")
        assert got[at - 2:at + 1] == ["fuse_gemm_residual", "fuse_gemm_norm", "select_gemm"]
        at = got.index("fold_rotary")
        assert got[at + 1 : at + 4] == after
        groups = [n for n, _ in default_rule_groups(mode, Config(gemm_fusion=True))]
        assert groups[-3:] == ["fuse_gemm_residual", "fuse_gemm_norm", "select_gemm"]


def test_user_rules_follow_the_last_rule_group_in_every_mode() -> None:
    for mode in ("none", "piecewise"):
        got = names(Config(mode=mode, extra_rules=(DOUBLE,)))
        assert got[got.index("user_rules") - 1] == ("select_gemm" if mode != "none" else "fuse_quant")
        assert got[got.index("user_rules") + 1] == "fold_rotary"


def test_rules_replace_the_rule_groups_and_keep_the_graph_passes() -> None:
    """fuse_moe is a graph pass that fuses: replaced with the rule groups."""
    assert names(Config(rules=(DOUBLE,))) == ["canonicalize", "cse", "merge_siblings", "rules", "fold_rotary",
                                              "fold_constants", "cleanup"]
    assert names(Config(rules=(DOUBLE,), merge_siblings=False)) == ["canonicalize", "cse", "rules", "fold_rotary",
                                                                    "fold_constants", "cleanup"]


def test_no_rules_runs_none_of_the_library() -> None:
    assert names(Config(rules=())) == ["canonicalize", "fold_constants", "cleanup"]
    assert names(Config(rules=(), extra_rules=(DOUBLE,))) == ["canonicalize", "user_rules", "fold_constants", "cleanup"]


def test_a_graph_pass_gets_the_config_fields_it_names() -> None:
    seen: list[int] = []

    def count_positions(gm: torch.fx.GraphModule, max_positions: int) -> PassResult:
        seen.append(max_positions)
        return PassResult()

    library = (RuleGroup("empty", []), GraphPass("positions", count_positions, options=("max_positions",)))
    passes = fxrewrite.pipeline(Config(max_positions=77), library)
    assert [p.name for p in passes] == ["canonicalize", "positions", "fold_constants", "cleanup"]  # an empty group: no pass
    passes[1].fn(torch.fx.symbolic_trace(torch.nn.Identity()))
    assert seen == [77]


def test_the_library_states_its_steps_as_data() -> None:
    assert all(isinstance(s, (RuleGroup, GraphPass)) for s in rewrites.PIPELINE)
    assert all(isinstance(r, Rule) for s in rewrites.PIPELINE if isinstance(s, RuleGroup) for r in s.rules)


def test_the_readme_lists_the_passes_in_order() -> None:
    paragraph = re.search(PASS_LIST, README.read_text(), re.S)
    assert paragraph is not None
    text = " ".join(paragraph.group(1).split()).replace("your rules", "`user_rules`")
    listed = [n for n in re.findall(r"`(\w+)`", text) if n not in ("piecewise", "full")]  # the modes named
    assert listed == names(Config(mode="piecewise", extra_rules=(DOUBLE,), gemm_fusion=True, fp8_norm_prologue=True))
