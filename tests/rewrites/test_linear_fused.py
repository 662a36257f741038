"""The GEMM prologue and epilogue rules (rewrites/linear_fused.py): a pre-norm decoder's residual
adds into the GEMMs that produce them, its norms into the GEMMs that read them.

Every test compiles in mode "full" (the passes run where select_gemm runs: graphs replayed as CUDA
graphs); on CPU the ops run their references, which compute what the unfused code does, so the
numerics against eager are tight (the kernels' own: tests/runtime/test_linear_fused_ops.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers.rewrites import BF16, DTYPE_MODES, F32, check, reasons, sites

from fxrewrite.rewrites import linear_fused
from fxrewrite.testing import Compiled

HIDDEN, INTER = 64, 96
FULL = {"mode": "full", "gemm_fusion": True}  # Config.gemm_fusion: off by default
IDS = torch.tensor([3, 1, 4, 1, 5])


class Norm(torch.nn.Module):
    """RMSNorm as Llama writes it (``w * h.to(dtype)``), OLMo2's order (``(w * h).to(dtype)``:
    ``cast_last``) or without weight; with ``residual``, adds it first and returns both."""

    def __init__(self, order: str = "llama", residual_first: bool = False) -> None:
        super().__init__()
        self.order, self.residual_first = order, residual_first
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN)) if order != "none" else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = residual + x if self.residual_first else x + residual
        residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.order == "llama":
            out = self.weight * h.to(x.dtype)
        elif self.order == "cast_last":
            out = (self.weight * h).to(x.dtype)
        else:
            out = h.to(x.dtype)
        return out, residual


class Layer(torch.nn.Module):
    """norm -> qkv -> (a stand-in for attention) -> o -> add + norm -> gate_up -> SiLU-and-mul
    -> down; the residual carried to the next layer's norm, as serving engines write it."""

    def __init__(self, order: str, qkv_bias: bool, o_bias: bool, residual_first: bool = False) -> None:
        super().__init__()
        self.input_norm, self.post_norm = Norm(order, residual_first), Norm(order, residual_first)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN, bias=qkv_bias)
        self.o = torch.nn.Linear(HIDDEN, HIDDEN, bias=o_bias)
        self.gate_up = torch.nn.Linear(HIDDEN, 2 * INTER, bias=False)
        self.down = torch.nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_norm(h, residual)
        q, k, v = self.qkv(h).split(HIDDEN, dim=-1)
        h, residual = self.post_norm(self.o(torch.tanh(q) * k + v), residual)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up), residual


class Decoder(torch.nn.Module):
    """Token embedding, two layers and a final add + norm. ``leak``: the residual stream after
    the first layer's attention is returned too (read after the add that updates it);
    ``embed=False``: the model's input is the hidden state (the first residual a graph input)."""

    def __init__(self, order: str = "llama", qkv_bias: bool = False, o_bias: bool = False, leak: bool = False,
                 embed: bool = True, residual_first: bool = False, dtype: torch.dtype = F32) -> None:  # fmt: skip
        super().__init__()
        self.leak = leak
        self.embed = torch.nn.Embedding(32, HIDDEN) if embed else None
        self.layers = torch.nn.ModuleList(Layer(order, qkv_bias, o_bias, residual_first) for _ in range(2))
        self.norm = Norm(order, residual_first)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.layers[0](self.embed(x) if self.embed is not None else x, None)
        leaked = residual
        h, residual = self.layers[1](h, residual)
        out = self.norm(h, residual)[0]
        return (out, leaked * 2) if self.leak else out


# per layer: the norm into qkv, the add into o, the norm into gate_up (and its activation), the
# add into down; the final add + norm: the add into the last down, the norm alone (no GEMM reads
# it). Then each add whose sum a norm GEMM reads hands that norm its squares (hand_off_norms): all
# but the last down's; the first qkv's norm reads the embedding and keeps its prologue.
FUSED = {"rms_norm_linear": 2, "rms_norm_linear_silu_and_mul": 2, "linear_add_rms_parts": 3, "linear_add_": 1,
         "rms_norm": 1}  # fmt: skip
# the same before hand_off_norms: a norm without weight hands off nothing
PROLOGUES = {"rms_norm_linear": 2, "rms_norm_linear_silu_and_mul": 2, "linear_add_": 4, "rms_norm": 1}


