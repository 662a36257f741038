"""What bench/bench_e2e.py times, built alike in its parent and in every child process: the
columns (:class:`Scenario`), the plan derived from the arguments, and the model with its hand-fused
twin and inputs (:func:`prepare`), plain or quantized (``--quant``).

Quantized models (``--quant``), built from the plain one with the bench converters:

- ``fp8``: ``engine_fp8.to_fp8``, static per-tensor FP8 linears (``torch._scaled_mm``), their
  input scales calibrated on a prefill of :data:`CALIBRATION_SEQS` sequences (the first prefill
  column's size); fxrewrite gets ``Config(attention_quant=engine_fp8.ATTENTION_QUANT)``, so the
  quantization of the attention output moves into the attention call;
- ``block-fp8``: ``engine_model_fp8.to_block_fp8``, block FP8 (weights per 128 x 128 tile,
  activations per token and group of 128, ``fxr.linear_block_fp8``); the tiny shape widened to
  ``tiny_fp8`` (every dim a multiple of 128). The same declaration is passed: the attention
  output's block quantization is dynamic, so the attention does not take it (the report's
  reason); it is ``fxr.block_quant_fp8`` alone;
- ``nvfp4``: ``fp8_linears.to_nvfp4_linears``, NVFP4 (e2m1 values per block of 16, e4m3 block
  scales, float32 global input scales calibrated as ``fp8``'s). Its GEMM is a dequantizing
  reference (``F.linear`` of the dequantized input and weight in the model's dtype): NVFP4 GEMMs
  need Blackwell's FP4 tensor cores, so on Hopper this variant shows the fusions and their
  numerics, and its step times are not NVFP4's. The attention output's quantization is NVFP4,
  ``fxr.quant_nvfp4`` alone (the report says why the attention does not take it).

Neither has a hand-fused twin (its linears are not the twin's).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import torch

from engine_model import EngineLlama, ModelConfig, build_model, fused_twin, llama_8b, make_batch, mark_static_metadata, tiny

Batch = dict[str, torch.Tensor]
CHECK_SEED, FILL_SEED, CALIBRATION_SEED = 1234, 7, 99
CALIBRATION_SEQS = 4
QUANTS = {
    "none": "none",
    "fp8": "static per-tensor FP8 (e4m3 weights and activations, calibrated input scales, torch._scaled_mm)",
    "block-fp8": "block FP8 (e4m3 weights per 128 x 128 tile, activations per token and group of 128, fxr.linear_block_fp8)",
    "nvfp4": "NVFP4 (e2m1 values per block of 16, e4m3 block scales, calibrated float32 global scales); the GEMM a "
             "dequantizing reference in the model's dtype (NVFP4 GEMMs need Blackwell): step times are not NVFP4's",
}


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ").replace("|", "/")
    return text[:300] + ("..." if len(text) > 300 else "")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One column: a decode or prefill step."""

    name: str
    kind: str  # "decode" | "prefill"
    size: int  # sequences (decode) or tokens (prefill)
    context: int  # tokens already cached per sequence
    num_seqs: int = 1


def scenarios(shape: str, context: int, prefill_seqs: int) -> list[Scenario]:
    """The columns: decode at batch 1, 8, 64 and two prefill sizes (smaller for ``tiny``)."""
    prefill = (512, 4096) if shape == "8b" else (64, 256)
    ctx = context if shape == "8b" else min(context, 64)
    cols = [Scenario(f"decode {b}", "decode", b, ctx) for b in (1, 8, 64)]
    cols += [Scenario(f"prefill {t}", "prefill", t, 0, min(prefill_seqs, t)) for t in prefill]
    return cols


@dataclasses.dataclass
class Plan:
    """What the parent and every child derive alike from the arguments."""

    cfg: ModelConfig
    cols: list[Scenario]
    max_seqs: int
    max_len: int
    device: torch.device
    dtype: torch.dtype
    quant: str = "none"

    @property
    def capture(self) -> dict[str, tuple[int, ...]]:
        """CUDA-graph sizes: the token counts the columns run, up to 512 (prefill beyond runs
        eagerly, as engines do); decode batch sizes only for the full graph."""
        tokens = sorted({c.size for c in self.cols})
        return {"all": tuple(t for t in tokens if t <= 512), "decode": tuple(c.size for c in self.cols if c.kind == "decode")}

    @property
    def fx_options(self) -> dict[str, Any]:
        """Fields of ``fxrewrite.Config`` the model needs beyond the row's own: the quantized
        engine's declaration of its attention op's FP8-output twin."""
        if self.quant == "none":
            return {}
        from engine_fp8 import ATTENTION_QUANT

        return {"attention_quant": ATTENTION_QUANT}


