"""NVFP4 (runtime/ops/quant_nvfp4.py): the quantizer on hand-made values against an independent
oracle (nearest e2m1 value by distance, ties to the even code), and the fused ops' Triton kernel
(interpreted, GPU rounding of casts: the ``triton_nvfp4`` fixture) against the references, byte
for byte. tests/runtime/test_quant_nvfp4_gpu.py runs the kernel compiled."""

from __future__ import annotations

import inspect
import types
import zlib

import pytest
import torch

from fxrewrite.runtime.ops import quant_nvfp4 as nv
from fxrewrite.runtime.ops.activation import gelu_and_mul_reference, silu_and_mul_reference
from fxrewrite.runtime.ops.norm import rms_norm_reference
from fxrewrite.runtime.providers import OpDef
from samples import EPS, op_args, rand, with_arg  # this folder

ONE = torch.tensor([1.0])  # with a 6 in every block the scale is exactly 1: values land on the grid as they are
GRID = torch.tensor(nv.E2M1)
MIDPOINTS = [(a + b) / 2 for a, b in zip(nv.E2M1, nv.E2M1[1:])]  # 0.25 0.75 1.25 1.75 2.5 3.5 5.0


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def oracle_codes(v: torch.Tensor) -> torch.Tensor:
    """The e2m1 code of each float (already scaled, |v| <= 6): the nearest grid magnitude, a tie
    to the even code; sign bit for v < 0."""
    dist = (v.abs().double().unsqueeze(-1) - GRID.double()).abs()
    best = dist.min(-1, keepdim=True).values
    ties = dist == best
    even = ties & (torch.arange(8) % 2 == 0)
    index = torch.where(even.any(-1), even.int().argmax(-1), ties.int().argmax(-1))
    return index + 8 * (v < 0).long()


def with_six(values: list[float] | torch.Tensor) -> torch.Tensor:
    """Rows of 16: a 6 then 15 of ``values`` (padded with zeros), so each block's scale is 1."""
    v = torch.as_tensor(values, dtype=torch.float32).flatten()
    v = torch.cat([v, v.new_zeros(-len(v) % 15)]).view(-1, 15)
    return torch.cat([torch.full((len(v), 1), 6.0), v], dim=-1)


