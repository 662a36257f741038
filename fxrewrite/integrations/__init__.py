"""fxrewrite as the compiler of a serving engine: the engine keeps its graph capture, its
splitting ops, its attention and its CUDA graphs; fxrewrite fuses the graph it hands over.

    engine.py   what every engine hook calls: fuse one engine graph, record its report (per
                process), log it, write it to ``FXREWRITE_REPORT_DIR``
    vllm.py     vLLM: a Dynamo backend for its whole-graph modes, a general plugin that fuses
                the graph vLLM's piecewise backend is about to split, the report from a run
    sglang.py   SGLang: a general plugin (a hook on its piecewise backend) doing the same

Nothing here imports an engine at import time; each engine is an optional extra
(``pip install 'fxrewrite[vllm]'``).
"""

from fxrewrite.integrations.engine import EngineGraph, fuse, reports

__all__ = ["EngineGraph", "fuse", "reports"]
