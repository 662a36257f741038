"""Fused custom ops in namespace ``fxr``; importing this package registers them all."""

from fxrewrite.runtime.ops import activation, norm

OPS: tuple[str, ...] = ("rms_norm", "silu_and_mul")

__all__ = ["OPS", "activation", "norm"]
