"""The Triton provider's kernels on CPU, under Triton's interpreter (skipped without Triton).

The interpreter computes in numpy float32 with exact ``rsqrt`` / ``exp`` and IEEE division, and
(``triton_kernels`` fixture) rounds casts as the GPU does; the kernels round where the spec
rounds, so here they give the spec's bytes exactly. On the GPU, approximate ``rsqrt`` / ``exp``
may move a value by one FP8 step: tests/runtime/test_ops_gpu.py checks that contract.
"""

from __future__ import annotations

import types
import zlib

import pytest
import torch

from fxrewrite.runtime.ops import activation, norm, norm_variants, quant
from fxrewrite.runtime.providers import OpDef
from samples import EPS, op_args, rand, with_arg  # this folder

TRITON_OPS = [op for op in quant.DEFS if any(k.provider == "triton" for k in op.kernels)]
NORM_OPS = [op for op in TRITON_OPS if op.name.startswith(("rms", "fused"))]


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def as_tuple(out: object) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)  # type: ignore[return-value]


def check_of(op: OpDef) -> object:
    return next(k for k in op.kernels if k.provider == "triton").check


def assert_same_bytes(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    for g, w in zip(got, want):
        g, w = (g.view(torch.uint8), w.view(torch.uint8)) if g.dtype == quant.FP8_DTYPE else (g, w)
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("cast_last", [False, True], ids=["round-then-scale", "scale-then-round"])
@pytest.mark.parametrize("shape", [(1, 64), (5, 33), (2, 3, 128), (4, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", TRITON_OPS, ids=lambda op: op.name)
def test_kernel_gives_the_spec_bytes(triton_kernels: types.ModuleType, gen: torch.Generator, op: OpDef,
                                     dtype: torch.dtype, shape: tuple[int, ...], cast_last: bool) -> None:  # fmt: skip
    """The norms in either order of weight and rounding (``cast_last``: torch.rms_norm's)."""
    if op not in NORM_OPS:
        if cast_last:
            pytest.skip("no norm")
        shape = (*shape[:-1], 2 * shape[-1])  # [..., 2d]
    args = with_arg(op, op_args(op, shape, gen, dtype), "cast_last", cast_last)
    assert check_of(op)(*args) is None  # type: ignore[operator]
    assert_same_bytes(as_tuple(getattr(triton_kernels, op.name)(*args)), as_tuple(op.reference(*args)))


@pytest.mark.parametrize("op", NORM_OPS, ids=lambda op: op.name)
def test_norm_reads_strided_rows(triton_kernels: types.ModuleType, gen: torch.Generator, op: OpDef) -> None:
    """Rows sliced out of a wider tensor (e.g. a fused projection's output) are read in place."""
    args = op_args(op, (3, 64), gen)
    for i in (0, 1) if "add" in op.name else (0,):
        args[i] = rand(gen, 3, 96)[:, 16:80]
    assert not args[0].is_contiguous() and check_of(op)(*args) is None  # type: ignore[operator]
    assert_same_bytes(as_tuple(getattr(triton_kernels, op.name)(*args)), as_tuple(op.reference(*args)))


@pytest.mark.parametrize("op", [op for op in TRITON_OPS if "dynamic" in op.name], ids=lambda op: op.name)
def test_zero_rows_get_the_floor_scale(triton_kernels: types.ModuleType, gen: torch.Generator, op: OpDef) -> None:
    """Padding tokens (zero rows) give q = 0 and s = 1e-12 / 448, never 0 or NaN."""
    args = op_args(op, (3, 64), gen)
    for i in (0, 1) if "add" in op.name else (0,):
        args[i] = torch.zeros_like(args[i])
    q, s = as_tuple(getattr(triton_kernels, op.name)(*args))[:2]
    assert torch.equal(q.float(), torch.zeros_like(q, dtype=torch.float32))
    assert torch.equal(s, torch.full_like(s, quant.SCALE_FLOOR))


def test_static_scale_saturates(triton_kernels: types.ModuleType, gen: torch.Generator) -> None:
    x, w = rand(gen, 4, 64), torch.ones(64, dtype=torch.bfloat16)
    q = triton_kernels.rms_norm_quant_fp8(x, w, EPS, torch.tensor([1e-4]))
    assert q.float().abs().max() == quant.FP8_MAX and not q.float().isnan().any()
    q = triton_kernels.silu_and_mul_quant_fp8(rand(gen, 3, 2 * 2000) * 4, torch.tensor([1e-4]))
    assert q.float().abs().max() == quant.FP8_MAX and not q.float().isnan().any()


def test_checks_refuse_what_the_kernels_cannot_serve(gen: torch.Generator) -> None:
    """No Triton needed: the checks live in the op module."""
    norm, static_silu, silu = (
        quant.DEFS[quant.OPS.index(name)]
        for name in ("rms_norm_dynamic_quant_fp8", "silu_and_mul_quant_fp8", "silu_and_mul_dynamic_quant_fp8")
    )
    x, w = rand(gen, 2, 64), rand(gen, 64)
    assert check_of(norm)(x.float(), w.float(), EPS) == "dtype float32 not bf16/fp16"  # type: ignore[operator]
    wide = quant.TRITON_MAX_ROW + 8
    reason = f"row of {wide} values exceeds one Triton program ({quant.TRITON_MAX_ROW})"
    assert check_of(norm)(rand(gen, 1, wide), rand(gen, wide), EPS) == reason  # type: ignore[operator]
    assert check_of(silu)(rand(gen, 1, 2 * wide)) == reason  # type: ignore[operator]
    assert check_of(static_silu)(rand(gen, 1, 2 * wide), torch.tensor([0.02])) is None  # type: ignore[operator]
    assert check_of(silu)(rand(gen, 4, 2 * 64)[:, :64]) == "input not contiguous"  # type: ignore[operator]
    assert "is not one float32" in check_of(static_silu)(x, torch.tensor([0.02, 0.03]))  # type: ignore[operator]


# --------------------------------------------------------------------------- strided rows: norms and activations

ROWS_OPS = {op.name: op for op in norm.DEFS + norm_variants.DEFS + activation.DEFS
            if any(k.provider == "triton" for k in op.kernels)}  # fmt: skip


def per_head(gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """q of a merged q/k/v projection, [B, T, H, D]: rows at the qkv row stride (the Q/K norm case)."""
    return rand(gen, 2, 5, 3 * 4 * 64, dtype=dtype)[..., : 4 * 64].view(2, 5, 4, 64)


def permuted(gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """[T, B, H, D] read from a [B, H, T, D] buffer: three leading dims at independent strides."""
    return rand(gen, 2, 4, 5, 64, dtype=dtype).permute(2, 0, 1, 3)


LAYOUTS = {"rows": lambda gen, dtype: rand(gen, 7, 64, dtype=dtype), "per-head": per_head, "permuted": permuted}


def close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    """The spec's values: the kernels round where it rounds, so only the order of the row sum
    differs; in half dtypes that moves a rare value by one step (at most 1% of them)."""
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    for g, w in zip(got, want):
        step = torch.finfo(g.dtype).eps
        torch.testing.assert_close(g, w, rtol=step, atol=1e-6)
        assert (g != w).float().mean() <= (0.01 if g.dtype != torch.float32 else 1.0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", list(ROWS_OPS))
def test_rows_kernels_give_the_spec_at_any_strides(
    triton_kernels: types.ModuleType, gen: torch.Generator, name: str, dtype: torch.dtype, layout: str
) -> None:
    op = ROWS_OPS[name]
    x = LAYOUTS[layout](gen, dtype)
    if op in activation.DEFS:
        x = torch.cat([x, x.flip(-1)], dim=-1)[..., 16:16 + x.shape[-1]]  # [.., 2d], offset into wider rows
    args = op_args(op, tuple(x.shape), gen, dtype)
    args[0] = x
    if "add" in name or "gated" in name:  # the residual, the gate: at the same strides
        args[1] = LAYOUTS[layout](gen, dtype)
    assert check_of(op)(*args) is None  # type: ignore[operator]
    want = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = next(k for k in op.kernels if k.provider == "triton").run(*args)  # functional add: torch adds
    if op.mutates_args:  # in place: x <- norm(x + residual), residual <- x + residual
        op.reference(*want)
        close((args[0], args[1]), (want[0], want[1]))
    else:
        close(as_tuple(out), as_tuple(op.reference(*want)))


@pytest.mark.parametrize("cast_last", [False, True], ids=["round-then-scale", "scale-then-round"])
def test_norm_takes_a_float32_weight_in_either_order(triton_kernels: types.ModuleType, gen: torch.Generator,
                                                     cast_last: bool) -> None:  # fmt: skip
    x, w = per_head(gen, torch.bfloat16), rand(gen, 64, dtype=torch.float32)
    assert check_of(ROWS_OPS["rms_norm"])(x, w, EPS, cast_last) is None  # type: ignore[operator]
    close((triton_kernels.rms_norm(x, w, EPS, cast_last),), (norm.rms_norm_reference(x, w, EPS, cast_last),))


def test_rows_checks_refuse_what_the_kernels_cannot_serve(gen: torch.Generator) -> None:
    """No Triton needed: the checks live in the op modules; the negative twins of the above."""
    rms, add_, silu = (check_of(ROWS_OPS[n]) for n in ("rms_norm", "fused_add_rms_norm_", "silu_and_mul"))
    x, w = rand(gen, 4, 64), rand(gen, 64)
    five = rand(gen, 2, 3, 4, 5, 64).permute(3, 1, 0, 2, 4)  # four leading dims at independent strides
    assert rms(five, w, EPS).startswith("more than 3 leading dims")  # type: ignore[operator]
    assert rms(x.to(torch.float64), w, EPS).startswith("dtype float64")  # type: ignore[operator]
    assert rms(x, rand(gen, 32), EPS) == "weight (32,) is not a contiguous [64] vector"  # type: ignore[operator]
    assert rms(x.t().contiguous().t(), w, EPS) == "last dim not contiguous"  # type: ignore[operator]
    assert add_(x, x, w, EPS) == "inputs share memory"  # type: ignore[operator]
    assert add_(x, x.float(), w, EPS) == "residual torch.float32 != input torch.bfloat16"  # type: ignore[operator]
    assert silu(rand(gen, 4, 63)) == "odd last dim 63"  # type: ignore[operator]
    assert silu(rand(gen, 0, 64)) == "empty input"  # type: ignore[operator]


@pytest.mark.parametrize("round_scale", [False, True], ids=["no-weight", "rounded-scale"])
@pytest.mark.parametrize("weight", [False, True], ids=["unweighted", "weighted"])
def test_norm_without_weight_or_with_the_scale_rounded(triton_kernels: types.ModuleType, gen: torch.Generator,
                                                       weight: bool, round_scale: bool) -> None:  # fmt: skip
    x = per_head(gen, torch.bfloat16)
    args = (x, rand(gen, 64) if weight else None, EPS, False, round_scale)
    assert check_of(ROWS_OPS["rms_norm"])(*args) is None  # type: ignore[operator]
    assert_same_bytes((triton_kernels.rms_norm(*args),), (norm.rms_norm_reference(*args),))


def test_add_norm_in_place_without_weight(triton_kernels: types.ModuleType, gen: torch.Generator) -> None:
    x, r = rand(gen, 5, 64), rand(gen, 5, 64)
    want_x, want_r = x.clone(), r.clone()
    triton_kernels.fused_add_rms_norm_(x, r, None, EPS)
    norm.fused_add_rms_norm_inplace_reference(want_x, want_r, None, EPS)
    assert_same_bytes((x, r), (want_x, want_r))


@pytest.mark.parametrize("slots", [2, 3])
def test_partials_summed_added_and_normed(triton_kernels: types.ModuleType, gen: torch.Generator, slots: int) -> None:
    """The async-TP reduce-scatter's last step (``sum_add_rms_norm``): this rank's rows of every
    rank's partial product (slots ``chunk`` rows apart, only the first ``n`` real) and the
    residual summed in float32 and rounded once, then normed as ``fused_add_rms_norm_`` norms
    its sum; the sum stored apart from the residual, which stays as it was."""
    chunk, n = 6, 5
    partials, r, w = rand(gen, slots, chunk, 64), rand(gen, n, 64), rand(gen, 64)
    keep = r.clone()
    out, total = torch.full_like(r, float("nan")), torch.full_like(r, float("nan"))
    triton_kernels.sum_add_rms_norm(partials[:, :n], r, w, EPS, out, total)
    want_total = (partials[:, :n].float().sum(0) + r.float()).to(r.dtype)
    want_out = norm.rms_norm_reference(want_total, w, EPS)
    assert_same_bytes((out, total, r), (want_out, want_total, keep))
    # a reduce-scatter that rounds its sum before the add differs somewhere: the rounding is skipped
    rounded = partials[:, :n].float().sum(0).to(r.dtype)
    assert not torch.equal((rounded.float() + r.float()).to(r.dtype), want_total)


@pytest.mark.parametrize("world", [2, 3])
def test_rows_summed_from_every_rank_and_stored_to_every_rank(triton_kernels: types.ModuleType, gen: torch.Generator,
                                                              world: int) -> None:  # fmt: skip
    """The exchange of the async-TP site (``exchange_add_rms_norm``): one allocation per rank
    stands for each rank's symmetric memory; this rank's rows of each rank's partial product are
    read at their byte offsets from this rank's and summed with the residual in float32, rounded
    once, normed, and the result stored into every rank's copy of these rows (the other rows of
    each copy untouched); the residual stays as it was."""
    chunk, n, lo = 6, 5, 3
    partials = [rand(gen, world * chunk, 64) for _ in range(world)]  # rank k's partial product
    gathered = [torch.full((world * chunk, 64), float("nan"), dtype=torch.bfloat16) for _ in range(world)]
    me, r, w = 1, rand(gen, n, 64), rand(gen, 64)
    keep = r.clone()

    def table(bufs: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([b.data_ptr() - bufs[me].data_ptr() for b in bufs], dtype=torch.int64)

    total = torch.full_like(r, float("nan"))
    triton_kernels.exchange_add_rms_norm(partials[me][lo : lo + n], table(partials), r, w, EPS,
                                         gathered[me][lo : lo + n], table(gathered), total)  # fmt: skip
    want_total = (sum(p[lo : lo + n].float() for p in partials) + r.float()).to(r.dtype)
    want_out = norm.rms_norm_reference(want_total, w, EPS)
    assert_same_bytes((total, r, *(g[lo : lo + n] for g in gathered)), (want_total, keep, *[want_out] * world))
    for g in gathered:
        assert g[:lo].isnan().all() and g[lo + n :].isnan().all()


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cast_last", [False, True], ids=["round-then-scale", "scale-then-round"])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize(("group_size", "gate_first"), [(None, False), (None, True), (16, True), (16, False)])
def test_gated_norm_every_form(triton_kernels: types.ModuleType, gen: torch.Generator, group_size: int | None,
                               gate_first: bool, activation: str, cast_last: bool, w_dtype: torch.dtype) -> None:  # fmt: skip
    """Norm then gate or gate first, groups or the whole row, SiLU or sigmoid, both orders of the
    weight, a weight of the input's dtype or float32: the spec's bytes."""
    x = per_head(gen, torch.bfloat16)  # [2, 5, 4, 64], rows at the merged projection's stride
    z = rand(gen, 2, 4, 5, 64).permute(0, 2, 1, 3)  # the gate at strides of its own
    args = (x, z, rand(gen, 64, dtype=w_dtype), EPS, group_size, gate_first, activation, cast_last)
    op = ROWS_OPS["rms_norm_gated"]
    assert check_of(op)(*args) is None  # type: ignore[operator]
    assert_same_bytes((op.kernels[0].run(*args),), (op.reference(*args),))


def test_norm_variant_checks_refuse_what_the_kernels_cannot_serve(gen: torch.Generator) -> None:
    """No Triton needed: the negative twins of the above."""
    gated, l2 = check_of(ROWS_OPS["rms_norm_gated"]), check_of(ROWS_OPS["l2_norm"])
    x, w = rand(gen, 4, 64), rand(gen, 64)
    assert gated(x, rand(gen, 4, 64), w, EPS) is None  # type: ignore[operator]
    assert gated(x, rand(gen, 4, 1), w, EPS) == "shape (4, 1) != input shape (4, 64)"  # type: ignore[operator]
    assert gated(x, rand(gen, 4, 64), w, EPS, 24) == "group size 24 does not divide the last dim 64"  # type: ignore[operator]
    assert gated(x, rand(gen, 4, 64), w, EPS, None, False, "gelu") == "activation 'gelu'"  # type: ignore[operator]
    assert gated(x, rand(gen, 4, 64), w.double(), EPS).startswith("weight dtype float64")  # type: ignore[operator]
    assert l2(x.double(), EPS).startswith("dtype float64")  # type: ignore[operator]
