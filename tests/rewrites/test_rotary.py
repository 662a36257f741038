"""Rotary embedding rules and the folding of their tables (rewrites/rotary.py, rotary_tables.py).

Each positive case is model code as authors write it (HF rotate_half with tables computed from
``inv_freq``, an engine's cache indexed by positions, GPT-J pairs, partial rotary, q alone; then
other families' spellings: RoFormer's sinusoidal table, ``inv_freq`` made in ``forward``, Qwen3.5's
multimodal sections, the complex form of Llama 4, per-head norms on either side) in the layouts
models use; the fused counts are exact and outputs equal eager. Each negative twin changes one
thing so that the rotation must not fuse, or its tables must not fold, and checks the reason.
tests/rewrites/test_rotary_families.py runs the real families.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.rewrites import BF16, DYNAMIC, DTYPE_MODES, F32, LlamaRMSNorm, check, fused, fused_nodes, reasons, sites

from fxrewrite import Config
from fxrewrite.rewrites import rotary
from fxrewrite.testing import Compiled, compile_once

HEADS, KV_HEADS, HEAD_DIM, TOKENS = 4, 2, 16, 7
PAIR = {"rotary_embedding": 1}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def inv_freq(dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


class HFRope(torch.nn.Module):
    """HF Llama: tables from ``inv_freq`` and position ids inside the graph, times an attention
    scaling, cast to the activations' dtype; q, k in ``layout`` ("bhtd" as HF, "bthd", or "flat"
    ``[T, heads * head_dim]`` viewed per head)."""

    def __init__(self, layout: str = "bhtd", scaling: float = 1.0, rotary_dim: int = HEAD_DIM) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq(rotary_dim), persistent=False)
        self.layout, self.scaling, self.rotary_dim = layout, scaling, rotary_dim

    def tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(x.dtype), (emb.sin() * self.scaling).to(x.dtype)

    turn = staticmethod(rotate_half)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == x.shape[-1]:
            return x * cos + self.turn(x) * sin
        x_rot, x_pass = x[..., :r], x[..., r:]
        return torch.cat((x_rot * cos + self.turn(x_rot) * sin, x_pass), dim=-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(q, position_ids)  # [B, T, D]
        if self.layout == "bhtd":  # q [B, T, H*D] -> [B, H, T, D]
            q = q.view(*q.shape[:2], -1, HEAD_DIM).transpose(1, 2)
            k = k.view(*k.shape[:2], -1, HEAD_DIM).transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        elif self.layout == "bthd":
            q, k = q.view(*q.shape[:2], -1, HEAD_DIM), k.view(*k.shape[:2], -1, HEAD_DIM)
            cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        else:  # flat tokens: q [T, H*D], position_ids [T]
            q, k = q.view(q.shape[0], -1, HEAD_DIM), k.view(k.shape[0], -1, HEAD_DIM)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


class EngineRope(torch.nn.Module):
    """A serving engine: a float32 cos/sin cache indexed by positions, half-width tables,
    computed in float32 and cast back; q, k are ``[T, heads * head_dim]``."""

    def __init__(self, positions: int = 64, interleaved: bool = False) -> None:
        super().__init__()
        angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq(HEAD_DIM)
        self.register_buffer("cos_sin_cache", torch.cat((angles.cos(), angles.sin()), dim=-1), persistent=False)
        self.interleaved = interleaved

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        if self.interleaved:
            x1, x2 = x[..., ::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(dtype)
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = self.rotate(q.view(q.shape[0], -1, HEAD_DIM), cos, sin)
        k = self.rotate(k.view(k.shape[0], -1, HEAD_DIM), cos, sin)
        return q.flatten(1), k.flatten(1)


class GPTJRope(HFRope):
    """GPT-J: pairs (2i, 2i+1) rotate; full tables repeat each angle twice."""

    turn = staticmethod(rotate_every_two)

    def tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq
        return freqs.cos().repeat_interleave(2, -1).to(x.dtype), freqs.sin().repeat_interleave(2, -1).to(x.dtype)


class UpcastAfterTurnRope(HFRope):
    """Ernie 4.5 and DeepSeek-V4: the products in float32 from tables in x's dtype, the turned
    half upcast after turning it (``turn(x).float()``), the sum cast back."""

    def __init__(self, turn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__("bhtd")
        self.turn = turn
        self.interleaved = turn is rotate_every_two

    def tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.interleaved:
            return GPTJRope.tables(self, x, position_ids)
        return super().tables(x, position_ids)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return ((x.float() * cos) + (self.turn(x).float() * sin)).to(x.dtype)


class GatheredRope(GPTJRope):
    """GPT-J as transformers 5.19 writes it: a [P, D] sin/cos buffer repeated per sequence and
    read with ``torch.gather`` at the positions (the table bounds the positions to P)."""

    def __init__(self, positions: int = 64) -> None:
        super().__init__("bhtd")
        angles = torch.arange(positions, dtype=torch.float32)[:, None] * self.inv_freq
        self.register_buffer("embed_positions", torch.cat((angles.sin(), angles.cos()), dim=-1), persistent=False)

    def tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.embed_positions.repeat(position_ids.shape[0], 1, 1)
        index = position_ids.unsqueeze(-1).repeat(1, 1, table.shape[-1])
        sin, cos = torch.split(torch.gather(table, 1, index).to(x.dtype), table.shape[-1] // 2, dim=-1)
        return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)


def qk(tokens: int = TOKENS, batch: int | None = 1, dtype: torch.dtype = F32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    lead = (tokens,) if batch is None else (batch, tokens)
    q = torch.randn(*lead, HEADS * HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(*lead, KV_HEADS * HEAD_DIM, generator=g).to(dtype)
    pos = torch.randint(0, 50, lead, generator=g)
    return q, k, pos


@functools.cache
def hf_rope(layout: str, dtype: torch.dtype, dynamic: bool | str) -> Compiled:
    """``check`` of ``HFRope(layout, scaling=0.75)`` on :func:`qk`, once per process:
    test_rotary_reverse compares the tables of the reverse rotation with this compile's."""
    return check(HFRope(layout, scaling=0.75), *qk(batch=None if layout == "flat" else 1, dtype=dtype), expect=PAIR,
                 dynamic=dynamic)  # fmt: skip


