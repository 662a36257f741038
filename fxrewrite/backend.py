"""The ``torch.compile`` backend that wires the stages together.

    backend = fxrewrite.Backend()
    model = backend.compile(model)  # torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    model(x)                       # Dynamo captures, our passes rewrite, the graph runs eagerly
    print(backend.report.table())  # what was fused, what nearly was and why
    backend.graphs[0].print_readable()

Inductor is never imported: the rewritten GraphModule runs as Python calling ATen and
``torch.ops.fxr`` ops, or, with ``Config(mode="piecewise" | "full")``, as CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxrewrite import fingerprint, meta, precompile, rewrites
from fxrewrite.cache import CompileCache
from fxrewrite.canonicalize import canonicalize
from fxrewrite.config import Config
from fxrewrite.passes import GraphPass, Pass, PassManager, RuleGroup, Step, prepare_dump_dir
from fxrewrite.report import GraphReport, PassResult, Report
from fxrewrite.rewrite import apply_rules, dead_code, graph_calls
from fxrewrite.rule import Rule
from fxrewrite.runtime import by_size, providers, unguarded
from fxrewrite.runtime.cudagraph import build_runner
from fxrewrite.runtime.dispatch import check_capture_sizes
from fxrewrite.runtime.fold_constants import fold_constants
from fxrewrite.verify import verify_match

log = logging.getLogger(__name__)


def default_rule_groups(mode: str = "none", config: Config | None = None) -> list[tuple[str, list[Rule]]]:
    """The library's rule groups that run in ``mode`` with ``config``'s switches (default: the
    defaults), in order, as ``(name, rules)``: the ``RuleGroup`` entries of
    ``fxrewrite.rewrites.PIPELINE`` (its comments say why this order)."""
    config = config or Config()
    return [(s.name, list(s.rules)) for s in rewrites.PIPELINE if isinstance(s, RuleGroup) and s.runs_in(mode)
            and (s.switch is None or getattr(config, s.switch))]  # fmt: skip


def _canonicalize_pass(gm: fx.GraphModule) -> PassResult:
    return PassResult(matches=canonicalize(gm))


def _cleanup_pass(gm: fx.GraphModule) -> PassResult:
    changed = canonicalize(gm)  # no-ops the rules left behind
    return PassResult(matches=changed + dead_code(gm))


def _rules_pass(rules: Sequence[Rule], config: Config) -> Callable[[fx.GraphModule], PassResult]:
    return functools.partial(_apply, rules=list(rules), near_miss_min=config.near_miss_min, filters=_filters(config))


@functools.cache
def _prebuild() -> providers.Prebuild:
    """The runtime's kernel builds ahead of verification (see ``rewrite.apply_rules``)."""
    return providers.Prebuild()


def _filters(config: Config) -> list[Callable[[Any], str | None]]:
    """Checks every match passes before it is applied: verification, then the user's filter."""
    filters: list[Callable[[Any], str | None]] = []
    if config.verify:
        filters.append(_verify_apart)
    if config.match_filter is not None:
        filters.append(config.match_filter)
    return filters


def _verify_apart(m: Any) -> str | None:
    """``verify_match``, its kernel calls counted apart from the model's (``providers.counting``)."""
    with providers.counting("verification"):
        return verify_match(m)


def _apply(
    gm: fx.GraphModule, rules: list[Rule], near_miss_min: float, filters: list[Callable[[Any], str | None]]
) -> PassResult:
    def verify(m: Any) -> str | None:
        return next((why for f in filters if (why := f(m)) is not None), None)

    return apply_rules(gm, rules, near_miss_min, verify if filters else None, _prebuild() if _on_cuda(gm) else None)


def _on_cuda(gm: fx.GraphModule) -> bool:
    """Whether an input of ``gm`` lives on a CUDA device: only there are kernels built ahead
    (elsewhere the prescan would be a second matching pass for nothing). Read once per graph."""
    if "fxr_on_cuda" not in gm.meta:
        gm.meta["fxr_on_cuda"] = any(isinstance(v := meta.value(n), torch.Tensor) and v.device.type == "cuda"
                                     for n in gm.graph.find_nodes(op="placeholder"))  # fmt: skip
    return gm.meta["fxr_on_cuda"]


