"""Runner dispatch, padding, copies and fallbacks, on CPU (pieces emulated, no CUDA graph).

On CPU the Runner runs the same dispatch, static buffers and copy accounting as on CUDA, with
each captured piece replaced by an eager run writing into fixed output tensors; the GPU twin
of these tests is tests/runtime/test_cudagraph_gpu.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fxrewrite.config import Config
from fxrewrite.runtime.cudagraph import Runner, build_runner, copy_all
from fxrewrite.runtime.dispatch import Dispatch, ShapeError, check_capture_sizes, pad_zeros, select_size
from fxrewrite.runtime.hazards import CaptureHazardError
from helpers.graphs import (
    CAPTURE_SIZES,
    SDPA,
    CachedAttention,
    Recorded,
    TinyLlama,
    ToyAttention,
    args_for,
    check_state_written_by_splitting_op,
    copy_all_case,
    llama_inputs,
    record,
    runner_for,
    seeded,
    toy_inputs,
)

TOY_CALLS = (3, 4, 5, 8, 9, 16, 17)  # padded, exact, padded, exact, padded, exact, beyond


def tokens(args: tuple[Any, ...]) -> int:
    return next(a for a in args if isinstance(a, int))


@pytest.fixture(scope="module")
def toy() -> Recorded:
    return record(seeded(ToyAttention), toy_inputs(TOY_CALLS), dynamic=True)


@pytest.fixture(scope="module")
def toy_out() -> Recorded:
    return record(seeded(lambda: ToyAttention("custom_out")), toy_inputs((8, 5)), dynamic=True)


@pytest.fixture(scope="module")
def toy_custom() -> Recorded:
    return record(seeded(lambda: ToyAttention("custom")), toy_inputs((8, 5)), dynamic=True)


@pytest.fixture(scope="module")
def llama() -> Recorded:
    pytest.importorskip("transformers")
    return record(seeded(TinyLlama), llama_inputs((3, 8, 9)), dynamic=True)


@pytest.mark.parametrize(("n", "pad", "size"), [
    (1, True, 4), (4, True, 4), (5, True, 8), (16, True, 16), (17, True, None),
    (4, False, 4), (5, False, None), (17, False, None),
])
def test_select_size(n: int, pad: bool, size: int | None) -> None:
    assert select_size(n, CAPTURE_SIZES, pad) == size


@pytest.mark.parametrize(("sizes", "says"), [
    ((), r"capture_sizes is empty"),
    ((8, 4, 16), r"capture_sizes must be in increasing order: \(8, 4, 16\)"),
    ((4, 4), r"increasing order"),
    ((0, 4), r"positive integers"),
    ((8, 1024), r"capture size 1024 is above max_capture_size 512"),
])
def test_bad_capture_sizes_are_refused(toy: Recorded, sizes: tuple[int, ...], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        check_capture_sizes(Config(capture_sizes=sizes))
    with pytest.raises(ValueError, match=says):
        runner_for(toy, mode="piecewise", capture_sizes=sizes)
    assert check_capture_sizes(Config(max_capture_size=64))[-1] == 64  # the default list


def test_dispatch_classifies_llama_inputs(llama: Recorded) -> None:
    used = set(range(len(llama.example_inputs)))
    d = Dispatch(llama.gm, llama.example_inputs, used, CAPTURE_SIZES, pad=True, on_cuda=False)
    kinds = {s.kind for s in d.inputs}
    assert kinds == {"sym", "token", "static", "host"} and d.reason is None
    (token,) = [s for s in d.inputs if s.kind == "token"]
    assert "input_ids" in token.name and token.token_dims == (1,)
    assert d.lo == 2 and d.sizes == CAPTURE_SIZES  # Dynamo compiles s0 >= 2: sizes 0 and 1 are not captured
    args = llama.calls[1]
    assert d.token_count(args) == 8 and d.select(3) == 4 and d.select(17) is None
    d.check(args, 8)
    i = next(i for i, s in enumerate(d.inputs) if s.kind == "token")
    assert d.expected_shape(i, 5) == (1, 5)
    with pytest.raises(ShapeError, match=r"expected shape \(1, 9\).*got \(1, 8\)"):
        d.check(args, 9)
    with pytest.raises(ShapeError, match="outside the range"):
        d.check(args, 1)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_toy_outputs_match_eager_for_every_size(toy: Recorded, mode: str) -> None:
    runner = runner_for(toy, mode=mode)
    for args in toy.calls:
        torch.testing.assert_close(runner(*args), toy.gm(*args))
    s = runner.stats()
    assert s["mode"] == mode and s["device"] == "cpu" and not s["cudagraphs"] and s["captured"]
    assert s["capture_sizes"] == list(CAPTURE_SIZES) and s["graphs"] == s["captured_pieces"] * len(CAPTURE_SIZES)
    assert (s["calls"], s["replays"], s["padded_calls"], s["eager_calls"]) == (7, 6, 3, 1)
    assert s["eager_reasons"] == {"beyond_max": 1}
    assert s["pieces"] == (5 if mode == "piecewise" else 1) and s["splitting_pieces"] == (2 if mode == "piecewise" else 0)
    # one captured piece is called directly, several through the split module's forward
    assert (runner._forward == runner.module.forward) == (mode == "piecewise")


@pytest.mark.parametrize("mode", ["piecewise", "full"])
@pytest.mark.parametrize("op", ["attn", "attn_out"])
def test_custom_attention_ops(toy_custom: Recorded, toy_out: Recorded, op: str, mode: str) -> None:
    rec = toy_custom if op == "attn" else toy_out
    runner = runner_for(rec, mode=mode, splitting_ops=(f"fxrtest::{op}",))
    for args in rec.calls:
        torch.testing.assert_close(runner(*args), rec.gm(*args))
    s = runner.stats()
    assert s["replays"] == 2 and s["splitting_pieces"] == (2 if mode == "piecewise" else 0)


def test_through_torch_compile() -> None:
    runners: list[Runner] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Runner:
        runners.append(build_runner(gm, example_inputs, Config(mode="piecewise", capture_sizes=CAPTURE_SIZES,
                                                              progress=False)))
        return runners[-1]

    model = seeded(ToyAttention)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for (x,) in toy_inputs((8, 5, 16, 40)):
            torch.testing.assert_close(compiled(x), model(x))
    assert len(runners) == 1 and runners[0].stats()["replays"] == 3 and runners[0].stats()["eager_calls"] == 1


def test_an_output_viewing_a_parameter_outside_no_grad() -> None:
    """Outputs are cloned out of the static buffers without autograd, as the replay runs: a
    view of a parameter among them (made under no_grad) must not trip autograd's view checks."""
    w = torch.nn.Parameter(torch.randn(5, 8))
    fn = lambda x: (F.linear(x, w), w.t())  # noqa: E731
    torch._dynamo.reset()
    runners: list[Runner] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Runner:
        runners.append(build_runner(gm, example_inputs, Config(mode="full", capture_sizes=(4,), progress=False)))
        return runners[-1]

    x = torch.randn(3, 8)
    out = torch.compile(fn, backend=backend, fullgraph=True)(x)
    with torch.no_grad():
        for got, want in zip(out, fn(x)):
            torch.testing.assert_close(got, want)
    assert runners[0].stats()["replays"] == 1 and not out[1].requires_grad  # inference only


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_state_written_by_splitting_op(mode: str) -> None:
    rec = record(seeded(CachedAttention), [(x, torch.arange(1, 9)) for (x,) in toy_inputs((8,))], dynamic=True)
    runner = check_state_written_by_splitting_op(rec, mode, "cpu")
    # full mode: the one captured piece writes the caches; its warm-up wrote scratch, nothing saved
    assert runner.stats()["capture_saved_bytes"] == 0


