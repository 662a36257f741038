"""Async tensor parallelism: the GEMMs on either side of a sequence-parallel add + RMSNorm fused
with its collectives, so that communication overlaps compute.

A sequence-parallel site (``fxr.sp_reduce_add_rms_norm``, ``runtime/ops/sequence_parallel.py``)
sits between a row-parallel GEMM (``o_proj``, ``down_proj``) and a column-parallel one
(``qkv_proj``, ``gate_up_proj``). From ``min_tokens`` rows on, two ops split it at its GEMMs::

    # before (rewrites/sequence_parallel.py)          # after (rewrites/async_tp.py)
    x   = fxr.linear(a, w_o)                          out, s = fxr.sp_linear_reduce_add_rms_norm(
    out, s = fxr.sp_reduce_add_rms_norm(                       a, w_o, res, w, eps, 512, False, '0')
             x, res, w, eps, 512, '0')                y   = fxr.sp_all_gather_linear(out, w_qkv, 512, False, '0')
    y   = fxr.linear(out, w_qkv)

``fxr.sp_linear_reduce_add_rms_norm(a, w, residual, weight, eps, min_tokens, gather,
group_name) -> (out, sum)``: ``x = a @ w.T`` (``w`` None: ``x = a``), then what
``fxr.sp_reduce_add_rms_norm(x, ...)`` does, but for ``gather=False`` the all-gather is left to
the reader: ``out`` holds this rank's rows only (as ``sum`` does). Below ``min_tokens`` rows:
``fxr.linear`` then ``fxr.all_reduce_add_rms_norm`` (every row of both outputs right).

``fxr.sp_all_gather_linear(x, w, min_tokens, gated, group_name) -> y``: ``x``'s rows
gathered from the rank that owns each (this rank's rows of ``x`` are all that is read), then
``fxr.linear(x, w)`` (``gated``: ``fxr.linear_silu_and_mul``). Below ``min_tokens`` rows
``x`` is whole on every rank and the linear alone runs: a decode step runs the kernels it ran
before the rewrite.

``fxr.sp_linear_reduce_add_rms_norm_linear(a, w, residual, weight, eps, w_next, gated,
min_tokens, overlap_min_tokens, group_name) -> (y, sum)``: both, for a site whose normed output
only the next GEMM reads: ``out, sum = fxr.sp_linear_reduce_add_rms_norm(a, w, ..., gather=True)``
and ``y = fxr.linear(out, w_next)`` (``gated``: ``fxr.linear_silu_and_mul``).

Shapes are the unsharded model's (as the SP op's, for the same reasons: piecewise capture,
padding, one graph for every token count); rows that are not a multiple of the group pad inside.

The reference (the spec, and the CPU implementation, gloo) spells each path in
``_c10d_functional`` collectives and ``fxr`` ops. On CUDA ``providers.served()`` counts the path
each call took: ``symm-mem``, else the reference's NCCL steps (``reduce-scatter`` /
``all-gather``), and ``all-reduce`` / ``linear`` below the threshold. Why a sharded call did not
take ``symm-mem`` (dtype, no symmetric memory or too little, no Triton) is counted in
:func:`refusals` and logged once per reason.

The ``symm-mem`` paths exchange rows through two symmetric-memory buffers per group (memory each
rank maps from every rank, so a copy into a peer's goes over NVLink), each ``[world, chunk, width]``
slots: slot ``r`` of rank ``q``'s buffer holds what rank ``r`` sent to ``q``. Each path copies
on a side stream (the copy engines: no SMs taken from the GEMMs) while its next GEMM runs::

    reduce: GEMM + reduce-scatter + add + norm          all-gather + GEMM
    barrier                                             barrier
    for each other rank r: a[r's rows] @ w.T,           for each other rank r: copy x[my rows]
        copied into r's partials, slot [me]      |          into r's gathered rows, slot [me]  |
    a[my rows] @ w.T into my partials, slot [me] |      x[my rows] @ w.T -> y[my rows]         |
    barrier                                             barrier
    one kernel: sum of my slots + residual -> sum,      for each other rank r:
        its RMSNorm -> out (my rows)                        (my slot [r]) @ w.T -> y[r's rows]

The first barrier of each keeps a rank from copying into a peer's buffer before that peer has
read the call before's; the second, from reading its slots before every peer's copy has
landed (each rank waits for its side stream first). The site op runs the two back to back
from ``overlap_min_tokens`` rows on ("symm-mem overlap"; the all-gather's first barrier
skipped: the reduce's came after this rank's last read of its gathered rows). Below that, the
split GEMMs cost more than the copies they hide (a 256-row half of a GEMM takes most of the
whole one's time: a single wave either way), and the site exchanges its rows in one kernel
between whole GEMMs ("symm-mem exchange")::

    a @ w.T -> my partials (every row)
    barrier
    one kernel, my rows: sum of every rank's partials there (read over NVLink) + residual -> sum,
        its RMSNorm -> my rows of every rank's gathered rows (stored over NVLink)
    barrier
    (my gathered rows: every row) @ w_next.T -> y

Two barriers a site and no pre-barrier: each remote access to a buffer happens between the
two barriers of a call, and every rank's local writes to its partials and reads of its
gathered rows happen outside them. ``triton_kernels.sum_add_rms_norm`` does
what the reduce-scatter's sum, the residual add and the norm did as three kernels. torch's
``symm_mem.fused_matmul_reduce_scatter`` / ``fused_all_gather_matmul`` do the same exchange with
more steps: a stacked partials buffer summed by ``torch.sum`` after the peers' rows were pulled
once both GEMMs ended, the shard copied into the workspace before the first barrier, one more
barrier at the end. bench/RESULTS.md (issue 32) has both against the fused all-reduce, on the
8B shape at TP=2.

torch facts used (read in torch 2.13 ``torch/distributed/_symmetric_memory/__init__.py``; the
same in 2.11):

- ``symm_mem.empty(size, dtype=, device=)`` then ``symm_mem.rendezvous(tensor, group_name)``
  (collective) give a handle: ``get_buffer(rank, sizes, dtype, storage_offset=0)`` is a tensor
  over that rank's memory, usable by this rank's kernels and copies; ``barrier(channel=0)`` is a
  kernel that returns once every rank has reached its own, ordering the memory operations
  before it on each rank before those after it on every other. Both are CUDA-graph capturable.
- The buffers never grow (captured graphs hold their addresses): :func:`workspace` makes them
  once, eagerly, at ``FXREWRITE_SYMM_MEM_MB`` (default 128 MiB each) or the first call's need,
  never during capture, and refuses calls that need more.
- torch before 2.11 registers a group for symmetric memory with ``enable_symm_mem_for_group``
  (deprecated from 2.11 on, where the group resolves by name).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops.collective import _fake
from fxrewrite.runtime.ops.linear import _linear_fake, _linear_silu_and_mul_fake
from fxrewrite.runtime.ops.sequence_parallel import (add_norm_own_rows, all_gather_rows, group_size_and_rank, own_rows,
                                                     reduce_scatter_rows, sharded, split_rows)
from fxrewrite.runtime.providers import Kernel, OpDef

log = logging.getLogger(__name__)

SYMM_MEM = "torch.distributed._symmetric_memory"
TRITON_KERNELS = "fxrewrite.runtime.triton_kernels"
SYMM_MEM_ENV = "FXREWRITE_SYMM_MEM_MB"
DEFAULT_SYMM_MEM_MIB = 128  # 16384 tokens of a 4096-wide bf16 hidden state at TP=2


def _rows(t: Tensor) -> int:
    return t.numel() // t.shape[-1]


def _gemm(a: Tensor, w: Tensor | None) -> Tensor:
    return a if w is None else torch.ops.fxr.linear.default(a, w)


def _linear(x: Tensor, w: Tensor, gated: bool) -> Tensor:
    op = torch.ops.fxr.linear_silu_and_mul if gated else torch.ops.fxr.linear
    return op.default(x, w)


# --------------------------------------------------------------------------- GEMM + reduce-scatter + add + norm


def sp_linear_reduce_add_rms_norm_reference(
    a: Tensor, w: Tensor | None, residual: Tensor, weight: Tensor, eps: float, min_tokens: int, gather: bool,
    group_name: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Returns ``(out, sum)``; see the module docstring. Above the threshold ``sum`` holds this
    rank's rows, and so does ``out`` unless ``gather``."""
    path = _reduce_nccl if sharded(_rows(a), min_tokens) else _reduce_all
    return path(a, w, residual, weight, eps, min_tokens, gather, group_name)


