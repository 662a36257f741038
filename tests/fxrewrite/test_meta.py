"""``fxrewrite.meta.common_module``: the module a site spanning several nodes belongs to, named as
``module_path`` names one node's (Dynamo's root prefix removed, whatever it is)."""

from __future__ import annotations

import torch.fx as fx

from fxrewrite import meta


def _nodes(*stacks: list[str]) -> list[fx.Node]:
    """One placeholder per stack of module paths, outermost first, as Dynamo records them."""
    graph = fx.Graph()
    out = []
    for i, paths in enumerate(stacks):
        node = graph.placeholder(f"x{i}")
        if paths:
            node.meta["nn_module_stack"] = {p: (p, object) for p in paths}
        out.append(node)
    return out


ROOT = "L['self']"
BLOCK = [f"{ROOT}.layers.1", f"{ROOT}.layers.1.mlp"]


def test_the_innermost_module_all_nodes_ran_in() -> None:
    router = _nodes(BLOCK + [f"{ROOT}.layers.1.mlp.gate"])[0]
    expert = _nodes(BLOCK + [f"{ROOT}.layers.1.mlp.experts"])[0]
    assert meta.module_path(router) == "layers.1.mlp.gate"
    assert meta.common_module([router, expert]) == "layers.1.mlp"
    # a wrapped forward's root (transformers 5.24) is removed the same way
    wrapped = _nodes(["L['args'][0].layers.0.mlp.gate"], ["L['args'][0].layers.0.mlp.gate"])
    assert meta.common_module(wrapped) == "layers.0.mlp.gate"


def test_nodes_without_a_module_are_left_out_and_none_in_common_names_nothing() -> None:
    router, bare = _nodes(BLOCK + [f"{ROOT}.layers.1.mlp.gate"], [])
    assert meta.common_module([router, bare]) == "layers.1.mlp.gate"
    assert meta.common_module([bare]) == ""
    apart = _nodes([f"{ROOT}.layers.0"], [f"{ROOT}.layers.1"])
    assert meta.common_module(apart) == ""
