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

Shapes are the unsharded model's (as the SP op's, for the same reasons: piecewise capture,
padding, one graph for every token count); rows that are not a multiple of the group pad inside.

The reference (the spec, and the CPU implementation, gloo) spells each path in
``_c10d_functional`` collectives and ``fxr`` ops. On CUDA ``providers.served()`` counts the path
each call took: ``symm-mem`` (torch's ``symm_mem.fused_matmul_reduce_scatter`` /
``fused_all_gather_matmul``: the GEMM in row blocks on two streams, each block's exchange over
NVLink overlapping the next block's GEMM, through a symmetric-memory workspace), else the
reference's NCCL steps (``reduce-scatter`` / ``all-gather``), and ``all-reduce`` / ``linear``
below the threshold. Why a sharded call did not take ``symm-mem`` (dtype, no workspace, the
workspace too small) is counted in :func:`refusals` and logged once per reason.

torch facts used (read in torch 2.13 ``torch/distributed/_symmetric_memory/__init__.py``; the
same ops and signatures in 2.11):

- ``fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name) -> Tensor``:
  ``reduce_scatter(A @ B)`` along ``scatter_dim``; its rows must split evenly over the group.
  The partial products go to a stacked ``[M, N]`` buffer, summed by one ``torch.sum``.
- ``fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A=True) -> (A?, [A @ B])``;
  ``A_shard`` contiguous. Multicast variants need ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` unset and
  multicast hardware (off where NVLS is); the native one ``TORCH_SYMM_MEM_ENABLE_NATIVE_ASYNC_TP``.
- Both take a workspace from ``get_symm_mem_workspace(group_name, min_size)``, which reallocates
  when asked for more and raises during CUDA graph capture then. A reallocation would free memory
  that captured graphs read: :func:`workspace` allocates it once, eagerly, at
  ``FXREWRITE_SYMM_MEM_MB`` (default 128 MiB) or the first call's need, and refuses calls that
  need more. Their barriers, side stream and copies are CUDA-graph capturable.
- torch before 2.11 registers a group for symmetric memory with ``enable_symm_mem_for_group``
  (deprecated from 2.11 on, where the group resolves by name).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import warnings

import torch
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops.collective import _fake
from fxrewrite.runtime.ops.linear import _linear_fake, _linear_silu_and_mul_fake
from fxrewrite.runtime.ops.sequence_parallel import (add_norm_own_rows, all_gather_rows, group_size_and_rank, own_rows,
                                                     pad_rows, reduce_scatter_rows, sharded, split_rows)
from fxrewrite.runtime.providers import Kernel, OpDef

log = logging.getLogger(__name__)

SYMM_MEM = "torch.distributed._symmetric_memory"
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
    assert w is not None
    world = group_size_and_rank(group_name)[0]
    a2 = pad_rows(a, split_rows(_rows(a), group_name)[0] * world)
    mine = torch.ops.symm_mem.fused_matmul_reduce_scatter.default(a2, w.t(), "sum", 0, group_name)
    return _norm_and_place(mine, residual, weight, eps, gather, group_name)


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


def _gather_symm(x: Tensor, w: Tensor, min_tokens: int, gated: bool, group_name: str) -> Tensor:
    _, (y,) = torch.ops.symm_mem.fused_all_gather_matmul.default(
        own_rows(x, group_name), [w.t()], 0, group_name, return_A=False
    )
    y = y[: _rows(x)]
    y = torch.ops.fxr.silu_and_mul.default(y) if gated else y
    return y.view(*x.shape[:-1], y.shape[-1])


def _fake_gather(x: Tensor, w: Tensor, min_tokens: int, gated: bool, group_name: str) -> Tensor:
    return (_linear_silu_and_mul_fake if gated else _linear_fake)(x, w)


# --------------------------------------------------------------------------- the symmetric-memory workspace

_WORKSPACES: dict[str, int | str] = {}  # group name -> workspace bytes, or why there is none
_REFUSALS: collections.Counter[tuple[str, str]] = collections.Counter()


def workspace(group_name: str, nbytes: int, device: torch.device) -> str | None:
    """None when ``group_name``'s symmetric-memory workspace holds ``nbytes``, else why not.
    Created at the first call (collective: every rank of the group calls it at the same call),
    never during capture, never grown."""
    found = _WORKSPACES.get(group_name)
    if found is None:
        if torch.cuda.is_current_stream_capturing():
            return "no symmetric-memory workspace yet, and none can be made during CUDA graph capture"
        found = _WORKSPACES[group_name] = _create(group_name, nbytes, device)
    if isinstance(found, str):
        return found
    if nbytes > found:
        return (f"needs {nbytes >> 20} MiB of symmetric memory, the workspace holds {found >> 20} MiB "
                f"({SYMM_MEM_ENV}; it never grows: captured graphs read it)")  # fmt: skip
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
        sm.get_symm_mem_workspace(group_name, min_size=size)
        made = size
    except Exception as e:  # noqa: BLE001 - reported as the refusal reason, never silent
        made = f"symmetric-memory workspace failed: {type(e).__name__}: {e}"
    ok = torch.tensor([0 if isinstance(made, str) else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=_resolve_process_group(group_name))
    if not isinstance(made, str) and int(ok.item()) == 0:
        made = "symmetric-memory workspace failed on another rank"
    log.info("async TP, group %s: %s", group_name, made if isinstance(made, str) else f"workspace of {size >> 20} MiB")
    return made


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


def _symm_check(op: str, rows: int, min_tokens: int, tensors: tuple[Tensor, ...], nbytes: int, group_name: str) -> str | None:
    if not sharded(rows, min_tokens):
        return f"{rows} rows < {min_tokens}"
    if not hasattr(torch.ops.symm_mem, "fused_matmul_reduce_scatter"):
        return _refused(op, "this torch has no symm_mem fused ops")
    if tensors[-1] is None:
        return _refused(op, "no GEMM before the reduce-scatter (the reduced input is not a plain linear's)")
    reason = constraints.check_half(*tensors) or constraints.check_same_device(*tensors)
    return _refused(op, reason or workspace(group_name, nbytes, tensors[0].device))


def _reduce_symm_check(a: Tensor, w: Tensor | None, residual: Tensor, weight: Tensor, eps: float,
                       min_tokens: int, gather: bool, group_name: str) -> str | None:  # fmt: skip
    rows = _rows(a)
    chunk = -(-rows // group_size_and_rank(group_name)[0])
    # the stacked partials' exchange: two [chunk, N] buffers
    nbytes = 2 * chunk * residual.shape[-1] * a.element_size()
    return _symm_check("sp_linear_reduce_add_rms_norm", rows, min_tokens, (a, w), nbytes, group_name)


def _gather_symm_check(x: Tensor, w: Tensor, min_tokens: int, gated: bool, group_name: str) -> str | None:
    rows = _rows(x)
    chunk = -(-rows // group_size_and_rank(group_name)[0])
    nbytes = chunk * x.shape[-1] * x.element_size()  # this rank's rows, where the peers read them
    return _symm_check("sp_all_gather_linear", rows, min_tokens, (x, w), nbytes, group_name)


def _path_check(want: bool, at: int, x: Tensor, *args: object) -> str | None:
    min_tokens, rows = args[at - 1], _rows(x)
    return None if sharded(rows, min_tokens) == want else f"{rows} rows {'<' if want else '>='} {min_tokens}"


def _paths(at: int, symm: tuple, nccl: tuple, local: tuple) -> tuple[Kernel, ...]:
    """The symm-mem kernel first, then the reference's two paths, labelled: each call meets one of
    the last two's checks (``served()`` counts which); ``min_tokens`` is argument ``at``."""
    P = functools.partial
    return (Kernel("symm_mem", symm[0], symm[1], (8, 0), "symm-mem", SYMM_MEM),
            Kernel("nccl", nccl[0], P(_path_check, True, at), label=nccl[1], module="torch.distributed"),
            Kernel("nccl", local[0], P(_path_check, False, at), label=local[1], module="torch.distributed"))  # fmt: skip


DEFS: tuple[OpDef, ...] = (
    OpDef("sp_linear_reduce_add_rms_norm", sp_linear_reduce_add_rms_norm_reference, _fake_reduce,
          _paths(5, (_reduce_symm, _reduce_symm_check), (_reduce_nccl, "reduce-scatter"), (_reduce_all, "all-reduce"))),
    OpDef("sp_all_gather_linear", sp_all_gather_linear_reference, _fake_gather,
          _paths(2, (_gather_symm, _gather_symm_check), (_gather_nccl, "all-gather"), (_gather_local, "linear"))),
)  # fmt: skip
OPS: tuple[str, ...] = providers.define_all(providers.collectives(DEFS))
