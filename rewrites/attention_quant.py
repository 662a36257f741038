"""Attention + FP8 output quantization: a static-scale FP8 quantization of an attention op's
output (the input of an FP8 ``o_proj``) moves into the attention call, where the engine has
declared the op's quantized twin.

    # before                                                  # after
    o = mylib.attention(q, k, v, k_cache, ..., None)          oq = mylib.attention_quant_fp8(q, k, v, k_cache, ..., scale, None)
    x = o.reshape(-1, heads * dim)                            xq = oq.reshape(-1, heads * dim)
    xq = (x.float() / scale).clamp(-448, 448).to(float8_e4m3fn)

The attention op is the engine's own (an opaque custom op that reads and writes its KV cache),
so the rewriter cannot know that an op exists which also quantizes: the engine declares it in
``Config.attention_quant``, one :class:`AttentionQuant` per op::

    Config(attention_quant=(AttentionQuant(torch.ops.mylib.attention.default,
                                           torch.ops.mylib.attention_quant_fp8.default,
                                           scale_arg="output_scale"),))

The twin takes the attention op's arguments by the same names (mutating the same ones) plus one
tensor argument, ``scale_arg``, anywhere in its signature: a float32 scalar, and returns
``quant_fp8_static(op(...), scale)`` (``runtime/ops/quant.py``; a kernel may divide the
float32 accumulator instead of the rounded output, within one e4m3 step). The declaration is
checked when it is made (:meth:`AttentionQuant.__post_init__`). A twin of a splitting op is a
splitting op too: ``Config.resolved`` adds it to ``splitting_ops``, so piecewise mode still cuts
the graph at attention and full mode captures it as it did the plain op.

Why a graph pass and not a :class:`fxrewrite.Rule`: the attention op has the engine's signature
(any number of arguments, optional ones, mutated caches), and between the op and the quantizer
the model reshapes the heads into one row (``o.view(T, H * d)``). The pass starts at each call of
a declared op (or of a splitting op, to say why one without a twin did not fuse), follows the
output through reshapes, and matches the quantizer with the node-walking matcher
(:data:`QUANT_STATIC`: every spelling the FP8 rules accept, a lifted 448, an elided cast).

Near misses, at the attention call, only where an FP8 value is computed from its output within
a few nodes (a plain bf16 model gets none): a per-token (dynamic) quantization; a quantizer whose
input is the attention output plus something else; the output read elsewhere too; a scale that
is not one float32 element; an attention op with no declared twin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from fxrewrite import meta
from fxrewrite.canonicalize import AMAX
from fxrewrite.canonicalize_shape import RESHAPES
from fxrewrite.match import Failure, match_at
from fxrewrite.passes import SiteFilter
from fxrewrite.report import NearMiss, PassResult, Rejected, Site
from fxrewrite.rewrite import Anchors
from fxrewrite.rewrites.quant import scale_guard
from fxrewrite.rule import Rule
from fxrewrite.runtime.ops.quant import FP8_DTYPE, quant_fp8_static
from fxrewrite.split import resolve_op, target_matches

RULE = "attention_quant_fp8"
MAX_HOPS = 8
"""Nodes searched past the attention output for an FP8 value (a quantizer is four or five)."""

# Ops that carry the attention output on unchanged but for its shape: the quantizer commutes.
_RESHAPES = frozenset(RESHAPES | {torch.ops.aten.view.default, torch.ops.aten.contiguous.default})
# Reductions over the quantized value itself: a per-token scale.
_REDUCTIONS = frozenset({AMAX, torch.ops.aten.max.dim, torch.ops.aten.max.default})


# (x.float() / scale).clamp(-448, 448).to(float8_e4m3fn): the quantizer this pass moves
def quant_static_pattern(x, scale):
    return quant_fp8_static(x, scale)


def _quant_static_replacement(x, scale):  # never applied: the pass replaces the attention call
    return quant_fp8_static(x, scale)


QUANT_STATIC = Rule(RULE, quant_static_pattern, _quant_static_replacement, scale_guard)


# --------------------------------------------------------------------------- the declaration


def _overload(op: Any, what: str) -> torch._ops.OpOverload:
    op = resolve_op(op)
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(f"AttentionQuant: {what} must be a torch op (an OpOverload, packet or 'ns::name'), got {op!r}")
    return op


def _describe_arg(a: Any) -> tuple[str, str, bool]:
    return a.name, str(a.type), bool(a.alias_info is not None and a.alias_info.is_write)


@dataclasses.dataclass(frozen=True)
class AttentionQuant:
    """An attention op and its twin that returns the output quantized to FP8 (e4m3) by a static
    per-tensor scale: ``quant_op(**op_args, **{scale_arg: scale}) ==
    quant_fp8_static(op(**op_args), scale)``.

    op:         the attention op (``torch.ops.ns.name.default``; a packet means its ``.default``;
                ``"ns::name"`` too).
    quant_op:   its twin: the same arguments (names, types, mutations) plus ``scale_arg``, one
                tensor, anywhere; returns one FP8 tensor of the op's output shape.
    scale_arg:  the name of the twin's scale argument.
    """

    op: Any
    quant_op: Any
    scale_arg: str = "output_scale"

    def __post_init__(self) -> None:
        op, twin = _overload(self.op, "op"), _overload(self.quant_op, "quant_op")
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "quant_op", twin)
        mine = [_describe_arg(a) for a in op._schema.arguments]
        theirs = [_describe_arg(a) for a in twin._schema.arguments]
        scale = [a for a in theirs if a[0] == self.scale_arg]
        if not scale or scale[0][1] != "Tensor":
            raise ValueError(f"AttentionQuant: {twin} has no Tensor argument {self.scale_arg!r} (scale_arg)")
        rest = [a for a in theirs if a[0] != self.scale_arg]
        if rest != mine:
            raise ValueError(f"AttentionQuant: {twin} must take the arguments of {op} (names, types, mutations) "
                             f"plus {self.scale_arg!r}: {op._schema} vs {twin._schema}")  # fmt: skip
        if len(twin._schema.returns) != 1 or str(twin._schema.returns[0].type) != "Tensor":
            raise ValueError(f"AttentionQuant: {twin} must return one Tensor, not {twin._schema.returns}")

    def call_args(self, node: fx.Node, scale: fx.Node) -> tuple[Any, ...] | None:
        """The twin's positional arguments for the attention call ``node`` with ``scale``, or
        None when its arguments do not bind to the op's schema."""
        bound = normalize_function(self.op, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        if bound is None:
            return None
        values = {**bound.kwargs, self.scale_arg: scale}
        args: list[Any] = []
        for a in self.quant_op._schema.arguments:
            if a.name in values:
                args.append(values[a.name])
            elif a.has_default_value():
                args.append(a.default_value)
            else:
                return None
        return tuple(args)


# --------------------------------------------------------------------------- the pass


@dataclasses.dataclass
class _Site:
    """One attention call whose output reaches an FP8 value: the reshapes from the call to the
    value quantized, the FP8 value, the quantizer's match, and why it does not fuse (if so)."""

    attn: fx.Node
    views: list[fx.Node]
    quant: fx.Node
    match: Any = None
    reason: str | None = None


def fuse_attention_quant(
    gm: fx.GraphModule,
    attention_quant: Sequence[AttentionQuant] = (),
    splitting_ops: Sequence[Any] = (),
    site_filter: SiteFilter | None = None,
) -> PassResult:
    """Replace ``quant_fp8_static(reshape(op(...)), scale)`` by ``reshape(quant_op(..., scale))``
    for each declared op (module docstring); near misses at the attention calls that nearly fused."""
    result = PassResult()
    declared = {d.op: d for d in attention_quant}
    watched = [*declared, *(op for op in map(resolve_op, splitting_ops) if op is not None)]
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and any(target_matches(n.target, op) for op in watched)]
    if not calls:
        return result
    Anchors(gm.graph)  # numbers the nodes: the matcher compares positions
    fake_mode = meta.fake_mode_of(gm.graph)
    for attn in calls:
        site = _find(attn)
        if site is None:
            continue  # nothing FP8 computed from this output: not a site
        decl = next((d for op, d in declared.items() if target_matches(attn.target, op)), None)
        why = site.reason or _refusal(site, decl)
        if why is not None:
            result.near_misses.append(NearMiss(RULE, attn.name, meta.source_line(attn), site.quant.name, why,
                                               meta.module_path(attn)))  # fmt: skip
            continue
        assert decl is not None
        refusal = site_filter(attn, [attn, *site.views, *site.match.internal]) if site_filter is not None else None
        if refusal is None:
            refusal = _replace(gm.graph, site, decl, fake_mode, result)
        if refusal is not None:
            result.rejected.append(Rejected(RULE, attn.name, meta.source_line(attn), refusal))
    return result


