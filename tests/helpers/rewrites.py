"""Shared helpers for the rule-library tests (tests/rewrites), imported as ``helpers.rewrites``.

Every test compiles a small module written as model code through the default pipeline and
checks three things: the captured graph calls no fused op, the rewritten graph calls exactly the
fused ops expected, and the outputs equal eager (float32 tight, bf16 within ``TOLERANCES``, FP8
exactly where the same CPU formulas run on both sides).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
import torch.fx as fx

from fxrewrite.report import NearMiss, Site
from fxrewrite.testing import Compiled, assert_close, compile_once

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
F32 = torch.float32

# "lifted": dynamic=True with the model's Python floats lifted to graph inputs (plain
# torch.compile, or Config(specialize_floats=False)); True alone keeps them constants, as
# Backend.compile does. Rules must match both spellings of eps.
DYNAMIC = pytest.mark.parametrize("dynamic", [True, False, "lifted"], ids=["dynamic", "static", "lifted"])
# dtype x DYNAMIC, as ("dtype", "dynamic"): float32 in every mode and bf16 with its floats lifted
# (plain torch.compile of a bf16 model) in the default run, so every dtype and every mode is
# checked; the three other pairs are marked ``exhaustive`` (``-m exhaustive``, not in CI: Dynamo's
# tracing is most of the suite's time; they check pairs, not a dtype or a mode the run misses).
DEFAULT_DTYPE_MODES = {("f32", "dynamic"), ("f32", "static"), ("bf16", "lifted")}
DTYPE_MODES = pytest.mark.parametrize(("dtype", "dynamic"), [
    pytest.param(dtype, mode, id=f"{dname}-{mname}",
                 marks=() if (dname, mname) in DEFAULT_DTYPE_MODES else pytest.mark.exhaustive)
    for dtype, dname in ((F32, "f32"), (BF16, "bf16"))
    for mode, mname in ((True, "dynamic"), (False, "static"), ("lifted", "lifted"))
])  # fmt: skip


def compile_modes(dynamic: bool | str) -> dict[str, Any]:
    """compile_once keywords for a DYNAMIC value."""
    return {"dynamic": True, "specialize_floats": False} if dynamic == "lifted" else {"dynamic": bool(dynamic)}


def fused(counts: Mapping[str, int]) -> dict[str, int]:
    """The ``fxr.*`` entries of an op-count Counter, namespace dropped: ``{"rms_norm": 1}``."""
    return {op.split(".", 1)[1]: n for op, n in counts.items() if op.startswith("fxr.") and n}


def _leaves(v: Any) -> Iterator[Any]:
    if isinstance(v, (tuple, list)):
        for x in v:
            yield from _leaves(x)
    elif hasattr(v, "to_tuple"):  # a transformers ModelOutput
        yield from _leaves(v.to_tuple())
    else:
        yield v


def assert_same(actual: Any, expected: Any) -> None:
    """Bit-for-bit equal (FP8 compared after ``.float()``), same dtypes and shapes."""
    acts, exps = list(_leaves(actual)), list(_leaves(expected))
    assert len(acts) == len(exps)
    for a, e in zip(acts, exps):
        if not isinstance(e, torch.Tensor):
            assert a == e
            continue
        assert a.dtype == e.dtype and a.shape == e.shape, f"{a.dtype}{tuple(a.shape)} != {e.dtype}{tuple(e.shape)}"
        assert torch.equal(a.float(), e.float()), f"max abs diff {(a.float() - e.float()).abs().max().item()}"


def check(
    fn: Any,
    *inputs: Any,
    expect: Mapping[str, int],
    dynamic: bool | str = True,
    exact: bool = False,
    **overrides: Any,
) -> Compiled:
    """Compile ``fn(*inputs)`` with the default library (or ``rules=``/config overrides) and
    assert: no fused op as captured, exactly ``expect`` fused ops after (names without ``fxr.``),
    numerics against eager (``exact``: bit-for-bit, else ``TOLERANCES`` of the output dtype)."""
    r = compile_once(fn, *inputs, **{**compile_modes(dynamic), **overrides})
    assert fused(r.counts_before()) == {}, r.counts_before()
    assert fused(r.counts()) == dict(expect), f"fused ops {fused(r.counts())}, expected {dict(expect)}"
    if exact:
        assert_same(r.output, r.eager)
    else:
        assert_close(r.output, r.eager)
    return r


@contextlib.contextmanager
def fake_process_group() -> Iterator[None]:
    """Rank 0 of a fake 2-rank default group (``torch.testing._internal.distributed.fake_pg``):
    its all-reduce returns its input, so eager and compiled runs compute the same thing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sites(r: Compiled, rule: str | None = None) -> list[Site]:
    return [s for s in r.report.sites if rule is None or s.rule == rule]


def misses(r: Compiled, rule: str) -> list[NearMiss]:
    return [m for m in r.report.near_misses if m.rule == rule]


def reasons(r: Compiled, rule: str) -> list[str]:
    return [m.reason for m in misses(r, rule)]


def fused_nodes(r: Compiled, op: str) -> list[fx.Node]:
    """The graph's calls of ``torch.ops.fxr.<op>``."""
    out = []
    for n in r.graph.graph.nodes:
        name = getattr(n.target, "name", None)
        if n.op == "call_function" and callable(name) and n.target.name().split(".")[0] == f"fxr::{op}":
            out.append(n)
    return out


def storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind ``module``'s parameters (views counted once)."""
    seen: dict[int, int] = {}
    for p in module.parameters():
        s = p.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def storages(module: torch.nn.Module) -> collections.Counter[int]:
    """Storage address -> how many parameters live in it."""
    return collections.Counter(p.untyped_storage().data_ptr() for p in module.parameters())


# -- model code shared by several files --------------------------------------------------------


class LlamaRMSNorm(torch.nn.Module):
    """HF transformers' LlamaRMSNorm, as written there (eps a float attribute: under
    ``dynamic=True`` Dynamo lifts it and the graph reads it with ``.item()``)."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def quant_static(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 static per-tensor quantization spelled inline, as runtime/ops/quant.py specifies it."""
    return (y.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def quant_per_token(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 dynamic per-token quantization spelled inline (scale = absmax / 448, floored)."""
    y = y.float()
    s = y.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (y / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s
