"""bench/bench_gemm.py on a machine without CUDA: the shapes it times, and a clear exit."""

from __future__ import annotations

import pytest
import torch

import bench_gemm


def test_the_projections_are_the_8b_layers() -> None:
    assert bench_gemm.projections() == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                        "down": (4096, 14336)}  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU exit")
def test_without_cuda_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_gemm.main([]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_the_three_ways_to_run_gate_up_with_its_activation_agree() -> None:
    """On CPU each way runs the ops' references: all three compute ``silu(gate) * up``."""
    x, w = torch.randn(3, 64), torch.randn(96, 64) * 0.1
    gate, up = (x @ w.t()).chunk(2, dim=-1)
    for name, fn in bench_gemm.GATED_WAYS.items():
        torch.testing.assert_close(fn(x, w), torch.nn.functional.silu(gate) * up, msg=name)