def test_copies_per_step(toy: Recorded, toy_out: Recorded) -> None:
    sdpa = runner_for(toy, mode="piecewise")
    sdpa(*toy.calls[3])  # 8 tokens
    s = sdpa.stats()  # x copied in; each attention output copied into the next piece's buffer
    assert (s["static_input_copies_last"], s["activation_copies_last"]) == (1, 2)
    full = runner_for(toy, mode="full")
    full(*toy.calls[3])
    assert (full.stats()["static_input_copies_last"], full.stats()["activation_copies_last"]) == (1, 0)
    out = runner_for(toy_out, mode="piecewise", splitting_ops=("fxrtest::attn_out",))
    for args in toy_out.calls:
        torch.testing.assert_close(out(*args), toy_out.gm(*args))
    s = out.stats()  # the op writes into a buffer allocated by the piece before: nothing to copy
    assert s["splitting_pieces"] == 2 and s["activation_copies"] == 0 and s["replays"] == 2


def test_copy_all_copies_every_pair() -> None:
    dst, src = copy_all_case("cpu")
    copy_all(dst, src)
    for d, s in zip(dst, src):
        assert torch.equal(d, s.to(d.dtype))
    copy_all([], [])  # nothing to copy: no error


def test_engine_writing_into_static_inputs_makes_no_copy(toy: Recorded) -> None:
    runner = runner_for(toy, mode="piecewise")
    args = toy.calls[0]  # 3 tokens, padded to 4
    runner(*args)
    i = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[0] == 3)
    buf = runner.static_inputs(3)[i]
    assert buf.shape == (4, 32) and bool((buf[3] == 0).all())  # zero padding
    buf[:3].copy_(args[i])
    out = runner(*args[:i], buf[:3], *args[i + 1:])
    torch.testing.assert_close(out, toy.gm(*args))
    assert runner.stats()["static_input_copies_last"] == 0


