"""fxrewrite.tolerances: the per-dtype tolerances and the comparison verification reports with."""

from __future__ import annotations

import torch

from fxrewrite.tolerances import TOLERANCES, compare, tolerance


def test_compare_says_what_differs() -> None:
    t = torch.tensor([1.0, 2.0, float("nan"), float("inf")])
    assert compare(t, t.clone()) is None
    assert compare(t + 1e-7, t) is None
    why = compare(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]))
    assert why == "max abs error 0.5 > tol 3e-05 (fp32)"
    assert compare(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])).startswith("NaN at 1")
    assert compare(t.bfloat16(), t) == "dtype bf16 != fp32"
    assert compare(t[:2], t[:3]) == "shape (2,) != (3,)"
    b = torch.tensor([1.0, 100.0], dtype=torch.bfloat16)
    assert compare(b * 1.01, b) is None  # within bf16's 2e-2
    assert compare(b * 1.1, b).endswith("(bf16)")


def test_fp8_and_integer_tolerances() -> None:
    assert tolerance(torch.float8_e4m3fn) == (0.25, 0.25)
    assert tolerance(torch.int32) == (0.0, 0.0)
    assert compare(torch.tensor([1, 2]), torch.tensor([1, 3])) == "max abs error 1 > tol 0 (i64)"


def test_a_table_given_replaces_the_default() -> None:
    loose = {**TOLERANCES, torch.float32: (0.5, 0.5)}
    assert compare(torch.tensor([1.0, 2.4]), torch.tensor([1.0, 2.0]), loose) is None
    assert tolerance(torch.float32, loose) == (0.5, 0.5) and tolerance(torch.float32) == (1e-5, 1e-5)
