"""A rule is data: a pattern written as model code, its replacement, and an optional guard.

Example (the whole RMSNorm rule lives in ``rewrites/norm.py``)::

    def pattern(x, weight, eps):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)        # -> dtype is a scalar wildcard in the real rule

    def replacement(x, weight, eps):
        return torch.ops.fxr.rms_norm(x, weight, eps)

    RULE = Rule("rms_norm", pattern, replacement, scalars={"eps": Scalar(float)})

Both functions are traced with ``torch.fx.symbolic_trace`` and the pattern is canonicalized by
the same code as the model graph, so ``x.pow(2)`` in a pattern also matches ``x * x`` in a model.
Pattern arguments are tensors unless named in ``scalars``: a scalar wildcard binds a literal
(``1e-6``) or a symbolic scalar node (HF models under ``dynamic=True`` read eps with ``.item()``),
subject to an optional predicate. The first value the pattern returns is its *anchor*; any further
returned values must be computed on the way to it (add + norm returns the normed value and the
sum).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from fxrewrite import meta
from fxrewrite.canonicalize import CAST, canonicalize
from fxrewrite.canonicalize_shape import pairs_with


class RuleError(ValueError):
    """A rule that cannot be used as written (untraceable, inconsistent outputs, bad names)."""


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A scalar wildcard: binds a literal or a symbolic scalar node.

    kind:       the Python type a literal must have (``float`` also accepts ints); None: any.
    predicate:  called with the literal value, or for a symbolic node that reads a lifted
                constant (``.item()`` of a module float under ``dynamic=True``) with the value
                it had at compile time; other symbolic values are accepted unchecked.
    """

    kind: type | None = None
    predicate: Callable[[Any], bool] | None = None

    def accepts(self, v: Any) -> str | None:
        """None if ``v`` may bind, else the reason it may not."""
        if isinstance(v, fx.Node):
            if meta.is_tensor(v):
                return "a tensor where a scalar is expected"
            c = meta.constant(v)  # a lifted constant's compile-time value, when the backend knows it
            if c is None or self.predicate is None or self.predicate(c):
                return None
            return f"{_describe_const(v, c)} fails the predicate of this wildcard"
        if self.kind is float and isinstance(v, bool):
            return f"{v!r} is not a float"
        if self.kind is not None and not isinstance(v, (self.kind, int) if self.kind is float else self.kind):
            return f"{v!r} is not a {self.kind.__name__}"
        if self.predicate is not None and not self.predicate(v):
            return f"{v!r} fails the predicate of this wildcard"
        return None


def _describe_const(node: fx.Node, value: Any) -> str:
    return f"`{node.name}` (= {value!r} at compile time)"


COMPLETE = 1.01
"""The progress of a failed match whose structure was complete and a check (guard, containment,
order) refused: a :attr:`Rule.near_miss_min` of this reports only those."""

NOT_A_SITE = "not a site of this rule"
"""What a guard returns when the values show that the structure that matched is not what the rule
is about (a per-channel weight pattern that matched the product of two activations): refused,
and no near miss."""


@dataclasses.dataclass(frozen=True)
class InPlace:
    """An in-place replacement, used only where the matcher proves it safe.

    replacement: returns the same values as the functional replacement, computed by a kernel
                 that overwrites the pattern inputs named in ``overwrites``.
    overwrites:  pattern arguments the kernel writes to; each must be dead after the match and
                 must not be a graph input or a view.
    """

    replacement: Callable[..., Any]
    overwrites: tuple[str, ...]


