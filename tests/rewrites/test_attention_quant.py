"""fuse_attention_quant (rewrites/attention_quant.py): a static FP8 quantization of a declared
attention op's output moves into the op's twin; the twin is still a splitting op.

The attention ops here are this file's own (``fxrtest_aq::*``), declared as an engine would
declare its own: the rewriter knows no engine. On CPU the twin quantizes after the plain op,
so the outputs equal eager bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxrewrite import AttentionQuant, Config
from fxrewrite.split import split_graph
from fxrewrite.testing import op_counts
from fxrewrite.runtime.ops.quant import quant_fp8_static
from helpers.rewrites import BF16, DTYPE_MODES, F32, check, quant_per_token, quant_static, reasons, sites

RULE = "attention_quant_fp8"
HEADS, DIM, T, SLOTS = 4, 16, 6, 32


def _register() -> None:
    if hasattr(torch.ops.fxrtest_aq, "attn_quant"):
        return

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        cache.index_copy_(0, slots, k.flatten(1).to(cache.dtype))
        s = torch.einsum("thd,shd->hts", q.float(), k.float()) / DIM**0.5
        out = torch.einsum("hts,shd->thd", s.softmax(-1), v.float()).to(q.dtype).contiguous()
        return out if bias is None else out + bias

    @torch.library.custom_op("fxrtest_aq::attn", mutates_args=("cache",))
    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        return attend(q, k, v, cache, slots, bias)

    @torch.library.custom_op("fxrtest_aq::attn_quant", mutates_args=("cache",))
    def attn_quant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                   scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        return quant_static(attend(q, k, v, cache, slots, bias), scale)

    @torch.library.custom_op("fxrtest_aq::other", mutates_args=("cache",))
    def other(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        return attend(q, k, v, cache, slots, bias)

    for op in (attn, other):
        op.register_fake(lambda q, k, v, cache, slots, bias=None: torch.empty_like(q))
    attn_quant.register_fake(lambda q, k, v, cache, slots, scale, bias=None: q.new_empty(q.shape, dtype=torch.float8_e4m3fn))

    # a twin whose arguments differ from the op's (no bias): a declaration error
    @torch.library.custom_op("fxrtest_aq::attn_quant_bad", mutates_args=("cache",))
    def attn_quant_bad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                       scale: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return quant_static(attend(q, k, v, cache, slots, None), scale)


_register()
ATTN, ATTN_QUANT, OTHER = (torch.ops.fxrtest_aq.attn.default, torch.ops.fxrtest_aq.attn_quant.default,
                           torch.ops.fxrtest_aq.other.default)  # fmt: skip
DECLARED = (AttentionQuant(ATTN, ATTN_QUANT, scale_arg="scale"),)
CONFIG = Config(splitting_ops=(ATTN, OTHER), attention_quant=DECLARED)


class Layer(nn.Module):
    """attention -> heads flattened into one row -> ``quant`` (how its output is quantized)."""

    def __init__(self, quant: str = "static", op: object = ATTN, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.quant, self.op = quant, op
        self.scale = nn.Parameter(torch.tensor(0.0625) if scale is None else scale, requires_grad=False)
        self.register_buffer("cache", torch.zeros(SLOTS, HEADS * DIM))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                residual: torch.Tensor) -> object:  # fmt: skip
        out = self.op(q, k, v, self.cache, slots, None)  # type: ignore[operator]
        x = out.view(-1, HEADS * DIM)
        if self.quant == "static":
            return quant_static(x, self.scale)
        if self.quant == "runtime":  # the library's spelling: 448 read from a module constant
            return quant_fp8_static(x, self.scale)
        if self.quant == "dynamic":
            return quant_per_token(x)
        if self.quant == "residual":
            return quant_static(x + residual, self.scale)
        if self.quant == "also_read":
            return quant_static(x, self.scale), x
        return x  # "none": no FP8 anywhere


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    q, k, v = (torch.randn(T, HEADS, DIM).to(dtype) for _ in range(3))
    return q, k, v, torch.randperm(SLOTS)[:T], torch.randn(T, HEADS * DIM).to(dtype)


def counts(r: object, name: str) -> int:
    return sum(c for op, c in op_counts(r.graph).items() if op == name)  # type: ignore[attr-defined]


@pytest.mark.parametrize("quant", ["static", "runtime"])
@DTYPE_MODES
def test_static_quant_moves_into_the_twin(dtype: torch.dtype, dynamic: bool | str, quant: str) -> None:
    """op -> view -> (x.float() / s).clamp(-448, 448).to(fp8)  =>  twin(..., s) -> view; the
    FP8 bytes equal eager's."""
    layer = Layer(quant)
    r = check(layer, *inputs(dtype), expect={}, dynamic=dynamic, exact=True, config=CONFIG)
    assert counts(r, "fxrtest_aq.attn") == 0 and counts(r, "fxrtest_aq.attn_quant") == 1
    assert not any(op.startswith("prims.convert_element_type") for op in op_counts(r.graph)), op_counts(r.graph)
    assert counts_before(r, "fxrtest_aq.attn") == 1
    (site,) = sites(r, RULE)
    assert site.source.startswith("test_attention_quant.py")
    assert reasons(r, RULE) == []


