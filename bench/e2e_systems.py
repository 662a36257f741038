"""bench_e2e's rows: how each system builds the step it times (``SYSTEMS``, in the order they
run), from eager and Inductor to fxrewrite in each mode with its switches on and off. Each build
takes the model, its hand-fused twin (or why there is none) and the capture sizes, and returns the
step and fxrewrite's backend (None for the other systems)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from engine_model import SPLITTING_OPS, EngineLlama

Step = Callable[..., torch.Tensor]
# (model, hand-fused twin or why none, capture sizes[, fxrewrite Config fields the model needs]) -> (step, backend)
Build = Callable[..., tuple[Step, Any]]


@dataclasses.dataclass
class System:
    """One row: how to build its step function, which kinds of step it runs."""

    key: str
    label: str
    build: Build  # (model, twin or why none, capture sizes, Config fields) -> (step, fxrewrite backend or None)
    kinds: tuple[str, ...] = ("decode", "prefill")
    needs_cuda: bool = False
    inductor: bool = False
    warm_from: str | None = None  # a restart of this row: its process starts with that row's caches


def _target(m: EngineLlama | str) -> EngineLlama:
    """The model, or raise the reason there is none (the hand-fused twin may be missing)."""
    if isinstance(m, str):
        raise RuntimeError(m)
    return m


def _without_rope() -> list[Any]:
    """The default library of a piecewise graph less the RoPE rules: the "with and without this
    rule" rows."""
    from fxrewrite.backend import default_rule_groups
    from fxrewrite.rewrites import rotary

    return [r for _, rules in default_rule_groups("piecewise") for r in rules if r not in rotary.RULES]


class Unguarded:
    """A step through ``Backend.unguarded``, as an engine would hold it: the first call of each
    batch shape runs the compiled model (compile, capture), later calls run the graph it ran,
    without Dynamo's frame evaluation. The shape key stands for the engine's own choice of
    graph (decode or prefill, one token or more)."""

    def __init__(self, backend: Any, compiled: Step) -> None:
        self.backend, self.compiled, self.graphs = backend, compiled, {}

    def __call__(self, **batch: torch.Tensor) -> torch.Tensor:
        key = tuple(t.shape for t in batch.values())
        fast = self.graphs.get(key)
        if fast is not None:
            return fast(**batch)
        out = self.compiled(**batch)
        self.graphs[key] = self.backend.unguarded(self.compiled, **batch)
        return out


def _fx(fused: bool, mode: str, rules: list[Any] | str | None, sizes: str, unguarded: bool = False,
        gemm: bool = False, pdl: bool = True, attention: str | None = None, provider: str | None = None,
        off: tuple[str, ...] = (), **fields: Any) -> Build:  # fmt: skip
    """fxrewrite in ``mode`` (the rules named in ``off`` refused at every site, as
    ``Config.match_filter`` would be told by a user; ``fields``: more ``Config`` fields)."""

    def refuse(m: Any) -> str | None:
        return "off in this row" if getattr(m.rule, "name", m.rule) in off else None

    def build(model: EngineLlama, twin: EngineLlama | str, capture: dict[str, tuple[int, ...]],
              options: dict[str, Any] | None = None) -> tuple[Step, Any]:  # fmt: skip
        import fxrewrite

        nonlocal rules
        rules = {"no-rope": _without_rope}[rules]() if isinstance(rules, str) else rules
        config = fxrewrite.Config(mode=mode, splitting_ops=SPLITTING_OPS, capture_sizes=capture[sizes], gemm_fusion=gemm,
                                  match_filter=refuse if off else None, **{**(options or {}), **fields})  # fmt: skip
        backend = fxrewrite.Backend(config=config, rules=rules)
        step = backend.compile(_target(twin if fused else model))
        step = Unguarded(backend, step) if unguarded else step
        return (step if pdl and attention is None and provider is None else _launched(step, pdl, attention, provider)), backend

    return build


