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

Pass ``hand_off_norm_quant`` (``Config.fp8_norm_prologue``): the same in a static FP8 layer, where no GEMM took the norm (the
norm quantizes for the FP8 GEMMs after it, one kernel of its own)::

    %o = fxr.linear_fp8(%a, %w_o, %s_a, %s_o, bf16)                    # maybe reshaped to [B, S, n]
    %q, %s = fxr.fused_add_rms_norm_quant_fp8(%o, %r, %g, eps, %s_q)   # -> two getitems
    %y = fxr.linear_fp8(%q, %w, %s_q, %s_w, bf16)                      # each reader, maybe of %q flattened
    ->
    %h = fxr.linear_fp8_add_rms_parts(%a, %w_o, %s_a, %s_o, bf16, %r, %g)
    %y = fxr.rms_norm_quant_linear_fp8(%h[1], %h[2], eps, %s_q, %w, %s_w, bf16)

Every reader of the quantized norm must be such a GEMM with the quantization's scale as its
input scale (``fxr.linear_fp8_silu_and_mul_quant`` too); the sum's other readers read ``%h[0]``
(reshaped back as the residual stream is). The spec: runtime/ops/linear_fp8_fused.py.
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


# --------------------------------------------------------------------------- the FP8 layer's norms

FP8_RULE = "linear_fp8_add_rms_parts"
FP8_HAND_OFF = FXR.linear_fp8_add_rms_parts.default
FP8_GEMM = FXR.linear_fp8.default
QUANT_NORM = FXR.fused_add_rms_norm_quant_fp8.default
# the GEMM reading a quantized norm -> the GEMM quantizing the hand-off's norm in its prologue
FP8_READERS = {FP8_GEMM: FXR.rms_norm_quant_linear_fp8.default,
               FXR.linear_fp8_silu_and_mul_quant.default: FXR.rms_norm_quant_linear_fp8_silu_and_mul_quant.default}  # fmt: skip


def _outputs(node: fx.Node) -> dict[int, fx.Node] | None:
    """``node``'s ``getitem`` readers by index, None if anything else reads it."""
    outs = {}
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] in outs:
            return None
        outs[user.args[1]] = user
    return outs


ATEN = torch.ops.aten
RESHAPES = {torch.reshape, torch.flatten, torch.unflatten, ATEN.reshape.default, ATEN.view.default,
            ATEN.flatten.using_ints, ATEN.unflatten.int, ATEN._unsafe_view.default}  # fmt: skip
RESHAPE_METHODS = {"view", "reshape", "flatten", "unflatten"}


def _regroups_rows(node: fx.Node) -> bool:
    """``node`` reshapes its input keeping the last dimension: the same rows, grouped otherwise
    (a GEMM's [T, n] output unflattened to [B, S, n], a norm's [B, S, k] flattened for a GEMM)."""
    if not ((node.op == "call_function" and node.target in RESHAPES)
            or (node.op == "call_method" and node.target in RESHAPE_METHODS)):  # fmt: skip
        return False
    out, src = meta.tensor(node), meta.tensor(node.args[0])
    return out is not None and src is not None and out.dim() >= 1 and src.dim() >= 1 and (
        meta.dim_key(out.shape[-1]) == meta.dim_key(src.shape[-1]))


def _gemm_behind(x: Any) -> tuple[fx.Node | None, list[fx.Node]]:
    """The FP8 GEMM whose rows ``x`` is, up to reshapes only ``x`` reads (and those reshapes)."""
    between = []
    while isinstance(x, fx.Node) and _regroups_rows(x) and len(x.users) == 1:
        between.append(x)
        x = x.args[0]
    return (x, between) if isinstance(x, fx.Node) and x.target is FP8_GEMM else (None, [])


def _fp8_site(norm: fx.Node) -> tuple[fx.Node, int, list[fx.Node], list[fx.Node]] | str | None:
    """``(producer, residual, readers, replaced)`` where ``norm`` (``fxr.fused_add_rms_norm_quant_fp8``)
    adds an FP8 GEMM's output (either addend; ``residual``: the other's index) to the residual stream and only FP8 GEMMs read its quantized output,
    each with the norm's scale as its input scale (a merged q/k/v GEMM, or q, k and v apart), the
    rows on both sides as the producer made them up to a reshape each way (``replaced``: the
    nodes between, which go); a reason where the sum is an FP8 GEMM's but no more holds; None
    where it is not (nothing of this pass's there)."""
    found = [(*_gemm_behind(norm.args[i]), 1 - i) for i in (0, 1)]  # either addend
    found = [f for f in found if f[0] is not None]
    if not found:
        return None
    producer, between, other = found[0]
    residual = norm.args[other]
    g, scale = norm.args[2], norm.args[4]
    if len(producer.users) != 1:
        return "the GEMM's output has readers besides the norm: the hand-off stores only their sum"
    outs = _outputs(norm)
    q = outs.get(0) if outs is not None else None
    if q is None or not q.users:
        return "the norm's outputs are read other than by index"
    rows = q
    if len(q.users) == 1 and _regroups_rows(next(iter(q.users))):
        rows = next(iter(q.users))
        between.append(rows)
    readers = list(rows.users)
    for reader in readers:
        if reader.target not in FP8_READERS or reader.args[0] is not rows or rows in reader.args[1:]:
            return f"the quantized norm is read by {reader.target}, not as an FP8 GEMM's input"
        if reader.args[2] is not scale:
            return f"{reader.name}'s input scale is not the quantization's scale"
    s, weight, read = meta.tensor(producer), meta.tensor(g), meta.tensor(rows)
    if s is None or read is None or read.shape != s.shape:
        return "the GEMMs reading the norm see its rows shaped otherwise than the GEMM making them"
    if weight is None or weight.dim() != 1 or weight.dtype != s.dtype:
        return f"norm weight {getattr(weight, 'dtype', None)} is not a [n] vector of the sum's dtype"
    r = meta.tensor(residual)
    if r is None or r.dtype != s.dtype or (r.dim() != s.dim() and (s.dim() != 2 or not isinstance(s.shape[-1], int))):
        return "the residual stream is not the GEMM output's dtype, or its rows are not [T, n] of a static n"
    return producer, other, readers, between


