"""Sibling-linear merging (rewrites/merge.py): q/k/v and gate/up become one GEMM each.

The module's parameters are re-laid as views into the merged buffer: memory does not grow, the
module keeps working eagerly, and a second compilation reuses the buffer.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, DYNAMIC, F32, check, compile_modes, reasons, sites, storage_bytes, storages

from fxrewrite import Backend
from fxrewrite.config import Config
from fxrewrite.rewrites import activation


class Block(torch.nn.Module):
    """A decoder block's projections as HF writes them (attention itself left out)."""

    def __init__(self, hidden: int = 64, kv: int = 32, inter: int = 96, qkv_bias: bool = False) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=qkv_bias)
        self.k_proj = torch.nn.Linear(hidden, kv, bias=qkv_bias)
        self.v_proj = torch.nn.Linear(hidden, kv, bias=qkv_bias)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        attn = q * torch.cat([k, v], dim=-1)  # stands in for attention: reads all three
        h = x + self.o_proj(attn)
        return h + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


QKV = "q_proj + k_proj + v_proj"
GATE_UP = "gate_proj + up_proj"


@pytest.mark.parametrize(("dtype", "dynamic"), [(F32, True), (F32, False), (BF16, True)])
def test_qkv_and_gate_up_merged_and_named_in_the_report(dtype: torch.dtype, dynamic: bool) -> None:
    model = Block().to(dtype)
    r = check(model, torch.randn(2, 5, 64, dtype=dtype), expect={"silu_and_mul": 1}, dynamic=dynamic)
    assert r.counts_before()["torch._C._nn.linear"] == 7
    assert r.counts()["aten.linear"] == 4  # qkv, o, gate_up, down
    assert [s.module for s in sites(r, "merge_siblings")] == [QKV, GATE_UP]
    assert r.report.graphs[0].notes == [
        f"merged 3 linears into one GEMM: {QKV}",
        f"merged 2 linears into one GEMM: {GATE_UP}",
    ]
    assert not r.report.near_misses


def test_memory_does_not_grow_and_the_module_keeps_working_eagerly() -> None:
    model = Block()
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = model(x)
    bytes_before, names = storage_bytes(model), [n for n, _ in model.named_parameters()]
    r = check(model, x, expect={"silu_and_mul": 1})
    assert storage_bytes(model) == bytes_before
    # q/k/v share one storage, gate/up another; o and down keep theirs
    assert sorted(storages(model).values()) == [1, 1, 2, 3]
    assert [n for n, _ in model.named_parameters()] == names
    assert all(isinstance(p, torch.nn.Parameter) and p.is_contiguous() for p in model.parameters())
    merged = dict(r.graph.named_buffers())
    assert {n: tuple(b.shape) for n, b in merged.items()} == {"fxr_merged_0": (128, 64), "fxr_merged_1": (192, 64)}
    with torch.no_grad():
        assert torch.equal(model(x), before)  # the views hold the same values


def test_second_compile_reuses_the_merged_buffer_and_both_follow_in_place_weight_updates() -> None:
    """dynamic=True, then dynamic=False of the same module: no second buffer; weights loaded in
    place afterwards (``load_state_dict`` copies) reach both compiled graphs."""
    model, x = Block(), torch.randn(3, 64)
    first, second = Backend(), Backend()
    compiled = [torch.compile(model, backend=b, fullgraph=True, dynamic=d) for b, d in ((first, True), (second, False))]
    with torch.no_grad():
        compiled[0](x)
        layout = storages(model)
        compiled[1](x)
    assert storages(model) == layout, "the second compile moved the parameters to a new buffer"
    ptrs = [{b.untyped_storage().data_ptr() for _, b in be.graphs[0].named_buffers()} for be in (first, second)]
    assert ptrs[0] == ptrs[1]

    fresh = Block()
    model.load_state_dict(fresh.state_dict())
    with torch.no_grad():
        want = fresh(x)
        for fn in compiled:
            torch.testing.assert_close(fn(x), want)
    assert len(first.graphs) == len(second.graphs) == 1


@DYNAMIC
def test_compiled_call_after_merge_does_not_recompile(dynamic: bool) -> None:
    modes = compile_modes(dynamic)
    model, backend = Block(), Backend(specialize_floats=modes.pop("specialize_floats", True))
    compiled = backend.compile(model, **modes)
    with torch.no_grad():
        compiled(torch.randn(3, 64))
        out = compiled(torch.randn(3, 64))
    assert len(backend.graphs) == 1
    assert out.shape == (3, 64)


