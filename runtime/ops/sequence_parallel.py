"""Sequence parallelism: the all-reduce + add + RMSNorm of a tensor-parallel layer, with each rank
normalizing its own share of the tokens when a call has many of them.

``fxr.sp_reduce_add_rms_norm(x, residual, w, eps, min_tokens, group_name) -> (out, sum)`` has the
shapes and the ``out`` of ``fxr.all_reduce_add_rms_norm`` (``runtime/ops/collective.py``); it
picks its collective pattern by the row count of each call::

    rows <  min_tokens   fxr.all_reduce_add_rms_norm(x, residual, w, eps, group_name)   (decode:
                         the fused all-reduce kernel, unchanged)
    rows >= min_tokens   chunk = ceil(rows / world); x padded with zero rows to chunk * world
                         xs     = reduce_scatter(x)                     # [chunk, H]: my rows' sum
                         rs     = residual[my rows] (zero rows past the end)
                         rs += xs; xs = rms_norm(rs, w, eps)            # fxr.fused_add_rms_norm_
                         out    = all_gather(xs)[:rows]                 # every rank: every row
                         sum    = rs in my rows; the other rows unspecified (never written)

One op rather than a reduce-scatter op and an all-gather op: below the threshold the all-gather
would have to return its input unchanged, which a custom op can only do with a copy (every
decode step would pay it); the all-gather ends the op, right before the column-parallel GEMM
that reads ``out``. The branch is on the row count, which every rank shares: all ranks take the
same path (or the collectives hang), and a captured CUDA graph takes one fixed path per capture
size, so one graph with a symbolic token count serves both.

``sum`` keeps the residual stream sharded: only this rank's rows hold the sum, and only the next
site reads it, its own rows, as its ``residual`` (``rewrites/sequence_parallel.py`` proves that
every reader of ``sum`` is such a site and that all of a chain's sites take the same path: they
see the same rows). Keeping the full shape (not ``[chunk, H]``) keeps the graph's shapes those
of the unsharded model: piecewise pieces, static buffers and padding to a capture size are
untouched, and a row count that is not a multiple of ``world`` pads inside the op. The
``residual`` of a chain's first site is replicated (the same on every rank, as a
tensor-parallel model's residual stream is): each rank reads its rows of it.

The reference is the implementation on every device: the collectives through
``_c10d_functional`` (NCCL, gloo; capturable in CUDA graphs, as the all-reduce op's NCCL path),
the add + norm through ``fxr.fused_add_rms_norm_``, whose providers serve it on CUDA. On CUDA
``providers.served()`` counts the calls of each path ("reduce-scatter", "all-reduce").
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops.collective import _fake
from fxrewrite.runtime.providers import Kernel, OpDef


def group_size_and_rank(group_name: str) -> tuple[int, int]:
    """``(size, rank)`` of the process group named ``group_name`` (the rank within it)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    return group.size(), group.rank()


def sharded(rows: int, min_tokens: int) -> bool:
    """Whether a call of ``rows`` rows takes the reduce-scatter path (the op's branch)."""
    return rows >= min_tokens