def same_bytes(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    for g, w in zip(got, want):
        g, w = (g.view(torch.uint8), w.view(torch.uint8)) if g.dtype == nv.SCALE_DTYPE else (g, w)
        assert torch.equal(g, w), f"{int((g != w).sum())} of {g.numel()} differ"


# -- the quantizer -------------------------------------------------------------------------------


def test_layout_and_packing_order() -> None:
    """Element 2i in the low nibble, 2i + 1 in the high one; scales row-major, one per 16."""
    y = with_six([0.5, 1.0, -1.5, 2.0, 3.0, -4.0, 0.0, -0.0])  # after the block's 6 (code 7)
    q, s = nv.quant_nvfp4(y, ONE)
    assert q.shape == (1, 8) and q.dtype == torch.uint8 and s.shape == (1, 1) and s.dtype == nv.SCALE_DTYPE
    assert s.float().item() == 1.0
    assert q[0, :4].tolist() == [0x7 | 0x1 << 4, 0x2 | 0xB << 4, 0x4 | 0x5 << 4, 0xE | 0x0 << 4]
    assert nv.codes_nvfp4(q).tolist()[0][:8] == [7, 1, 2, 11, 4, 5, 14, 0]


def test_every_grid_value_and_midpoint_rounds_to_even() -> None:
    ties = torch.tensor(MIDPOINTS)
    below = torch.nextafter(ties, torch.zeros(()))
    above = torch.nextafter(ties, torch.full((), 7.0))
    values = torch.cat([GRID, ties, below, above])
    values = torch.cat([values, -values])
    q, _ = nv.quant_nvfp4(with_six(values), ONE)
    want = oracle_codes(with_six(values))
    assert torch.equal(nv.codes_nvfp4(q), want)
    # the ties by name: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    q, _ = nv.quant_nvfp4(with_six(ties), ONE)
    assert nv.codes_nvfp4(q)[0, 1:8].tolist() == [0, 2, 2, 4, 4, 6, 6]


def test_every_bf16_value_up_to_six_matches_the_oracle() -> None:
    """All 16-bit floats in [-6, 6] of bf16 and fp16, exactly on the grid's scale (the scale is 1)."""
    for dtype in (torch.bfloat16, torch.float16):
        bits = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(dtype).float()
        values = bits[bits.isfinite() & (bits.abs() <= 6)]
        y = with_six(values)
        q, _ = nv.quant_nvfp4(y, ONE)
        assert torch.equal(nv.codes_nvfp4(q), oracle_codes(y)), dtype


def test_zeros_negatives_and_tiny_blocks() -> None:
    y = torch.zeros(2, 32)
    y[0, 16:] = -1e-30  # a block too small for any e4m3 scale: scale 0, every value 0 (sign dropped)
    y[1, :16] = torch.linspace(-6, 6, 16)
    y[1, 16:] = -0.6 / torch.arange(1, 17)
    y[1, 31] = -0.01  # negative, rounds to zero in its block's scale
    q, s = nv.quant_nvfp4(y, ONE)
    assert s.float()[0].tolist() == [0.0, 0.0] and s.float()[1].tolist() == [1.0, 0.1015625]  # e4m3(0.1)
    codes = nv.codes_nvfp4(q)
    assert codes[0].tolist() == [0] * 32
    assert codes[1, 31].item() == 8  # a negative zero, as the hardware conversion gives it
    assert (codes[1, 16:] >= 8).all() and (codes[1, :7] >= 8).all() and (codes[1, 8:16] < 8).all()
    scaled = torch.cat([y[1, :16], y[1, 16:] * (1 / (s.float()[1, 1] * (1 / ONE)))])
    assert torch.equal(codes[1], oracle_codes(scaled))


def test_scale_is_the_references_recipe() -> None:
    """s = e4m3(g * (amax * f32(1 / 6))): by hand for amax 3 and 1 at g 2 (1.0; 0.333 rounds to
    e4m3 0.34375); on random values every dequantized value within half an e2m1 step of the input."""
    y = torch.zeros(1, 32)
    y[0, 0], y[0, 16] = 3.0, 1.0
    _, s = nv.quant_nvfp4(y, torch.tensor([2.0]))
    assert s.float().tolist() == [[1.0, 0.34375]]
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    g = torch.tensor([448 * 6 / x.abs().max().item()])
    q, s = nv.quant_nvfp4(x, g)
    d = nv.dequant_nvfp4(q, s, g)
    unit = s.float().repeat_interleave(16, -1) / g
    mag = d.abs() / unit
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0)) * unit
    assert ((d - x).abs() <= step / 2 * 1.0001).all()


def test_saturation_above_six_times_the_scale() -> None:
    """A global scale that puts a block's scale above 448: the scale saturates at 448 and values
    beyond 6 times it at +-6 (code 7 / 15), never NaN."""
    y = torch.linspace(-12, 12, 32).view(1, 32)
    q, s = nv.quant_nvfp4(y, torch.tensor([1000.0]))
    assert s.float().tolist() == [[448.0, 448.0]]
    d = nv.dequant_nvfp4(q, s, torch.tensor([1000.0]))
    assert not d.isnan().any() and d.abs().max().item() == pytest.approx(6 * 448 / 1000)
    codes = nv.codes_nvfp4(q)[0]
    assert codes[0].item() == 15 and codes[-1].item() == 7


def test_dequant_inverts_the_grid() -> None:
    y = with_six(GRID.tolist() + (-GRID).tolist())
    q, s = nv.quant_nvfp4(y, ONE)
    assert torch.equal(nv.dequant_nvfp4(q, s, ONE), y)


