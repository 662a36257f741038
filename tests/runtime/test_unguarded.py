"""Backend.unguarded: the compiled graph called without Dynamo's frame evaluation (CPU)."""

from __future__ import annotations

import inspect
import types
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn

import fxrewrite
from fxrewrite.runtime.dispatch import ShapeError

HIDDEN = 16


class Block(nn.Module):
    """RMSNorm (plain torch, fused by the default rules) and a linear; ``scale`` is a Python float
    Dynamo bakes into the graph (a value only a guard notices changing)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(HIDDEN) + 0.5)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.scale = 1.0

    def forward(self, x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        normed = (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * self.weight
        return self.proj(normed) * self.scale + shift


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()  # cache entries live on Block.forward's code, shared by every test
    with torch.no_grad():
        yield
    torch._dynamo.reset()


def compiled_block(mode: str = "none") -> tuple[Block, object, fxrewrite.Backend]:
    torch.manual_seed(0)
    model = Block().eval()
    backend = fxrewrite.Backend(mode=mode, capture_sizes=(4, 8), progress=False, splitting_ops=())
    return model, backend.compile(model), backend


@pytest.mark.parametrize("mode", ["none", "full"])
def test_runs_the_compiled_graph(mode: str) -> None:
    model, step, backend = compiled_block(mode)
    step(tokens(8))
    fast = backend.unguarded(step, tokens(8))
    assert fast.__qualname__.endswith("(unguarded)")
    linears = {"linear": 1} if mode == "full" else {}  # fxr.linear: in graphs replayed as CUDA graphs only
    assert backend.report.graphs[0].fused_ops == {"rms_norm": 1, **linears}
    for n in (3, 8):  # padded and exact sizes in mode full; any count in mode none
        x = tokens(n, seed=n)
        torch.testing.assert_close(fast(x), step(x))
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(backend.graphs) == 1


@pytest.mark.parametrize("mode", ["none", "full"])
def test_calls_the_graph_not_dynamos_wrapper(mode: str) -> None:
    """The bytecode's global for the compiled graph is the backend's graph (its runner in the
    CUDA-graph modes) in the unguarded function's scope; the model's module keeps Dynamo's
    wrapper, which compiled calls still go through."""
    model, step, backend = compiled_block(mode)
    step(tokens(8))
    fast = backend.unguarded(step, tokens(8))
    ours = {k: v for k, v in fast.__func__.__globals__.items() if k.startswith("__compiled_fn")}
    theirs = {k: v for k, v in Block.forward.__globals__.items() if k.startswith("__compiled_fn")}
    assert [k for k, v in ours.items() if v is backend.runners[0]] != []
    assert not any(v is backend.runners[0] for v in theirs.values())
    torch.testing.assert_close(fast(tokens(8, seed=1)), step(tokens(8, seed=1)))
    # so are the helpers it calls from torch._dynamo.utils (call_size for the dynamic rows)
    key = "__import_torch_dot__dynamo_dot_utils"
    proxy, module = fast.__func__.__globals__[key], Block.forward.__globals__[key]
    assert isinstance(module, types.ModuleType) and not isinstance(proxy, types.ModuleType)
    used = [n for n in vars(proxy) if not n.startswith("_")]
    assert used and all(getattr(proxy, n) is inspect.unwrap(getattr(module, n)) for n in used)
    assert all(getattr(proxy, n) is not getattr(module, n) for n in used)


def test_skips_the_guards() -> None:
    """The compiled model sees ``scale`` change and compiles again; the unguarded function keeps
    running the graph it was given (the documented trade)."""
    model, step, backend = compiled_block()
    x = tokens(8)
    before = step(x)
    fast = backend.unguarded(step, x)
    model.scale = 2.0
    torch.testing.assert_close(step(x), 2 * before)
    assert len(backend.graphs) == 2
    torch.testing.assert_close(fast(x), before)


def test_picks_the_graph_the_example_selects() -> None:
    """Under ``dynamic=True`` one token is specialized: graph 0 serves it, graph 1 every other
    count; each example gets its own graph, and keyword defaults pass through."""
    model, step, backend = compiled_block()
    step(tokens(1))
    step(tokens(8))
    assert len(backend.graphs) == 2
    one, many = backend.unguarded(step, tokens(1)), backend.unguarded(step, x=tokens(8), shift=0.0)
    assert one.__code__ is not many.__code__
    torch.testing.assert_close(one(tokens(1, 5)), model(tokens(1, 5)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(many(tokens(6, 5)), model(tokens(6, 5)), rtol=1e-5, atol=1e-5)


def test_a_compiled_function() -> None:
    backend = fxrewrite.Backend()

    def norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    step = backend.compile(norm)
    step(tokens(4))
    torch.testing.assert_close(backend.unguarded(step, tokens(4))(tokens(5)), norm(tokens(5)))
    torch.testing.assert_close(backend.unguarded(norm, tokens(4))(tokens(5)), norm(tokens(5)))


def test_before_the_first_call_is_refused() -> None:
    _, step, backend = compiled_block()
    with pytest.raises(RuntimeError, match="call the compiled model once first"):
        backend.unguarded(step, tokens(8))


def test_another_backends_graph_is_refused() -> None:
    model, _, backend = compiled_block()
    other = torch.compile(model, backend="eager", fullgraph=True)
    other(tokens(8))
    with pytest.raises(RuntimeError, match="no compiled graph of this backend"):
        backend.unguarded(other, tokens(8))


def test_an_example_no_graph_accepts_is_refused() -> None:
    _, step, backend = compiled_block()
    step(tokens(8))
    with pytest.raises(RuntimeError, match="accepts the example call.*first failed guard"):
        backend.unguarded(step, tokens(8).double())
    with pytest.raises(TypeError, match="does not fit"):
        backend.unguarded(step, tokens(8), tokens(8), tokens(8))


def test_shapes_are_still_checked() -> None:
    """No guards, but the runner's shape check: a width the graph was not compiled for fails
    loudly instead of replaying the wrong graph."""
    _, step, backend = compiled_block("full")
    step(tokens(8))
    fast = backend.unguarded(step, tokens(8))
    with pytest.raises(ShapeError, match="expected shape"):
        fast(torch.randn(8, 2 * HIDDEN))


def test_a_torch_without_cache_entries_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _, step, backend = compiled_block()
    step(tokens(8))
    monkeypatch.delattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list")
    with pytest.raises(RuntimeError, match="does not expose Dynamo's cache entries"):
        backend.unguarded(step, tokens(8))
