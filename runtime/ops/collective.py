"""All-reduce fused with the residual add and RMSNorm (and a quantization: static FP8, block FP8,
NVFP4) that follow it.

Tensor parallelism ends attention (``o_proj``) and the MLP (``down_proj``) with an all-reduce
of row-parallel partial sums; the next thing a Llama layer does is add the residual and norm::

    # before (functional collectives, as Dynamo records them)   # after
    t = _c10d_functional.all_reduce(x, "sum", group_name)       out, s = torch.ops.fxr.all_reduce_add_rms_norm(
    y = _c10d_functional.wait_tensor(t)                                 x, residual, w, eps, group_name)
    s = y + residual
    out = rms_norm(s, w, eps)

The group travels as its name (a ``str``), as it does in ``_c10d_functional``: the op stays a
plain custom op with a fake impl, and the name resolves to the process group at run time
(``_resolve_process_group``). CPU (and the spec, and every fallback): the all-reduce through
``_c10d_functional`` (gloo, NCCL, or a fake group in tests), then ``fxr.fused_add_rms_norm``
(``fxr.fused_add_rms_norm_quant_fp8``), which serve the add and norm with their own kernels.

CUDA: flashinfer's ``comm.trtllm_allreduce_fusion`` (TensorRT-LLM's kernel: Lamport one-shot or
two-shot all-reduce, the residual add, RMSNorm and the quantization in one launch) over an IPC
workspace created once per process group (:func:`workspace`). A call it cannot serve (dtype,
layout, rank count, size beyond the workspace, the workspace missing) falls back to the NCCL
all-reduce plus the fused add + norm above, counted with its reason (``providers.served()``).
Both paths are CUDA-graph safe once the workspace exists (it is created at the first eager call,
never during capture).

Every rank must take the same path at every call, or the collectives hang: the checks read only
what SPMD ranks share (shapes, dtypes, strides, alignment, group size), and workspace creation
ends with an all-reduce of its outcome so that all ranks agree.

flashinfer facts used here (read in flashinfer 0.7.2, ``flashinfer/comm/trtllm_ar.py`` and
``data/include/flashinfer/comm/trtllm_allreduce_fusion.cuh``):

- ``trtllm_create_ipc_workspace_for_all_reduce_fusion(tp_rank, tp_size, max_token_num,
  hidden_dim, use_fp32_lamport=False, group=None, create_metadata=False, comm_backend=None,
  use_symm_dev_mem=False)`` -> ``(ipc_handles, workspace_tensor, metadata)`` with
  ``create_metadata=True``; collective (symmetric-memory rendezvous, then ``dist.barrier``).
  Buffers: ``tp * max_token_num * hidden * 2`` bytes, flags, and a Lamport buffer of three times
  that. Marked deprecated in favour of ``allreduce.create_allreduce_fusion_workspace``, which
  calls it with flashinfer's own symmetric device memory; we keep torch's symmetric memory
  (``use_symm_dev_mem=False``: no multicast, which the GPU machine forbids).
- ``trtllm_allreduce_fusion(allreduce_in, world_size, world_rank, token_num, hidden_dim,
  workspace_ptrs, launch_with_pdl, trigger_completion_at_end, fp32_acc, pattern_code,
  use_oneshot, allreduce_out, residual_in, residual_out, norm_out, quant_out, scale_out,
  rms_gamma, rms_eps, scale_factor, layout_code, metadata=None, ...)``; outputs are written
  into the tensors given. ``AllReduceFusionPattern``: ``kARResidualRMSNorm = 1``,
  ``kARResidualRMSNormFP8Quant = 2`` (static: ``fp8(norm * (1 / scale_factor))``, saturating),
  ``kARResidualRMSNormDynamicFP8Quant = 10`` (scale floor 2^-9 / 448, not the spec's
  1e-12 / 448: not used here).
- World sizes 2, 4, 8, 16; ``hidden_dim % (16 / itemsize) == 0``; fp16 / bf16 / fp32 inputs
  (fp32 needs a workspace built with ``use_fp32_lamport``: not used here).
- One-shot or two-shot: the Python heuristic ``_should_use_oneshot``: one-shot while
  ``token_num * hidden_dim * 2 * world_size * itemsize`` is at most {2: 512, 4: 64, 8: 42} MiB
  (measured on B200); one-shot also needs ``token_num * hidden_dim * 2 * world_size`` bytes
  <= ``MAX_COMM_SIZE`` (2 GiB - 2 MiB); two-shot needs ``token_num > world_size``. The workspace
  holds ``token_num * hidden_dim <= max_token_num * hidden_dim`` (its metadata check).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import torch
from torch import Tensor

from fxrewrite.runtime import constraints, providers
from fxrewrite.runtime.ops import quant_block, quant_nvfp4
from fxrewrite.runtime.ops.norm import _rms_norm_fake, check_norm_args, fake_sum
from fxrewrite.runtime.ops.quant import FP8_CAPABILITY, _q, check_scale
from fxrewrite.runtime.providers import Kernel, OpDef

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- references (the spec)


def all_reduce_sum(x: Tensor, group_name: str) -> Tensor:
    """``wait_tensor(all_reduce(x, "sum", group_name))``: what funcol's ``all_reduce`` records."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor.default(c10d.all_reduce.default(x, "sum", group_name))


