"""Property-based tests: random programs spelled the many ways model code spells things.

A program is a list of steps over a pool of 3-D tensors; each step draws an operation family, a
spelling of it (method / function / operator forms, kwargs or positional, scalar first or last,
casts, reshapes, chunk / split / slices) and operands from the pool. Composite steps spell the
patterns the default rules look for (RMSNorm, add + RMSNorm, Gemma's norm, SiLU / GELU and mul)
component by component, and may expose their intermediates to later steps (which must then
block the fusion, not break it).

Properties:

* canonicalization keeps dtype, shape and values (float64 programs, any family);
* the whole default pipeline (every default rule) keeps them, in float32, bfloat16 and float16;
* the matcher never leaves an invalid graph (``lint``), a cycle, a match over erased nodes or
  two applied matches sharing a node, and in-place replacements never change a value read later;
* through Dynamo (sparingly): composite programs keep their numerics under ``dynamic`` True and
  False, and every RMSNorm / SiLU-and-mul spelled in a canonical way is fused.

Graphs are built with ``torch.fx.symbolic_trace`` and given fake values with ``FakeTensorProp``
(fast); only the last property goes through Dynamo. CI runs a bounded, derandomized number of
examples; ``FXREWRITE_FUZZ_EXAMPLES=500`` runs more, randomized.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import fxrewrite.runtime.ops  # noqa: F401  (torch.ops.fxr.*)
from fxrewrite.backend import default_rule_groups, pipeline
from fxrewrite.canonicalize import canonicalize
from fxrewrite.config import Config
from fxrewrite.match import Match
from fxrewrite.passes import PassManager
from fxrewrite.rewrites import norm
from fxrewrite.rewrite import apply_rules
from fxrewrite.testing import compile_once, op_counts
from fxrewrite.tolerances import TOLERANCES

_ENV_EXAMPLES = os.environ.get("FXREWRITE_FUZZ_EXAMPLES")


def fuzz_settings(ci_examples: int, shrink: bool = True) -> settings:
    """``ci_examples`` derandomized examples, or FXREWRITE_FUZZ_EXAMPLES random ones; without
    ``shrink`` a failure is reported as drawn (shrinking Dynamo compilations takes minutes)."""
    n = int(_ENV_EXAMPLES) if _ENV_EXAMPLES else ci_examples
    phases = list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(
        max_examples=n, deadline=None, derandomize=not _ENV_EXAMPLES, database=None, phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )  # fmt: skip


# -- spellings --------------------------------------------------------------------------------------
# Each list holds interchangeable spellings of one operation. `None` in KNOWN marks spellings the
# canonicalizer is not expected to unify (a composite using one need not fuse).

Fn = Callable[..., Any]


@dataclasses.dataclass
class Ctx:
    """What spellings may read besides their operands: the program's dtype, inputs and widths."""

    dtype: torch.dtype
    x: Any
    w: Any
    eps: Any
    d: int