def counts_before(r: object, name: str) -> int:
    return r.counts_before()[name]  # type: ignore[attr-defined]


def test_twin_is_a_splitting_op() -> None:
    """Config.resolved adds the twin of a splitting op; the fused graph splits at the twin."""
    assert Config(splitting_ops=(ATTN,), attention_quant=DECLARED).resolved().splitting_ops == (ATTN, ATTN_QUANT)
    assert Config(splitting_ops=(OTHER,), attention_quant=DECLARED).resolved().splitting_ops == (OTHER,)
    r = check(Layer(), *inputs(BF16), expect={}, exact=True, config=CONFIG)
    split = split_graph(r.graph, r.backend.config.splitting_ops)
    chosen = [p for p in split.pieces if p.is_splitting]
    assert len(chosen) == 1 and ATTN_QUANT not in split.missing
    assert [n.target for n in chosen[0].submodule.graph.nodes if n.op == "call_function"] == [ATTN_QUANT]


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_piecewise_and_full_runners(mode: str) -> None:
    """The CUDA-graph runner (emulated on CPU) splits at the twin in piecewise mode and runs the
    whole graph in full mode; outputs equal eager."""
    r = check(Layer(), *inputs(BF16), expect={}, exact=True, config=CONFIG, mode=mode, capture_sizes=(8,))
    runtime = r.report.graphs[0].runtime
    assert runtime["splitting_pieces"] == (1 if mode == "piecewise" else 0), runtime
    assert counts(r, "fxrtest_aq.attn_quant") == 1


@pytest.mark.parametrize(
    "layer,reason",
    [
        (lambda: Layer("dynamic"), "a dynamic quantization: its scale is reduced from the attention output"),
        (lambda: Layer("residual"), "is computed from the attention output"),
        (lambda: Layer("also_read"), "also read by"),
        (lambda: Layer(op=OTHER), "`fxrtest_aq::other` has no declared FP8-output twin"),
        (lambda: Layer(scale=torch.full((HEADS * DIM,), 0.0625)), "scale must be one float32 element"),
        (lambda: Layer(scale=torch.tensor(0.0625, dtype=BF16)), "scale must be one float32 element"),
    ],
    ids=["per_token", "attention_plus_residual", "output_read_elsewhere", "undeclared_op", "per_channel_scale",
         "bf16_scale"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_near_misses(layer: object, reason: str, dtype: torch.dtype) -> None:
    """The attention keeps its output; a per-token quantization of it then fuses alone
    (``fxr.dynamic_quant_fp8``, rewrites/quant.py's last rule)."""
    model = layer()  # type: ignore[operator]
    expect = {"dynamic_quant_fp8": 1} if model.quant == "dynamic" else {}
    r = check(model, *inputs(dtype), expect=expect, exact=True, config=CONFIG)
    assert counts(r, "fxrtest_aq.attn_quant") == 0
    assert counts(r, "fxrtest_aq.attn") + counts(r, "fxrtest_aq.other") == 1
    (why,) = reasons(r, RULE)
    assert reason in why, why


def test_no_fp8_no_near_miss() -> None:
    """A declared attention whose output is not quantized is no site: no near miss."""
    r = check(Layer("none"), *inputs(BF16), expect={}, exact=True, config=CONFIG)
    assert counts(r, "fxrtest_aq.attn") == 1 and reasons(r, RULE) == []


def test_without_declaration_nothing_fuses() -> None:
    r = check(Layer(), *inputs(BF16), expect={}, exact=True, config=Config(splitting_ops=(ATTN,)))
    assert counts(r, "fxrtest_aq.attn") == 1
    (why,) = reasons(r, RULE)
    assert "no declared FP8-output twin (Config.attention_quant)" in why


def test_declaration_is_checked() -> None:
    assert AttentionQuant("fxrtest_aq::attn", torch.ops.fxrtest_aq.attn_quant, "scale").op is ATTN
    with pytest.raises(ValueError, match="no Tensor argument 'output_scale'"):
        AttentionQuant(ATTN, ATTN_QUANT)
    with pytest.raises(ValueError, match="must take the arguments of"):
        AttentionQuant(ATTN, torch.ops.fxrtest_aq.attn_quant_bad.default, "scale")
    with pytest.raises(TypeError, match="must be a torch op"):
        AttentionQuant(ATTN, "fxrtest_aq::missing", "scale")


def test_match_filter_refuses_a_site() -> None:
    """Config.match_filter (bisection) sees the site as a FusionMatch and may refuse it."""
    seen: list[object] = []

    def refuse(m: object) -> str:
        seen.append(m)
        return "refused by the filter"

    config = Config(splitting_ops=(ATTN,), attention_quant=DECLARED, match_filter=refuse)
    r = check(Layer(), *inputs(BF16), expect={}, exact=True, config=config)
    assert counts(r, "fxrtest_aq.attn") == 1 and counts(r, "fxrtest_aq.attn_quant") == 0
    assert [m.anchor.target for m in seen] == [ATTN]  # type: ignore[attr-defined]
    assert [x.reason for x in r.report.rejected if x.rule == RULE] == ["refused by the filter"]
