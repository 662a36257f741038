"""Bisection: which rule, then which site, moves a model's output away from eager.

    result = fxrewrite.bisect.bisect(model, inputs, extra_rules=MY_RULES, tol=1e-4)
    result.rules    # ['my_norm']                    the smallest set of rules that drifts
    result.site     # ('my_norm', 0, 'modeling_llama.py:66')   its first bad site
    result.error    # 0.31                            output error with only that site rewritten
    print(result.summary())

Also ``python -m fxrewrite bisect --model llama --rules mypkg.rules:RULES --tol 1e-4``.

How: Dynamo captures the model once; every trial copies the captured graphs and runs the normal
pipeline (:func:`fxrewrite.backend.pipeline`, through :class:`fxrewrite.Backend`) with a
``Config.match_filter`` that refuses every match except those the trial allows; the compiled
model then runs with the rewritten graphs swapped in (no recompilation) and its output is
compared with eager (max abs error over all output tensors). Fusion passes of the pipeline
(``GraphPass(..., fusion=True)``, such as ``fuse_moe``) are units beside the rules, named by the
pass: they ask the same filter for each site (:class:`fxrewrite.passes.FusionMatch`), so "rule"
below means a rule or a fusion pass. The search:

1. every rule, and no rule at all: if everything stays within ``tol`` there is nothing to find;
   if the output drifts with no rule applied, canonicalization or sibling merging did it (said
   in ``result.note``), not a rule; rules that matched nowhere with every rule on are dropped;
2. each rule alone, in pipeline order: the first that drifts on its own is the answer;
3. otherwise (the drift needs several rules together) rules are dropped one by one while the
   rest still drifts, leaving a set from which no rule can be removed;
4. the last rule of that set (the others fully on) is bisected over its sites in match order:
   the smallest prefix of sites that drifts; its last site is the one reported, with the error
   it causes on its own.

Sites are numbered per rule in the order the matcher checks them (graph order, Dynamo graphs in
capture order): site 0 is the first place the rule matched. Bisection runs with
``verify=False`` and ``mode="none"`` (rewritten graphs run eagerly): it looks for what verify
would refuse, and CUDA graph replay does not change numerics.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxrewrite import meta
from fxrewrite.backend import Backend, pipeline_steps
from fxrewrite.config import Config
from fxrewrite.passes import FusionMatch, GraphPass, RuleGroup
from fxrewrite.rule import Rule

log = logging.getLogger(__name__)


class BisectError(RuntimeError):
    """Bisection cannot run (the model does not compile, its output is not comparable)."""


Unit = Rule | GraphPass  # what bisection switches on and off: a rule or a fusion pass


class BadSite(NamedTuple):
    """A rule's (or fusion pass's) ``index``-th site (0-based, in match order) and its model
    source line."""

    rule: str
    index: int
    source: str


@dataclasses.dataclass
class BisectResult:
    """What bisection found. ``rules`` empty and ``site`` None: no rule moves the output past
    ``tol`` (``note`` says when the drift comes from elsewhere).

    rules:           names of the smallest set of rules whose rewrites drift (pipeline order;
                     a fusion pass by its name, ``fuse_moe``).
    site:            the first site of the last of those rules that tips the output over ``tol``.
    error:           output error with only ``site`` of its rule (and the other rules of the
                     set) rewritten; the error of the whole set when no single site is found.
    module:          the module the site's code belongs to (``layers.0.input_layernorm``).
    rules_error:     output error with exactly ``rules`` on.
    full_error:      output error with every rule on.
    baseline_error:  output error with no rule on (canonicalization and merging only).
    alone:           output error of each rule on its own, by name (those that were tried).
    sites:           how many sites the culprit rule has.
    trials:          compilations of the captured graphs that the search ran.
    """

    rules: list[str]
    site: BadSite | None
    error: float
    tol: float
    module: str = ""
    rules_error: float = 0.0
    full_error: float = 0.0
    baseline_error: float = 0.0
    alone: dict[str, float] = dataclasses.field(default_factory=dict)
    sites: int = 0
    trials: int = 0
    note: str = ""

    @property
    def found(self) -> bool:
        return bool(self.rules)

    def summary(self) -> str:
        """A few lines for people."""
        lines = [
            f"every rule: max abs error {self.full_error:.3g} vs eager (tol {self.tol:g}); "
            f"no rule: {self.baseline_error:.3g}; {self.trials} trials"
        ]
        if self.note:
            lines.append(self.note)
        if not self.rules:
            if not self.note:
                lines.append("no rule moves the output past the tolerance")
            return "\n".join(lines)
        lines.append(f"smallest set of rules past the tolerance: {', '.join(self.rules)} (error {self.rules_error:.3g})")
        if self.site is not None:
            where = f"{self.site.source} {self.module}".strip()
            lines.append(
                f"first bad site: rule {self.site.rule} site {self.site.index} of {self.sites} "
                f"({where}): error {self.error:.3g}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["site"] = self.site._asdict() if self.site is not None else None
        return d


# --------------------------------------------------------------------------- trials


class _Allow:
    """A match filter for one trial: only ``enabled`` units; for units in ``limit``, only the
    listed site indices. Records every site it sees, numbered per unit."""

    def __init__(self, enabled: set[Unit], limit: dict[Unit, set[int]] | None = None) -> None:
        self.enabled = enabled
        self.limit = limit or {}
        self.count: collections.Counter[Unit] = collections.Counter()
        self.seen: dict[tuple[Unit, int], tuple[str, str]] = {}

    def __call__(self, m: Any) -> str | None:
        rule = m.rule
        if rule not in self.enabled:
            return "bisect: rule turned off"
        k = self.count[rule]
        self.count[rule] += 1
        # a fusion site (passes.FusionMatch) spans a block: name the module around all of it
        module = meta.common_module(m.nodes) if isinstance(m, FusionMatch) else meta.module_path(m.anchor)
        self.seen[(rule, k)] = (meta.source_line(m.anchor), module)
        if rule in self.limit and k not in self.limit[rule]:
            return f"bisect: site {k} turned off"
        return None


class _Slot:
    """What Dynamo calls: the current trial's rewritten graph."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose graph can be rewritten without touching ``gm`` (node meta copied shallowly)."""
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


