"""Provider selection without a GPU: availability and device capability are faked, sgl-kernel's
registered ops are emulated on CPU under their real 0.4.6 schemas, flashinfer's functions under
their real 0.7.2 signatures; every op's CUDA impl (``OpDef.cuda``) then runs on CPU tensors."""

from __future__ import annotations

import inspect
import threading
import types
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import fxrewrite.runtime.ops as ops
from fxrewrite.runtime import providers
from fxrewrite.runtime.ops import activation, layernorm, linear, linear_block_fp8, norm, quant, quant_block, quant_nvfp4, rotary
from fxrewrite.runtime.providers import Kernel, OpDef
from samples import op_args  # this folder

EPS = 1e-6
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def install(reg: providers._Registry, **modules: types.ModuleType | None) -> None:
    """Pretend these modules import (a module) or fail to (None)."""
    for name, module in modules.items():
        reg.modules[name.replace("__", ".")] = module
        if module is None:
            reg.import_errors[name.replace("__", ".")] = "ModuleNotFoundError: faked"


def lib(name: str) -> types.ModuleType:
    return types.ModuleType(name)


# --------------------------------------------------------------------------- selection logic


def tagged(tag: str, reason: str | None = None, **kw: Any) -> Kernel:
    return Kernel(tag, lambda *a: tag, lambda *a: reason, **kw)


def reference(*args: Any) -> str:
    return "torch"


X = torch.zeros(2, 8)


def test_tries_kernels_in_the_order_the_op_lists_them(registry: providers._Registry) -> None:
    install(registry, sgl_kernel=lib("sgl_kernel"), flashinfer=lib("flashinfer"))
    kernels = (tagged("sgl_kernel"), tagged("flashinfer"))
    assert providers.dispatch("rms_norm", kernels, reference, X) == "sgl_kernel"
    assert providers.dispatch("gemma_rms_norm", kernels[::-1], reference, X) == "flashinfer"
    rejecting = (tagged("sgl_kernel", "dtype float32 not bf16/fp16"), tagged("flashinfer"))
    assert providers.dispatch("silu_and_mul", rejecting, reference, X) == "flashinfer"
    assert providers.served() == {
        "gemma_rms_norm": {"flashinfer": 1, "fallbacks": {}},
        "rms_norm": {"sgl_kernel": 1, "fallbacks": {}},
        "silu_and_mul": {"flashinfer": 1, "fallbacks": {}},
    }


def test_no_kernel_can_serve_counts_fallback_with_reasons(registry: providers._Registry) -> None:
    install(registry, sgl_kernel=lib("sgl_kernel"), flashinfer=None)
    kernels = (tagged("sgl_kernel", "odd last dim 33"), tagged("flashinfer"))
    for _ in range(3):
        assert providers.dispatch("silu_and_mul", kernels, reference, X) == "torch"
    reason = "sgl_kernel: odd last dim 33; flashinfer not importable"
    assert providers.served() == {"silu_and_mul": {"torch": 3, "fallbacks": {reason: 3}}}
    assert "silu_and_mul: torch 3 (fallbacks: 3x " + reason in providers.format_served()
    providers.reset_counts()
    assert providers.served() == {}


def test_calls_counted_apart_under_a_scope(registry: providers._Registry) -> None:
    install(registry, sgl_kernel=lib("sgl_kernel"))
    kernels = (tagged("sgl_kernel", "odd last dim 33"),)
    with providers.counting("verification"):
        assert providers.dispatch("silu_and_mul", kernels, reference, X) == "torch"
    assert providers.dispatch("rms_norm", (tagged("sgl_kernel"),), reference, X) == "sgl_kernel"
    assert providers.served() == {"rms_norm": {"sgl_kernel": 1, "fallbacks": {}}}  # the model's calls
    assert providers.served("verification") == {
        "silu_and_mul": {"torch": 1, "fallbacks": {"sgl_kernel: odd last dim 33": 1}}}
    providers.reset_counts()
    assert providers.served("verification") == {}


