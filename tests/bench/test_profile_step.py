"""bench/profile_step.py's count of kernels per layer, on stand-in profiler events (the script
itself needs a GPU)."""

from __future__ import annotations

import types

import torch

from profile_step import kernels_per_layer


def event(name: str, us: float, device: torch.autograd.DeviceType = torch.autograd.DeviceType.CUDA) -> object:
    return types.SimpleNamespace(name=name, device_type=device, time_range=types.SimpleNamespace(elapsed_us=lambda: us))


def test_kernels_per_layer_counts_device_events_per_step_and_layer() -> None:
    """Two steps of two layers: 4 GEMMs and 2 attention kernels a layer, a final norm a step;
    the host-side events are not kernels."""
    steps, layers = 2, 2
    events = ([event("_skinny_linear_kernel", 40.0)] * (4 * layers * steps) + [event("_partial_kernel", 8.0)] * (
        2 * layers * steps) + [event("rms_norm", 2.0)] * steps + [event("cudaGraphLaunch", 5.0, torch.autograd.DeviceType.CPU)])  # fmt: skip
    text = kernels_per_layer(events, steps, layers)
    assert text.splitlines()[1] == "kernels per step: 13 (6.50 per layer over 2 layers), 0.354 ms of kernel time"
    assert "| _skinny_linear_kernel | 8 | 4.00 | 320.0 |" in text and "| rms_norm | 1 | 0.50 | 2.0 |" in text
    assert "cudaGraphLaunch" not in text
