"""Graph fixtures shared by the split and CUDA-graph tests (tests/fxrewrite/test_split.py,
tests/runtime/test_cudagraph.py and its GPU twin): custom attention ops (``fxrtest::attn``,
``attn_out``, ``cache_attn``), toy attention models, a tiny transformers Llama, a backend that
records Dynamo graphs and the calls they served, and what the runner tests check on CPU and GPU.

    rec = record(seeded(ToyAttention), toy_inputs([8, 5]), dynamic=True)
    runner = runner_for(rec, mode="piecewise")
    runner(*args_for(runner, rec.calls[0], 6))

Imported as ``helpers.graphs``: ``tests/`` is on ``sys.path`` while pytest runs (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fxrewrite.config import Config
from fxrewrite.runtime.cudagraph import Runner, build_runner

SDPA = F.scaled_dot_product_attention
CAPTURE_SIZES = (4, 8, 16)  # runner_for's default


def _register_attention_ops() -> None:
    """fxrtest::attn (functional), fxrtest::attn_out (writes ``out``) and fxrtest::cache_attn
    (writes the keys into a cache at ``slots``, an engine's KV cache), once per process."""
    if hasattr(torch.ops.fxrtest, "cache_attn"):
        return

    @torch.library.custom_op("fxrtest::attn", mutates_args=())
    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return SDPA(q, k, v, is_causal=True)

    @attn.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(q)

    @torch.library.custom_op("fxrtest::attn_out", mutates_args=("out",))
    def attn_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(SDPA(q, k, v, is_causal=True))

    @attn_out.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        return None

    @torch.library.custom_op("fxrtest::cache_attn", mutates_args=("cache",))
    def cache_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, slots, k.transpose(0, 1).flatten(1))  # [heads, T, d] -> [T, heads * d]
        return SDPA(q, k, v, is_causal=True)

    @cache_attn.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(q)


_register_attention_ops()


class ToyAttention(nn.Module):
    """x [tokens, hidden] -> ``layers`` x (qkv linear, causal attention, o linear, residual).

    attention: "sdpa" (F.scaled_dot_product_attention), "custom" (fxrtest::attn), "custom_out"
    (fxrtest::attn_out writing into a buffer allocated just before it).
    """

    def __init__(self, attention: str = "sdpa", hidden: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.attention, self.heads = attention, heads
        self.qkv = nn.ModuleList(nn.Linear(hidden, 3 * hidden) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.attention == "sdpa":
            return SDPA(q, k, v, is_causal=True)
        if self.attention == "custom":
            return torch.ops.fxrtest.attn(q, k, v)
        out = torch.empty_like(q)
        torch.ops.fxrtest.attn_out(q, k, v, out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        for qkv, o in zip(self.qkv, self.o):
            q, k, v = qkv(x).view(t, 3, self.heads, h // self.heads).permute(1, 2, 0, 3).unbind(0)
            a = self.attend(q.contiguous(), k.contiguous(), v.contiguous())
            x = x + o(a.transpose(0, 1).reshape(t, h)).relu()
        return x


class CachedAttention(ToyAttention):
    """ToyAttention whose attention op writes each layer's keys into a KV-cache buffer at
    ``slots`` [tokens] (fxrtest::cache_attn): state that outlives a call."""

    def __init__(self, slots: int = 64, hidden: int = 32) -> None:
        super().__init__("cache", hidden)
        for i in range(len(self.qkv)):
            self.register_buffer(f"cache{i}", torch.randn(slots, hidden))
        self.slots: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = getattr(self, f"cache{self.layer}")
        self.layer += 1
        return torch.ops.fxrtest.cache_attn(q, k, v, cache, self.slots)

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        self.layer, self.slots = 0, slots
        return super().forward(x)


class TinyLlama(nn.Module):
    """transformers LlamaModel at the test shape, returning the last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=128)
        self.model = LlamaModel(cfg).eval()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).last_hidden_state


@dataclasses.dataclass
class Recorded:
    """One Dynamo graph, its example inputs, and the real arguments of every call it served."""

    gm: torch.fx.GraphModule
    example_inputs: list[Any]
    calls: list[tuple[Any, ...]]


def record(model: nn.Module, inputs: Sequence[tuple[Any, ...]], dynamic: bool | None) -> Recorded:
    """Compile ``model`` with a throwaway backend, call it on each inputs tuple, return the graph.

    All calls must land in one graph (``dynamic=True`` over several token counts).
    """
    graphs: list[Recorded] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        rec = Recorded(gm, list(example_inputs), [])
        graphs.append(rec)

        def run(*args: Any) -> Any:
            rec.calls.append(args)
            return gm(*args)

        return run

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    with torch.no_grad():
        for args in inputs:
            compiled(*args)
    assert len(graphs) == 1, f"expected one graph, Dynamo made {len(graphs)}"
    return graphs[0]


def on_fake_device(gm: torch.fx.GraphModule, host: Sequence[str] = ()) -> torch.fx.GraphModule:
    """``gm`` with every tensor value of its nodes' metadata (``example_value``, ``val``) moved to a
    fake CUDA device, but those of the nodes named in ``host``: what the capture analyses
    (:mod:`fxrewrite.runtime.hazards`) read of a graph traced on the GPU, on a CPU build of torch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        for n in gm.graph.nodes:
            for key in ("example_value", "val"):
                v = n.meta.get(key)
                if isinstance(v, torch.Tensor) and n.name not in host:
                    n.meta[key] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda:0")
    return gm


def toy_inputs(sizes: Sequence[int], device: str = "cpu", hidden: int = 32) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(n, hidden, generator=gen).to(device),) for n in sizes]


def llama_inputs(sizes: Sequence[int], device: str = "cpu") -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 128, (1, n), generator=gen).to(device),) for n in sizes]