def test_device_too_old_for_fp8(registry: providers._Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    install(registry, sgl_kernel=lib("sgl_kernel"))
    monkeypatch.setattr(providers, "device_capability", lambda device: (8, 0))
    assert providers.dispatch("q", (tagged("sgl_kernel", min_capability=(8, 9)),), reference, X) == "torch"
    assert providers.served()["q"]["fallbacks"] == {"sgl_kernel needs sm89+, device is sm80": 1}


def test_label_and_module(registry: providers._Registry) -> None:
    install(registry, flashinfer=lib("flashinfer"), flashinfer__norm=None)
    kernel = Kernel("flashinfer", lambda *a: "fi", lambda *a: None, label="flashinfer+torch", module="flashinfer.norm")
    assert providers.dispatch("op", (kernel,), reference, X) == "torch"
    assert providers.served()["op"]["fallbacks"] == {"flashinfer.norm not importable": 1}
    install(registry, flashinfer__norm=lib("flashinfer.norm"))
    providers.configure(None)  # clears the plans
    assert providers.dispatch("op", (kernel,), reference, X) == "fi"
    assert providers.served()["op"]["flashinfer+torch"] == 1


def test_plan_is_fixed_at_first_use_per_device(registry: providers._Registry) -> None:
    install(registry, sgl_kernel=lib("sgl_kernel"))
    kernels = (tagged("sgl_kernel"),)
    assert providers.dispatch("rms_norm", kernels, reference, X) == "sgl_kernel"
    install(registry, sgl_kernel=None)
    assert providers.dispatch("rms_norm", kernels, reference, X) == "sgl_kernel"
    assert list(registry.plans) == [("rms_norm", "cpu")]


# --------------------------------------------------------------------------- overrides


def test_global_override(registry: providers._Registry) -> None:
    install(registry, sgl_kernel=lib("sgl_kernel"), flashinfer=lib("flashinfer"))
    providers.configure("flashinfer")
    kernels = (tagged("sgl_kernel"), tagged("flashinfer"))
    assert providers.dispatch("rms_norm", kernels, reference, X) == "flashinfer"
    assert providers.dispatch("rms_norm_dynamic_quant_fp8", kernels[:1], reference, X) == "torch"
    assert providers.served()["rms_norm_dynamic_quant_fp8"]["fallbacks"] == {
        "flashinfer has no kernel for rms_norm_dynamic_quant_fp8": 1
    }


def test_per_op_override_and_torch_is_no_fallback(registry: providers._Registry) -> None:
    install(registry, sgl_kernel=lib("sgl_kernel"), flashinfer=lib("flashinfer"))
    providers.configure("rms_norm=flashinfer, silu_and_mul=torch")
    kernels = (tagged("sgl_kernel"), tagged("flashinfer"))
    assert providers.dispatch("rms_norm", kernels, reference, X) == "flashinfer"
    assert providers.dispatch("silu_and_mul", kernels, reference, X) == "torch"
    assert providers.dispatch("gelu_and_mul", kernels, reference, X) == "sgl_kernel"
    assert providers.served()["silu_and_mul"] == {"torch": 1, "fallbacks": {}}


def test_mixed_spec(registry: providers._Registry) -> None:
    install(registry, sgl_kernel=lib("sgl_kernel"), flashinfer=lib("flashinfer"))
    providers.configure("flashinfer,silu_and_mul=sgl_kernel")
    kernels = (tagged("sgl_kernel"), tagged("flashinfer"))
    assert providers.dispatch("rms_norm", kernels, reference, X) == "flashinfer"
    assert providers.dispatch("silu_and_mul", kernels, reference, X) == "sgl_kernel"


def test_an_override_inside_a_block_restores_the_one_before(registry: providers._Registry) -> None:
    """``overriding``: bench_e2e's side-by-side rows of two providers of one op in one process."""
    install(registry, sgl_kernel=lib("sgl_kernel"), flashinfer=lib("flashinfer"))
    providers.configure("silu_and_mul=sgl_kernel")
    kernels = (tagged("sgl_kernel"), tagged("flashinfer"))
    with providers.overriding("rms_norm=flashinfer"):
        assert providers.dispatch("rms_norm", kernels, reference, X) == "flashinfer"
    assert providers.dispatch("rms_norm", kernels, reference, X) == "sgl_kernel"
    with pytest.raises(RuntimeError), providers.overriding("torch"):
        assert providers.dispatch("rms_norm", kernels, reference, X) == "torch"
        raise RuntimeError("the block raised")
    assert providers.dispatch("rms_norm", kernels, reference, X) == "sgl_kernel"
    assert providers._REGISTRY.overrides == {"silu_and_mul": "sgl_kernel"}


def test_an_override_block_before_any_configure_leaves_the_env_var_to_be_read(
    registry: providers._Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A side-by-side row's override in a process whose first fused op runs inside it (a CPU run
    of bench_e2e): the block works, and after it the override is unread again, so the env var
    still decides."""
    install(registry, sgl_kernel=lib("sgl_kernel"), flashinfer=lib("flashinfer"))
    assert providers._REGISTRY.overrides is None
    kernels = (tagged("sgl_kernel"), tagged("flashinfer"))
    with providers.overriding("rms_norm=flashinfer"):
        assert providers.dispatch("rms_norm", kernels, reference, X) == "flashinfer"
    assert providers._REGISTRY.overrides is None
    monkeypatch.setenv(providers.ENV_VAR, "torch")
    assert providers.dispatch("rms_norm", kernels, reference, X) == "torch"


def test_env_var_read_when_configure_gets_none(registry: providers._Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    install(registry, sgl_kernel=lib("sgl_kernel"))
    monkeypatch.setenv(providers.ENV_VAR, "torch")
    assert providers.dispatch("rms_norm", (tagged("sgl_kernel"),), reference, X) == "torch"
    monkeypatch.setenv(providers.ENV_VAR, "")
    providers.configure(None)
    assert providers.dispatch("rms_norm", (tagged("sgl_kernel"),), reference, X) == "sgl_kernel"


@pytest.mark.parametrize("library_name", ["sgl_kernel", "flashinfer"])
def test_override_naming_missing_library_raises(registry: providers._Registry, library_name: str) -> None:
    install(registry, **{library_name: None})
    with pytest.raises(ValueError, match=f"{library_name} is not importable"):
        providers.configure(library_name)
    with pytest.raises(ValueError, match=f"{library_name} is not importable"):
        providers.configure(f"rms_norm={library_name}")


def test_override_of_library_absent_here_raises_for_real(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(providers, "_REGISTRY", providers._Registry())
    for name in ("sgl_kernel", "flashinfer"):
        if providers.library(name) is None:
            with pytest.raises(ValueError, match=f"{name} is not importable"):
                providers.configure(name)


@pytest.mark.parametrize(("spec", "message"), [("cutlass", "unknown provider"), ("rms_nrom=torch", "unknown op")])
def test_bad_spec_raises(registry: providers._Registry, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        providers.configure(spec)


def test_without_libraries_cpu_needs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real device_capability: None on CPU (no CUDA query), PDL off."""
    assert providers.device_capability(torch.device("cpu")) is None
    assert not providers.enable_pdl(torch.device("cpu"))
    assert providers.available("torch")


# --------------------------------------------------------------------------- kernel constraints


def test_norm_constraints(gen: torch.Generator) -> None:
    x, w = rand(gen, 4, 64), rand(gen, 64)
    assert norm.check_norm(x, w) is None
    assert norm.check_norm(x.float(), w.float()) == "dtype float32 not bf16/fp16"
    assert norm.check_norm(x, w.float()) == "dtype float32 != input dtype bfloat16"
    assert norm.check_norm(x[:0], w) == "empty input"
    assert "weight" in norm.check_norm(x, rand(gen, 32))  # type: ignore[operator]
    assert norm.check_norm(rand(gen, 64, 4).t(), w) == "last dim not contiguous"
    assert norm.check_norm(rand(gen, 4, 128)[:, :64], w) is None  # strided rows
    assert norm.check_norm(rand(gen, 4, 128)[:, :64], w, contiguous=True) == "input not contiguous"
    assert norm.check_norm(rand(gen, 4 * 64 + 1)[1:].view(4, 64), w) == "address or row stride not 16-byte aligned"
    assert norm.check_norm(rand(gen, 4 * 33 + 1)[1:].view(4, 33), rand(gen, 33)) is None  # vectors of 1
    assert norm.check_norm(rand(gen, 4, 65)[:, :64], w) == "address or row stride not 16-byte aligned"


def test_per_head_norm_needs_flashinfer_when_not_viewable_as_rows(gen: torch.Generator) -> None:
    qkv = rand(gen, 5, 3 * 4 * 128)
    q = qkv[:, : 4 * 128].view(5, 4, 128)  # heads of a fused QKV projection: rows not uniform
    w = rand(gen, 128)
    assert norm.as_rows(q) is None
    assert "not viewable as 2D rows" in norm.check_norm(q, w)  # type: ignore[operator]
    assert norm.check_norm(q, w, allow_3d=True) is None
    assert norm.check_norm(rand(gen, 5, 4, 128), w) is None  # contiguous: flattened to rows


def test_inplace_refuses_shared_memory(gen: torch.Generator) -> None:
    x, w = rand(gen, 4, 64), rand(gen, 64)
    assert norm._inplace_check(x, x, w, EPS) == "x and residual share memory"
    assert norm._inplace_check(x, rand(gen, 4, 32), w, EPS) == "shape (4, 32) != input shape (4, 64)"


def test_activation_constraints(gen: torch.Generator) -> None:
    assert activation.check_act_and_mul(rand(gen, 4, 128), half_aligned=True) is None
    assert activation.check_act_and_mul(rand(gen, 4, 8), half_aligned=True) == "half row 8 bytes, not a multiple of 16"
    assert activation.check_act_and_mul(rand(gen, 4, 8), half_aligned=False) is None
    assert activation.check_act_and_mul(rand(gen, 4, 7), half_aligned=False) == "odd last dim 7"
    assert activation.check_act_and_mul(rand(gen, 4, 256)[:, :128], half_aligned=False) == "input not contiguous"
    assert activation.check_act_and_mul(rand(gen, 4, 128).half(), half_aligned=True) is None
    assert activation.check_act_and_mul(rand(gen, 4, 128).float(), half_aligned=True) == "dtype float32 not bf16/fp16"


def test_scale_constraints(gen: torch.Generator) -> None:
    x = rand(gen, 2, 64)
    assert quant.check_scale(x, torch.ones(1)) is None
    assert quant.check_scale(x, torch.ones(())) is None
    assert "is not one float32" in quant.check_scale(x, torch.ones(2))  # type: ignore[operator]
    assert "is not one float32" in quant.check_scale(x, torch.ones(1, dtype=BF16))  # type: ignore[operator]


# --------------------------------------------------------------------------- emulated libraries


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float, bias: float) -> torch.Tensor:
    """What the CUDA kernels compute: float32 throughout, one rounding at the end."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (bias + w.float())).to(x.dtype)


def _sgl_norm(bias: float, out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float, pdl: bool) -> None:
    assert x.dim() == 2 and x.stride(-1) == 1 and w.dtype == x.dtype
    out.copy_(_norm(x, w, eps, bias))


def _sgl_add_norm(bias: float, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float, pdl: bool) -> None:
    assert x.dim() == 2 and x.shape == r.shape and w.dtype == x.dtype == r.dtype
    total = x.float() + r.float()
    r.copy_(total)
    x.copy_(_norm(total, w, eps, bias))


def _act(name: str, out: torch.Tensor, x: torch.Tensor) -> None:
    assert x.is_contiguous() and out.is_contiguous()
    fn = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[name]
    gate, up = x.float().chunk(2, dim=-1)
    out.copy_(fn(gate) * up)


def _sgl_per_token_quant(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    assert x.dim() == 2 and x.is_contiguous() and s.is_contiguous() and s.numel() == x.shape[0]
    scale = x.float().abs().amax(-1, keepdim=True) / 448.0
    inv = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
    q.copy_((x.float() * inv).clamp(-448.0, 448.0).to(FP8))
    s.view(-1).copy_(scale.view(-1))


SGL_SCHEMAS = {  # as registered by sgl-kernel 0.4.6 (sm90/common_ops.abi3.so)
    "rmsnorm": (
        "rmsnorm(Tensor! output, Tensor input, Tensor weight, float eps, bool enable_pdl) -> ()",
        lambda *a: _sgl_norm(0.0, *a),
    ),
    "gemma_rmsnorm": (
        "gemma_rmsnorm(Tensor! output, Tensor input, Tensor weight, float eps, bool enable_pdl) -> ()",
        lambda *a: _sgl_norm(1.0, *a),
    ),
    "fused_add_rmsnorm": (
        "fused_add_rmsnorm(Tensor! input, Tensor! residual, Tensor weight, float eps, bool enable_pdl) -> ()",
        lambda *a: _sgl_add_norm(0.0, *a),
    ),
    "gemma_fused_add_rmsnorm": (
        "gemma_fused_add_rmsnorm(Tensor! input, Tensor! residual, Tensor weight, float eps, bool enable_pdl) -> ()",
        lambda *a: _sgl_add_norm(1.0, *a),
    ),
    "silu_and_mul": ("silu_and_mul(Tensor! out, Tensor input) -> ()", lambda *a: _act("silu", *a)),
    "gelu_and_mul": ("gelu_and_mul(Tensor! out, Tensor input) -> ()", lambda *a: _act("gelu", *a)),
    "gelu_tanh_and_mul": ("gelu_tanh_and_mul(Tensor! out, Tensor input) -> ()", lambda *a: _act("gelu_tanh", *a)),
    "sgl_per_token_quant_fp8": (
        "sgl_per_token_quant_fp8(Tensor input, Tensor! output_q, Tensor! output_s) -> ()",
        _sgl_per_token_quant,
    ),
}


@pytest.fixture(scope="module")
def sgl_ops() -> Iterator[None]:
    """``torch.ops.sgl_kernel.*`` on CPU under the real schemas, for this module only."""
    try:
        torch.ops.sgl_kernel.rmsnorm  # noqa: B018
        pytest.skip("the real sgl-kernel ops are loaded")
    except (AttributeError, RuntimeError):
        pass
    library = torch.library.Library("sgl_kernel", "DEF")
    for name, (schema, impl) in SGL_SCHEMAS.items():
        library.define(schema)
        library.impl(name, impl, "CPU")
    yield
    library._destroy()


def _fi_norm(
    bias: float,
    input: Tensor,
    weight: Tensor,
    eps: float = 1e-6,
    out: Tensor | None = None,
    enable_pdl: bool | None = None,
) -> Tensor:
    assert input.dim() in (2, 3) and input.stride(-1) == 1 and weight.dtype == input.dtype and out is not None
    out.copy_(_norm(input, weight, eps, bias))
    return out


def _fi_add_norm(
    bias: float, input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, enable_pdl: bool | None = None
) -> None:
    _sgl_add_norm(bias, input, residual, weight, eps, bool(enable_pdl))


def _fi_rmsnorm_quant(
    out: Tensor, input: Tensor, weight: Tensor, scale: Tensor, eps: float = 1e-6, enable_pdl: bool | None = None
) -> None:
    assert input.dim() == 2 and out.dtype == FP8 and scale.numel() == 1
    h = input.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    out.copy_((y * (1.0 / scale)).clamp(-448.0, 448.0).to(FP8))


def _fi_layernorm(input: Tensor, gemma: Tensor, beta: Tensor, eps: float = 1e-6) -> Tensor:
    assert input.dim() == 2 and input.is_contiguous() and input.dtype == BF16
    assert gemma.dtype == beta.dtype == torch.float32
    h = input.float()
    return (F.layer_norm(h, h.shape[-1:], None, None, eps) * gemma + beta).to(input.dtype)


def _fi_act(name: str, input: Tensor, out: Tensor | None = None, enable_pdl: bool | None = None) -> Tensor:
    assert out is not None
    _act(name, out, input)
    return out


def _fi_rope(
    positions: Tensor, query: Tensor, key: Tensor, head_size: int, cos_sin_cache: Tensor, is_neox: bool = True
) -> tuple[Tensor, Tensor]:
    assert cos_sin_cache.dtype == torch.float32 and query.stride(-1) == 1 and key.stride(-1) == 1
    q = query.view(query.shape[0], -1, head_size)
    k = key.view(key.shape[0], -1, head_size)
    return tuple(rotary.rotary_embedding_q_reference(positions, t, cos_sin_cache, is_neox) for t in (q, k))  # type: ignore[return-value]


def _fi_rope_inplace(positions: Tensor, query: Tensor, key: Tensor, head_size: int, cos_sin_cache: Tensor,
                    is_neox: bool = True) -> None:  # fmt: skip
    """0.7.2's ``apply_rope_with_cos_sin_cache_inplace``: ``[nnz, heads * head_size]`` views rotated in place."""
    for t, turned in zip((query, key), _fi_rope(positions, query, key, head_size, cos_sin_cache, is_neox)):
        t.copy_(turned.reshape(t.shape))


