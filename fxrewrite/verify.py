"""Verification: run every distinct matched site and its replacement on random inputs, compare.

With ``Config(verify=True)`` (or ``FXREWRITE_VERIFY=1``) the backend calls :func:`verify_match`
with each checked match before applying it. The match's internal nodes are copied into a
standalone graph whose placeholders are the bound inputs; that graph and the rule's replacement
(the in-place one, on clones, where the matcher would apply it) run on the same fresh random
inputs, and their outputs are compared with the tolerance of their dtype
(:data:`fxrewrite.tolerances.TOLERANCES`). A mismatch refuses the rewrite: the original nodes stay,
and the report lists the site under ``rejected`` with the reason::

    # matched in the model graph                     # standalone graph that verify runs
    %add_7   = aten.add.Tensor(%variance_1, %item_4)     def forward(x, weight, eps):
    %rsqrt_1 = aten.rsqrt.default(%add_7)                    pow_1 = aten.pow(x, 2) ...
    ...                                                  -> compared with fxr.rms_norm(x, weight, eps)

    REJECTED bad_rms_norm at hidden_states_3 (modeling_llama.py:66): verify: max abs error
    2.1 > tol 1e-05 (fp32) in output 0 on x=fp32[1, 8, 64], weight=fp32[64], eps=1e-06 (symbolic)

Inputs: symbolic sizes take their hints (the sizes of the example inputs Dynamo traced with);
floating tensors are ``randn`` with each row scaled by 10**u, u uniform in [-3, 1], so that
terms that only matter for small rows (an RMSNorm's eps) are exercised; integer tensors are
drawn from [0, 8); a symbolic float (eps read with ``.item()``) takes its hint, or 1e-6 without
one. Each tensor is drawn on its own device, from a generator per device seeded from the site
signature, so a verdict is a pure function of it (and of the device type).

In bf16 and fp16 the code a rule replaces rounds after every operation; where its terms cancel
(a rotation, a difference of products) it is itself off by more than the dtype tolerance of the
small result. An output that fails the tolerance is then judged against the subgraph run in
float64: it passes when it is at most ``ACCURACY_SLACK`` (2) times as far from that as the
replaced code, plus one unit of the dtype at the output's scale. An FP8 GEMM (``_scaled_mm``, which
takes no float64 operands) is its exact product there: a decode kernel summing in another order
than cuBLASLt is judged so where a cancelling row leaves a small output. A replacement that computes
something else stays far from both and is refused.

A site that cannot be checked (unknown metadata, an input the generator cannot make, an
original subgraph that raises on random inputs) is refused too, with the reason: under
``verify=True`` only checked rewrites are applied.

Cost: one check per distinct *signature* (rule, the bound inputs' shapes / dtypes / devices,
bound scalar values, the matched targets, in-place or not). A 32-layer model repeats a handful of
signatures, so the check runs a few times per model, not per layer (measured in
``bench/VERIFY_COST.md``).

Cache: :class:`Verifier` keeps verdicts per signature. :func:`verify_match`, which the backend
calls, uses one module-level :class:`Verifier` (an LRU of at most ``MAX_ENTRIES`` verdicts) so that
recompilations (new shapes, several Dynamo graphs, several Backends in one process) skip sites
already checked. Sharing it between Backends never changes a verdict, only saves time: the key
holds the rule object itself (two rules of one name never share), the device and the provider
override (``FXREWRITE_PROVIDER``), and the inputs are seeded from the key. ``clear_cache()``
empties it; ``stats()`` says how much it did.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from fxrewrite import meta
from fxrewrite.match import Match, inplace_blocker
from fxrewrite.tolerances import compare, dtype_name

log = logging.getLogger(__name__)

MAX_ENTRIES = 4096
SYMBOLIC_EPS = 1e-6  # value given to a symbolic float scalar that has no hint
ROW_SCALE_LOG10 = (-3.0, 1.0)  # rows of float inputs are scaled by 10**u, u in this range


class _CannotVerify(Exception):
    """The site cannot be checked; the message says why."""


@dataclasses.dataclass
class VerifyStats:
    """What a Verifier did: checks run, verdicts reused, rewrites refused, seconds spent."""

    checked: int = 0
    cached: int = 0
    refused: int = 0
    seconds: float = 0.0


class Verifier:
    """``Verifier()(match) -> None | reason``: checks each distinct site signature once.

    Use one per compilation to keep verdicts private; :func:`verify_match` uses a shared one.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._verdicts: collections.OrderedDict[tuple[Any, ...], str | None] = collections.OrderedDict()
        self.stats = VerifyStats()

    def __call__(self, m: Match) -> str | None:
        t0 = time.perf_counter()
        try:
            return self._verdict(m)
        finally:
            self.stats.seconds += time.perf_counter() - t0

    def _verdict(self, m: Match) -> str | None:
        try:
            key = signature(m)
        except _CannotVerify as e:
            self.stats.refused += 1
            return f"verify: cannot check this site: {e}"
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            self.stats.cached += 1
            verdict = self._verdicts[key]
        else:
            verdict = check(m, seed=zlib.crc32(repr(key[1:]).encode()))
            self._verdicts[key] = verdict
            if len(self._verdicts) > self.max_entries:
                self._verdicts.popitem(last=False)
            self.stats.checked += 1
            if verdict is not None:
                log.warning("rule %s refused at %s: %s", m.rule.name, m.anchor.name, verdict)
        if verdict is not None:
            self.stats.refused += 1
        return verdict

    def clear(self) -> None:
        self._verdicts.clear()
        self.stats = VerifyStats()


