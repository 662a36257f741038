"""``fxr.act_mul`` + quantization ops (runtime/ops/quant_act_mul.py): static / per-token / block FP8
and NVFP4 of ``act(a) * b``, gate and up two tensors, and their Triton kernels (the [.., 2d] ops'
kernels given up as a second pointer).

The references are the unfused compositions. The kernels, interpreted on CPU: on the halves of
one row they give the [.., 2d] op's kernel's bytes exactly (one kernel, two pointers into the
row or two tensors); against the reference, the SiLU ops' bytes in bf16 / fp16 exactly (as
tests/runtime/test_triton_kernels.py asserts of the [.., 2d] ones), every other case but for a
last bit of the interpreter's ``exp`` / ``erf`` that a rounding exposes (one e4m3 step, on about
1e-4 of the values, as tests/runtime/test_quant_block_ops.py measures: a few of these small rows). GPU tests (marked ``gpu``): the
ops through ``torch.ops.fxr``, served by Triton, against the CPU reference.
"""

from __future__ import annotations

import types
import zlib

import pytest
import torch

from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import quant_act_mul as qam
from fxrewrite.runtime.ops.activation import ACT_MUL_ACTIVATIONS, act_mul_reference
from fxrewrite.runtime.ops.quant import fp8_mismatch
from fxrewrite.runtime.ops.quant_nvfp4 import nvfp4_mismatch

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# exp(-gate) of large gates overflows to inf in the interpreter (silu is then -0, as in torch)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
OPS = [op.name for op in qam.DEFS]
# each op's interpreted kernel module (tests/runtime/conftest.py) and its [.., 2d] counterpart, by activation
FIXTURE = {"act_mul_quant_fp8": "triton_kernels", "act_mul_dynamic_quant_fp8": "triton_kernels",
           "act_mul_block_quant_fp8": "triton_quant_block", "act_mul_quant_nvfp4": "triton_nvfp4"}  # fmt: skip
APPROX = {"gelu": "none", "gelu_tanh": "tanh"}


def gen_for(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def quant_arg(name: str, device: str = "cpu") -> object:
    """The op's quantization argument: a static scale, none, a group of 32, a global scale."""
    return {"act_mul_quant_fp8": torch.tensor([0.02], device=device), "act_mul_dynamic_quant_fp8": None,
            "act_mul_block_quant_fp8": 32, "act_mul_quant_nvfp4": torch.tensor([300.0], device=device)}[name]  # fmt: skip


def call_args(name: str, a: torch.Tensor, b: torch.Tensor, activation: str) -> tuple[object, ...]:
    q = quant_arg(name, str(a.device))
    return (a, b, activation) if q is None else (a, b, q, activation)


def gate_up(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu",
            smallest: float = -2) -> torch.Tensor:  # fmt: skip
    """[.., 2d]: gate then up, rows of scales 10**smallest .. 10 (so per-token and block scales differ)."""
    x = torch.randn((*shape[:-1], 2 * shape[-1]), generator=gen)
    x = x * torch.logspace(smallest, 1, x.shape[-2] if x.dim() > 1 else 1).unsqueeze(-1)
    return x.to(dtype).to(device)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def as_tuple(out: object) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)  # type: ignore[return-value]


def pair_op(triton: types.ModuleType, name: str, x: torch.Tensor, activation: str) -> tuple[torch.Tensor, ...]:
    """The [.., 2d] op's kernel on ``x`` (gate, then up)."""
    q = quant_arg(name, str(x.device))
    if name == "act_mul_quant_fp8":
        return as_tuple(triton.silu_and_mul_quant_fp8(x, q))
    if name == "act_mul_dynamic_quant_fp8":
        return triton.silu_and_mul_dynamic_quant_fp8(x)
    kind = "block_quant_fp8" if name == "act_mul_block_quant_fp8" else "quant_nvfp4"
    if activation == "silu":
        return getattr(triton, f"silu_and_mul_{kind}")(x, q)
    return getattr(triton, f"gelu_and_mul_{kind}")(x, q, APPROX[activation])