def all_reduce_add_rms_norm_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str
) -> tuple[Tensor, Tensor]:
    """Returns ``(out, sum)``: ``sum = all_reduce_sum(x, group_name) + residual;
    out = rms_norm(sum, weight, eps)`` (``fxr.fused_add_rms_norm`` of the reduced ``x``)."""
    return torch.ops.fxr.fused_add_rms_norm.default(all_reduce_sum(x, group_name), residual, weight, eps)


def all_reduce_add_rms_norm_quant_fp8_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor, group_name: str
) -> tuple[Tensor, Tensor]:
    """Returns ``(q, sum)``: ``out, sum = all_reduce_add_rms_norm_reference(...)``;
    ``q = (out.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``
    (``fxr.fused_add_rms_norm_quant_fp8`` of the reduced ``x``)."""
    reduced = all_reduce_sum(x, group_name)
    return torch.ops.fxr.fused_add_rms_norm_quant_fp8.default(reduced, residual, weight, eps, scale)


def all_reduce_add_rms_norm_block_quant_fp8_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group: int, group_name: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(q, scales, sum)``: ``fxr.fused_add_rms_norm_block_quant_fp8`` (per-token groups of
    ``group``, ``runtime/ops/quant_block.py``) of the reduced ``x``. No library fuses an
    all-reduce with a block quantization: on CUDA this is the kernel too (NCCL's all-reduce,
    then the fused op's Triton kernel: "nccl+triton" in ``providers.served()``)."""
    reduced = all_reduce_sum(x, group_name)
    return torch.ops.fxr.fused_add_rms_norm_block_quant_fp8.default(reduced, residual, weight, eps, group)


def all_reduce_add_rms_norm_quant_nvfp4_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, global_scale: Tensor, group_name: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(values, scales, sum)``: ``fxr.fused_add_rms_norm_quant_nvfp4`` (``runtime/ops/quant_nvfp4.py``)
    of the reduced ``x``. As for block FP8, no library fuses the all-reduce with it: on CUDA this
    is the kernel too (NCCL's all-reduce, then the fused op's Triton kernel, "nccl+triton")."""
    reduced = all_reduce_sum(x, group_name)
    return torch.ops.fxr.fused_add_rms_norm_quant_nvfp4.default(reduced, residual, weight, eps, global_scale)


# --------------------------------------------------------------------------- fake impls


def _fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str) -> tuple[Tensor, Tensor]:
    total = fake_sum(x, residual)
    return _rms_norm_fake(total, weight, eps), total


def _quant_fake(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor, group_name: str
) -> tuple[Tensor, Tensor]:
    return _q(x), fake_sum(x, residual)


def _without_group_name(fn: Any) -> Any:
    """``fn`` of the fused op's arguments (a check or a fake), called with the all-reduce op's:
    the same followed by ``group_name``."""
    return lambda *args: fn(*args[:-1])


# NCCL's all-reduce, then the fused op's Triton kernel: what that kernel needs, what it returns
_block_quant_check = _without_group_name(quant_block._triton_fused_add_check)
_block_quant_fake = _without_group_name(quant_block._fused_add_fake)
_nvfp4_check = _without_group_name(quant_nvfp4._triton_fused_add_check)
_nvfp4_fake = _without_group_name(quant_nvfp4._fused_add_fake)


# --------------------------------------------------------------------------- the workspace

FLASHINFER_COMM = "flashinfer.comm"
WORLD_SIZES = (2, 4, 8, 16)
ONESHOT_MAX_MIB = {2: 512, 4: 64, 8: 42}  # flashinfer trtllm_ar.py _use_oneshot_heuristics (B200)
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)  # flashinfer trtllm_ar.py: the Lamport buffer's limit
MAX_INPUT_MIB_ENV = "FXREWRITE_AR_FUSION_MAX_MB"
ONESHOT_ENV = "FXREWRITE_AR_FUSION_ONESHOT"
DEFAULT_MAX_INPUT_MIB = 64  # per call: 8192 tokens of a 4096-wide bf16 hidden state


@dataclasses.dataclass
class Workspace:
    """flashinfer's IPC workspace for one process group on one device."""

    rank: int
    world_size: int
    max_elements: int  # token_num * hidden_dim it holds
    pointers: Tensor  # int64 device tensor of the peers' buffer addresses
    metadata: dict[str, Any]
    handles: Any  # the IPC handles: kept alive with the workspace


_WORKSPACES: dict[tuple[str, int], Workspace | str] = {}


def max_input_bytes() -> int:
    """The largest all-reduce input (bytes) the workspace is sized for (env FXREWRITE_AR_FUSION_MAX_MB)."""
    return int(float(os.environ.get(MAX_INPUT_MIB_ENV, DEFAULT_MAX_INPUT_MIB)) * (1 << 20))


def workspace(group_name: str, x: Tensor) -> Workspace | str:
    """The workspace of ``group_name`` on ``x``'s device, created at the first call (collective:
    every rank of the group must call it), or why there is none. Sized for ``max_input_bytes()``
    of ``x``'s dtype and hidden size; created once per process group and device."""
    key = (group_name, x.device.index if x.device.index is not None else torch.cuda.current_device())
    found = _WORKSPACES.get(key)
    if found is not None:
        return found
    if torch.cuda.is_current_stream_capturing():
        return "no workspace yet, and it cannot be created during CUDA graph capture"
    _WORKSPACES[key] = found = _create(group_name, x)
    return found


def _create(group_name: str, x: Tensor) -> Workspace | str:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    comm = providers.library(FLASHINFER_COMM)
    group = _resolve_process_group(group_name)
    rank, world = dist.get_rank(group), group.size()
    hidden = x.shape[-1]
    max_tokens = max(1, max_input_bytes() // (hidden * x.element_size()))
    ws: Workspace | str
    try:
        handles, pointers, metadata = comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            rank, world, max_tokens, hidden, use_fp32_lamport=False, group=group, create_metadata=True
        )
        ws = Workspace(rank, world, max_tokens * hidden, pointers, metadata, handles)
    except Exception as e:  # noqa: BLE001 - reported as the fallback reason, never silent
        ws = f"workspace creation failed: {type(e).__name__}: {e}"
    # every rank must agree, or one would call the IPC kernel while another calls NCCL
    ok = torch.tensor([0 if isinstance(ws, str) else 1], dtype=torch.int32, device=x.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not isinstance(ws, str) and int(ok.item()) == 0:
        ws = "workspace creation failed on another rank"
    if isinstance(ws, str):
        log.warning("fxr::all_reduce_add_rms_norm: %s; NCCL serves it", ws)
    else:
        log.info("flashinfer all-reduce workspace for group %s: rank %d of %d, %d tokens of %d",
                 group_name, rank, world, max_tokens, hidden)
    return ws


def release_workspaces() -> None:
    """Drop every workspace (their memory goes when the last reference does); the next call
    creates a new one. Call on every rank, between steps."""
    comm = providers.library(FLASHINFER_COMM)
    for ws in _WORKSPACES.values():
        if comm is not None and not isinstance(ws, str):
            comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(ws.handles)
    _WORKSPACES.clear()


def use_oneshot(tokens: int, hidden: int, dtype: torch.dtype, world_size: int) -> bool:
    """flashinfer's size rule: one-shot (Lamport, one kernel phase) while the exchanged bytes are
    at most ``ONESHOT_MAX_MIB[world_size]`` and within ``MAX_COMM_SIZE``; two-shot (reduce-scatter
    then all-gather) beyond. Env FXREWRITE_AR_FUSION_ONESHOT=1 / 0 forces one or the other."""
    lamport = tokens * hidden * 2 * world_size
    forced = os.environ.get(ONESHOT_ENV, "")
    if forced in ("0", "1"):
        return forced == "1" and lamport <= MAX_COMM_SIZE
    mib = lamport * torch.empty(0, dtype=dtype).element_size() / (1 << 20)
    return mib <= ONESHOT_MAX_MIB.get(world_size, 0) and lamport <= MAX_COMM_SIZE


# --------------------------------------------------------------------------- kernel constraints


def _check(x: Tensor, residual: Tensor, weight: Tensor, group_name: str, oneshot: bool) -> str | None:
    """What ``trtllm_allreduce_fusion`` needs: one half dtype (weight included), contiguous
    [tokens, hidden] rows, hidden a multiple of 16 bytes and at least 128 vectors (one block of
    four warps per token: narrower rows take a launch shape that was not tried here), a
    supported group size, the token count within the workspace, and this strategy's size rule."""
    reason = check_norm_args(x, weight, residual)
    if reason:
        return reason
    for t in (x, residual):
        if not t.is_contiguous():
            return "input not contiguous"
        if not constraints.is_aligned(t, 16):
            return "address not 16-byte aligned"
    hidden, vec = x.shape[-1], 16 // x.element_size()
    if hidden % vec or hidden // vec < 128:
        return f"hidden {hidden} is not a multiple of {vec} of at least {128 * vec} elements"
    ws = workspace(group_name, x)
    if isinstance(ws, str):
        return ws
    tokens = x.numel() // hidden
    if ws.world_size not in WORLD_SIZES:
        return f"group of {ws.world_size} ranks (the kernel has 2, 4, 8, 16)"
    if x.numel() > ws.max_elements:
        return f"{tokens} tokens x {hidden} exceed the workspace ({ws.max_elements} elements, {MAX_INPUT_MIB_ENV})"
    if oneshot != use_oneshot(tokens, hidden, x.dtype, ws.world_size):
        return "one-shot by size" if not oneshot else "two-shot by size"
    if not oneshot and tokens <= ws.world_size:
        return f"two-shot needs more than {ws.world_size} tokens"
    return None


def _check_norm(oneshot: bool, x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str) -> str | None:
    return _check(x, residual, weight, group_name, oneshot)


def _check_quant(
    oneshot: bool, x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor, group_name: str
) -> str | None:
    return check_scale(x, scale) or _check(x, residual, weight, group_name, oneshot)


# --------------------------------------------------------------------------- kernels


def _fused(
    pattern: str, oneshot: bool, x: Tensor, residual: Tensor, weight: Tensor, eps: float,
    scale: Tensor | None, group_name: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One ``trtllm_allreduce_fusion`` call; returns (norm or FP8 output, sum)."""
    comm = providers.library(FLASHINFER_COMM)
    ws = workspace(group_name, x)
    assert not isinstance(ws, str)
    hidden = x.shape[-1]
    tokens = x.numel() // hidden
    total = torch.empty_like(residual)
    out = torch.empty_like(x) if scale is None else _q(x)
    comm.trtllm_allreduce_fusion(
        allreduce_in=x, world_size=ws.world_size, world_rank=ws.rank, token_num=tokens, hidden_dim=hidden,
        workspace_ptrs=ws.pointers, launch_with_pdl=providers.enable_pdl(x.device),
        trigger_completion_at_end=True, fp32_acc=True,
        pattern_code=getattr(comm.AllReduceFusionPattern, pattern), use_oneshot=oneshot,
        allreduce_out=None, residual_in=residual, residual_out=total,
        norm_out=out if scale is None else None, quant_out=out if scale is not None else None,
        scale_out=None, rms_gamma=weight, rms_eps=eps, scale_factor=scale, layout_code=None,
        metadata=ws.metadata,
    )  # fmt: skip
    return out, total


def _norm_kernel(oneshot: bool, x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str) -> tuple[Tensor, Tensor]:
    return _fused("kARResidualRMSNorm", oneshot, x, residual, weight, eps, None, group_name)


def _quant_kernel(
    oneshot: bool, x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor, group_name: str
) -> tuple[Tensor, Tensor]:
    return _fused("kARResidualRMSNormFP8Quant", oneshot, x, residual, weight, eps, scale, group_name)


def _kernels(run: Any, check: Any, min_capability: tuple[int, int] = (9, 0)) -> tuple[Kernel, ...]:
    """The one-shot and two-shot launches as two kernels: ``served()`` counts each."""
    P = functools.partial
    return tuple(
        Kernel("flashinfer", P(run, one), P(check, one), min_capability, f"flashinfer-{name}", FLASHINFER_COMM)
        for one, name in ((True, "oneshot"), (False, "twoshot"))
    )


# --------------------------------------------------------------------------- the ops

DEFS: tuple[OpDef, ...] = (
    OpDef("all_reduce_add_rms_norm", all_reduce_add_rms_norm_reference, _fake, _kernels(_norm_kernel, _check_norm)),
    OpDef(
        "all_reduce_add_rms_norm_quant_fp8",
        all_reduce_add_rms_norm_quant_fp8_reference,
        _quant_fake,
        _kernels(_quant_kernel, _check_quant, max(FP8_CAPABILITY, (9, 0))),
    ),
    # NCCL's all-reduce, then the fused op's Triton kernel (the reference's own steps, labelled)
    OpDef("all_reduce_add_rms_norm_block_quant_fp8", all_reduce_add_rms_norm_block_quant_fp8_reference, _block_quant_fake,
          (Kernel("triton", all_reduce_add_rms_norm_block_quant_fp8_reference, _block_quant_check, FP8_CAPABILITY,
                  "nccl+triton", quant_block.TRITON_MODULE),)),
    OpDef("all_reduce_add_rms_norm_quant_nvfp4", all_reduce_add_rms_norm_quant_nvfp4_reference, _nvfp4_fake,
          (Kernel("triton", all_reduce_add_rms_norm_quant_nvfp4_reference, _nvfp4_check, FP8_CAPABILITY,
                  "nccl+triton", quant_nvfp4.TRITON_MODULE),)),
)
OPS: tuple[str, ...] = providers.define_all(providers.collectives(DEFS))
