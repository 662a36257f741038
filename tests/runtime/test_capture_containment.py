"""Containment (fxrewrite.runtime.pieces, cudagraph.Runner): a piece that cannot be captured, a
capture that fails, a call the runner cannot serve: the call still returns eager's answer and the
stats name the piece, the op and its source line; ``Config(strict_capture=True)`` (the suite's
default, FXREWRITE_STRICT=1 in tests/conftest.py) raises instead. On CPU, where capture is emulated:
the failure is injected by an op that refuses to run while ``pieces.capturing()``, as a library
call that CUDA-graph capture refuses does."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fxrewrite.config import Config
from fxrewrite.runtime import pieces
from fxrewrite.runtime.dispatch import ShapeError
from fxrewrite.runtime.hazards import CaptureHazardError
from helpers.graphs import SDPA, Recorded, ToyAttention, record, runner_for, seeded, toy_inputs

FAIL_UP_TO = [8]  # fxrtest::fragile refuses capture at this many tokens and fewer
REFUSAL = "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"


@torch.library.custom_op("fxrtest::fragile", mutates_args=())
def fragile(x: torch.Tensor) -> torch.Tensor:
    if pieces.capturing() and x.shape[0] <= FAIL_UP_TO[0]:
        raise RuntimeError(REFUSAL)
    return x * 2


@fragile.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class FragileAttention(ToyAttention):
    """ToyAttention with fxrtest::fragile between its layers: in submod_2 (piecewise)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        for i, (qkv, o) in enumerate(zip(self.qkv, self.o)):
            q, k, v = qkv(x).view(t, 3, self.heads, h // self.heads).permute(1, 2, 0, 3).unbind(0)
            a = SDPA(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True)
            x = x + o(a.transpose(0, 1).reshape(t, h)).relu()
            if i == 0:
                x = torch.ops.fxrtest.fragile(x)  # the refused op
        return x


CALLS = (3, 8, 16, 5, 16)  # padded to 4 and 8 (refused there), 16 (captured)


@pytest.fixture(scope="module")
def fragile_rec() -> Recorded:
    return record(seeded(FragileAttention), toy_inputs(CALLS), dynamic=True)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_failed_capture_runs_that_piece_eagerly_and_says_where(fragile_rec: Recorded, mode: str) -> None:
    runner = runner_for(fragile_rec, mode=mode, strict_capture=False)
    for args in fragile_rec.calls:
        torch.testing.assert_close(runner(*args), fragile_rec.gm(*args))
    s = runner.stats()
    (failed,) = s["eager_pieces"]
    piece = "submod_2" if mode == "piecewise" else "submod_0"
    assert (failed["piece"], failed["op"], failed["sizes"]) == (piece, "call_function fragile", [8, 4])
    assert "test_capture_containment.py" in failed["source"] and "fxrtest.fragile(x)" in failed["source"]
    assert failed["reason"] == f"capture failed: RuntimeError: {REFUSAL}"
    # the graphs of size 16, captured before the failure, still replay; the piece runs eagerly at 4 and 8
    assert s["replays"] == 5 and s["eager_calls"] == 0 and s["eager_piece_calls"] == 3
    assert (s["graphs"], s["captured_pieces"]) == ((3 * 3 - 2, 2) if mode == "piecewise" else (1, 0))
    if mode == "piecewise":  # the piece after it copies its eager outputs in, as after attention
        assert s["activation_copies_last"] == 2


def test_a_failed_capture_raises_when_strict(fragile_rec: Recorded) -> None:
    runner = runner_for(fragile_rec, mode="piecewise", strict_capture=True)
    message = (r"(?s)capture of submod_2 failed in call_function fragile \(node fragile\) at "
               r"File .*test_capture_containment\.py.*fxrtest\.fragile\(x\).*" + REFUSAL[:20] + r".* \(at 8 tokens\)")
    with pytest.raises(RuntimeError, match=message):
        runner(*fragile_rec.calls[1])
    args = fragile_rec.calls[1]
    torch.testing.assert_close(runner(*args), fragile_rec.gm(*args))  # after the error: eager
    assert "capture failed" in runner.stats()["reason"]


def test_a_static_graph_says_its_static_shape_not_size_0() -> None:
    rec = record(seeded(FragileAttention), toy_inputs((6,)), dynamic=False)
    with pytest.raises(RuntimeError, match=r"capture of submod_0 failed .* \(at its static shape\)"):
        runner_for(rec, mode="full", strict_capture=True)(*rec.calls[0])
    runner = runner_for(rec, mode="full", strict_capture=False)
    torch.testing.assert_close(runner(*rec.calls[0]), rec.gm(*rec.calls[0]))
    assert runner.stats()["eager_pieces"][0]["sizes"] == [0]


def test_a_failure_outside_every_piece_runs_the_graph_eagerly(fragile_rec: Recorded,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    runner = runner_for(fragile_rec, mode="piecewise", strict_capture=False)

    def broken(*args: Any) -> Any:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(runner, "_buffer", broken)  # the static input buffers cannot be made
    args = fragile_rec.calls[1]
    torch.testing.assert_close(runner(*args), fragile_rec.gm(*args))
    s = runner.stats()
    assert s["reason"] == "capture failed: RuntimeError: out of memory" and s["eager_reasons"] == {"unsupported": 1}


# --- a capture CUDA invalidates: what torch leaves behind, and what pieces.capture_graph cleans up

class TorchCapture:
    """What ``CUDAGraph.capture_begin`` / ``capture_end`` do to the caching allocators' lists of
    captures underway in torch 2.11 and 2.13 (aten/src/ATen/cuda/CUDAGraph.cpp): begin adds the
    pool to the device allocator's list, then to the pinned-host allocator's, each refusing a
    pool already there; end removes it from both, unless ``cudaStreamEndCapture`` fails (CUDA
    invalidated the capture), where it raises first and leaves both. Python can end only the
    device allocator's entry (``torch._C._cuda_endAllocateToPool``)."""

    REFUSED = "CUDA error: operation not permitted when stream is capturing"

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.device: list[Any] = []
        self.host: list[Any] = []
        self.handles, self.invalidated = 0, False
        monkeypatch.setattr(torch.cuda, "CUDAGraph", self.graph)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", self.pool_handle)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", self.end_device, raising=False)
        monkeypatch.setattr(pieces, "_clear_cublas_workspaces", lambda: None)
        monkeypatch.setattr(pieces, "_ABANDONED", [])

    def pool_handle(self) -> tuple[int, int]:
        self.handles += 1
        return (0, self.handles)

    def end_device(self, device: int, pool: Any) -> None:
        if pool not in self.device:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.device.remove(pool)

    def graph(self) -> Any:
        fake = self

        class Graph:
            def capture_begin(self, pool: Any) -> None:
                for underway in (fake.device, fake.host):
                    if pool in underway:
                        raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
                    underway.append(pool)
                self.pool = pool

            def capture_end(self) -> None:
                if fake.invalidated:
                    fake.invalidated = False
                    raise RuntimeError(fake.REFUSED)
                fake.device.remove(self.pool)
                fake.host.remove(self.pool)

        return Graph()

    def refused(self, x: torch.Tensor) -> torch.Tensor:
        """An opaque op that syncs: CUDA invalidates the capture, the op raises."""
        self.invalidated = True
        raise RuntimeError(self.REFUSED)


def test_after_a_capture_cuda_refuses_later_captures_take_a_fresh_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = TorchCapture(monkeypatch)
    owner = SimpleNamespace(_pool=fake.pool_handle())
    owner._pools = [owner._pool]
    x = torch.ones(3)
    outputs, _ = pieces.capture_graph(lambda t: t * 2, [x], owner)
    assert torch.equal(outputs, x * 2) and fake.device == fake.host == []
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):  # the op's error
        pieces.capture_graph(fake.refused, [x], owner)
    for _ in range(2):  # every later capture works, in a fresh pool
        pieces.capture_graph(lambda t: t + 1, [x], owner)
    assert owner._pools == [(0, 1), (0, 2)] and owner._pool == (0, 2)
    # the device allocator's entry ended; the host allocator's stays, and the graph its filter reads too
    assert fake.device == [] and fake.host == [(0, 1)] and len(pieces._ABANDONED) == 1


