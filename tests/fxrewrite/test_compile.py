"""``Backend.compile`` / ``fxrewrite.compile``: Python floats become graph constants.

Under ``dynamic=True`` Dynamo lifts a module's float attributes (RMSNorm eps) to CPU scalar
tensors built on every call; ``Backend.compile`` turns Dynamo's ``specialize_float`` on for its
frames, so they are literals guarded by value. Plain ``torch.compile`` drops the backend's hook:
the floats stay lifted, the rewrite still happens, and the backend says why the call is slower.
"""

from __future__ import annotations

import logging

import pytest
import torch

import fxrewrite


class NormLinear(torch.nn.Module):
    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.rand(64) + 0.5)
        self.proj = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.proj(self.weight * h.to(x.dtype))


def host_scalars(backend: fxrewrite.Backend) -> int:
    """Graph inputs the CUDA-graph runner reads on the host (a lifted float each)."""
    return sum(r.stats()["inputs"].get("host", 0) for r in backend.runners)


def full_mode(**kw: object) -> fxrewrite.Backend:
    return fxrewrite.Backend(mode="full", capture_sizes=(4, 8), progress=False, **kw)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def test_backend_compile_makes_floats_constants(caplog: pytest.LogCaptureFixture) -> None:
    model, backend = NormLinear(), full_mode()
    compiled = backend.compile(model)
    x = torch.randn(6, 64)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fxrewrite"):
        torch.testing.assert_close(compiled(x), model(x))
    assert host_scalars(backend) == 0
    assert backend.report.fused_ops() == {"rms_norm": 1, "linear": 1}
    assert "lifted" not in caplog.text
    assert torch._dynamo.config.specialize_float is False  # only while Dynamo runs our frames


def test_a_changed_float_recompiles_instead_of_replaying_stale() -> None:
    model, backend = NormLinear(eps=1e-5), full_mode()
    compiled = backend.compile(model)
    x = torch.randn(4, 64) * 1e-3  # small enough that eps matters
    with torch.no_grad():
        compiled(x)
        model.eps = 1e-2
        torch.testing.assert_close(compiled(x), model(x))
    assert len(backend.graphs) == 2


def test_plain_torch_compile_lifts_floats_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    model, backend = NormLinear(), full_mode()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    x = torch.randn(6, 64)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fxrewrite"):
        torch.testing.assert_close(compiled(x), model(x))
    assert host_scalars(backend) == 1
    assert backend.report.fused_ops() == {"rms_norm": 1, "linear": 1}  # the rewrite does not depend on it
    assert "Dynamo lifted 1 Python floats to graph inputs" in caplog.text
    assert "fxrewrite.compile" in caplog.text


def test_specialize_floats_off_lifts_them_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model, backend = NormLinear(), full_mode(specialize_floats=False)
    compiled = backend.compile(model)
    x = torch.randn(6, 64)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fxrewrite"):
        torch.testing.assert_close(compiled(x), model(x))
    assert host_scalars(backend) == 1
    assert "lifted" not in caplog.text


def test_module_level_compile_returns_the_backend() -> None:
    model = NormLinear()
    compiled, backend = fxrewrite.compile(model, mode="full", capture_sizes=(4,), progress=False)
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert host_scalars(backend) == 0 and backend.report.fused_ops() == {"rms_norm": 1, "linear": 1}
