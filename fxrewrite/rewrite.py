"""Apply rules to a graph: match at anchors, replace, record sites and near misses.

One call of ``apply_rules`` is one pass. For each rule, in order, the graph's nodes with the
rule's anchor target are collected (one scan: linear in graph size) and tried one by one; a
match is replaced at once, so later anchors never overlap an earlier match's nodes::

    %pow_1 = aten.pow.Tensor_Scalar(%x, 2)
    %mean  = aten.mean.dim(%pow_1, [-1], True)
    %add   = aten.add.Tensor(%mean, %item)            ->   %rms_norm = fxr.rms_norm(%x, %w, %item)
    %rsqrt = aten.rsqrt.default(%add)
    %mul   = aten.mul.Tensor(%x, %rsqrt)
    %mul_1 = aten.mul.Tensor(%w, %mul)

Replacement nodes are inserted just before the anchor, get fake values computed from their inputs
(checked against the values they replace: a replacement whose outputs differ in shape or dtype is
rejected, never applied), and keep the ``stack_trace`` / ``nn_module_stack`` of the anchor.

Before the first match is checked or applied, a :class:`Prebuild` (the backend passes the
runtime's) gets the calls the pass's matches will make to the ops it builds kernels for, with
the bound inputs' fake values, from one scan that applies nothing: it builds those kernels in
parallel (Triton's JIT otherwise builds them one after another, at the first run of each,
which is verification's)::

    %h = fxr.silu_and_mul(aten.linear(%x, %w))   ->   prebuild([(fxr.linear_silu_and_mul, (x, w))])
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Protocol

import torch.fx as fx
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from fxrewrite import meta
from fxrewrite.canonicalize import CAST, noop_source
from fxrewrite.canonicalize_shape import pairs_with
from fxrewrite.match import Failure, Match, inplace_blocker, match_at
from fxrewrite.passes import mark_site
from fxrewrite.report import NearMiss, PassResult, Rejected, Site
from fxrewrite.rule import Bindings, Rule

# Called with each match before it is applied; returns None to go ahead, or a reason to refuse.
Verifier = Callable[[Match], "str | None"]

# A call a replacement will make: target, args, kwargs (fake values for graph values).
Call = tuple[Any, tuple[Any, ...], dict[str, Any]]


class Prebuild(Protocol):
    """Builds ahead the kernels of the calls a pass's replacements will make."""

    def wants(self, target: Any) -> bool:
        """Whether calls of ``target`` have anything to build (only those rules are scanned)."""
        ...

    def __call__(self, calls: list[Call]) -> str | None:
        """Build what ``calls`` need (returning when it is built); a line for the report, or None."""
        ...


def apply_rules(
    gm: fx.GraphModule, rules: Sequence[Rule], near_miss_min: float = 0.5, verify: Verifier | None = None,
    prebuild: Prebuild | None = None,
) -> PassResult:
    """Apply ``rules`` in order to ``gm`` (in place); what matched, nearly matched, was refused."""
    result = PassResult()
    fake_mode = meta.fake_mode_of(gm.graph)
    if prebuild is not None and (calls := planned_calls(gm, rules, prebuild.wants)):
        note = prebuild(calls)
        if note:
            result.notes.append(note)
    erased: set[fx.Node] = set()
    misses: list[tuple[fx.Node, NearMiss]] = []
    index: Anchors | None = None
    for rule in rules:
        if rule.requires and (index := index or Anchors(gm.graph)).absent(rule.requires):
            continue
        if rule.via == "subgraph_rewriter":
            _apply_subgraph_rewriter(gm, rule, result, fake_mode)
            index = None  # its nodes are neither numbered nor indexed
            continue
        cr = rule.compiled
        index = index or Anchors(gm.graph)
        least = near_miss_min if rule.near_miss_min is None else rule.near_miss_min
        prune = _shallow_progress(cr.anchor) / max(cr.op_count, 1) < least  # pruned: no near miss
        rule_misses: dict[fx.Node, NearMiss] = {}
        for anchor in index.get(cr.anchor_targets):
            if anchor in erased or (prune and not _may_match(cr.anchor, anchor)):
                continue
            try:
                found = match_at(rule, anchor)
                if isinstance(found, Failure):
                    if found.progress >= least:
                        at = found.at.name if found.at is not None else ""
                        rule_misses[anchor] = NearMiss(rule.name, anchor.name, meta.source_line(anchor), at,
                                                       found.reason, meta.module_path(anchor))  # fmt: skip
                    continue
                refusal = verify(found) if verify is not None else None
                if refusal is None:
                    refusal = _replace(gm.graph, found, fake_mode, result, erased, index)
            except Exception as e:
                mark_site(e, anchor)  # the report names the site (fxrewrite.passes)
                raise
            if refusal is not None:
                result.rejected.append(Rejected(rule.name, anchor.name, meta.source_line(anchor), refusal))
        # One site, one miss: an attempt at a node whose consumer is an anchor that nearly matched
        # too (a pattern ending in a cast tried with and without the cast) is part of that one.
        misses += [(a, miss) for a, miss in rule_misses.items() if not any(u in rule_misses for u in a.users)]
    # A site another rule of this pass fused is no miss (Gemma's norm pattern nearly matches a
    # plain norm that the plain rule then takes).
    result.near_misses += [miss for anchor, miss in misses if anchor not in erased]
    return result