UNARY: dict[str, list[Fn]] = {
    "neg": [lambda a: -a, torch.neg, lambda a: a.neg()],
    "sigmoid": [torch.sigmoid, lambda a: a.sigmoid(), F.sigmoid],
    "tanh": [torch.tanh, lambda a: a.tanh()],
    "relu": [F.relu, torch.relu, lambda a: a.relu()],
    "silu": [F.silu, lambda a: a * torch.sigmoid(a), lambda a: torch.sigmoid(a) * a, lambda a: a.sigmoid().mul(a)],
    "gelu": [F.gelu, lambda a: F.gelu(a, approximate="tanh")],
    "square": [lambda a: a**2, lambda a: a.pow(2), lambda a: torch.pow(a, 2), torch.square, lambda a: a * a,
               lambda a: a**2.0],  # fmt: skip
    "rsqrt": [lambda a: torch.rsqrt(a.abs() + 0.5), lambda a: (a.abs() + 0.5).rsqrt(),
              lambda a: 1 / torch.sqrt(a.abs() + 0.5), lambda a: torch.reciprocal((a.abs() + 0.5).sqrt()),
              lambda a: 1.0 / (a * a + 0.5).sqrt()],  # fmt: skip
    "clamp": [lambda a: a.clamp(min=-1.0), lambda a: torch.clamp(a, -2.0, 2.0), lambda a: torch.clip(a, max=1.5),
              lambda a: a.clamp(-1, 1)],  # fmt: skip
    "noop": [lambda a: a.contiguous(), lambda a: a[..., :], lambda a: a[:, :, 0:], lambda a: a.float().float()],
    # (not `a.view(a.shape)`: see test_view_to_a_traced_size_is_kept)
    "reshape": [lambda a: a.view(-1, a.shape[-1]).view(a.shape[0], a.shape[1], a.shape[2]),
                lambda a: a.reshape(-1, a.shape[-1]).reshape(a.shape[0], a.shape[1], -1),
                lambda a: torch.reshape(a, (-1,)).reshape((a.shape[0], a.shape[1], a.shape[2])),
                lambda a: a.flatten(0, 1).view(a.shape[0], a.shape[1], -1)],  # fmt: skip
    "cast": [lambda a: a.float(), lambda a: a.to(torch.float32), lambda a: a.type(torch.float32),
             lambda a: a.to(dtype=torch.float32), lambda a: a.double()],  # fmt: skip
}
# (not `a.to(x.dtype)`: see test_cast_to_a_traced_dtype_is_kept)
CAST_BACK: list[Fn] = [lambda a, c: a.to(c.dtype), lambda a, c: a.type(c.dtype), lambda a, c: a.type_as(c.x),
                       lambda a, c: a.to(c.x)]  # fmt: skip
BINARY: dict[str, list[Fn]] = {
    "add": [lambda a, b: a + b, torch.add, lambda a, b: a.add(b), lambda a, b: b + a],
    "sub": [lambda a, b: a - b, torch.sub, lambda a, b: a.sub(b), torch.subtract],
    "mul": [lambda a, b: a * b, torch.mul, lambda a, b: a.mul(b), lambda a, b: b * a, torch.multiply],
    "div": [lambda a, b: a / (b.abs() + 1), lambda a, b: torch.div(a, b.abs() + 1), lambda a, b: a.div(b.abs() + 1),
            lambda a, b: torch.true_divide(a, b * b + 1)],  # fmt: skip
}
SCALAR: list[Fn] = [
    lambda a, s: a * s, lambda a, s: s * a, lambda a, s: a.mul(s), lambda a, s: torch.mul(a, s),
    lambda a, s: a + s, lambda a, s: s + a, lambda a, s: a.add(s), lambda a, s: torch.add(a, s),
    lambda a, s: a - s, lambda a, s: s - a, lambda a, s: a / s, lambda a, s: a.div(s),
    lambda a, s: s / (a.abs() + 1),
]  # fmt: skip
MEAN: list[Fn] = [lambda a: a.mean(-1, keepdim=True), lambda a: torch.mean(a, dim=-1, keepdim=True),
                  lambda a: a.mean(dim=[-1], keepdim=True), lambda a: a.mean(2, True),
                  lambda a: torch.mean(a, (-1,), True)]  # fmt: skip