def test_padding_rows_are_zeroed_again_after_a_longer_call(toy: Recorded) -> None:
    runner = runner_for(toy, mode="full")
    by_n = {tokens(a): a for a in toy.calls}
    runner(*by_n[8])
    runner(*by_n[5])  # same size 8: rows 5..7 held the previous input
    i = next(i for i, a in enumerate(by_n[5]) if isinstance(a, torch.Tensor) and a.shape[0] == 5)
    assert bool((runner.static_inputs(5)[i][5:] == 0).all())
    square = torch.ones(4, 4)
    pad_zeros(square, (0, 1), 2)  # an input with the token count in two dims
    assert square.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_exact_sizes_without_padding(toy: Recorded) -> None:
    runner = runner_for(toy, mode="piecewise", pad_inputs=False)
    for args in toy.calls:
        torch.testing.assert_close(runner(*args), toy.gm(*args))
    s = runner.stats()
    assert not s["pad_inputs"] and s["replays"] == 3 and s["padded_calls"] == 0
    assert s["eager_reasons"] == {"not_captured": 3, "beyond_max": 1}


def test_outputs_survive_the_next_call(toy: Recorded) -> None:
    runner = runner_for(toy, mode="piecewise")
    by_n = {tokens(a): a for a in toy.calls}
    first = runner(*by_n[8])
    runner(*by_n[5])  # replays size 8 again
    torch.testing.assert_close(first, toy.gm(*by_n[8]))


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_llama_outputs_match_eager(llama: Recorded, mode: str) -> None:
    runner = runner_for(llama, mode=mode)
    for args in llama.calls:
        torch.testing.assert_close(runner(*args), llama.gm(*args))
    s = runner.stats()
    assert s["replays"] == 3 and s["padded_calls"] == 2 and s["missing_splitting_ops"] == []
    assert s["activation_copies_last"] == (2 if mode == "piecewise" else 0)
    assert (runner._forward == runner.module.forward) == (mode == "piecewise")


def test_llama_host_scalar_change_runs_eagerly(llama: Recorded) -> None:
    runner = runner_for(llama, mode="piecewise")
    args = list(llama.calls[1])
    host = next(i for i, s in enumerate(runner.dispatch.inputs) if s.kind == "host" and "epsilon" in s.name)
    args[host] = torch.tensor(0.5)
    torch.testing.assert_close(runner(*args), llama.gm(*args))
    assert runner.stats()["eager_reasons"] == {"host_scalar_changed": 1}


class KeepsLast(ToyAttention):
    """An int argument that slices the output rows, as transformers' ``logits_to_keep`` (0: every
    row): where ``forward`` is Dynamo's frame (Falcon's) it is a SymInt input of its own, a second
    symbol next to the token count that sizes no input tensor."""

    def forward(self, x: torch.Tensor, keep: int = 0) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[-keep:] + keep


@pytest.fixture(scope="module")
def keeps() -> Recorded:
    return record(seeded(KeepsLast), toy_inputs((8, 5, 16)), dynamic=True)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_an_int_input_is_a_value_frozen_at_capture_not_a_second_dim(keeps: Recorded, mode: str) -> None:
    runner = runner_for(keeps, mode=mode)
    (keep,) = [i for i, v in enumerate(keeps.example_inputs) if isinstance(v, torch.SymInt) and i > 0]
    assert runner.dispatch.inputs[keep].kind == "host" and not runner.dispatch.reason and runner.dispatch.pad
    for args in keeps.calls:
        torch.testing.assert_close(runner(*args), keeps.gm(*args))
    s = runner.stats()
    assert (s["replays"], s["padded_calls"], s["eager_calls"]) == (3, 1, 0)
    # another value than the one captured: that call runs eagerly, with the right answer
    args = list(keeps.calls[0])
    args[keep] = 3
    torch.testing.assert_close(runner(*args), keeps.gm(*args))
    assert runner.stats()["eager_reasons"] == {"host_scalar_changed": 1}


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_an_int_input_of_a_graph_of_static_shapes_is_a_value_not_the_token_count(mode: str) -> None:
    """Tensors of static shapes (a model that specializes its sequence, as transformers' CPM-Ant)
    and an int slicing the output rows from the end: the int sizes no input, so it is a value
    frozen at capture and the graph has one graph, of its static shape. Taken for the token count,
    a call was padded to the next capture size and its rows sliced from the front: wrong rows (or,
    where Dynamo's range of it held no capture size, CPM-Ant's [-9, 0], no graph at all)."""
    x = torch.randn(8, 32)
    torch._dynamo.mark_static(x)
    rec = record(seeded(KeepsLast), [(x, 2), (x, 3)], dynamic=True)
    runner = runner_for(rec, mode=mode)
    d = runner.dispatch
    assert d.symbol is None and d.reason is None
    assert [s.kind for s in d.inputs if s.kind != "static"] == ["tensor", "host"]
    for args in rec.calls:
        torch.testing.assert_close(runner(*args), rec.gm(*args))
    s = runner.stats()
    assert s["static_shape"] and (s["replays"], s["eager_reasons"]) == (1, {"host_scalar_changed": 1})