def flashinfer_modules() -> dict[str, types.ModuleType]:
    """``flashinfer.norm``, ``.activation`` and ``.rope`` with 0.7.2's signatures."""
    fi_norm, fi_act, fi_rope = lib("flashinfer.norm"), lib("flashinfer.activation"), lib("flashinfer.rope")
    fi_rope.apply_rope_with_cos_sin_cache = _fi_rope  # type: ignore[attr-defined]
    fi_rope.apply_rope_with_cos_sin_cache_inplace = _fi_rope_inplace  # type: ignore[attr-defined]
    fi_norm.rmsnorm = lambda *a, **k: _fi_norm(0.0, *a, **k)  # type: ignore[attr-defined]
    fi_norm.gemma_rmsnorm = lambda *a, **k: _fi_norm(1.0, *a, **k)  # type: ignore[attr-defined]
    fi_norm.fused_add_rmsnorm = lambda *a, **k: _fi_add_norm(0.0, *a, **k)  # type: ignore[attr-defined]
    fi_norm.gemma_fused_add_rmsnorm = lambda *a, **k: _fi_add_norm(1.0, *a, **k)  # type: ignore[attr-defined]
    fi_norm.rmsnorm_quant = _fi_rmsnorm_quant  # type: ignore[attr-defined]
    fi_norm.layernorm = _fi_layernorm  # type: ignore[attr-defined]
    for name in ("silu", "gelu", "gelu_tanh"):
        setattr(fi_act, f"{name}_and_mul", lambda *a, _n=name, **k: _fi_act(_n, *a, **k))
    return {"flashinfer": lib("flashinfer"), "flashinfer.norm": fi_norm, "flashinfer.activation": fi_act,
            "flashinfer.rope": fi_rope}  # fmt: skip


