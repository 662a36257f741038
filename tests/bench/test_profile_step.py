"""bench/profile_step.py's count of kernels per layer, on stand-in profiler events (the script
itself needs a GPU)."""

from __future__ import annotations

import types

import torch

from profile_step import kernels_per_layer


def event(name: str, us: float, device: torch.autograd.DeviceType = torch.autograd.DeviceType.CUDA) -> object:
    return types.SimpleNamespace(name=name, device_type=device, time_range=types.SimpleNamespace(elapsed_us=lambda: us))


def test_kernels_per_layer_counts_device_events_per_step_and_layer() -> None:
    """Two steps of two layers: 4 GEMMs and 2 attention kernels a layer, a final norm a step;
    the host-side events are not kernels."""
    steps, layers = 2, 2
    events = ([event("_skinny_linear_kernel", 40.0)] * (4 * layers * steps) + [event("_partial_kernel", 8.0)] * (
        2 * layers * steps) + [event("rms_norm", 2.0)] * steps + [event("cudaGraphLaunch", 5.0, torch.autograd.DeviceType.CPU)])  # fmt: skip
    text = kernels_per_layer(events, steps, layers)
    assert text.splitlines()[1] == "kernels per step: 13 (6.50 per layer over 2 layers), 0.354 ms of kernel time"
    assert "| _skinny_linear_kernel | 8 | 4.00 | 320.0 |" in text and "| rms_norm | 1 | 0.50 | 2.0 |" in text
    assert "cudaGraphLaunch" not in text


def test_the_design_chain_is_the_steps_gemms_and_attention_alone() -> None:
    """``design_chain`` runs, per layer, the qkv GEMM, the attention op (its write of the step's
    keys and values included), o, gate_up with SiLU-and-mul and down, on the model's own weights
    and caches, and nothing else: equal to the same computation in plain torch; without the
    attention, o reads q's columns of the qkv GEMM."""
    import torch.nn.functional as F
    from engine_model import _decode, build_model, make_batch, tiny
    from profile_step import design_chain

    import fxrewrite.runtime.ops  # noqa: F401  (torch.ops.fxr.*)

    cfg = tiny()
    model = build_model(cfg, dtype=torch.float32)
    model.allocate_kv_cache(4, 64)
    model.fill_kv_cache_random(0)
    batch = make_batch(cfg, "decode", 2, 10, num_seqs=2, max_len=64)
    x0 = model.embed_tokens(batch["input_ids"])

    def reference(attention: bool) -> torch.Tensor:
        x = x0
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            q, k, v = F.linear(x, a.qkv_proj.weight).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            out = q
            if attention:
                kv = (k.view(-1, a.num_kv_heads, a.head_dim), v.view(-1, a.num_kv_heads, a.head_dim))
                for cache, new in zip((a.k_cache, a.v_cache), kv):
                    cache.view(-1, a.num_kv_heads, a.head_dim)[batch["slots"]] = new
                out = _decode(q.view(-1, a.num_heads, a.head_dim), a.k_cache, a.v_cache, batch["seq_lens"],
                              batch["kv_range"]).reshape(-1, a.q_size)  # fmt: skip
            gate, up = F.linear(F.linear(out, a.o_proj.weight), mlp.gate_up_proj.weight).chunk(2, dim=-1)
            x = F.linear(F.silu(gate) * up, mlp.down_proj.weight)
        return x

    with torch.no_grad():
        for attention in (True, False):
            got = design_chain(model, batch, attention=attention)()
            torch.testing.assert_close(got, reference(attention), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(design_chain(model, batch)(), design_chain(model, batch, attention=False)())
        seen: list[object] = []  # a probe's hook: once a layer, the chain's result unchanged
        torch.testing.assert_close(design_chain(model, batch, before_attention=seen.append)(), reference(True),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
        assert seen == list(model.layers)