def test_qwen2_style_qkv_biases_are_merged_too() -> None:
    model = Block(qkv_bias=True)
    bytes_before = storage_bytes(model)
    r = check(model, torch.randn(4, 64), expect={"silu_and_mul": 1})
    assert [s.module for s in sites(r, "merge_siblings")] == [QKV, GATE_UP]
    buffers = {n: tuple(b.shape) for n, b in r.graph.named_buffers()}
    assert buffers == {"fxr_merged_0": (128, 64), "fxr_merged_0_bias": (128,), "fxr_merged_1": (192, 64)}
    assert storage_bytes(model) == bytes_before
    assert sorted(storages(model).values()) == [1, 1, 2, 3, 3]  # biases share their own buffer


# -- opt-out and negatives ----------------------------------------------------------------------


def test_opt_out_leaves_the_linears() -> None:
    """Unmerged, the gate and up projections' outputs are two tensors: act_mul, not silu_and_mul."""
    model = Block()
    r = check(model, torch.randn(4, 64), expect={"act_mul": 1}, config=Config(merge_siblings=False))
    assert r.counts()["aten.linear"] == 7
    assert not sites(r, "merge_siblings") and "merge_siblings" not in [p.name for p in r.report.graphs[0].passes]
    assert len(storages(model)) == 7


def test_opt_out_shows_the_silu_and_mul_near_miss() -> None:
    """(The library's act_mul then takes the site: test_opt_out_leaves_the_linears.)"""
    r = check(Block(), torch.randn(4, 64), expect={},
              config=Config(merge_siblings=False, rules=activation.ONE_TENSOR_RULES))  # fmt: skip
    (why,) = reasons(r, "silu_and_mul")
    assert re.fullmatch(r"expected `slice`, found `linear` \(`\w+`\)", why)


def test_linears_reading_different_inputs_are_not_merged() -> None:
    class TwoInputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.a(x) * self.b(y)

    model = TwoInputs()
    r = check(model, torch.randn(4, 64), torch.randn(4, 64), expect={})
    assert r.counts()["aten.linear"] == 2 and not sites(r, "merge_siblings")
    assert len(storages(model)) == 2


def test_mixed_bias_merges_only_the_linears_alike() -> None:
    """q and v without bias merge; k, with one, stays alone (one GEMM cannot add half a bias)."""
    model = Block()
    model.k_proj = torch.nn.Linear(64, 32, bias=True)
    r = check(model, torch.randn(4, 64), expect={"silu_and_mul": 1})
    assert [s.module for s in sites(r, "merge_siblings")] == ["q_proj + v_proj", GATE_UP]
    assert r.counts()["aten.linear"] == 5


class SharedExpert(torch.nn.Module):
    """Qwen2-MoE's shared expert beside its router: four linears read the same input."""

    def __init__(self, hidden: int = 64, inter: int = 96, experts: int = 8, up_first: bool = False) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.shared_gate = torch.nn.Linear(hidden, 1, bias=False)
        self.up_first = up_first

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.up_first:  # the product spelled up * act(gate), up computed first
            up = self.up_proj(x)
            h = up * F.silu(self.gate_proj(x))
        else:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return torch.sigmoid(self.shared_gate(x)) * self.down_proj(h), self.router(x)


@pytest.mark.parametrize("up_first", [False, True], ids=["gate-first", "up-first"])
def test_gate_up_pair_merges_apart_from_other_siblings_gate_rows_first(up_first: bool) -> None:
    """A router and a gate scalar reading the shared expert's input merge with each other, not
    in between gate and up: the pair stays the two halves SiLU-and-mul fuses, gate first
    whatever order the code computes them in."""
    model = SharedExpert(up_first=up_first)
    r = check(model, torch.randn(4, 64), expect={"silu_and_mul": 1})
    assert [s.module for s in sites(r, "merge_siblings")] == ["gate_proj + up_proj", "shared_gate + router"]
    assert r.counts()["aten.linear"] == 3  # gate_up, router + shared_gate, down
    assert not r.report.near_misses


def test_siblings_without_a_gated_product_stay_one_group() -> None:
    """Negative twin: silu(a) + b is no gated pair; the three linears merge as one GEMM."""

    class NotGated(SharedExpert):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return F.silu(self.gate_proj(x)) + self.up_proj(x), self.router(x)

    r = check(NotGated(), torch.randn(4, 64), expect={})
    assert [s.module for s in sites(r, "merge_siblings")] == ["gate_proj + up_proj + router"]


def test_an_activation_read_by_something_other_than_a_product_is_no_gated_pair() -> None:
    """``dropout(gelu(fc1(x)))`` (BioGPT, BART): the activation's one reader is a call of one
    positional argument, not a product; the siblings merge as one group, and the pass does not
    trip over the reader's arguments."""

    class DropoutAfterAct(SharedExpert):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = F.dropout(F.gelu(self.gate_proj(x)), p=0.1, training=False)
            return h + self.up_proj(x), self.router(x)

    r = check(DropoutAfterAct(), torch.randn(4, 64), expect={})
    assert [s.module for s in sites(r, "merge_siblings")] == ["gate_proj + up_proj + router"]