@pytest.fixture
def both_libraries(registry: providers._Registry, sgl_ops: None) -> providers._Registry:
    """sgl-kernel and flashinfer emulated; Triton's kernels not importable (a test that wants
    them installs the ``triton_kernels`` fixture's module)."""
    registry.modules.update({"sgl_kernel": lib("sgl_kernel"), **flashinfer_modules()})
    install(registry, **{providers.TRITON_MODULE: None, layernorm.TRITON_LAYER_NORM: None, quant_block.TRITON_MODULE: None,
                         rotary.TRITON_ROTARY: None})  # fmt: skip
    return registry


def assert_served_close(got: Any, want: Any) -> None:
    """Kernels round once where the spec rounds twice (bf16): one bf16 step, or one FP8 step."""
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    problems, rest = quant.quantized_output_mismatches(got, want, quant.fp8_scale_rtol(BF16))
    assert not problems, problems
    for i in rest:
        torch.testing.assert_close(got[i].float(), want[i].float(), rtol=2e-2, atol=2e-2)


# Triton kernels built on tl.dot (the fused GEMMs' kernel in float16: tests/runtime/test_linear_fused_ops.py)
INTERPRETER_BF16_DOT = ("linear", "linear_silu_and_mul", "rms_norm_linear", "rms_norm_linear_silu_and_mul",
                        "rms_norm_linear_rotary", "linear_add", "linear_add_", "linear_add_rms_parts", "moe")  # fmt: skip


