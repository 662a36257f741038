"""What runs: fused custom ops and CUDA graphs (installed as ``fxrewrite.runtime``)."""
