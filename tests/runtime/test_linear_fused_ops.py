"""The GEMMs with a norm prologue or a residual epilogue (runtime/ops/linear_fused.py): references
against the unfused code, the cuBLAS path, the Triton kernel's constraints, and the kernel itself
under Triton's interpreter (float16: the interpreter multiplies bfloat16 ``tl.dot`` operands
wrongly; tests/runtime/test_ops_gpu.py runs bfloat16 on the GPU)."""

from __future__ import annotations

import types
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite.runtime.ops import linear_fused as lf

EPS = 1e-6
F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def operands(gen: torch.Generator, rows: tuple[int, ...], k: int, n: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"x": rand(gen, *rows, k, dtype=dtype), "g": 1 + rand(gen, k, dtype=dtype, scale=0.1),
            "w": rand(gen, n, k, dtype=dtype, scale=k**-0.5), "b": rand(gen, n, dtype=dtype),
            "r": rand(gen, *rows, n, dtype=dtype)}  # fmt: skip


def llama_norm(x: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return h.to(x.dtype) if g is None else g * h.to(x.dtype)


# --------------------------------------------------------------------------- the spec


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_references_are_the_unfused_code(gen: torch.Generator, dtype: torch.dtype) -> None:
    t = operands(gen, (2, 3), 64, 32, dtype)
    x, g, w, b, r = t["x"], t["g"], t["w"], t["b"], t["r"]
    for weight in (g, None):
        torch.testing.assert_close(torch.ops.fxr.rms_norm_linear(x, weight, EPS, w, b), F.linear(llama_norm(x, weight), w, b),
                                   rtol=0, atol=0)  # fmt: skip
        gate, up = F.linear(llama_norm(x, weight), w).chunk(2, dim=-1)
        torch.testing.assert_close(torch.ops.fxr.rms_norm_linear_silu_and_mul(x, weight, EPS, w),
                                   F.silu(gate) * up, rtol=0, atol=0)  # fmt: skip
    # the cast_last order: the weight multiplies in float32, rounded once
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    torch.testing.assert_close(torch.ops.fxr.rms_norm_linear(x, g, EPS, w, None, True), F.linear((g * h).to(dtype), w),
                               rtol=0, atol=0)  # fmt: skip
    torch.testing.assert_close(torch.ops.fxr.linear_add(x, w, r), F.linear(x, w) + r, rtol=0, atol=0)
    r0 = r.clone()
    out = torch.ops.fxr.linear_add_(x, w, r)
    assert out is r  # returns the tensor it overwrote
    torch.testing.assert_close(r, F.linear(x, w) + r0, rtol=0, atol=0)


def test_the_in_place_op_is_mutable_and_impure() -> None:
    op = torch.ops.fxr.linear_add_.default
    assert op._schema.is_mutable and [a.name for a in op._schema.arguments if a.is_write] == ["residual"]
    g = torch.fx.Graph()
    x, w, r = g.placeholder("x"), g.placeholder("w"), g.placeholder("r")
    assert g.call_function(op, (x, w, r)).is_impure()
    assert not g.call_function(torch.ops.fxr.linear_add.default, (x, w, r)).is_impure()


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_cublas_path_runs_what_it_replaces(gen: torch.Generator, dtype: torch.dtype) -> None:
    """Above 16 rows: the norm op then the GEMM (the same values); cuBLAS's addmm, the sum
    rounded once (one rounding from the spec in bf16)."""
    t = operands(gen, (40,), 64, 32, dtype)
    x, g, w, b, r = t["x"], t["g"], t["w"], t["b"], t["r"]
    torch.testing.assert_close(lf._norm_cublas(x, g, EPS, w, b), lf.rms_norm_linear_reference(x, g, EPS, w, b),
                               rtol=0, atol=0)  # fmt: skip
    torch.testing.assert_close(lf._norm_cublas_silu_and_mul(x, g, EPS, w), lf.rms_norm_linear_silu_and_mul_reference(x, g, EPS, w),
                               rtol=0, atol=0)  # fmt: skip
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1.6e-2}
    torch.testing.assert_close(lf._addmm(x, w, r), lf.linear_add_reference(x, w, r), **tol)
    wide = rand(gen, 40, 64, dtype=dtype)
    view = wide[:, 16:48]  # rows of the residual at a stride of 64: written in place, the rest untouched
    want, rest = lf.linear_add_reference(x, w, view), wide[:, :16].clone()
    lf._addmm_(x, w, view)
    torch.testing.assert_close(view, want, **tol)
    assert torch.equal(wide[:, :16], rest)