class Anchors:
    """A rules pass's index of its graph's call nodes by target, in graph order, made in one scan
    that also numbers every node (``meta["_fxr_pos"]``): each rule takes its anchors from it instead
    of scanning the graph. Nodes a replacement inserts are numbered between their neighbours
    and added (:meth:`add`), so a later rule of the pass may anchor on them."""

    def __init__(self, graph: fx.Graph) -> None:
        self.by_target: dict[Any, list[fx.Node]] = {}
        for i, n in enumerate(graph.nodes):
            n.meta["_fxr_pos"] = i * 4
        for n in meta.outside_transforms(graph):  # no anchor inside a vmapped body
            if n.op == "call_function":
                self.by_target.setdefault(n.target, []).append(n)
        self.unsorted: set[Any] = set()

    def absent(self, targets: Iterable[Any]) -> bool:
        """No node calls any of ``targets``."""
        return not any(self.by_target.get(t) for t in targets)

    def get(self, targets: Collection[Any]) -> list[fx.Node]:
        """The nodes calling ``targets``, in graph order (erased ones included: callers skip them)."""
        found: list[fx.Node] = []
        for t in targets:
            nodes = self.by_target.get(t, [])
            if t in self.unsorted:
                nodes.sort(key=_pos)
                self.unsorted.discard(t)
            found += nodes
        return sorted(found, key=_pos) if len(targets) > 1 else found

    def add(self, n: fx.Node) -> None:
        if n.op == "call_function":
            self.by_target.setdefault(n.target, []).append(n)
            self.unsorted.add(n.target)


def _pos(n: fx.Node) -> float:
    return n.meta["_fxr_pos"]


def planned_calls(gm: fx.GraphModule, rules: Sequence[Rule], wants: Callable[[Any], bool]) -> list[Call]:
    """The calls to targets ``wants`` accepts that the replacements of ``rules`` would make, from
    one scan that applies nothing (a node an earlier match consumed is not matched again): the
    target and its arguments, a bound graph value as its fake value at the hints
    (:func:`meta.example`: what verification would run it on), a literal as it is. Calls
    with an argument computed inside the replacement are left out; so are matches that only
    exist once an earlier replacement is in place."""
    calls: list[Call] = []
    consumed: set[fx.Node] = set()
    index: Anchors | None = None
    for rule in rules:
        if rule.via == "subgraph_rewriter":
            continue
        cr = rule.compiled
        index = index or Anchors(gm.graph)  # nothing is applied: one numbering serves every rule
        builds: bool | None = None  # whether the replacements call a target to build: asked at a match
        for anchor in index.get(cr.anchor_targets):  # a walk that cannot pass the anchor is not tried (at worst
            # a kernel is not built ahead; on a 32-layer Llama 4,904 walks instead of 15,660)
            found = None if anchor in consumed or not _may_match(cr.anchor, anchor) else match_at(rule, anchor)
            if not isinstance(found, Match) or consumed.intersection(found.internal):
                continue
            if builds is None:
                bodies = [b for b in (cr.replacement, cr.inplace) if b is not None]
                builds = any(n.op == "call_function" and wants(n.target) for b in bodies for n in b.graph.nodes)
            if not builds:
                break
            consumed.update(found.internal)
            body = cr.inplace if inplace_blocker(found) is None else cr.replacement
            bound = {p: found.bindings[p.target] for p in body.graph.find_nodes(op="placeholder")}
            for n in body.graph.nodes:
                if n.op != "call_function" or not wants(n.target) or not all(a in bound for a in n.all_input_nodes):
                    continue
                values = {a: meta.example(meta.value(b)) if isinstance(b := bound[a], fx.Node) else b
                          for a in n.all_input_nodes}
                if all(v is not None or not isinstance(bound[a], fx.Node) for a, v in values.items()):
                    calls.append((n.target, fx.node.map_arg(n.args, values.__getitem__),
                                  fx.node.map_arg(n.kwargs, values.__getitem__)))
    return calls


