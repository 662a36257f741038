"""Helpers shared by tests in several folders (imported as ``helpers.<module>``; see tests/conftest.py)."""

from __future__ import annotations

import torch


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the running torch is ``major.minor`` or newer (CI and the CPU machines run 2.13, the
    GPU machine 2.11: a test of what an older torch cannot do skips there, saying so)."""
    return tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (major, minor)
