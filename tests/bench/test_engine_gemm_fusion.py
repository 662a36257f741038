"""The engine Llama compiled by fxrewrite in mode "full" on the GPU, with the norms and residual
adds inside its GEMMs (rewrites/linear_fused.py): four fused GEMMs per layer, and an error against
the float32 reference no larger than eager bf16's, at decode (the Triton kernels) and at prefill
(the norm kernels and cuBLAS). A narrow model of the 8B layer's proportions, so that the test
runs in seconds; bench/profile_step.py --profile measures the 8B step."""

from __future__ import annotations

import pytest
import torch

import fxrewrite
from fxrewrite.runtime import providers
from engine_model import SPLITTING_OPS, build_model, float32_reference, make_batch, mark_static_metadata, tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = tiny(num_layers=4, hidden_size=1024, intermediate_size=3584, num_heads=8, num_kv_heads=2, head_dim=128)
# per layer: qkv with its norm and RoPE, o with its add, gate_up with its norm and SiLU-and-mul,
# down with its add; each add but the last hands the next norm its squares (hand_off_norms); the
# final norm reads the last add's sum alone
FUSED = {"rms_norm_linear_rotary": CFG.num_layers, "rms_norm_linear_silu_and_mul": CFG.num_layers,
         "linear_add_rms_parts": 2 * CFG.num_layers - 1, "linear_add_": 1, "rms_norm": 1}  # fmt: skip


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(("kind", "size", "context"), [("decode", 8, 200), ("decode", 1, 50), ("prefill", 64, 0)])
def test_fused_gemms_err_no_more_than_eager_bf16(kind: str, size: int, context: int) -> None:
    torch._dynamo.reset()
    model = build_model(CFG, device="cuda", dtype=torch.bfloat16, seed=1)
    model.allocate_kv_cache(8, 512)
    model.fill_kv_cache_random(2)
    batch = mark_static_metadata(make_batch(CFG, kind, size, context, num_seqs=size if kind == "decode" else 1,
                                            max_len=512, device="cuda"))  # fmt: skip
    backend = fxrewrite.Backend(mode="full", splitting_ops=SPLITTING_OPS, capture_sizes=(1, 8, 64), progress=False,
                                gemm_fusion=True)
    step = backend.compile(model)
    with torch.no_grad():
        got = step(**batch)
        eager = model(**batch)
        ref = float32_reference(model, batch)
    assert backend.report.fused_ops() == FUSED
    served = providers.served()
    assert all(entry["fallbacks"] == {} for op, entry in served.items() if op in FUSED), served
    assert rel_err(got, ref) <= 1.02 * rel_err(eager, ref), (rel_err(got, ref), rel_err(eager, ref))
    torch._dynamo.reset()