def output_error(actual: Any, expected: Any) -> float:
    """Max abs difference over all tensors of two outputs (inf when their structure, a shape,
    or a NaN position differs)."""
    a_leaves, a_spec = pytree.tree_flatten(_plain(actual))
    e_leaves, e_spec = pytree.tree_flatten(_plain(expected))
    if len(a_leaves) != len(e_leaves):
        return math.inf
    err = 0.0
    for a, e in zip(a_leaves, e_leaves):
        if not isinstance(e, torch.Tensor):
            if a != e:
                return math.inf
            continue
        if not isinstance(a, torch.Tensor) or a.shape != e.shape:
            return math.inf
        if e.numel() == 0:
            continue
        a64, e64 = a.detach().double().cpu(), e.detach().double().cpu()
        nan_a, nan_e = torch.isnan(a64), torch.isnan(e64)
        if not torch.equal(nan_a, nan_e):
            return math.inf
        diff = (a64 - e64).abs().masked_fill(nan_a | (a64 == e64), 0.0)
        err = max(err, float(diff.max()))
    return err


def _plain(out: Any) -> Any:
    """transformers ModelOutput -> a tuple of its values, so pytree can flatten it."""
    if hasattr(out, "to_tuple") and callable(out.to_tuple):
        return out.to_tuple()
    return out


