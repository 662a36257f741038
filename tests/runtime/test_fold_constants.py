"""fold_constants (fxrewrite.runtime.fold_constants): tensors a graph builds from Python values are
evaluated once at compile time and read as constants; one per kind, each with its negative twin
(built from a runtime value, of a symbolic size, written in place, returned, too large). Through
the backend with no rules (``rules=[]``: canonicalize, fold_constants, cleanup), outputs against
eager in float32 and bf16."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxrewrite
from fxrewrite.runtime import fold_constants as fc
from fxrewrite.runtime.hazards import find_capture_hazards, host_lists, op_name
from fxrewrite.testing import Compiled, assert_close, check_rewrite
from helpers.graphs import on_fake_device

DTYPES = [torch.float32, torch.bfloat16]


def constants_of(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    return {n.target: getattr(gm, n.target) for n in gm.graph.find_nodes(op="get_attr") if n.target.startswith("fxr_const")}


def constants(result: Compiled) -> dict[str, torch.Tensor]:
    return constants_of(result.graph)


def folded(result: Compiled) -> int:
    return next(p.matches for p in result.report.graphs[0].passes if p.name == "fold_constants")


def fold(fn: Any, *inputs: Any, expect: dict[str, int] = {}, absent: tuple[str, ...] = (), dynamic: bool = True) -> Compiled:
    return check_rewrite(fn, *inputs, rules=[], expect=expect, absent=absent, dynamic=dynamic)


# --- torch.tensor of a Python scalar (transformers 5.17's masking_utils.eager_mask, as gpt-oss runs it)

def eager_mask_517(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    zero = torch.tensor(0.0, device=mask.device, dtype=x.dtype)
    return x + torch.where(mask, zero, torch.finfo(x.dtype).min)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dynamic", [True, False])
def test_a_scalar_tensor_becomes_a_constant(dtype: torch.dtype, dynamic: bool) -> None:
    x, mask = torch.randn(5, 8, dtype=dtype), torch.rand(5, 8) > 0.3
    result = fold(eager_mask_517, x, mask, expect={"torch.where": 1}, absent=("torch.tensor",), dynamic=dynamic)
    assert result.counts_before()["torch.tensor"] == 1 and folded(result) == 1
    (value,) = constants(result).values()
    assert value.dtype == dtype and value.shape == () and value.item() == 0.0


def test_a_tensor_of_a_runtime_value_stays() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + torch.tensor([x.shape[0], 1.0], dtype=x.dtype).sum()  # the token count, a SymInt

    result = fold(f, torch.randn(5, 8))
    assert folded(result) == 0 and not constants(result) and result.counts()["torch._refs.tensor"] == 1


# --- zeros / ones / full of a static size (5.24's eager_mask, Falcon's ALiBi base)

def eager_mask_524(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers 5.24's masking_utils.eager_mask: a 0-d zeros on the mask's device."""
    return x + torch.where(mask, torch.zeros((), device=mask.device, dtype=x.dtype), torch.finfo(x.dtype).min)