# RMSNorm components, in the order they are drawn
NORM_PARTS: list[list[Fn]] = [
    [lambda a, c: a.float(), lambda a, c: a.to(torch.float32), lambda a, c: a.type(torch.float32),
     lambda a, c: a.to(dtype=torch.float32)],  # cast up
    [lambda h, c: h.pow(2), lambda h, c: h**2, lambda h, c: h * h, lambda h, c: torch.square(h),
     lambda h, c: torch.pow(h, 2)],  # square
    [lambda s, c: m(s) for m in MEAN],  # mean
    [lambda v, c: v + 1e-6, lambda v, c: 1e-5 + v, lambda v, c: torch.add(v, 1e-6), lambda v, c: v.add(c.eps),
     lambda v, c: v + c.eps],  # + eps (a literal or a scalar input)
    [lambda v, c: torch.rsqrt(v), lambda v, c: v.rsqrt(), lambda v, c: 1 / torch.sqrt(v),
     lambda v, c: torch.reciprocal(torch.sqrt(v)), lambda v, c: 1.0 / v.sqrt()],  # rsqrt
    [lambda h, r: h * r, lambda h, r: r * h, lambda h, r: torch.mul(h, r), lambda h, r: h.mul(r)],  # apply
    CAST_BACK,  # cast back
    [lambda w, n: w * n, lambda w, n: n * w, lambda w, n: torch.mul(w, n), lambda w, n: n.mul(w)],  # weight
]
GEMMA_SCALE: list[Fn] = [lambda w: 1.0 + w.float(), lambda w: w.float() + 1.0, lambda w: 1 + w.to(torch.float32)]
HALVES: list[Fn] = [
    lambda a, d: (a[..., :d], a[..., d:]),
    lambda a, d: tuple(a.chunk(2, -1)[i] for i in range(2)),
    lambda a, d: tuple(torch.chunk(a, 2, dim=-1)[i] for i in range(2)),
    lambda a, d: tuple(a.split(d, -1)[i] for i in range(2)),
    lambda a, d: tuple(torch.split(a, [d, d], dim=-1)[i] for i in range(2)),
    lambda a, d: (a[:, :, :d], a[:, :, d:]),
    lambda a, d: (a.narrow(-1, 0, d), a.narrow(-1, d, d)),
]
ACT: dict[str, list[Fn]] = {"silu": UNARY["silu"], "gelu": [F.gelu]}
PRODUCT: list[Fn] = [lambda g, u: g * u, lambda g, u: u * g, lambda g, u: torch.mul(g, u)]

# spellings a composite may use and still be expected to fuse (indices per component)
KNOWN_NORM = [None, None, None, None, None, None, None, None]  # every RMSNorm spelling above is canonical
KNOWN_HALVES = set(range(6))  # narrow is not canonicalized