class Bindings(Mapping[str, Any]):
    """What a match bound, as a guard sees it: fake tensors for tensors, values for scalars.

    ``b["x"]`` is the fake tensor bound to pattern argument ``x`` (shape, dtype, device);
    ``b["eps"]`` is a literal or a SymFloat; ``b.node("x")`` is the graph node itself;
    ``b.anchor`` the graph node paired with the pattern's anchor (the order of its arguments,
    which commutative matching does not bind), None where the caller has none.
    """

    def __init__(self, raw: Mapping[str, Any], anchor: fx.Node | None = None) -> None:
        self._raw = dict(raw)
        self.anchor = anchor

    def __getitem__(self, name: str) -> Any:
        v = self._raw[name]
        if isinstance(v, fx.Node):
            mv = meta.value(v)
            return v if mv is None else mv
        return v

    def node(self, name: str) -> Any:
        return self._raw[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


Guard = Callable[[Bindings], "bool | str | None"]


def all_of(*guards: Guard) -> Guard:
    """A guard that accepts when every one of ``guards`` does; the first rejection is the reason."""

    def guard(b: Bindings) -> bool | str | None:
        for g in guards:
            ok = g(b)
            if not (ok is True or ok is None):
                return ok
        return True

    guard.__doc__ = " and ".join(g.__name__ for g in guards)
    return guard


@dataclasses.dataclass(frozen=True, eq=False)
class Rule:
    """``Rule(name, pattern, replacement, guard)``; see the module docstring.

    guard:       called with the Bindings of a structural match; returns True/None to accept,
                 False or a string (the reason, shown in near misses) to reject.
    via:         "walk" (fxrewrite's matcher: scalar wildcards, commutativity, several outputs,
                 in-place) or "subgraph_rewriter" (``torch.fx.subgraph_rewriter``; no wildcards).
    requires:    call targets of which the graph must hold at least one for the rule to be tried
                 at all; otherwise it is skipped without near misses (an all-reduce rule on a
                 graph with no collective: every add + norm would "nearly" match it).
    optional:    tensor arguments that may also bind a literal ``None`` (an absent weight or
                 bias: ``F.layer_norm(x, shape, None, None, eps)``); guards see ``b[name] is None``
                 and the replacement gets ``None``.
    near_miss_min: this rule's own threshold for reporting a failed match (default: the
                 config's). A rule that extends an op another rule fused (a residual add or a
                 weight taken into a fused norm) sets :data:`COMPLETE`: only a complete match
                 that a check refused (guard, containment, order) is a near miss there, not every
                 fused norm without an add before it.
    explain_shared: for a complete match refused because an internal node has readers outside
                 it, ``(node, outside readers, matched nodes)`` -> the reason in the rule's terms
                 (None: the matcher's own), as static FP8 says that a value quantized with two
                 scales cannot be one fused quantization.
    """

    name: str
    pattern: Callable[..., Any]
    replacement: Callable[..., Any]
    guard: Guard | None = None
    scalars: Mapping[str, Scalar] = dataclasses.field(default_factory=dict)
    inplace: InPlace | None = None
    via: Literal["walk", "subgraph_rewriter"] = "walk"
    requires: tuple[Any, ...] = ()
    optional: tuple[str, ...] = ()
    near_miss_min: float | None = None
    explain_shared: Callable[[fx.Node, list[fx.Node], set[fx.Node]], str | None] | None = None

    def __repr__(self) -> str:
        return f"Rule({self.name!r})"

    @functools.cached_property
    def compiled(self) -> CompiledRule:
        return CompiledRule.build(self)

    def check_guard(self, bindings: Bindings) -> str | None:
        """None if the guard accepts; otherwise the reason (:data:`NOT_A_SITE` as it is). A guard
        that raises is a bug in the rule: re-raised as RuleError naming the rule."""
        if self.guard is None:
            return None
        try:
            ok = self.guard(bindings)
        except Exception as e:
            raise RuleError(f"guard of rule {self.name!r} raised {type(e).__name__}: {e}") from e
        if ok is True or ok is None:
            return None
        if ok is NOT_A_SITE:
            return NOT_A_SITE
        return f"guard: {ok}" if isinstance(ok, str) else "guard rejected the bound values"


@dataclasses.dataclass
class CompiledRule:
    """The traced, canonicalized form of a Rule. The pattern is traced when the rule is first
    tried (its anchor decides which nodes it is tried at); the replacements when one is first
    needed (a match to apply, a call to plan, a key), so a rule that never matches costs one
    trace, not two or three."""

    rule: Rule
    pattern: fx.GraphModule
    params: list[str]
    anchor: fx.Node
    outputs: list[fx.Node]
    op_count: int
    # outputs off the walk from the anchor: one operation on values the walk pairs (vLLM's
    # `residual = sum.to(dtype)` beside the norm that reads the sum)
    side_outputs: list[fx.Node] = dataclasses.field(default_factory=list)

    @property
    def anchor_targets(self) -> set[Any]:
        """Targets a graph node may have to start a match: the anchor's, and where the anchor is
        a cast (which the graph may not need), its input's; each with the graph spellings it
        pairs with (``canonicalize_shape.pairs_with``)."""
        targets = set(pairs_with(self.anchor.target))
        inner = self.anchor.args[0] if self.anchor.target is CAST else None
        if isinstance(inner, fx.Node) and inner.op == "call_function":
            targets |= pairs_with(inner.target)
        return targets

    @functools.cached_property
    def replacement(self) -> fx.GraphModule:
        rule = self.rule
        out = trace(rule.name, "replacement", rule.replacement, rule.scalars)
        _check_outputs(rule.name, "replacement", out, len(self.outputs))
        return out

    @functools.cached_property
    def inplace(self) -> fx.GraphModule | None:
        rule = self.rule
        if rule.inplace is None:
            return None
        out = trace(rule.name, "in-place replacement", rule.inplace.replacement, rule.scalars)
        _check_outputs(rule.name, "in-place replacement", out, len(self.outputs))
        return out

    def traced(self) -> CompiledRule:
        """Every function of the rule traced now (a user rule checked at construction)."""
        _ = self.replacement, self.inplace
        return self

    @classmethod
    def build(cls, rule: Rule) -> CompiledRule:
        params = _params(rule.name, "pattern", rule.pattern)
        unknown = set(rule.scalars) - set(params)
        if unknown:
            raise RuleError(f"rule {rule.name!r}: scalars {sorted(unknown)} are not pattern arguments")
        bad = set(rule.optional) - (set(params) - set(rule.scalars))
        if bad:
            raise RuleError(f"rule {rule.name!r}: optional {sorted(bad)} are not tensor arguments of the pattern")
        if rule.inplace is not None:
            bad = set(rule.inplace.overwrites) - (set(params) - set(rule.scalars))
            if bad:
                raise RuleError(f"rule {rule.name!r}: in-place overwrites {sorted(bad)}, which are not tensor arguments")
        if rule.via == "subgraph_rewriter" and rule.scalars:
            raise RuleError(f"rule {rule.name!r}: torch.fx.subgraph_rewriter rules cannot have scalar wildcards")
        pattern = trace(rule.name, "pattern", rule.pattern, rule.scalars)
        outputs = output_nodes(pattern)
        anchor = outputs[0]
        if not isinstance(anchor, fx.Node) or anchor.op != "call_function":
            raise RuleError(f"rule {rule.name!r}: the pattern's first output must be an operation, got {anchor}")
        ancestors = meta.ancestors(anchor)
        side = [o for o in outputs[1:] if o not in ancestors]
        for o in side:
            if not (isinstance(o, fx.Node) and o.op == "call_function" and o.all_input_nodes
                    and all(a in ancestors for a in o.all_input_nodes)):  # fmt: skip
                raise RuleError(
                    f"rule {rule.name!r}: pattern output {o} is not computed on the way to the first output "
                    f"{anchor}, nor by one operation on values that are"
                )
        for what, fn in (("replacement", rule.replacement), ("in-place replacement", getattr(rule.inplace, "replacement", None))):
            if fn is not None and set(names := _params(rule.name, what, fn)) - set(params):
                raise RuleError(f"rule {rule.name!r}: {what} takes {sorted(set(names) - set(params))}, which the pattern does not bind")
        ops = sum(1 for n in pattern.graph.nodes if n.op == "call_function")
        return cls(rule, pattern, params, anchor, outputs, ops, side)


def trace(rule: str, what: str, fn: Callable[..., Any], scalars: Mapping[str, Any]) -> fx.GraphModule:
    """Trace ``fn`` symbolically and canonicalize it, with errors that name the rule."""
    try:
        with _use_lazy_graph_module(True):  # code made once, if ever needed (a user rule's key, a call)
            gm = fx.symbolic_trace(fn)
    except Exception as e:
        raise RuleError(f"rule {rule!r}: the {what} cannot be traced by torch.fx.symbolic_trace: {e}") from e
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverloadPacket):
            n.target = n.target.default
    meta.mark_kinds(gm.graph, scalars)
    canonicalize(gm)
    with _use_lazy_graph_module(True):
        gm.recompile()
    return gm


def _params(rule: str, what: str, fn: Callable[..., Any]) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:  # builtins such as torch.relu have no signature
        raise RuleError(f"rule {rule!r}: the {what} {fn!r} has no Python signature; wrap it in a def: {e}") from e


def output_nodes(gm: fx.GraphModule) -> list[Any]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    vals = out.args[0]
    return list(vals) if isinstance(vals, (tuple, list)) else [vals]


def _check_outputs(rule: str, what: str, gm: fx.GraphModule, n: int) -> None:
    got = len(output_nodes(gm))
    if got != n:
        raise RuleError(f"rule {rule!r}: the {what} returns {got} value(s), the pattern {n}")