@functools.cache
def decoder(order: str, dtype: torch.dtype, dynamic: bool | str = True) -> Compiled:
    """``check`` of ``Decoder(order, dtype=dtype)`` (seeded weights) on IDS in mode full, once per
    process: tests that read other facts of one compile share it (each ~1.5 s)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Decoder(order, dtype=dtype)
    return check(model, IDS, expect=PROLOGUES if order == "none" else FUSED, dynamic=dynamic, **FULL)


@DTYPE_MODES
def test_a_decoder_layer_is_four_gemms_with_its_norms_and_adds_inside(dtype: torch.dtype, dynamic: bool | str) -> None:
    r = decoder("llama", dtype, dynamic)
    assert all(s.inplace for s in sites(r, "linear_add_rms_norm_inplace"))
    assert len(sites(r, "linear_add_rms_norm_inplace")) == 4
    assert not [m for m in r.report.near_misses if m.rule in {x.name for x in linear_fused.NORM_RULES}]


def test_a_batch_dimension_changes_nothing() -> None:
    """Tokens in a batch dimension ([batch, seq, hidden] activations): the same GEMMs."""
    check(Decoder(dtype=BF16), IDS.view(1, 5), expect=FUSED, **FULL)


@pytest.mark.parametrize("order", ["cast_last", "none"])
def test_the_other_norm_orders_fuse_too(order: str) -> None:
    """OLMo2's order (the weight multiplies in float32; bf16, where it is another computation)
    and a norm without weight."""
    r = decoder(order, BF16)
    names = {s.rule for s in sites(r)}
    if order == "cast_last":
        assert {"rms_norm_cast_last_linear", "rms_norm_cast_last_linear_silu_and_mul",
                "linear_add_rms_norm_cast_last_inplace"} <= names  # fmt: skip
    else:
        assert {"rms_norm_linear", "rms_norm_linear_silu_and_mul", "linear_add_rms_norm_inplace"} <= names


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_the_residual_may_be_the_first_operand_of_the_add(dtype: torch.dtype) -> None:
    """``residual + o_proj(a)``, as transformers writes it: the GEMM's output is the add + norm's
    second operand; the same GEMMs."""
    r = check(Decoder(residual_first=True, dtype=dtype), IDS, expect=FUSED, **FULL)
    assert len(sites(r, "linear_add_rms_norm_swapped_inplace")) == 4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_transformers_decoders_get_four_fused_gemms_per_layer(family: str) -> None:
    """transformers' Llama and Qwen2 (separate q, k, v and gate, up projections, merged by
    merge_siblings; Qwen2's qkv with a bias), two layers: qkv with its norm and the rotation of
    q and k (through the transposes the rotation's folding undid, rewrites/linear_rotary.py),
    o with its add, gate_up with its norm and activation, down with its add."""
    from fxrewrite import models

    model = models.build(family, layers=2)
    expect = {"rms_norm_linear_rotary": 2, "rms_norm_linear_silu_and_mul": 2, "linear_add_rms_parts": 3,
              "linear_add_": 1, "rms_norm": 1}  # fmt: skip
    check(model, *models.example_inputs(model), expect=expect, capture_sizes=(8,), **FULL)


def test_a_biased_qkv_takes_its_norm_with_the_bias() -> None:
    r = check(Decoder(qkv_bias=True), IDS, expect=FUSED, **FULL)
    (site,) = [n for n in r.graph.graph.nodes if n.target is torch.ops.fxr.rms_norm_linear.default][:1]
    assert site.args[4] is not None


def test_no_gemm_takes_anything_where_graphs_run_eagerly() -> None:
    """Negative twin: mode "none" (no CUDA graphs) runs neither these passes nor select_gemm."""
    check(Decoder(), IDS, expect={"rms_norm": 1, "fused_add_rms_norm_": 4, "silu_and_mul": 2},
          mode="none")  # fmt: skip


def test_no_gemm_takes_anything_unless_switched_on() -> None:
    """Negative twin: in mode "full" without ``Config.gemm_fusion`` (the default) the GEMMs are
    select_gemm's plain ones and the norms and adds stay."""
    check(Decoder(), IDS, expect={"rms_norm": 1, "fused_add_rms_norm_": 4, "linear": 6, "linear_silu_and_mul": 2},
          mode="full")  # fmt: skip


def test_a_biased_o_proj_keeps_its_add_and_norm() -> None:
    """Negative twin: an o_proj with a bias (cuBLAS would need a second kernel for it above the
    decode sizes) keeps the add + norm, and the gate_up after it its plain linear; the down
    projections' adds still fuse."""
    expect = {"fused_add_rms_norm_": 2, "linear": 2, "linear_silu_and_mul": 2, "rms_norm_linear": 2,
              "linear_add_rms_parts": 1, "linear_add_": 1, "rms_norm": 1}  # fmt: skip
    check(Decoder(o_bias=True), IDS, expect=expect, **FULL)


def test_a_norm_read_by_two_gemms_stays_a_norm() -> None:
    """Negative twin: with sibling merging off, the norm feeds two linears (each would need the
    norm in its own prologue: left alone, and reported)."""

    class Split(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = Norm()
            self.a, self.b = torch.nn.Linear(HIDDEN, HIDDEN, bias=False), torch.nn.Linear(HIDDEN, HIDDEN, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)[0]
            return self.a(h) * self.b(h)

    r = check(Split(), torch.randn(5, HIDDEN), expect={"rms_norm": 1, "linear": 2}, merge_siblings=False, **FULL)
    assert any("user(s) outside the match" in why for why in reasons(r, "rms_norm_linear"))


def test_a_residual_read_after_its_add_gets_a_new_tensor() -> None:
    """Negative twin of the in-place form: the stream after the first attention block is read
    later, so its add writes a new tensor (``linear_add``) there and in place elsewhere (then
    handed off like the others: the hand-off writes a new tensor)."""
    r = check(Decoder(leak=True), IDS, expect=FUSED, **FULL)
    (functional,) = [s for s in sites(r) if s.rule.startswith("linear_add_rms_norm") and not s.inplace]
    assert "read later" in functional.note


def test_a_residual_that_is_a_graph_input_gets_a_new_tensor() -> None:
    """Negative twin of the in-place form: the first residual is the model's input, which the
    graph may not overwrite."""
    r = check(Decoder(embed=False), torch.randn(5, HIDDEN), expect=FUSED, **FULL)
    (functional,) = [s for s in sites(r) if s.rule.startswith("linear_add_rms_norm") and not s.inplace]
    assert "is a graph input" in functional.note


def test_the_residual_guard_wants_the_outputs_dtype_and_shape() -> None:
    x, w = torch.randn(5, 8), torch.randn(4, 8)
    assert linear_fused.residual_guard({"x": x, "w": w, "residual": torch.randn(5, 4)}) is True
    assert linear_fused.residual_guard({"x": x, "w": w, "residual": torch.randn(5, 4, dtype=BF16)}) == (
        "input torch.float32, weight torch.float32, residual torch.bfloat16 differ")
    assert linear_fused.residual_guard({"x": x, "w": w, "residual": torch.randn(1, 4)}) == (
        "residual shape (1, 4) != the linear's output (5, 4)")  # a broadcast add
    assert linear_fused.residual_guard({"x": x, "w": torch.randn(8), "residual": torch.randn(5)}) == (
        "weight is 1-D, not a matrix")


# --------------------------------------------------------------------------- the norms' hand-off


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_each_add_hands_the_next_norm_its_squares(dtype: torch.dtype) -> None:
    """hand_off_norms: every norm GEMM reading an add-GEMM's sum reads that GEMM's hand-off
    (``s * g`` and the squares), its own weight gone; numerics against eager (check)."""
    r = decoder("llama", dtype)
    assert len(sites(r, "linear_add_rms_parts")) == 3
    readers = [n for n in r.graph.graph.nodes if n.kwargs.get("parts") is not None]
    assert len(readers) == 3 and all(n.args[1] is None for n in readers)
    assert [n.target for n in readers] == [torch.ops.fxr.rms_norm_linear_silu_and_mul.default,
                                           torch.ops.fxr.rms_norm_linear.default,
                                           torch.ops.fxr.rms_norm_linear_silu_and_mul.default]  # fmt: skip


def test_a_norm_without_weight_keeps_its_prologue() -> None:
    """Negative twin: the hand-off stores ``s * g``; a weightless norm keeps the squares in its
    GEMM, each such site a near miss with the reason."""
    r = decoder("none", BF16)
    assert reasons(r, "linear_add_rms_parts") == ["the norm has no weight: the hand-off stores s * g"] * 3


def test_a_sum_read_by_two_norms_hands_off_once() -> None:
    """Negative twin: two norm GEMMs of one sum (parallel attention and MLP, each with its own
    norm weight): the first takes the hand-off, the second keeps its prologue (a near miss)."""

    class Parallel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(32, HIDDEN)
            self.o = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
            self.norm_a, self.norm_b = Norm(), Norm()
            self.a = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
            self.b = torch.nn.Linear(HIDDEN, 2 * INTER, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            s = self.o(torch.tanh(h)) + h
            gate, up = self.b(self.norm_b(s)[0]).chunk(2, dim=-1)
            return self.a(self.norm_a(s)[0]) + (F.silu(gate) * up).sum(-1, keepdim=True) + s

    r = check(Parallel(), IDS, expect={"linear_add_rms_parts": 1, "rms_norm_linear": 1,
                                       "rms_norm_linear_silu_and_mul": 1}, **FULL)  # fmt: skip
    assert reasons(r, "linear_add_rms_parts") == ["the sum hands off to another norm"]