def graph_calls(gm: fx.GraphModule, wants: Callable[[Any], bool]) -> list[Call]:
    """The calls ``gm`` makes to targets ``wants`` accepts, graph values as their fake values at
    the hints, as :func:`planned_calls` gives them: what a graph loaded from the compile cache
    builds ahead, with no rule to scan."""
    calls: list[Call] = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or not wants(n.target):
            continue
        values = {a: meta.example(meta.value(a)) for a in n.all_input_nodes}
        if all(v is not None for v in values.values()):
            calls.append((n.target, fx.node.map_arg(n.args, values.__getitem__), fx.node.map_arg(n.kwargs, values.__getitem__)))
    return calls


def _shallow_progress(anchor: fx.Node) -> int:
    """The most pattern nodes a walk that fails at the anchor's arguments can have matched: the
    anchor, an elided cast in its place, and elided casts among its arguments."""
    heads = [anchor] + ([anchor.args[0]] if anchor.target is CAST and isinstance(anchor.args[0], fx.Node) else [])
    return 2 + sum(1 for h in heads for a in h.all_input_nodes if a.target is CAST)


def _may_match(p: fx.Node, g: fx.Node) -> bool:
    """A cheap test that a walk from ``g`` could get past the anchor: some input of ``g`` has the
    target of an operation feeding the pattern's anchor (or, for a cast there, of the cast's
    input, since the graph may have elided it). Most add/mul nodes of a model fail it; a walk from them would fail at the
    anchor's first argument, matching one pattern node, too little for a near miss."""
    if p.target is CAST and g.target is not CAST:
        p = p.args[0]  # the anchor's cast is elided in this graph
    want: set[Any] = set()
    for a in p.all_input_nodes:
        if a.op == "call_function":
            want |= pairs_with(a.target)
            if a.target is CAST and isinstance(a.args[0], fx.Node) and a.args[0].op == "call_function":
                want |= pairs_with(a.args[0].target)  # the graph may have elided this cast
    return not want or any(a.op == "call_function" and a.target in want for a in g.all_input_nodes)


def _replace(graph: fx.Graph, m: Match, fake_mode: Any, result: PassResult, erased: set[fx.Node],
             index: Anchors) -> str | None:  # fmt: skip
    """Insert the replacement before the anchor and remove the match; None, or why it was refused."""
    cr = m.rule.compiled
    blocker = inplace_blocker(m)
    inplace = blocker is None
    body = cr.inplace if inplace else cr.replacement
    env: dict[fx.Node, Any] = {}
    new: list[fx.Node] = []
    outs: list[Any] = []
    with graph.inserting_before(m.anchor):
        for rn in body.graph.nodes:
            if rn.op == "placeholder":
                env[rn] = m.bindings[rn.target]
            elif rn.op == "output":
                vals = rn.args[0]
                outs = [fx.node.map_arg(v, env.__getitem__) for v in (vals if isinstance(vals, (tuple, list)) else [vals])]
            elif rn.target is operator.getitem and isinstance(seq := env.get(rn.args[0]), (list, tuple)):
                env[rn] = seq[rn.args[1]]  # an element of a bound list (a reshape's sizes): read here, no node
            else:
                n = graph.node_copy(rn, env.__getitem__)
                n.meta = {"fxr_rule": m.rule.name}
                meta.copy_provenance(m.anchor, n)
                meta.propagate(n, fake_mode)
                if (src := noop_source(n)) is not None:  # a no-op once the scalars are bound
                    graph.erase_node(n)
                    env[rn] = src
                    continue
                env[rn] = n
                new.append(n)
    # Number the new nodes between the anchor and the node before them, so a later anchor may
    # match through them (or on them).
    end = m.anchor.meta["_fxr_pos"]
    prev = new[0].prev if new else None
    start = prev.meta["_fxr_pos"] if prev is not None and prev.op != "root" else end - 4
    for i, n in enumerate(new):
        n.meta["_fxr_pos"] = start + (end - start) * (i + 1) / (len(new) + 1)
    olds = [m.nodes[o] for o in cr.outputs]
    why = _meta_mismatch(olds, outs)
    if why is not None:
        for n in reversed(new):
            graph.erase_node(n)
        return why
    for old, out in zip(olds, outs):
        old.replace_all_uses_with(out)
    for n in new:
        index.add(n)
    for n in reversed(m.internal):
        if not n.users:
            graph.erase_node(n)
            erased.add(n)
    _erase_unread_inputs(graph, m.bindings.values(), erased)
    result.matches += 1
    node = next((n for n in reversed(new) if n.op == "call_function" and n.target is not getattr), m.anchor)
    result.sites.append(
        Site(m.rule.name, node.name, meta.source_line(node), meta.module_path(node), inplace=inplace,
             note="" if inplace or m.rule.inplace is None else f"functional: {blocker}")  # fmt: skip
    )
    return None