def test_the_triton_checks_refuse_what_the_kernel_cannot_serve(gen: torch.Generator) -> None:
    t = operands(gen, (5,), 64, 32, BF16)
    x, g, w, r = t["x"], t["g"], t["w"], t["r"]
    assert lf._norm_check(x, g, EPS, w) is None and lf._norm_check(x, None, EPS, w, t["b"], True) is None
    assert lf._norm_check(rand(gen, 17, 64, dtype=BF16), g, EPS, w) == "17 rows: cuBLAS serves outside 1..16"
    assert lf._norm_check(x, g.float(), EPS, w) == "norm weight torch.float32 on cpu, input torch.bfloat16 on cpu"
    assert lf._norm_check(x, g[:32], EPS, w) == "norm weight (32,) is not a contiguous [64] vector"
    assert lf._norm_gated_check(x, g, EPS, w[:31]) == "odd weight rows 31"
    assert lf._add_check(x, w, r) is None
    assert lf._add_check(x, w, r[:1]) == "residual torch.bfloat16(1, 32) != output torch.bfloat16(5, 32)"
    assert lf._add_check(x, w, r.float()) == "residual torch.float32(5, 32) != output torch.bfloat16(5, 32)"
    assert lf._add_check(x, w, rand(gen, 32, 5, dtype=BF16).t()) == "residual rows not viewable with unit stride"
    both = rand(gen, 5, 96, dtype=BF16)
    assert lf._add_check(both[:, :64], w, both[:, 64:]) == "residual and input share memory"
    assert lf._same_dtype(x, w, r.float()) == "dtypes torch.bfloat16, torch.bfloat16, torch.float32 differ"


# --------------------------------------------------------------------------- the Triton kernel


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


SHAPES = [((1,), 256), ((5,), 200), ((16,), 256), ((2, 3), 128)]  # rows up to 16, k not a multiple of BK, 3-D x


@pytest.mark.parametrize(("rows", "k"), SHAPES)
def test_kernel_norm_prologue(triton_gemm: types.ModuleType, gen: torch.Generator, rows: tuple[int, ...], k: int) -> None:
    """Against the float32 spec: no further off than the spec in float16 (plus one float16 step
    of summation order), with and without weight and bias, plain and gated."""
    t = operands(gen, rows, k, 96, F16)
    for weight, bias in ((t["g"], None), (None, t["b"]), (t["g"], t["b"])):
        for op in ("rms_norm_linear", "rms_norm_linear_silu_and_mul"):
            ref = getattr(lf, f"{op}_reference")
            args = (t["x"], weight, EPS, t["w"], bias)
            exact = ref(*(a.float() if isinstance(a, torch.Tensor) else a for a in args))
            got = getattr(triton_gemm, op)(*args)
            assert got.shape == exact.shape and got.dtype == F16
            assert rel_err(got, exact) <= rel_err(ref(*args), exact) + 2e-3, (op, weight is None, bias is None)


@pytest.mark.parametrize(("rows", "tile"), [((16,), 16), ((17,), 32), ((2, 16), 32), ((40,), 64), ((64,), 64)])
def test_kernel_tall_tiles(triton_gemm: types.ModuleType, gen: torch.Generator, rows: tuple[int, ...], tile: int) -> None:
    """The plain and gated GEMMs past 16 rows: tiles of 32 and 64 rows (their own launch
    configurations), the last rows masked; no further off the float32 product than the spec in
    float16. Negative twin: the fusions around the GEMM keep their one tile of 16 rows."""
    t = operands(gen, rows, 200, 96, F16)
    x, w, b = t["x"], t["w"], t["b"]
    plan = triton_gemm._plan(x, w, None, triton_gemm.PLAIN)
    assert plan.meta.get("ROWS", 16) == tile and plan.meta["BK"] == (512 if tile == 16 else 256)
    exact = x.float() @ w.float().t() + b.float()
    got = triton_gemm.linear(x, w, b)
    assert got.shape == exact.shape and rel_err(got, exact) <= rel_err(F.linear(x, w, b), exact) + 1e-3
    gate, up = exact.chunk(2, dim=-1)
    spec_gate, spec_up = F.linear(x, w, b).chunk(2, dim=-1)
    gated = triton_gemm.linear_silu_and_mul(x, w, b)
    assert rel_err(gated, F.silu(gate) * up) <= rel_err(F.silu(spec_gate) * spec_up, F.silu(gate) * up) + 2e-3
    if tile > 16:
        assert lf._norm_check(x, t["g"], EPS, w) == f"{x.numel() // 200} rows: cuBLAS serves outside 1..16"


