"""Which library serves a fused op on this device: sgl-kernel, flashinfer, our Triton kernels, or
the torch reference.

Each op module hands :func:`dispatch` its kernels (one :class:`Kernel` per library that can run
the op), in its order of preference, and its plain-torch reference. The order is per op, set by
measurement (``bench/bench_ops.py`` times every provider side by side): mostly ``sgl_kernel``,
then ``flashinfer``; a single Triton kernel first where the libraries need two. At the first
call per (op, device) the candidates are fixed: those of the overriding provider if one is
configured, else all in the op's order, each marked unusable when its library does not import or
the device is too old. Every call then takes the first candidate whose per-call constraints
hold (dtype, alignment, layout, rank); a call no kernel can serve runs the reference and is
counted as a fallback keyed ``(op, reason)``: slower, never wrong.

    providers.configure("rms_norm=flashinfer,silu_and_mul=torch")   # or env FXREWRITE_PROVIDER
    y = torch.ops.fxr.rms_norm(x, w, 1e-6)                           # served by flashinfer
    providers.served()  # {"rms_norm": {"flashinfer": 1, "fallbacks": {}}}

Imports of ``sgl_kernel`` / ``flashinfer`` / ``triton`` (through
``fxrewrite.runtime.triton_kernels``) are lazy and guarded: the first two do not import without a
GPU driver, Triton is optional, and this module never needs any of them on CPU. Counters count
Python-level calls: a CUDA graph replay does not pass through here, its capture does.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import os
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

PROVIDERS: tuple[str, ...] = ("sgl_kernel", "flashinfer", "triton", "torch")
"""All provider names (what an override may name); ``torch`` (the reference) is always last. The
order of preference is each op's own: the order of its kernels."""

ENV_VAR = "FXREWRITE_PROVIDER"
_DEFAULT = "*"  # key of the override that applies to every op not named on its own


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One way a library runs an op.

    provider:        "sgl_kernel", "flashinfer" or "triton": what the override names.
    module:          the module that must import for ``run`` to work (default ``provider``),
                     e.g. "flashinfer.norm", "fxrewrite.runtime.triton_kernels"; ``run`` gets it
                     from :func:`library`.
    run:             takes the op's arguments, returns what the op returns.
    check:           takes the op's arguments; None when ``run`` can serve them, else the reason.
    min_capability:  oldest CUDA compute capability the kernel supports, e.g. (8, 9) for FP8.
    label:           name in :func:`served` (default ``provider``); "sgl_kernel+torch" marks a
                     kernel that does part of the op (e.g. the residual add) in plain torch.
    prepare:         for a JIT-built kernel: takes the op's arguments (fake tensors will do: only
                     shapes, dtypes and devices are read) and returns ``(key, build)``, ``build()``
                     building what ``run`` would build at its first such call, without running
                     it; None when nothing is left to build. Equal keys are one build
                     (:func:`prebuild` runs them in parallel).
    """

    provider: str
    run: Callable[..., Any]
    check: Callable[..., str | None]
    min_capability: tuple[int, int] = (0, 0)
    label: str | None = None
    module: str | None = None
    prepare: Callable[..., tuple[Any, Callable[[], Any]] | None] | None = None

    @property
    def name(self) -> str:
        return self.label or self.provider


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Candidates for one (op, device): each kernel with the reason it is unusable, or None."""

    candidates: tuple[tuple[Kernel, str | None], ...]
    forced_torch: bool  # the override says "torch": the reference serves, not as a fallback


@dataclasses.dataclass
class _Registry:
    """All module state: the override, imported libraries, plans and counters."""

    overrides: dict[str, str] | None = None  # op -> provider, _DEFAULT for all; None: not read yet
    modules: dict[str, types.ModuleType | None] = dataclasses.field(default_factory=dict)
    import_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    plans: dict[tuple[str, str], _Plan] = dataclasses.field(default_factory=dict)
    # counters keyed (scope, op, provider label) and (scope, op, reason); see :func:`counting`
    served: collections.Counter[tuple[str, str, str]] = dataclasses.field(default_factory=collections.Counter)
    fallbacks: collections.Counter[tuple[str, str, str]] = dataclasses.field(default_factory=collections.Counter)
    scope: str = "model"


_REGISTRY = _Registry()
_OPS: dict[str, OpDef] = {}  # every op define_op registered, by name


# --------------------------------------------------------------------------- libraries


