"""vLLM's native torch code (its custom ops off), written as plain torch in ``helpers.engine`` (no
vLLM needed): the default rules fuse each piece, in float32 and bf16, and negative twins stay.

The spellings that differ from transformers' (see ``helpers.engine``): the residual add in float32
with the new residual cast back beside the norm, RMSNorm on ``weight.data``, RoPE through an
``index_select`` of a cos|sin cache at flattened positions with an empty pass-through slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers.engine import EPS, HEAD, HIDDEN, EngineLayer, EngineRMSNorm, RopeOnQKV, silu_and_mul, tokens
from helpers.rewrites import BF16, F32, check, reasons

from fxrewrite.rewrites import activation


def test_engine_rms_norm() -> None:
    for dtype in (F32, BF16):
        r = check(EngineRMSNorm(HIDDEN).to(dtype), torch.randn(6, HIDDEN, dtype=dtype), expect={"rms_norm": 1})
        assert r.report.rules() == {"rms_norm": 1} and not r.report.near_misses


def test_engine_add_rms_norm_sums_in_float32() -> None:
    """bf16: the float32-sum rule (the graph casts the sum back beside the norm); float32: every
    cast is a no-op and the plain add + norm rule takes it."""
    for dtype, rule in ((BF16, "add_rms_norm_f32_sum"), (F32, "add_rms_norm")):
        x, res = torch.randn(6, HIDDEN, dtype=dtype), torch.randn(6, HIDDEN, dtype=dtype)
        r = check(EngineRMSNorm(HIDDEN).to(dtype), x, res, expect={"fused_add_rms_norm": 1})
        assert r.report.rules() == {rule: 1} and not r.report.near_misses


def test_engine_add_rms_norm_twin_residual_kept_in_float32() -> None:
    """Negative twin: the new residual stays float32 (never cast back): the fused op returns it in
    the input's dtype, so the add + norm does not fuse, and the report says which output it could
    not find. The norm of the float32 sum alone is a weightless float32 norm (then cast, then
    weighted, as written): that fuses."""

    class KeepsFloat32Residual(EngineRMSNorm):
        def forward(self, x, residual):  # type: ignore[override]
            s = x.to(torch.float32) + residual.to(torch.float32)
            normed = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * self.weight
            return normed, s

    x, res = torch.randn(6, HIDDEN, dtype=BF16), torch.randn(6, HIDDEN, dtype=BF16)
    r = check(KeepsFloat32Residual(HIDDEN).to(BF16), x, res, expect={"rms_norm": 1})
    assert r.report.rules() == {"rms_norm_unweighted": 1}
    [why] = reasons(r, "add_rms_norm_f32_sum")
    assert why.startswith("no reader of") and "computes the pattern's output" in why, why


def test_engine_rotary_whole_head_folds_into_one_kernel() -> None:
    """The empty pass-through slice and its ``cat`` go; the rotation of q and k becomes one
    ``rotary_embedding`` on the cache the engine indexes (its rows bound the positions)."""
    for dtype in (F32, BF16):
        pos, h, _ = tokens(dtype=dtype)
        r = check(RopeOnQKV(dtype=dtype).to(dtype), pos, h, expect={"rotary_embedding": 1})
        assert not r.report.near_misses
        assert r.counts()["torch.cat"] == 0 and r.counts()["aten.index_select"] == 0


def test_engine_rotary_partial_rotates_the_first_dims() -> None:
    pos, h, _ = tokens()
    r = check(RopeOnQKV(rotary_dim=HEAD // 2), pos, h, expect={"rotary_embedding": 1})
    assert not r.report.near_misses


def test_engine_rotary_positions_reordered_before_the_cache() -> None:
    """The cache read at positions reordered first: the tables are per position of the reordered
    tensor, which the kernel then reads."""
    pos, h, _ = tokens()
    r = check(RopeOnQKV(index="reversed-positions"), pos, h, expect={"rotary_embedding": 1})
    assert not r.report.near_misses


def test_engine_rotary_twin_rows_not_per_position() -> None:
    """Negative twin: the rows read are reordered after the gather, so token i gets another
    token's angles: the rotation is matched, its tables do not fold, and the report says why."""
    pos, h, _ = tokens()
    r = check(RopeOnQKV(index="reversed-rows"), pos, h, expect={"apply_rotary": 2})
    assert reasons(r, "rotary_embedding") == ["cos/sin are not per-position tables (shuffled positions do not shuffle them)"] * 2


def test_engine_silu_and_mul_and_its_twin() -> None:
    x = torch.randn(6, 2 * HIDDEN)
    check(silu_and_mul, x, expect={"silu_and_mul": 1})
    overlap = lambda x: F.silu(x[..., : HIDDEN + 8]) * x[..., HIDDEN - 8 :]  # noqa: E731 - gate and up overlap
    r = check(overlap, x, expect={}, rules=activation.ONE_TENSOR_RULES)
    assert r.counts()["aten.silu"] == 1
    check(overlap, x, expect={"act_mul": 1})  # the library: two equally shaped operands


def test_engine_layer_fuses_everything() -> None:
    """A whole layer of engine code: both norms with the residual add (the second in place: its
    inputs are the layer's own), RoPE and SiLU-and-mul fuse and nothing nearly matches, in float32
    and bf16."""
    for dtype in (F32, BF16):
        pos, h, res = tokens(dtype=dtype)
        r = check(EngineLayer(dtype).to(dtype), pos, h, res,
                  expect={"fused_add_rms_norm": 1, "fused_add_rms_norm_": 1, "rotary_embedding": 1,
                          "silu_and_mul": 1})  # fmt: skip
        assert not r.report.near_misses, r.report.near_misses