_SHARED = Verifier()


def verify_match(match: Match) -> str | None:
    """None if ``match``'s replacement computes what the matched subgraph computes on random
    inputs of the site's shapes and dtypes; otherwise the reason (``"verify: ..."``)."""
    return _SHARED(match)


def clear_cache() -> None:
    """Forget every verdict of the shared verifier (and its statistics)."""
    _SHARED.clear()


def stats() -> VerifyStats:
    """Statistics of the shared verifier since the last ``clear_cache()``."""
    return _SHARED.stats


# --------------------------------------------------------------------------- signature


def _concrete_shape(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape, stride = [], []
    for s in t.shape:
        h = meta.check_value(s)
        if h is None:
            raise _CannotVerify(f"size {s} has no hint, and its symbols have no values the graph's "
                                "runtime asserts allow")
        shape.append(int(h))
    try:
        for s in t.stride():
            h = meta.check_value(s)
            stride.append(int(h) if h is not None else -1)
    except Exception:  # noqa: BLE001 - sparse / nested tensors have no strides
        stride = []
    return tuple(shape), tuple(stride)


_DESCRIBED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _describe_value(v: Any) -> Any:
    """The part of a bound value a verdict depends on."""
    if isinstance(v, fx.Node):
        mv = meta.value(v)
        if isinstance(mv, torch.Tensor):
            desc = _DESCRIBED.get(mv)  # fake values are shared between nodes: described once
            if desc is None:
                shape, stride = _concrete_shape(mv)
                desc = _DESCRIBED[mv] = ("tensor", shape, stride, mv.dtype, _device(mv).type)
            return desc
        if isinstance(mv, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("symbolic", type(mv).__name__, meta.check_value(mv))
        if isinstance(mv, (int, float, bool)):
            return ("scalar", mv)
        raise _CannotVerify(f"`{v.name}` has no known value (meta {type(mv).__name__})")
    return ("literal", repr(v))


def signature(m: Match) -> tuple[Any, ...]:
    """What a verdict depends on: the rule (by identity), bound values' shapes, dtypes and
    scalars, the matched targets, in-place or not, and the provider override."""
    bound = tuple((name, _describe_value(m.bindings[name])) for name in sorted(m.bindings))
    targets = tuple(str(n.target) for n in m.internal)
    inplace = m.rule.inplace is not None and inplace_blocker(m) is None
    provider = os.environ.get("FXREWRITE_PROVIDER", "")
    return (m.rule, m.rule.name, bound, targets, inplace, provider)


# --------------------------------------------------------------------------- inputs


def _device(t: torch.Tensor) -> torch.device:
    d = t.device
    if d.type == "meta" or (d.type == "cuda" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return d


class _Generators:
    """One seeded generator per device: each tensor is drawn on the device it lives on (a
    weight of 10^8 values drawn on the host would cost seconds), CPU tensors from the CPU
    generator in the order they come."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.by_device: dict[torch.device, torch.Generator] = {}

    def __call__(self, device: torch.device) -> torch.Generator:
        if device not in self.by_device:
            self.by_device[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.by_device[device]


def _random_tensor(t: torch.Tensor, gens: _Generators) -> torch.Tensor:
    shape, _ = _concrete_shape(t)
    dtype, device = t.dtype, _device(t)
    gen = gens(device)
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(shape, generator=gen, dtype=torch.float64, device=device)
        if len(shape) >= 2 and shape[-1] > 0:
            lo, hi = ROW_SCALE_LOG10
            u = torch.rand((*shape[:-1], 1), generator=gen, dtype=torch.float64, device=device) * (hi - lo) + lo
            base = base * torch.pow(10.0, u)
        try:
            out = base.to(dtype)
        except (RuntimeError, TypeError) as e:
            raise _CannotVerify(f"cannot make a random {dtype} tensor: {e}") from e
    elif dtype is torch.bool:
        out = torch.rand(shape, generator=gen, device=device) < 0.5
    else:
        out = torch.randint(0, 8, shape, generator=gen, device=device).to(dtype)
    return out


def _materialize(node: fx.Node, gens: _Generators) -> Any:
    mv = meta.value(node)
    if isinstance(mv, torch.Tensor):
        return _random_tensor(mv, gens)
    if isinstance(mv, torch.SymFloat):
        h = meta.hint(mv)
        return float(h) if h is not None else SYMBOLIC_EPS
    if isinstance(mv, (torch.SymInt, torch.SymBool)):
        h = meta.check_value(mv)
        if h is None:
            raise _CannotVerify(f"`{node.name}` is a symbolic {type(mv).__name__} without a hint or an "
                                "allowed stand-in")
        return h
    if isinstance(mv, (int, float, bool)):
        return mv
    raise _CannotVerify(f"`{node.name}` has no known value")


# --------------------------------------------------------------------------- the check


def extract(m: Match) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The matched subgraph as a standalone GraphModule.

    Its placeholders stand for the graph nodes the match reads from outside (the bound inputs
    and anything else an internal node reads), in the order returned; it returns the values of
    the pattern's outputs.
    """
    return extract_nodes(m.internal, [m.nodes[o] for o in m.rule.compiled.outputs])


def extract_nodes(internal: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node]]:
    """``internal`` (graph nodes in graph order) copied into a standalone GraphModule whose
    placeholders stand for the nodes they read from outside, in the order returned, and which
    returns the values of ``outputs``. Graph passes that prove a region numerically use it too
    (``rewrites/moe.py``)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []
    inside = set(internal)

    def arg(n: fx.Node) -> fx.Node:
        if n not in env:
            if n in inside:
                raise _CannotVerify(f"internal node `{n.name}` read before it is computed")
            env[n] = graph.placeholder(f"in{len(inputs)}_{n.name}")
            inputs.append(n)
        return env[n]

    for n in internal:
        env[n] = graph.node_copy(n, arg)
    graph.output(tuple(env[g] if g in env else arg(g) for g in outputs))
    return fx.GraphModule(torch.nn.Module(), graph), inputs


def _replacement(m: Match) -> fx.GraphModule:
    cr = m.rule.compiled
    if cr.inplace is not None and inplace_blocker(m) is None:
        return cr.inplace
    return cr.replacement


def run_graph(gm: fx.GraphModule, args: Sequence[Any], run: Callable[..., Any] | None = None) -> list[Any]:
    """Run ``gm`` (or ``run``, a runner of it) on clones: one clone per distinct tensor, so
    arguments bound to one graph node alias each other as they do in the graph (an in-place
    kernel sees the same aliasing)."""
    clones: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        out = (run or gm)(*[clones.setdefault(id(a), a.clone()) if isinstance(a, torch.Tensor) else a for a in args])
    return list(out) if isinstance(out, (tuple, list)) else [out]


class _Float64(fx.Interpreter):
    """The subgraph in float64, where an FP8 GEMM (``aten._scaled_mm``: its operands must be FP8,
    not float64) is its exact value, ``(a @ b) * scale_a * scale_b + bias`` (e4m3 values and their
    products are exact in float64), and the kernel's own float32 sum is judged against that."""

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target is torch.ops.aten._scaled_mm.default and (list(args) + [None] * 6)[5] is None:
            # (a result scale means an FP8 output: that keeps the dtype tolerance)
            a, b, scale_a, scale_b, bias = (list(args) + [None] * 5)[:5]
            y = (a.double() @ b.double()) * scale_a.double() * scale_b.double()
            return y if bias is None else y + bias.double()
        return super().call_function(target, args, kwargs)


def check(m: Match, seed: int = 0) -> str | None:
    """Run the matched subgraph and the replacement on the same random inputs; None if every
    output agrees within its dtype's tolerance, else the reason."""
    try:
        sub, ext = extract(m)
        gens = _Generators(seed)
        values = {n: _materialize(n, gens) for n in ext}
    except _CannotVerify as e:
        return f"verify: cannot check this site: {e}"
    where = _where(m, values)
    try:
        expected = run_graph(sub, [values[n] for n in ext])
    except Exception as e:  # noqa: BLE001 - any failure means the site is unchecked
        return f"verify: the matched subgraph fails on random inputs ({type(e).__name__}: {e}) on {where}"
    rep = _replacement(m)
    args = []
    for p in rep.graph.nodes:
        if p.op == "placeholder":
            b = m.bindings[p.target]
            args.append(values[b] if isinstance(b, fx.Node) else b)
    try:
        got = run_graph(rep, args)
    except Exception as e:  # noqa: BLE001 - the replacement is what we check
        return f"verify: the replacement raised {type(e).__name__}: {e} on {where}"
    if len(got) != len(expected):
        return f"verify: the replacement returns {len(got)} value(s), the subgraph {len(expected)} on {where}"
    exact: list[Any] | None = None

    def exact_output(i: int) -> Any:
        nonlocal exact
        exact = run_float64(sub, [values[n] for n in ext]) if exact is None else exact
        return exact[i] if i < len(exact) else None

    judged, why = _quantized_outputs(got, expected, [values[n] for n in ext], exact_output)
    if why is not None:
        return f"verify: {why} on {where}"
    for i, (a, b) in enumerate(zip(got, expected)):
        if i in judged:
            continue
        why = agrees(a, b, lambda i=i: exact_output(i))
        if why is None:
            continue
        out = f" in output {i}" if len(expected) > 1 else ""
        if _meta_differs(a, b):
            if _meta_check_refuses(m, rep, i):
                return None  # the rewrite step refuses it by fake values and says which output
            return f"verify: {why}{out} at run time, while the fake values agree (a fake impl is wrong) on {where}"
        return f"verify: {why}{out} on {where}"
    return None


def _quantized_outputs(got: Sequence[Any], expected: Sequence[Any], inputs: Sequence[Any],
                       exact: Callable[[int], Any]) -> tuple[set[int], str | None]:  # fmt: skip
    """(indices of the quantized outputs, what differs or None), judged as quantizations
    (``quant.quantized_output_mismatches``): an FP8 value one e4m3 step from the code's (or,
    statically scaled, from the code's float64 run's, ``exact``: where the code's sum cancels), a
    scale within two roundings of the least precise input's dtype (a kernel's amax of values one
    rounding apart, e.g. a bf16 activation through another ``exp``, moves a scale by one bf16
    step, which float32's tolerance refuses); NVFP4 one e2m1 and one e4m3 scale step."""
    if not all(isinstance(t, torch.Tensor) for t in (*got, *expected)):
        return set(), None
    from fxrewrite.runtime.ops.quant import fp8_scale_rtol, quantized_output_mismatches

    floats = [t.dtype for t in inputs if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.element_size() > 1]
    least = max(floats, key=lambda d: torch.finfo(d).eps, default=torch.float32)
    problems, rest = quantized_output_mismatches(got, expected, fp8_scale_rtol(least), exact)
    return set(range(len(got))) - set(rest), "; ".join(problems) or None


LOW_PRECISION = (torch.bfloat16, torch.float16)
ACCURACY_SLACK = 2.0  # the replacement may be this many times further from exact than the code


def _low_precision(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.dtype in LOW_PRECISION


def agrees(got: Any, want: Any, exact: Callable[[], Any]) -> str | None:
    """None if ``got`` (the replacement's output) matches ``want`` (the replaced code's) within
    the dtype's tolerance, or in bf16/fp16 is no less accurate than ``want`` against
    ``exact()`` (the replaced code in float64: :func:`run_float64`; called only then); else the
    reason."""
    why = compare(got, want)
    if why is not None and _low_precision(got, want) and _no_less_accurate(got, want, exact()):
        return None
    return why


def run_float64(sub: fx.GraphModule, args: Sequence[Any]) -> list[Any]:
    """The matched subgraph on the same inputs upcast to float64 (its own casts still round; an
    FP8 GEMM is its exact product, :class:`_Float64`); [] when it does not run so."""
    up = [a.double() if isinstance(a, torch.Tensor) and a.dtype.is_floating_point else a for a in args]
    try:
        return run_graph(sub, up, _Float64(sub).run)
    except Exception:  # noqa: BLE001 - no exact reference: the dtype tolerance decides
        return []


def _no_less_accurate(got: torch.Tensor, want: torch.Tensor, exact: Any) -> bool:
    """In bf16/fp16 the code a rule replaces rounds at every step: where its terms cancel (a
    rotation, a difference) its own result is off by more than the dtype tolerance of that small
    output. A kernel that rounds once is then judged against the exact (float64) result: it
    passes when its largest error is at most ``ACCURACY_SLACK`` times the replaced code's, plus
    one unit of the dtype's precision at the output's scale."""
    if not isinstance(exact, torch.Tensor) or exact.shape != want.shape:
        return False
    e = exact.detach().cpu().double()
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    if not (torch.isfinite(g).all() and torch.isfinite(w).all()):
        return False
    unit = torch.finfo(got.dtype).eps * float(e.abs().max())
    return float((g - e).abs().max()) <= ACCURACY_SLACK * float((w - e).abs().max()) + unit


def _meta_differs(a: Any, b: Any) -> bool:
    return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or (
        a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape)
    )


def _meta_check_refuses(m: Match, rep: fx.GraphModule, i: int) -> bool:
    """Whether the rewrite step's own check (fake values of the replacement against the pattern's
    outputs) refuses output ``i``: then a dtype or shape difference is its to report, with its
    message. Running the replacement on the bound fake values tells."""
    want = meta.tensor(m.nodes[m.rule.compiled.outputs[i]])
    fake_mode = meta.fake_mode_of(m.anchor.graph)
    if want is None or fake_mode is None:
        return True
    args = []
    for p in rep.graph.nodes:
        if p.op == "placeholder":
            b = m.bindings[p.target]
            args.append(meta.value(b) if isinstance(b, fx.Node) else b)
    try:
        with fake_mode:
            outs = rep(*args)
    except Exception:  # noqa: BLE001 - no fake value: the rewrite step refuses that too
        return True
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    got = outs[i] if i < len(outs) else None
    return not isinstance(got, torch.Tensor) or got.dtype != want.dtype or not meta.same_sizes(got, want)


def _where(m: Match, values: dict[fx.Node, Any]) -> str:
    """``x=bf16[1, 8, 64], weight=bf16[64], eps=1e-06 (symbolic)``: the site's bound inputs."""
    parts = []
    for name in m.rule.compiled.params:
        if name not in m.bindings:
            continue
        b = m.bindings[name]
        v = values.get(b) if isinstance(b, fx.Node) else b
        if isinstance(v, torch.Tensor):
            parts.append(f"{name}={dtype_name(v.dtype)}{list(v.shape)}")
        elif isinstance(b, fx.Node):
            parts.append(f"{name}={v!r} (symbolic)")
        else:
            parts.append(f"{name}={v!r}")
    return ", ".join(parts)
