"""Shared test setup: seeded randomness for every test; GPU tests skipped without CUDA; Triton's
interpreter on machines without CUDA.

Helpers that tests in several folders share live in ``tests/helpers/`` and are imported as
``from helpers.graphs import ...``: pytest (its default "prepend" import mode) puts the folder of
this conftest, ``tests/``, on ``sys.path`` before it imports any test, as it puts each test's own
folder there (``from samples import ...`` in tests/runtime).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without CUDA, Triton kernels run only interpreted, on CPU tensors. The flag must be set
    # before Triton is imported: its own library functions (tl.sum, tl.max) are decorated then.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
