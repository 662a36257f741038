"""The serving-engine Llama of ``engine_model.py`` split over ``world`` ranks (tensor parallel).

Megatron's split, written with torch's functional collectives so that Dynamo captures the whole
forward as one graph (``_c10d_functional.all_reduce`` + ``wait_tensor`` in it):

    qkv_proj, gate_up_proj   column-parallel: each rank holds its heads' q, k, v rows and its
                             slice of the gate rows and of the up rows
    o_proj, down_proj        row-parallel (:class:`RowParallelLinear`): each rank multiplies its
                             slice of the columns, then ``funcol.all_reduce(y, "sum", group)``
    embedding, norms, RoPE   replicated; the KV cache holds the rank's KV heads

Per layer, as the rewriter sees it::

    embed -> [ norm -> qkv_proj -> rope -> fxbench.attention -> o_proj -> all_reduce
               -> add+norm -> gate_up_proj -> silu*mul -> down_proj -> all_reduce -> add ] x L -> norm

Each all-reduce feeds the add + RMSNorm that follows it (the next layer's input norm, or the
final norm): the sites of ``fxr.all_reduce_add_rms_norm``.

:func:`shard` builds a rank's model from the full one (same weights: the TP=2 output equals
the single-device output up to the order of the reductions); :func:`shard_kv_cache` copies the
full model's caches into it. The modules, the attention op and the batches are
``engine_model``'s own.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from engine_model import EngineLlama, ModelConfig

__all__ = ["RowParallelLinear", "local_config", "shard", "shard_kv_cache"]


class RowParallelLinear(nn.Linear):
    """``all_reduce(x @ W_r^T, "sum", group)``: this rank's columns of a linear, summed over the
    group. No bias (the engine's linears have none; a bias would be added once, after the sum)."""

    def __init__(self, in_features: int, out_features: int, group_name: str, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=False, dtype=dtype)
        self.group_name = group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(super().forward(x), "sum", self.group_name)


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """``cfg`` with one rank's share of the heads, KV heads and MLP width (each must divide)."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(cfg, name) % world:
            raise ValueError(f"{name}={getattr(cfg, name)} is not divisible by the {world} ranks")
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=cfg.num_kv_heads // world,
        intermediate_size=cfg.intermediate_size // world,
    )


def _rows(w: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of each of the row blocks ``sizes`` of ``w``, concatenated."""
    return torch.cat([part.chunk(world, dim=0)[rank] for part in w.split(sizes, dim=0)], dim=0)


def _shard_param(name: str, full: torch.Tensor, cfg: ModelConfig, rank: int, world: int) -> torch.Tensor:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if name.endswith("qkv_proj.weight"):
        return _rows(full, [q, kv, kv], rank, world)
    if name.endswith("gate_up_proj.weight"):
        return _rows(full, [cfg.intermediate_size] * 2, rank, world)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(world, dim=1)[rank]
    return full


@torch.no_grad()
def shard(full: EngineLlama, rank: int, world: int, group_name: str) -> EngineLlama:
    """Rank ``rank``'s model of ``world``, with ``full``'s weights (on ``full``'s device and
    dtype), reducing over the process group named ``group_name`` (``ProcessGroup.group_name``).

    KV caches are not copied: call ``allocate_kv_cache`` on the result (or :func:`shard_kv_cache`).
    """
    cfg = full.config
    weight = full.embed_tokens.weight
    with torch.device("meta"):
        model = EngineLlama(local_config(cfg, world), fused=full.fused, dtype=weight.dtype)
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(attn.q_size, cfg.hidden_size, group_name, weight.dtype)
            mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features, cfg.hidden_size, group_name, weight.dtype)
    model = model.to_empty(device=weight.device)
    sources = dict(full.named_parameters())
    for name, p in model.named_parameters():
        p.copy_(_shard_param(name, sources[name], cfg, rank, world))
    model.cos_sin_cache.copy_(full.cos_sin_cache)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def shard_kv_cache(full: EngineLlama, model: EngineLlama, rank: int, world: int) -> None:
    """Give ``model`` (from :func:`shard`) rank ``rank``'s KV heads of ``full``'s caches."""
    for src, dst in zip(full.layers, model.layers):
        for name in ("k_cache", "v_cache"):
            setattr(dst.self_attn, name, getattr(src.self_attn, name).chunk(world, dim=2)[rank].contiguous())