def pipeline_steps(config: Config, library: Sequence[Step] | None = None) -> list[Step]:
    """The library's steps that run for ``config``, in order (default
    ``fxrewrite.rewrites.PIPELINE``: merge_siblings, fuse_moe, the rule groups of ``config.mode``,
    fold_rotary). ``config.rules`` takes the place of the library's rule groups and fusion passes
    (``[]``: none of the library's steps run); ``config.extra_rules`` run after the last rule
    group."""
    steps: list[Step] = []
    user_at = 0  # where the user's rules go: after the last rule group
    if config.rules is None or config.rules:
        replaced = False
        for step in rewrites.PIPELINE if library is None else library:
            switched_on = step.switch is None or getattr(config, step.switch)
            if isinstance(step, GraphPass):
                if switched_on and not (step.fusion and config.rules is not None):
                    steps.append(step)
                continue
            if config.rules is None and step.runs_in(config.mode):
                if not switched_on:
                    continue
                steps.append(step)
            elif config.rules is not None and not replaced:
                steps.append(RuleGroup("rules", tuple(config.rules)))
                replaced = True
            user_at = len(steps)
    if config.extra_rules:
        steps.insert(user_at, RuleGroup("user_rules", tuple(config.extra_rules)))
    return steps


def pipeline(config: Config, library: Sequence[Step] | None = None) -> list[Pass]:
    """The ordered passes for ``config``: canonicalize, :func:`pipeline_steps`, fold_constants
    (tensors built from Python values evaluated once: after the rules, so they match the graph as
    written; in every mode, see :mod:`fxrewrite.runtime.fold_constants`), cleanup."""
    steps = pipeline_steps(config, library)
    passes = [Pass("canonicalize", _canonicalize_pass)]
    for step in steps:
        if isinstance(step, GraphPass):
            passes.append(step.bind(config))
        elif step.rules:
            passes.append(Pass(step.name, _rules_pass(step.rules, config)))
    passes.append(Pass("fold_constants", fold_constants))
    passes.append(Pass("cleanup", _cleanup_pass))
    return passes


def _lifted(node: fx.Node) -> bool:
    """A placeholder for a Python scalar (a module's float attribute, a global) that Dynamo
    passes to the graph as a tensor: its value at compile time is the model's."""
    return bool(getattr(node.meta.get("grapharg"), "pass_arg_as_tensor", False))


class _SpecializeFloats:
    """Dynamo's ``specialize_float`` on for a compile or call (10 us a call cheaper than
    ``torch._dynamo.config.patch``). Dynamo's config is process-wide: a compile in another
    thread while one of our frames runs sees it too."""

    __slots__ = ("prior",)

    def __enter__(self) -> None:
        self.prior = torch._dynamo.config.specialize_float
        torch._dynamo.config.specialize_float = True

    def __exit__(self, *exc: object) -> None:
        torch._dynamo.config.specialize_float = self.prior