@pytest.mark.parametrize(("rows", "k"), SHAPES)
def test_kernel_residual_epilogue(triton_gemm: types.ModuleType, gen: torch.Generator, rows: tuple[int, ...], k: int) -> None:
    """The sum into a new tensor and in place (into rows of a wider tensor: its row stride)."""
    t = operands(gen, rows, k, 48, F16)
    x, w = t["x"], t["w"]
    wide = rand(gen, *rows, 96, dtype=F16)
    r = wide[..., 8:56]
    exact = lf.linear_add_reference(x.float(), w.float(), r.float())
    spec = rel_err(lf.linear_add_reference(x, w, r), exact)
    got = triton_gemm.linear_add(x, w, r)
    assert rel_err(got, exact) <= spec + 1e-3
    untouched = wide[..., :8].clone(), wide[..., 56:].clone()
    triton_gemm.linear_add_(x, w, r)
    assert torch.equal(r, got)  # the same kernel, the same sums
    assert torch.equal(wide[..., :8], untouched[0]) and torch.equal(wide[..., 56:], untouched[1])


def test_prepare_keys_one_build_per_fusion(triton_gemm: types.ModuleType) -> None:
    """What is built ahead: one kernel per combination of fusions (shapes and eps alike); the
    residual add into a new tensor and in place are one build (the output pointer differs)."""
    with FakeTensorMode():
        x, g, w, r = (torch.empty(*s, dtype=BF16) for s in ((8, 4096), (4096,), (6144, 4096), (8, 6144)))
    calls = {"linear": (x, w), "linear_silu_and_mul": (x, w), "rms_norm_linear": (x, g, EPS, w),
             "rms_norm_linear_silu_and_mul": (x, g, EPS, w), "linear_add": (x, w, r), "linear_add_": (x, w, r)}  # fmt: skip
    keys = {op: triton_gemm.prepare(op, *args)[0] for op, args in calls.items()}
    assert keys["linear_add"] == keys["linear_add_"]
    assert len(set(keys.values())) == len(keys) - 1
    assert triton_gemm.prepare("rms_norm_linear", x, g, 1e-5, w)[0] == keys["rms_norm_linear"]  # eps: an argument
    assert dict(keys["linear_add_"][3])["RESIDUAL"] and dict(keys["rms_norm_linear"][3])["NORM"]
    assert triton_gemm.prepare("rms_norm", x, g, EPS) is None


