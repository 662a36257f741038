"""Issue 34 on the GPU: the two spellings that kept Falcon and gpt-oss from CUDA graphs are captured
(not merely contained), and a capture that CUDA itself refuses is contained without leaving the
allocator or the stream in a state that breaks later captures.

Run: ``python -m pytest -q -m gpu tests/runtime/test_capture_containment_gpu.py`` (skipped without CUDA).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fxrewrite
from helpers.graphs import SDPA, TinyLlama, ToyAttention, llama_inputs, record, runner_for, seeded, toy_inputs
from test_fold_constants import MultiQuery, eager_mask_517, eager_mask_524

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def compiled(fn: Any, mode: str, dynamic: bool | None = True) -> tuple[Any, fxrewrite.Backend]:
    torch._dynamo.reset()
    backend = fxrewrite.Backend(mode=mode, capture_sizes=(4, 8, 16), progress=False)  # strict: FXREWRITE_STRICT=1
    return backend.compile(fn, dynamic=dynamic), backend


def runtime(backend: fxrewrite.Backend) -> dict[str, Any]:
    backend.refresh_runtime()
    (stats,) = [g.runtime for g in backend.report.graphs]
    return stats


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_falcon_list_indices_are_captured(mode: str) -> None:
    model = MultiQuery().cuda().to(torch.bfloat16)
    step, backend = compiled(model, mode)
    with torch.no_grad():
        for n in (5, 8, 13):
            x = torch.randn(1, n, 32, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(step(x), model(x), rtol=2e-2, atol=2e-2)
    s = runtime(backend)
    assert s["cudagraphs"] and s["eager_pieces"] == [] and s["replays"] == 3 and s["eager_calls"] == 0


@pytest.mark.parametrize("mask", [eager_mask_517, eager_mask_524], ids=["transformers_5.17", "transformers_5.24"])
def test_gpt_oss_eager_mask_is_captured(mask: Any) -> None:
    def f(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return mask(x, m).softmax(-1)

    # only the token dim is dynamic, as a serving engine marks it: under dynamic=True the scores'
    # last dim (8) would be a second symbol, and the runner cannot know that it never varies
    step, backend = compiled(f, "full", dynamic=None)
    with torch.no_grad():
        for n in (6, 16):
            x, m = torch.randn(n, 8, device="cuda"), torch.rand(n, 8, device="cuda") > 0.3
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(m, 0)
            torch.testing.assert_close(step(x, m), f(x, m))
    s = runtime(backend)
    assert len(backend.report.graphs) == 1 and s["cudagraphs"] and s["eager_pieces"] == [] and s["replays"] == 2


@torch.library.custom_op("fxrtest::host_roundtrip", mutates_args=())
def host_roundtrip(x: torch.Tensor, sync: bool) -> torch.Tensor:
    """What the hazard check cannot see into: torch refuses the pageable copy during capture (it
    raises before CUDA sees it); CUDA refuses the sync (it invalidates the capture)."""
    if sync:
        torch.cuda.synchronize()
        return x * 2
    return x.cpu().to(x.device) * 2


@host_roundtrip.register_fake
def _(x: torch.Tensor, sync: bool) -> torch.Tensor:
    return torch.empty_like(x)


class Roundtrip(ToyAttention):
    def __init__(self, sync: bool) -> None:
        super().__init__()
        self.sync = sync

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        for i, (qkv, o) in enumerate(zip(self.qkv, self.o)):
            q, k, v = qkv(x).view(t, 3, self.heads, h // self.heads).permute(1, 2, 0, 3).unbind(0)
            x = x + o(SDPA(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True).transpose(0, 1).reshape(t, h))
            if i == 0:
                x = torch.ops.fxrtest.host_roundtrip(x, self.sync)
        return x


@pytest.mark.parametrize("sync", [False, True], ids=["pageable_copy", "sync"])
def test_a_refused_capture_is_contained_and_later_captures_work(sync: bool) -> None:
    rec = record(seeded(lambda: Roundtrip(sync), "cuda"), toy_inputs((8, 5, 16), "cuda"), dynamic=True)
    runner = runner_for(rec, mode="piecewise", strict_capture=False)
    for args in rec.calls:
        torch.testing.assert_close(runner(*args), rec.gm(*args), rtol=1e-4, atol=1e-4)
    s = runner.stats()
    (failed,) = s["eager_pieces"]  # only the refused piece: every capture after it works
    assert failed["piece"] == "submod_2" and failed["op"] == "call_function host_roundtrip"
    assert failed["sizes"] == [16, 8, 4] and s["captured_pieces"] == 2 and s["graphs"] == 2 * 3
    assert s["replays"] == 3 and s["eager_calls"] == 0 and s["eager_piece_calls"] == 3
    # CUDA refusing the capture (a sync) leaves torch's allocators recording to the pool: the
    # later captures go to a fresh one (pieces.abandon_pool); a copy torch refuses ends cleanly
    assert s["pools"] == (2 if sync else 1)
    # the stream left capture mode and the allocator serves it from its own memory again; the
    # CUDA generator left it too: eager random numbers (a sampler's) are drawn as before
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.rand(4, device="cuda").shape == (4,)
    llama = record(seeded(TinyLlama, "cuda"), llama_inputs((8,), "cuda"), dynamic=True)
    other = runner_for(llama, mode="piecewise")
    torch.testing.assert_close(other(*llama.calls[0]), llama.gm(*llama.calls[0]), rtol=1e-4, atol=1e-4)
    assert other.stats()["cudagraphs"] and other.stats()["eager_pieces"] == []
    with pytest.raises(RuntimeError, match=r"capture of submod_2 failed in call_function host_roundtrip"):
        runner_for(rec, mode="piecewise", strict_capture=True)(*rec.calls[0])
