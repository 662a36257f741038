"""Configuration of the backend: one frozen dataclass, environment overrides read once."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from fxrewrite.split import resolve_op, target_matches

Mode = Literal["none", "piecewise", "full"]

DEFAULT_SPLITTING_OPS: tuple[Any, ...] = (
    torch.nn.functional.scaled_dot_product_attention,
    torch._C._nn.scaled_dot_product_attention,
)


def default_capture_sizes(max_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 256, then every 16 up to ``max_size``."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, min(max_size, 256) + 1, 8))
    sizes += list(range(272, max_size + 1, 16))
    return tuple(sizes)


def _default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fxrewrite``, or ``~/.cache/fxrewrite``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fxrewrite"


def _with_quantized_twins(splitting_ops: Sequence[Any], attention_quant: Sequence[Any]) -> tuple[Any, ...]:
    """``splitting_ops`` and the declared FP8-output twin of each of them (a fused attention is
    still attention: the graph is cut at it as at the op it replaces)."""
    ops = tuple(splitting_ops)
    resolved = [resolve_op(s) for s in ops]
    twins = [d.quant_op for d in attention_quant
             if d.quant_op not in ops and any(r is not None and target_matches(d.op, r) for r in resolved)]  # fmt: skip
    return ops + tuple(twins)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything the backend is told. Environment variables fill fields left at None.

    rules:           rules to apply; None means the default library (``fxrewrite.rewrites``).
    extra_rules:     user rules applied after the defaults.
    dump_dir:        write ``NN.<pass>.before.py`` / ``.after.py`` here (env FXREWRITE_DUMP_DIR).
    verify:          check every distinct matched site numerically at compile time; on unless
                     False or env FXREWRITE_VERIFY=0 (it costs about 20 ms on a 32-layer llama:
                     one check per distinct site signature, bench/RESULTS.md).
    merge_siblings:  merge linears that read the same input into one GEMM.
    lint:            ``graph.lint()`` after every pass (costs about a tenth of the rewrite time).
    near_miss_min:   a failed match is reported as a near miss when it got at least this
                     fraction of the pattern's operations right.
    mode:            "none" (run eagerly), "piecewise" (split at splitting ops, CUDA graph per
                     piece), "full" (one CUDA graph for the whole graph).
    splitting_ops:   call targets the graph is split at (attention).
    attention_quant: the engine's attention ops that have a twin writing FP8 output
                     (``fxrewrite.rewrites.attention_quant.AttentionQuant``): a static FP8
                     quantization of such an op's output moves into the call. The twin of a
                     splitting op is added to ``splitting_ops`` by :meth:`resolved`.
    capture_sizes:   token counts to capture; None means ``default_capture_sizes(max_capture_size)``.
    pad_inputs:      pad graph inputs along the token dimension up to the next captured size.
    match_filter:    called with each checked match before it is applied; returns None to go
                     ahead or a reason to refuse (bisection uses it; verification is another).
                     A rule's match is a ``fxrewrite.match.Match``, a fusion pass's site a
                     ``fxrewrite.passes.FusionMatch``; both have ``rule`` and ``anchor``.
    provider:        kernel provider override: "sgl_kernel", "flashinfer", "torch", or per op
                     "rms_norm=flashinfer,silu_and_mul=torch" (env FXREWRITE_PROVIDER).
    specialize_floats: Python floats the model reads (RMSNorm eps, attention scale) become
                     constants of the graph, guarded by value: Dynamo's ``specialize_float`` is
                     on while this backend compiles and runs (Inductor does the same under CUDA
                     graphs). A float that changes recompiles. False lets Dynamo lift them to CPU
                     scalar tensors under ``dynamic=True``: one tensor built per float per call
                     (about 1 ms a step for a 32-layer Llama's 65 eps values, bench/RESULTS.md).
    max_positions:   rows of the RoPE cos/sin cache folded from tables the model computes (from
                     ``inv_freq``); positions must stay below it. Tables the model indexes (an
                     engine's cache) keep their own row count.
    sequence_parallel_min_tokens: tensor parallelism: from this many rows on, a fused all-reduce
                     + add + RMSNorm chain reduce-scatters, normalizes this rank's rows and
                     all-gathers (``rewrites/sequence_parallel.py``); below it, the fused
                     all-reduce. None (default): off, as in the engines that ship it (vLLM:
                     opt-in; vLLM-Ascend: from 1000 tokens); 1024 is the value to start from,
                     and ``bench/bench_tp.py`` measures it.
    async_tp:        with ``sequence_parallel_min_tokens``: the GEMM before each sharded site and
                     the GEMM after it fused with its reduce-scatter and all-gather (on CUDA
                     the rows go through symmetric memory on the copy engines while the GEMMs
                     run; ``rewrites/async_tp.py``, ``runtime/ops/async_tp.py``). Off by default.
    async_tp_overlap_min_tokens: with ``async_tp``, where the GEMMs on both sides of a site
                     fuse: from this many rows on, each GEMM splits by the ranks' rows so that
                     the copies run under the GEMM halves; below it, whole GEMMs with one kernel
                     between them that sums, norms and exchanges the rows over NVLink (the
                     halves cost more than they hide: bench/RESULTS.md, issue 32).
    gemm_fusion:     in modes ``piecewise`` and ``full``: the decode GEMMs take in the small ops
                     around them (``rewrites/linear_fused.py``, ``linear_rotary.py``,
                     ``norm_hand_off.py``): RMSNorm as a prologue or the hand-off of the add-GEMM
                     before, the residual add and RoPE as epilogues, 5 kernels a Llama layer at
                     decode instead of 9. Off by default (issue 30, bench/RESULTS.md).
    gemm_fusion_max_tokens: with ``gemm_fusion``, the token counts it serves: the graph is
                     rewritten twice, with ``gemm_fusion`` for the capture sizes up to this many
                     tokens and without it for the larger ones (and calls run eagerly beyond the
                     largest), each size replaying the graph that is faster at it
                     (:mod:`fxrewrite.runtime.by_size`). Default 16: above 16 rows the fused
                     GEMMs become cuBLAS and row kernels, one launch more per site than the
                     add + norm kernel they replace. None: one graph, ``gemm_fusion`` at every
                     size. A graph of static shapes, or one whose capture sizes all lie on one
                     side, is rewritten once.
    fp8_norm_prologue: with ``gemm_fusion``, in a static FP8 layer: the add + RMSNorm +
                     quantization between two FP8 GEMMs in them, the producing GEMM's hand-off
                     and the quantization in each reading GEMM's prologue (pass
                     ``hand_off_norm_quant``). Off by default: on the H100 at the 8B shape each
                     reading GEMM's programs quantize the whole input again, which costs more than
                     the norm kernel it removes (decode 1: 3.457 ms a step against 3.388;
                     bench/RESULTS.md, issue 30).
    cache:           keep rewritten graphs on disk and load them in later processes instead of
                     running the passes (:mod:`fxrewrite.cache`); on unless False or env
                     FXREWRITE_CACHE=0. Not read while ``dump_dir`` is set (dumps need the passes).
    cache_dir:       where (env FXREWRITE_CACHE_DIR; default ``~/.cache/fxrewrite``); Triton's
                     cache goes to ``<cache_dir>/triton`` unless TRITON_CACHE_DIR is set.
    strict:          a pass that raises fails the compile (env FXREWRITE_STRICT=1). Off: the
                     graph goes on as the pass found it, without that pass, and the report
                     says which pass raised, at which node, and what (``Report.failures``).
    strict_capture:  modes piecewise and full: raise when a piece cannot be captured (a capture
                     hazard, a capture that fails) or a call has shapes the runner cannot serve;
                     off, such a piece or call runs eagerly and the report says why
                     (``eager_pieces``). Unset: as ``strict`` (env FXREWRITE_STRICT=1 turns both on).
    """

    rules: Sequence[Any] | None = None
    extra_rules: Sequence[Any] = ()
    dump_dir: str | None = None
    verify: bool | None = None
    merge_siblings: bool = True
    lint: bool = True
    near_miss_min: float = 0.5
    mode: Mode = "none"
    splitting_ops: Sequence[Callable[..., Any] | Any] = DEFAULT_SPLITTING_OPS
    attention_quant: Sequence[Any] = ()
    capture_sizes: Sequence[int] | None = None
    max_capture_size: int = 512
    pad_inputs: bool = True
    match_filter: Callable[[Any], str | None] | None = None
    provider: str | None = None
    progress: bool = True
    specialize_floats: bool = True
    max_positions: int = 32768
    sequence_parallel_min_tokens: int | None = None
    async_tp: bool = False
    async_tp_overlap_min_tokens: int = 2048
    gemm_fusion: bool = False
    gemm_fusion_max_tokens: int | None = 16
    fp8_norm_prologue: bool = False
    cache: bool | None = None
    cache_dir: str | None = None
    strict: bool | None = None
    strict_capture: bool | None = None

    def resolved(self) -> Config:
        """Fill unset fields from the environment and defaults."""
        env = os.environ
        if self.sequence_parallel_min_tokens is not None and self.sequence_parallel_min_tokens < 1:
            raise ValueError(f"sequence_parallel_min_tokens={self.sequence_parallel_min_tokens}: at least 1, or None (off)")
        if self.gemm_fusion_max_tokens is not None and self.gemm_fusion_max_tokens < 1:
            raise ValueError(f"gemm_fusion_max_tokens={self.gemm_fusion_max_tokens}: at least 1, or None (every size)")
        if self.async_tp_overlap_min_tokens < 1:
            raise ValueError(f"async_tp_overlap_min_tokens={self.async_tp_overlap_min_tokens}: at least 1")
        if self.async_tp and self.sequence_parallel_min_tokens is None:
            raise ValueError("async_tp fuses the collectives of sequence parallelism: set sequence_parallel_min_tokens too")
        strict = self.strict if self.strict is not None else env.get("FXREWRITE_STRICT", "0") not in ("", "0")
        sizes = tuple(self.capture_sizes) if self.capture_sizes is not None else default_capture_sizes(self.max_capture_size)
        return dataclasses.replace(
            self,
            dump_dir=self.dump_dir if self.dump_dir is not None else env.get("FXREWRITE_DUMP_DIR") or None,
            verify=self.verify if self.verify is not None else env.get("FXREWRITE_VERIFY", "1") not in ("", "0"),
            provider=self.provider if self.provider is not None else env.get("FXREWRITE_PROVIDER") or None,
            cache=self.cache if self.cache is not None else env.get("FXREWRITE_CACHE", "1") not in ("", "0"),
            strict=strict,
            cache_dir=self.cache_dir or env.get("FXREWRITE_CACHE_DIR") or str(_default_cache_dir()),
            strict_capture=self.strict_capture if self.strict_capture is not None else strict,
            splitting_ops=_with_quantized_twins(self.splitting_ops, self.attention_quant),
            capture_sizes=sizes,
        )
