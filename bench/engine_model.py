"""A Llama-architecture model written the way a serving engine writes it, and its hand-fused twin.

The plain model is what a model author writes before anyone fuses: a flat token batch
``input_ids [T]`` with ``positions [T]``, merged ``qkv_proj`` and ``gate_up_proj`` linears,
RMSNorm, SiLU-and-mul and NeoX RoPE spelled in plain torch, the residual add written next to the
norm that follows it, and attention as one opaque custom op, ``torch.ops.fxbench.attention``,
that writes the step's keys and values into a KV cache and reads the cache back::

    embed -> [ norm -> qkv_proj -> rope -> fxbench.attention -> o_proj
               -> add+norm -> gate_up_proj -> silu*mul -> down_proj -> add ] x L -> norm

The hand-fused twin (``build_model(..., fused=True)`` or :func:`fused_twin`) has the same module
tree and the same weights; only five spots differ, each a call to an op registered by
``fxrewrite.runtime.ops``:

    RMSNorm          ``self.weight * (x.float() * rsqrt(...)).to(dtype)`` -> ``fxr.rms_norm``
    add + RMSNorm    ``x = x + residual; residual = x; norm(x)``        -> ``fxr.fused_add_rms_norm_``
    RoPE             ``cos, sin = cache[positions]; rotate q, k``        -> ``fxr.rotary_embedding``
    gate_up + SiLU-and-mul  ``gate, up = gate_up_proj(x).chunk(2, -1); F.silu(gate) * up``
                     -> ``fxr.linear_silu_and_mul`` (one kernel at decode sizes)
    linears          ``nn.Linear``                                       -> ``fxr.linear`` (the
                     decode-size GEMM, as the rewriter's graphs replayed as CUDA graphs call it)

It is the ceiling the rewriter should reach on the plain model.

KV cache: per layer ``k_cache``, ``v_cache`` buffers of shape ``[max_seqs, max_len, kv_heads,
head_dim]``: one contiguous row per sequence, and **the step's i-th sequence lives in row i**
(a slot-per-request engine whose scheduler packs running sequences into the first rows). A real
engine uses a paged cache and a paged attention kernel; the ones at hand (flashinfer) JIT-compile
for minutes on the GPU machine, so this model keeps a contiguous cache: decode reads it with a
Triton split-KV kernel on CUDA (bench/decode_attention.py), torch SDPA elsewhere; prefill with
torch SDPA (a strided view, no gather).

Step metadata travels as tensors (see :func:`make_batch`), never as Python ints, so a CUDA graph
replayed around the attention op stays valid from step to step:

    slots       [T] int64   flat cache index ``row * max_len + position`` of each new token
    seq_lens    [S] int32   context length of each sequence after this step
    kv_range    [L] int32   ``arange(L)``, L = max(seq_lens) or more: its *length* bounds the keys
                            read, so the bound is a shape, not a host sync
    query_start [S+1] int32 token offsets of the sequences; only a prefill of several sequences
                            needs it (None otherwise)

Under ``dynamic=True`` every input length Dynamo cannot relate to the token count becomes a
symbol of its own; :func:`mark_static_metadata` fixes those (the decode key bound, the sequence
count of a prefill), leaving the token count the one dynamic dimension a CUDA-graph runner
keys on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:  # Triton kernels for CUDA tensors: cache write, split-KV decode (bench/decode_attention.py)
    import decode_attention as _triton
except ImportError:  # no Triton: torch serves every step
    _triton = None


# "torch" makes CUDA steps use the torch path too (to compare); env FXBENCH_ATTENTION at import
KERNELS = os.environ.get("FXBENCH_ATTENTION", "triton")


def _use_triton(t: torch.Tensor) -> bool:
    return _triton is not None and t.is_cuda and KERNELS == "triton"

__all__ = [
    "SPLITTING_OPS",
    "ModelConfig",
    "EngineLlama",
    "attention",
    "build_model",
    "float32_reference",
    "fused_twin",
    "llama_8b",
    "make_batch",
    "mark_static_metadata",
    "tiny",
]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of a Llama-architecture decoder."""

    num_layers: int = 32
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 128256
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    max_positions: int = 8192
    # The LM head is left out by default. Engines apply it outside the captured forward, to the
    # last token of each sequence only; at vocab 128256 its weight is 1 GB of bf16, the same GEMM
    # for every system compared, so leaving it out makes the benchmarks measure what the
    # compilers change. ``EngineLlama.compute_logits`` applies it when it is built.
    lm_head: bool = False