def _find(attn: fx.Node) -> _Site | None:
    """The output of ``attn`` followed through single-reader reshapes, and the first FP8 value
    computed from it within :data:`MAX_HOPS` nodes, matched as a static quantizer; None when no
    FP8 value is computed from the output (not a site)."""
    views: list[fx.Node] = []
    out = attn
    while len(out.users) == 1 and (user := next(iter(out.users))).op == "call_function" and user.target in _RESHAPES:
        views.append(user)
        out = user
    quant, between = _first_fp8(out)
    if quant is None:
        return None
    site = _Site(attn, views, quant)
    if any(n.target in _REDUCTIONS for n in between):
        site.reason = ("a dynamic quantization: its scale is reduced from the attention output (per token, group "
                       "or block); the fused attention takes a static scale")  # fmt: skip
        return site
    found = match_at(QUANT_STATIC, quant)
    if isinstance(found, Failure):
        site.reason = f"the FP8 value `{quant.name}` is not a static quantization of the output: {found.reason}"
        return site
    site.match = found
    x = found.bindings["x"]
    if x is not out:
        site.reason = (f"the value quantized, `{getattr(x, 'name', x)}`, is computed from the attention output "
                       "(not the output itself, through reshapes)")  # fmt: skip
    return site


def _first_fp8(out: fx.Node) -> tuple[fx.Node | None, set[fx.Node]]:
    """The first node (graph order) at most :data:`MAX_HOPS` users away from ``out`` whose value
    is FP8, and the nodes on the way from ``out`` to it (:func:`_between`)."""
    frontier, seen = [out], {out}
    for _ in range(MAX_HOPS):
        frontier = [u for n in frontier for u in n.users if u not in seen and u.op == "call_function"]
        seen.update(frontier)
        hits = [n for n in frontier if (t := meta.tensor(n)) is not None and t.dtype == FP8_DTYPE]
        if hits:
            quant = min(hits, key=lambda n: n.meta["_fxr_pos"])
            return quant, _between(out, quant)
        if not frontier:
            break
    return None, set()


