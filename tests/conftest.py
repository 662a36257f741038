"""Shared test setup: seeded randomness for every test; GPU tests skipped without CUDA; Triton's
interpreter on machines without CUDA.

Helpers that tests in several folders share live in ``tests/helpers/`` and are imported as
``from helpers.graphs import ...``: pytest (its default "prepend" import mode) puts the folder of
this conftest, ``tests/``, on ``sys.path`` before it imports any test, as it puts each test's own
folder there (``from samples import ...`` in tests/runtime).
"""

from __future__ import annotations

import gc
import os

# Dynamo's time is most of the suite's, and on the tiny models of the tests most of Dynamo's is
# symbolic-shape reasoning in sympy. sympy memoizes it in LRU caches of 1000 entries, set when
# sympy is first imported (torch imports it lazily, after this line): a worker traces thousands of
# graphs over the same few size symbols, and a cache 100x larger keeps what they share.
os.environ.setdefault("SYMPY_CACHE_SIZE", "100000")

import pytest  # noqa: E402
import torch  # noqa: E402

# The compile cache stays off in the suite (tests patch rules and kernels in place, which no cache
# key can see) except where a test turns it on with a directory of its own (tests/fxrewrite/test_cache.py).
os.environ.setdefault("FXREWRITE_CACHE", "0")
# A pass that raises fails the compile in the suite (users get the graph as the pass found it,
# and a report line): a bug in a pass must not hide behind that. Likewise a piece that cannot be
# captured (Config.strict_capture follows Config.strict): the tests of containment turn it off.
os.environ.setdefault("FXREWRITE_STRICT", "1")

# Under pytest-xdist each worker is a process of its own, and torch gives each one intra-op
# thread per core: N workers on N cores run N * N threads, whose OpenMP barriers spin while the
# other workers' threads hold the cores (on 2 cores with 2 workers the real model's tests took
# 5x the CPU time they take with one thread each). Each worker gets its share of the cores, and
# the processes it starts (bench rows, ranks) the same through OMP_NUM_THREADS, unless it is set.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, _CORES // _WORKERS))
    torch.set_num_threads(max(1, _CORES // _WORKERS))

# A worker holds millions of long-lived objects (torch, transformers, the compiles the family tests
# cache), and CPython's collections walked them: 12 % of test_families.py's time, 15 % of
# test_norm_variants.py's. Collections 70x rarer (a young generation of 50 000 objects, not 700)
# halve that, and what is alive once the tests are collected is frozen out of every later
# collection (pytest_collection_finish): 4.5 s of GC in test_norm_variants.py, then 2.7 s. A
# worker's peak memory grew under 2 %. The suite only: the library sets nothing.
gc.set_threshold(50_000, 20, 10)

# FakeTensor's dispatch cache pays off where the same op meets the same shapes again (the 30
# identical layers of a real model); a test's model has one or two layers, and Dynamo is reset
# before each compile: making its entries (each checks its output's symbolic sizes and strides)
# costs more than its hits save. Off, the rule and family tests ran 13 % faster, 19 % with the
# sympy cache above; the whole suite 919 s -> 853 s on 2 cores (bench/RESULTS.md, eighteenth
# session). The suite only: the library sets nothing.
torch._dynamo.config.fake_tensor_cache_enabled = False

if not torch.cuda.is_available():
    # Without CUDA, Triton kernels run only interpreted, on CPU tensors. The flag must be set
    # before Triton is imported: its own library functions (tl.sum, tl.max) are decorated then.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _case(item: pytest.Item) -> str:
    spec = getattr(item, "callspec", None)
    return spec.id if spec is not None else ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The tests marked slow (each tens of seconds up to minutes on a 2-core CI machine) first, in
    # their order: under pytest-xdist a long test handed out last keeps one worker busy while the
    # others have finished (every worker sorts alike, as xdist requires). Within a file, the cases
    # of one parameter set side by side: the family tests compile each case once for several test
    # functions (``functools.cache``), and xdist's worksteal hands out runs of adjacent tests, so a
    # case's tests land on the worker that compiled it (function by function they were split
    # between the workers and compiled twice: about 90 s of the suite's CPU time)
    files = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: ("slow" not in item.keywords, files[item.path], _case(item)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()  # see gc.set_threshold above


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    gc.unfreeze()  # collected at exit as usual (extension modules warn of objects never freed)