def llama_8b(**overrides: object) -> ModelConfig:
    """Llama-3-8B shape: 32 layers, hidden 4096, MLP 14336, 32 heads, 8 KV heads."""
    return dataclasses.replace(ModelConfig(), **overrides)


def tiny(**overrides: object) -> ModelConfig:
    """A narrow model for CPU tests and compile-time benchmarks (node count, not width)."""
    base = ModelConfig(
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=256,
        rope_theta=10000.0,
        rms_eps=1e-6,
        max_positions=512,
    )
    return dataclasses.replace(base, **overrides)


# --------------------------------------------------------------------------- attention op


def _attend_one(
    q: torch.Tensor, k_row: torch.Tensor, v_row: torch.Tensor, kv_range: torch.Tensor
) -> torch.Tensor:
    """Causal attention of the last ``q.shape[0]`` positions of one sequence over its row.

    q: [Tq, H, d]; k_row, v_row: [L, kv_heads, d] (the first L cache positions). -> [Tq, H, d].
    """
    tq, heads, _ = q.shape
    length, kv_heads, _ = k_row.shape
    group = heads // kv_heads
    # GQA by repeating K/V heads: query head h reads KV head h // group.
    k = k_row.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
    v = v_row.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)
    if tq == length:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True)
    else:  # a prefix is cached already: query t sits at position length - tq + t
        keys = kv_range[:length]
        mask = keys[None, :] <= keys[length - tq :, None]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask)
    return out.squeeze(0).transpose(0, 1)


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor, kv_range: torch.Tensor
) -> torch.Tensor:
    """One query token per sequence, sequence b in cache row b; no sync. The torch path (on CUDA
    the op calls the Triton kernel of bench/decode_attention.py instead): one batched SDPA call;
    the query heads that share a KV head become that head's "query positions", so SDPA needs no
    GQA support and reads K/V straight from the strided cache view:
    q [B, kv, group, d] x k [B, kv, L, d], masked by ``position < seq_lens[b]``.
    """
    batch, heads, dim = q.shape
    rows, kv_heads = k_cache.shape[0], k_cache.shape[2]
    length = kv_range.shape[0]
    # More sequences than cache rows is never a real step (make_batch refuses it); it is a
    # CUDA-graph runner warming up at a size the engine does not run. Read rows modulo then, so
    # the op stays total. Likewise zeros in seq_lens (padding) would mask every key: SDPA would
    # return NaN; a real sequence always has at least its new token.
    rows_read = slice(0, batch) if batch <= rows else torch.arange(batch, device=q.device) % rows
    k = k_cache[rows_read, :length].transpose(1, 2)
    v = v_cache[rows_read, :length].transpose(1, 2)
    mask = (kv_range[None, :] < seq_lens.clamp(min=1)[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, heads // kv_heads, dim), k, v, attn_mask=mask)
    return out.reshape(batch, heads, dim)


def _path(q: torch.Tensor, seq_lens: torch.Tensor, kv_range: torch.Tensor) -> str:
    """Which computation a step needs, from shapes alone: "decode" (one token per sequence),
    "prefill" (one sequence from position 0), "chunk" (one sequence with a cached prefix) or
    "many" (several sequences: a host loop).

    The fake impl takes the same decision. Under Dynamo the comparisons become guards, which
    tie each metadata length to the token count where they are equal: without them a recompile
    gives every input read only by this opaque op a symbol of its own.
    """
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    if num_seqs == num_tokens:
        return "decode"
    if num_seqs == 1:
        return "prefill" if kv_range.shape[0] == num_tokens else "chunk"
    return "many"


@torch.library.custom_op("fxbench::attention", mutates_args=("k_cache", "v_cache"))
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_range: torch.Tensor,
    query_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write k, v [T, kv_heads, d] at ``slots``, then attend q [T, heads, d] causally. -> [T, heads, d].

    Capture-safe (no host sync; shapes decide the path) for decode and for a one-sequence
    prefill; a prefill of several sequences reads their lengths on the host and must run
    eagerly (it does, between the pieces of a piecewise graph).
    """
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    path = _path(q, seq_lens, kv_range)
    triton = _use_triton(k) and k_cache.is_contiguous() and v_cache.is_contiguous()
    if path == "decode" and triton:  # one launch writes the step's keys and values, and attends
        return _triton.decode_attention(q, k_cache, v_cache, seq_lens, kv_range.shape[0], store=(k, v, slots))
    if triton:
        _triton.store_kv(k, v, k_cache, v_cache, slots)
    else:
        k_cache.view(-1, kv_heads, dim).index_copy_(0, slots, k)
        v_cache.view(-1, kv_heads, dim).index_copy_(0, slots, v)
    if path == "decode":
        out = _decode(q, k_cache, v_cache, seq_lens, kv_range)
    elif path in ("prefill", "chunk"):
        length = kv_range.shape[0]
        out = _attend_one(q, k_cache[0, :length], v_cache[0, :length], kv_range)
    else:
        out = _attend_many(q, k_cache, v_cache, seq_lens, kv_range, query_start)
    return out.contiguous()  # the layout the fake impl promises, whatever SDPA backend ran


def _attend_many(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_range: torch.Tensor,
    query_start: torch.Tensor | None,
) -> torch.Tensor:
    """A prefill of several sequences: one causal attention per sequence, lengths read on the host."""
    if query_start is None:
        raise ValueError("fxbench::attention: a prefill of several sequences needs query_start")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("fxbench::attention: a prefill of several sequences cannot be captured")
    out = torch.empty_like(q)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for row, length in enumerate(lens):
        lo, hi = starts[row], starts[row + 1]
        out[lo:hi] = _attend_one(q[lo:hi], k_cache[row, :length], v_cache[row, :length], kv_range)
    return out


@attention.register_fake
def _(q, k, v, k_cache, v_cache, slots, seq_lens, kv_range, query_start=None):  # type: ignore[no-untyped-def]
    torch._check(slots.shape[0] == q.shape[0], lambda: "one cache slot per new token")
    _path(q, seq_lens, kv_range)
    return q.new_empty(q.shape)


# What ``Config.splitting_ops`` must name. The model calls the overload (``.default``), not the
# packet, so that the captured graph and every lower level show the same target.
SPLITTING_OPS: tuple[object, ...] = (torch.ops.fxbench.attention.default,)


# --------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """RMSNorm as a model author writes it; with ``residual``, adds it first and returns both.

    ``norm(x) -> out``; ``norm(x, residual) -> (norm(x + residual), x + residual)``.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


class FusedRMSNorm(RMSNorm):
    """The same norm through ``fxr.rms_norm`` / ``fxr.fused_add_rms_norm_``.

    The add + norm is the in-place op, as a kernel author calls sgl-kernel's
    ``fused_add_rmsnorm``: ``residual += x; x = norm(residual)``. Both inputs are dead after the
    call (``x`` is a sublayer's fresh output, ``residual`` the running sum), and the functional
    ``fxr.fused_add_rms_norm`` would pay an extra add kernel: this is the ceiling.
    """

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return torch.ops.fxr.rms_norm.default(x, self.weight, self.eps)
        out, total = torch.ops.fxr.fused_add_rms_norm_.default(x, residual, self.weight, self.eps)
        return out, total


class FusedLinear(nn.Linear):
    """``nn.Linear`` through ``fxr.linear`` (its GEMM chosen by the rows of each call)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.fxr.linear.default(x, self.weight, self.bias)


class SiluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: ``silu(gate) * up``."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE in float32. x [T, heads, d]; cos, sin [T, d/2] float32."""
    dtype = x.dtype
    x = x.float()
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(dtype)


class Attention(nn.Module):
    """qkv_proj -> RoPE -> ``fxbench.attention`` (writes and reads this layer's KV cache) -> o_proj.

    ``rope`` is ``(cos, sin)`` ``[T, d/2]`` float32, or for the hand-fused twin ``(positions,
    cos_sin_cache)``, which ``fxr.rotary_embedding`` reads itself.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        linear = FusedLinear if fused else nn.Linear
        self.qkv_proj = linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False, dtype=dtype)
        self.o_proj = linear(self.q_size, cfg.hidden_size, bias=False, dtype=dtype)
        empty = torch.empty(0, 0, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
        self.register_buffer("k_cache", empty, persistent=False)
        self.register_buffer("v_cache", empty.clone(), persistent=False)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        kv_range: torch.Tensor,
        query_start: torch.Tensor | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.fused:
            q, k = torch.ops.fxr.rotary_embedding.default(rope[0], q, k, rope[1], True)
        else:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = torch.ops.fxbench.attention.default(
            q, k, v, self.k_cache, self.v_cache, slots, seq_lens, kv_range, query_start
        )
        return self.o_proj(out.view(-1, self.q_size))


class MLP(nn.Module):
    """gate_up_proj -> SiLU-and-mul -> down_proj; hand-fused, the first two are one
    ``fxr.linear_silu_and_mul``."""

    def __init__(self, cfg: ModelConfig, fused: bool, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.fused = fused
        linear = FusedLinear if fused else nn.Linear
        self.gate_up_proj = linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, dtype=dtype)
        self.act_fn = SiluAndMul()  # hand-fused: unused, part of the gated GEMM
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate_up = self.gate_up_proj
            return self.down_proj(torch.ops.fxr.linear_silu_and_mul.default(x, gate_up.weight, gate_up.bias))
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer carrying ``(hidden, residual)``: each residual add happens in the
    norm that follows it, where an engine fuses it."""

    def __init__(self, cfg: ModelConfig, fused: bool, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        norm = FusedRMSNorm if fused else RMSNorm
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_eps, dtype)
        self.self_attn = Attention(cfg, dtype, fused)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_eps, dtype)
        self.mlp = MLP(cfg, fused, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        kv_range: torch.Tensor,
        query_start: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, slots, seq_lens, kv_range, query_start)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class EngineLlama(nn.Module):
    """The whole decoder: ``forward(input_ids, positions, <metadata>) -> hidden [T, hidden]``.

    Build with :func:`build_model`; call :meth:`allocate_kv_cache` before the first step.
    """

    def __init__(self, cfg: ModelConfig, fused: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.fused = fused
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, fused, dtype) for _ in range(cfg.num_layers))
        self.norm = (FusedRMSNorm if fused else RMSNorm)(cfg.hidden_size, cfg.rms_eps, dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype) if cfg.lm_head else None
        # [max_positions, head_dim] float32: cos of the head_dim/2 frequencies, then their sin.
        self.register_buffer("cos_sin_cache", torch.empty(cfg.max_positions, cfg.head_dim), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        kv_range: torch.Tensor,
        query_start: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.fused:
            rope = (positions, self.cos_sin_cache)
        else:
            cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
            rope = (cos, sin)
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, slots, seq_lens, kv_range, query_start)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on the rows given (engines pass the last token of each sequence)."""
        if self.lm_head is None:
            raise RuntimeError("built without an LM head: ModelConfig(lm_head=True)")
        return self.lm_head(hidden)

    def allocate_kv_cache(self, max_seqs: int, max_len: int) -> None:
        """Zeroed per-layer caches ``[max_seqs, max_len, kv_heads, head_dim]`` in the weights' dtype."""
        weight = self.embed_tokens.weight
        cfg = self.config
        for layer in self.layers:
            attn = layer.self_attn
            shape = (max_seqs, max_len, cfg.num_kv_heads, cfg.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
            attn.v_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)

    @torch.no_grad()
    def zero_kv_cache(self) -> None:
        """Every cache slot back to zero (after a calibration step wrote some)."""
        for layer in self.layers:
            layer.self_attn.k_cache.zero_()
            layer.self_attn.v_cache.zero_()

    @torch.no_grad()
    def fill_kv_cache_random(self, seed: int = 0) -> None:
        """Random keys and values in every cache slot: a decode context without running a prefill."""
        g = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for layer in self.layers:
            for cache in (layer.self_attn.k_cache, layer.self_attn.v_cache):
                cache.copy_(torch.randn(cache.shape, generator=g, device=cache.device, dtype=torch.float32))