def library(name: str) -> types.ModuleType | None:
    """Import ``name`` (e.g. "sgl_kernel", "flashinfer.norm") once; None when it does not import.

    Any exception counts as "not importable" (without a GPU driver both libraries raise
    OSError or RuntimeError, not ImportError); the message is kept for error reports.
    """
    if name not in _REGISTRY.modules:
        try:
            _REGISTRY.modules[name] = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a broken install must not break the package
            _REGISTRY.modules[name] = None
            _REGISTRY.import_errors[name] = f"{type(e).__name__}: {e}"
            log.debug("%s is not importable: %s", name, _REGISTRY.import_errors[name])
    return _REGISTRY.modules[name]


def preload() -> dict[str, bool]:
    """Import every library and module the registered ops' kernels use, now rather than at
    their first call (which may fall inside a CUDA graph capture). Returns module -> imported."""
    from fxrewrite.runtime.ops import DEFS  # late: the op modules import this module

    names = {k.module or k.provider for op in DEFS for k in op.kernels if k.provider != "torch"}
    return {name: library(name) is not None for name in sorted(names | {"sgl_kernel", "flashinfer"})}


def available(provider: str) -> bool:
    """Whether ``provider`` can serve anything here ("torch" always can)."""
    return provider == "torch" or library(provider) is not None


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """CUDA compute capability of ``device``; None for non-CUDA devices."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def enable_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: on for Hopper and newer, as both libraries default."""
    cap = device_capability(device)
    return cap is not None and cap >= (9, 0)


# --------------------------------------------------------------------------- configuration


def configure(spec: str | None = None) -> None:
    """Set the provider override; ``None`` reads env ``FXREWRITE_PROVIDER`` (unset: no override).

    spec: "sgl_kernel" | "flashinfer" | "torch" for every op, or per op
    "rms_norm=flashinfer,silu_and_mul=torch"; both forms mix ("flashinfer,silu_and_mul=torch").
    An op forced to a library that has no kernel for it, or whose constraints a call breaks,
    runs the reference and counts a fallback. Raises ValueError for an unknown provider or op,
    and for a library that is not importable here. Clears the per-device plans.
    """
    if spec is None:
        spec = os.environ.get(ENV_VAR, "")
    overrides = _parse(spec)
    for provider in sorted(set(overrides.values())):
        if not available(provider):
            raise ValueError(
                f"provider {provider!r} requested ({ENV_VAR} or config: {spec!r}), but {provider} "
                f"is not importable: {_REGISTRY.import_errors.get(provider, 'unknown error')}"
            )
    _REGISTRY.overrides = overrides
    _REGISTRY.plans.clear()
    log.debug("provider overrides: %s", overrides)


@contextlib.contextmanager
def overriding(spec: str) -> Iterator[None]:
    """The override ``spec`` (as :func:`configure` takes it) inside, the one before restored
    after: a side-by-side measure of two providers of one op in one process (bench_e2e)."""
    before = None if _REGISTRY.overrides is None else dict(_REGISTRY.overrides)  # None: not read yet
    configure(spec)
    try:
        yield
    finally:
        _REGISTRY.overrides = before
        _REGISTRY.plans.clear()


def _parse(spec: str) -> dict[str, str]:
    from fxrewrite.runtime.ops import OPS  # late: the op modules import this module

    overrides: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        op, _, provider = item.rpartition("=")
        op, provider = op.strip() or _DEFAULT, provider.strip()
        if provider not in PROVIDERS:
            raise ValueError(f"unknown provider {provider!r} in {spec!r}; expected one of {PROVIDERS}")
        if op != _DEFAULT and op not in OPS:
            raise ValueError(f"unknown op {op!r} in {spec!r}; known ops: {', '.join(OPS)}")
        overrides[op] = provider
    return overrides


def _override(op: str) -> str | None:
    if _REGISTRY.overrides is None:
        configure(None)
    assert _REGISTRY.overrides is not None
    return _REGISTRY.overrides.get(op, _REGISTRY.overrides.get(_DEFAULT))


# --------------------------------------------------------------------------- dispatch


def _plan(op: str, kernels: Sequence[Kernel], device: torch.device) -> _Plan:
    key = (op, str(device))
    plan = _REGISTRY.plans.get(key)
    if plan is not None:
        return plan
    forced = _override(op)
    chosen = [k for k in kernels if forced in (None, k.provider)]  # the op's order of preference
    cap = device_capability(device)
    candidates = []
    for k in chosen:
        reason = None
        if library(k.module or k.provider) is None:
            reason = f"{k.module or k.provider} not importable"
        elif cap is not None and cap < k.min_capability:
            reason = f"{k.name} needs sm{k.min_capability[0]}{k.min_capability[1]}+, device is sm{cap[0]}{cap[1]}"
        candidates.append((k, reason))
    plan = _Plan(tuple(candidates), forced_torch=forced == "torch")
    _REGISTRY.plans[key] = plan
    log.debug("fxr::%s on %s: override %s, candidates %s", op, device, forced, plan.candidates)
    return plan