def _launched(step: Step, pdl: bool, attention: str | None, provider: str | None = None) -> Step:
    """``step`` with its kernels launched (and captured) otherwise, the side-by-side measures of
    programmatic dependent launch: ``pdl=False``, none of them so (``triton_gemm.without_pdl``);
    ``attention``, the attention op's decode kernel launched so (``decode_attention.launched``);
    and of a provider: ``provider``, an override of fxrewrite's (``providers.overriding``)."""
    from fxrewrite.runtime import providers, triton_gemm

    def call(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            if not pdl:
                stack.enter_context(triton_gemm.without_pdl())
            if attention is not None:
                import decode_attention

                stack.enter_context(decode_attention.launched(attention))
            if provider is not None:
                stack.enter_context(providers.overriding(provider))
            return step(*args, **kwargs)

    return call


def _eager(fused: bool) -> Build:
    return lambda model, twin, *_: (_target(twin if fused else model), None)


def _inductor(mode: str | None) -> Build:
    return lambda model, *_: (torch.compile(model, mode=mode, fullgraph=True), None)


def _dynamo_alone() -> Build:
    return lambda model, *_: (torch.compile(model, backend="eager", fullgraph=True), None)


# Every row, in the order they run: what the goals compare first, in case the budget runs out.
SYSTEMS = (
    System("eager", "eager", _eager(False)),
    System("fxrewrite", "fxrewrite piecewise", _fx(False, "piecewise", None, "all")),
    System("fused-piecewise", "hand-fused piecewise", _fx(True, "piecewise", [], "all")),
    System("fxrewrite-full", "fxrewrite full", _fx(False, "full", None, "all")),
    System("fused-full", "hand-fused full", _fx(True, "full", [], "all")),
    System("full-norewrite", "full, no rewrites", _fx(False, "full", [], "all")),
    System("fxrewrite-full-warm", "fxrewrite full, cache warm", _fx(False, "full", None, "all"), warm_from="fxrewrite-full"),
    System("fxrewrite-full-ug", "fxrewrite full, unguarded", _fx(False, "full", None, "all", unguarded=True)),
    System("fxrewrite-norope", "fxrewrite piecewise, RoPE rule off", _fx(False, "piecewise", "no-rope", "all")),
    System("fxrewrite-full-norope", "fxrewrite full, RoPE rule off", _fx(False, "full", "no-rope", "decode"),
           kinds=("decode",)),  # fmt: skip
    # --quant fp8: the FP8 linears on cuBLASLt's _scaled_mm at every size, not the decode kernel,
    # and the MLP's activation + quantization a kernel of its own after gate_up (the row before
    # the gated kernel: its "torch" provider would be its eager reference); then the decode
    # kernel without the gated one
    System("fxrewrite-full-cublaslt", "fxrewrite full, FP8 GEMMs on cuBLASLt",
           _fx(False, "full", None, "all", provider="linear_fp8=torch", off=("linear_fp8_silu_and_mul_quant",))),
    System("fxrewrite-full-ungated", "fxrewrite full, FP8 gate_up and its activation apart",
           _fx(False, "full", None, "all", off=("linear_fp8_silu_and_mul_quant",))),  # fmt: skip
    System("fxrewrite-full-gemm", "fxrewrite full, norms, adds and RoPE in the GEMMs (Config.gemm_fusion)",
           _fx(False, "full", None, "all", gemm=True)),  # fmt: skip
    # --quant fp8: the norms' quantization in the reading FP8 GEMMs' prologues too
    System("fxrewrite-full-gemm-fp8norm", "fxrewrite full, gemm_fusion, FP8 norms in the GEMMs (Config.fp8_norm_prologue)",
           _fx(False, "full", None, "all", gemm=True, fp8_norm_prologue=True)),  # fmt: skip
    System("fxrewrite-full-gemm-nopdl", "fxrewrite full, gemm_fusion, no programmatic dependent launch",
           _fx(False, "full", None, "all", gemm=True, pdl=False)),  # fmt: skip
    # the attention op's decode kernel without its L2 prefetch, and launched plainly (bench/decode_attention.py)
    System("fxrewrite-full-gemm-attn-pdl", "fxrewrite full, gemm_fusion, attention under PDL without prefetch",
           _fx(False, "full", None, "all", gemm=True, attention="pdl"), kinds=("decode",)),  # fmt: skip
    System("fxrewrite-full-gemm-attn-plain", "fxrewrite full, gemm_fusion, attention launched plainly",
           _fx(False, "full", None, "all", gemm=True, attention="plain"), kinds=("decode",)),  # fmt: skip
    System("inductor-cg", "inductor + CUDA graphs", _inductor("reduce-overhead"), needs_cuda=True, inductor=True),
    # Inductor's autotuned GEMMs and Triton configs, with CUDA graphs (issue 30's comparison)
    System("inductor-ma", "inductor max-autotune", _inductor("max-autotune"), needs_cuda=True, inductor=True),
    System("piecewise-norewrite", "piecewise, no rewrites", _fx(False, "piecewise", [], "all")),
    System("inductor", "inductor", _inductor(None), inductor=True),
    System("fused-eager", "hand-fused eager", _eager(True)),
    # Dynamo's tracing with nothing behind it: the floor of any Dynamo backend's first call
    System("dynamo-eager", "Dynamo alone (backend eager)", _dynamo_alone()),
)
SYSTEM_BY_KEY = {s.key: s for s in SYSTEMS}
