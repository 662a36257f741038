"""Piecewise and full CUDA graphs: capture per token count, replay, pad, fall back to eager.

``build_runner(gm, example_inputs, config)`` returns a :class:`Runner`, callable like ``gm``
(same inputs, same outputs); ``Runner.stats()`` goes into the backend's Report. Modes
(``Config.mode``): "none" runs ``gm`` as is; "piecewise" splits it at ``Config.splitting_ops``
(:mod:`fxrewrite.split`), captures every other piece per capture size and runs the splitting
pieces (attention) eagerly between replays; "full" captures the whole graph per size.

Dispatch. The token count is Dynamo's dynamic dimension: under ``dynamic=True`` (or
``mark_dynamic``) the graph has one symbol ``s0``, a SymInt placeholder and tensor inputs with
``s0`` in a dim. A call reads ``n``, checks every input shape (a :class:`ShapeError` naming
expected and actual shapes), picks a size and replays it. Sizes outside the symbol's range are
not captured (Dynamo compiles ``s0 >= 2``; 0 and 1 get graphs of their own). Either
1. exact (``pad_inputs=False``): the engine pads its inputs to a capture size itself; other
   counts run eagerly, counted; or
2. padded (``pad_inputs=True``): token inputs are copied into the buffers of the next capture
   size, padding rows are **zeros**, outputs are sliced back to ``n`` rows. Correct when no
   real row reads a later row (pointwise ops, norms, GEMMs, causal attention) and padded rows
   write no state a real row reads: they carry token 0, position 0, KV slot 0, length 0, so an
   engine whose attention writes per-row state reserves index 0 as a dummy (as SGLang reserves
   KV slot 0) or pads its own metadata. No value suits every model: repeating the last row
   instead writes a padded row's different keys over the last real token's slot.
Beyond the largest size the original graph runs eagerly (``eager_calls``). A static graph
(``dynamic=False``) has one size (size 0 in the runner's tables, "its static shape" in messages);
a call with shapes the graph was not compiled for runs eagerly (``shape_mismatch``), or is a
ShapeError under ``Config.strict_capture`` (Dynamo recompiles first: only a caller that skips its
guards, ``Backend.unguarded``, meets this).

Static addresses: a CUDA graph reads its inputs where they were at capture.
- Parameters and buffers (Dynamo's ``_dynamo_static_input_type``, ``nn.Parameter``,
  ``torch._dynamo.mark_static_address``) are read in place, never copied; each call checks
  they are the same tensors (another address makes the call eager, with a warning).
- Other inputs of captured pieces have one buffer each, shared by all sizes (a size uses a
  prefix); inputs found elsewhere are copied in (one launch per dtype), counted per step
  (``static_input_copies``); writing into ``Runner.static_inputs(n)`` avoids it. An input
  written in place is copied back.
- A captured piece reads earlier captured pieces' outputs where their replay wrote them: no
  copy. Splitting pieces return fresh tensors, copied into the next piece's buffer
  (``activation_copies``), unless the op writes into a buffer the piece before allocated (an
  ``out=`` attention op): no copy.
- Outputs are cloned (after slicing): they stay valid after the next call.

Host scalars: under ``dynamic=True`` and plain ``torch.compile`` Dynamo lifts float attributes
(RMSNorm eps, attention scaling) to CPU scalar tensors read with ``.item()`` (``Backend.compile``
makes them constants instead: ``Config.specialize_floats``). That does not sync the GPU, so capture
allows it, but the value becomes a kernel argument, frozen at capture: each call compares the
values (about 0.5 us each); a changed one makes the call eager, with a warning. An int input that
sizes no input tensor is such a value too, not a second dynamic dimension: transformers'
``logits_to_keep`` is one where the model's ``forward`` is Dynamo's frame (Falcon's; Llama's is
wrapped by ``can_return_tuple``, which inlines the default), read by the last piece's slice. In a
graph whose tensors are all static it is no token count either (it counts no input rows to pad; a
slice from the end padded would keep the wrong rows): that graph has one graph, of its static shape.

Containment: no capture problem reaches the caller unless ``Config.strict_capture`` (env
``FXREWRITE_STRICT=1``; the test suite turns it on) asks for errors. A piece holding any other
host sync, transfer or data-dependent shape (:mod:`fxrewrite.runtime.hazards`) runs eagerly, as a
splitting piece does; a capture that raises makes its piece run eagerly at that size and every
smaller one (:mod:`fxrewrite.runtime.pieces`); a failure outside any piece makes the whole graph
run eagerly. ``stats()["eager_pieces"]`` names each such piece, the op and its source line, and
the warning log says the same. Strict: a :class:`CaptureHazardError` at build, a RuntimeError
naming the piece, op and source line at capture.

Capture: at the first call or ``Runner.capture()``, largest size first, the split module runs
once per size on the static buffers; each captured piece gets an eager warm-up, a capture on a
side stream and a replay (later warm-ups must read real values, e.g. indices; the last piece
skips it). Splitting pieces (and pieces run eagerly) do not run then: they return zeros shaped
like their outputs, so attention's writes (a KV cache) happen in real steps only. Parameters or buffers a captured
piece writes (full mode: the KV caches) are never written by capture: warm-ups write zeroed
scratch tensors in their place (one per shape, freed after capture); only where a piece that
writes them is replayed at capture (not the last) are they saved to host memory and restored.
All graphs share one pool (``torch.cuda.graph_pool_handle``; a fresh one after a capture torch
could not end, :func:`fxrewrite.runtime.pieces.abandon_pool`); once a size is captured the
Runner keeps non-owning references to its pool tensors, so later sizes reuse the memory: one
size's values are dead before another size runs, and inputs and outputs live outside the pool. gc is frozen and disabled; ``capture_begin`` / ``capture_end`` are
called directly, skipping the ``gc.collect`` / ``empty_cache`` that ``torch.cuda.graph`` may do
per capture. cuBLAS's cached workspaces are dropped around each capture, so the captured GEMMs
take theirs from the pool: other code clearing that cache (Inductor's CUDA-graph trees do) cannot
free memory a replay writes.

On CPU (no CUDA input) piecewise and full run the same dispatch, buffers and copies, captured
pieces emulated by eager runs copied into fixed outputs (``stats()["cudagraphs"]`` False).

Example::

    runner = build_runner(gm, example_inputs, Config(mode="piecewise", capture_sizes=(8, 16)))
    out = runner(*args)                       # what gm(*args) returns
    runner.stats()["activation_copies_last"]  # copies made by the last call
"""