def pairs() -> list[tuple[str, str]]:
    """(op, activation) for which a [.., 2d] op exists: static and per-token FP8 have SiLU's only."""
    return [(n, act) for n in OPS for act in ACT_MUL_ACTIVATIONS if "block" in n or "nvfp4" in n or act == "silu"]


# -- the spec -----------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACT_MUL_ACTIVATIONS)
@pytest.mark.parametrize("name", OPS)
def test_reference_is_the_quantizer_of_act_mul(request: pytest.FixtureRequest, name: str, activation: str) -> None:
    """The op on (gate, up) is its quantizer of ``fxr.act_mul(gate, up, act)`` in either operand
    order, and, where a [.., 2d] op exists, that op's reference on the row they are halves of."""
    from fxrewrite.runtime.ops import quant_block, quant_nvfp4
    from fxrewrite.runtime.ops.quant import quant_fp8_per_token, quant_fp8_static

    x = gate_up(gen_for(request), (2, 3, 64), BF16)
    a, b = x[..., :64], x[..., 64:]
    op = getattr(torch.ops.fxr, name)
    got = as_tuple(op(*call_args(name, a, b, activation)))
    quantize = {"act_mul_quant_fp8": lambda y: quant_fp8_static(y, quant_arg(name)),
                "act_mul_dynamic_quant_fp8": quant_fp8_per_token,
                "act_mul_block_quant_fp8": lambda y: quant_block.quant_fp8_block(y, 32),
                "act_mul_quant_nvfp4": lambda y: quant_nvfp4.quant_nvfp4(y, quant_arg(name))}[name]  # fmt: skip
    for act_first in (True, False):
        want = as_tuple(quantize(act_mul_reference(a, b, activation, act_first)))
        assert [u8(g).tolist() for g in got] == [u8(w).tolist() for w in want]
    assert all(g.is_contiguous() for g in got)


def test_fp8_ops_on_the_halves_of_a_row_are_the_silu_and_mul_ops() -> None:
    from fxrewrite.runtime.ops import quant

    x = gate_up(torch.Generator().manual_seed(0), (5, 64), BF16)
    s = torch.tensor([0.02])
    assert torch.equal(u8(qam.act_mul_quant_fp8_reference(x[:, :64], x[:, 64:], s)),
                       u8(quant.silu_and_mul_quant_fp8_reference(x, s)))  # fmt: skip
    got, want = qam.act_mul_dynamic_quant_fp8_reference(x[:, :64], x[:, 64:]), quant.silu_and_mul_dynamic_quant_fp8_reference(x)
    assert torch.equal(u8(got[0]), u8(want[0])) and torch.equal(got[1], want[1])


def test_activations_quantize_differently() -> None:
    """The twin of the activation argument: each names another value (a kernel that ignored it fails above)."""
    x = gate_up(torch.Generator().manual_seed(1), (4, 64), BF16)
    outs = [u8(qam.act_mul_quant_fp8_reference(x[:, :64], x[:, 64:], torch.tensor([0.02]), act)) for act in ACT_MUL_ACTIVATIONS]
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


# -- constraints --------------------------------------------------------------------------------


def check_of(name: str) -> object:
    return next(k for k in qam.DEFS[OPS.index(name)].kernels if k.provider == "triton").check