@pytest.mark.parametrize("shape", [(1, 64), (7, 256), (2, 3, 128)])
@pytest.mark.parametrize("provider", ["sgl_kernel", "flashinfer", "triton"])
# The all-reduce ops (sequence parallelism included) need a process group and flashinfer.comm:
# tests/runtime/test_collective_ops.py, tests/runtime/test_sequence_parallel_ops.py, tests/runtime/test_async_tp_ops.py.
@pytest.mark.parametrize("op", [op for op in ops.DEFS if op not in ops.collective.DEFS + ops.sequence_parallel.DEFS
                                + ops.async_tp.DEFS], ids=lambda op: op.name)
def test_every_op_through_each_emulated_provider(
    both_libraries: providers._Registry,
    gen: torch.Generator,
    op: OpDef,
    provider: str,
    shape: tuple[int, ...],
    request: pytest.FixtureRequest,
) -> None:
    """sgl-kernel and flashinfer emulated; Triton's real kernels, interpreted (skipped without)."""
    if provider == "triton" and op.name in INTERPRETER_BF16_DOT:
        pytest.skip("Triton 3.6's interpreter multiplies bf16 tl.dot operands wrongly (8e10 off on a "
                    "3x64 @ 64x32 product; fp16 and fp32 are right): tests/runtime/test_ops_gpu.py runs it")
    if provider == "triton":
        both_libraries.modules[providers.TRITON_MODULE] = request.getfixturevalue("triton_kernels")
        both_libraries.modules[layernorm.TRITON_LAYER_NORM] = request.getfixturevalue("triton_layernorm")
        both_libraries.modules[quant_nvfp4.TRITON_MODULE] = request.getfixturevalue("triton_nvfp4")
        both_libraries.modules[quant_block.TRITON_MODULE] = request.getfixturevalue("triton_quant_block")
        both_libraries.modules[rotary.TRITON_ROTARY] = request.getfixturevalue("triton_rotary")
    providers.configure(provider)
    args = op_args(op, shape, gen)
    if provider == "flashinfer" and op in layernorm.DEFS:  # its LayerNorm takes float32 gamma and beta
        args = [a.float() if a is not None and name in ("weight", "bias") else a
                for a, name in zip(args, inspect.signature(op.reference).parameters)]  # fmt: skip
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got, want = op.cuda(*args), op.reference(*ref_args)
    if op.mutates_args:
        assert got is None and want is None
        names = list(inspect.signature(op.reference).parameters)
        got, want = (tuple(a[names.index(m)] for m in op.mutates_args) for a in (args, ref_args))
    assert_served_close(got, want)
    entry = providers.served()[op.name]
    if any(k.provider == provider for k in op.kernels):
        assert entry["fallbacks"] == {}, entry
        label = next(k.name for k in op.kernels if k.provider == provider)
        assert [name for name in entry if name != "fallbacks"] == [label]
    else:
        assert entry == {"torch": 1, "fallbacks": {f"{provider} has no kernel for {op.name}": 1}}