class MaskedAttention(torch.nn.Module):
    """A causal mask built in the first piece and broadcast to every head (stride 0, as
    transformers expands its mask over the batch), read by attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        i = torch.arange(t, device=x.device)
        mask = (i[:, None] >= i[None, :]).expand(4, t, t)
        q = self.qkv(x).view(t, 4, 8).transpose(0, 1)
        return self.o(SDPA(q, q, q, attn_mask=mask).transpose(0, 1).reshape(t, 32))


def test_a_broadcast_output_of_a_captured_piece_replays() -> None:
    """On CPU a replay copies the piece's results into its fixed outputs: a broadcast one takes
    one row per broadcast dim (``copy_`` refuses to write overlapping elements)."""
    rec = record(seeded(MaskedAttention), toy_inputs((8, 5, 16)), dynamic=True)
    runner = runner_for(rec, mode="piecewise")
    for args in rec.calls * 2:
        torch.testing.assert_close(runner(*args), rec.gm(*args))
    mask = next(o for o in runner._pieces[0]._graphs[8][2] if o.dtype == torch.bool)
    assert mask.stride(0) == 0 and runner.stats()["replays"] == 6


def test_static_inputs_are_not_copied_and_moves_are_caught(llama: Recorded) -> None:
    runner = runner_for(llama, mode="full")
    args = list(llama.calls[1])
    runner(*args)
    static = [i for i, s in enumerate(runner.dispatch.inputs) if s.kind == "static"]
    assert len(static) > 10 and runner.stats()["static_input_copies_last"] == 1  # only input_ids
    args[static[0]] = args[static[0]].detach()  # a new tensor object, same memory: adopted
    runner(*args)
    assert runner.stats()["eager_calls"] == 0
    args[static[0]] = args[static[0]].clone()  # another address: the graph would read stale weights
    torch.testing.assert_close(runner(*args), llama.gm(*args))
    assert runner.stats()["eager_reasons"] == {"static_input_moved": 1}


def test_static_shape_graph_has_one_size_and_rejects_other_shapes() -> None:
    rec = record(seeded(ToyAttention), toy_inputs((6,)), dynamic=False)
    runner = runner_for(rec, mode="piecewise")
    args = rec.calls[0]
    torch.testing.assert_close(runner(*args), rec.gm(*args))
    s = runner.stats()
    assert s["static_shape"] and s["capture_sizes"] == [] and s["graphs"] == 3 and s["replays"] == 1
    other = [torch.randn(7, 32) if isinstance(a, torch.Tensor) and a.shape == (6, 32) else a for a in args]
    with pytest.raises(ShapeError, match=r"expected shape \(6, 32\).*got \(7, 32\)"):
        runner(*other)
    with pytest.raises(ShapeError, match="expected .* inputs"):
        runner(*args[:-1])


def test_input_written_in_place_is_copied_back() -> None:
    class DoubleInPlace(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2)
            return x @ self.w

    rec = record(seeded(DoubleInPlace), [(torch.randn(n, 4),) for n in (5, 8)], dynamic=True)
    runner = runner_for(rec, mode="full")
    args = [a.clone() if type(a) is torch.Tensor else a for a in rec.calls[0]]  # x, not the weight
    expected = [a.clone() if type(a) is torch.Tensor else a for a in rec.calls[0]]
    torch.testing.assert_close(runner(*args), rec.gm(*expected))
    torch.testing.assert_close(args, expected)  # the input was doubled, as in eager
    s = runner.stats()
    assert s["replays"] == 1 and s["padded_calls"] == 1 and s["static_input_copies_last"] == 2  # in, and back


class CountingAttention(torch.nn.Module):
    """A buffer written before the split (a captured piece that is not the last one writes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(4))
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.sum(0))
        h = F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None])[0, 0]
        return (h + self.seen) @ self.w