def test_a_capture_begin_that_stops_halfway_is_cleaned_up_too(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = TorchCapture(monkeypatch)
    owner = SimpleNamespace(_pool=fake.pool_handle())
    owner._pools = [owner._pool]
    fake.host.append(owner._pool)  # the host allocator still records to the pool: begin routes the device one, then raises
    with pytest.raises(RuntimeError, match="already recording"):
        pieces.capture_graph(lambda t: t, [torch.ones(1)], owner)
    assert fake.device == [] and owner._pool == (0, 2)
    pieces.capture_graph(lambda t: t, [torch.ones(1)], owner)


def test_without_the_cleanup_torch_refuses_every_later_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure the H100 showed (torch 2.11): ending the device allocator's entry alone, as the
    runner did, leaves the pool unusable; the model above must reproduce it."""
    fake = TorchCapture(monkeypatch)
    pool = fake.pool_handle()
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool)
    fake.invalidated = True
    with pytest.raises(RuntimeError, match="not permitted"):
        graph.capture_end()
    fake.end_device(0, pool)
    with pytest.raises(RuntimeError, match="beginAllocateToPool: already recording to mempool_id"):
        torch.cuda.CUDAGraph().capture_begin(pool=pool)


# --- hazards found before capture

class ItemInTheMiddle(torch.nn.Module):
    """A host read (``.item()`` of a device value) in the piece between two attentions."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x @ self.w
        h = SDPA(x[None], x[None], x[None], is_causal=True)[0] @ self.w
        h = h * h.abs().amax().item()  # the hazard
        return SDPA(h[None], h[None], h[None], is_causal=True)[0] @ self.w + 1


@pytest.fixture(scope="module")
def item_rec() -> Recorded:
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        return record(seeded(ItemInTheMiddle), [(torch.randn(n, 8),) for n in (5, 8)], dynamic=True)


def test_a_piece_with_a_hazard_runs_eagerly_and_the_others_are_captured(item_rec: Recorded) -> None:
    runner = runner_for(item_rec, mode="piecewise", strict_capture=False)
    for args in item_rec.calls:
        # 5 rows replay padded to 8: the CPU GEMMs of the padded call may block the sums otherwise
        # (a few float32 ulps, which the amax multiplies: 2.6e-6 relative seen on one CPU)
        torch.testing.assert_close(runner(*args), item_rec.gm(*args), rtol=1e-5, atol=1e-5)
    s = runner.stats()
    hazards = s["eager_pieces"]
    assert {h["piece"] for h in hazards} == {"submod_2"} and hazards[0]["sizes"] == "all"
    assert any(h["op"] == "call_method item" and ".item()" in h["source"] for h in hazards)
    assert s["captured_pieces"] == 2 and s["replays"] == 2 and not s["reason"]


def test_a_hazard_raises_when_strict_and_full_mode_runs_eagerly_otherwise(item_rec: Recorded) -> None:
    with pytest.raises(CaptureHazardError, match=r"(?s)call_method item.*\.item\(\)"):
        runner_for(item_rec, mode="piecewise", strict_capture=True)
    runner = runner_for(item_rec, mode="full", strict_capture=False)
    torch.testing.assert_close(runner(*item_rec.calls[1]), item_rec.gm(*item_rec.calls[1]))
    s = runner.stats()
    assert s["reason"] == "no piece can be captured (eager_pieces says why)" and s["captured_pieces"] == 0
    assert s["eager_reasons"] == {"unsupported": 1} and s["eager_pieces"][0]["piece"] == "submod_0"


# --- calls the runner cannot serve

def test_a_call_the_runner_cannot_serve_runs_eagerly_unless_strict(fragile_rec: Recorded) -> None:
    """One token: below the range Dynamo compiled the graph for (s0 >= 2), no buffer fits it, but
    the graph's code runs it. Strict, a ShapeError."""
    def one_token(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return torch.randn(1, 32) if a.shape == (3, 32) else a
        return 1 if a == 3 else a

    one = tuple(map(one_token, fragile_rec.calls[0]))
    runner = runner_for(fragile_rec, mode="piecewise", strict_capture=False)
    torch.testing.assert_close(runner(*one), fragile_rec.gm(*one))
    assert runner.stats()["eager_reasons"] == {"shape_mismatch": 1}
    with pytest.raises(ShapeError, match="outside the range"):
        runner_for(fragile_rec, mode="piecewise", strict_capture=True)(*one)


def test_a_call_the_graph_cannot_run_either_is_a_shape_error() -> None:
    rec = record(seeded(lambda: ToyAttention(layers=1)), toy_inputs((6,)), dynamic=False)
    other = tuple(torch.randn(7, 32) if isinstance(a, torch.Tensor) and a.shape == (6, 32) else a for a in rec.calls[0])
    runner = runner_for(rec, mode="piecewise", strict_capture=False)
    with pytest.raises(ShapeError, match=r"expected shape \(6, 32\)") as info:
        runner(*other)
    assert "invalid for input of size" in str(info.value.__cause__)  # the static graph's own view


def test_a_changed_value_a_graph_froze_runs_that_piece_eagerly(fragile_rec: Recorded) -> None:
    """A non-tensor input a piece's graph froze at capture (a SymInt from an eager piece) differs:
    the piece runs eagerly and writes where its replay would have, for the pieces after it."""
    FAIL_UP_TO[0] = 0
    try:
        runner = runner_for(fragile_rec, mode="piecewise", strict_capture=False)
        args = fragile_rec.calls[1]  # 8 tokens
        runner(*args)
    finally:
        FAIL_UP_TO[0] = 8
    piece = runner._pieces[1]
    static, copied = piece._graphs[8][0], piece._graphs[8][1]
    k = next(i for i, a in enumerate(static) if isinstance(a, int))  # the token count, frozen at 8
    static[k] = 7
    copied.append(k)
    torch.testing.assert_close(runner(*args), fragile_rec.gm(*args))
    assert runner.stats()["piece_input_changed"] == 1
    runner.strict = True
    with pytest.raises(ShapeError, match=r"was 7 at capture, now 8"):
        runner(*args)


def test_the_report_names_each_piece_run_eagerly(fragile_rec: Recorded) -> None:
    from fxrewrite.report import GraphReport, Report

    runner = runner_for(fragile_rec, mode="piecewise", strict_capture=False)
    runner(*fragile_rec.calls[1])
    report = Report(graphs=[GraphReport(runtime=runner.stats())])
    (line,) = [ln for ln in report.table().splitlines() if ln.startswith("runs eagerly")]
    assert line.startswith("runs eagerly at sizes 8, 4: submod_2, call_function fragile at File ")
    assert line.endswith(f"capture failed: RuntimeError: {REFUSAL}") and "fxrtest.fragile(x)" in line


def test_strict_capture_follows_strict_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FXREWRITE_STRICT", raising=False)
    assert not Config().resolved().strict_capture and Config(strict=True).resolved().strict_capture
    assert not Config(strict=True, strict_capture=False).resolved().strict_capture
    monkeypatch.setenv("FXREWRITE_STRICT", "1")  # what the suite sets (tests/conftest.py)
    assert Config().resolved().strict_capture and not Config(strict_capture=False).resolved().strict_capture
