"""Dead code after the rewrites: nodes nobody reads go, writes in place stay.

A KV cache written with ``keys.index_copy_(2, pos, k)`` (transformers' ``StaticCache``) is a
``call_method`` node whose result nobody reads; ``torch.fx``'s ``Node.is_impure`` calls every
``call_method`` pure, so plain dead-code elimination dropped the cache writes and a compiled
model decoded garbage from an empty cache.
"""

from __future__ import annotations

import operator

import torch

import fxrewrite
from fxrewrite import meta
from fxrewrite.rewrite import dead_code


def write_cache(x: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    keys.index_copy_(0, pos, x)
    length.add_(x.shape[0])
    return x * 2


def test_writes_in_place_survive_the_pipeline() -> None:
    keys, length = torch.zeros(4, 3), torch.zeros((), dtype=torch.long)
    backend = fxrewrite.Backend(progress=False)
    out = backend.compile(write_cache)(torch.ones(1, 3), keys, torch.tensor([2]), length)
    torch.testing.assert_close(out, torch.full((1, 3), 2.0))
    assert keys[2].tolist() == [1.0, 1.0, 1.0] and keys.sum() == 3
    assert int(length) == 1
    methods = [n.target for n in backend.graphs[0].graph.nodes if n.op == "call_method"]
    assert methods.count("index_copy_") == 1 and methods.count("add_") == 1


def test_dead_code_drops_unread_pure_nodes_and_keeps_writes() -> None:
    def f(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        unused = x.sin()  # noqa: F841  (pure, read by nobody: goes)
        buf.mul_(2)  # read by nobody, but writes buf: stays
        torch.relu_(buf)  # an in-place function: stays
        return x + 1

    gm = torch.fx.symbolic_trace(f)
    assert dead_code(gm) == 1
    kept = {str(n.target) for n in gm.graph.nodes if n.op in ("call_method", "call_function")}
    assert kept == {"mul_", str(torch.relu_), "<built-in function add>"}


def test_dead_code_keeps_the_state_changes_dynamo_records_as_unread_calls() -> None:
    """``torch.vmap`` inlined by Dynamo: its nesting level is entered and left by calls nobody
    reads (Mamba's associative scan in transformers); dropping them broke every batched call."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.vmap(lambda row: row * row.sum())(x) + 1

    backend = fxrewrite.Backend(progress=False)
    x = torch.randn(4, 3)
    torch.testing.assert_close(backend.compile(f)(x), f(x))
    kept = [str(n.target) for n in backend.graphs[0].graph.nodes if n.op == "call_function"]
    assert any("_vmap_increment_nesting" in t for t in kept) and any("_vmap_decrement_nesting" in t for t in kept)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def test_no_rule_matches_inside_a_vmapped_body() -> None:
    """A fused op has no batching rule: an RMSNorm inside ``torch.vmap`` stays as traced, the
    same norm outside it fuses (the twin)."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        inside = torch.vmap(lambda row: _rms(row, w))(x)
        return inside + _rms(x, w)

    backend = fxrewrite.Backend(progress=False)
    x, w = torch.randn(4, 3, 16), torch.randn(16)
    torch.testing.assert_close(backend.compile(f)(x, w), f(x, w))
    assert backend.report.fused_ops() == {"rms_norm": 1}
    assert not backend.report.rejected and not backend.report.near_misses  # the body was not tried


def test_pure_calls_are_known_pure_and_unknown_functions_are_not() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    pure = [graph.call_function(t, (x,)) for t in (torch.ops.aten.relu.default, torch.sin, torch.nn.functional.silu)]
    pure.append(graph.call_function(operator.getitem, (x, 0)))
    unknown = graph.call_function(torch._C._functorch._vmap_increment_nesting, (x, "error"))
    assert not any(meta.is_impure(n) for n in pure)
    assert meta.is_impure(unknown)


def test_written_args_names_the_tensors_written() -> None:
    def f(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        torch.add(x, y, out=out)
        torch.relu_(y)
        return torch.sin(x)

    gm = torch.fx.symbolic_trace(f)
    written = {n.name: [a.name for a in meta.written_args(n)] for n in gm.graph.nodes if meta.written_args(n)}
    assert written == {"add_": ["x"], "add": ["out"], "relu_": ["y"]}
    sin = next(n for n in gm.graph.nodes if n.target is torch.sin)
    assert meta.written_args(sin) == [] and not meta.is_impure(sin)