def test_every_op_has_a_kernel(both_libraries: providers._Registry) -> None:
    """All but ``apply_rotary``, the rules' intermediate form: no library rotates by arbitrary
    tables; the folding pass turns it into ``rotary_embedding`` (and the report says where not)."""
    assert [op.name for op in ops.DEFS if not op.kernels] == ["apply_rotary"]


def test_default_order_and_fallbacks_on_real_tables(both_libraries: providers._Registry, gen: torch.Generator) -> None:
    w = rand(gen, 128)
    q = rand(gen, 5, 3 * 4 * 128)[:, : 4 * 128].view(5, 4, 128)
    torch.testing.assert_close(ops.DEFS[0].cuda(q, w, EPS), norm.rms_norm_reference(q, w, EPS), rtol=2e-2, atol=2e-2)
    ops.DEFS[0].cuda(rand(gen, 4, 128), w, EPS)
    ops.DEFS[0].cuda(rand(gen, 4, 128).float(), w.float(), EPS)
    assert providers.served()["rms_norm"] == {
        "flashinfer": 1,
        "sgl_kernel": 1,
        "torch": 1,
        "fallbacks": {"sgl_kernel: dtype float32 not bf16/fp16; flashinfer: dtype float32 not bf16/fp16; "
                      "fxrewrite.runtime.triton_kernels not importable": 1},  # Triton would take it
    }