# --------------------------------------------------------------------------- positive


@DTYPE_MODES
def test_a_gathered_table_folds_bounded_by_its_rows(dtype: torch.dtype, dynamic: bool) -> None:
    r = check(GatheredRope(positions=64), *qk(dtype=dtype), expect=PAIR, dynamic=dynamic)
    assert r.graph.fxr_rotary_cache_0.shape[0] == 64  # the table's rows, not max_positions
    assert reasons(r, "rotary_embedding") == []


@DTYPE_MODES
@pytest.mark.parametrize("layout", ["bhtd", "bthd", "flat"])
def test_hf_rotate_half_folds_inv_freq_tables(layout: str, dtype: torch.dtype, dynamic: bool) -> None:
    r = hf_rope(layout, dtype, dynamic)
    cache = r.graph.fxr_rotary_cache_0
    assert cache.dtype == torch.float32 and cache.shape == (Config().max_positions, HEAD_DIM)
    assert reasons(r, "rotary_embedding") == []


def test_batched_positions_fold_in_token_order() -> None:
    """[B, T] position ids of two sequences at different offsets: tokens flatten in (B, T) order."""
    q, k, _ = qk(batch=2)
    pos = torch.stack((torch.arange(TOKENS), torch.arange(TOKENS) + 30))
    check(HFRope("bhtd"), q, k, pos, expect=PAIR)


def test_cache_rows_follow_max_positions() -> None:
    r = check(HFRope(), *qk(), expect=PAIR, max_positions=128)
    assert r.graph.fxr_rotary_cache_0.shape == (128, HEAD_DIM)


@DTYPE_MODES
def test_engine_cache_indexed_by_positions(dtype: torch.dtype, dynamic: bool) -> None:
    model = EngineRope(positions=64)
    r = check(model, *qk(batch=None, dtype=dtype), expect=PAIR, dynamic=dynamic)
    assert torch.equal(r.graph.fxr_rotary_cache_0, model.cos_sin_cache), "the engine's own cache, its own rows"


class MatmulRope(HFRope):
    """transformers <= 5.17 Llama: ``inv_freq[None, :, None]`` (a view of the buffer, indexed
    without a tensor) times the positions as a batched matmul."""

    def tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).float()
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