def rope_cache(cfg: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """``[max_positions, head_dim]`` float32: ``cat(cos(p * f), sin(p * f))``, f = theta^(-2i/d),
    in float64 on the CPU with one thread, then moved to ``device``. The same bits in every
    process: the compile cache compares this table bit for bit (the RoPE fold reads it), and
    with two threads torch 2.13's CPU cos gave the rows the second thread computes other bits in
    about one process in four (up to 7e-9 apart in float64), so the table varied by process."""
    half = cfg.head_dim // 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        freqs = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(cfg.max_positions, dtype=torch.float64)[:, None] * freqs[None, :]
        table = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    finally:
        torch.set_num_threads(threads)
    return table.to(device)


@torch.no_grad()
def init_weights(model: EngineLlama, seed: int) -> None:
    """Seeded random weights on the model's device: linears N(0, 1/fan_in), embedding N(0, 1),
    norm weights 1 + N(0, 0.1^2) (not all ones, so a dropped weight multiply shows)."""
    device = model.embed_tokens.weight.device
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif p.dim() == 2 and "embed_tokens" not in name:
            p.copy_(noise / math.sqrt(p.shape[1]))
        else:
            p.copy_(noise)
    model.cos_sin_cache.copy_(rope_cache(model.config, device))


def build_model(
    cfg: ModelConfig,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    fused: bool = False,
) -> EngineLlama:
    """Allocate on ``device`` without default init (fast at 8B) and fill with seeded weights."""
    if fused:
        import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
    with torch.device("meta"):
        model = EngineLlama(cfg, fused=fused, dtype=dtype)
    model = model.to_empty(device=device)
    init_weights(model, seed)
    return model.eval().requires_grad_(False)


def fused_twin(model: EngineLlama) -> EngineLlama:
    """The hand-fused model sharing ``model``'s parameters and buffers (KV caches included).

    Shared, not copied: at 8B a copy costs 15 GB. Call after :meth:`EngineLlama.allocate_kv_cache`.
    """
    import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)

    with torch.device("meta"):
        twin = EngineLlama(model.config, fused=True)
    for (name, src), (twin_name, dst) in zip(model.named_modules(), twin.named_modules()):
        assert name == twin_name, (name, twin_name)
        dst._parameters.update(src._parameters)
        dst._buffers.update(src._buffers)
    return twin.eval()