def dispatch(op: str, kernels: Sequence[Kernel], reference: Callable[..., Any], *args: Any) -> Any:
    """Run ``op`` on ``args`` with the first kernel that can serve them, else ``reference``.

    The device is that of the first argument. Used as the CUDA impl of every ``fxr`` op.
    """
    device = args[0].device
    plan = _plan(op, kernels, device)
    scope = _REGISTRY.scope
    if plan.forced_torch:
        _REGISTRY.served[(scope, op, "torch")] += 1
        return reference(*args)
    kernel, reasons = _pick(plan, args)
    if kernel is not None:
        _REGISTRY.served[(scope, op, kernel.name)] += 1
        return kernel.run(*args)
    if not plan.candidates:
        forced = _override(op)
        reasons.append(f"{forced} has no kernel for {op}" if forced else f"no kernel for {op}")
    reason = "; ".join(reasons)
    if _REGISTRY.fallbacks[(scope, op, reason)] == 0:
        log.info("fxr::%s falls back to the torch reference on %s (%s calls): %s", op, device, scope, reason)
    _REGISTRY.fallbacks[(scope, op, reason)] += 1
    _REGISTRY.served[(scope, op, "torch")] += 1
    return reference(*args)


def _pick(plan: _Plan, args: Sequence[Any]) -> tuple[Kernel | None, list[str]]:
    """The first usable candidate whose constraints ``args`` meet, or None and every reason."""
    reasons = []
    for kernel, unusable in plan.candidates:
        reason = unusable if unusable is not None else kernel.check(*args)
        if reason is None:
            return kernel, reasons
        reasons.append(reason if unusable is not None else f"{kernel.name}: {reason}")
    return None, reasons


@dataclasses.dataclass(frozen=True)
class OpDef:
    """One fused op: ``torch.ops.fxr.<name>``.

    reference:     the spec in plain torch; its annotations give the schema; CPU impl.
    fake:          output shapes and dtypes for fake tensors (same signature).
    kernels:       the libraries' ways to run it on CUDA (:class:`Kernel`), the preferred first.
    mutates_args:  names of the arguments an in-place op overwrites.
    collective:    the op communicates with other ranks: two identical calls are two exchanges,
                   never merged into one (:func:`is_pure`).
    """

    name: str
    reference: Callable[..., Any]
    fake: Callable[..., Any]
    kernels: tuple[Kernel, ...] = ()
    mutates_args: tuple[str, ...] = ()
    collective: bool = False

    def cuda(self, *args: Any) -> Any:
        """The CUDA impl: :func:`dispatch` to the kernels, else the reference."""
        return dispatch(self.name, self.kernels, self.reference, *args)


def define_op(op: OpDef) -> Any:
    """Register ``torch.ops.fxr.<op.name>``: body the reference (CPU and every device without a
    kernel), fake impl, CUDA impl :meth:`OpDef.cuda`. Returns the ``CustomOpDef``. Safe to run
    again (re-import, reload): an op defined before keeps its ``torch.ops.fxr`` objects, which
    compiled rules and graphs hold (a new definition would make them stale: a rule compiled
    before a reload would no longer match the nodes a replacement makes after it), and takes
    the new fake and CUDA impls.

    In-place ops (``mutates_args``) return the tensors they overwrite, aliased, as ATen's
    ``add_`` returns ``self``: a graph then reads the results from the op's outputs, so the data
    flow stays explicit across split pieces and CUDA-graph static buffers.
    """
    _OPS[op.name] = op
    if op.mutates_args:
        return _define_inplace(op)
    custom = _CUSTOM.get(op.name)
    if custom is None:
        custom = _CUSTOM[op.name] = torch.library.custom_op(f"fxr::{op.name}", op.reference, mutates_args=op.mutates_args)
    custom.register_fake(op.fake)
    custom.register_kernel("cuda")(op.cuda)
    return custom


_CUSTOM: dict[str, Any] = {}  # op name -> its CustomOpDef, defined once per process


def collectives(defs: Sequence[OpDef]) -> tuple[OpDef, ...]:
    """``defs`` marked as collectives (:attr:`OpDef.collective`)."""
    return tuple(dataclasses.replace(op, collective=True) for op in defs)


