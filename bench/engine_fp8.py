"""The engine model (bench/engine_model.py) with static per-tensor FP8 linears, and its attention
op's FP8-output twin: what an engine serving an FP8 checkpoint runs.

:func:`to_fp8` turns every linear of the decoder layers into :class:`Fp8Linear`: the weight
quantized offline (one scale per tensor, ``amax / 448``), the input quantized with a static scale
calibrated on a sample step, then one scaled GEMM, as FP8 checkpoints with per-tensor scales
are served::

    xq = (x.float() / input_scale).clamp(-448, 448).to(float8_e4m3fn)      # quant_fp8_static
    y = torch._scaled_mm(xq, w_fp8.t(), scale_a=input_scale, scale_b=weight_scale, out_dtype=x.dtype)

So the graph quantizes after the input norm (qkv_proj), after the add + norm (gate_up_proj),
after SiLU-and-mul (down_proj) and after attention (o_proj): the last one, ``quant_fp8_static(
fxbench.attention(...).view(T, H * d), o_proj.input_scale)``, is what
``fxrewrite.rewrites.attention_quant`` moves into the attention call, given the declaration
:data:`ATTENTION_QUANT` (``Config(attention_quant=ATTENTION_QUANT)``). Its twin,
``fxbench::attention_quant_fp8``, takes the attention op's arguments plus ``output_scale``:
on CUDA at decode, the Triton split-KV kernel (bench/decode_attention.py) quantizes the float32
result in its combine epilogue; elsewhere the op quantizes after the torch path's SDPA (the
unfused pair, bit for bit). :class:`Fp8Linear` (``bench/fp8_linears.py``) takes any ``nn.Linear``'s
weight and bias; :func:`float32_reference` is ``engine_model``'s, which keeps FP8 values as stored.
"""

from __future__ import annotations

import torch

import engine_model
from engine_model import _path, _triton, _use_triton, float32_reference
from fp8_linears import Fp8Linear, to_fp8_linears
from fxrewrite.rewrites.attention_quant import AttentionQuant
from fxrewrite.runtime.ops.quant import FP8_DTYPE, quant_fp8_static

__all__ = ["ATTENTION_QUANT", "Fp8Linear", "attention_quant_fp8", "float32_reference", "to_fp8"]


@torch.library.custom_op("fxbench::attention_quant_fp8", mutates_args=("k_cache", "v_cache"))
def attention_quant_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_range: torch.Tensor,
    output_scale: torch.Tensor,
    query_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """``quant_fp8_static(fxbench.attention(q, k, ..., query_start), output_scale)``: the
    attention output [T, heads, d] in float8_e4m3fn. ``output_scale``: one float32 element."""
    contiguous = k_cache.is_contiguous() and v_cache.is_contiguous()
    if _path(q, seq_lens, kv_range) == "decode" and _use_triton(k) and contiguous:
        return _triton.decode_attention(q, k_cache, v_cache, seq_lens, kv_range.shape[0], store=(k, v, slots),
                                        out_scale=output_scale)  # fmt: skip
    out = engine_model.attention(q, k, v, k_cache, v_cache, slots, seq_lens, kv_range, query_start)
    return quant_fp8_static(out, output_scale)


@attention_quant_fp8.register_fake
def _(q, k, v, k_cache, v_cache, slots, seq_lens, kv_range, output_scale, query_start=None):  # type: ignore[no-untyped-def]
    torch._check(slots.shape[0] == q.shape[0], lambda: "one cache slot per new token")
    _path(q, seq_lens, kv_range)
    return q.new_empty(q.shape, dtype=FP8_DTYPE)


# What ``Config.attention_quant`` names for this engine: ``fxbench.attention`` has an FP8 twin.
ATTENTION_QUANT: tuple[AttentionQuant, ...] = (
    AttentionQuant(torch.ops.fxbench.attention.default, torch.ops.fxbench.attention_quant_fp8.default, "output_scale"),
)


@torch.no_grad()
def to_fp8(model: engine_model.EngineLlama, calibration: dict[str, torch.Tensor]) -> engine_model.EngineLlama:
    """Replace the decoder layers' linears by :class:`Fp8Linear`, in place, and return ``model``.

    Each input scale is ``amax / 448`` of what the linear read on ``calibration`` (one step,
    keyword arguments of ``model.forward``; a prefill of a few sequences calibrates best), with
    headroom of 2x for other steps (``fp8_linears.to_fp8_linears``). The KV caches are zeroed
    after the calibration step."""
    to_fp8_linears(model.layers, lambda: model(**calibration))
    model.zero_kv_cache()
    return model