def _reduce_all(a: Tensor, w: Tensor | None, residual: Tensor, weight: Tensor, eps: float, min_tokens: int,
                gather: bool, group_name: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    return torch.ops.fxr.all_reduce_add_rms_norm.default(_gemm(a, w), residual, weight, eps, group_name)


def _reduce_nccl(a: Tensor, w: Tensor | None, residual: Tensor, weight: Tensor, eps: float, min_tokens: int,
                 gather: bool, group_name: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    mine = reduce_scatter_rows(_gemm(a, w), group_name)
    return _norm_and_place(mine, residual, weight, eps, gather, group_name)


def _reduce_symm(a: Tensor, w: Tensor | None, residual: Tensor, weight: Tensor, eps: float, min_tokens: int,
                 gather: bool, group_name: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The other ranks' rows' partial products first, each copied into its owner's partials
    while the next GEMM runs; this rank's own into its own; a barrier; one kernel sums this
    rank's partials, adds the residual's rows and normalizes (module docstring)."""
    assert w is not None
    world, rank = group_size_and_rank(group_name)
    a2 = a.reshape(-1, a.shape[-1])
    rows, hidden = a2.shape[0], w.shape[0]
    chunk, lo, hi = split_rows(rows, group_name)
    memory = _SYMM[group_name].partials

    def slots(owner: int) -> Tensor:  # owner's partials of its rows, one slot per rank that made them
        return memory.get_buffer(owner, (world, chunk, hidden), a.dtype)

    memory.barrier(channel=0)  # every rank has summed its partials of the call before
    with _pushing() as push:
        for owner in _peers(rank, world):
            first, end = _bounds(owner, chunk, rows)
            push(torch.mm(a2[first:end], w.t()), slots(owner)[rank, : end - first])
        torch.mm(a2[lo:hi], w.t(), out=slots(rank)[rank, : hi - lo])
    memory.barrier(channel=0)  # every rank's partials of this rank's rows have landed
    total = residual.new_empty(chunk * world, hidden)
    out = residual.new_empty(chunk * world, hidden)
    mine = slice(rank * chunk, rank * chunk + hi - lo)
    res = residual.reshape(rows, hidden)[lo:hi]
    if hi > lo:
        providers.library(TRITON_KERNELS).sum_add_rms_norm(  # type: ignore[union-attr]
            slots(rank)[:, : hi - lo], res if res.stride() == (hidden, 1) else res.contiguous(), weight, eps,
            out[mine], total[mine])  # fmt: skip
    if gather:
        out = all_gather_rows(out[rank * chunk : (rank + 1) * chunk], rows, group_name)
    return out[:rows].view(residual.shape), total[:rows].view(residual.shape)


def _norm_and_place(mine: Tensor, residual: Tensor, weight: Tensor, eps: float, gather: bool,
                    group_name: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``mine`` (this rank's reduced rows) + the residual's, normed; ``out`` all-gathered, or
    residual-shaped with this rank's rows alone written."""
    rows = _rows(residual)
    total = add_norm_own_rows(mine, residual, weight, eps, rows, group_name)
    if gather:
        return all_gather_rows(mine, rows, group_name).view(residual.shape), total
    world, rank = group_size_and_rank(group_name)
    chunk = mine.shape[0]
    out = mine.new_empty(chunk * world, mine.shape[-1])
    out[rank * chunk : (rank + 1) * chunk].copy_(mine)
    return out[:rows].view(residual.shape), total


def _fake_reduce(a: Tensor, w: Tensor | None, residual: Tensor, weight: Tensor, eps: float, min_tokens: int,
                 gather: bool, group_name: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    x = a if w is None else _linear_fake(a, w)
    return _fake(x, residual, weight, eps, group_name)


# --------------------------------------------------------------------------- all-gather + GEMM


def sp_all_gather_linear_reference(x: Tensor, w: Tensor, min_tokens: int, gated: bool, group_name: str) -> Tensor:
    """``fxr.linear(x, w)`` (``gated``: ``fxr.linear_silu_and_mul``) of ``x`` gathered by
    rows from their owners above the threshold (module docstring); of ``x`` as it is below."""
    path = _gather_nccl if sharded(_rows(x), min_tokens) else _gather_local
    return path(x, w, min_tokens, gated, group_name)


def _gather_local(x: Tensor, w: Tensor, min_tokens: int, gated: bool, group_name: str) -> Tensor:
    return _linear(x, w, gated)


def _gather_nccl(x: Tensor, w: Tensor, min_tokens: int, gated: bool, group_name: str) -> Tensor:
    full = all_gather_rows(own_rows(x, group_name), _rows(x), group_name)
    return _linear(full.view(x.shape), w, gated)


def _gather_symm(x: Tensor, w: Tensor, min_tokens: int, gated: bool, group_name: str, fresh: bool = False) -> Tensor:
    """This rank's rows copied into every other rank's gathered rows while its own rows' GEMM
    runs; a barrier; then the GEMM of each other rank's rows, landed here (module docstring).
    ``fresh``: a barrier was passed since this rank's last read of its gathered rows (the site
    op's reduce right before): the first barrier is skipped."""
    world, rank = group_size_and_rank(group_name)
    x2 = x.reshape(-1, x.shape[-1])
    rows, width = x2.shape
    chunk, lo, hi = split_rows(rows, group_name)
    memory = _SYMM[group_name].gathered

    def slots(owner: int) -> Tensor:  # every rank's rows as they land at owner, one slot per rank
        return memory.get_buffer(owner, (world, chunk, width), x.dtype)

    y = x.new_empty(rows, w.shape[0])
    if not fresh:
        memory.barrier(channel=0)  # every rank has read its gathered rows of the call before
    with _pushing() as push:
        for owner in _peers(rank, world):
            push(x2[lo:hi], slots(owner)[rank, : hi - lo])
        torch.mm(x2[lo:hi], w.t(), out=y[lo:hi])
    memory.barrier(channel=0)  # every rank's rows have landed here
    for owner in _peers(rank, world):
        first, end = _bounds(owner, chunk, rows)
        torch.mm(slots(rank)[owner, : end - first], w.t(), out=y[first:end])
    y = torch.ops.fxr.silu_and_mul.default(y) if gated else y
    return y.view(*x.shape[:-1], y.shape[-1])


# --------------------------------------------------------------------------- the whole site


def sp_linear_reduce_add_rms_norm_linear_reference(
    a: Tensor, w: Tensor, residual: Tensor, weight: Tensor, eps: float, w_next: Tensor, gated: bool,
    min_tokens: int, overlap_min_tokens: int, group_name: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Returns ``(y, sum)``: ``out, sum = fxr.sp_linear_reduce_add_rms_norm(a, w, residual,
    weight, eps, min_tokens, True, group_name)`` and ``y = fxr.linear(out, w_next)``
    (``gated``: ``fxr.linear_silu_and_mul``): both ops of a site whose normed output only the
    next GEMM reads, in one. ``overlap_min_tokens`` picks the symm-mem path (module docstring)."""
    path = _site_nccl if sharded(_rows(a), min_tokens) else _site_local
    return path(a, w, residual, weight, eps, w_next, gated, min_tokens, overlap_min_tokens, group_name)


def _then_linear(reduce: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., tuple[Tensor, Tensor]]:
    """The site op's path that runs ``reduce`` (a path of ``fxr.sp_linear_reduce_add_rms_norm``,
    gathering) and then the next GEMM."""

    def site(a: Tensor, w: Tensor, residual: Tensor, weight: Tensor, eps: float, w_next: Tensor, gated: bool,
             min_tokens: int, overlap_min_tokens: int, group_name: str) -> tuple[Tensor, Tensor]:  # fmt: skip
        out, total = reduce(a, w, residual, weight, eps, min_tokens, True, group_name)
        return _linear(out, w_next, gated), total

    return site


_site_local, _site_nccl = _then_linear(_reduce_all), _then_linear(_reduce_nccl)


def _site_overlap(a: Tensor, w: Tensor, residual: Tensor, weight: Tensor, eps: float, w_next: Tensor, gated: bool,
                  min_tokens: int, overlap_min_tokens: int, group_name: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The two ops' symm-mem paths back to back, the all-gather's first barrier skipped: the
    reduce's barriers came after this rank's last read of its gathered rows."""
    out, total = _reduce_symm(a, w, residual, weight, eps, min_tokens, False, group_name)
    return _gather_symm(out, w_next, min_tokens, gated, group_name, fresh=True), total


def _site_exchange(a: Tensor, w: Tensor, residual: Tensor, weight: Tensor, eps: float, w_next: Tensor, gated: bool,
                   min_tokens: int, overlap_min_tokens: int, group_name: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Whole GEMMs, one kernel between them (module docstring): this rank's partial product of
    every row into its own partials; a barrier; ``triton_kernels.exchange_add_rms_norm`` sums
    this rank's rows of every rank's partials (read from the peers' memory), adds the residual,
    normalizes, and stores the rows into every rank's gathered rows; a barrier; the next GEMM
    of every row, read from this rank's gathered rows."""
    world, rank = group_size_and_rank(group_name)
    a2 = a.reshape(-1, a.shape[-1])
    rows, hidden = a2.shape[0], w.shape[0]
    chunk, lo, hi = split_rows(rows, group_name)
    symm = _SYMM[group_name]
    partial = symm.partials.get_buffer(rank, (chunk * world, hidden), a.dtype)
    gathered = symm.gathered.get_buffer(rank, (chunk * world, hidden), a.dtype)
    torch.mm(a2, w.t(), out=partial[:rows])
    symm.partials.barrier(channel=0)  # every rank's partial product is whole
    total = residual.new_empty(chunk * world, hidden)
    mine = slice(rank * chunk, rank * chunk + hi - lo)
    res = residual.reshape(rows, hidden)[lo:hi]
    if hi > lo:
        providers.library(TRITON_KERNELS).exchange_add_rms_norm(  # type: ignore[union-attr]
            partial[lo:hi], symm.tables[0], res if res.stride() == (hidden, 1) else res.contiguous(), weight, eps,
            gathered[mine], symm.tables[1], total[mine])  # fmt: skip
    symm.gathered.barrier(channel=0)  # every rank's normed rows have landed here
    y = _linear(gathered[:rows], w_next, gated)
    return y.view(*a.shape[:-1], y.shape[-1]), total[:rows].view(residual.shape)


def _fake_site(a: Tensor, w: Tensor, residual: Tensor, weight: Tensor, eps: float, w_next: Tensor, gated: bool,
               min_tokens: int, overlap_min_tokens: int, group_name: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    out, total = _fake_reduce(a, w, residual, weight, eps, min_tokens, True, group_name)
    return _fake_gather(out, w_next, min_tokens, gated, group_name), total


def _peers(rank: int, world: int) -> list[int]:
    """The other ranks, from the next one on (each rank starts at a different peer)."""
    return [(rank + step) % world for step in range(1, world)]


def _bounds(owner: int, chunk: int, rows: int) -> tuple[int, int]:
    """The real rows ``[first, end)`` of ``owner``'s chunk (the last rank's may be short)."""
    return min(owner * chunk, rows), min((owner + 1) * chunk, rows)


@contextlib.contextmanager
def _pushing() -> Iterator[Callable[[Tensor, Tensor], None]]:
    """``push(src, dst)`` copies on a side stream (the copy engines; over NVLink where ``dst``
    is a peer's memory) once what the current stream has queued so far is done, while the
    current stream goes on; at the exit the current stream waits for every copy. Each ``src``
    stays referenced until then (a staged GEMM output would go back to the allocator mid-copy)."""
    here = torch.cuda.current_stream()
    if here.device not in _SIDE_STREAMS:
        _SIDE_STREAMS[here.device] = torch.cuda.Stream(here.device)
    side, sources = _SIDE_STREAMS[here.device], []

    def push(src: Tensor, dst: Tensor) -> None:
        sources.append(src)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            dst.copy_(src)

    yield push
    here.wait_stream(side)
    sources.clear()


_SIDE_STREAMS: dict[torch.device, Any] = {}


def _fake_gather(x: Tensor, w: Tensor, min_tokens: int, gated: bool, group_name: str) -> Tensor:
    return (_linear_silu_and_mul_fake if gated else _linear_fake)(x, w)


# --------------------------------------------------------------------------- the symmetric memory


class Buffers(NamedTuple):
    """A group's two symmetric-memory buffers (handles: ``get_buffer`` of any rank's, ``barrier``),
    their local tensors, kept alive as long as the handles, and for each the byte offset of every
    rank's buffer from this rank's (int64 on the device: the exchange kernel's tables)."""

    partials: Any
    gathered: Any
    memory: tuple[Tensor, Tensor]
    tables: tuple[Tensor, Tensor]


_WORKSPACES: dict[str, int | str] = {}  # group name -> bytes of each buffer, or why there are none
_SYMM: dict[str, Buffers] = {}
_REFUSALS: collections.Counter[tuple[str, str]] = collections.Counter()


def workspace(group_name: str, nbytes: int, device: torch.device) -> str | None:
    """None when each of ``group_name``'s symmetric-memory buffers holds ``nbytes``, else why
    not. Created at the first call (collective: every rank of the group calls it at the same
    call), never during capture, never grown."""
    found = _WORKSPACES.get(group_name)
    if found is None:
        if torch.cuda.is_current_stream_capturing():
            return "no symmetric memory yet, and none can be made during CUDA graph capture"
        found = _WORKSPACES[group_name] = _create(group_name, nbytes, device)
    if isinstance(found, str):
        return found
    if nbytes > found:
        return (f"needs {nbytes >> 20} MiB of symmetric memory, the buffers hold {found >> 20} MiB "
                f"({SYMM_MEM_ENV}; they never grow: captured graphs read them)")  # fmt: skip
    return None


def _create(group_name: str, nbytes: int, device: torch.device) -> int | str:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    sm = providers.library(SYMM_MEM)
    size = max(nbytes, int(float(os.environ.get(SYMM_MEM_ENV, DEFAULT_SYMM_MEM_MIB)) * (1 << 20)))
    made: int | str
    try:
        if torch.torch_version.TorchVersion(torch.__version__) < "2.11":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                sm.enable_symm_mem_for_group(group_name)
        memory = (sm.empty(size, dtype=torch.uint8, device=device), sm.empty(size, dtype=torch.uint8, device=device))
        handles = [sm.rendezvous(t, group_name) for t in memory]
        _SYMM[group_name] = Buffers(*handles, memory, tuple(_offsets(h, group_name, device) for h in handles))
        made = size
    except Exception as e:  # noqa: BLE001 - reported as the refusal reason, never silent
        made = f"symmetric memory failed: {type(e).__name__}: {e}"
    ok = torch.tensor([0 if isinstance(made, str) else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=_resolve_process_group(group_name))
    if not isinstance(made, str) and int(ok.item()) == 0:
        made = "symmetric memory failed on another rank"
    log.info("async TP, group %s: %s", group_name, made if isinstance(made, str) else f"2 buffers of {size >> 20} MiB")
    return made


def _offsets(handle: Any, group_name: str, device: torch.device) -> Tensor:
    """The byte offset of each rank's buffer of ``handle`` from this rank's, as this rank maps them."""
    world, rank = group_size_and_rank(group_name)
    base = [handle.get_buffer(r, (1,), torch.uint8).data_ptr() for r in range(world)]
    return torch.tensor([b - base[rank] for b in base], dtype=torch.int64, device=device)


def refusals() -> dict[str, dict[str, int]]:
    """Per op: why sharded calls did not take the ``symm-mem`` path, with their counts."""
    out: dict[str, dict[str, int]] = {}
    for (op, reason), n in sorted(_REFUSALS.items()):
        out.setdefault(op, {})[reason] = n
    return out


def _refused(op: str, reason: str | None) -> str | None:
    if reason is not None:
        if not _REFUSALS[(op, reason)]:
            log.warning("fxr::%s: a sharded call takes the NCCL path: %s", op, reason)
        _REFUSALS[(op, reason)] += 1
    return reason


def _symm_check(op: str, rows: int, min_tokens: int, tensors: tuple[Tensor, ...], width: int,
                group_name: str) -> str | None:  # fmt: skip
    """None when a call can take the symm-mem path: sharded, ``tensors`` (the GEMM's weight
    last) of one half dtype on one device, and the group's buffers hold ``[world, chunk,
    width]`` of them; else why not (a refusal counted, unless the call is below the threshold:
    not sharded, not the path's)."""
    if not sharded(rows, min_tokens):
        return f"{rows} rows < {min_tokens}"
    if not hasattr(providers.library(SYMM_MEM), "rendezvous"):
        return _refused(op, "this torch has no symmetric-memory rendezvous")
    if tensors[-1] is None:
        return _refused(op, "no GEMM before the reduce-scatter (the reduced input is not a plain linear's)")
    world = group_size_and_rank(group_name)[0]
    nbytes = world * -(-rows // world) * width * tensors[0].element_size()
    reason = constraints.check_half(*tensors) or constraints.check_same_device(*tensors)
    return _refused(op, reason or workspace(group_name, nbytes, tensors[0].device))


def _reduce_symm_check(a: Tensor, w: Tensor | None, residual: Tensor, weight: Tensor, eps: float,
                       min_tokens: int, gather: bool, group_name: str) -> str | None:  # fmt: skip
    op = "sp_linear_reduce_add_rms_norm"
    reason = _symm_check(op, _rows(a), min_tokens, (a, residual, w), residual.shape[-1], group_name)
    if reason is None and providers.library(TRITON_KERNELS) is None:
        reason = _refused(op, "Triton is not importable (the partials' sum, add and norm)")
    return reason


def _gather_symm_check(x: Tensor, w: Tensor, min_tokens: int, gated: bool, group_name: str) -> str | None:
    return _symm_check("sp_all_gather_linear", _rows(x), min_tokens, (x, w), x.shape[-1], group_name)


def _site_check(overlap: bool, a: Tensor, w: Tensor, residual: Tensor, weight: Tensor, eps: float, w_next: Tensor,
                gated: bool, min_tokens: int, overlap_min_tokens: int, group_name: str) -> str | None:  # fmt: skip
    """The exchange path below ``overlap_min_tokens`` rows, the overlapping one from there (the
    row count first: only the path a call's rows pick counts a refusal)."""
    rows = _rows(a)
    if (rows >= overlap_min_tokens) != overlap:
        return f"{rows} rows {'<' if overlap else '>='} {overlap_min_tokens}"
    op = "sp_linear_reduce_add_rms_norm_linear"
    reason = _symm_check(op, rows, min_tokens, (a, residual, w_next, w), residual.shape[-1], group_name)
    if reason is None and providers.library(TRITON_KERNELS) is None:
        reason = _refused(op, "Triton is not importable (the exchange kernel)")
    return reason


def _path_check(want: bool, at: int, x: Tensor, *args: object) -> str | None:
    min_tokens, rows = args[at - 1], _rows(x)
    return None if sharded(rows, min_tokens) == want else f"{rows} rows {'<' if want else '>='} {min_tokens}"


def _paths(at: int, nccl: tuple, local: tuple, *symm: tuple) -> tuple[Kernel, ...]:
    """The symm-mem kernels (run, check, label) first, then the reference's two paths, labelled:
    each call meets one of the last two's checks (``served()`` counts which); ``min_tokens`` is
    argument ``at``."""
    P = functools.partial
    return (*(Kernel("symm_mem", run, check, (8, 0), label, SYMM_MEM) for run, check, label in symm),
            Kernel("nccl", nccl[0], P(_path_check, True, at), label=nccl[1], module="torch.distributed"),
            Kernel("nccl", local[0], P(_path_check, False, at), label=local[1], module="torch.distributed"))  # fmt: skip


DEFS: tuple[OpDef, ...] = (
    OpDef("sp_linear_reduce_add_rms_norm", sp_linear_reduce_add_rms_norm_reference, _fake_reduce,
          _paths(5, (_reduce_nccl, "reduce-scatter"), (_reduce_all, "all-reduce"),
                 (_reduce_symm, _reduce_symm_check, "symm-mem"))),
    OpDef("sp_all_gather_linear", sp_all_gather_linear_reference, _fake_gather,
          _paths(2, (_gather_nccl, "all-gather"), (_gather_local, "linear"),
                 (_gather_symm, _gather_symm_check, "symm-mem"))),
    OpDef("sp_linear_reduce_add_rms_norm_linear", sp_linear_reduce_add_rms_norm_linear_reference, _fake_site,
          _paths(7, (_site_nccl, "reduce-scatter"), (_site_local, "all-reduce"),
                 (_site_exchange, functools.partial(_site_check, False), "symm-mem exchange"),
                 (_site_overlap, functools.partial(_site_check, True), "symm-mem overlap"))),
)  # fmt: skip
OPS: tuple[str, ...] = providers.define_all(providers.collectives(DEFS))
