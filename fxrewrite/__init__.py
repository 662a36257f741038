"""fxrewrite: rewrite TorchDynamo graphs into fused kernels, without Inductor."""
