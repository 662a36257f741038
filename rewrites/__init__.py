"""The rule library (installed as ``fxrewrite.rewrites``): which subgraphs become which fused op.

Families export plain lists; the backend's pipeline applies them in a fixed order of passes
(``fxrewrite.backend.pipeline``). Nothing registers itself at import time.
"""

from fxrewrite.rewrites import activation, collective, linear, norm, rotary

__all__ = ["activation", "collective", "linear", "norm", "rotary"]