def test_checks_refuse_what_the_kernels_cannot_serve() -> None:
    a, b = torch.randn(4, 64, dtype=BF16), torch.randn(4, 64, dtype=BF16)
    static, block, nvfp4 = (check_of(n) for n in ("act_mul_quant_fp8", "act_mul_block_quant_fp8", "act_mul_quant_nvfp4"))
    s = torch.tensor([0.02])
    assert static(a, b, s, "silu") is None  # type: ignore[operator]
    assert static(torch.randn(4, 128, dtype=BF16)[:, 32:96], b, s, "gelu") is None  # type: ignore[operator]  # rows at a stride
    assert static(a, b, s, "relu") == "activation 'relu'"  # type: ignore[operator]
    assert static(a, b.float(), s, "silu") == "torch.float32(4, 64) != input torch.bfloat16(4, 64)"  # type: ignore[operator]
    assert static(a, b[:, :32], s, "silu") == "torch.bfloat16(4, 32) != input torch.bfloat16(4, 64)"  # type: ignore[operator]
    assert static(a.t().contiguous().t(), b, s, "silu") == "last dim not contiguous"  # type: ignore[operator]
    a3 = torch.randn(2, 4, 64, dtype=BF16).transpose(0, 1)  # [4, 2, 64]: rows not one stride apart
    assert static(a3, torch.randn(4, 2, 64, dtype=BF16), s, "silu") == "rows not at one stride"  # type: ignore[operator]
    assert "is not one float32" in static(a, b, torch.tensor([0.02, 0.03]), "silu")  # type: ignore[operator]
    assert block(a, b, 32, "silu") is None  # type: ignore[operator]
    assert block(a, b, 48, "silu") == "group 48 does not divide the quantized dim 64"  # type: ignore[operator]
    assert nvfp4(a[:, :40], b[:, :40], torch.tensor([300.0]), "silu") == "40 values a row, not a multiple of 16"  # type: ignore[operator]


# -- the Triton kernels, interpreted -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize(("name", "activation"), pairs())
def test_kernel_on_two_tensors_is_the_row_kernel(request: pytest.FixtureRequest, name: str, activation: str,
                                                 dtype: torch.dtype) -> None:  # fmt: skip
    """The up operand at another row stride than the gate (a slice of a wider tensor): the bytes
    of the [.., 2d] op's kernel on the row made of the two."""
    triton = request.getfixturevalue(FIXTURE[name])
    gen = gen_for(request)
    x = gate_up(gen, (2, 3, 64), dtype)
    wide = torch.randn(2, 3, 192, generator=gen).to(dtype)
    wide[..., 64:128] = x[..., 64:]
    a, b = x[..., :64].contiguous(), wide[..., 64:128]
    assert check_of(name)(*call_args(name, a, b, activation)) is None  # type: ignore[operator]
    got = as_tuple(getattr(triton, name)(*call_args(name, a, b, activation)))
    want = pair_op(triton, name, x, activation)
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    assert all(torch.equal(u8(g), u8(w)) for g, w in zip(got, want))


@pytest.mark.parametrize("shape", [(1, 64), (5, 96), (2, 3, 128)])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("activation", ACT_MUL_ACTIVATIONS)
@pytest.mark.parametrize("name", OPS)
def test_kernel_gives_the_reference_bytes(request: pytest.FixtureRequest, name: str, activation: str,
                                          dtype: torch.dtype, shape: tuple[int, ...]) -> None:  # fmt: skip
    """SiLU in bf16 / fp16: the reference's bytes exactly; the rest but for rare last bits of
    ``exp`` / ``erf``: one e4m3 step on under 1% of the values (scales: float32 ones are
    unrounded and move with them, by a few float32 roundings)."""
    triton = request.getfixturevalue(FIXTURE[name])
    x = gate_up(gen_for(request), shape, dtype)
    args = call_args(name, x[..., : shape[-1]], x[..., shape[-1] :], activation)
    got, want = as_tuple(getattr(triton, name)(*args)), as_tuple(getattr(qam, f"{name}_reference")(*args))
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    if activation == "silu" and dtype != F32:
        assert all(torch.equal(u8(g), u8(w)) for g, w in zip(got, want))
    elif name == "act_mul_quant_nvfp4":
        assert nvfp4_mismatch(got, want, quant_arg(name)) is None  # type: ignore[arg-type]
    else:
        assert fp8_mismatch(got[0], want[0], *(got[1:] + want[1:]) or (None, None), scale_rtol=4 * torch.finfo(F32).eps) is None
        assert float((u8(got[0]) != u8(want[0])).float().mean()) < 1e-2