def is_pure(name: str) -> bool:
    """``torch.ops.fxr.<name>`` is a function of its inputs alone (defined here, writes nothing in
    place, no collective): two calls on the same inputs may be computed once."""
    op = _OPS.get(name)
    return op is not None and not op.mutates_args and not op.collective


def define_all(defs: Sequence[OpDef]) -> tuple[str, ...]:
    """:func:`define_op` for each of an op module's definitions; their names (the module's ``OPS``)."""
    for op in defs:
        define_op(op)
    return tuple(op.name for op in defs)


_LIB = torch.library.Library("fxr", "FRAGMENT")  # only the in-place ops: custom_op cannot alias


def _define_inplace(op: OpDef) -> Any:
    qualname = f"fxr::{op.name}"
    if hasattr(torch.ops.fxr, op.name):
        return getattr(torch.ops.fxr, op.name)  # already defined by an earlier import
    schema = torch.library.infer_schema(op.reference, mutates_args=op.mutates_args)
    names = [a.split()[-1] for a in schema[schema.index("(") + 1 : schema.index(") ->")].split(", ")]
    index = [names.index(m) for m in op.mutates_args]
    tags = [schema.split(", ")[i].split()[0].removeprefix("(") for i in index]  # Tensor(a0!) ...
    _LIB.define(op.name + schema.rsplit("->", 1)[0] + "-> (" + ", ".join(tags) + ")")

    def overwritten(args: tuple[Any, ...]) -> Any:
        """What the op returns: the tensor it overwrites, or a tuple of them (the schema's form)."""
        return args[index[0]] if len(index) == 1 else tuple(args[i] for i in index)

    def returning(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            fn(*args)
            return overwritten(args)

        return run

    _LIB.impl(op.name, returning(op.reference), "CompositeExplicitAutograd")
    _LIB.impl(op.name, returning(op.cuda), "CUDA")
    torch.library.register_fake(qualname, lambda *args: overwritten(args), lib=_LIB)
    return getattr(torch.ops.fxr, op.name)


TRITON_MODULE = "fxrewrite.runtime.triton_kernels"
"""The ``triton`` provider's library: our Triton kernels, one launcher per op, named as the op."""


def _triton(module: str, op: str, *args: Any) -> Any:
    return getattr(library(module), op)(*args)


def _triton_prepare(module: str, op: str, *args: Any) -> tuple[Any, Callable[[], Any]] | None:
    return library(module).prepare(op, *args)


def triton_kernel(op: str, check: Callable[..., str | None], min_capability: tuple[int, int] = (8, 0),
                  prepare: bool = False, module: str = TRITON_MODULE) -> Kernel:  # fmt: skip
    """The ``triton`` provider's :class:`Kernel` for ``op``: ``<module>.<op>(*args)``
    (``triton_kernels`` unless another module of ours holds it); with ``prepare``, built ahead
    by ``<module>.prepare(op, *args)`` (:func:`prebuild`)."""
    return Kernel("triton", functools.partial(_triton, module, op), check, min_capability, module=module,
                  prepare=functools.partial(_triton_prepare, module, op) if prepare else None)  # fmt: skip


# --------------------------------------------------------------------------- building ahead


MAX_BUILD_THREADS = 8
"""Most kernels :func:`prebuild` builds at once (a Triton build mostly waits on ``ptxas``, a
subprocess, so threads overlap well)."""


def op_def(target: Any) -> OpDef | None:
    """The :class:`OpDef` of ``torch.ops.fxr.<name>`` (the packet or an overload), or None."""
    name = getattr(target, "_qualified_op_name", None)  # an OpOverloadPacket
    if name is None and isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
    if not isinstance(name, str) or not name.startswith("fxr::"):
        return None
    return _OPS.get(name.removeprefix("fxr::"))


def prebuild(calls: Iterable[tuple[Any, Sequence[Any], dict[str, Any]]]) -> str | None:
    """Build now, in parallel, the kernels that calls of ``fxr`` ops will take, and wait for them.

    ``calls``: (target, args, kwargs), tensors as fake tensors of concrete shapes (or real
    ones). Each call takes the kernel :func:`dispatch` would pick for it; kernels with a
    ``prepare`` give a build, equal keys build once, up to ``MAX_BUILD_THREADS`` at a time.
    Returns a line for the report, or None when no call had a kernel to build. A build that fails is
    logged and left to the call itself, which raises the same error where it is handled now
    (verification refuses the site; without verification the call fails).
    """
    builds: dict[Any, tuple[str, Callable[[], Any]]] = {}
    for target, args, kwargs in calls:
        op = op_def(target)
        if op is None:
            continue
        try:
            bound = inspect.signature(op.reference).bind(*args, **kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        device = getattr(bound.args[0], "device", None) if bound.args else None
        if device is None or device.type != "cuda":
            continue  # the reference runs there: nothing to build
        plan = _plan(op.name, op.kernels, device)
        try:
            kernel, _ = _pick(plan, bound.args) if not plan.forced_torch else (None, [])
            planned = kernel.prepare(*bound.args) if kernel is not None and kernel.prepare is not None else None
        except Exception as e:  # noqa: BLE001 - a constraint that reads data a fake tensor lacks
            log.debug("fxr::%s: not built ahead: %s: %s", op.name, type(e).__name__, e)
            continue
        if planned is not None:
            builds.setdefault(planned[0], (f"{op.name} ({kernel.name})", planned[1]))
    if not builds:
        return None
    start = time.perf_counter()
    workers = min(len(builds), MAX_BUILD_THREADS)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="fxr-build") as pool:
        futures = {pool.submit(build): name for name, build in builds.values()}
    seconds = time.perf_counter() - start
    failed = []
    for f, name in futures.items():
        if (e := f.exception()) is not None:
            failed.append(name)
            log.info("building %s ahead failed (its first call will raise it): %s: %s", name, type(e).__name__, e)
    names = ", ".join(f"{n} x{c}" for n, c in collections.Counter(futures.values()).items())
    return (f"{len(builds)} kernels built ahead (or found built) in {seconds:.2f} s, {workers} at a time: {names}"
            + (f"; {len(failed)} failed ({', '.join(failed)})" if failed else ""))


class Prebuild:
    """The runtime's :class:`fxrewrite.rewrite.Prebuild`: before a pass checks or applies its
    matches, builds the kernels their ``fxr`` calls will take (:func:`prebuild`). Triton's JIT
    would build each at its first call, one after another: in verification when it is on, else
    in the first CUDA-graph capture."""

    def wants(self, target: Any) -> bool:
        op = op_def(target)
        return op is not None and any(k.prepare is not None for k in op.kernels)

    def __call__(self, calls: list[tuple[Any, Sequence[Any], dict[str, Any]]]) -> str | None:
        return prebuild(calls)


# --------------------------------------------------------------------------- report


@contextlib.contextmanager
def counting(scope: str) -> Iterator[None]:
    """Count the calls made inside under ``scope`` instead of the model's (``"model"``).

    Compile-time verification runs each matched site's replacement on random inputs; its calls
    are not the model's (an ``apply_rotary`` that a later pass folds away never runs in the
    model), so the backend counts them as ``served("verification")``. Not thread-safe: one
    scope for the whole process at a time.

        with providers.counting("verification"):
            torch.ops.fxr.rms_norm(x, w, 1e-6)
        providers.served("verification")  # {"rms_norm": {"flashinfer": 1, "fallbacks": {}}}
    """
    prior, _REGISTRY.scope = _REGISTRY.scope, scope
    try:
        yield
    finally:
        _REGISTRY.scope = prior


def served(scope: str = "model") -> dict[str, dict[str, Any]]:
    """Per op: calls served per provider label, and ``"fallbacks"``: {reason: calls}, counted
    under ``scope`` (the model's calls by default; see :func:`counting`).

    ``torch`` counts every call the reference served on a kernel-capable device, whether
    forced by the override or as a fallback (then also under ``fallbacks`` with its reason).
    """
    out: dict[str, dict[str, Any]] = {}
    for (where, op, name), n in sorted(_REGISTRY.served.items()):
        if where == scope:
            out.setdefault(op, {"fallbacks": {}})[name] = n
    for (where, op, reason), n in sorted(_REGISTRY.fallbacks.items()):
        if where == scope:
            out.setdefault(op, {"fallbacks": {}})["fallbacks"][reason] = n
    return out


def reset_counts() -> None:
    """Zero the served and fallback counters of every scope (plans and overrides stay)."""
    _REGISTRY.served.clear()
    _REGISTRY.fallbacks.clear()


def format_served(counts: dict[str, dict[str, Any]] | None = None) -> str:
    """:func:`served` as one line per op: ``rms_norm: sgl_kernel 12, torch 2 (fallback: ...)``."""
    lines = []
    for op, entry in (served() if counts is None else counts).items():
        by = ", ".join(f"{name} {n}" for name, n in entry.items() if name != "fallbacks")
        why = "; ".join(f"{n}x {reason}" for reason, n in entry["fallbacks"].items())
        lines.append(f"{op}: {by}" + (f" (fallbacks: {why})" if why else ""))
    return "\n".join(lines)