def sp_reduce_add_rms_norm_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, min_tokens: int, group_name: str
) -> tuple[Tensor, Tensor]:
    """Returns ``(out, sum)``; see the module docstring. ``out`` equals
    ``fxr.all_reduce_add_rms_norm``'s; ``sum`` does in this rank's rows of a sharded call (all
    rows below ``min_tokens``)."""
    path = _sharded if sharded(x.numel() // x.shape[-1], min_tokens) else _all_reduce
    return path(x, residual, weight, eps, min_tokens, group_name)


def _all_reduce(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, min_tokens: int, group_name: str
) -> tuple[Tensor, Tensor]:
    return torch.ops.fxr.all_reduce_add_rms_norm.default(x, residual, weight, eps, group_name)


def _sharded(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, min_tokens: int, group_name: str
) -> tuple[Tensor, Tensor]:
    rows = x.numel() // x.shape[-1]
    mine = reduce_scatter_rows(x, group_name)
    total = add_norm_own_rows(mine, residual, weight, eps, rows, group_name)
    return all_gather_rows(mine, rows, group_name).view(x.shape), total


# -- the sharded path's steps, shared with the async-TP ops (runtime/ops/async_tp.py) -----------


def split_rows(rows: int, group_name: str) -> tuple[int, int, int]:
    """``(chunk, lo, hi)``: each rank's row count (``ceil(rows / world)``, the last rank's rows
    padded with zero rows) and this rank's rows ``[lo, hi)`` of the ``rows`` real ones."""
    world, rank = group_size_and_rank(group_name)
    chunk = -(-rows // world)
    return chunk, min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` as ``[rows', H]`` rows, zero rows appended up to ``rows`` (no copy when none are)."""
    xs = x.reshape(-1, x.shape[-1])
    return xs if xs.shape[0] == rows else torch.nn.functional.pad(xs, (0, 0, 0, rows - xs.shape[0]))


def own_rows(x: Tensor, group_name: str) -> Tensor:
    """This rank's ``chunk`` rows of ``x`` (``[chunk, H]``, contiguous; zero rows past the end)."""
    xs = x.reshape(-1, x.shape[-1])
    chunk, lo, hi = split_rows(xs.shape[0], group_name)
    return pad_rows(xs[lo:hi], chunk).contiguous()


def reduce_scatter_rows(x: Tensor, group_name: str) -> Tensor:
    """``[chunk, H]``: this rank's rows of the sum of ``x`` over the group (``x`` padded to
    ``chunk * world`` rows)."""
    c10d = torch.ops._c10d_functional
    rows = x.numel() // x.shape[-1]
    world = group_size_and_rank(group_name)[0]
    xs = pad_rows(x, split_rows(rows, group_name)[0] * world)
    return c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(xs.contiguous(), "sum", world, group_name))


def add_norm_own_rows(mine: Tensor, residual: Tensor, weight: Tensor, eps: float, rows: int,
                      group_name: str) -> Tensor:  # fmt: skip
    """``mine`` (this rank's reduced rows) += the residual's rows, then normed, in place; returns
    the sum, ``residual``-shaped, holding this rank's rows (the others never written)."""
    chunk, lo, hi = split_rows(rows, group_name)
    world, rank = group_size_and_rank(group_name)
    hidden = residual.shape[-1]
    total = residual.new_empty(chunk * world, hidden)
    own = total[rank * chunk : (rank + 1) * chunk]
    own[: hi - lo].copy_(residual.reshape(rows, hidden)[lo:hi])
    own[hi - lo :].zero_()
    torch.ops.fxr.fused_add_rms_norm_.default(mine, own, weight, eps)
    return total[:rows].view(residual.shape)


def all_gather_rows(mine: Tensor, rows: int, group_name: str) -> Tensor:
    """``[rows, H]``: every rank's ``mine`` in rank order, the padding rows dropped."""
    c10d = torch.ops._c10d_functional
    world = group_size_and_rank(group_name)[0]
    return c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(mine, world, group_name))[:rows]


def _path_check(want: bool, x: Tensor, residual: Tensor, weight: Tensor, eps: float, min_tokens: int,
                group_name: str) -> str | None:  # fmt: skip
    rows = x.numel() // x.shape[-1]
    if sharded(rows, min_tokens) == want:
        return None
    return f"{rows} rows {'<' if want else '>='} {min_tokens}"


def _fake_sp(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, min_tokens: int, group_name: str
) -> tuple[Tensor, Tensor]:
    return _fake(x, residual, weight, eps, group_name)


# On CUDA the two paths as two "kernels" (the reference's own steps, labelled), so that
# ``providers.served()`` counts the calls each took; every call meets exactly one's check.
_PATHS = tuple(Kernel("nccl", run, functools.partial(_path_check, want), label=label, module="torch.distributed")
               for run, want, label in ((_sharded, True, "reduce-scatter"), (_all_reduce, False, "all-reduce")))  # fmt: skip
DEFS: tuple[OpDef, ...] = (OpDef("sp_reduce_add_rms_norm", sp_reduce_add_rms_norm_reference, _fake_sp, _PATHS),)
OPS: tuple[str, ...] = providers.define_all(providers.collectives(DEFS))
