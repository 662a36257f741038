"""A deliberately wrong rule and fusion pass, planted among the defaults by the verify and bisect
tests."""

from __future__ import annotations

import torch
import torch.fx as fx

import fxrewrite.runtime.ops  # noqa: F401  (torch.ops.fxr.*)
from fxrewrite import Rule, meta
from fxrewrite.passes import GraphPass, SiteFilter
from fxrewrite.report import PassResult
from fxrewrite.rewrites import moe, norm


def eps_off_replacement(x, weight, eps):
    return torch.ops.fxr.rms_norm(x, weight, eps * 100)


# RMSNorm -> fxr.rms_norm with eps 100x off (wrong)
EPS_OFF = Rule("eps_off_rms_norm", norm.rms_norm_pattern, eps_off_replacement, norm.norm_guard, norm.WILDCARDS)


def moe_off(gm: fx.GraphModule, site_filter: SiteFilter | None = None) -> PassResult:
    """``fuse_moe``, then the output of every fused block past layer 0 scaled by 1.01 (wrong
    there, right in layer 0: a fusion pass whose first bad site is its second)."""
    result = moe.fuse_moe(gm, site_filter=site_filter)
    fake_mode = meta.fake_mode_of(gm.graph)
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.fxr.moe.default):
        if meta.module_path(node).startswith("layers.0."):
            continue
        with gm.graph.inserting_after(node):
            off = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.01))
        meta.copy_provenance(node, off)
        meta.propagate(off, fake_mode)
        node.replace_all_uses_with(off, delete_user_cb=lambda user: user is not off)
    return result


# fuse_moe with its blocks past layer 0 off by 1% (wrong): a fusion pass, bisected as one
MOE_OFF = GraphPass("fuse_moe_off", moe_off, fusion=True)
