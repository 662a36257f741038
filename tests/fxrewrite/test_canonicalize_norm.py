"""LayerNorm's canonical forms (fxrewrite/canonicalize_norm.py): every spelling of the library
call is one ``aten.layer_norm.default`` with every argument spelled out, every unbiased=False /
correction=0 variance one ``aten.var.correction``; numerics equal eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxrewrite.canonicalize_norm import LAYER_NORM, VAR
from fxrewrite.rule import trace
from fxrewrite.testing import Compiled, assert_counts, check_rewrite

N = 16


def canon(fn: object, *inputs: torch.Tensor, dynamic: bool = True) -> Compiled:
    """Capture with no rules (canonicalize + cleanup only), outputs against eager."""
    return check_rewrite(fn, *inputs, rules=[], dynamic=dynamic)


def args_of(r: Compiled, target: object) -> list[tuple[tuple, dict]]:
    return [(n.args, dict(n.kwargs)) for n in r.graph.graph.nodes if n.op == "call_function" and n.target is target]


class Spellings(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.plain = torch.nn.LayerNorm(N, eps=1e-6), torch.nn.LayerNorm(N, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w, b = self.ln.weight, self.ln.bias
        return (self.ln(x), self.plain(x), F.layer_norm(x, (N,), w, b, 1e-6), torch.layer_norm(x, [N], w, b, 1e-6),
                F.layer_norm(x, normalized_shape=(N,), bias=b, weight=w, eps=1e-6), F.layer_norm(x, x.shape[-1:]))


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_layer_norm_spellings_are_one_call(dynamic: bool) -> None:
    r = canon(Spellings(), torch.randn(2, 3, N), dynamic=dynamic)
    assert_counts(r.counts_before(), {"torch.nn.functional.layer_norm": 5, "torch.layer_norm": 1})
    assert_counts(r.counts(), {"aten.layer_norm": 6}, absent=["torch.nn.functional.layer_norm", "torch.layer_norm"])
    found = args_of(r, LAYER_NORM)
    assert all(len(a) == 6 and a[5] is True and not kw for a, kw in found)
    assert [a[4] for a, _ in found] == [1e-6, 1e-5, 1e-6, 1e-6, 1e-6, 1e-5]  # eps: default filled in
    assert [(a[2] is None, a[3] is None) for a, _ in found] == [(False, False), (True, True)] + [(False, False)] * 3 + [
        (True, True)]
    for a, _ in found:  # the shape a list of sizes: an int, or a symbolic size's node (x.shape[-1:])
        assert isinstance(a[1], list) and len(a[1]) == 1


def test_variance_spellings_are_one_call() -> None:
    def variances(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.var(-1, keepdim=True, unbiased=False), x.var(dim=-1, correction=0, keepdim=True),
                torch.var(x, 1, False, True), x.var(-1), torch.var(x, dim=[-1], correction=1), x.var(1, True),
                x.var())  # fmt: skip

    r = canon(variances, torch.randn(4, N))
    found = args_of(r, VAR)
    assert [(a[1], kw) for a, kw in found] == [
        ([-1], {"correction": 0, "keepdim": True}), ([-1], {"correction": 0, "keepdim": True}),
        ([-1], {"correction": 0, "keepdim": True}), ([-1], {"correction": 1}), ([-1], {"correction": 1}),
        ([-1], {"correction": 1}),
    ]  # fmt: skip
    assert_counts(r.counts(), {"method.var": 1})  # over every value: kept as written


def test_patterns_spell_it_as_the_graph_does() -> None:
    def pattern(x, w, b, eps):  # type: ignore[no-untyped-def]
        v = x.var(-1, keepdim=True, unbiased=False)
        return torch.layer_norm(x, [N], w, b, eps) + v

    gm = trace("p", "pattern", pattern, {"eps": None})
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets[:2] == [VAR, LAYER_NORM]
    ln = next(n for n in gm.graph.nodes if n.target is LAYER_NORM)
    assert len(ln.args) == 6 and ln.args[1] == [N] and ln.args[5] is True
