"""The pieces of a split graph under the CUDA-graph runner: captured per size and replayed, or run
eagerly; a capture that fails is contained here.

:mod:`fxrewrite.runtime.cudagraph` puts a stand-in in the split module for every piece that runs
(``Runner.module``): a :class:`CapturedPiece` for a piece it captures, an :class:`EagerPiece` for
a splitting piece (attention) or one it does not capture (a capture hazard,
:mod:`fxrewrite.runtime.hazards`). The split module's forward calls them in order::

    split module: submod_0 (CapturedPiece) -> submod_1 (EagerPiece: sdpa) -> submod_2 (CapturedPiece)

A capture that raises (an op that the hazard check did not see, a library that refuses stream
capture) does not reach the caller unless ``Config.strict_capture`` (env ``FXREWRITE_STRICT=1``) is
on: the piece runs eagerly at that size and at every size captured after it (capture goes from the
largest size down), a :class:`CaptureFailure` names the piece, the op that raised and its source
line, and the pieces captured after it copy its outputs in as they copy attention's. Sizes captured
before the failure keep their graphs. A capture that CUDA itself invalidates (a device sync in an
opaque op) leaves torch's allocators recording to the graph pool: :func:`abandon_pool` ends what
Python can end and moves later captures to a fresh pool, so they all work.

On CPU a capture is emulated (the piece runs and its outputs become the fixed outputs);
:func:`capturing` is true during that run as during a real capture, so a test op can fail there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import traceback
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fxrewrite.runtime.dispatch import ShapeError, _dense_strides
from fxrewrite.runtime.hazards import failing_node, mutated_placeholders, op_name, where
from fxrewrite.split import Piece

if TYPE_CHECKING:
    from fxrewrite.runtime.cudagraph import Runner

logger = logging.getLogger(__name__)

EAGER = "eager"  # the graph of an entry whose piece runs eagerly at that size
_EMULATING = [False]


def capturing() -> bool:
    """Whether a piece is being captured now: a CUDA stream capture on the current stream, or the
    runner's emulation of one on CPU."""
    if _EMULATING[0]:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def _emulating() -> Iterator[None]:
    _EMULATING[0] = True
    try:
        yield
    finally:
        _EMULATING[0] = False