from __future__ import annotations

import collections
import contextlib
import logging
import operator
import sys
import time
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch.fx import GraphModule
from torch.fx._lazy_graph_module import _make_graph_module

from fxrewrite.config import Config
from fxrewrite.runtime.dispatch import (
    Dispatch,
    ShapeError,
    _concrete,
    _dense_strides,
    check_capture_sizes,
    pad_zeros,
)
from fxrewrite.runtime.hazards import CaptureHazardError, find_capture_hazards, is_trivial, mutated_placeholders
from fxrewrite.runtime.pieces import CapturedPiece, EagerPiece, capture_context
from fxrewrite.split import Piece, split_graph

try:
    from tqdm import tqdm
except ImportError:  # a nicety: without tqdm the capture is only logged
    tqdm = None

logger = logging.getLogger(__name__)

def copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, one ``torch._foreach_copy_`` per (dtype, device) group: on
    CUDA one kernel launch copies a group (an engine step's ids, positions and slots take one
    launch instead of three); pairs that differ in dtype or device are copied one by one."""
    groups: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dst, src):
        if d.dtype != s.dtype or d.device != s.device:
            d.copy_(s)
            continue
        ds, ss = groups.setdefault((d.dtype, d.device), ([], []))
        ds.append(d)
        ss.append(s)
    for ds, ss in groups.values():
        if len(ds) == 1:
            ds[0].copy_(ss[0])
        else:
            torch._foreach_copy_(ds, ss)


def _host_values(args: Sequence[Any], idx: Sequence[int]) -> list[Any]:
    """The values frozen at capture: CPU scalar tensors read on the host, int inputs."""
    return [a.item() if isinstance(a, torch.Tensor) else a for a in map(args.__getitem__, idx)]


def _picker(idx: Sequence[int]) -> Any:
    """``args -> tuple(args[i] for i in idx)``, in C (the per-call check of ~300 parameters)."""
    if len(idx) > 1:
        return operator.itemgetter(*idx)
    return lambda args: tuple(args[i] for i in idx)


def _with_stand_ins(split: GraphModule, stand_ins: dict[str, Any]) -> GraphModule:
    """The split module's graph over ``stand_ins`` (by submodule name) and its other submodules
    and constants. The stand-ins are plain attributes: the generated forward finds them without
    going through ``nn.Module.__getattr__`` and ``__call__`` (about 5 us a piece). Built from a
    root that holds no captured piece's GraphModule: a GraphModule generates the code of all its
    GraphModule children again when it is made (65 on the 8B model's piecewise split). Its
    code is generated when it is first called where GraphModules are lazy (under ``torch.compile``
    and ``aot_compile``): never when the runner calls a lone piece directly."""
    root = torch.nn.Module()
    for node in split.graph.nodes:
        if node.op not in ("call_module", "get_attr") or node.target in root.__dict__:
            continue
        *path, name = node.target.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        value = stand_ins[node.target] if node.target in stand_ins else operator.attrgetter(node.target)(split)
        if isinstance(value, (torch.nn.Module, torch.Tensor)):
            setattr(owner, name, value)
        else:
            owner.__dict__[name] = value
    return _make_graph_module(root, split.graph)


class Runner:
    """Runs a rewritten graph in the configured mode; callable like the graph itself.

    See the module docstring for modes, dispatch, copies and capture. Not thread-safe: one
    call at a time. Inference only: replays build no autograd graph.
    """

    def __init__(self, gm: GraphModule, example_inputs: Sequence[Any], config: Config) -> None:
        config = config.resolved()
        self.gm, self.mode, self._progress, self.strict = gm, config.mode, config.progress, config.strict_capture
        self._counts: collections.Counter = collections.Counter()
        self._reasons: collections.Counter = collections.Counter()
        self._last = (0, 0)
        self._size, self._capturing = 0, False  # the size being run; capturing it now
        self._arenas: dict[Any, torch.Tensor] = {}
        self._buffers: dict[int, dict[int, torch.Tensor]] = {}
        self._captured, self._pool, self.capture_s, self.pool_bytes = False, None, 0.0, 0
        self._pools: list[Any] = []  # every pool captured into (more than one after a capture torch could not end)
        self.on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
        self.module: GraphModule | None = None
        self.split, self.dispatch, self._pieces, self._restore = None, None, [], []
        self.eager_pieces: set[int] = set()  # pieces that run eagerly (splitting, trivial, not captured)
        self._not_captured: list[dict[str, Any]] = []  # pieces with hazards, for the report
        if self.mode == "none":
            return
        if self.mode not in ("piecewise", "full"):
            raise ValueError(f"unknown mode {self.mode!r}: expected 'none', 'piecewise' or 'full'")
        sizes = check_capture_sizes(config)
        self.split = split_graph(gm, config.splitting_ops if self.mode == "piecewise" else ())
        pieces = [p for p in self.split.pieces if not p.is_splitting and not is_trivial(p.submodule)]
        d = self._dispatch(gm, example_inputs, pieces, sizes, config.pad_inputs)
        capturable = self._capturable(pieces, {s.name for s in d.inputs if s.kind == "host"})
        if len(capturable) < len(pieces):  # the inputs of pieces run eagerly are not the runner's
            pieces = capturable
            d = self._dispatch(gm, example_inputs, pieces, sizes, config.pad_inputs)
            if not pieces and not d.reason:
                d.reason = "no piece can be captured (eager_pieces says why)"
        self.eager_pieces = {p.index for p in self.split.pieces} - {p.index for p in pieces}
        if d.reason:
            logger.warning("CUDA graphs off, the graph runs eagerly: %s", d.reason)
        statics = {i for i, spec in enumerate(d.inputs) if spec.kind == "static"}
        self._pieces = [CapturedPiece(p, self, statics, last=p is pieces[-1]) for p in pieces]
        stand_ins: dict[str, Any] = dict(zip((p.name for p in pieces), self._pieces))
        stand_ins.update((p.name, EagerPiece(p, self)) for p in self.split.pieces
                         if p.is_splitting or p.name in {r["piece"] for r in self._not_captured})  # fmt: skip
        self.module = _with_stand_ins(self.split.module, stand_ins)
        self._forward = self._lone_piece() or self.module.forward
        # parameters/buffers that a piece replayed during capture writes: saved and restored
        replayed = {i for p in self._pieces if not p.last for i in p.written_inputs}
        self._restore = [example_inputs[i] for i in sorted(replayed)]
        self._scratches: dict[Any, torch.Tensor] = {}
        self._examples = [_concrete(v) for v in example_inputs]
        kinds = [s.kind for s in d.inputs]
        self._pick_statics = _picker([i for i, k in enumerate(kinds) if k == "static"])
        self._statics = self._pick_statics(example_inputs)
        self._host_idx = [i for i, k in enumerate(kinds) if k == "host"]
        self._host_values = _host_values(self._examples, self._host_idx)
        self._managed = d.managed
        self._sym_idx = [i for i, k in enumerate(kinds) if k == "sym"]
        written = mutated_placeholders(gm)
        self._written = [i for i in self._managed if d.inputs[i].name in written]
        self._device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda), None)

    def _dispatch(self, gm: GraphModule, example_inputs: Sequence[Any], pieces: Sequence[Piece], sizes: Sequence[int],
                  pad: bool) -> Dispatch:  # fmt: skip
        used = {s.index for p in pieces for s in p.sources if s.kind == "input"}
        self.dispatch = Dispatch(gm, example_inputs, used, sizes, pad, self.on_cuda)
        return self.dispatch

    def _capturable(self, pieces: Sequence[Piece], hosts: Collection[str]) -> list[Piece]:
        """The pieces without capture hazards. The others run eagerly, each hazard logged and
        listed in ``stats()["eager_pieces"]``; under ``strict_capture`` they raise
        :class:`CaptureHazardError`."""
        found = {p.index: find_capture_hazards(p.submodule, hosts) for p in pieces}
        if self.strict and any(found.values()):
            raise CaptureHazardError([h for p in pieces for h in found[p.index]])
        for p in pieces:
            for h in found[p.index]:
                logger.warning("%s runs eagerly (not captured): %s", p.name, h)
                self._not_captured.append({"piece": p.name, "sizes": "all", "op": h.op, "node": h.node,
                                           "source": h.source, "reason": h.reason})
        return [p for p in pieces if not found[p.index]]

    # -- buffers ------------------------------------------------------------------------

    def _take(self, key: Any, shape: Sequence[int], strides: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """A zero-initialised tensor in the arena ``key`` (one arena serves every size)."""
        span = 1 + sum((s - 1) * st for s, st in zip(shape, strides)) if all(shape) else 0
        arena = self._arenas.get(key)
        if arena is None or arena.numel() < span or arena.dtype != like.dtype:
            arena = self._arenas[key] = torch.zeros(span, dtype=like.dtype, device=like.device)
        return arena[:span].as_strided(tuple(shape), tuple(strides))

    def _scratch(self, t: torch.Tensor) -> torch.Tensor:
        """A zeroed stand-in for a buffer a warm-up would write, shared by every buffer of the
        same shape, strides and dtype (a model's 64 KV caches take one), freed after capture."""
        key = (tuple(t.shape), t.stride(), t.dtype, t.device)
        if key not in self._scratches:
            self._scratches[key] = torch.zeros_like(t)
        return self._scratches[key]

    def _buffer(self, i: int, size: int) -> torch.Tensor:
        per_size = self._buffers.setdefault(size, {})
        if i not in per_size:
            shape = self.dispatch.expected_shape(i, size or None)
            like = self._examples[i]
            per_size[i] = self._take(("input", i), shape, _dense_strides(shape, like), like)
        return per_size[i]

    def static_inputs(self, n: int | None = None) -> list[torch.Tensor | None]:
        """The static buffers a call with ``n`` tokens reads (None where an input is used in
        place). An engine that writes its inputs there (a prefix of ``n`` rows when padding)
        and passes those views makes no copy."""
        size = self.dispatch.select(n) if self.dispatch is not None else None
        if size is None:
            raise ShapeError(f"no captured size serves n={n}")
        return [self._buffer(i, size) if i in self._managed else None for i in range(len(self.dispatch.inputs))]

    # -- capture ------------------------------------------------------------------------

    def capture(self) -> None:
        """Capture every size now (otherwise done at the first call). Idempotent."""
        if self._captured or self.module is None or self.dispatch.reason:
            return
        self._captured = True
        sizes = sorted(self.dispatch.sizes, reverse=True) or [0]
        t0, reserved = time.perf_counter(), torch.cuda.memory_reserved(self._device) if self.on_cuda else 0
        ctx = capture_context(self._device) if self.on_cuda else contextlib.nullcontext()
        saved = [t.to("cpu", copy=True) for t in self._restore]
        try:
            with ctx, torch.inference_mode(False), torch.no_grad():
                if self.on_cuda:
                    self._pool = torch.cuda.graph_pool_handle()
                    self._pools = [self._pool]
                desc = "capturing CUDA graphs" if self.on_cuda else "emulating CUDA graphs"
                show = self._progress and tqdm is not None
                for size in tqdm(sizes, desc=desc, unit="size", file=sys.stderr) if show else sizes:
                    args = [size if i in self._sym_idx else self._buffer(i, size) if i in self._managed
                            else self._examples[i] for i in range(len(self._examples))]
                    self._size, self._capturing = size, True
                    self._forward(*args)  # as a call runs: a lone piece directly
                    self._capturing = False
                    for p in self._pieces if self.on_cuda else ():
                        p.release(size)
        except Exception as e:
            self.dispatch.reason = f"capture failed: {type(e).__name__}: {e}"  # later calls run eagerly
            if self.strict:
                raise
            logger.warning("%s; the graph runs eagerly (strict_capture would raise)", self.dispatch.reason)
            return
        finally:
            self._capturing = False
            self._scratches.clear()
            for t, copy in zip(self._restore, saved):
                t.copy_(copy)
        self.capture_s = time.perf_counter() - t0
        if self.on_cuda:  # the pool's segments; else what capture reserved (warm-ups included)
            pools = {tuple(p) for p in self._pools}
            segments = [s["total_size"] for s in torch.cuda.memory_snapshot()
                        if tuple(s.get("segment_pool_id", ())) in pools]
            self.pool_bytes = sum(segments) if segments else torch.cuda.memory_reserved(self._device) - reserved
        logger.info("captured %d graphs (%d pieces x %d sizes) in %.2f s; pool %.1f MiB, buffers %.1f MiB",
                    sum(p.graphs() for p in self._pieces), len(self._pieces), len(sizes), self.capture_s,
                    self.pool_bytes / 2**20, self._buffer_bytes() / 2**20)

    def _buffer_bytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self._arenas.values())

    # -- calls --------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        if self.module is None:
            return self.gm(*args)
        d, counts = self.dispatch, self._counts
        counts["calls"] += 1
        if d.reason:
            return self._eager(args, "unsupported")
        n = d.token_count(args)
        try:
            d.check(args, n)
        except ShapeError as e:
            if self.strict:
                raise
            try:  # the graph's code may serve it (a token count below Dynamo's range, say)
                return self._eager(args, "shape_mismatch", str(e))
            except Exception as failed:  # noqa: BLE001 - it does not: say why, with the graph's error
                raise e from failed
        size = d.select(n)
        if size is None:
            return self._eager(args, "beyond_max" if n > d.sizes[-1] else "not_captured")
        if not all(map(operator.is_, self._pick_statics(args), self._statics)) and not self._adopt(args):
            return self._eager(args, "static_input_moved")
        if _host_values(args, self._host_idx) != self._host_values:
            return self._eager(args, "host_scalar_changed")
        self.capture()
        if d.reason:  # the capture failed outside any one piece
            return self._eager(args, "unsupported")
        before = (counts["static_input_copies"], counts["activation_copies"])
        if torch.is_grad_enabled():  # no autograd here: an output may view a parameter
            with torch.no_grad():
                out = self._replay(args, n, size)
        else:
            out = self._replay(args, n, size)
        counts["replays"] += 1
        counts["padded_calls"] += n is not None and n != size
        self._last = (counts["static_input_copies"] - before[0], counts["activation_copies"] - before[1])
        return out

    def _replay(self, args: Sequence[Any], n: int | None, size: int) -> Any:
        call = self._prepare(args, n, size)
        self._size = size
        out = self._forward(*call)
        for i in self._written:
            self._copy_back(i, args[i], call[i], n, size)
        return self.dispatch.finish(out, n, size)

    def _lone_piece(self) -> Any:
        """The split module's forward when it only calls one captured piece (on graph inputs,
        its own constants and literals) and returns its result: a function that calls the
        piece's stand-in directly, without the generated forward (a call with every parameter
        as an argument, twice). None otherwise."""
        graph = self.split.module.graph
        placeholders = {n: i for i, n in enumerate(graph.find_nodes(op="placeholder"))}
        calls = [n for n in graph.nodes if n.op == "call_module"]
        out = graph.output_node().args[0]
        if len(self._pieces) != 1 or len(calls) != 1 or calls[0].kwargs or (
                out is not calls[0] and out != (calls[0],)) or any(  # fmt: skip
                n.op not in ("placeholder", "get_attr", "call_module", "output") for n in graph.nodes):
            return None
        index, constants = [], []
        for a in calls[0].args:
            if isinstance(a, torch.fx.Node) and a.op == "placeholder":
                index.append(placeholders[a])
                continue
            index.append(len(placeholders) + len(constants))
            constants.append(operator.attrgetter(a.target)(self.module) if isinstance(a, torch.fx.Node) else a)
        stand_in, pick, constants, wrap = self._pieces[0], _picker(index), tuple(constants), out is not calls[0]

        def forward(*call: Any) -> Any:
            result = stand_in(*pick(call + constants))
            return (result,) if wrap else result

        return forward

    def _eager(self, args: Sequence[Any], reason: str, detail: str = "") -> Any:
        self._counts["eager_calls"] += 1
        self._reasons[reason] += 1
        if reason in ("static_input_moved", "host_scalar_changed", "shape_mismatch") and self._reasons[reason] == 1:
            logger.warning("%s%s: this call and the next such ones run eagerly (stats: eager_reasons)", reason,
                           f" ({detail})" if detail else "")
        self._last = (0, 0)
        return self.gm(*args)

    def _adopt(self, args: Sequence[Any]) -> bool:
        """Same addresses under new tensor objects are fine (adopt them); a new address is not."""
        new = self._pick_statics(args)
        if [t.data_ptr() for t in new] != [t.data_ptr() for t in self._statics]:
            return False
        self._statics = new
        return True

    def _region(self, buf: torch.Tensor, i: int, n: int | None, size: int) -> torch.Tensor:
        for dim in self.dispatch.inputs[i].token_dims if n is not None and n != size else ():
            buf = buf.narrow(dim, 0, n)
        return buf

    def _prepare(self, args: Sequence[Any], n: int | None, size: int) -> list[Any]:
        call, dst, src = list(args), [], []
        padded = n is not None and n != size
        for i in self._managed:
            buf = call[i] = self._buffer(i, size)
            region, a = self._region(buf, i, n, size) if padded else buf, args[i]
            if a.data_ptr() != region.data_ptr() or a.stride() != region.stride():
                dst.append(region)
                src.append(a)
            if region is not buf:
                pad_zeros(buf, self.dispatch.inputs[i].token_dims, n)
        copy_all(dst, src)
        self._counts["static_input_copies"] += len(dst)
        for i in self._sym_idx:
            call[i] = size
        return call

    def _copy_back(self, i: int, arg: torch.Tensor, buf: torch.Tensor, n: int | None, size: int) -> None:
        region = self._region(buf, i, n, size)
        if arg.data_ptr() != region.data_ptr():
            arg.copy_(region)
            self._counts["static_input_copies"] += 1

    # -- report -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters and capture facts for the Report.

        mode, device; cudagraphs (real graphs in use) and reason (why not, e.g. several dynamic
        dims, a failed capture); capture_sizes, static_shape, pad_inputs; inputs (count per
        InputSpec kind); pieces, captured_pieces, splitting_pieces, missing_splitting_ops;
        graphs, captured, capture_s, pool_bytes (the graph pools' segments), pools (1, or more after
        a capture torch could not end: :func:`~fxrewrite.runtime.pieces.abandon_pool`), buffer_bytes
        (static input buffers), capture_saved_bytes (parameters/buffers saved to host and restored
        around capture: written by a piece replayed then); calls, replays, padded_calls, eager_calls and eager_reasons
        (beyond_max, not_captured, static_input_moved, host_scalar_changed, shape_mismatch, unsupported);
        static_input_copies and activation_copies, in all and in the last call (``_last``).
        eager_pieces: the pieces not captured at some or every size, one entry per hazard or failed
        capture (piece, sizes: "all" or the token counts, op, node, source line, reason);
        eager_piece_calls (calls of such a piece at replay); piece_input_changed (replays where a
        piece ran eagerly because a value its graph froze had changed).
        """
        d, split, c = self.dispatch, self.split, self._counts
        return {
            "mode": self.mode,
            "device": "cuda" if self.on_cuda else "cpu",
            "cudagraphs": bool(self.on_cuda and d is not None and not d.reason),
            "reason": d.reason if d is not None else None,
            "capture_sizes": list(d.sizes) if d is not None else [],
            "static_shape": d is not None and d.symbol is None,
            "pad_inputs": bool(d is not None and d.pad),
            "inputs": dict(collections.Counter(s.kind for s in d.inputs)) if d is not None else {},
            "pieces": len(split.pieces) if split else 1,
            "captured_pieces": sum(p.failure is None for p in self._pieces),
            "splitting_pieces": split.num_splitting if split else 0,
            "missing_splitting_ops": [getattr(o, "__name__", str(o)) for o in split.missing] if split else [],
            "graphs": sum(p.graphs() for p in self._pieces),
            "captured": self._captured, "capture_s": self.capture_s,
            "pool_bytes": self.pool_bytes, "pools": len(self._pools), "buffer_bytes": self._buffer_bytes(),
            "capture_saved_bytes": sum(t.numel() * t.element_size() for t in self._restore),
            **{k: c[k] for k in ("calls", "replays", "padded_calls", "eager_calls")},
            "eager_reasons": dict(self._reasons),
            "static_input_copies": c["static_input_copies"], "static_input_copies_last": self._last[0],
            "activation_copies": c["activation_copies"], "activation_copies_last": self._last[1],
            "eager_pieces": self._not_captured + [p.failure.row() for p in self._pieces if p.failure is not None],
            "eager_piece_calls": c["eager_piece_calls"], "piece_input_changed": c["piece_input_changed"],
        }


def build_runner(gm: GraphModule, example_inputs: Sequence[Any], config: Config) -> Runner:
    """Wrap the rewritten ``gm`` for ``config.mode`` ("none", "piecewise" or "full").

    A piece holding an op capture cannot hold runs eagerly (``stats()["eager_pieces"]`` says
    which op, where); under ``config.strict_capture`` that raises :class:`CaptureHazardError`.
    Capture itself happens at the first call, or at ``runner.capture()``. Example::

        runner = build_runner(gm, example_inputs, Config(mode="full", capture_sizes=(4, 8)))
        out = runner(*args)
    """
    return Runner(gm, list(example_inputs), config)
