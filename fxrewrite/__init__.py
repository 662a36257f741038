"""fxrewrite: rewrite TorchDynamo graphs into fused kernels and CUDA graphs, without Inductor.

    import fxrewrite
    backend = fxrewrite.Backend()
    compiled = backend.compile(model)  # torch.compile(fullgraph=True, dynamic=True), floats constant
"""

from fxrewrite.backend import Backend, compile, pipeline
from fxrewrite.config import Config
from fxrewrite.precompile import GuardFailure, Precompiled, StaleArtifact, load, warm_start
from fxrewrite.report import Report
from fxrewrite.rewrites.attention_quant import AttentionQuant
from fxrewrite.rule import Bindings, InPlace, Rule, RuleError, Scalar

__all__ = ["AttentionQuant", "Backend", "Bindings", "Config", "GuardFailure", "InPlace", "Precompiled", "Report", "Rule",
           "RuleError", "Scalar", "StaleArtifact", "compile", "load", "pipeline", "warm_start"]
