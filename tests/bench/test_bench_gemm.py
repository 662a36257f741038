"""bench/bench_gemm.py on a machine without CUDA: the shapes it times, and a clear exit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_gemm  # noqa: E402


def test_the_projections_are_the_8b_layers() -> None:
    assert bench_gemm.projections() == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                        "down": (4096, 14336)}  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU exit")
def test_without_cuda_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_gemm.main([]) == 2
    assert "needs CUDA" in capsys.readouterr().err
