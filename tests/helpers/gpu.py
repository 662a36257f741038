"""Fixtures of the GPU op tests (test_ops_gpu.py, test_moe_gpu.py, test_moe_route_gpu.py), imported
by the modules that use them: provider counters zeroed and the override cleared around every test
(autouse in those modules only), a CUDA generator seeded by the test's id; and :func:`force`, one
provider for every op (the test skipped where that provider is not importable)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import pytest
import torch

from fxrewrite.runtime import providers


@pytest.fixture(autouse=True)
def fresh_counts() -> Iterator[None]:
    """Each test counts its own calls and starts with no provider override."""
    providers.reset_counts()
    yield
    providers.configure(None)
    providers.reset_counts()


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CUDA generator seeded by the test's id: each case draws its own, reproducible inputs."""
    return torch.Generator(device="cuda").manual_seed(zlib.crc32(request.node.nodeid.encode()))


def force(provider: str) -> None:
    """Every op to ``provider`` (:func:`providers.configure`); skip the test where it is not importable."""
    if not providers.available(provider):
        pytest.skip(f"{provider} is not importable here: {providers._REGISTRY.import_errors.get(provider)}")
    providers.configure(provider)