def _erase_unread_inputs(graph: fx.Graph, bound: Iterable[Any], erased: set[fx.Node]) -> None:
    """Remove what only the match read and its replacement does not (the ``size`` call that gave
    ``F.layer_norm`` its normalized shape), and what only that read: left in place until the
    pass's cleanup, it would be a reader of values a later rule of the pass replaces."""
    stack = [n for v in bound for n in _nodes(v)]
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op not in ("call_function", "call_method") or meta.is_impure(n):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased.add(n)
        stack += inputs


def _nodes(v: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(v, found.append)
    return found


def _meta_mismatch(olds: list[fx.Node], outs: list[Any]) -> str | None:
    """Why the replacement's outputs cannot stand in for the pattern's, or None."""
    for old, out in zip(olds, outs):
        a, b = meta.tensor(old), meta.tensor(out)
        if a is not None and b is None and isinstance(out, fx.Node):
            name = out.name
            return f"replacement output `{name}` has no fake value (no fake kernel?): shape and dtype unchecked"
        if a is None or b is None:
            continue
        if a.dtype != b.dtype:
            return f"replacement output `{getattr(out, 'name', out)}` is {b.dtype}, the pattern's {a.dtype}"
        if not meta.sizes_match(a, b):
            return f"replacement output shape {tuple(b.shape)} != pattern's {tuple(a.shape)}"
    return None


def _apply_subgraph_rewriter(gm: fx.GraphModule, rule: Rule, result: PassResult, fake_mode: Any) -> None:
    """The same rule through ``torch.fx.subgraph_rewriter.replace_pattern_with_filters``: exact
    structural matching (no wildcards, no commutativity), the rule's guard as a match filter."""
    cr = rule.compiled
    names = [n.target for n in cr.pattern.graph.nodes if n.op == "placeholder"]
    rnames = [n.target for n in cr.replacement.graph.nodes if n.op == "placeholder"]
    if rnames != names:
        raise ValueError(f"rule {rule.name!r}: a subgraph_rewriter replacement must take the pattern's arguments in order")

    def guard(match: Any, original_graph: fx.Graph, pattern_graph: fx.Graph) -> bool:
        bound = dict(zip(names, match.placeholder_nodes))
        anchor = match.returning_nodes[0] if match.returning_nodes else None
        why = rule.check_guard(Bindings(bound, anchor))
        if why is None:
            return True
        if anchor is not None:
            result.near_misses.append(NearMiss(rule.name, anchor.name, meta.source_line(anchor), anchor.name, why,
                                                        meta.module_path(anchor)))
        return False

    replaced = replace_pattern_with_filters(gm, cr.pattern, cr.replacement, match_filters=[guard])
    for r in replaced:
        source = r.nodes_map.get(r.anchor, r.anchor)  # r.anchor is the pattern's node
        for n in r.replacements:
            meta.copy_provenance(source, n)
            n.meta["fxr_rule"] = rule.name
            meta.propagate(n, fake_mode)
        last = r.replacements[-1] if r.replacements else source
        result.sites.append(Site(rule.name, last.name, meta.source_line(last), meta.module_path(last)))
        result.matches += 1


def dead_code(gm: fx.GraphModule) -> int:
    """Remove nodes nobody reads (pure ops only: an in-place write stays, :func:`meta.is_impure`),
    last first so that their inputs may follow; returns how many. ``Graph.eliminate_dead_code``
    does the same after linting the graph and asking every node whether it is pure; here only
    nodes without users are asked."""
    removed = 0
    for node in reversed(gm.graph.nodes):
        if not node.users and not meta.is_impure(node):
            gm.graph.erase_node(node)
            removed += 1
    return removed