@contextlib.contextmanager
def _as_float32(module: torch.nn.Module) -> Iterator[None]:
    """Swap the module's floating parameters and buffers for float32 copies; restore them after.
    8-bit values (an FP8 checkpoint's weights) stay as stored: their float32 scales are exact."""
    saved = []
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in store.items():
                if t is not None and t.is_floating_point() and t.dtype != torch.float32 and t.dtype.itemsize > 1:
                    saved.append((store, name, t))
                    store[name] = t.float()
    try:
        yield
    finally:
        for store, name, t in saved:
            store[name] = t


def float32_reference(model: EngineLlama, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's output computed in float32, one block at a time (an 8B float32 copy would
    not fit beside the bf16 one): each top-level block runs on float32 copies of its weights
    and KV cache, which are dropped after it. The real cache is left untouched. A quantized
    model (``bench/fp8_linears.py``) keeps its FP8 weights and still quantizes its activations:
    every value that is not FP8 is float32."""
    blocks = [model.embed_tokens, *model.layers, model.norm]
    stacks: dict[int, contextlib.ExitStack] = {}

    def enter(m: torch.nn.Module, _args: Any) -> None:
        stacks[id(m)] = contextlib.ExitStack()
        stacks[id(m)].enter_context(_as_float32(m))

    def leave(m: torch.nn.Module, _args: Any, _out: Any) -> None:
        stacks.pop(id(m)).close()

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
    try:
        return model(**batch).float()
    finally:
        for h in handles:
            h.remove()


def make_batch(
    cfg: ModelConfig,
    kind: str,
    size: int,
    context: int = 0,
    *,
    num_seqs: int = 1,
    max_len: int,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Inputs and metadata of one step, as keyword arguments of :meth:`EngineLlama.forward`.

    kind="prefill": ``size`` new tokens split over ``num_seqs`` sequences (the last takes the
    remainder), each with ``context`` tokens already cached. kind="decode": ``size`` sequences of
    one new token each at position ``context``. Sequence i is in cache row i; ``max_len`` is the
    cache's row length (slots are ``row * max_len + position``).
    """
    if kind == "decode":
        new = [1] * size
    elif kind == "prefill":
        if not 1 <= num_seqs <= size:
            raise ValueError(f"num_seqs={num_seqs} must be in [1, {size}]")
        new = [size // num_seqs] * num_seqs
        new[-1] += size - sum(new)
    else:
        raise ValueError(f"kind must be 'prefill' or 'decode', not {kind!r}")
    if context + max(new) > max_len:
        raise ValueError(f"context {context} + {max(new)} new tokens exceed the cache row length {max_len}")
    positions = torch.cat([torch.arange(context, context + n) for n in new])
    rows = torch.cat([torch.full((n,), row) for row, n in enumerate(new)])
    seq_lens = torch.tensor([context + n for n in new], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    batch = {
        "input_ids": torch.randint(0, cfg.vocab_size, (len(positions),), generator=g),
        "positions": positions,
        "slots": rows * max_len + positions,
        "seq_lens": seq_lens,
        "kv_range": torch.arange(int(seq_lens.max()), dtype=torch.int32),
    }
    if kind == "prefill" and num_seqs > 1:
        batch["query_start"] = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return {name: t.to(device) for name, t in batch.items()}


def mark_static_metadata(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mark the metadata lengths that are not the token count static (``torch._dynamo.mark_static``)
    and return the batch.

    Under ``dynamic=True`` Dynamo gives each such length a symbol of its own; a CUDA-graph runner
    keys on one, the token count. Decode: ``kv_range`` (the key bound: one compiled graph per
    bound, as an engine buckets its maximum context). Prefill of several sequences:
    ``seq_lens`` and ``query_start`` (one graph per sequence count). A one-sequence prefill from
    position 0 needs nothing: its lengths are 1 (specialized) or the token count itself.
    """
    num_tokens = batch["input_ids"].shape[0]
    for name in ("seq_lens", "kv_range", "query_start"):
        t = batch.get(name)
        if t is not None and t.shape[0] not in (0, 1, num_tokens):
            torch._dynamo.mark_static(t, 0)
    return batch
