"""CPU tests of the serving-engine reference model in ``bench/engine_model.py``."""

from __future__ import annotations

import pytest
import torch

from engine_model import (
    SPLITTING_OPS,
    EngineLlama,
    build_model,
    float32_reference,
    fused_twin,
    make_batch,
    mark_static_metadata,
    tiny,
)

CFG = tiny()
MAX_SEQS, MAX_LEN = 4, 64
FUSED_OPS = ("rms_norm", "fused_add_rms_norm_", "linear_silu_and_mul", "rotary_embedding")


def _model(seed: int = 0) -> EngineLlama:
    model = build_model(CFG, seed=seed)
    model.allocate_kv_cache(MAX_SEQS, MAX_LEN)
    return model


def _batch(kind: str, size: int, context: int = 0, num_seqs: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    return make_batch(CFG, kind, size, context, num_seqs=num_seqs, max_len=MAX_LEN, seed=seed)


def _missing_fused_ops() -> list[str]:
    import fxrewrite.runtime.ops  # noqa: F401

    return [name for name in FUSED_OPS if not hasattr(torch.ops.fxr, name)]


def test_decode_after_prefill_equals_longer_prefill() -> None:
    """Decode of token t after a prefill of t-1 tokens == prefill of t tokens at its last row."""
    model = _model()
    full = _batch("prefill", 10)
    expected = model(**full)[-1]

    head = _batch("prefill", 9)
    head["input_ids"] = full["input_ids"][:9]
    model(**head)
    step = _batch("decode", 1, context=9)
    step["input_ids"] = full["input_ids"][9:]
    torch.testing.assert_close(model(**step)[0], expected, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_equals_one_prefill() -> None:
    """Prefill of 4 tokens on top of 6 cached ones == one prefill of 10 (causal offset mask)."""
    model = _model()
    full = _batch("prefill", 10)
    expected = model(**full)[6:]
    model(**{**_batch("prefill", 6), "input_ids": full["input_ids"][:6]})
    chunk = {**_batch("prefill", 4, context=6), "input_ids": full["input_ids"][6:]}
    torch.testing.assert_close(model(**chunk), expected, rtol=1e-5, atol=1e-5)


def test_batched_decode_equals_single_sequences() -> None:
    """Three sequences prefilled together (the host-loop path), then decoded together (the
    batched masked path), give what each sequence gives alone."""
    model = _model()
    prefill = _batch("prefill", 12, num_seqs=3)
    decode = _batch("decode", 3, context=4, seed=1)
    together = model(**prefill)
    stepped = model(**decode)
    for row in range(3):
        alone = _model()
        ids = torch.cat([prefill["input_ids"][4 * row : 4 * row + 4], decode["input_ids"][row : row + 1]])
        out = alone(**{**_batch("prefill", 5), "input_ids": ids})
        torch.testing.assert_close(together[4 * row : 4 * row + 4], out[:4], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stepped[row], out[4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, size, context", [("decode", 3, 9), ("prefill", 6, 0), ("prefill", 4, 5)])
def test_attention_op_passes_opcheck(kind: str, size: int, context: int) -> None:
    """Schema, fake impl (shapes, strides, mutation) and dynamic-shape tracing of the op agree
    with its real impl: decode, prefill, and prefill on a cached prefix."""
    model = _model()
    attn = model.layers[0].self_attn
    batch = _batch(kind, size, context)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(size, CFG.num_heads, CFG.head_dim, generator=g)
    k, v = (torch.randn(size, CFG.num_kv_heads, CFG.head_dim, generator=g) for _ in range(2))
    args = (q, k, v, attn.k_cache, attn.v_cache, batch["slots"], batch["seq_lens"], batch["kv_range"])
    torch.library.opcheck(torch.ops.fxbench.attention.default, args)


def test_fused_twin_equals_plain_model() -> None:
    """The hand-fused twin shares the weights and computes the same thing (float32, tight)."""
    missing = _missing_fused_ops()
    if missing:
        pytest.skip(f"fused ops not registered yet: {missing}")
    model = _model()
    twin = fused_twin(model)
    assert twin.layers[0].mlp.gate_up_proj.weight is model.layers[0].mlp.gate_up_proj.weight
    for kind, size, context in (("prefill", 9, 0), ("decode", 3, 9)):
        batch = _batch(kind, size, context, seed=size)
        torch.testing.assert_close(twin(**batch), model(**batch), rtol=1e-6, atol=1e-6)


def test_float32_reference_runs_a_bf16_model_in_float32() -> None:
    """The block-by-block float32 reference of a bf16 model equals a float32 model holding the
    same (upcast) weights and cache, and leaves the bf16 model's cache as it was."""
    low = build_model(CFG, dtype=torch.bfloat16, seed=3)
    low.allocate_kv_cache(MAX_SEQS, MAX_LEN)
    low.fill_kv_cache_random(seed=4)
    high = _model()
    high.load_state_dict({k: v.float() for k, v in low.state_dict().items()})
    for a, b in zip(low.layers, high.layers):
        b.self_attn.k_cache.copy_(a.self_attn.k_cache)
        b.self_attn.v_cache.copy_(a.self_attn.v_cache)
    cache_before = low.layers[1].self_attn.k_cache.clone()
    batch = _batch("decode", 3, context=20)
    ref = float32_reference(low, batch)
    assert ref.dtype == torch.float32
    torch.testing.assert_close(ref, high(**batch), rtol=1e-5, atol=1e-5)
    assert torch.equal(low.layers[1].self_attn.k_cache, cache_before)
    assert low.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16


class _GraphCounter:
    """A Dynamo backend that records the graphs it gets and runs them as they are."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # noqa: ANN204
        self.graphs.append(gm)
        return gm.forward


def _free_symbols(gm: torch.fx.GraphModule) -> set[object]:
    """The symbols in the shapes of the graph's inputs."""
    symbols: set[object] = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            for size in value.shape:
                if isinstance(size, torch.SymInt):
                    symbols |= size.node.expr.free_symbols
    return symbols


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "hand-fused"])
def test_fullgraph_dynamic_capture(fused: bool) -> None:
    """One graph per shape class, no graph break, one attention op per layer, eager numerics,
    and with the metadata marked, the token count as the only dynamic dimension."""
    if fused and (missing := _missing_fused_ops()):
        pytest.skip(f"fused ops not registered yet: {missing}")
    torch._dynamo.reset()
    model = _model()
    model = fused_twin(model) if fused else model
    counter = _GraphCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for kind, size, context in (("prefill", 7, 0), ("prefill", 11, 0), ("decode", 2, 11), ("decode", 3, 11)):
        batch = mark_static_metadata(_batch(kind, size, context, seed=size))
        expected = model(**batch)
        torch.testing.assert_close(compiled(**batch), expected, rtol=1e-6, atol=1e-6)
    # one graph for single-sequence prefill, one for decode (sizes 2 and 3 share it)
    assert len(counter.graphs) == 2
    for gm in counter.graphs:
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert sum(t in SPLITTING_OPS for t in targets) == CFG.num_layers
        assert len(_free_symbols(gm)) == 1, _free_symbols(gm)
    torch._dynamo.reset()