@dataclasses.dataclass
class CaptureFailure:
    """A piece whose capture raised: which op, where in the model, the error, and the sizes (token
    counts; 0 for a graph of one static shape) at which the piece runs eagerly."""

    piece: str
    node: str | None
    op: str
    source: str
    error: str
    sizes: list[int]

    def describe(self) -> str:
        at = f"{self.op} (node {self.node}) at {self.source}" if self.node else "an op not found in its code"
        return f"capture of {self.piece} failed in {at}: {self.error}"

    def row(self) -> dict[str, Any]:
        """The report's entry (``Runner.stats()["eager_pieces"]``)."""
        return {"piece": self.piece, "sizes": list(self.sizes), "op": self.op, "node": self.node,
                "source": self.source, "reason": f"capture failed: {self.error}"}


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` where ``dst`` may be broadcast (an expanded mask: stride 0, which
    ``copy_`` refuses to write): along such dims one row of each is copied, as the piece's graph
    broadcasts that row."""
    for d in range(dst.dim()):
        if dst.stride(d) == 0 and dst.shape[d] > 1:
            dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
    dst.copy_(src)


def size_label(size: int) -> str:
    """A capture size as the messages say it: 0 is the one graph of a static-shape graph."""
    return "its static shape" if size == 0 else f"{size} tokens"


def _weak(t: Any) -> Any:
    """A tensor at ``t``'s address that does not own its memory (``t`` itself if impossible)."""
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if not isinstance(t, torch.Tensor) or not t.is_cuda or make is None:
        return t
    st = t.untyped_storage()
    storage = make(st.data_ptr(), t.device, st.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())


def _clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-stream workspaces, around each capture.

    A GEMM captured with a workspace cached by an earlier eager call bakes in an address the
    graph does not own: whoever clears the cache later (Inductor's CUDA-graph trees do, around
    each warm-up and recording) frees it, and the replay writes freed memory (an illegal memory
    access, or another tensor's values). Cleared before capture_begin, the captured GEMMs
    allocate their workspace inside the graph's pool, which lives as long as the graphs do.
    Cleared again after capture_end (as Inductor does), that block goes back to the pool, free
    for later captures (sequential, like all of the pool), not to eager GEMMs on the stream."""
    torch._C._cuda_clearCublasWorkspaces()


@contextlib.contextmanager
def capture_context(device: torch.device) -> Iterator[None]:
    """Side stream and the cyclic collector off, for the whole capture loop. The caller's frozen
    objects stay frozen: a serving engine freezes its heap after loading (``gc.freeze``), and an
    unfreeze here put every loaded object back under the collector's walks."""
    torch.cuda.synchronize(device)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield
    finally:
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        if gc_was_enabled:
            gc.enable()


_ABANDONED: list[Any] = []  # CUDAGraphs whose capture torch could not end: kept for the process (see abandon_pool)


def capture_graph(fn: Any, static: Sequence[Any], owner: Any) -> tuple[Any, Any]:
    """``fn(*static)`` captured as a CUDA graph into ``owner._pool`` (the Runner's); its outputs
    and the graph. A capture that fails is ended and leaves the allocators fit for the next one
    (:func:`abandon_pool` where torch could not end it), then its error propagates."""
    graph = torch.cuda.CUDAGraph()
    _clear_cublas_workspaces()  # the capture's GEMMs take theirs from the pool (see there)
    try:
        graph.capture_begin(pool=owner._pool)
    except BaseException:
        abandon_pool(owner, graph)  # begin may stop halfway: one allocator routed to the pool, not the other
        raise
    try:
        outputs = fn(*static)
    except BaseException:
        try:
            graph.capture_end()  # the stream leaves capture mode, whatever was captured
        except Exception:  # noqa: BLE001 - CUDA invalidated the capture (a sync); the op's error is the one to report
            abandon_pool(owner, graph)
        _clear_cublas_workspaces()
        raise
    try:
        graph.capture_end()
    except BaseException:
        abandon_pool(owner, graph)
        raise
    finally:
        _clear_cublas_workspaces()
    return outputs, graph


def abandon_pool(owner: Any, graph: Any) -> None:
    """After a capture torch could not end: later captures go to a fresh pool.

    ``CUDAGraph.capture_begin`` tells both caching allocators, the device one and (torch 2.11,
    2.13) the pinned-host one, to route the capturing stream's allocations to the pool;
    ``capture_end`` checks ``cudaStreamEndCapture`` first, and when CUDA invalidated the capture
    (a device sync, a host read inside an opaque op) it raises before telling either allocator
    that the capture ended. Both keep the pool in their list of captures underway, so every later
    ``capture_begin`` on that pool raises "beginAllocateToPool: already recording to mempool_id".
    The device allocator's entry can be ended from Python (``_cuda_endAllocateToPool``; a no-op
    where torch ended it already), the host allocator's cannot. So: end the device routing, retire
    the pool (graphs captured in it keep it; nothing is allocated there again, so their memory
    stays theirs) and give ``owner`` a fresh one; keep ``graph`` alive for the process, since the
    host allocator's stale entry holds a filter that reads it. The pool's use count is left as is:
    the retired pool stays reserved until the process ends, where a second release would assert.
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        with contextlib.suppress(RuntimeError):  # "not currently recording": already ended
            end(torch.cuda.current_device(), owner._pool)
    _ABANDONED.append(graph)
    owner._pool = torch.cuda.graph_pool_handle()
    owner._pools.append(owner._pool)
    logger.info("graph pool %s retired after a capture torch could not end; now capturing into %s",
                owner._pools[-2], owner._pool)
    if torch.cuda.is_available():  # the CPU tests' emulated captures (tests/runtime) have no generator
        _end_generator_capture()


def _end_generator_capture() -> None:
    """The same raise skips the default CUDA generator's capture epilogue (torch 2.11): the
    generator stays in capture mode, and every later eager random op on the device (a sampler's
    ``torch.multinomial``) raises "Offset increment outside graph capture encountered
    unexpectedly". A capture of one tiny kernel, on a stream and in a pool of its own, runs the
    prologue and the epilogue again and leaves the generator out of capture mode (torch 2.13's
    generator keeps that state per capture id: there it is one more short capture). Where even
    that fails, the capture's own error is still the one raised, and the log says why."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            graph.capture_begin(pool=torch.cuda.graph_pool_handle())
            try:
                torch.zeros(1, device="cuda")
            finally:
                graph.capture_end()
        graph.reset()
    except RuntimeError as e:
        logger.warning("the CUDA generator may still be in capture mode after the failed capture: %s", e)


class EagerPiece:
    """Stands in the split module for a piece that runs eagerly: a splitting piece, or a piece
    that is not captured. During capture it returns zeros shaped like its outputs, so its effects
    (a KV-cache write, a host sync) happen in real steps only and its values are never needed to
    capture the next piece; without shape metadata it runs for real then."""

    def __init__(self, piece: Piece, runner: Runner) -> None:
        self.fn, self.piece_name, self._runner = piece.submodule.forward, piece.name, runner
        leaves, self._spec = tree_flatten(piece.submodule.graph.output_node().args[0])
        fakes = [leaf.meta.get("example_value") if isinstance(leaf, torch.fx.Node) else leaf for leaf in leaves]
        known = all(f is not None or not isinstance(leaf, torch.fx.Node) for f, leaf in zip(fakes, leaves))
        self._fakes = fakes if known else None

    def __call__(self, *args: Any) -> Any:
        if self._runner._capturing:
            return self.during_capture(args)
        return self.fn(*args)

    def during_capture(self, args: Sequence[Any]) -> Any:
        runner = self._runner
        if self._fakes is not None:
            with contextlib.suppress(TypeError, KeyError, AttributeError):
                return tree_unflatten([runner.dispatch.materialize(v, runner._size or None) for v in self._fakes],
                                      self._spec)
        logger.warning("%s: no shape metadata, so it runs for real during capture", self.piece_name)
        return self.fn(*args)


class CapturedPiece:
    """Stands in the split module for one captured piece: captures it per size, then replays.

    Per size an entry [static inputs, positions copied in from eager pieces, outputs, CUDA graph
    (None on CPU: the piece runs and its results are copied into the fixed outputs; ``EAGER``: it
    runs eagerly at this size), positions of inputs it keeps owning].
    """

    def __init__(self, piece: Piece, runner: Runner, static: set[int], last: bool) -> None:
        self.fn, self.piece_name, self.index, self._runner = piece.submodule.forward, piece.name, piece.index, runner
        self.submodule, self.sources = piece.submodule, piece.sources
        self._graphs: dict[int, list[Any]] = {}
        self._eager = EagerPiece(piece, runner)
        self.failure: CaptureFailure | None = None
        # parameters / buffers this piece writes (a KV cache, in full mode): its warm-up writes
        # scratch tensors instead; only the replay after capture would write them, and the last
        # piece of a step skips that replay (no later piece reads its values)
        names = mutated_placeholders(piece.submodule)
        phs = piece.submodule.graph.find_nodes(op="placeholder")
        self.writes = [k for k, (s, ph) in enumerate(zip(piece.sources, phs))
                       if ph.name in names and s.kind == "input" and s.index in static]  # fmt: skip
        self.written_inputs = {piece.sources[k].index for k in self.writes}
        self.last = last

    def __call__(self, *args: Any) -> Any:
        runner = self._runner
        entry = self._graphs.get(runner._size)
        if entry is None:
            if not runner._capturing:
                raise RuntimeError(f"{self.piece_name} has no graph for {size_label(runner._size)}")
            entry = self._graphs[runner._size] = self._capture(args, runner._size)
            return self._eager.during_capture(args) if entry[3] is EAGER else entry[2]
        static, copied, outputs, graph, _ = entry
        if graph is EAGER:
            runner._counts["eager_piece_calls"] += 1
            return self.fn(*args)
        for k in copied:
            if not isinstance(static[k], torch.Tensor):
                if args[k] != static[k]:
                    return self._serve_eagerly(args, outputs, f"input {k} of {self.piece_name} was {static[k]!r} "
                                                              f"at capture, now {args[k]!r}")
            elif args[k].data_ptr() != static[k].data_ptr():
                static[k].copy_(args[k])
                runner._counts["activation_copies"] += 1
        if graph is not None:
            graph.replay()
        else:
            for dst, src in zip(tree_flatten(outputs)[0], tree_flatten(self.fn(*static))[0]):
                if isinstance(dst, torch.Tensor):
                    _copy_into(dst, src)
        return outputs

    def _serve_eagerly(self, args: Sequence[Any], outputs: Any, why: str) -> Any:
        """A call the captured graph cannot serve (a value it froze has changed): the piece runs
        eagerly and its results go where the replay would have written them, for the pieces after
        it; ShapeError under ``strict_capture`` or when they no longer fit there."""
        runner = self._runner
        if runner.strict:
            raise ShapeError(f"{why}: the captured graph would be wrong")
        fresh = tree_flatten(self.fn(*args))[0]
        for dst, src in zip(tree_flatten(outputs)[0], fresh):
            if isinstance(dst, torch.Tensor):
                if not isinstance(src, torch.Tensor) or src.shape != dst.shape:
                    raise ShapeError(f"{why}, and its outputs no longer fit the captured buffers")
                _copy_into(dst, src)
        if runner._counts["piece_input_changed"] == 0:
            logger.warning("%s: it runs eagerly in such calls (stats: piece_input_changed)", why)
        runner._counts["piece_input_changed"] += 1
        return outputs

    def _from_eager(self) -> tuple[list[int], set[int]]:
        """Inputs produced by pieces that run eagerly now (copied into buffers of this piece), and
        the inputs this piece keeps owning after capture (those and graph inputs)."""
        eager = self._runner.eager_pieces
        copied = [k for k, s in enumerate(self.sources) if s.kind == "piece" and s.index in eager]
        keep = {k for k, s in enumerate(self.sources) if s.kind != "piece" or s.index in eager}
        return copied, keep

    def _capture(self, args: Sequence[Any], size: int) -> list[Any]:
        runner, static = self._runner, list(args)
        if self.failure is not None:  # failed at a larger size: eager from there down
            self.failure.sizes.append(size)
            return [None, [], None, EAGER, set()]
        copied, keep = self._from_eager()
        for k in copied:
            if isinstance(a := args[k], torch.Tensor):
                static[k] = runner._take(("piece", self.piece_name, k), a.shape, _dense_strides(a.shape, a), a)
                static[k].copy_(a)
        warm = list(static)
        for k in self.writes:
            warm[k] = runner._scratch(static[k])
        try:
            outputs, graph = self._record(static, warm)
        except Exception as e:  # noqa: BLE001 - contained unless strict: the piece runs eagerly
            return self._failed(e, size)
        return [static, copied, outputs, graph, keep]

    def _record(self, static: list[Any], warm: list[Any]) -> tuple[Any, Any]:
        """Warm up and capture (on CPU: one emulated capture run); the outputs and the graph."""
        runner = self._runner
        if not runner.on_cuda:
            with _emulating():
                return self.fn(*warm), None
        self.fn(*warm)  # warm-up: lazy inits, library handles, workspaces
        outputs, graph = capture_graph(self.fn, static, runner)
        if not self.last:
            graph.replay()  # capture computes nothing: later pieces' warm-ups must not read garbage (indices)
        return outputs, graph

    def _failed(self, error: Exception, size: int) -> list[Any]:
        node = failing_node(self.submodule, error)
        op, source = (f"{node.op} {op_name(node)}", where(node)) if node is not None else ("?", "(unknown)")
        self.failure = CaptureFailure(self.piece_name, node.name if node is not None else None, op, source,
                                      f"{type(error).__name__}: {error}", [size])
        runner = self._runner
        if runner.strict:
            raise RuntimeError(f"{self.failure.describe()} (at {size_label(size)})") from error
        traceback.clear_frames(error.__traceback__)  # no tensor of the failed capture outlives it
        logger.warning("%s; it runs eagerly at %s and every smaller size (strict_capture would raise)",
                       self.failure.describe(), size_label(size))
        runner.eager_pieces.add(self.index)  # pieces captured after this copy its outputs in
        return [None, [], None, EAGER, set()]

    def release(self, size: int) -> None:
        """Drop ownership of the pool tensors of ``size`` (outputs, inputs from captured pieces)."""
        entry = self._graphs.get(size)
        if entry and entry[3] is not EAGER:
            entry[0] = [a if k in entry[4] else _weak(a) for k, a in enumerate(entry[0])]
            entry[2] = tree_map(_weak, entry[2])

    def graphs(self) -> int:
        """Sizes this piece replays (captured or, on CPU, emulated)."""
        return sum(e[3] is not EAGER for e in self._graphs.values())