# -- programs -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """One drawn operation: family, spelling indices, operand indices into the pool, a scalar,
    whether intermediates join the pool."""

    family: str
    spell: tuple[int, ...]
    args: tuple[int, ...]
    scalar: float = 0.0
    expose: bool = False


@dataclasses.dataclass(frozen=True)
class Program:
    dtype: torch.dtype
    shape: tuple[int, int, int]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]

    def inputs(self, seed: int = 0) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(seed)
        b, t, d = self.shape
        x, r = (torch.randn(self.shape, generator=g).to(self.dtype) for _ in range(2))
        w = torch.randn(d, generator=g).to(self.dtype)
        return x, r, w, 1e-6


def apply_step(st_: Step, pool: list[Any], c: Ctx) -> list[Any]:
    """Run one step on ``pool`` values (real tensors or proxies); the new pool entries."""
    a = [pool[i] for i in st_.args]
    f, s = st_.family, st_.spell
    if f in UNARY:
        return [UNARY[f][s[0]](a[0])]
    if f == "cast_back":
        return [CAST_BACK[s[0]](a[0], c)]
    if f in BINARY:
        return [BINARY[f][s[0]](a[0], a[1])]
    if f == "scalar":
        return [SCALAR[s[0]](a[0], st_.scalar)]
    if f == "mean":
        return [MEAN[s[0]](a[0])]
    if f in ("norm", "add_norm", "gemma_norm"):
        extra = []
        x = a[0]
        if f == "add_norm":
            x = BINARY["add"][s[-1]](a[0], a[1])
            extra.append(x)  # the sum is read later: the add + norm rule's second output
        cast, square, mean, add_eps, rsqrt, apply_, back, weight = (NORM_PARTS[i][s[i]] for i in range(8))
        h = cast(x, c)
        var = mean(square(h, c), c)
        normed = apply_(h, rsqrt(add_eps(var, c), c))
        if f == "gemma_norm":
            out = back(normed * GEMMA_SCALE[s[7] % len(GEMMA_SCALE)](c.w), c)
        else:
            out = weight(c.w, back(normed, c))
        return [out, *extra, *([h, var] if st_.expose else [])]
    if f in ("silu_and_mul", "gelu_and_mul"):
        gate, up = HALVES[s[0]](a[0], c.d)
        act = ACT[f.split("_")[0]][s[1]]
        return [PRODUCT[s[2]](act(gate), up), *([gate] if st_.expose else [])]
    raise AssertionError(f)


def run_program(prog: Program, x: Any, r: Any, w: Any, eps: Any) -> tuple[Any, ...]:
    c = Ctx(prog.dtype, x, w, eps, prog.shape[-1] // 2)
    pool = [x, r]
    for s in prog.steps:
        pool += apply_step(s, pool, c)
    return tuple(pool[i] for i in prog.outputs)


class Traced(torch.nn.Module):
    """The program as a module (Dynamo keeps a module's int attributes static, as in models)."""

    def __init__(self, prog: Program, eps: float | None = None) -> None:
        super().__init__()
        self.prog = prog
        self.eps = eps

    def forward(self, x: Any, r: Any, w: Any, eps: Any = None) -> tuple[Any, ...]:
        return run_program(self.prog, x, r, w, self.eps if eps is None else eps)


GENERAL = [*UNARY, "cast_back", *BINARY, "scalar", "mean"]
COMPOSITE = ["norm", "add_norm", "gemma_norm", "silu_and_mul", "gelu_and_mul"]
GLUE = ["neg", "relu", "noop", "reshape", "scalar", "add", "mul", "cast", "cast_back"]
SPELLINGS: dict[str, list[int]] = {
    **{k: [len(v)] for k, v in UNARY.items()},
    "cast_back": [len(CAST_BACK)], **{k: [len(v)] for k, v in BINARY.items()},
    "scalar": [len(SCALAR)], "mean": [len(MEAN)],
    "norm": [len(p) for p in NORM_PARTS], "gemma_norm": [len(p) for p in NORM_PARTS],
    "add_norm": [len(p) for p in NORM_PARTS] + [len(BINARY["add"])],
    "silu_and_mul": [len(HALVES), len(ACT["silu"]), len(PRODUCT)],
    "gelu_and_mul": [len(HALVES), len(ACT["gelu"]), len(PRODUCT)],
}  # fmt: skip


@st.composite
def programs(
    draw: st.DrawFn,
    families: Sequence[str],
    dtypes: Sequence[torch.dtype],
    max_steps: int = 8,
    expose: bool = True,
    extra_outputs: bool = True,
) -> Program:
    """A random program; shapes are checked by running each step on small real tensors."""
    dtype = draw(st.sampled_from(dtypes))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([4, 8, 16])))
    prog = Program(dtype, shape, (), (0,))
    x, r, w, eps = prog.inputs()
    c = Ctx(dtype, x, w, eps, shape[-1] // 2)
    pool: list[torch.Tensor] = [x, r]
    steps: list[Step] = []
    for _ in range(draw(st.integers(1, max_steps))):
        family = draw(st.sampled_from(list(families)))
        full = [i for i, v in enumerate(pool) if tuple(v.shape) == shape]
        if family in COMPOSITE and not full:
            continue
        cands = full if family in COMPOSITE else list(range(len(pool)))
        first = draw(st.sampled_from(cands))
        args = [first]
        if family in BINARY or family == "add_norm":
            others = [i for i in (full if family == "add_norm" else range(len(pool))) if _broadcasts(pool[i], pool[first])]
            if family == "add_norm" and len(others) > 1:  # (not x + x: see test_inplace_add_norm_of_x_plus_x)
                others.remove(first)
            args.append(draw(st.sampled_from(others)))
        spell = tuple(draw(st.integers(0, n - 1)) for n in SPELLINGS[family])
        step = Step(family, spell, tuple(args), draw(st.sampled_from([0.5, 2.0, -3.0, 1.0])),
                    expose and draw(st.booleans()))  # fmt: skip
        steps.append(step)
        pool += apply_step(step, pool, c)
    outputs = [len(pool) - 1]
    if extra_outputs:
        outputs += draw(st.lists(st.integers(2, len(pool) - 1), max_size=2, unique=True))
    return Program(dtype, shape, tuple(steps), tuple(dict.fromkeys(outputs)))


def _broadcasts(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return torch.broadcast_shapes(a.shape, b.shape) == b.shape or a.shape == b.shape
    except RuntimeError:
        return False


# -- graphs ---------------------------------------------------------------------------------------


def traced(prog: Program) -> fx.GraphModule:
    """The program as an FX graph with fake values on every node, as Dynamo leaves them."""
    gm = fx.symbolic_trace(Traced(prog))
    mode = FakeTensorMode()
    inputs = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in prog.inputs()]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    return gm


def run(gm: fx.GraphModule, prog: Program) -> tuple[Any, ...]:
    with torch.no_grad():
        return gm(*[v.clone() if isinstance(v, torch.Tensor) else v for v in prog.inputs(seed=1)])


def assert_same(actual: Sequence[Any], expected: Sequence[Any], floor: torch.dtype | None = None) -> None:
    """Same dtypes and shapes; values within the tolerance of their dtype, or of ``floor`` when
    looser (a float32 output of a bfloat16 value carries bfloat16's rounding)."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, f"{a.dtype}{tuple(a.shape)} != {e.dtype}{tuple(e.shape)}"
        tols = [TOLERANCES[e.dtype]] + ([TOLERANCES[floor]] if floor is not None else [])
        rtol, atol = max(t[0] for t in tols), max(t[1] for t in tols)
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)


def precision_floor(prog: Program) -> torch.dtype:
    """The least precise dtype a value of ``prog`` may pass through (casts go to float32)."""
    return torch.float32 if prog.dtype == torch.float64 else prog.dtype


def all_rules() -> list[Any]:
    return [r for _, rules in default_rule_groups() for r in rules]


def assert_acyclic(graph: fx.Graph) -> None:
    """Every node's inputs come before it (lint checks the same; this says which node)."""
    seen: set[fx.Node] = set()
    for n in graph.nodes:
        late = [a for a in n.all_input_nodes if a not in seen]
        assert not late, f"`{n.name}` reads {[a.name for a in late]} before they are computed"
        seen.add(n)


# -- properties -------------------------------------------------------------------------------------


@fuzz_settings(15)
@given(programs(GENERAL + COMPOSITE, [torch.float64]))
def test_canonicalization_keeps_numerics(prog: Program) -> None:
    gm = traced(prog)
    expected = run(gm, prog)
    canonicalize(gm)
    gm.recompile()  # passes edit the graph; the pass manager regenerates code, here we do
    gm.graph.lint()
    assert_same(run(gm, prog), expected, precision_floor(prog))


@fuzz_settings(15)
@given(programs(COMPOSITE + GLUE, [torch.float32, torch.bfloat16, torch.float16]))
def test_every_default_rule_keeps_numerics(prog: Program) -> None:
    gm = traced(prog)
    expected = run(gm, prog)
    PassManager(pipeline(Config(verify=False, dump_dir=""))).run(gm)
    assert_same(run(gm, prog), expected, precision_floor(prog))


@fuzz_settings(15)
@given(programs(GENERAL + COMPOSITE + COMPOSITE, [torch.float32], max_steps=12))
def test_matcher_keeps_graphs_valid_and_matches_disjoint(prog: Program) -> None:
    gm = traced(prog)
    canonicalize(gm)
    gm.recompile()  # passes edit the graph; the pass manager regenerates code, here we do
    expected = run(gm, prog)
    accepted: list[tuple[Match, set[fx.Node]]] = []

    def record(m: Match) -> None:
        live = set(gm.graph.nodes)
        inside = set(m.internal)
        assert inside <= live, f"{m.rule.name} matched erased nodes {[n.name for n in inside - live]}"
        accepted.append((m, inside))
        return None

    apply_rules(gm, all_rules(), verify=record)
    gm.recompile()
    gm.graph.lint()
    assert_acyclic(gm.graph)
    live = set(gm.graph.nodes)
    applied = [inside for m, inside in accepted if m.anchor not in live]
    for i, a in enumerate(applied):
        for b in applied[i + 1 :]:
            assert not a & b, f"two applied matches share {[n.name for n in a & b]}"
    assert_same(run(gm, prog), expected, precision_floor(prog))


def with_every_output(prog: Program) -> Program:
    """``prog`` returning every value its steps make."""
    x, r, w, eps = prog.inputs()
    c = Ctx(prog.dtype, x, w, eps, prog.shape[-1] // 2)
    pool = [x, r]
    for s in prog.steps:
        pool += apply_step(s, pool, c)
    return dataclasses.replace(prog, outputs=tuple(range(2, len(pool))))


def _fusable(s: Step) -> bool:
    if s.family in ("norm", "add_norm"):
        return True
    return s.family == "silu_and_mul" and s.spell[0] in KNOWN_HALVES


@fuzz_settings(4, shrink=False)
@given(programs(COMPOSITE + ["scalar", "neg"], [torch.float32, torch.bfloat16], max_steps=4, expose=False,
                extra_outputs=False), st.booleans())  # fmt: skip
def test_through_dynamo_known_spellings_fuse_and_numerics_hold(prog: Program, dynamic: bool) -> None:
    prog = with_every_output(prog)  # no composite is dead code
    x, r, w, _ = prog.inputs(seed=1)
    for t in (x, r):
        torch._dynamo.mark_static(t, 2)  # the hidden width is static in models (it is a weight's)
    result = compile_once(Traced(prog, eps=1e-6), x, r, w, dynamic=dynamic)
    assert_same(result.output, result.eager, precision_floor(prog))
    counts = op_counts(result.graph)
    fused = sum(c for op, c in counts.items() if op.startswith("fxr."))
    expected = sum(_fusable(s) for s in prog.steps)
    assert fused >= expected, f"{expected} fusable composites, {fused} fused: {dict(counts)}\n{prog}"


# -- regressions the fuzzer found --------------------------------------------------------------------


def test_cast_to_a_traced_dtype_is_kept() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.float().to(x.dtype)

    prog = Program(torch.bfloat16, (1, 1, 4), (), (0,))
    gm = fx.symbolic_trace(f)
    x = prog.inputs()[0]
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(x)
    canonicalize(gm)
    gm.recompile()  # passes edit the graph; the pass manager regenerates code, here we do
    assert gm(x).dtype == torch.bfloat16


def test_view_to_a_traced_size_is_kept() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, x.shape[-1]).view(x.shape) * 2

    compile_once(f, torch.randn(2, 3, 4), rules=[], dynamic=True)


def test_split_by_a_symbolic_size_compiles() -> None:
    def f(x: torch.Tensor, d: int) -> torch.Tensor:
        a, b = x.split(d, -1)  # an int argument is a SymInt under dynamic=True
        return F.silu(a) * b

    x = torch.randn(2, 8)
    torch._dynamo.mark_static(x, 1)
    r = compile_once(f, x, 4, rules=[], dynamic=True)
    assert_same([r.output], [r.eager])


def test_inplace_add_norm_of_x_plus_x() -> None:
    def f(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = -a
        s = h + h  # x and residual are one intermediate: the kernel writes the sum, then the norm, into it
        v = s.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * v.to(a.dtype), s

    r = compile_once(f, torch.randn(2, 8), torch.randn(8), rules=[norm.ADD_RMS_NORM], verify=False)
    assert_same(r.output, r.eager)
