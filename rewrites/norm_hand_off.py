"""An RMSNorm's whole-row work handed to the GEMM that makes its rows (pass ``hand_off_norms``).

After ``fuse_gemm_residual``, ``fuse_gemm_norm`` and ``fuse_gemm_rotary`` a decoder layer reads,
per residual add::

    %s = fxr.linear_add_(%a, %w_o, %r)                         # r += a @ w_o.T (o_proj, down_proj)
    %y = fxr.rms_norm_linear_silu_and_mul(%s, %g, eps, %w_gu)  # the norm in the next GEMM's prologue

The prologue sums each row's squares in the GEMM's k loop, and that costs the decode GEMMs a
third of their time (the A tiles pass through registers: bench/RESULTS.md, issue 30). The GEMM
that makes ``s`` sees every element once in its epilogue; it can leave what the norm needs of
whole rows::

    %h = fxr.linear_add_rms_parts(%a, %w_o, %r, %g)            # s, s * g, sums of squares by slot
    %s = %h[0];  %sg = %h[1];  %parts = %h[2]
    %y = fxr.rms_norm_linear_silu_and_mul(%sg, None, eps, %w_gu, parts=%parts)

so the reading GEMM streams its operands and scales each row in its epilogue. The same for
``fxr.rms_norm_linear`` and ``fxr.rms_norm_linear_rotary``, and for the functional
``fxr.linear_add``. The in-place add becomes the functional hand-off (it writes ``s`` to a new
tensor: the same bytes at decode), and the readers of the sum read ``%s``.

A norm without a weight, or whose GEMM input is not such a sum, keeps its prologue; a sum read
by two norms hands off to the first (the other keeps its prologue). Each is a near miss with
its reason where the input is such a sum. The ops' references are the spec: the pair computes
``rms_norm(s, g, eps) @ w.T`` with ``s * g`` rounded once where the unfused norm rounds ``s *
rsqrt(...)`` then the product (runtime/ops/linear_fused.py).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite import meta
from fxrewrite.passes import SiteFilter
from fxrewrite.report import NearMiss, PassResult, Rejected, Site
from fxrewrite.runtime import providers

RULE = "linear_add_rms_parts"
FXR = torch.ops.fxr
HAND_OFF = FXR.linear_add_rms_parts.default
PRODUCERS = {FXR.linear_add.default, FXR.linear_add_.default}
READERS = {FXR.rms_norm_linear.default, FXR.rms_norm_linear_silu_and_mul.default,
           FXR.rms_norm_linear_rotary.default}  # fmt: skip


def _reason(reader: fx.Node, producer: fx.Node) -> str | None:
    """Why ``reader`` (a norm GEMM of ``producer``'s sum) does not take a hand-off, else None."""
    if reader.kwargs.get("parts") is not None:
        return "the norm already reads a hand-off"
    g, s = meta.tensor(reader.args[1]), meta.tensor(producer)
    if g is None:
        return "the norm has no weight: the hand-off stores s * g"
    if s is None or g.dim() != 1 or g.dtype != s.dtype or meta.dim_key(g.shape[0]) != meta.dim_key(s.shape[-1]):
        return f"norm weight {g.dtype}{tuple(g.shape)} is not a [n] vector of the sum's dtype"
    return None


def _replace(graph: fx.Graph, reader: fx.Node, producer: fx.Node, fake_mode: Any) -> fx.Node:
    x, w, residual = producer.args[:3]
    with graph.inserting_before(producer):
        both = graph.call_function(HAND_OFF, (x, w, residual, reader.args[1]))
        s, sg, parts = (graph.call_function(operator.getitem, (both, i)) for i in range(3))
    both.meta["fxr_rule"] = RULE
    meta.copy_provenance(producer, both)
    for n in (both, s, sg, parts):
        meta.propagate(n, fake_mode)
    producer.replace_all_uses_with(s)
    graph.erase_node(producer)
    reader.args = (sg, None, *reader.args[2:])
    reader.kwargs = {**reader.kwargs, "parts": parts}
    return both


def hand_off_norms(gm: fx.GraphModule, site_filter: SiteFilter | None = None) -> PassResult:
    """Give each norm GEMM (``fxr.rms_norm_linear*``) that reads the sum of an
    ``fxr.linear_add(_)`` a hand-off from that GEMM (see the module docstring); the kernels are
    built ahead here (``providers.prebuild``), as a rules pass builds those of its matches."""
    result = PassResult()
    fake_mode = meta.fake_mode_of(gm.graph)
    sites: list[tuple[fx.Node, fx.Node]] = []
    taken: set[fx.Node] = set()
    for reader in gm.graph.nodes:
        if reader.op != "call_function" or reader.target not in READERS:
            continue
        producer = reader.args[0]
        if not (isinstance(producer, fx.Node) and producer.target in PRODUCERS):
            continue
        why = "the sum hands off to another norm" if producer in taken else _reason(reader, producer)
        if why is None and site_filter is not None:
            refusal = site_filter(reader, [producer, reader])
            if refusal is not None:
                result.rejected.append(Rejected(RULE, reader.name, meta.source_line(reader), refusal))
                continue
        if why is not None:
            result.near_misses.append(NearMiss(RULE, reader.name, meta.source_line(reader), producer.name, why,
                                               meta.module_path(reader)))  # fmt: skip
            continue
        taken.add(producer)
        sites.append((reader, producer))
    calls = []
    for reader, producer in sites:
        both = _replace(gm.graph, reader, producer, fake_mode)
        result.matches += 1
        result.sites.append(Site(RULE, both.name, meta.source_line(both), meta.module_path(both)))
        calls += [(n.target, meta.at_hints(n.args), meta.at_hints(n.kwargs)) for n in (both, reader)]
    if calls and (note := providers.prebuild(calls)):
        result.notes.append(note)
    return result