def _between(out: fx.Node, quant: fx.Node) -> set[fx.Node]:
    """The nodes on the way from ``out`` to ``quant``: those ``quant`` reads (directly or not)
    that read ``out`` (directly or not). Graph order bounds the walks to the nodes between the two."""
    lo = out.meta["_fxr_pos"]

    def back(start: fx.Node) -> set[fx.Node]:
        seen, stack = set(), [start]
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack += [a for a in n.all_input_nodes if a.meta.get("_fxr_pos", -1) > lo]
        return seen

    span = back(quant)
    return {n for n in span if any(a is out for m in back(n) for a in m.all_input_nodes)}


def _refusal(site: _Site, decl: AttentionQuant | None) -> str | None:
    """Why a static quantizer of the whole output does not fuse, or None."""
    attn, out = site.attn, site.views[-1] if site.views else site.attn
    if decl is None:
        name = attn.target.name() if isinstance(attn.target, torch._ops.OpOverload) else str(attn.target)
        return f"`{name}` has no declared FP8-output twin (Config.attention_quant)"
    inside = set(site.match.internal)
    others = [u for u in out.users if u not in inside]
    if others:
        return f"the attention output is also read by `{others[0].name}`: the fused op returns only FP8"
    scale = site.match.bindings["scale"]
    if isinstance(scale, fx.Node) and scale.meta.get("_fxr_pos", 0) > attn.meta["_fxr_pos"]:
        return f"the scale `{scale.name}` is computed after the attention call"
    return None


def _replace(graph: fx.Graph, site: _Site, decl: AttentionQuant, fake_mode: Any, result: PassResult) -> str | None:
    """Insert ``quant_op`` and the reshapes in place of the call; erase the call and the quantizer."""
    attn, quant = site.attn, site.quant
    args = decl.call_args(attn, site.match.bindings["scale"])
    if args is None:
        return f"the call's arguments do not bind to {decl.op._schema}"
    new: list[fx.Node] = []
    with graph.inserting_before(attn):
        fused = graph.call_function(decl.quant_op, args)
        new.append(fused)
        for v in site.views:
            new.append(graph.node_copy(v, lambda a, v=v: new[-1] if a is v.args[0] else a))
    for n in new:
        n.meta = {"fxr_rule": RULE, "_fxr_pos": attn.meta["_fxr_pos"]}
        meta.copy_provenance(attn if n is fused else site.views[new.index(n) - 1], n)
        meta.propagate(n, fake_mode)
    got, want = meta.tensor(new[-1]), meta.tensor(quant)
    if got is None or want is None or got.dtype != want.dtype or not meta.sizes_match(got, want):
        for n in reversed(new):
            graph.erase_node(n)
        return f"{decl.quant_op} returns {_describe(got)} where the quantizer gives {_describe(want)}"
    quant.replace_all_uses_with(new[-1])
    for n in reversed([attn, *site.views, *site.match.internal]):
        if not n.users:
            graph.erase_node(n)
    result.matches += 1
    result.sites.append(Site(RULE, fused.name, meta.source_line(fused), meta.module_path(fused)))
    return None


def _describe(t: torch.Tensor | None) -> str:
    return "no fake value" if t is None else f"{t.dtype} {tuple(t.shape)}"


__all__ = ["QUANT_STATIC", "RULE", "AttentionQuant", "fuse_attention_quant"]