def test_mismatch_accepts_one_step_and_refuses_two() -> None:
    y = with_six(torch.linspace(0, 5.9, 15))
    q, s = nv.quant_nvfp4(y, ONE)
    assert nv.nvfp4_mismatch((q, s), (q, s), ONE) is None
    one_up = q.clone()
    one_up[0, 3] += 1  # elements 6, 7: codes one index up in the low nibble
    assert nv.nvfp4_mismatch((one_up, s), (q, s), ONE) is None
    two_up = q.clone()
    two_up[0, 3] += 2
    assert nv.nvfp4_mismatch((two_up, s), (q, s), ONE) == "1 of 16 values more than one e2m1 step off"


# -- the fused ops and their Triton kernel ------------------------------------------------------

FUSED = [op for op in nv.DEFS if op.name != "quant_nvfp4"]  # the quantizer alone: test_quant_alone_ops.py


def as_tuple(out: object) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)  # type: ignore[return-value]


def is_act(op: OpDef) -> bool:
    return "weight" not in op.reference.__code__.co_varnames[: op.reference.__code__.co_argcount]


def triton_check(op: OpDef) -> object:
    return op.kernels[0].check


def arg(op: OpDef, args: list[object], name: str) -> object:
    """The argument ``name`` of ``op`` (the norms end in ``cast_last``, the activations do not)."""
    return args[list(inspect.signature(op.reference).parameters).index(name)]


@pytest.mark.parametrize("op", FUSED, ids=lambda op: op.name)
def test_reference_is_the_unfused_code_then_the_quantizer(gen: torch.Generator, op: OpDef) -> None:
    args = op_args(op, (3, 64), gen)
    got = as_tuple(getattr(torch.ops.fxr, op.name)(*args))
    x, g = args[0], arg(op, args, "global_scale")
    if op.name == "rms_norm_quant_nvfp4":
        want = nv.quant_nvfp4(rms_norm_reference(x, args[1], EPS, args[-1]), g)
    elif op.name.startswith("fused_add"):
        total = x + args[1]
        want = (*nv.quant_nvfp4(rms_norm_reference(total, args[2], EPS, args[-1]), g), total)
    elif op.name.startswith("silu"):
        want = nv.quant_nvfp4(silu_and_mul_reference(x), g)
    else:
        want = nv.quant_nvfp4(gelu_and_mul_reference(x, args[2]), g)
    same_bytes(got, want)