def _replace_fp8(graph: fx.Graph, norm: fx.Node, producer: fx.Node, residual: int, readers: list[fx.Node],
                 between: list[fx.Node], outs: dict[int, fx.Node], fake_mode: Any) -> list[fx.Node]:  # fmt: skip
    """The hand-off in place of ``producer`` and ``norm``, each reader in place by its quantizing
    form: the new nodes, the hand-off first. The sum's rows are reshaped as the residual stream's
    where the norm saw them so."""
    x, w, scale_a, scale_b, out_dtype = producer.args[:5]
    residual, g, eps, scale = norm.args[residual], norm.args[2], norm.args[3], norm.args[4]  # (as they are now)
    shape = meta.tensor(producer).shape
    reshaped = meta.tensor(residual).dim() != len(shape)
    with graph.inserting_before(norm):
        rows = graph.call_function(ATEN.reshape.default, (residual, [-1, shape[-1]])) if reshaped else residual
        both = graph.call_function(FP8_HAND_OFF, (x, w, scale_a, scale_b, out_dtype, rows, g))
        s, sg, parts = (graph.call_function(operator.getitem, (both, i)) for i in range(3))
        total = graph.call_function(torch.Tensor.view_as, (s, residual)) if reshaped else s
    made = [both]
    for reader in readers:
        with graph.inserting_before(reader):
            _, w_r, _, scale_b_r, out_dtype_r, *out_scale = reader.args
            made.append(graph.call_function(FP8_READERS[reader.target], (sg, parts, eps, scale, w_r, scale_b_r,
                                                                         out_dtype_r, *out_scale)))  # fmt: skip
        meta.copy_provenance(reader, made[-1])
    meta.copy_provenance(producer, both)
    for n in dict.fromkeys((rows, both, s, sg, parts, total, *made[1:])):
        if n is not residual:
            n.meta["fxr_rule"] = FP8_RULE
            meta.propagate(n, fake_mode)
    for reader, read in zip(readers, made[1:]):
        reader.replace_all_uses_with(read)
    if 1 in outs:
        outs[1].replace_all_uses_with(total)
    gone = [*readers, *between, *outs.values(), norm, producer]
    while gone:  # each once nothing reads it (readers first, the producer last)
        n = next(n for n in gone if not n.users)
        graph.erase_node(n)
        gone.remove(n)
    return made


def hand_off_norm_quants(gm: fx.GraphModule, mode: str = "full", gemm_fusion: bool = True,
                         site_filter: SiteFilter | None = None) -> PassResult:  # fmt: skip
    """The FP8 layer's add + norm + quantization between two static FP8 GEMMs
    (``fxr.fused_add_rms_norm_quant_fp8`` between ``fxr.linear_fp8``s) -> the producing GEMM's
    hand-off and the reading GEMM's quantizing prologue (runtime/ops/linear_fp8_fused.py), in the
    CUDA-graph modes, with ``gemm_fusion`` (the decode sizes: ``gemm_fusion_max_tokens``); the
    kernels are built ahead here."""
    result = PassResult()
    if mode not in ("piecewise", "full") or not gemm_fusion:
        return result
    fake_mode = meta.fake_mode_of(gm.graph)
    sites = []
    for norm in gm.graph.nodes:
        if norm.op != "call_function" or norm.target is not QUANT_NORM:
            continue
        site = _fp8_site(norm)
        if isinstance(site, str):
            result.near_misses.append(NearMiss(FP8_RULE, norm.name, meta.source_line(norm), norm.args[0].name, site,
                                               meta.module_path(norm)))  # fmt: skip
            continue
        if site is None:
            continue
        producer, _, readers, _ = site
        if site_filter is not None and (refusal := site_filter(norm, [producer, norm, *readers])) is not None:
            result.rejected.append(Rejected(FP8_RULE, norm.name, meta.source_line(norm), refusal))
            continue
        sites.append((norm, *site))
    calls = []
    for norm, producer, residual, readers, between in sites:
        made = _replace_fp8(gm.graph, norm, producer, residual, readers, between, _outputs(norm), fake_mode)
        result.matches += 1
        result.sites.append(Site(FP8_RULE, made[0].name, meta.source_line(made[0]), meta.module_path(made[0])))
        calls += [(n.target, meta.at_hints(n.args), meta.at_hints(n.kwargs)) for n in made]
    if calls and (note := providers.prebuild(calls)):
        result.notes.append(note)
    return result