@pytest.mark.parametrize("act", [0, 1, 2], ids=["silu", "gelu", "gelu_tanh"])
def test_act_mul_kernels_compile_for_hopper(act: int) -> None:
    """The FP8 and NVFP4 act + quant kernels with their second operand's pointer and stride
    built for sm90 by this Triton's front end and NVIDIA backend (what the interpreter lets
    through, the GPU's compiler may refuse): each stores e4m3 through the saturating convert."""
    from helpers.triton import compile_for_hopper

    pytest.importorskip("fxrewrite.runtime.triton_kernels", reason="triton is not installed")
    fp8 = compile_for_hopper(
        "fxrewrite.runtime.triton_kernels", "_act_mul_quant_kernel",
        {"a_ptr": "*bf16", "b_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "scale_ptr": "*fp32",
         "a_stride": "i32", "b_stride": "i32", "d": "i32"},
        {"BLOCK": 1024, "DYNAMIC": False, "ACT": act})  # fmt: skip
    nvfp4 = compile_for_hopper(
        "fxrewrite.runtime.triton_nvfp4", "_nvfp4_kernel",
        {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "sum_ptr": "*bf16", "y_ptr": "*bf16", "q_ptr": "*u8",
         "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "b_ptr": "*bf16", "x_stride": "i32", "r_stride": "i32",
         "b_stride": "i32", "n": "i32", "eps": "fp32"},
        {"BLOCK": 1024, "PRE": 3, "ACT_KIND": act, "STORE_Y": False})  # fmt: skip
    assert "cvt.rn.satfinite.e4m3x2.f32" in fp8
    assert "cvt.rn.satfinite.e4m3x2.f32" in nvfp4 and "ld.global" in nvfp4


# -- GPU: the ops through torch.ops.fxr ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", [(1, 2048), (8, 4096), (33, 7168), (512, 14336)])
@pytest.mark.parametrize("activation", ACT_MUL_ACTIVATIONS)
@pytest.mark.parametrize("name", OPS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_op_is_served_by_triton_and_matches_the_reference(name: str, activation: str, shape: tuple[int, ...],
                                                              dtype: torch.dtype) -> None:  # fmt: skip
    """Served by Triton; FP8 values within one e4m3 step of the CPU reference's (per-token and
    block scales within two roundings), NVFP4 within :func:`nvfp4_mismatch`; on the halves of one
    row, the [.., 2d] op's bytes (one kernel) where that op exists."""
    providers.reset_counts()
    # float16: rows of scale 1 .. 10. Gate times up of a row of scale 1e-2 is float16-subnormal
    # (steps of 6e-8 on an amax near 1e-6); an activation one float16 step off, which the GPU's
    # exp gives on rare values, then moves the product by a few percent of its row's amax.
    x = gate_up(torch.Generator().manual_seed(2), shape, dtype, "cuda", smallest=0 if dtype == F16 else -2)
    a, b = x[..., : shape[-1]].contiguous(), x[..., shape[-1] :].contiguous()
    got = as_tuple(getattr(torch.ops.fxr, name)(*call_args(name, a, b, activation)))
    assert providers.served()[name].get("triton") == 1, providers.served()
    want = as_tuple(getattr(qam, f"{name}_reference")(*call_args(name, a.cpu(), b.cpu(), activation)))
    got = tuple(g.cpu() for g in got)
    if name == "act_mul_quant_nvfp4":
        assert nvfp4_mismatch(got, want, quant_arg(name)) is None  # type: ignore[arg-type]
    else:
        assert fp8_mismatch(got[0], want[0], *(got[1:2] + want[1:2]) or (None, None),
                            scale_rtol=2 * torch.finfo(dtype).eps) is None  # fmt: skip
    if (name, activation) in pairs():
        pair = pytest.importorskip(f"fxrewrite.runtime.{FIXTURE[name]}")
        want_pair = pair_op(pair, name, x, activation)
        assert all(torch.equal(u8(g), u8(w.cpu())) for g, w in zip(got, want_pair))

