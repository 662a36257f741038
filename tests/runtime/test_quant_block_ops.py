"""Block FP8 ops (runtime/ops/quant_block.py) and their Triton kernel (runtime/triton_quant_block.py).

The contract, bit for bit: every kernel's FP8 bytes and float32 scales equal ``quant_fp8_block``
of the values it quantizes (the kernel stores those with ``STORE_Y``), and those values equal
the reference's where the row reductions and transcendental functions agree (bf16 / fp16 norms:
always here; float32 norms: rows whose sum of squares is exact in any order). CPU tests run the
kernel in Triton's interpreter (rounding as the GPU rounds: ``triton_quant_block`` fixture); the
GPU tests (marked ``gpu``, skipped here) run it compiled.
"""

from __future__ import annotations

import types

import pytest
import torch

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import quant_block as qb
from fxrewrite.runtime.ops.activation import gelu_and_mul_reference, silu_and_mul_reference
from fxrewrite.runtime.ops.norm import rms_norm_reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
EPS = 1e-6
# exp(-gate) of the large rows overflows to inf in the interpreter (silu is then -0, as in torch)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
NORMS = ["rms_norm_block_quant_fp8", "fused_add_rms_norm_block_quant_fp8"]


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == qb.FP8_DTYPE else t


def assert_bits(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    """Equal bytes; e4m3 NaNs of either sign are one value (an activation that overflows float16
    gives inf / inf: the GPU's conversion and torch's CPU one write NaN with other signs)."""
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    for i, (g, w) in enumerate(zip(got, want)):
        nan = (g != g) & (w != w) if g.dtype == torch.float8_e4m3fn else None
        g, w = u8(g).cpu(), u8(w).cpu()
        if nan is not None:
            g, w = g.masked_fill(nan.cpu(), 0), w.masked_fill(nan.cpu(), 0)
        assert torch.equal(g, w), f"output {i}: {int((g != w).sum())} of {g.numel()} differ"


def rows(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu", exact: bool = False) -> torch.Tensor:
    """Rows of scales 1e-3 .. 1e2, one all zero; ``exact``: multiples of 1/8 in [-4, 4], whose
    squares sum exactly in float32 in any order."""
    if exact:
        return (torch.randint(-32, 33, shape) / 8).to(dtype).to(device)
    x = torch.randn(shape) * torch.logspace(-3, 2, shape[-2] if len(shape) > 1 else 1).unsqueeze(-1)
    x.view(-1, shape[-1])[0] = 0
    return x.to(dtype).to(device)


# -- the spec -----------------------------------------------------------------------------------


def vllm_native(y: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The group quantization as vLLM's native path spells it (with this project's floor)."""
    t = y.reshape(-1, y.shape[-1] // group, group).float()
    s = t.abs().max(dim=-1, keepdim=True)[0].clamp(min=qb.AMAX_FLOOR) / qb.FP8_MAX
    q = (t / s).clamp(-qb.FP8_MAX, qb.FP8_MAX).to(qb.FP8_DTYPE)
    return q.reshape(y.shape), s.reshape(*y.shape[:-1], -1)


@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_spec_is_the_group_quantization_model_code_writes(dtype: torch.dtype, group: int) -> None:
    y = rows((2, 5, 512), dtype)
    q, s = qb.quant_fp8_block(y, group)
    assert q.shape == y.shape and s.shape == (2, 5, 512 // group) and s.dtype == F32 and s.is_contiguous()
    assert_bits((q, s), vllm_native(y, group))
    # a zero group: the floor, and zeros; the dequantized values within half an e4m3 step (2^-4)
    assert torch.equal(s[0, 0], torch.full((512 // group,), qb.AMAX_FLOOR / qb.FP8_MAX))
    err = (qb.dequant_fp8_block(q, s) - y.float()).abs()
    assert bool((err <= y.float().abs() * 2**-4 + s.repeat_interleave(group, -1) * 2**-9).all())


def test_groups_differ_from_a_scale_over_the_row() -> None:
    """The twin: one scale per row is another quantization (its scales, its bytes)."""
    y = torch.randn(4, 512) * torch.linspace(0.1, 10, 512)  # columns of growing size
    q, s = qb.quant_fp8_block(y, 128)
    amax_row = y.abs().amax(-1, keepdim=True) / qb.FP8_MAX
    assert not torch.equal(s, amax_row.expand_as(s)) and bool((s[:, -1:] == amax_row).all())
    assert not torch.equal(u8(q), u8((y / amax_row).clamp(-448, 448).to(qb.FP8_DTYPE)))


@pytest.mark.parametrize("op", qb.DEFS, ids=lambda op: op.name)
def test_fake_impl_gives_the_reference_shapes(op: providers.OpDef) -> None:
    if op.name.startswith("all_reduce"):
        pytest.skip("needs a process group (tests/rewrites/test_quant_block.py runs it on a fake one)")
    args = op_args(op.name, (3, 256), BF16, 64)
    want = op.reference(*args)
    with torch._subclasses.FakeTensorMode() as mode:
        got = op.fake(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]


# -- constraints --------------------------------------------------------------------------------


def test_triton_checks_refuse_what_the_kernel_cannot_take() -> None:
    x, w = torch.randn(2, 384, dtype=BF16), torch.randn(384, dtype=BF16)
    check = qb._triton_norm_check
    assert check(x, w, EPS, 128) is None
    assert check(x, w, EPS, 256) == "group 256 does not divide the quantized dim 384"
    assert check(x, w, EPS, 96) == "group 96 is not a power of two"
    assert check(x, w.float(), EPS, 128).startswith("weight torch.float32(384,) is not")
    assert check(x.t().contiguous().t(), w, EPS, 128) == "input not contiguous"
    assert qb._triton_act_check(torch.randn(2, 320, dtype=BF16), 64) == "group 64 does not divide the quantized dim 160"
    assert qb._triton_act_check(torch.randn(2, 512, dtype=BF16), 128, "sigmoid") == "approximate='sigmoid'"


# -- the Triton kernel, interpreted ------------------------------------------------------------


def op_args(name: str, shape: tuple[int, ...], dtype: torch.dtype, group: int, device: str = "cpu",
            exact: bool = False, cast_last: bool = False) -> tuple[object, ...]:  # fmt: skip
    """Arguments of op ``name`` for a ``shape`` output (activations: an input of twice its width;
    norms: ``cast_last``, their order of weight and rounding; the quantizer alone: ``y``, ``group``)."""
    if name == "block_quant_fp8":
        return rows(shape, dtype, device, exact), group
    wide = name not in NORMS
    x = rows((*shape[:-1], 2 * shape[-1]) if wide else shape, dtype, device, exact)
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype).to(device)
    if name == "rms_norm_block_quant_fp8":
        return x, w, EPS, group, cast_last
    if name == "fused_add_rms_norm_block_quant_fp8":
        return x, rows(shape, dtype, device, exact), w, EPS, group, cast_last
    if name == "silu_and_mul_block_quant_fp8":
        return x, group
    return x, group, "tanh" if name.endswith("tanh") else "none"


def pre_quant(name: str, args: tuple[object, ...]) -> torch.Tensor:
    """What the reference quantizes."""
    if name == "rms_norm_block_quant_fp8":
        x, w, eps, _, cast_last = args
        return rms_norm_reference(x, w, eps, cast_last)
    if name == "fused_add_rms_norm_block_quant_fp8":
        x, r, w, eps, _, cast_last = args
        return rms_norm_reference(x + r, w, eps, cast_last)
    if name == "silu_and_mul_block_quant_fp8":
        return silu_and_mul_reference(args[0])
    return gelu_and_mul_reference(args[0], args[2])


KERNEL_OPS = ["rms_norm_block_quant_fp8", "fused_add_rms_norm_block_quant_fp8", "silu_and_mul_block_quant_fp8",
              "gelu_and_mul_block_quant_fp8", "gelu_and_mul_block_quant_fp8_tanh"]  # fmt: skip


def run_storing_y(tq: types.ModuleType, name: str, args: tuple[object, ...]) -> tuple[torch.Tensor, ...]:
    """The kernel as the op runs it, with ``STORE_Y``: (q, s[, sum], y)."""
    x, group = args[0], args[-2] if name in NORMS else args[1]
    assert isinstance(x, torch.Tensor)
    cast_last = False
    if name in NORMS:
        n, mode = x.shape[-1], tq.RMS_NORM if name == NORMS[0] else tq.ADD_RMS_NORM
        weight, eps, cast_last = args[-4], args[-3], args[-1]
        residual = args[1] if name == NORMS[1] else None
    else:
        n, weight, eps, residual = x.shape[-1] // 2, None, 0.0, None
        mode = tq.SILU if name.startswith("silu") else tq.GELU_TANH if args[2] == "tanh" else tq.GELU
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    q, s, total = tq.launch(mode, x, n, group, weight, eps, residual, y_out=y, cast_last=cast_last)
    return (q, s, *(() if total is None else (total,)), y)


def assert_near(y: torch.Tensor, ref: torch.Tensor) -> None:
    """The values quantized are the reference's within a rounding or two (a last bit of a norm's
    row scale, times the weight), or, where ``1 + erf`` / ``1 + tanh`` cancels (GELU of a large
    negative gate), within 2^-20 of the row's largest value: a last bit of erf, amplified."""
    eps = torch.finfo(ref.dtype).eps
    y, ref = y.float().cpu(), ref.float().cpu()
    bound = 4 * eps * ref.abs()
    bound = bound + 2**-20 * ref.abs().amax(-1, keepdim=True)
    assert bool(((y - ref).abs() <= bound).all()), float(((y - ref).abs() - bound).max())


def _op(name: str) -> str:
    return name.removesuffix("_tanh")


@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_triton_quantizer_is_the_spec(triton_quant_block: types.ModuleType, dtype: torch.dtype, group: int) -> None:
    y = rows((7, 640), dtype) * 30  # saturating values too
    assert_bits(triton_quant_block.block_quant_fp8(y, group), qb.quant_fp8_block(y, group))


@pytest.mark.parametrize("shape", [(1, 256), (6, 384), (2, 3, 512)])
@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("name", KERNEL_OPS)
def test_triton_kernel_quantizes_its_values_as_the_spec(triton_quant_block: types.ModuleType, name: str,
                                                        dtype: torch.dtype, group: int, shape: tuple[int, ...]) -> None:  # fmt: skip
    args = op_args(name, shape, dtype, group)
    *outs, y = run_storing_y(triton_quant_block, name, args)
    assert_bits(tuple(outs[:2]), qb.quant_fp8_block(y, group))
    assert_near(y, pre_quant(name, args))
    if len(outs) == 3:
        assert_bits((outs[2],), (args[0] + args[1],))  # type: ignore[operator]


@pytest.mark.parametrize("cast_last", [False, True], ids=["round-then-scale", "scale-then-round"])
@pytest.mark.parametrize("exact", [False, True], ids=["random", "exact-sums"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("name", NORMS)
def test_triton_norm_ops_equal_the_reference_bit_for_bit(triton_quant_block: types.ModuleType, name: str,
                                                          dtype: torch.dtype, exact: bool, cast_last: bool) -> None:  # fmt: skip
    """The whole op against its reference: bf16 / fp16 rows (rounding absorbs the order of the
    sum of squares), float32 rows whose sums are exact; float32 random rows may not (the twin).
    Either order of the weight and the rounding (``cast_last``: torch.rms_norm's)."""
    args = op_args(name, (8, 1024), dtype, 128, exact=exact, cast_last=cast_last)
    got, want = getattr(triton_quant_block, name)(*args), getattr(qb, f"{name}_reference")(*args)
    if dtype == F32 and not exact:  # scales move with a last bit of the row's sum: one e4m3 step at most
        from fxrewrite.runtime.ops.quant import fp8_mismatch

        assert fp8_mismatch(got[0], want[0], scale_rtol=4 * torch.finfo(F32).eps) is None
        return
    assert_bits(got, want)


@pytest.mark.parametrize("name", NORMS)
def test_the_two_orders_quantize_differently(triton_quant_block: types.ModuleType, name: str) -> None:
    """The twin of ``cast_last``: in bf16 the order of weight and rounding moves FP8 bytes, so the
    test above tells a kernel that ignores the flag from one that follows it."""
    args = op_args(name, (8, 1024), BF16, 128)
    flipped = (*args[:-1], True)
    assert not torch.equal(u8(getattr(qb, f"{name}_reference")(*args)[0]), u8(getattr(qb, f"{name}_reference")(*flipped)[0]))
    assert not torch.equal(u8(getattr(triton_quant_block, name)(*args)[0]), u8(getattr(triton_quant_block, name)(*flipped)[0]))


def test_triton_activation_ops_equal_the_reference_but_for_exp_erf_last_bits(triton_quant_block: types.ModuleType) -> None:
    """Activations in bf16: FP8 bytes equal but where the interpreter's exp / erf (numpy) and
    torch's (Sleef) differ in a last bit that a rounding exposes (measured: about 1e-4)."""
    for name in KERNEL_OPS[2:]:
        args = op_args(name, (16, 2048), BF16, 128)
        got, want = getattr(triton_quant_block, _op(name))(*args), getattr(qb, f"{_op(name)}_reference")(*args)
        assert torch.equal(got[1], want[1]), name
        assert float((u8(got[0]) != u8(want[0])).float().mean()) < 1e-3, name


def test_triton_kernel_compiles_for_hopper() -> None:
    """Compiled for sm90 (no GPU needed; the interpreter forgives what the compiler refuses, e.g.
    a global that is not a constexpr): IEEE divisions only, no FMA, saturating e4m3 conversion;
    the norm in either order of its weight and rounding (``CAST_LAST``), an activation."""
    import collections
    import re

    from helpers.triton import compile_for_hopper

    tq = pytest.importorskip("fxrewrite.runtime.triton_quant_block", reason="triton is not installed")

    types = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "sum_ptr": "*bf16", "q_ptr": "*fp8e4nv",
             "s_ptr": "*fp32", "y_ptr": "*bf16", "b_ptr": "*bf16", "x_stride": "i32", "b_stride": "i32", "n": "i32",
             "eps": "fp32"}  # fmt: skip
    for mode, cast_last in ((tq.ADD_RMS_NORM, False), (tq.ADD_RMS_NORM, True), (tq.GELU_TANH, False)):
        constexprs = {"GROUP": 128, "GROUPS": 32, "MODE": int(mode.value), "STORE_Y": False, "CAST_LAST": cast_last}
        ptx = compile_for_hopper("fxrewrite.runtime.triton_quant_block", "_block_quant_kernel", types, constexprs,
                                 enable_fp_fusion=False)  # fmt: skip
        counts = collections.Counter(re.findall(
            r"\b(div\.full\.f32|div\.approx\.f32|fma\.rn\.f32|cvt\.rn\.satfinite\.e4m3x2\.f32)", ptx))
        assert set(counts) == {"cvt.rn.satfinite.e4m3x2.f32"}, counts


# -- GPU: each provider compiled, against the spec ---------------------------------------------

@pytest.mark.parametrize("cast_last", [False, True], ids=["round-then-scale", "scale-then-round"])
@pytest.mark.parametrize("shape", [(1, 2048), (8, 4096), (33, 7168), (512, 4096)])
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("name", KERNEL_OPS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_quantizes_its_values_as_the_spec(name: str, dtype: torch.dtype, shape: tuple[int, ...],
                                                     cast_last: bool) -> None:  # fmt: skip
    """Compiled: bytes and scales equal the spec of the values quantized (on the CPU), bit for
    bit; those values within one rounding of the CPU reference's (approximate rsqrt / exp may move one)."""
    tq = pytest.importorskip("fxrewrite.runtime.triton_quant_block", reason="triton is not installed")

    if cast_last and name not in NORMS:
        pytest.skip("no norm")
    args = op_args(name, shape, dtype, 128, "cuda", cast_last=cast_last)
    if dtype == F16 and name not in NORMS:  # rows up to 1e2: gate * up would overflow float16
        args = tuple(a / 16 if isinstance(a, torch.Tensor) else a for a in args)
    *outs, y = run_storing_y(tq, name, args)
    assert_bits(tuple(o.cpu() for o in outs[:2]), qb.quant_fp8_block(y.cpu(), 128))
    cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    assert_near(y, pre_quant(name, cpu_args))


@pytest.mark.parametrize("name", KERNEL_OPS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_op_is_served_by_triton_and_matches_the_reference(name: str) -> None:
    """Through ``torch.ops.fxr``: served by Triton; bf16 norms equal the CPU reference bit for bit
    where sums are exact; every op's FP8 values within one e4m3 step of it."""
    from fxrewrite.runtime.ops.quant import fp8_mismatch

    providers.reset_counts()
    exact = name in NORMS
    args = op_args(name, (8, 4096), BF16, 128, "cuda", exact=exact)
    got = getattr(torch.ops.fxr, _op(name))(*args)
    assert providers.served()[_op(name)].get("triton") == 1, providers.served()
    want = getattr(qb, f"{_op(name)}_reference")(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    if exact:
        assert_bits(tuple(g.cpu() for g in got), want)
    assert fp8_mismatch(got[0].cpu(), want[0], scale_rtol=2 * torch.finfo(BF16).eps) is None