def test_buffer_written_by_a_piece_replayed_at_capture_is_saved_and_restored() -> None:
    model = seeded(CountingAttention)
    rec = record(model, [(torch.randn(n, 4),) for n in (5, 8)], dynamic=True)
    runner = runner_for(rec, mode="piecewise")
    seen = next(a for a in rec.calls[0] if isinstance(a, torch.Tensor) and a.shape == (4,))
    seen.zero_()
    runner.capture()  # piece 0 writes `seen` in its warm-up (scratch) and its replay (restored)
    assert torch.equal(seen, torch.zeros(4)) and runner.stats()["capture_saved_bytes"] == 4 * 4
    args = args_for(runner, rec.calls[0], 8)  # a capture size: no padding (this attention is not causal)
    x = next(a for a, spec in zip(args, runner.dispatch.inputs) if spec.kind == "token")
    expected = rec.gm(*[a.clone() if a is seen else a for a in args])
    torch.testing.assert_close(runner(*args), expected)
    torch.testing.assert_close(seen, x.sum(0))


def test_several_dynamic_dims_run_eagerly_with_a_reason() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x.sum(0) + y.sum(0)).relu()

    rec = record(f, [(torch.randn(5, 4), torch.randn(7, 4))], dynamic=True)
    runner = runner_for(rec, mode="full")
    args = rec.calls[0]
    torch.testing.assert_close(runner(*args), rec.gm(*args))
    s = runner.stats()
    assert "dynamic dimensions" in s["reason"] and s["eager_reasons"] == {"unsupported": 1}


def test_hazard_in_a_captured_piece_fails_at_build() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * x.amax().item()).relu()

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        rec = record(f, [(torch.randn(6),)], dynamic=False)
    with pytest.raises(CaptureHazardError, match=r"(?s)call_method item.*x\.amax\(\)\.item\(\)"):
        runner_for(rec, mode="full")
    assert runner_for(rec, mode="none").stats()["mode"] == "none"


def test_failed_capture_raises_then_runs_eagerly(toy: Recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = runner_for(toy, mode="piecewise")

    def broken(args: Any, size: int) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner._pieces[1], "_capture", broken)
    args = toy.calls[3]
    with pytest.raises(RuntimeError, match="not permitted"):
        runner(*args)
    torch.testing.assert_close(runner(*args), toy.gm(*args))
    s = runner.stats()
    assert "capture failed" in s["reason"] and s["eager_reasons"] == {"unsupported": 1}


def test_graph_without_metadata_runs_with_static_shapes(caplog: pytest.LogCaptureFixture) -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w
        return SDPA(h, h, h) @ w

    gm = torch.fx.symbolic_trace(f)  # no example values: shapes come from the example inputs
    args = (torch.randn(2, 8, 16), torch.randn(16, 16))
    runner = build_runner(gm, list(args), Config(mode="piecewise", progress=False))
    torch.testing.assert_close(runner(*args), f(*args))
    s = runner.stats()
    assert s["static_shape"] and s["splitting_pieces"] == 1 and s["replays"] == 1
    assert s["static_input_copies_last"] == 2  # plain tensors, not parameters: copied into buffers
    assert "runs for real during capture" in caplog.text  # no metadata to fake the attention output
    with pytest.raises(ShapeError, match=r"expected shape \(2, 8, 16\)"):
        runner(torch.randn(2, 9, 16), args[1])


def test_mode_none_is_the_graph_itself(toy: Recorded) -> None:
    runner = runner_for(toy, mode="none")
    args = toy.calls[0]
    torch.testing.assert_close(runner(*args), toy.gm(*args))
    s = runner.stats()
    assert s["mode"] == "none" and not s["cudagraphs"] and s["replays"] == 0
    with pytest.raises(ValueError, match="unknown mode"):
        runner_for(toy, mode="bogus")


def test_progress_bar_on_stderr(toy: Recorded, capsys: pytest.CaptureFixture[str]) -> None:
    runner = build_runner(toy.gm, toy.example_inputs, Config(mode="full", capture_sizes=CAPTURE_SIZES))
    runner.capture()
    assert "emulating CUDA graphs" in capsys.readouterr().err
    assert runner.stats()["capture_s"] > 0