def eager_mask_and_ones(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return eager_mask_524(x, mask) + torch.ones(8, device=x.device, dtype=x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_and_ones_of_a_static_size_become_constants(dtype: torch.dtype) -> None:
    x, mask = torch.randn(5, 8, dtype=dtype), torch.rand(5, 8) > 0.3
    result = fold(eager_mask_and_ones, x, mask, absent=("torch.zeros", "torch.ones"))
    assert folded(result) == 2 and sorted(tuple(v.shape) for v in constants(result).values()) == [(), (8,)]


@pytest.mark.parametrize("dynamic", [True, False])
def test_zeros_of_a_symbolic_size_stays(dynamic: bool) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(x.shape[0], 1, dtype=x.dtype)

    result = fold(f, torch.randn(5, 8), dynamic=dynamic)
    assert result.counts()["torch.zeros"] == (1 if dynamic else 0) and folded(result) == (0 if dynamic else 1)


def alibi_slopes(x: torch.Tensor) -> torch.Tensor:
    """Falcon's / Bloom's build_alibi_tensor: full, two aranges, pow, cat, then casts."""
    base = torch.full((), 2 ** (-(2 ** -(3 - 3))), device=x.device, dtype=torch.float32)
    powers = torch.arange(1, 1 + 4, device=x.device, dtype=torch.int32)
    extra = torch.pow(torch.full((), 0.7, device=x.device), torch.arange(1, 5, 2, device=x.device, dtype=torch.int32))
    slopes = torch.cat([torch.pow(base, powers), extra], dim=0)
    return x * slopes[..., None].bfloat16().to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_arange_and_arithmetic_of_them_fold_into_one_constant(dtype: torch.dtype) -> None:
    result = fold(alibi_slopes, torch.randn(6, 3, dtype=dtype), absent=("torch.full", "torch.arange", "torch.pow"))
    (value,) = constants(result).values()  # only the last value that a kept op reads
    # the cast back to x's dtype is type promotion's in float32: canonicalize drops it
    assert folded(result) == 1 and value.shape == (6, 1) and value.dtype == torch.bfloat16
    assert result.counts() == {"aten.mul": 1}


# --- arange of a static size and its casts (transformers' mask: the batch arange)

@pytest.mark.parametrize("dynamic", [True, False])
def test_arange_and_casts_fold_but_not_arange_of_the_token_count(dynamic: bool) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(8, device=x.device).float().to(x.dtype)  # static: folds
        tokens = torch.arange(x.shape[0], device=x.device)[:, None].to(x.dtype)  # the token count
        return x * steps + tokens

    result = fold(f, torch.randn(5, 8), dynamic=dynamic)
    assert result.counts()["torch.arange"] == (1 if dynamic else 0)
    assert folded(result) == (1 if dynamic else 2)


# --- a 0-dim constant read on the host: the value of masked_fill / index_fill (CPM-Ant's scores)

def fill_scores(score: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scores filled where the mask is off with 0-dim tensors built on their device (transformers
    5.19's CPM-Ant attention: ``torch.scalar_tensor(float("-inf"), device=..., dtype=...)``), the
    mask compared with a CPU ``torch.tensor(False)``, an ``index_fill`` of a ``torch.full(())``, and
    the ATen overload as a traced graph or a rule's replacement spells it."""
    off = mask == torch.tensor(False)
    neg = torch.scalar_tensor(float("-inf"), device=score.device, dtype=score.dtype)
    score = torch.masked_fill(score, off, neg).softmax(-1)
    score = torch.ops.aten.masked_fill.Tensor(score, off, torch.full((), 0.0, device=score.device))
    score = score.masked_fill(off, value=torch.zeros((), device=score.device, dtype=score.dtype))
    first = torch.tensor([0], device=score.device)
    return score.index_fill(1, first, torch.full((), 0.5, device=score.device)) + neg.exp()  # neg: also a constant


aten_fill = torch.ops.aten.masked_fill


def value_reads(gm: torch.fx.GraphModule) -> list[Any]:
    """What the fills read as their value: a number, or the node of a tensor."""
    reads = [n for n in gm.graph.nodes if op_name(n) in ("masked_fill", "index_fill")]
    return [n.args[2] if op_name(n) == "masked_fill" and len(n.args) > 2 else
            n.kwargs["value"] if op_name(n) == "masked_fill" else n.args[3] for n in reads]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dynamic", [True, False])
def test_a_constant_fill_value_is_passed_as_a_number(dtype: torch.dtype, dynamic: bool) -> None:
    """On the GPU the tensor overload reads the value with ``.item()``, a sync CUDA-graph capture
    refuses; the number overload computes the same. Before: 4 fills reading a tensor; after: each
    reads its number, and no fill is a capture hazard on a (fake) device."""
    score, mask = torch.randn(2, 4, 6, dtype=dtype), torch.rand(2, 4, 6) > 0.3
    mask[..., 0] = True  # no row filled whole: its softmax would be NaN in both
    result = fold(fill_scores, score, mask, absent=("torch.scalar_tensor", "torch.full", "torch.zeros"),
                  expect={"torch.masked_fill": 1, "aten.masked_fill": 1, "method.masked_fill": 1,
                          "method.index_fill": 1}, dynamic=dynamic)
    before = result.counts_before()
    assert before["torch.scalar_tensor"] == 1 and before["torch.full"] == 2 and before["aten.masked_fill"] == 1
    (aten,) = [n for n in result.graph.graph.nodes if n.target in (aten_fill.Tensor, aten_fill.Scalar)]
    assert aten.target is aten_fill.Scalar  # the Tensor overload would refuse the number
    # 4 numbers, 3 constants
    assert value_reads(result.graph) == [float("-inf"), 0.0, 0.0, 0.5] and folded(result) == 7
    # what stays a constant: the CPU False (read by eq, a host scalar), the index, exp(-inf)
    assert sorted((tuple(v.shape), str(v.dtype)) for v in constants(result).values()) == sorted(
        [((), "torch.bool"), ((1,), "torch.int64"), ((), str(dtype))])
    host = [name for name, v in constants(result).items() if v.dtype == torch.bool]
    assert find_capture_hazards(on_fake_device(result.graph, host)) == []


def test_a_fill_value_of_a_runtime_value_stays_and_is_a_capture_hazard_on_the_device() -> None:
    def f(score: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.masked_fill(score, ~mask, score.amin())  # computed per call: no constant

    result = fold(f, torch.randn(4, 6), torch.rand(4, 6) > 0.3)
    (read,) = value_reads(result.graph)
    assert isinstance(read, torch.fx.Node) and folded(result) == 0
    (hazard,) = find_capture_hazards(on_fake_device(result.graph))
    assert hazard.op == "call_function masked_fill" and f"reads its value `{read.name}`" in hazard.reason


# --- a Python list indexing a tensor (Falcon's multi-query split)

class MultiQuery(nn.Module):
    """Falcon's fused QKV with one key and one value head, split as FalconAttention._split_heads
    does (transformers 5.17 and 5.24): ``fused_qkv[..., [-2], :]``."""

    def __init__(self, heads: int = 4, head_dim: int = 8) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.Linear(heads * head_dim, (heads + 2) * head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        fused = self.qkv(x).view(batch, seq, self.heads + 2, self.head_dim)
        q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        return (q * k + v).flatten(2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dynamic", [True, False])
def test_list_indices_become_device_constants(dtype: torch.dtype, dynamic: bool) -> None:
    model = MultiQuery().to(dtype)
    result = fold(model, torch.randn(2, 5, 32, dtype=dtype), dynamic=dynamic)
    lists = [n for n in result.graph.graph.nodes if n.target is operator.getitem and host_lists(n.args[1])]
    assert lists == [] and folded(result) == 2
    assert sorted(v.tolist() for v in constants(result).values()) == [[-2], [-1]]
    assert all(v.dtype == torch.int64 for v in constants(result).values())


def test_a_list_of_bools_or_of_runtime_values_stays() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[[True, False, True, True, False]], x[:, [0, x.shape[0] - 4]]  # a mask; a SymInt in the list

    result = fold(f, torch.randn(5, 8))
    assert folded(result) == 0 and not constants(result)


# --- what must stay: written in place, returned, too large

def test_a_tensor_written_in_place_stays() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros(8, dtype=x.dtype)
        acc[0:2] = x[0, :2]  # written through a view: a shared constant would keep the write
        ones = torch.ones(8, dtype=x.dtype)
        ones.mul_(2)
        return x + acc + ones

    result = fold(f, torch.randn(5, 8))
    assert folded(result) == 0 and result.counts()["torch.zeros"] == 1 and result.counts()["torch.ones"] == 1


def test_a_returned_tensor_stays() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = torch.arange(8, dtype=x.dtype)
        return x + c, c, torch.ones(3).to(torch.float32)  # c and a no-op cast of ones: the caller could write them

    result = fold(f, torch.randn(5, 8))
    assert folded(result) == 0 and not constants(result)


def test_a_constant_over_the_size_limit_stays() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + torch.ones(fc.MAX_BYTES // 4 + 1, dtype=torch.float32)[:8]

    result = fold(f, torch.randn(5, 8))
    assert folded(result) == 0 and result.counts()["torch.ones"] == 1


def test_shared_values_are_one_constant_and_the_log_says_what_folded(caplog: pytest.LogCaptureFixture) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor(2.0) + x * torch.tensor(2.0) + torch.full((), 3.0)

    with caplog.at_level("DEBUG", logger=fc.__name__):
        result = fold(f, torch.randn(5, 8))
    assert folded(result) == 3 and len(constants(result)) == 2
    assert "fold_constants: 3 calls evaluated at compile time, read as 2 constants (full, tensor)" in caplog.text


def test_the_compile_cache_keeps_folded_constants(tmp_path: Path) -> None:
    model, x = MultiQuery(), torch.randn(2, 5, 32)
    outs = []
    for _ in range(2):
        torch._dynamo.reset()
        backend = fxrewrite.Backend(rules=[], cache=True, cache_dir=str(tmp_path), progress=False)
        with torch.no_grad():
            outs.append(backend.compile(model)(x))
    assert backend.report.cache["hits"] == 1
    with torch.no_grad():
        assert_close(outs[1], model(x))


# --- the two models of the issue, as this transformers spells them

def test_transformers_eager_mask_builds_its_zero_once() -> None:
    """transformers' eager attention mask (gpt-oss runs it): 5.17 builds its zero with
    ``torch.tensor(0.0, device=...)``, 5.24 with ``torch.zeros((), device=...)``; either folds."""
    masking_utils = pytest.importorskip("transformers.masking_utils")

    def f(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return x + masking_utils.eager_mask(batch_size=1, q_length=n, kv_length=n, dtype=x.dtype, device=x.device)[0, 0]

    result = fold(f, torch.randn(6, 6))
    before = result.counts_before()
    assert before["torch.tensor"] + before["torch.zeros"] == 1 and folded(result) == 1
    assert result.counts()["torch.tensor"] + result.counts()["torch.zeros"] == 0
    (zero,) = constants(result).values()
    assert zero.shape == () and zero.item() == 0.0


@pytest.mark.parametrize("mode", ["none", "piecewise"])
def test_transformers_falcon_indexes_with_device_constants(mode: str) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=128,
                                    multi_query=True, new_decoder_architecture=False, alibi=False)
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(cfg).eval()
    seen: list[torch.fx.GraphModule] = []
    backend = fxrewrite.Backend(mode=mode, capture_sizes=(4, 8), progress=False)
    torch._dynamo.reset()

    def spy(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append(sum(1 for n in gm.graph.nodes if n.target is operator.getitem and host_lists(n.args[1])))
        return backend(gm, example_inputs)

    spy.backend_ctx_ctor = backend.backend_ctx_ctor  # type: ignore[attr-defined]
    compiled = torch._dynamo.optimize(spy, nopython=True, dynamic=True)(model)
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        assert_close(compiled(ids).logits, model(ids).logits)
    rewritten = backend.graphs[0]
    assert seen == [2 * cfg.num_hidden_layers]  # key and value heads picked with one-element lists
    assert not [n for n in rewritten.graph.nodes if n.target is operator.getitem and host_lists(n.args[1])]
    indices = [v.tolist() for v in constants_of(rewritten).values() if v.dtype == torch.int64 and v.dim() == 1]
    assert [-2] in indices and [-1] in indices
