"""bench/bench_ops.py on CPU: the launch-floor kernels run (Triton's interpreter) and compute what
they say; the report's launch section bounds each small-T op by the larger of its two floors."""

from __future__ import annotations

import pytest
import torch

bench_ops = pytest.importorskip("bench_ops")


def test_launch_floor_kernels_run() -> None:
    if bench_ops.triton is None:
        pytest.skip("no Triton")
    t = torch.zeros(1)
    kernels = bench_ops.launch_floor_kernels()
    kernels["empty Triton kernel"](t)
    assert t.item() == 0.0
    kernels["one-element Triton kernel"](t)
    kernels["one-element Triton kernel"](t)
    assert t.item() == 2.0


def test_launch_report_uses_the_larger_floor() -> None:
    rows = [bench_ops.Row("rms_norm_quant_fp8", 8, "triton", "ok", 2.4, 24.0, 100_000, 0.04),
            bench_ops.Row("rms_norm_quant_fp8", 4096, "triton", "ok", 22.0, 380.0, 50_000_000, 18.0)]  # fmt: skip
    lines = bench_ops.launch_report({"empty Triton kernel": 1.5, "one-element Triton kernel": 2.0}, rows)
    text = "\n".join(lines)
    assert "one-element Triton kernel 2.00 us" in text
    assert "| rms_norm_quant_fp8 | 8 | 2.40 | 0.04 | 2.00 | 1.20 |" in text
    assert "| 4096 |" not in text  # T > 64: the HBM floor's own table has it
    assert bench_ops.launch_report({}, rows) == []