def make_plan(args: argparse.Namespace) -> Plan:
    quant = getattr(args, "quant", "none")
    if args.shape == "8b":
        cfg = llama_8b()
    elif quant == "block-fp8":
        from engine_model_fp8 import tiny_fp8

        cfg = tiny_fp8()
    else:
        cfg = tiny()
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    cols = scenarios(args.shape, args.context, args.prefill_seqs)
    max_seqs = max(c.size if c.kind == "decode" else c.num_seqs for c in cols)
    max_len = max(c.context + (1 if c.kind == "decode" else c.size) for c in cols)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    return Plan(cfg, cols, max_seqs, max_len, torch.device(args.device), dtype, quant)


def quantize(model: EngineLlama, plan: Plan) -> None:
    """Convert the plain ``model`` to ``plan.quant``'s format, in place (module docstring); its KV
    cache is left zeroed."""
    if plan.quant in ("fp8", "nvfp4"):
        size = min(c.size for c in plan.cols if c.kind == "prefill")
        calibration = make_batch(plan.cfg, "prefill", size, num_seqs=min(CALIBRATION_SEQS, size), max_len=plan.max_len,
                                 device=plan.device, seed=CALIBRATION_SEED)  # fmt: skip
        with torch.no_grad():
            if plan.quant == "fp8":
                from engine_fp8 import to_fp8

                to_fp8(model, calibration)
            else:
                from fp8_linears import to_nvfp4_linears

                to_nvfp4_linears(model.layers, lambda: model(**calibration))
                model.zero_kv_cache()
    elif plan.quant == "block-fp8":
        from engine_model_fp8 import to_block_fp8

        to_block_fp8(model)
    elif plan.quant != "none":
        raise ValueError(f"unknown quantization {plan.quant!r}; known: {list(QUANTS)}")


def weight_bytes(model: EngineLlama) -> int:
    """Bytes of the weights a step reads, each tensor at its own element size (an FP8 model's
    linears are 1 byte per value, their scales 4): parameters and buffers, less the embedding
    (a step reads only its rows), the LM head, the KV caches and the RoPE table."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    skip = ("embed_tokens", "lm_head", "cos_sin_cache")
    return sum(t.numel() * t.element_size() for name, t in tensors
               if not name.startswith(skip) and not name.endswith(("k_cache", "v_cache")))  # fmt: skip


def prepare(plan: Plan) -> tuple[EngineLlama, EngineLlama | str, dict[str, Batch], dict[str, Batch]]:
    """The model (seeded: every process builds the same), its hand-fused twin, the timed
    inputs and the fresh inputs the outputs are checked on."""
    quant = "" if plan.quant == "none" else f", {plan.quant}"
    log(f"building {plan.cfg.num_layers} layers on {plan.device} in {plan.dtype}{quant}; KV cache {plan.max_seqs} x {plan.max_len}")
    model = build_model(plan.cfg, device=plan.device, dtype=plan.dtype, seed=0)
    model.allocate_kv_cache(plan.max_seqs, plan.max_len)
    quantize(model, plan)
    model.fill_kv_cache_random(FILL_SEED)
    twin = _hand_fused(model) if plan.quant == "none" else f"no hand-fused twin: the model is quantized ({plan.quant})"

    def batch(c: Scenario, seed: int) -> Batch:
        b = make_batch(plan.cfg, c.kind, c.size, c.context, num_seqs=c.num_seqs, max_len=plan.max_len, device=plan.device, seed=seed)
        return mark_static_metadata(b)  # the token count as the one dynamic dimension

    return model, twin, {c.name: batch(c, 0) for c in plan.cols}, {c.name: batch(c, CHECK_SEED) for c in plan.cols}


def _hand_fused(model: EngineLlama) -> EngineLlama | str:
    """The hand-fused twin, or why there is none."""
    try:
        import fxrewrite.runtime.ops  # noqa: F401

        missing = [op for op in ("rms_norm", "fused_add_rms_norm_", "linear_silu_and_mul") if not hasattr(torch.ops.fxr, op)]
        return f"no hand-fused twin: fused ops missing: {missing}" if missing else fused_twin(model)
    except Exception as e:  # noqa: BLE001
        return f"no hand-fused twin: {_short(e)}"