@DTYPE_MODES
def test_indexing_inv_freq_does_not_bound_the_positions(dtype: torch.dtype, dynamic: bool) -> None:
    """``inv_freq[None, :, None]`` reads a constant, not a table at the positions: the cache keeps
    ``max_positions`` rows, not ``len(inv_freq)`` (8 here; the positions go up to 49)."""
    r = check(MatmulRope(), *qk(dtype=dtype), expect=PAIR, dynamic=dynamic)
    assert r.graph.fxr_rotary_cache_0.shape == (Config().max_positions, HEAD_DIM)
    assert reasons(r, "rotary_embedding") == []


@DYNAMIC
def test_one_token_positions_fold(dynamic: bool) -> None:
    """A decode step of one token: ``positions`` is a one-element tensor, an input all the same
    (not a lifted Python scalar whose compile-time value the tables could be evaluated at)."""
    r = check(EngineRope(positions=64), *qk(tokens=1, batch=None), expect=PAIR, dynamic=dynamic)
    assert reasons(r, "rotary_embedding") == []


@DYNAMIC
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("batch", [1, 3])
def test_hf_decode_step_folds(layout: str, batch: int, dynamic: bool) -> None:
    """One token per sequence (HF ``position_ids`` ``[B, 1]``): every dim of the positions that
    reach the tables is 1 but the batch, so which one the tokens run along is read from the
    tables' code, not from the shapes."""
    r = check(HFRope(layout), *qk(tokens=1, batch=batch), expect=PAIR, dynamic=dynamic)
    assert reasons(r, "rotary_embedding") == []


@pytest.mark.parametrize("model", [GPTJRope("bhtd"), EngineRope(interleaved=True)], ids=["gptj", "engine"])
def test_interleaved_pairs(model: torch.nn.Module) -> None:
    r = check(model, *qk(batch=None if isinstance(model, EngineRope) else 1), expect=PAIR)
    assert [n.args[-1] for n in r.graph.graph.nodes if n.target is rotary.ROTARY] == [False]  # not NeoX