@pytest.mark.parametrize("cast_last", [False, True], ids=["round-then-scale", "scale-then-round"])
@pytest.mark.parametrize("shape", [(1, 64), (5, 48), (2, 3, 128), (4, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("op", FUSED, ids=lambda op: op.name)
def test_kernel_gives_the_spec_bytes(triton_nvfp4: types.ModuleType, gen: torch.Generator, op: OpDef,
                                     dtype: torch.dtype, shape: tuple[int, ...], cast_last: bool) -> None:  # fmt: skip
    """The quantized bytes are the spec's of what the kernel quantized (``y_out``), always; that
    is the reference's own intermediate, so the outputs are the reference's bytes, except GELU's:
    the interpreter's erf / tanh and torch's differ in the last bit, which a 16-bit rounding
    mostly but not always hides (2 bytes of 2048 at fp16). The norms in either order of weight
    and rounding (``cast_last``: torch.rms_norm's)."""
    if is_act(op):
        if cast_last:
            pytest.skip("no norm")
        shape = (*shape[:-1], 2 * shape[-1])
    args = with_arg(op, op_args(op, shape, gen, dtype), "cast_last", cast_last)
    args[0] = args[0] * 2  # some blocks past the global scale's top
    assert triton_check(op)(*args) is None  # type: ignore[operator]
    width = shape[-1] // 2 if is_act(op) else shape[-1]
    y = torch.empty((*shape[:-1], width), dtype=dtype)
    got = as_tuple(getattr(triton_nvfp4, op.name)(*args, y_out=y))
    g = arg(op, args, "global_scale")
    same_bytes(got[:2], nv.quant_nvfp4(y, g))
    if op.name.startswith("gelu"):
        torch.testing.assert_close(y, gelu_and_mul_reference(args[0], args[2]))
    else:
        same_bytes(got, as_tuple(op.reference(*args)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantizer_kernel_alone_gives_the_spec_bytes(triton_nvfp4: types.ModuleType, dtype: torch.dtype) -> None:
    """Hand-made values (grid, ties, their neighbours, zeros, negatives, saturation) and random ones."""
    ties = torch.tensor(MIDPOINTS)
    values = torch.cat([GRID, ties, torch.nextafter(ties, torch.zeros(())), torch.nextafter(ties, torch.full((), 7.0))])
    y = torch.cat([with_six(torch.cat([values, -values])), torch.zeros(1, 16), torch.full((1, 16), -1e-30)])
    y = torch.cat([y.flatten(), torch.randn(16 * 42, generator=torch.Generator().manual_seed(1)) * 3]).view(-1, 64)
    for g in (ONE, torch.tensor([300.0]), torch.tensor([1e5])):
        same_bytes(triton_nvfp4.quant_nvfp4(y.to(dtype), g), nv.quant_nvfp4(y.to(dtype), g))


def test_kernel_writes_what_it_quantized(triton_nvfp4: types.ModuleType, gen: torch.Generator) -> None:
    """``y_out``: the quantizer's input, the norm's output (what the GPU tests check the quantizer by)."""
    x, w = rand(gen, 3, 64), rand(gen, 64)
    y = torch.empty_like(x)
    q, s = triton_nvfp4.rms_norm_quant_nvfp4(x, w, EPS, ONE, y_out=y)
    assert torch.equal(y, rms_norm_reference(x, w, EPS))
    same_bytes((q, s), nv.quant_nvfp4(y, ONE))


def test_kernel_reads_rows_at_a_stride(triton_nvfp4: types.ModuleType, gen: torch.Generator) -> None:
    wide = rand(gen, 4, 160)
    x, r, w = wide[:, :64], wide[:, 64:128], rand(gen, 64)
    g = torch.tensor([300.0])
    same_bytes(triton_nvfp4.fused_add_rms_norm_quant_nvfp4(x, r, w, EPS, g),
               nv.fused_add_rms_norm_quant_nvfp4_reference(x, r, w, EPS, g))  # fmt: skip
    gate_up = wide[:, :128]
    same_bytes(triton_nvfp4.silu_and_mul_quant_nvfp4(gate_up, g), nv.silu_and_mul_quant_nvfp4_reference(gate_up, g))


def test_checks_refuse_what_the_kernel_cannot_serve(gen: torch.Generator) -> None:
    norm, add, silu, gelu = FUSED
    x, w, g = rand(gen, 2, 64), rand(gen, 64), torch.tensor([300.0])
    assert triton_check(norm)(x, w, EPS, g) is None
    assert triton_check(norm)(rand(gen, 2, 40), rand(gen, 40), EPS, g) == "40 values a row, not a multiple of 16"
    assert triton_check(norm)(x, w, EPS, g.to(torch.bfloat16)) == "global scale (1,) torch.bfloat16 is not one float32"
    assert triton_check(norm)(x, w, EPS, torch.ones(2)) == "global scale (2,) torch.float32 is not one float32"
    want = "weight torch.float32(64,) is not a contiguous [64] torch.bfloat16 vector"
    assert triton_check(norm)(x, w.float(), EPS, g) == want
    assert triton_check(norm)(rand(gen, 64, 2).t(), w, EPS, g) == "last dim not contiguous"
    wide = 2 * (nv.constraints.TRITON_MAX_ROW + 16)
    assert "exceeds one Triton program" in triton_check(norm)(torch.empty(1, wide // 2), torch.empty(wide // 2), EPS, g)
    assert triton_check(add)(x, rand(gen, 2, 64).float(), w, EPS, g) == (
        "torch.float32(2, 64) != input torch.bfloat16(2, 64)")
    assert triton_check(silu)(rand(gen, 2, 80), g) == "40 values a row, not a multiple of 16"
    assert triton_check(silu)(rand(gen, 2, 65), g) == "odd last dim 65"
    assert triton_check(gelu)(rand(gen, 2, 64), g, "sigmoid") == "approximate='sigmoid'"
    assert triton_check(silu)(torch.empty(2, 64, dtype=torch.int32), g) == "dtype int32 is not a float of 16 or 32 bits"