def test_dynamic_quant_zero_rows_get_the_floor_scale(both_libraries: providers._Registry) -> None:
    q, s = quant.DEFS[1].cuda(torch.zeros(3, 64, dtype=BF16), torch.ones(64, dtype=BF16), EPS)
    assert torch.equal(q.float(), torch.zeros(3, 64))
    assert torch.equal(s, torch.full((3, 1), quant.SCALE_FLOOR))
    assert providers.served()["rms_norm_dynamic_quant_fp8"]["sgl_kernel"] == 1


def test_preload_imports_every_kernel_module(registry: providers._Registry) -> None:
    install(registry, sgl_kernel=lib("sgl_kernel"), flashinfer=None, flashinfer__norm=None, flashinfer__activation=None,
            flashinfer__rope=None, flashinfer__comm=None)  # fmt: skip
    install(registry, **{providers.TRITON_MODULE: None, "fxrewrite.runtime.triton_moe": None,
                         layernorm.TRITON_LAYER_NORM: None, "fxrewrite.runtime.triton_route": None,
                         "fxrewrite.runtime.triton_norms": None, quant_nvfp4.TRITON_MODULE: None,
                         quant_block.TRITON_MODULE: None, activation.TRITON_ACT_MUL: None,
                         linear_block_fp8.TRITON_MODULE: None, linear.TRITON_GEMM: None,
                         rotary.TRITON_ROTARY: None})  # fmt: skip
    assert providers.preload() == {
        "flashinfer": False,
        "flashinfer.activation": False,
        "flashinfer.comm": False,
        "flashinfer.norm": False,
        "flashinfer.rope": False,
        "fxrewrite.runtime.triton_act_mul": False,
        "fxrewrite.runtime.triton_gemm": False,
        "fxrewrite.runtime.triton_kernels": False,
        "fxrewrite.runtime.triton_layernorm": False,
        "fxrewrite.runtime.triton_linear_block_fp8": False,
        "fxrewrite.runtime.triton_moe": False,
        "fxrewrite.runtime.triton_quant_block": False,
        "fxrewrite.runtime.triton_norms": False,
        "fxrewrite.runtime.triton_nvfp4": False,
        "fxrewrite.runtime.triton_rotary": False,
        "fxrewrite.runtime.triton_route": False,
        "sgl_kernel": True,
        "torch.distributed": True,  # sequence parallelism's NCCL paths
        "torch.distributed._symmetric_memory": True,  # async TP's fused GEMM + collective ops
    }


