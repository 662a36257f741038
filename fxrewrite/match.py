"""The node-walking matcher: find a rule's pattern in a graph and replace it.

Matching starts at an *anchor*: a graph node whose target equals the target of the pattern's
first output. Graph nodes are indexed by target once per rule, so a pass costs time linear in
the graph's size. From the anchor the matcher walks the pattern's inputs backwards, pairing each
pattern node with a graph node:

* operations pair when their canonical targets are equal and their arguments pair; for ``add``
  and ``mul`` both argument orders are tried (backtracking); a pattern's ``reshape`` (canonicalized
  without shapes) also pairs with the graph's ``flatten`` / ``unflatten``, its size list read as a
  reshape would write it (``canonicalize_shape.SPELLINGS``);
* a pattern argument (placeholder) binds a graph node the first time and must see the same node
  every later time; a scalar wildcard binds a literal or a symbolic scalar node;
* a cast in the pattern pairs with nothing when the graph value already has that dtype (the
  canonicalizer removed the no-op cast), or when it is an operand of ``+ - * /`` that promotes
  it to that dtype anyway (the canonicalizer removed that cast too);
* literals compare equal (``2 == 2.0``, lists element-wise);
* an output off the walk (one operation on values it paired, such as vLLM's cast of the residual
  sum beside the norm that reads it) pairs with a graph reader of their graph nodes.

A structural match is then checked: internal nodes used outside the match (containment), the
rule's guard, and no output that another node reads before the match's end (which would need
reordering, or be a cycle). The best failed attempt at an anchor is kept with its reason: the
near miss the report shows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from fxrewrite import meta
from fxrewrite.canonicalize import ADD, CAST, COMMUTATIVE, DIV, MAX, MUL, SUB
from fxrewrite.canonicalize_shape import SPELLINGS, args_as
from fxrewrite.rule import COMPLETE, NOT_A_SITE, Bindings, Rule, Scalar

ARITHMETIC = frozenset({ADD, SUB, MUL, DIV})

@dataclasses.dataclass
class Match:
    """A checked match of ``rule`` whose first output is ``anchor``."""

    rule: Rule
    anchor: fx.Node
    nodes: dict[fx.Node, fx.Node]  # pattern node -> graph node
    bindings: dict[str, Any]  # pattern argument -> graph node or literal
    elided: set[fx.Node]  # pattern casts that paired with nothing

    @property
    def internal(self) -> list[fx.Node]:
        """Graph nodes the match consumes, in graph order (anchor last)."""
        seen = {g for p, g in self.nodes.items() if p.op == "call_function" and p not in self.elided}
        return sorted(seen, key=_position)


@dataclasses.dataclass
class Failure:
    """Why a rule did not match at an anchor: the first differing graph node and a reason."""

    reason: str
    at: fx.Node | None
    progress: float


def _position(n: fx.Node) -> float:
    """The node's place in graph order, numbered by the pass (``rewrite.Anchors``): matching
    and in-place checks compare positions."""
    return n.meta["_fxr_pos"]


def _describe(v: Any) -> str:
    if isinstance(v, fx.Node):
        return f"`{v.name}`"
    if v is MAX:
        return "end"  # a canonical slice's "to the end"
    return repr(v)


def _target_name(t: Any) -> str:
    if isinstance(t, torch._ops.OpOverload):
        return f"{t._schema.name.split('::')[-1]}"
    return getattr(t, "__name__", str(t))


_Where = "tuple[fx.Node, str] | None"


def _arg_names(target: Any, n: int) -> list[str]:
    """Names of the first ``n`` positional arguments of ``target`` (``arg<i>`` when unknown)."""
    schema = getattr(target, "_schema", None)
    names = [a.name for a in schema.arguments if not a.kwarg_only] if schema is not None else []
    return [names[i] if i < len(names) else f"arg{i}" for i in range(n)]


def _pattern_arguments(p: fx.Node) -> tuple[tuple[str, ...], tuple[str, ...], frozenset[str]]:
    """A pattern node's argument names (positional, then its keywords sorted) and keywords,
    worked out once per pattern node (kept in its meta): the walker asks at every graph node
    it pairs."""
    found = p.meta.get("_fxr_arguments")
    if found is None:
        keywords = tuple(sorted(p.kwargs))
        found = p.meta["_fxr_arguments"] = (tuple(_arg_names(p.target, len(p.args))) + keywords, keywords, frozenset(keywords))
    return found


def _arg(where: Any) -> str:
    """``"`mean` keepdim: "``: which argument of which node a reason is about."""
    return f"`{where[0].name}` {where[1]}: " if where else ""


def _implied_by_promotion(t: torch.Tensor, dtype: torch.dtype, g: Any, where: _Where) -> bool:
    """``g`` (value ``t``) is an operand of a canonical ``+ - * /`` (``where``'s node) that
    promotes it to ``dtype`` anyway."""
    if not where or where[0].target not in ARITHMETIC or where[0].kwargs:
        return False
    others = [a for a in where[0].args[:2] if a is not g]
    if len(others) != 1:
        return False
    other = meta.tensor(others[0]) if isinstance(others[0], fx.Node) else others[0]
    return other is not None and meta.promotion_makes(t, dtype, other)


def _lit_eq(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_lit_eq(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b)


@dataclasses.dataclass
class _State:
    nodes: dict[fx.Node, fx.Node]
    owner: dict[fx.Node, fx.Node]  # graph node -> pattern node
    binds: dict[str, Any]
    elided: set[fx.Node]

    def copy(self) -> _State:
        return _State(dict(self.nodes), dict(self.owner), dict(self.binds), set(self.elided))


class _Walker:
    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.cr = rule.compiled
        self.best: Failure | None = None

    def fail(self, st: _State, reason: str | Callable[[], str], at: Any) -> None:
        """Record a failure if it got further than the best so far (``reason`` may be a callable,
        evaluated only then: most anchors fail at once and their reasons are never shown)."""
        # A cast the graph does not have (elided) matched nothing: it counts on neither side,
        # or a product of two products, cast-free in float32, would be half of an RMSNorm.
        done = sum(1 for p in st.nodes if p.op == "call_function" and p not in st.elided)
        progress = done / max(self.cr.op_count - len(st.elided), 1)
        if self.best is None or progress > self.best.progress:
            text = reason() if callable(reason) else reason
            self.best = Failure(text, at if isinstance(at, fx.Node) else None, progress)

    # Each matcher yields every state in which the pair matches (backtracking on alternatives).
    # ``where`` is the graph node whose argument ``g`` is, and the argument's name: a literal has
    # no node of its own, so a mismatch there is reported at that node.
    def value(self, p: Any, g: Any, st: _State, where: _Where = None) -> Iterator[_State]:
        if isinstance(p, fx.Node):
            if p.op == "placeholder":
                yield from self.placeholder(p, g, st, where)
            else:
                yield from self.node(p, g, st, where)
        elif isinstance(p, (list, tuple)):
            if not isinstance(g, (list, tuple)) or len(p) != len(g):
                self.fail(st, f"{_arg(where)}expected {len(p)} values, found {_describe(g)}", g)
                return
            yield from self.seq(list(p), list(g), st, [where] * len(p))
        elif isinstance(g, fx.Node):
            c = meta.constant(g)
            if c is not None and _lit_eq(p, c):
                yield st  # a lifted constant (Dynamo makes global floats symbolic) equal to p
                return
            self.fail(st, f"{_arg(where)}expected literal {p!r}, found node {_describe(g)}", g)
        elif _lit_eq(p, g):
            yield st
        else:
            self.fail(st, f"{_arg(where)}literal {g!r} != {p!r}", where and where[0])

    def seq(self, ps: list[Any], gs: list[Any], st: _State, wheres: list[_Where] | None = None) -> Iterator[_State]:
        if not ps:
            yield st
            return
        where = wheres[0] if wheres else None
        for st1 in self.value(ps[0], gs[0], st, where):
            yield from self.seq(ps[1:], gs[1:], st1, wheres[1:] if wheres else None)

    def placeholder(self, p: fx.Node, g: Any, st: _State, where: _Where = None) -> Iterator[_State]:
        name = p.target
        spec: Scalar | None = self.rule.scalars.get(name)
        if name in st.binds:
            bound = st.binds[name]
            same = bound is g if isinstance(bound, fx.Node) or isinstance(g, fx.Node) else _lit_eq(bound, g)
            if not same:
                self.fail(st, f"{_describe(g)} != bound {name} {_describe(bound)}", g)
                return
            yield st
            return
        if spec is not None:
            why = spec.accepts(g)
            if why is not None:
                self.fail(st, f"{name}: {why}", g if isinstance(g, fx.Node) else where and where[0])
                return
        elif g is None and name in self.rule.optional:
            pass  # an absent optional tensor (a LayerNorm without weight or bias)
        elif not isinstance(g, fx.Node):
            self.fail(st, f"{_arg(where)}{name}: expected a tensor, found literal {g!r}", where and where[0])
            return
        elif meta.value(g) is not None and not meta.is_tensor(g):
            self.fail(st, f"{_arg(where)}{name}: expected a tensor, found scalar {_describe(g)}", g)
            return
        st = st.copy()
        st.binds[name] = g
        yield st

    def node(self, p: fx.Node, g: Any, st: _State, where: _Where = None) -> Iterator[_State]:
        if p in st.nodes:
            if st.nodes[p] is g:
                yield st
            else:
                self.fail(st, f"{_describe(g)} is not {_describe(st.nodes[p])}", g)
            return
        if p.target is CAST:
            yield from self.elided_cast(p, g, st, where)
        if not isinstance(g, fx.Node):
            self.fail(st, f"expected `{_target_name(p.target)}`, found literal {g!r}", None)
            return
        if g.op != "call_function" or (g.target != p.target and g.target not in SPELLINGS.get(p.target, ())):
            self.fail(st, lambda: self.mismatch_reason(p, g), g)
            return
        if g in st.owner:
            self.fail(st, f"{_describe(g)} already paired with pattern node {st.owner[g].name}", g)
            return
        names, keywords, keyword_set = _pattern_arguments(p)
        if keyword_set != g.kwargs.keys():
            self.fail(st, f"`{g.name}`: keyword arguments {sorted(g.kwargs)} != {list(keywords)}", g)
            return
        ga = args_as(p.target, g)
        if ga is None:
            self.fail(st, f"`{g.name}` computes a `{_target_name(p.target)}` of a shape not known here", g)
            return
        st = st.copy()
        st.nodes[p], st.owner[g] = g, p
        pa = list(p.args)
        if len(pa) != len(ga):
            self.fail(st, f"`{g.name}`: {len(ga)} arguments, pattern has {len(pa)}", g)
            return
        orders = [ga]
        if p.target in COMMUTATIVE and len(ga) == 2:
            orders.append([ga[1], ga[0]])
        pk = [p.kwargs[k] for k in keywords]
        gk = [g.kwargs[k] for k in keywords]
        wheres: list[_Where] = [(g, n) for n in names]
        for args in orders:
            yield from self.seq(pa + pk, args + gk, st, wheres)

    def side(self, ps: list[fx.Node], st: _State) -> Iterator[_State]:
        """Pair the pattern's outputs off the walk from the anchor: each is one operation on nodes
        the walk paired, so its graph node reads theirs (a cast the graph elided is the node)."""
        if not ps:
            yield st
            return
        p = ps[0]
        src = p.all_input_nodes[0]
        g_src = st.binds.get(src.target) if src.op == "placeholder" else st.nodes.get(src)
        if not isinstance(g_src, fx.Node):
            self.fail(st, f"output `{p.name}` reads `{src.name}`, which is not a graph value here", None)
            return
        readers = [u for u in g_src.users if u.op == "call_function" and u.target == p.target and u not in st.owner]
        paired = False
        elided = self.elided_cast(p, g_src, st) if p.target is CAST else iter(())
        for st1 in [*elided, *(st2 for g in readers for st2 in self.node(p, g, st))]:
            paired = True
            yield from self.side(ps[1:], st1)
        if not paired:
            self.fail(st, f"no reader of `{g_src.name}` computes the pattern's output `{p.name}` "
                      f"(`{_target_name(p.target)}`)", g_src)  # fmt: skip

    def elided_cast(self, p: fx.Node, g: Any, st: _State, where: _Where = None) -> Iterator[_State]:
        """A pattern cast pairs with nothing when ``g`` already has the cast's dtype, or when
        ``g`` is an operand of ``+ - * /`` whose type promotion makes the cast anyway (the
        canonicalizer removed it: ``meta.promotion_makes``)."""
        t = meta.tensor(g)
        if t is None or (isinstance(g, fx.Node) and g.target is CAST and g not in st.owner):
            return
        want = p.args[1]
        st = st.copy()
        if isinstance(want, fx.Node):  # dtype wildcard
            name = want.target
            if name in st.binds and st.binds[name] != t.dtype:
                return
            st.binds[name] = t.dtype
        elif want != t.dtype and not _implied_by_promotion(t, want, g, where):
            return
        st.nodes[p] = g
        st.elided.add(p)
        yield from self.value(p.args[0], g, st)

    def mismatch_reason(self, p: fx.Node, g: fx.Node) -> str:
        want = _target_name(p.target)
        got = _target_name(g.target) if g.op == "call_function" else f"{g.op} {g.target}"
        for inner in g.all_input_nodes:
            if inner.op == "call_function" and inner.target == p.target:
                return f"target `{got}` interposed (`{g.name}`) where `{want}` was expected"
        return f"expected `{want}`, found `{got}` (`{g.name}`)"


def match_at(rule: Rule, anchor: fx.Node) -> Match | Failure:
    """Try ``rule`` with its first output paired to ``anchor``; a checked Match or the best Failure."""
    w = _Walker(rule)
    cr = w.cr
    st0 = _State({}, {}, {}, set())
    walks = (st for st1 in w.node(cr.anchor, anchor, st0) for st in w.side(cr.side_outputs, st1))
    for st in walks:
        m = Match(rule, anchor, st.nodes, st.binds, st.elided)
        why, at = _check(m)
        if why is None:
            return m
        if why is NOT_A_SITE:
            continue  # the guard says these values are not the rule's business: no near miss
        if w.best is None or w.best.progress < COMPLETE:
            # a complete structure that failed a check is the nearest miss there is
            w.best = Failure(why, at, COMPLETE)
    return w.best or Failure("no structural match", anchor, 0.0)


def _check(m: Match) -> tuple[str | None, fx.Node | None]:
    """Containment, scalar predicates, guard, ordering."""
    cr = m.rule.compiled
    inside = set(m.internal)
    outputs = {m.nodes[o] for o in cr.outputs}
    for g in m.internal:
        if g in outputs:
            continue
        outside = [u for u in g.users if u not in inside]
        if outside:
            explain = m.rule.explain_shared
            if explain is not None and (why := explain(g, outside, inside)) is not None:
                return why, g
            names = ", ".join(f"`{u.name}`" for u in outside[:3])
            return f"internal node `{g.name}` has {len(outside)} user(s) outside the match ({names})", g
    written = _written_between(m, inside)
    if written is not None:
        return written
    unknown = [name for name, g in m.bindings.items()
               if isinstance(g, fx.Node) and meta.value(g) is None and name not in m.rule.scalars]  # fmt: skip
    if unknown and m.rule.guard is not None:
        return f"no fake value for {', '.join(unknown)}: the guard cannot check it", m.bindings[unknown[0]]
    why = m.rule.check_guard(Bindings(m.bindings, m.anchor))
    if why is not None:
        return why, m.anchor
    end = _position(m.anchor)
    for o in outputs - {m.anchor}:
        early = [u for u in o.users if u not in inside and _position(u) < end]
        if early:
            return (
                f"output `{o.name}` is read by `{early[0].name}` before the match ends at `{m.anchor.name}` "
                "(replacing it would need reordering or form a cycle)",
                early[0],
            )
    return None, None


def _storage(n: fx.Node) -> fx.Node:
    """The node whose storage ``n`` shares: through views and in-place ops (``x.mul_(2)``
    returns ``x``) to the first that owns it."""
    while n.args and isinstance(n.args[0], fx.Node) and (meta.is_view(n) or n.args[0] in meta.written_args(n)):
        n = n.args[0]
    return n


def _written_between(m: Match, inside: set[fx.Node]) -> tuple[str, fx.Node] | None:
    """A node outside the match that writes in place a value the match takes (a binding, or
    storage it shares) after a matched node read it and before the anchor: the matched code read
    it before and after the write, the replacement reads it once, at the anchor. (reason,
    writer) or None. The match's own values are not checked here: a writer of one is a user
    outside the match, which containment refuses. Walks the nodes between (a match spans a few)."""
    first_read: dict[fx.Node, float] = {}  # storage -> position of the first matched node reading it
    for b in m.bindings.values():
        readers = [_position(u) for u in b.users if u in inside] if isinstance(b, fx.Node) else []
        if readers:
            root = _storage(b)
            first_read[root] = min(first_read.get(root, math.inf), *readers)
    if not first_read:
        return None
    start = min(first_read.values())
    n = m.anchor.prev
    while n.op != "root" and _position(n) > start:
        if n not in inside:
            for w in meta.written_args(n):
                if isinstance(w, fx.Node) and _position(n) > first_read.get(root := _storage(w), math.inf):
                    return (f"`{root.name}` is written in place by `{n.name}` between the nodes that read it "
                            f"(the fused op would read it once, at `{m.anchor.name}`)", n)  # fmt: skip
        n = n.prev
    return None


def inplace_blocker(m: Match) -> str | None:
    """None if every tensor the in-place replacement overwrites is dead after the match and is
    neither a graph input nor a view; otherwise the reason the functional form is used."""
    spec = m.rule.inplace
    if spec is None:
        return "no in-place form"
    inside = set(m.internal)
    end = _position(m.anchor)
    bound = [m.bindings[name] for name in spec.overwrites]
    if len({id(b) for b in bound}) < len(bound):
        return "one tensor is bound to two overwritten arguments " + ", ".join(spec.overwrites)
    for name in spec.overwrites:
        g = m.bindings[name]
        if not isinstance(g, fx.Node):
            return f"{name} is not a graph value"
        if g.op == "placeholder":
            return f"{name} (`{g.name}`) is a graph input"
        if g.op == "get_attr" or meta.is_view(g):
            return f"{name} (`{g.name}`) may alias other storage"
        late = _late_readers(g, inside, end)
        if late:
            return f"{name} (`{g.name}`) is read later by `{late.name}`"
    return None


def _late_readers(g: fx.Node, inside: set[fx.Node], end: int) -> fx.Node | None:
    """A node outside the match that reads ``g`` (directly or through a view of it) at or after
    position ``end``."""
    stack = [g]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in inside:
                continue
            if _position(u) >= end:
                return u
            if meta.is_view(u):
                stack.append(u)
    return None