@pytest.mark.parametrize("turn", [rotate_half, rotate_every_two], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_the_turned_half_upcast_after_turning_folds(turn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> None:
    """``turn(x).float()`` beside ``x.float()`` is the same rotation as ``turn(x.float())``
    (canonicalize moves the cast before the turn): the pair folds in bf16 as in float32."""
    r = check(UpcastAfterTurnRope(turn), *qk(dtype=dtype), expect=PAIR, dynamic="lifted")
    assert reasons(r, "rotary_embedding") == []


@pytest.mark.parametrize("model", [HFRope, GPTJRope], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_partial_rotary_rotates_the_first_dims(model: type[HFRope], dtype: torch.dtype) -> None:
    """Phi, StableLM, Persimmon, Qwen3-Next (halves); GPT-J, CodeGen, GLM (pairs): the first
    ``r`` features rotate, the rest pass through, one kernel."""
    r = check(model("bhtd", rotary_dim=HEAD_DIM // 2), *qk(dtype=dtype), expect=PAIR)
    assert r.graph.fxr_rotary_cache_0.shape[-1] == HEAD_DIM // 2
    assert r.report.rules()["rotary_partial"] == 2


def test_partial_rotary_that_drops_features_is_two_ops() -> None:
    """Twin: the features after the rotated ones pass through from ``r + 2`` on (two are
    dropped): not a partial rotation of x. The rotated slice still folds, the cat stays."""

    class Dropping(HFRope):
        def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            x_rot = x[..., : self.rotary_dim]
            return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x[..., self.rotary_dim + 2 :]), dim=-1)

    r = check(Dropping("bhtd", rotary_dim=HEAD_DIM // 2), *qk(), expect=PAIR)
    assert "rotary_partial" not in r.report.rules() and reasons(r, "rotary_partial") == ["10 != bound r 8"] * 2


def test_q_alone() -> None:
    class QOnly(HFRope):
        def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            return super().forward(q, k, position_ids)[0] + 0  # k's rotation is dead code

    check(QOnly(), *qk(), expect={"rotary_embedding_q": 1})


def test_layers_share_one_cache_and_pair_per_layer() -> None:
    class TwoLayers(EngineRope):
        def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
            q1, k1 = super().forward(q, k, positions)
            return super().forward(q1 * 2, k1 * 2, positions)

    r = check(TwoLayers(), *qk(batch=None), expect={"rotary_embedding": 2})
    assert [name for name, _ in r.graph.named_buffers() if name.startswith("fxr_rotary_cache")] == ["fxr_rotary_cache_0"]


# --------------------------------------------------------------------------- negative twins


def test_tables_given_as_inputs_do_not_fold() -> None:
    """cos and sin passed in (no positions, no buffers): the rotation fuses, the tables cannot
    fold; the torch reference serves it and the report says why."""

    def rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return q * cos + rotate_half(q) * sin

    q = torch.randn(TOKENS, HEADS, HEAD_DIM)
    cos, sin = torch.randn(TOKENS, 1, HEAD_DIM), torch.randn(TOKENS, 1, HEAD_DIM)
    r = check(rope, q, cos, sin, expect={"apply_rotary": 1})
    assert reasons(r, "rotary_embedding") == [
        "cos/sin are not computed from integer positions in the graph: they come from inputs ['l_cos_', 'l_sin_']"]


def test_slices_that_do_not_halve_do_not_match() -> None:
    def rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return q * cos + torch.cat((-q[..., 4:], q[..., :4]), dim=-1) * sin

    q = torch.randn(TOKENS, HEADS, 12)
    r = check(rope, q, torch.randn(TOKENS, 1, 12), torch.randn(TOKENS, 1, 12), expect={})
    assert any("do not halve" in why for why in reasons(r, "rotary_neox"))


def test_halves_that_differ_do_not_fold() -> None:
    """Tables whose two halves differ are not RoPE tables: the kernel (half-width angles)
    would compute something else, so they stay unfolded."""

    class Skewed(HFRope):
        def tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            freqs = position_ids[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, 2 * freqs), dim=-1)
            return emb.cos(), emb.sin()

    r = check(Skewed(), *qk(), expect={"apply_rotary": 2})
    assert all("halves of cos differ" in why for why in reasons(r, "rotary_embedding"))


def test_tables_that_are_not_per_position_do_not_fold() -> None:
    """Angles summed over the sequence depend on other tokens' positions. (A cumsum of the
    integer positions would be fine: the kernel then reads the table at those summed positions.)"""

    class Running(HFRope):
        def tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            freqs = (position_ids[..., None].float() * self.inv_freq).cumsum(1)
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos(), emb.sin()

    r = check(Running(), *qk(), expect={"apply_rotary": 2})
    assert all("not per-position" in why for why in reasons(r, "rotary_embedding"))


def test_rows_read_past_the_cache_do_not_fold() -> None:
    """Twin of the engine's cache: the mean of rows ``positions`` and ``positions + 1``, a
    per-position table whose position P-1 would read past the table's P rows. The fold refuses
    and says why (evaluated on a GPU, a gather out of range asserts on the device)."""

    class Neighbours(EngineRope):
        def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
            rows = (self.cos_sin_cache[positions] + self.cos_sin_cache[positions + 1]) / 2
            cos, sin = rows.chunk(2, dim=-1)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q = self.rotate(q.view(q.shape[0], -1, HEAD_DIM), cos, sin)
            return q.flatten(1), self.rotate(k.view(k.shape[0], -1, HEAD_DIM), cos, sin).flatten(1)

    r = check(Neighbours(positions=64), *qk(batch=None), expect={"apply_rotary": 2})
    why = reasons(r, "rotary_embedding")
    assert len(why) == 2 and all(w.startswith("positions 0..P-1 read `") and w.endswith(
        "` at 1..64, outside its table's 64 rows") for w in why), why


def test_rotation_read_elsewhere_does_not_pair_across_it() -> None:
    """q's rotation feeds k's input: the two cannot run as one kernel; each runs alone."""

    class Chained(HFRope):
        def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            cos, sin = self.tables(q, position_ids)
            q = q.view(q.shape[0], -1, HEAD_DIM)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q1 = self.rotate(q, cos, sin)
            return self.rotate(q1[:, :KV_HEADS] * 2, cos, sin)

    check(Chained(), *qk(batch=None), expect={"rotary_embedding_q": 2})


# --------------------------------------------------------------------------- other families' spellings, each with its twin


class SinusoidalRope(torch.nn.Module):
    """RoFormer: a sinusoidal table (sin, then cos, per position) read at ``arange(T)`` made in
    the graph; angles and x's features taken in pairs by ``stack(..., -1).reshape_as``. ``skew``:
    the twin, whose sin pairs mix a sine and a cosine (not rotary tables)."""

    def __init__(self, skew: bool = False) -> None:
        super().__init__()
        angles = torch.arange(64, dtype=torch.float32)[:, None] * inv_freq(HEAD_DIM)
        self.register_buffer("table", torch.cat((angles.sin(), angles.cos()), dim=-1), persistent=False)
        self.skew = skew

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.nn.functional.embedding(torch.arange(q.shape[1]), self.table)[None, None]
        sin, cos = pos.chunk(2, dim=-1)
        sin_pos = torch.stack([sin, cos if self.skew else sin], dim=-1).reshape_as(pos)
        cos_pos = torch.stack([cos, cos], dim=-1).reshape_as(pos)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x = x.view(*x.shape[:2], -1, HEAD_DIM).transpose(1, 2)
            return x * cos_pos + torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape_as(x) * sin_pos

        return rotate(q), rotate(k)


@DTYPE_MODES
def test_sinusoidal_table_read_at_arange_folds(dtype: torch.dtype, dynamic: bool) -> None:
    model = SinusoidalRope().to(dtype)
    r = check(model, *qk(dtype=dtype)[:2], expect=PAIR, dynamic=dynamic)
    assert [n.args[-1] for n in fused_nodes(r, "rotary_embedding")] == [False]  # pairs: not NeoX
    want = torch.cat(model.table.chunk(2, -1)[::-1], -1).float()
    assert torch.equal(r.graph.fxr_rotary_cache_0, want), "the table's own rows: cos, then sin"


def test_tables_wider_than_x_rotate_in_their_dtype() -> None:
    """float32 tables, bf16 q and k, a float32 result nobody casts back: the kernel rotates q
    and k cast to float32 (rotating in bf16 and widening after would round where eager does not)."""
    r = check(SinusoidalRope(), *qk(dtype=BF16)[:2], expect=PAIR)
    assert [n.args[1].meta["example_value"].dtype for n in fused_nodes(r, "rotary_embedding")] == [F32]


def test_sinusoidal_table_whose_pairs_differ_does_not_fold() -> None:
    r = check(SinusoidalRope(skew=True), *qk()[:2], expect={"apply_rotary": 2})
    assert reasons(r, "rotary_embedding") == ["the pairs of sin differ: not rotary tables"] * 2


class FactoryRope(HFRope):
    """Phi-MoE: ``inv_freq`` computed in ``forward`` from ``arange(0, dim, 2)`` (float, or int64
    and cast, as other rope initializers do). ``rand``: the twin, random frequencies."""

    def __init__(self, make: str) -> None:
        super().__init__("bhtd")
        self.make = make

    def tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.make == "rand":
            inv = torch.rand(HEAD_DIM // 2)
        else:
            steps = torch.arange(0, HEAD_DIM, 2, dtype=torch.float if self.make == "float" else torch.int64)
            inv = 1.0 / 10000.0 ** (steps.float() / HEAD_DIM)
        freqs = position_ids[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


@DYNAMIC
@pytest.mark.parametrize("make", ["float", "int64"])
def test_inv_freq_made_in_forward_is_a_constant(make: str, dynamic: bool) -> None:
    r = check(FactoryRope(make), *qk(), expect=PAIR, dynamic=dynamic)
    assert reasons(r, "rotary_embedding") == []


def test_random_frequencies_made_in_forward_do_not_fold() -> None:
    """Twin: ``rand`` is no constant (and the fold must not draw from the user's generator).
    Eager and compiled draw different frequencies: op counts only."""
    r = compile_once(FactoryRope("rand"), *qk())
    assert fused(r.counts()) == {"apply_rotary": 2}
    why = "cos/sin depend on ['inv = rand(...)'], which are neither the positions nor constants"
    assert reasons(r, "rotary_embedding") == [why] * 2


class SectionRope(HFRope):
    """Qwen3.5 (multimodal RoPE) on text: one row of positions expanded into 3 sections (t, h, w)
    whose angles are written in place over every 3rd frequency of section 0. Positions ``[3, 1,
    T]`` (an image's grid): the twin, each token with 3 different positions."""

    def tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.dim() == 2:
            position_ids = position_ids[None].expand(3, -1, -1)
        freqs = position_ids[..., None].float() * self.inv_freq

        def recompose(f: torch.Tensor) -> torch.Tensor:
            out = f[0]
            for d in (1, 2):
                out[..., d::3] = f[d, ..., d::3]
            return torch.cat((out, out), dim=-1)

        return recompose(freqs.cos()).to(x.dtype), recompose(freqs.sin()).to(x.dtype)


@DTYPE_MODES
def test_sections_of_one_positions_row_fold_with_their_in_place_writes(dtype: torch.dtype, dynamic: bool) -> None:
    check(SectionRope("bhtd"), *qk(dtype=dtype), expect=PAIR, dynamic=dynamic)


def test_sections_of_different_positions_do_not_fold() -> None:
    q, k, pos = qk()
    r = check(SectionRope("bhtd"), q, k, torch.stack((pos, pos + 1, pos * 2)), expect={"apply_rotary": 2}, dynamic=False)
    assert reasons(r, "rotary_embedding") == [
        "each row of the tables ((1, 7)) is computed from several positions (`l_position_ids_` (3, 1, 7): "
        "multimodal RoPE sections, say); a cache row holds the angles of one position"] * 2


class StateWriteRope(HFRope):
    """Twin: the tables' computation writes into a buffer in place (evaluating it again would
    write the model's state)."""

    def tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.inv_freq.mul_(1.0)
        return super().tables(x, position_ids)


class LateWriteRope(HFRope):
    """Twin: cos is written in place between the rotation of q and that of k (each reads other
    values: no one cache serves both)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(q, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = self.rotate(q.view(*q.shape[:2], -1, HEAD_DIM).transpose(1, 2), cos, sin)
        cos[..., 0] = 1.0
        return q, self.rotate(k.view(*k.shape[:2], -1, HEAD_DIM).transpose(1, 2), cos, sin)


@pytest.mark.parametrize(("model", "why"), [
    (StateWriteRope(), "`mul_` writes in place into `l_self_buffers_inv_freq_`, a constant the tables read"),
    (LateWriteRope(), "`setitem` writes in place into the tables' `mul_1` after it is computed"),
], ids=["state", "late"])  # fmt: skip
def test_tables_written_in_place_elsewhere_do_not_fold(model: torch.nn.Module, why: str) -> None:
    r = check(model, *qk(), expect={"apply_rotary": 2})
    assert reasons(r, "rotary_embedding") == [why] * 2


class CacheLengthRope(HFRope):
    """A static KV cache's way (transformers' StaticCache): positions counted from the length the
    cache holds, which the cache advances in place after the tables are computed (between the
    rotations of q and k here, as layer 0's cache write comes before layer 1's rotation): the
    positions are a new tensor, so the folded op reads what the tables were computed from.
    ``view``: the twin, positions that are a view of the length, which the write changes."""

    def __init__(self, view: bool = False) -> None:
        super().__init__("bhtd")
        self.view = view

    def forward(self, q: torch.Tensor, k: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = q.shape[1]
        position_ids = length.expand(1, tokens) if self.view else (torch.arange(tokens) + length)[None]
        cos, sin = self.tables(q, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = self.rotate(q.view(*q.shape[:2], -1, HEAD_DIM).transpose(1, 2), cos, sin)
        length.add_(tokens)
        return q, self.rotate(k.view(*k.shape[:2], -1, HEAD_DIM).transpose(1, 2), cos, sin)


def _on_a_copy(model: CacheLengthRope) -> Any:
    """The model on a copy of the length (eager and compiled both see 5: the write stays inside)."""
    return lambda q, k, length: model(q, k, length.clone())


def test_a_cache_length_advanced_after_the_tables_folds() -> None:
    q, k, _ = qk()
    check(_on_a_copy(CacheLengthRope()), q, k, torch.tensor([5]), expect=PAIR, dynamic=False)


def test_positions_written_after_the_tables_do_not_fold() -> None:
    q, k, _ = qk()
    r = check(_on_a_copy(CacheLengthRope(view=True)), q, k, torch.tensor([5]), expect={"apply_rotary": 2}, dynamic=False)
    assert reasons(r, "rotary_embedding") == ["`add_` writes in place into the positions `getitem` after the tables "
                                              "are computed: the folded op would read the new values"] * 2


class ComplexRope(HFRope):
    """Llama 4, DeepSeek-V2: x's pairs as complex numbers times ``freqs_cis = polar(1, angles)``,
    in float32, cast back. ``real``: the twin, a real tensor where the complex angles go."""

    def __init__(self, real: bool = False) -> None:
        super().__init__("bthd")
        self.real = real

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].float() * self.inv_freq
        freqs = angles if self.real else torch.polar(torch.ones_like(angles), angles)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x = x.view(*x.shape[:2], -1, HEAD_DIM)
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * freqs[:, :, None, :]).flatten(3).type_as(x)

        return rotate(q), rotate(k)


@DTYPE_MODES
def test_complex_rotation_folds(dtype: torch.dtype, dynamic: bool) -> None:
    r = check(ComplexRope(), *qk(dtype=dtype), expect=PAIR, dynamic=dynamic)
    assert [n.args[-1] for n in fused_nodes(r, "rotary_embedding")] == [False]  # pairs: not NeoX
    assert fused_nodes(r, "rotary_embedding")[0].args[1].meta["example_value"].dtype == dtype, "x read as is"


def test_complex_product_with_real_factors_is_no_rotation() -> None:
    r = check(ComplexRope(real=True), *qk(), expect={})
    why = "guard: x torch.float32 times freqs torch.float32: not a real tensor rotated by complex angles"
    assert reasons(r, "rotary_complex")[0] == why


class QKNormRope(HFRope):
    """Per-head RMSNorms of q and k next to the rotation: before it (Qwen3, OLMo2), after it
    (Llama 4's order), or, the twin, between the normalization and its weight (not a norm)."""

    def __init__(self, order: str) -> None:
        super().__init__("bthd")
        self.order = order
        self.q_proj, self.k_proj = torch.nn.Linear(64, HEADS * HEAD_DIM), torch.nn.Linear(64, KV_HEADS * HEAD_DIM)
        self.q_norm, self.k_norm = LlamaRMSNorm(HEAD_DIM), LlamaRMSNorm(HEAD_DIM)

    def forward(self, h: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(h, position_ids)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        out = []
        for proj, norm in ((self.q_proj, self.q_norm), (self.k_proj, self.k_norm)):
            x = proj(h).view(*h.shape[:2], -1, HEAD_DIM)
            if self.order == "norm_then_rope":
                out.append(self.rotate(norm(x), cos, sin))
            elif self.order == "rope_then_norm":
                out.append(norm(self.rotate(x, cos, sin)))
            else:
                xf = x.float()
                normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
                out.append(norm.weight * self.rotate(normed, cos, sin))
        return out[0], out[1]


def hidden(dtype: torch.dtype = F32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, TOKENS, 64).to(dtype), torch.arange(TOKENS)[None]


@DTYPE_MODES
@pytest.mark.parametrize("order", ["norm_then_rope", "rope_then_norm"])
def test_per_head_norms_on_either_side_of_the_rotation(order: str, dtype: torch.dtype, dynamic: bool) -> None:
    """Both fuse. The rotation's closing add is no residual add for add + norm to take."""
    model = QKNormRope(order).to(dtype)
    r = check(model, *hidden(dtype), expect={**PAIR, "rms_norm": 2}, dynamic=dynamic)
    assert reasons(r, "rotary_embedding") == []


def test_rotation_inside_a_norm_leaves_the_norm_unfused() -> None:
    """Twin: the weight scales the rotated normalized value; a fused norm would scale before
    rotating, which differs. The rotation fuses; the weighted norm does not take the weight
    across it. The normalization alone is a weightless RMSNorm, which the norms' weightless rule
    (rms_norm_unweighted, added after this test was written) fuses: the weight's product stays."""
    model = QKNormRope("inside")
    r = check(model, *hidden(), expect={**PAIR, "rms_norm": 2})
    assert [s.rule for s in sites(r) if "norm" in s.rule] == ["rms_norm_unweighted"] * 2
    assert [n.args[1] for n in fused_nodes(r, "rms_norm")] == [None, None]