def seeded(factory: Callable[[], nn.Module], device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return factory().to(device=device, dtype=dtype).eval()


def runner_for(rec: Recorded, **config: Any) -> Runner:
    config.setdefault("capture_sizes", CAPTURE_SIZES)
    return build_runner(rec.gm, rec.example_inputs, Config(progress=False, **config))


def args_for(runner: Runner, base: Sequence[Any], n: int, seed: int = 0, **named: torch.Tensor) -> tuple[Any, ...]:
    """The graph's arguments for ``n`` tokens: each token input random (ids below 128) or
    ``named[key]`` when ``key`` is in its name; every other input as in ``base``."""
    gen = torch.Generator().manual_seed(seed + n)
    args: list[Any] = []
    for i, (spec, like) in enumerate(zip(runner.dispatch.inputs, base)):
        given = next((t for key, t in named.items() if key in spec.name), None)
        if spec.kind == "sym":
            args.append(n)
        elif spec.kind == "token" and given is not None:
            args.append(given.to(like.device, like.dtype))
        elif spec.kind == "token":
            shape = runner.dispatch.expected_shape(i, n)
            fresh = torch.randn(shape, generator=gen) if like.is_floating_point() else torch.randint(
                0, 128, shape, generator=gen)
            args.append(fresh.to(like.device, like.dtype))
        else:
            args.append(like)
    return tuple(args)


def check_state_written_by_splitting_op(rec: Recorded, mode: str, device: str) -> Runner:
    """Capture leaves the KV caches alone; padded steps match eager outside the dummy slot 0."""
    runner = runner_for(rec, mode=mode, splitting_ops=("fxrtest::cache_attn",))
    caches = [i for i, spec in enumerate(runner.dispatch.inputs) if "cache" in spec.name]
    assert len(caches) == 2 and {runner.dispatch.inputs[i].kind for i in caches} == {"static"}
    base = rec.calls[0]
    before = [base[i].clone() for i in caches]
    runner.capture()  # warm-ups, captures (emulated on CPU) must not write the caches
    for i, saved in zip(caches, before):
        torch.testing.assert_close(base[i], saved, rtol=0, atol=0)
    reference = list(base)
    for i in caches:
        reference[i] = base[i].clone()
    start = 1  # slot 0: where padded rows write (zero padding), reserved as a dummy
    for n in (3, 8, 5, 16):
        args = args_for(runner, base, n, slots=torch.arange(start, start + n, device=device))
        start += n
        ref_args = [reference[i] if i in caches else a for i, a in enumerate(args)]
        torch.testing.assert_close(runner(*args), rec.gm(*ref_args))
        for i in caches:
            torch.testing.assert_close(base[i][1:], reference[i][1:])
    assert runner.stats()["padded_calls"] == 2
    return runner


def copy_all_case(device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Destinations and sources: three int64 pairs, two int32 pairs, a pair that converts int32
    -> int64, and one that converts float32 -> bf16 into a strided destination."""
    gen = torch.Generator().manual_seed(0)
    lengths, dtypes = (8, 5, 3, 8, 8, 4, 6), (torch.int64,) * 3 + (torch.int32,) * 2 + (torch.int64, torch.bfloat16)
    src_dtypes = dtypes[:5] + (torch.int32, torch.float32)
    dst = [torch.full((k,), -1, dtype=dt, device=device) for k, dt in zip(lengths[:6], dtypes)]
    dst.append(torch.full((6, 2), -1, dtype=torch.bfloat16, device=device)[:, 0])
    src = [torch.randint(0, 1000, (k,), generator=gen).to(dt).to(device) for k, dt in zip(lengths, src_dtypes)]
    return dst, src
