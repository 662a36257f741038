"""Test parameters over HF transformers families, imported as ``helpers.families``: a family the
installed transformers lacks is skipped with the reason, not failed (families come and go
between releases: the GPU machine runs transformers 5.17, which has no ``kolibri1``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pytest


def missing(family: str, cls: str | None = None) -> str | None:
    """Why ``family`` cannot be built with the installed transformers, or None: no transformers,
    no causal-LM entry ``family`` in its auto mapping (what ``bench/coverage.py`` builds), or,
    given ``cls``, no class of that name."""
    try:
        import transformers as tf
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return "transformers is not installed"
    if cls is not None:
        return None if cls in _names() else f"transformers {tf.__version__} has no {cls}"
    if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"transformers {tf.__version__} has no causal-LM family {family!r}"
    return None


def family_param(
    family: str, *values: Any, id: str | None = None, cls: str | None = None, marks: Sequence[Any] = ()  # noqa: A002
) -> Any:
    """``pytest.param(family, *values, id=id, marks=marks)``, skipped where :func:`missing` says why."""
    reason = missing(family, cls)
    return pytest.param(family, *values, id=id, marks=[*marks, *([pytest.mark.skip(reason=reason)] if reason else [])])


def in_turn(family: int, pair: int, families: int, pairs: int) -> list[Any]:
    """Marks for the case (``family``-th family, ``pair``-th dtype/mode pair) of a family x pair
    matrix: the default run takes the pairs in turn, family i in pair j where
    ``(j - i) % min(families, pairs) == 0``, so it checks every family and every pair at least
    once; the other cases are ``exhaustive`` (``-m exhaustive``). Each case is a Dynamo trace of a
    whole model, most of the suite's time: a family whose rules hold in one pair and a pair the
    rules hold in for another family leave little for the full matrix to find (it runs before a
    change to canonicalization or the rules lands)."""
    return [] if (pair - family) % min(families, pairs) == 0 else [pytest.mark.exhaustive]


@functools.cache
def _names() -> frozenset[str]:
    """The names transformers exports, listed once: ``dir()`` of its lazy module takes a quarter
    of a second on a CI core, and the parameter lists of the family tests ask it about 80 times."""
    import transformers as tf

    return frozenset(dir(tf))