class _Session:
    """One Dynamo capture of ``model``; ``run(allow)`` compiles every captured graph with the
    pipeline under that filter and returns the output error against eager."""

    def __init__(
        self, model: Any, inputs: Sequence[Any], config: Config, dynamic: bool, fullgraph: bool
    ) -> None:
        self.inputs = tuple(inputs)
        self.config = config
        self.captured: list[tuple[fx.GraphModule, list[Any]]] = []
        self.slots: list[_Slot] = []
        self.allow: _Allow | None = None
        self.trials = 0
        with torch.no_grad():
            self.expected = model(*self.inputs)
        self.compiled = torch.compile(model, backend=self._capture, fullgraph=fullgraph, dynamic=dynamic)

    def _capture(self, gm: fx.GraphModule, example_inputs: list[Any]) -> _Slot:
        self.captured.append((_copy(gm), list(example_inputs)))
        slot = _Slot(self._build(len(self.captured) - 1))
        self.slots.append(slot)
        return slot

    def _build(self, i: int) -> Callable[..., Any]:
        gm, example_inputs = self.captured[i]
        cfg = dataclasses.replace(self.config, match_filter=self.allow)
        return Backend(cfg)(_copy(gm), example_inputs)

    def run(self, allow: _Allow) -> float:
        self.allow = allow
        self.trials += 1
        for i, slot in enumerate(self.slots):
            slot.fn = self._build(i)
        try:
            with torch.no_grad():
                out = self.compiled(*self.inputs)
        except Exception as e:
            if not self.slots:
                raise BisectError(f"the model does not compile with torch.compile: {type(e).__name__}: {e}") from e
            raise
        err = output_error(out, self.expected)
        log.debug("trial %d: %s -> %.3g", self.trials, sorted(r.name for r in allow.enabled), err)
        return err


# --------------------------------------------------------------------------- the search


def pipeline_units(config: Config) -> list[Unit]:
    """Every rule and fusion pass the pipeline of ``config`` applies, in order."""
    units: list[Unit] = []
    for step in pipeline_steps(config):
        if isinstance(step, RuleGroup):
            units += step.rules
        elif step.fusion:
            units.append(step)
    return units


def bisect(
    model: Any,
    inputs: Sequence[Any],
    rules: Sequence[Rule] | None = None,
    extra_rules: Sequence[Rule] = (),
    tol: float = 1e-4,
    *,
    config: Config | None = None,
    dynamic: bool = True,
    fullgraph: bool = True,
) -> BisectResult:
    """Find the smallest set of rules (and fusion passes), then the single site, whose rewrite
    moves the output of ``model(*inputs)`` more than ``tol`` (max abs error) away from eager.
    ``rules`` replaces the default library (its fusion passes too), ``extra_rules`` come after
    it, as for :class:`fxrewrite.Backend`."""
    cfg = config or Config()
    over: dict[str, Any] = {"verify": False, "mode": "none", "dump_dir": "", "progress": False}
    if rules is not None:
        over["rules"] = tuple(rules)
    if extra_rules:
        over["extra_rules"] = tuple(cfg.extra_rules) + tuple(extra_rules)
    cfg = dataclasses.replace(cfg, **over)
    universe = pipeline_units(cfg)
    names = _unique_names(universe)
    if len(set(universe)) != len(universe):
        raise BisectError("a rule or pass object appears twice in the pipeline; bisection needs each once")
    s = _Session(model, inputs, cfg, dynamic, fullgraph)

    everything = _Allow(set(universe))
    full = s.run(everything)
    base = s.run(_Allow(set()))
    result = BisectResult([], None, full, tol, full_error=full, baseline_error=base)
    if base > tol:
        result.note = (
            f"with no rule applied the output already differs from eager by {base:.3g} > tol {tol:g}: "
            "canonicalization, sibling merging or the capture itself, not a rule"
        )
    if full <= tol or base > tol:
        result.trials = s.trials
        return result

    # rules that never matched with every rule on did nothing to the drift being explained
    universe = [r for r in universe if everything.count[r]]
    culprits: list[Unit] | None = None
    for r in universe:
        e = s.run(_Allow({r}))
        result.alone[names[r]] = e
        if e > tol:
            culprits = [r]
            result.rules_error = e
            break
    if culprits is None:
        culprits = list(universe)
        for r in list(culprits):
            rest = [c for c in culprits if c is not r]
            if s.run(_Allow(set(rest))) > tol:
                culprits = rest
        result.rules_error = s.run(_Allow(set(culprits)))
    result.rules = [names[r] for r in culprits]

    _bisect_sites(s, culprits, tol, result, names)
    result.trials = s.trials
    return result