def test_programmatic_dependent_launch_where_the_device_has_it(triton_gemm: types.ModuleType,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The skinny kernel is built and launched with PDL where ``pdl`` says the device has it, and
    as a plain launch on CPU and inside ``without_pdl()`` (the bench's side-by-side row)."""
    with FakeTensorMode():
        x, w = torch.empty(8, 4096, dtype=BF16), torch.empty(6144, 4096, dtype=BF16)
    meta = lambda: dict(triton_gemm.prepare("linear", x, w)[0][3])  # noqa: E731
    assert not triton_gemm.pdl(torch.device("cpu")) and "PDL" not in meta()
    monkeypatch.setattr(triton_gemm, "pdl", lambda device: True)
    assert meta()["PDL"] and meta()["launch_pdl"]
    with triton_gemm.without_pdl():
        assert "PDL" not in meta() and "launch_pdl" not in meta()
    assert meta()["PDL"]


# --------------------------------------------------------------------------- rotary in the epilogue


def rope_operands(gen: torch.Generator, rows: int, k: int, d: int, dtype: torch.dtype) -> dict[str, object]:
    """A qkv projection of 4 q heads, 1 k head and 1 v head of ``d``; a cos|sin cache of 100 positions."""
    t: dict[str, object] = operands(gen, (rows,), k, 6 * d, dtype)
    angles = torch.arange(100)[:, None] * 10000.0 ** (-torch.arange(d // 2) / (d // 2))[None, :]
    t["cache"] = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    t["pos"] = torch.randint(0, 100, (rows,), generator=gen)
    t["rotated"] = 5 * d
    return t


def test_rotary_reference_is_the_rotation_of_q_and_k(gen: torch.Generator) -> None:
    """``fxr.rms_norm_linear_rotary`` is ``fxr.rotary_embedding`` of the q and k views of
    ``fxr.rms_norm_linear``, v as it was."""
    t = rope_operands(gen, 7, 64, 32, BF16)
    x, g, w, b, pos, cache = t["x"], t["g"], t["w"], t["b"], t["pos"], t["cache"]
    y = torch.ops.fxr.rms_norm_linear(x, g, EPS, w, b)
    q, k = torch.ops.fxr.rotary_embedding(pos, y[:, :128].view(7, 4, 32), y[:, 128:160].view(7, 1, 32), cache, True)
    got = torch.ops.fxr.rms_norm_linear_rotary(x, g, EPS, w, b, False, pos, cache, 160)
    torch.testing.assert_close(got, torch.cat((q.reshape(7, -1), k.reshape(7, -1), y[:, 160:]), dim=-1), rtol=0, atol=0)


@pytest.mark.parametrize(("rows", "k", "d"), [(1, 256, 64), (5, 200, 128), (16, 128, 32)])
def test_kernel_rotary_epilogue(triton_gemm: types.ModuleType, gen: torch.Generator, rows: int, k: int, d: int) -> None:
    """Heads of 32 (blocks of 16 columns), 64 and 128: no further from float32 than the spec in
    float16; the v columns are the plain GEMM's, to one float16 rounding (tiles of another width:
    the interpreter's numpy dot may sum them in another order, as numpy 2.4's does)."""
    t = rope_operands(gen, rows, k, d, F16)
    args = (t["x"], t["g"], EPS, t["w"], t["b"], False, t["pos"], t["cache"], t["rotated"])
    assert lf._norm_rotary_check(*args) is None
    exact = lf.rms_norm_linear_rotary_reference(*(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                                  and a is not t["cache"] else a for a in args))  # fmt: skip
    got = triton_gemm.rms_norm_linear_rotary(*args)
    assert rel_err(got, exact) <= rel_err(lf.rms_norm_linear_rotary_reference(*args), exact) + 2e-3
    torch.testing.assert_close(got[:, 5 * d :], triton_gemm.rms_norm_linear(*args[:5])[:, 5 * d :], rtol=2**-10, atol=2**-24)


def test_rotary_checks_refuse_what_the_kernels_cannot_serve(gen: torch.Generator) -> None:
    t = rope_operands(gen, 4, 64, 64, BF16)
    x, g, w, pos, cache = t["x"], t["g"], t["w"], t["pos"], t["cache"]
    assert lf._norm_rotary_check(x, g, EPS, w, None, False, pos, cache, 320) is None
    assert lf._norm_rotary_check(x, g, EPS, w, None, False, pos[:3], cache, 320) == (
        "positions torch.int64(3,) for input (4, 64)")
    assert lf._norm_rotary_check(x, g, EPS, w, None, False, pos, cache[:, :48].contiguous(), 288) == (
        "cos_sin_cache torch.float32(100, 48): needs contiguous float32 [P, 32 m]")
    assert lf._norm_rotary_check(x, g, EPS, w, None, False, pos, cache, 300) == "300 rotated of 384 columns in heads of 64"
    assert lf._rope_check(x, g, EPS, w, None, False, pos, cache, 64) == (
        "64 rotated columns in heads of 64 (input (4, 64), 4 positions)")
    assert lf._rope_check(x, g, EPS, w, None, False, pos, cache, 320) is None
    assert lf._rope_check(x.float(), g, EPS, w.float(), None, False, pos, cache, 320) == "dtype float32 not bf16/fp16"


def test_the_residual_check_passes_fake_tensors_and_refuses_shared_memory() -> None:
    """A build ahead plans on fake tensors (no memory: every storage at address 0), so the
    aliasing check must not refuse them (it did: linear_add was never built ahead); real
    tensors sharing memory are still refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxrewrite.runtime.ops.linear_fused import residual_check

    x, w, r = torch.randn(8, 64), torch.randn(32, 64), torch.randn(8, 32)
    with FakeTensorMode() as mode:
        fx, fw, fr = (mode.from_tensor(t) for t in (x, w, r))
    assert residual_check(fx, fw, fr) is None
    assert residual_check(x, w, r) is None
    shared = torch.randn(8 * 64 + 8 * 32)
    assert residual_check(shared[: 8 * 64].view(8, 64), w, shared[8 * 64 :].view(8, 32)) == "residual and input share memory"


# --------------------------------------------------------------------------- the norm's hand-off


def hand_off_operands(gen: torch.Generator, rows: tuple[int, ...], k: int, n: int, m: int,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:  # fmt: skip
    """o_proj's operands (x [.., k], w [n, k], the residual [.., n]), the next norm's weight
    [n] and the next GEMM's weight [m, n]."""
    t = operands(gen, rows, k, n, dtype)
    t["g"], t["w2"] = 1 + rand(gen, n, dtype=dtype, scale=0.1), rand(gen, m, n, dtype=dtype, scale=n**-0.5)
    return t


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_hand_off_is_the_sum_and_its_norm(gen: torch.Generator, dtype: torch.dtype) -> None:
    """``linear_add_rms_parts``: the sum exactly as ``linear_add``, ``s * g`` rounded once, the
    squares by slots of 32 columns; a norm op reading it computes the norm of the sum (within
    one rounding of the dtype: it rounds ``s * g`` where the unfused norm rounds ``s * scale``)."""
    t = hand_off_operands(gen, (2, 3), 64, 96, 40, dtype)
    x, w, r, g, w2 = t["x"], t["w"], t["r"], t["g"], t["w2"]
    s, sg, parts = torch.ops.fxr.linear_add_rms_parts(x, w, r, g)
    torch.testing.assert_close(s, lf.linear_add_reference(x, w, r), rtol=0, atol=0)
    torch.testing.assert_close(sg, (s.float() * g.float()).to(dtype), rtol=0, atol=0)
    assert parts.shape == (2, 3, 3) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(-1), s.float().square().sum(-1), rtol=1e-6, atol=0)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for op in ("rms_norm_linear", "rms_norm_linear_silu_and_mul"):
        w_op = w2 if op == "rms_norm_linear" else w2[:40]
        got = getattr(torch.ops.fxr, op)(sg, None, EPS, w_op, None, False, parts)
        torch.testing.assert_close(got, getattr(torch.ops.fxr, op)(s, g, EPS, w_op), **tol)
    # a hand-off's squares are what scales: other squares give another answer
    other = torch.ops.fxr.rms_norm_linear(sg, None, EPS, w2, None, False, parts * 4)
    torch.testing.assert_close(other, torch.ops.fxr.rms_norm_linear(s, g, EPS, w2) / 2, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_hand_off_cublas_path_is_the_reference(gen: torch.Generator, dtype: torch.dtype) -> None:
    """Above 16 rows: cuBLAS's addmm then the hand-off in torch's ops; the norm ops scale by the
    squares they are given, then cuBLAS."""
    t = hand_off_operands(gen, (40,), 64, 96, 32, dtype)
    x, w, r, g, w2 = t["x"], t["w"], t["r"], t["g"], t["w2"]
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1.6e-2}
    got, want = lf._addmm_parts(x, w, r, g), lf.linear_add_rms_parts_reference(x, w, r, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    _, sg, parts = want
    torch.testing.assert_close(lf._norm_cublas(sg, None, EPS, w2, None, False, parts),
                               lf.rms_norm_linear_reference(sg, None, EPS, w2, None, False, parts), rtol=0, atol=0)  # fmt: skip


def test_the_hand_off_checks_refuse_what_the_kernel_cannot_serve(gen: torch.Generator) -> None:
    t = hand_off_operands(gen, (5,), 64, 96, 32, BF16)
    x, w, r, g = t["x"], t["w"], t["r"], t["g"]
    assert lf._hand_off_check(x, w, r, g) is None
    assert lf._hand_off_check(x, w, r, g.float()) == (
        "norm weight torch.float32(96,): needs a contiguous [96] of torch.bfloat16")
    assert lf._hand_off_check(x, w, r[:1], g) == "residual torch.bfloat16(1, 96) != output torch.bfloat16(5, 96)"
    parts = torch.zeros(5, 2)
    assert lf._norm_check(x, None, EPS, t["w2"][:, :64], None, False, parts) is None
    assert lf.parts_check(x, parts[:4]) == "parts torch.float32(4, 2) (contiguous=True) for input (5, 64)"
    assert lf.parts_check(x, parts.double()) == "parts torch.float64(5, 2) (contiguous=True) for input (5, 64)"
    assert lf.parts_check(x, torch.zeros(5, 1025)) == "1025 slots of squares: the kernel sums 1 to 1024"


@pytest.mark.parametrize(("rows", "k", "n"), [((1,), 256, 256), ((5,), 200, 128), ((16,), 128, 200), ((2, 3), 128, 64)])
def test_kernel_hand_off_and_its_readers(triton_gemm: types.ModuleType, gen: torch.Generator, rows: tuple[int, ...],
                                         k: int, n: int) -> None:  # fmt: skip
    """The producing kernel: the sum equal to ``linear_add``'s, ``s * g`` from it, the squares
    of it by slot; each reading kernel (plain, gated, rotated) no further from the float32
    spec of the unfused norm and GEMM than that spec in float16."""
    t = hand_off_operands(gen, rows, k, n, 2 * 96, F16)
    x, w, r, g, w2 = t["x"], t["w"], t["r"], t["g"], t["w2"]
    s, sg, parts = triton_gemm.linear_add_rms_parts(x, w, r, g)
    assert torch.equal(s, triton_gemm.linear_add(x, w, r))
    assert torch.equal(sg, (s.float() * g.float()).to(F16))
    torch.testing.assert_close(parts, lf.hand_off(s, g)[2], rtol=1e-5, atol=1e-3)  # n = 200: a last slot of 8
    exact_s = s.float()
    for op, w_op in (("rms_norm_linear", w2), ("rms_norm_linear_silu_and_mul", w2)):
        ref = getattr(lf, f"{op}_reference")
        exact = ref(exact_s, g.float(), EPS, w_op.float())
        got = getattr(triton_gemm, op)(sg, None, EPS, w_op, None, False, parts)
        assert rel_err(got, exact) <= rel_err(ref(s, g, EPS, w_op), exact) + 2e-3, op
    d = 32  # 6 heads of 32 columns: 4 q heads and a k head rotated, the v head as is
    angles = torch.arange(100)[:, None] * 10000.0 ** (-torch.arange(d // 2) / (d // 2))[None, :]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    pos = torch.randint(0, 100, (s.numel() // n,), generator=gen)
    w_qkv = w2[: 6 * d]
    rotate = (EPS, w_qkv, None, False, pos, cache, 5 * d)
    exact = lf.rms_norm_linear_rotary_reference(exact_s.reshape(-1, n), g.float(), EPS, w_qkv.float(), *rotate[2:])
    got = triton_gemm.rms_norm_linear_rotary(sg.reshape(-1, n), None, *rotate, parts.reshape(-1, parts.shape[-1]))
    spec = lf.rms_norm_linear_rotary_reference(s.reshape(-1, n), g, *rotate)
    assert rel_err(got, exact) <= rel_err(spec, exact) + 2e-3


def test_prepare_builds_the_hand_off_and_its_readers_apart(triton_gemm: types.ModuleType) -> None:
    """The producing kernel and a reading one are builds of their own (the squares are not in
    the reader's k loop: another kernel)."""
    with FakeTensorMode():
        x, g, w, r = (torch.empty(*s, dtype=BF16) for s in ((8, 4096), (4096,), (4096, 4096), (8, 4096)))
        parts = torch.empty(8, 128)
    hand_off = triton_gemm.prepare("linear_add_rms_parts", x, w, r, g)[0]
    reader = triton_gemm.prepare("rms_norm_linear", x, None, EPS, w, None, False, parts)[0]
    assert dict(hand_off[3])["HAND_OFF"] and dict(reader[3])["PARTS"] == 128
    assert hand_off != triton_gemm.prepare("linear_add", x, w, r)[0]
    assert reader != triton_gemm.prepare("rms_norm_linear", x, None, EPS, w)[0]


@pytest.mark.parametrize("n", [64, 200])
def test_kernel_hand_off_rows_above_the_decode_sizes(triton_rows: types.ModuleType, gen: torch.Generator, n: int) -> None:
    """Above 16 rows the hand-off and its scaling are row kernels around cuBLAS: ``s * g`` equal
    to the spec, the squares within float32 summation order, the scaled rows within one step."""
    s, g = rand(gen, 40, n, dtype=F16), 1 + rand(gen, n, dtype=F16, scale=0.1)
    got, want = triton_rows.hand_off_rows(s, g), lf.hand_off(s, g)
    assert got[0] is s and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-4)
    scaled = triton_rows.scale_rows(want[1], want[2], EPS)
    torch.testing.assert_close(scaled, lf.normed(want[1], None, EPS, False, want[2]), rtol=1e-3, atol=1e-3)
    # the squares decide the scale: four times the squares, half the rows
    torch.testing.assert_close(triton_rows.scale_rows(want[1], want[2] * 4, EPS), (scaled.float() / 2).to(F16),
                               rtol=1e-3, atol=1e-3)  # fmt: skip
