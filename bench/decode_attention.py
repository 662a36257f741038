"""Split-KV decode attention ("flash decoding") over the engine model's per-row KV cache, in Triton.

The engine model's decode step has one query token per sequence, sequence b in cache row b,
``heads // kv_heads`` query heads per KV head. Torch SDPA over the masked cache (a KV head's
query heads as its "query positions") parallelizes over (sequence, KV head) and query blocks,
few programs for a 132-SM H100 at small batch: it reads the step's keys at about a quarter of
the copy bandwidth at batch 8 (bench/bench_attention.py). Here each (sequence, KV head) is cut
into ``splits`` slices of the key range, one program each:

    grid (batch * kv_heads, splits); a program loads its KV head's query heads as one
    [group, dim] tile, walks its slice of the row's first ``seq_lens[b]`` keys in blocks with
    an online softmax, and writes its output and log-sum-exp (float32); then it counts itself
    in (an atomic add per sequence and KV head), and the program that stores the last slice
    merges them, weights exp(lse_s - max lse), and writes the result (one launch, no combine
    kernel; with one split the program writes the result directly)

``splits`` depends on shapes only (batch, kv heads, the key bound ``length``), so a CUDA graph
captures a fixed launch; the lengths are read on the device. Sequences past the cache's rows
read row ``b % rows``, as the torch path does (a runner warming up a size the engine never runs).

With ``store=(k, v, slots)`` the partial kernel also writes the step's keys and values into the
cache (the programs of split 0, one per sequence and KV head); a program whose slice holds the
slot written walks the cache before and after it and takes the new key and value from ``k``,
``v`` (one extra softmax step, no per-block work): no program reads another's write, and the
engine model's attention is one launch, not three. :func:`store_kv` writes keys and values
alone (prefill), one launch for both caches.

On Hopper the decode kernel is a programmatic dependent launch, as fxrewrite launches its decode
GEMMs (``triton_gemm.launch_pdl``; off with ``FXREWRITE_PDL=0``), and as flashinfer's kernels can
be: inside a CUDA graph its programs are scheduled while the GEMM that makes q, k and v drains,
prefetch their slices of the cached keys and values into L2 (no output of that GEMM; where the
step's keys and values fit ``Tuning.prefetch_bytes``), then wait for it; each lets the next kernel
launch once its walk is done. :func:`launched` picks the launch for bench_e2e's side-by-side rows.

This file imports Triton at the top; :mod:`engine_model` imports it only where Triton is
installed and uses it for CUDA tensors, torch elsewhere (``engine_model.KERNELS = "torch"``, or
env ``FXBENCH_ATTENTION=torch``, forces torch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from fxrewrite.runtime import triton_gemm

FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # float8_e4m3fn's largest finite value


@triton.jit
def _walk(q, m, total, acc, k_row, v_row, k_sn, v_sn, lo, hi, scale, d,
          BLOCK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Online softmax over the cached keys [lo, hi) of one row, in blocks."""
    for n0 in range(lo, hi, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        valid = n < hi
        k = tl.load(k_row + n[:, None] * k_sn + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_row + n[:, None] * v_sn + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return m, total, acc


@triton.jit
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, o_ptr, lse_ptr, nk_ptr, nv_ptr, slots_ptr, out_ptr, scale_ptr, count_ptr,
    q_sb, q_sh, k_sr, k_sn, k_sh, v_sr, v_sn, v_sh, nk_sb, nk_sh, nv_sb, nv_sh, out_sb, out_sh,
    rows, kv_heads, length, chunk, scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
    SPLITS: tl.constexpr, PRECISION: tl.constexpr, STORE: tl.constexpr, QUANT: tl.constexpr,
    PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):  # fmt: skip
    pid, split = tl.program_id(0), tl.program_id(1)
    b, kvh = pid // kv_heads, pid % kv_heads
    row = b % rows
    # the lengths (and slots) are step inputs, copied in before the graph's first kernel: under
    # PDL every kernel waits for its predecessor before it lets the next launch, so only the
    # kernel just before (the one making q, k, v) may still run here
    seq_len = tl.minimum(tl.maximum(tl.load(lens_ptr + b), 1), length)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    g, d = tl.arange(0, GROUP_PAD), tl.arange(0, DIM)
    k_row = k_ptr + row * k_sr + kvh * k_sh
    v_row = v_ptr + row * v_sr + kvh * v_sh
    if PDL:
        if PREFETCH:  # the cached keys and values are no output of the kernel before: into L2 meanwhile
            _prefetch_l2(k_row, k_sn, start, end, DIM)
            _prefetch_l2(v_row, v_sn, start, end, DIM)
        tl.extra.cuda.gdc_wait()  # q and the step's key and value: the kernel before may still write them
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
    if STORE:
        # contiguous caches: a slot is row * max_len + position. Split 0 writes the new key and
        # value; every program reads the cache around that position and takes the new key and
        # value from the inputs, so none reads another's write.
        slot = tl.load(slots_ptr + b).to(tl.int64)
        k_new = tl.load(nk_ptr + b * nk_sb + kvh * nk_sh + d)
        v_new = tl.load(nv_ptr + b * nv_sb + kvh * nv_sh + d)
        if split == 0:
            tl.store(k_ptr + slot * k_sn + kvh * k_sh + d, k_new)
            tl.store(v_ptr + slot * v_sn + kvh * v_sh + d, v_new)
        new = (slot - row * (k_sr // k_sn)).to(tl.int32)  # its position in this row
        cut = tl.minimum(tl.maximum(new, start), end)
        m, total, acc = _walk(q, m, total, acc, k_row, v_row, k_sn, v_sn, start, cut, scale, d, BLOCK, PRECISION)
        if (new >= start) & (new < end):
            s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
            m_new = tl.maximum(m, s)
            alpha, p = tl.exp(m - m_new), tl.exp(s - m_new)
            total = total * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
            m = m_new
        m, total, acc = _walk(q, m, total, acc, k_row, v_row, k_sn, v_sn, tl.maximum(cut, tl.minimum(new + 1, end)), end,
                              scale, d, BLOCK, PRECISION)  # fmt: skip
    else:
        m, total, acc = _walk(q, m, total, acc, k_row, v_row, k_sn, v_sn, start, end, scale, d, BLOCK, PRECISION)
    if PDL:  # the next kernel (o_proj) may be scheduled now; it waits for this one's stores
        tl.extra.cuda.gdc_launch_dependents()
    keep = g < GROUP
    if SPLITS == 1:
        _store_out(out_ptr, scale_ptr, b * out_sb + heads * out_sh, d, acc / total[:, None], keep, QUANT)
    else:
        # an empty slice (its start past the sequence's length) has total 0: weight 0 below
        part = (b * kv_heads * GROUP + heads) * SPLITS + split
        tl.store(o_ptr + part[:, None] * DIM + d[None, :], acc / tl.maximum(total, 1e-30)[:, None], mask=keep[:, None])
        tl.store(lse_ptr + part, tl.where(total > 0, m + tl.log(total), float("-inf")), mask=keep)
        tl.debug_barrier()  # every thread's slice stored before the count says so (release)
        if tl.atomic_add(count_ptr + pid, 1) == SPLITS - 1:  # acq_rel: the last slice of (b, kvh)
            _merge_slices(o_ptr, lse_ptr, out_ptr, scale_ptr, part - split, b * out_sb + heads * out_sh, d, keep,
                          SPLITS, GROUP_PAD, DIM, QUANT)  # fmt: skip
            tl.atomic_xchg(count_ptr + pid, 0)  # zero again for the next launch (a CUDA graph's replay)


@triton.jit
def _prefetch_l2(row_ptr, stride, lo, hi, DIM: tl.constexpr):
    """Prefetch into L2 the 16-bit vectors ``row_ptr + n * stride``, n in [lo, hi), of ``DIM``
    elements each: one address per 128-byte line."""
    for n0 in range(lo, hi, 64):
        n = n0 + tl.arange(0, 64)
        lines = tl.arange(0, DIM // 64) * 64
        ptrs = tl.where((n < hi)[:, None], row_ptr + n[:, None].to(tl.int64) * stride + lines[None, :], row_ptr)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                                  pack=1)  # fmt: skip


@triton.jit
def _store_out(out_ptr, scale_ptr, rows, d, out, keep, QUANT: tl.constexpr):
    """Store [GROUP_PAD, DIM] float32 outputs at ``out_ptr + rows``; ``QUANT``: FP8 with a static
    scale, the float32 value / scale, clamped to +-448, rounded to nearest even."""
    if QUANT:
        out = tl.clamp(tl.math.div_rn(out, tl.load(scale_ptr)), -FP8_MAX, FP8_MAX)
    tl.store(out_ptr + rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=keep[:, None])


@triton.jit
def _merge_slices(o_ptr, lse_ptr, out_ptr, scale_ptr, first, rows, d, keep,
                  SPLITS: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
    """The slices' outputs merged, each weighted by exp(lse_s - max lse), by the program that
    stored the last of them; the others' stores are read past L1 (``.cg``)."""
    top = tl.load(lse_ptr + first, mask=keep, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLITS):
        top = tl.maximum(top, tl.load(lse_ptr + first + s, mask=keep, other=0.0, cache_modifier=".cg"))
    num = tl.zeros([GROUP_PAD, DIM], tl.float32)
    den = tl.zeros([GROUP_PAD], tl.float32)
    for s in tl.static_range(SPLITS):
        w = tl.exp(tl.load(lse_ptr + first + s, mask=keep, other=0.0, cache_modifier=".cg") - top)
        o = tl.load(o_ptr + (first + s)[:, None] * DIM + d[None, :], mask=keep[:, None], other=0.0, cache_modifier=".cg")
        num += o * w[:, None]
        den += w
    _store_out(out_ptr, scale_ptr, rows, d, num / den[:, None], keep, QUANT)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, k_st, k_sh, v_st, v_sh,
                     HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, DIM: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    h, d = tl.arange(0, HEADS_PAD), tl.arange(0, DIM)
    keep = (h < HEADS)[:, None]
    cached = slot * (HEADS * DIM) + h[:, None] * DIM + d[None, :]
    tl.store(kc_ptr + cached, tl.load(k_ptr + t * k_st + h[:, None] * k_sh + d[None, :], mask=keep), mask=keep)
    tl.store(vc_ptr + cached, tl.load(v_ptr + t * v_st + h[:, None] * v_sh + d[None, :], mask=keep), mask=keep)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """``k_cache.view(-1, kv_heads, dim)[slots] = k`` and the same for v, in one launch: k, v
    [T, kv_heads, dim] with unit stride along dim (views of a merged projection are fine);
    caches contiguous."""
    tokens, heads, dim = k.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_kv_kernel[(tokens,)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), DIM=dim)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch parameters (bench_attention.py --sweep compares others)."""

    block: int = 64  # keys per step of a program's walk
    per_sm: int = 2  # programs to aim for per SM
    warps: int = 4
    stages: int = 2
    # under PDL, a launch whose cached keys and values take at most this many bytes prefetches
    # them into L2 before it waits for the kernel before (the step's larger batches would only
    # evict each other's lines)
    prefetch_bytes: int = 48 << 20


LAUNCHES = ("pdl+prefetch", "pdl", "plain")
_LAUNCH: list[str] = []  # inside launched()


@contextlib.contextmanager
def launched(how: str) -> Iterator[None]:
    """The decode kernel launched (and captured) ``how`` inside, one of :data:`LAUNCHES`
    (default the first, where the device has PDL: fxrewrite's ``triton_gemm.launch_pdl``):
    bench_e2e's side-by-side rows."""
    if how not in LAUNCHES:
        raise ValueError(f"launched({how!r}): one of {LAUNCHES}")
    _LAUNCH.append(how)
    try:
        yield
    finally:
        _LAUNCH.pop()


def _launch(q: torch.Tensor, k_cache: torch.Tensor, batch: int, length: int, tuning: Tuning) -> dict[str, bool]:
    """The decode kernel's launch options: PDL where fxrewrite launches its GEMMs so (Hopper),
    the L2 prefetch where the keys and values read fit ``tuning.prefetch_bytes``."""
    how = _LAUNCH[-1] if _LAUNCH else LAUNCHES[0]
    if how == "plain" or not triton_gemm.launch_pdl(q.device):
        return {}
    _, _, kv_heads, dim = k_cache.shape
    read = 2 * batch * length * kv_heads * dim * k_cache.element_size()
    prefetch = how == "pdl+prefetch" and k_cache.element_size() == 2 and dim % 64 == 0 and read <= tuning.prefetch_bytes
    return {"PDL": True, "launch_pdl": True, "PREFETCH": prefetch}


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _arrivals(device: torch.device, n: int) -> torch.Tensor:
    """The partial kernel's arrival counts, one per (sequence, KV head), zero between launches
    (the merging program zeroes its own): one buffer per device, kept, so a CUDA graph's replay
    finds it zeroed without a memset. Made on the first call (a runner's warm-up, before capture)."""
    have = _ARRIVALS.get(device)
    if have is None or have.numel() < n:
        have = _ARRIVALS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return have


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def split_plan(batch: int, kv_heads: int, length: int, device: torch.device, tuning: Tuning = Tuning()) -> tuple[int, int]:
    """(splits, keys per split): enough programs to fill the device, slices of whole blocks."""
    want = triton.cdiv(tuning.per_sm * _sms(device), batch * kv_heads)
    want = max(1, min(want, triton.cdiv(length, tuning.block)))
    chunk = triton.cdiv(triton.cdiv(length, want), tuning.block) * tuning.block
    return triton.cdiv(length, chunk), chunk


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor, length: int,
    tuning: Tuning = Tuning(), store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, heads, dim] (one token per sequence) over cache rows ``b % rows``:
    keys ``[0, min(seq_lens[b], length))`` (at least one) of k_cache / v_cache
    [rows, max_len, kv_heads, dim]. -> [B, heads, dim], contiguous, q's dtype.

    ``store=(k, v, slots)``: first write k, v [B, kv_heads, dim] at the flat cache slots
    ``slots`` [B] (``row * max_len + position``; the caches must be contiguous), as
    :func:`store_kv` would, in the same launch.

    ``out_scale`` (one float32 element): the output in float8_e4m3fn, quantized in the merging
    program's epilogue from the float32 result: ``clamp(out / out_scale, -448, 448)``, rounded
    to nearest even (the unfused pair rounds to q's dtype first, then divides)."""
    batch, heads, dim = q.shape
    rows, _, kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if store is not None:
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("decode_attention(store=...) needs contiguous caches")
        new_k, new_v, slots = (t if t.stride(-1) == 1 else t.contiguous() for t in store)
    else:  # not read: STORE is off
        new_k, new_v, slots = k_cache, v_cache, seq_lens
    group = heads // kv_heads
    splits, chunk = split_plan(batch, kv_heads, length, q.device, tuning)
    o_part = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    quant = out_scale is not None
    out = torch.empty(batch, heads, dim, dtype=torch.float8_e4m3fn if quant else q.dtype, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _partial_kernel[(batch * kv_heads, splits)](
        q, k_cache, v_cache, seq_lens, o_part, lse, new_k, new_v, slots, out, out_scale if quant else lse,
        _arrivals(q.device, batch * kv_heads),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), out.stride(0), out.stride(1),
        rows, kv_heads, length, chunk, dim**-0.5,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), DIM=dim, BLOCK=tuning.block,
        SPLITS=splits, PRECISION=precision, STORE=store is not None, QUANT=quant, num_warps=tuning.warps,
        num_stages=tuning.stages, **_launch(q, k_cache, batch, length, tuning),
    )  # fmt: skip
    return out