class Backend:
    """A ``torch.compile`` backend: ``torch.compile(model, backend=Backend(config))``.

    ``rules`` replaces the default rule library (``[]`` for none); ``extra_rules`` adds user
    rules after the defaults; keyword arguments override ``Config`` fields.

    Attributes: ``graphs`` (the rewritten GraphModules, one per Dynamo graph), ``report``
    (a :class:`Report`), ``config`` (resolved against the environment).
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        rules: Sequence[Rule] | None = None,
        extra_rules: Sequence[Rule] = (),
        **overrides: Any,
    ) -> None:
        config = config or Config()
        if rules is not None:
            overrides["rules"] = tuple(rules)
        if extra_rules:
            overrides["extra_rules"] = tuple(config.extra_rules) + tuple(extra_rules)
        self.config = dataclasses.replace(config, **overrides).resolved()
        if self.config.provider is not None:
            providers.configure(self.config.provider)  # raises if it names a missing library
        if self.config.dump_dir:
            prepare_dump_dir(self.config.dump_dir)
        if self.config.mode != "none":
            check_capture_sizes(self.config)  # empty, unsorted, above the max: refused now
        self._cache = self._open_cache()
        self._check_rules()
        if self.config.specialize_floats:
            # Dynamo enters ``backend_ctx_ctor()`` around every compile and call of the frame
            # (it copies this instance attribute onto its wrapper of the backend)
            self.backend_ctx_ctor = _SpecializeFloats
        self._warned_floats = False
        self._precompiling: type[precompile.FusedGraph] | None = None  # aot_compile: __call__ returns one
        self.graphs: list[fx.GraphModule] = []
        self.runners: list[Any] = []
        self.report = Report()

    def _open_cache(self) -> CompileCache | None:
        """The compile cache of ``config.cache_dir`` when ``config.cache`` is on; off, with a
        warning, when its directory cannot be written."""
        if not self.config.cache:
            return None
        cache = CompileCache(self.config.cache_dir)
        try:
            cache.prepare()
        except OSError as e:
            log.warning("fxrewrite compile cache off: cannot write %s: %s", self.config.cache_dir, e.strerror or e)
            return None
        return cache

    def _check_rules(self) -> None:
        """Trace every user rule now, so a broken one fails at construction with its name. Library
        rules (``fingerprint.library_rule``: tested, traced in CI) are traced at their first match
        (``Rule.compiled``), so a start pays only for those its graphs can use (about 0.3 s
        less); one that cannot trace there is a pass failure in the report (strict: raised)."""
        for p in pipeline(self.config):
            for r in getattr(p.fn, "keywords", {}).get("rules", []):
                if not isinstance(r, Rule):
                    raise TypeError(f"rules must be fxrewrite.Rule objects, got {r!r} in pass {p.name!r}")
                if not fingerprint.library_rule(r):
                    r.compiled.traced()

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self._check_floats(gm)
        for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs):
            if isinstance(value, torch.nn.Parameter):
                node.meta["fxr_param"] = value  # real weights, for passes that re-lay them
            elif isinstance(value, torch.Tensor) and getattr(value, "_dynamo_static_input_type", None):
                node.meta["fxr_buffer"] = value  # module state (a buffer): tables may fold from it
            elif _lifted(node):  # a Python scalar, not a one-element input such as one token's positions
                node.meta["fxr_real"] = value.detach().clone()  # its compile-time value (see meta.constant)
        config, large_config = by_size.plan(gm, example_inputs, self.config)
        # an artifact holds one graph, rewritten (and keyed) for the configuration it is saved with
        one_rewrite = self._precompiling is not None and (config is not self.config or large_config is not None)
        if self._precompiling is not None:
            config, large_config = self.config, None
        large = by_size.copy_graph(gm) if large_config is not None else None  # before the passes rewrite gm
        cached = self._cache.graph(gm, example_inputs, config) if self._cache is not None else None
        identity = None  # aot_compile: the graph's part of the key, for the artifact's header
        if self._precompiling is not None:
            identity = precompile.Identity.of(gm, example_inputs, cached.graph_digest if cached is not None else None)
        graph_report, hit = self._rewrite(gm, cached, config, len(self.graphs))
        if one_rewrite:
            graph_report.notes.append("aot_compile keeps one rewrite of each graph, as configured: gemm_fusion serves "
                                      "every token count (gemm_fusion_max_tokens is not applied)")
        self.graphs.append(gm)
        self.report.graphs.append(graph_report)
        if large is not None and large_config is not None:
            runner = self._by_size(gm, config, large, large_config, example_inputs, graph_report, hit)
        else:
            runner = build_runtime(self, gm, example_inputs, graph_report, prebuild=hit, config=config)
        if self._cache is not None:
            self.report.cache = dataclasses.asdict(self._cache.stats)
        if identity is not None and self._precompiling is not None:  # aot_compile: a graph torch can serialize
            return self._precompiling.cold(gm, example_inputs, runner, graph_report, identity, self.config)
        return runner

    def _rewrite(self, gm: fx.GraphModule, cached: Any, config: Config, graph_id: int | str) -> tuple[GraphReport, bool]:
        """Rewrite ``gm`` in place for ``config``: from the compile cache's entry ``cached`` where
        it holds one (and no dumps are asked for), else by the passes (then stored there). Returns
        the graph's report and whether the cache served it."""
        graph_report = cached.load() if cached is not None and not config.dump_dir else None
        if graph_report is not None:
            return graph_report, True
        pm = PassManager(pipeline(config), config.dump_dir, graph_id=graph_id, lint=config.lint, strict=bool(config.strict))
        graph_report = pm.run(gm)
        if cached is not None:
            cached.store(graph_report)
        return graph_report, False

    def _by_size(self, gm: fx.GraphModule, config: Config, large: fx.GraphModule, large_config: Config,
                 example_inputs: list[Any], report: GraphReport, hit: bool) -> Callable[..., Any]:  # fmt: skip
        """The runner of a graph whose token counts two rewrites serve (:func:`by_size.plan`):
        ``gm``, rewritten for ``config``, the small counts; ``large`` (the graph as captured,
        copied before the passes) rewritten now for ``large_config`` (no ``gemm_fusion``), the
        others; its pass report listed under ``report.variants``."""
        cached = self._cache.graph(large, example_inputs, large_config) if self._cache is not None else None
        variant, large_hit = self._rewrite(large, cached, large_config, f"{len(self.graphs) - 1}.large")
        bound = max(config.capture_sizes or ())
        report.serves, variant.serves = f"1-{bound} tokens", f"{bound + 1}+ tokens, gemm_fusion off"
        report.variants.append(variant)
        for g, was_hit in ((gm, hit), (large, large_hit)):
            if was_hit:
                _build_ahead(g, report)
        runner = by_size.BySize(build_runner(gm, example_inputs, config), build_runner(large, example_inputs, large_config),
                                bound)  # fmt: skip
        report.runtime = runner.stats()
        self.runners.append(runner)
        return runner

    def compile(self, model: Any, *, dynamic: bool | None = True) -> Any:
        """``torch.compile(model, backend=self, fullgraph=True, dynamic=dynamic)``, with Python
        floats made graph constants (``Config.specialize_floats``).

        ``torch.compile`` wraps a backend in an object of its own, which drops the backend's
        ``backend_ctx_ctor``; ``torch._dynamo.optimize``, which ``torch.compile`` calls, keeps it.
        """
        return torch._dynamo.optimize(self, nopython=True, dynamic=dynamic)(model)

    def aot_compile(self, model: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, *,
                    dynamic: bool | None = True, recompile: bool = True) -> precompile.Precompiled:  # fmt: skip
        """``model`` precompiled: traced by Dynamo now with ``model(*args, **kwargs)``, rewritten,
        and returned as a callable (``model`` bound) whose ``save(path)`` writes an artifact that
        :func:`fxrewrite.load` runs in a new process without Dynamo's tracing or our passes (see
        :mod:`fxrewrite.precompile`). One graph (``fullgraph``); trace under the grad mode you
        will call with (it is guarded). torch >= 2.10.

            step = backend.aot_compile(model, (input_ids,))
            step.save("model.fxr")
            step = fxrewrite.load("model.fxr", model, backend)    # another process
        """
        return precompile.aot_compile(self, model, args, kwargs, dynamic=dynamic, recompile=recompile)

    def unguarded(self, model: Any, /, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        """``model``'s compiled step without Dynamo's frame evaluation and guards, for a serving
        engine's hot loop: the graph this backend compiled for a call like ``model(*args,
        **kwargs)`` (call the compiled model with such arguments first), as a function of the
        same arguments. It saves about half of Dynamo's per-call host time (0.39 to 0.20 ms
        on the 8B bench model) and trusts the caller to keep the module, dtypes and Python
        values as they were compiled; under CUDA graphs the runner still checks shapes. See
        :mod:`fxrewrite.runtime.unguarded`.

            step = backend.compile(model)
            step(**decode_batch)                                 # compile (and capture)
            fast = backend.unguarded(step, **decode_batch)       # the decode graph, direct
            fast(**next_batch)
        """
        return unguarded.unguarded(model, self.runners, args, kwargs)

    def _check_floats(self, gm: fx.GraphModule) -> None:
        """Warn (once) when Dynamo lifted Python floats to tensors although ``specialize_floats``
        asks for constants: ``torch.compile`` does not pass ``backend_ctx_ctor`` on."""
        if not self.config.specialize_floats or self._warned_floats:
            return
        lifted = [n.name for n in gm.graph.find_nodes(op="placeholder") if _lifted(n)]
        if lifted:
            self._warned_floats = True
            log.warning(
                "Dynamo lifted %d Python floats to graph inputs (%s): every call builds a tensor for "
                "each, and a CUDA-graph runner checks each on the host. Compile with "
                "backend.compile(model) (or fxrewrite.compile(model, ...)), or set "
                "torch._dynamo.config.specialize_float = True before torch.compile, to make them constants.", len(lifted), ", ".join(lifted[:3]) + (
                    ", ..." if len(lifted) > 3 else ""))

    def refresh_runtime(self) -> None:
        """Copy the runners' latest statistics (replays, copies, eager calls) into the report."""
        for g, r in zip(self.report.graphs, self.runners):
            stats = getattr(r, "stats", None)
            if callable(stats):
                g.runtime = stats()
        self.report.providers = providers.served()
        self.report.verification_providers = providers.served("verification")


def build_runtime(backend: Backend, gm: fx.GraphModule, example_inputs: list[Any], report: Any, *,
                  prebuild: bool, config: Config | None = None) -> Callable[..., Any]:  # fmt: skip
    """What runs a rewritten graph ``gm`` for ``backend``: the graph itself (mode ``"none"``) or
    its CUDA graph runner, listed in ``backend.runners``. ``prebuild``: no pass ran in this
    process (a cache hit, a precompiled graph), so the kernels of its fused ops are built now
    (on CUDA), as verification would have."""
    if prebuild:
        _build_ahead(gm, report)
    runner: Any = gm
    if backend.config.mode != "none":
        runner = build_runner(gm, example_inputs, config or backend.config)
        report.runtime = runner.stats()
    backend.runners.append(runner)
    return runner


def _build_ahead(gm: fx.GraphModule, report: GraphReport) -> None:
    """The kernels of ``gm``'s fused ops built now (on CUDA), as verification would have."""
    if _on_cuda(gm) and (note := _prebuild()(graph_calls(gm, _prebuild().wants))):
        report.notes.append(note)


def compile(model: Any, config: Config | None = None, *, dynamic: bool = True, **kw: Any) -> tuple[Any, Backend]:
    """``Backend(config, **kw).compile(model, dynamic=dynamic)``: the compiled callable and the
    backend (for its report and graphs)."""
    backend = Backend(config, **kw)
    return backend.compile(model, dynamic=dynamic), backend