def test_misaligned_weight_is_refused(gen: torch.Generator) -> None:
    x, w = rand(gen, 4, 64), rand(gen, 65)[1:]
    assert norm.check_norm(x, w) == "weight address not 16-byte aligned"
    assert norm._fused_add_check(x, x.clone(), w, EPS) == "weight address not 16-byte aligned"


# --------------------------------------------------------------------------- building ahead


def _fake_cuda(*shape: int) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, dtype=BF16, device="cuda")


def _probe_op(prepare: Any) -> tuple[OpDef, Any]:
    """An op ``fxr::probe`` whose one kernel (sgl_kernel's, up to 16 rows) builds ahead with
    ``prepare``, and a stand-in for its target (what a replacement graph calls)."""
    kernel = Kernel("sgl_kernel", lambda x, w: x, lambda x, w: None if x.shape[0] <= 16 else "rows", prepare=prepare)
    op = OpDef("probe", lambda x, w: x, lambda x, w: x, (kernel,))
    return op, types.SimpleNamespace(_qualified_op_name="fxr::probe")


def test_prebuild_builds_each_kernel_once_in_parallel_threads(registry: providers._Registry,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Calls with equal keys build once; the two distinct builds run at the same time (each
    waits for the other at a barrier, which times out if they ran one after another); calls the
    dispatch would not send to that kernel (17 rows: its check refuses) and CPU calls build
    nothing."""
    install(registry, sgl_kernel=lib("sgl_kernel"))
    both_running = threading.Barrier(2, timeout=10)
    built: list[tuple[Any, str]] = []

    def prepare(x: Tensor, w: Tensor) -> tuple[Any, Any]:
        def build() -> None:
            both_running.wait()
            built.append((tuple(w.shape), threading.current_thread().name))

        return tuple(w.shape), build

    op, target = _probe_op(prepare)
    monkeypatch.setitem(providers._OPS, "probe", op)
    x, big = _fake_cuda(8, 16), _fake_cuda(17, 16)
    calls = [(target, (x, _fake_cuda(32, 16)), {}), (target, (x,), {"w": _fake_cuda(32, 16)}),
             (target, (x, _fake_cuda(64, 16)), {}), (target, (big, _fake_cuda(128, 16)), {}),
             (target, (torch.zeros(8, 16), torch.zeros(256, 16)), {})]  # fmt: skip
    note = providers.prebuild(calls)
    assert sorted(key for key, _ in built) == [(32, 16), (64, 16)]
    assert all(name.startswith("fxr-build") for _, name in built)
    assert note is not None and note.startswith("2 kernels built ahead (or found built) in ") and note.endswith(
        "2 at a time: probe (sgl_kernel) x2")
    assert providers.served() == {}  # building runs nothing


def test_prebuild_leaves_a_failed_build_to_the_call(registry: providers._Registry,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Negative twin: a build that raises is reported, not raised (the call itself raises it
    later, where verification refuses the site); an override to torch builds nothing."""
    install(registry, sgl_kernel=lib("sgl_kernel"))

    def prepare(x: Tensor, w: Tensor) -> tuple[Any, Any]:
        def build() -> None:
            raise RuntimeError("out of resources: shared memory")

        return "k", build

    op, target = _probe_op(prepare)
    monkeypatch.setitem(providers._OPS, "probe", op)
    calls = [(target, (_fake_cuda(8, 16), _fake_cuda(32, 16)), {})]
    note = providers.prebuild(calls)
    assert note is not None and note.endswith("; 1 failed (probe (sgl_kernel))")
    providers.configure("torch")
    assert providers.prebuild(calls) is None
    assert providers.Prebuild().wants(target) and not providers.Prebuild().wants(torch.ops.aten.mm.default)