def _bisect_sites(s: _Session, culprits: list[Unit], tol: float, result: BisectResult, names: dict[Unit, str]) -> None:
    """Smallest prefix of the last culprit's sites that drifts (the other culprits fully on)."""
    rule, enabled = culprits[-1], set(culprits)
    probe = _Allow(enabled)
    s.run(probe)
    n = probe.count[rule]
    result.sites = n
    result.error = result.rules_error

    def prefix(k: int) -> tuple[float, _Allow]:
        allow = _Allow(enabled, {rule: set(range(k))})
        return s.run(allow), allow

    lo, hi = 0, n  # invariant (assumed at the ends): prefix(lo) <= tol < prefix(hi)
    if n == 0 or prefix(0)[0] > tol:
        result.note = result.note or f"the drift needs no single site of {names[rule]}"
        return
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prefix(mid)[0] > tol:
            hi = mid
        else:
            lo = mid
    k = hi - 1
    alone = _Allow(enabled, {rule: {k}})
    result.error = s.run(alone)
    source, module = alone.seen.get((rule, k), ("", ""))
    result.site = BadSite(names[rule], k, source)
    result.module = module
    if result.error <= tol:
        result.note = (
            f"site {k} of {names[rule]} tips the output over the tolerance only together with "
            f"the sites before it (alone: {result.error:.3g})"
        )


def _unique_names(rules: Sequence[Unit]) -> dict[Unit, str]:
    """Unit -> name, with ``#2``, ``#3`` ... appended where two share a name."""
    seen: collections.Counter[str] = collections.Counter()
    out: dict[Unit, str] = {}
    for r in rules:
        seen[r.name] += 1
        out[r] = r.name if seen[r.name] == 1 else f"{r.name}#{seen[r.name]}"
    return out


# --------------------------------------------------------------------------- loading


def load_object(spec: str, what: str = "object") -> Any:
    """``pkg.module:name`` -> the object; BisectError with the reason otherwise."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise BisectError(f"{what} {spec!r}: expected 'pkg.module:name'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise BisectError(f"{what} {spec!r}: cannot import {mod_name!r}: {e}") from e
    try:
        obj = mod
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as e:
        raise BisectError(f"{what} {spec!r}: {mod_name} has no {attr!r}") from e
    return obj


def load_rules(spec: str) -> list[Rule]:
    """``pkg.module:RULES`` -> a list of rules (a single Rule is accepted too)."""
    obj = load_object(spec, "rules")
    rules = [obj] if isinstance(obj, Rule) else list(obj) if isinstance(obj, (list, tuple)) else None
    if rules is None or not all(isinstance(r, Rule) for r in rules):
        raise BisectError(f"rules {spec!r}: expected a Rule or a list of Rules, got {type(obj).__name__}")
    return rules


def load_model(spec: str, **build: Any) -> tuple[Any, tuple[Any, ...]]:
    """A built-in family name (``fxrewrite.models.MODELS``, built with ``build``) or
    ``pkg.module:factory`` whose call returns ``(model, inputs)``."""
    from fxrewrite import models

    if ":" not in spec:
        if spec not in models.MODELS:
            raise BisectError(f"model {spec!r}: not a built-in ({', '.join(models.MODELS)}) nor 'pkg.module:factory'")
        tokens = build.pop("tokens", 8)
        model = models.build(spec, **build)
        return model, models.example_inputs(model, tokens=tokens)
    factory = load_object(spec, "model factory")
    if not callable(factory):
        raise BisectError(f"model factory {spec!r} must return (model, inputs); it is a {type(factory).__name__}")
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise BisectError(f"model factory {spec!r} must return (model, inputs), got {type(made).__name__}")
    model, inputs = made
    return model, tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
