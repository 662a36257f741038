"""The rule library: which subgraphs become which fused op (installed as ``fxrewrite.rewrites``)."""
