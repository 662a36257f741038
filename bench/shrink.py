"""A transformers family at a tiny shape: its default config shrunk (:func:`shrunk_config`) and its
causal LM built from it (:func:`build`). bench/coverage.py sweeps every family this way; other
scripts build one at their own :class:`Shape`.

The default config is rebuilt through its own constructor with new values for the fields it
declares, so that what its ``__post_init__`` derives follows the new sizes (MLA's ``qk_head_dim``,
Zamba2's ``mamba_headdim``, BailingHybrid's linear-attention heads). The new values:

* sizes by field name (:func:`_sizes`), per-layer lists of sizes too, and sizes that scale with
  the hidden size (:data:`_HIDDEN_SCALED`) at the same ratio;
* the relations the default config holds, kept: MLA's ``head_dim`` is its rotary part
  (``qk_rope_head_dim``, or that over ``partial_rotary_factor``) and ``qk_head_dim`` is
  nope + rope; a rotary dimension (``rotary_dim``) is the same share of the head; an SSM's
  heads * head dim is its inner width (``expand * hidden``, ``mamba_d_ssm``); SSM groups divide
  its heads;
* one layer of each kind (:func:`_kept_layers`): a layer's kind is its entry in every per-layer
  list and index list, its per-layer overrides (a heterogeneous config's ``per_layer_config``),
  the part of the stack it lies in (the first ``first_k_dense_replace``, the last
  ``num_kv_shared_layers``, Dory's input / recurrent / output layers); the layer count and all
  of those follow the kept layers (two of each kind where weights are tied across a kind's
  layers: Zamba's shared transformer);
* token ids inside the vocabulary, required sizes the default leaves ``None`` filled, the model a
  decoder (``is_decoder``) without a cache; sub-configs shrunk alike;
* where a default config cannot be made consistent by these rules, the fields :data:`EXTRA`
  gives that family (each with why).

:func:`build` builds the family's own causal-LM class, from the part of the config that class
takes (Llama 4's text config of a multimodal config); a ``...ForConditionalGeneration`` wrapper
whose text decoder has an entry of its own is refused naming that entry, one without builds the
causal LM of its text config.

For example (deepseek_v3)::

    hidden_size 7168, 128 heads, qk_nope_head_dim 128 + qk_rope_head_dim 64 (head_dim 64),
    61 layers of which the first 3 dense, 256 experts, 8 per token in 4 of 8 groups
    -> hidden_size 64, 4 heads, qk_nope_head_dim 16 + qk_rope_head_dim 8 (head_dim 8),
    2 layers: 1 dense, 1 MoE, 8 experts, 2 per token in 2 of 4 groups
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    """The shrunk shape every family is built at (``hidden`` = ``heads * head_dim``)."""

    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256
    experts: int = 8
    top_k: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = Shape()


def _sizes(shape: Shape) -> dict[str, int]:
    """Config fields, by name, and the value of each at ``shape``. Fields a config lacks are not
    added. Names that several families share; a family-specific name is still a size."""
    HIDDEN, HEADS, HEAD_DIM, VOCAB, EXPERTS = shape.hidden, shape.heads, shape.head_dim, shape.vocab, shape.experts
    return {
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "dim": HIDDEN, "embed_dim": HIDDEN,
    "word_embed_proj_dim": HIDDEN, "hidden_dim": HIDDEN,
    "intermediate_size": 2 * HIDDEN, "ffn_hidden_size": 2 * HIDDEN, "n_inner": 2 * HIDDEN, "ffn_dim": 2 * HIDDEN,
    "intermediate_size_mlp": 2 * HIDDEN, "decoder_ffn_dim": 2 * HIDDEN, "encoder_ffn_dim": 2 * HIDDEN,
    "dff": 2 * HIDDEN, "dim_ff": 2 * HIDDEN, "emb_dim": HIDDEN,
    "moe_intermediate_size": HIDDEN // 2, "shared_expert_intermediate_size": HIDDEN, "expert_intermediate_size": HIDDEN // 2,
    "expert_ffn_hidden_size": HIDDEN // 2, "shared_experts_intermediate_size": HIDDEN, "zero_expert_num": EXPERTS // 2,
    "moe_shared_expert_intermediate_size": HIDDEN,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "decoder_attention_heads": HEADS, "encoder_attention_heads": HEADS,
    "num_decoder_attention_heads": HEADS, "num_encoder_attention_heads": HEADS,
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "attention_head_dim": HEAD_DIM, "attention_head_size": HEAD_DIM,
    "d_head": HEAD_DIM, "dim_head": HEAD_DIM, "swa_head_dim": HEAD_DIM, "swa_num_attention_heads": HEADS,
    "vocab_size": VOCAB, "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256,
    "num_experts": EXPERTS, "n_routed_experts": EXPERTS, "num_local_experts": EXPERTS, "moe_num_experts": EXPERTS,
    # multi-head latent attention (DeepSeek) and its sparse indexer
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 24, "index_head_dim": 16, "index_n_heads": 2, "o_lora_rank": 16,
    # linear attention and state-space layers
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 16, "linear_num_heads": HEADS,
    "mamba_dt_rank": 8, "time_step_rank": 8, "mamba_d_head": 16, "mamba_n_heads": 8, "mamba_head_dim": 16,
    "mamba_num_heads": 8, "ssm_state_size": 16, "mamba_d_state": 16, "state_size": 16,
    # per-layer inputs (Gemma 3n), the global model of a byte-level one (BLT), audio codebooks (MusicGen)
    "vocab_size_per_layer_input": VOCAB, "hidden_size_global": HIDDEN, "indexer_head_dim": 16, "indexer_n_heads": 2,
    "num_codebooks": 1,
    "attention_chunk_size": 256, "sliding_window": 256, "attention_window_size": 256, "window_size": 256,
    }  # fmt: skip


# Sizes given as a multiple of the hidden size, scaled with it (Zamba's attention reads the hidden
# state next to the embeddings: twice the hidden size; ELECTRA's embeddings are half of it).
_HIDDEN_SCALED = ("attention_hidden_size", "embedding_dim", "embedding_size", "lru_width", "ple_embed_dim", "d_inner",
                  "feed_forward_size", "dense_intermediate_size", "shared_intermediate_size", "input_embedding_size",
                  "pronunciation_embed_dim", "shape_embed_dim", "hidden_size_per_layer_input", "adapter_in_dim",
                  "hc_lowrank", "laurel_rank", "adapter_rank", "ext_pw_out_channel", "depthwise_separable_out_channel",
                  "nemo_conv_channels")  # fmt: skip
# Sizes a default config may leave None that its model reads as numbers (Nemotron's KV heads,
# Ministral's head size, Dots1's experts), and the value each gets.
_REQUIRED = {"head_dim": "head_dim", "n_routed_experts": "experts", "num_experts_per_tok": "top_k",
             "n_shared_experts": 1}  # fmt: skip
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim")
_HEADS = ("num_attention_heads", "n_head", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "swa_num_key_value_heads")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers")
# Other stacks (an encoder the causal LM does not build, xLSTM's blocks): at most 2 layers.
_OTHER_LAYERS = ("num_encoder_layers", "encoder_layers", "num_blocks", "num_layers_per_stack")
_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k", "moe_k", "num_experts_per_token")
# Periodic layer patterns: every ``period``-th layer from ``offset`` is of the other kind
# (Jamba's attention and experts): period 2, offset 1 keeps both kinds in two layers.
_PERIODS = ("attn_layer_period", "expert_layer_period", "decoder_sparse_step", "moe_layer_freq",
            "interleave_moe_layer_step", "no_rope_layer_interval", "moe_every_k_layers")  # fmt: skip
_OFFSETS = ("attn_layer_offset", "expert_layer_offset")
# Counts of layers at the start (dense before MoE) and at the end (Gemma 3n's layers that reuse an
# earlier layer's KV cache) of the stack: each layer's side of the count is part of its kind.
_FIRST = ("first_k_dense_replace", "first_dense_layers", "num_dense_layers", "moe_layer_start_index")
_LAST = ("num_kv_shared_layers",)
_ROTARY_DIMS = ("rotary_dim", "rotary_emb_dim", "rope_dim")
# State-space layers: (heads, head dim) pairs whose product is the inner width, expand * hidden.
_SSM_HEADS = (("num_heads", "head_dim"), ("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"))
_SSM_EXPAND = ("expand", "mamba_expand")
# Groups of heads (an SSM's, DeepSeek-V4's output projection's): 2, which divides the heads.
_GROUPS = ("n_groups", "mamba_n_groups", "mamba_ngroups", "o_groups")

_QSA = {"indexer_n_heads": 32, "indexer_kv_heads": 1, "indexer_head_dim": 256, "indexer_budget": 2048,
        "indexer_compress_ratio": 4}  # fmt: skip
# Per family, fields its default config needs that no generic rule can give, each with why.
# Applied to the default config before it is shrunk (a nested dict: that sub-config's fields).
EXTRA: dict[str, dict[str, Any]] = {
    # The model reads ``attn_config.rope_theta``, which DbrxAttentionConfig does not declare, and
    # clamps q, k, v by ``clip_qkv`` unconditionally (torch refuses a clamp without bounds, the
    # default's None): DBRX's checkpoints carry both (500000, 8).
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    # The model reads rotary parameters per layer type, and the default gives none.
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # No default layer pattern (``layer_types`` None) and the model reads one per layer; the kinds
    # its checkpoints mix are short convolutions and full attention.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * 16},
    # Every attention layer is an indexed one (QSA) and the default leaves the indexer's sizes None,
    # which the model divides; checkpoints give them (one key head, as validation requires).
    "qwen4_exp_text": _QSA,
    "qwen4_exp": {"text_config": _QSA},
}


_ABSENT = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fields(cfg: Any) -> dict[str, Any]:
    """The init fields ``cfg`` declares, by name, and their values (through ``attribute_map``)."""
    get = getattr(cfg, "_getattr_without_heterogeneous_validation", None) or (lambda k, d: getattr(cfg, k, d))
    out = {}
    for f in dataclasses.fields(cfg):
        v = get(f.name, _ABSENT)
        if f.init and v is not _ABSENT:
            out[f.name] = v
    return out


def _first(vals: dict[str, Any], names: tuple[str, ...]) -> tuple[str, Any] | None:
    for name in names:
        if _is_int(vals.get(name)):
            return name, vals[name]
    return None


def _is_index_list(v: Any, n: int) -> bool:
    return bool(v) and all(_is_int(i) for i in v) and list(v) == sorted(set(v)) \
        and max(v) < n and (len(v) < n or list(v) == list(range(n)))  # fmt: skip


def _layer_lists(cfg: Any, n: int) -> dict[str, Any]:
    """The per-layer lists of ``cfg`` (fields and what ``__post_init__`` derived), by name."""
    return {k: v for k, v in vars(cfg).items() if isinstance(v, (list, tuple)) and len(v) == n and n > 2
            and not _is_index_list(v, n)}  # fmt: skip


def _overrides(cfg: Any) -> dict[int, dict[str, Any]]:
    """A heterogeneous config's per-layer overrides (``per_layer_config``), by layer index."""
    spec = vars(cfg).get("_heterogeneity_spec")
    return dict(spec.per_layer_overrides) if spec is not None else {}


def _segments(vals: dict[str, Any], n: int) -> list[str]:
    """Counts of layers that split the stack into consecutive parts, in the order the config
    declares them (Dory's ``n_input_layers``, ``n_recurrent_layers``, ``n_output_layers``)."""
    names = [k for k, v in vals.items() if _is_int(v) and v > 0 and k.endswith("_layers")
             and k.split("_")[0] in ("n", "num") and k not in _LAYERS + _OTHER_LAYERS + _FIRST + _LAST]  # fmt: skip
    return names if len(names) > 1 and sum(vals[k] for k in names) == n else []


def _segment_of(vals: dict[str, Any], segments: list[str], i: int) -> int:
    start = 0
    for j, k in enumerate(segments):
        start += vals[k]
        if i < start:
            return j
    return len(segments)


def _kept_layers(cfg: Any, n: int, per_kind: int = 1) -> list[int]:
    """Which of ``n`` layers to keep: the first ``per_kind`` of each kind, at least two. A layer's
    kind: its entry in every per-layer list, whether an index list (Mllama's cross-attention layers)
    holds it, its per-layer overrides, whether it is among the first
    ``first_k_dense_replace`` (any of :data:`_FIRST`) and among the last ``num_kv_shared_layers``
    (:data:`_LAST`), and which of the stack's parts (:func:`_segments`) it is in."""
    vals = _fields(cfg)
    segments = _segments(vals, n)
    lists = list(_layer_lists(cfg, n).values()) + [[_segment_of(vals, segments, i) for i in range(n)]]
    lists += [[i in v for i in range(n)] for v in vars(cfg).values() if isinstance(v, (list, tuple)) and n > 2
              and _is_index_list(v, n)]  # fmt: skip
    overrides = _overrides(cfg)
    firsts = [v for k, v in vals.items() if k in _FIRST and _is_int(v)]
    lasts = [v for k, v in vals.items() if k in _LAST and _is_int(v)]
    seen: dict[Any, list[int]] = {}
    for i in range(n):
        kind = tuple(repr(v[i]) for v in lists) + (repr(sorted(overrides.get(i, {}).items())),) \
            + tuple(i < k for k in firsts) + tuple(i >= n - k for k in lasts)  # fmt: skip
        if len(seen.setdefault(kind, [])) < per_kind:
            seen[kind].append(i)
    keep = sorted(i for layers in seen.values() for i in layers)
    for i in range(n):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep = sorted(keep + [i])
    return keep


def _partial_rotary(cfg: Any) -> float:
    """The share of each head that rotates (``partial_rotary_factor``, in the config or in its
    ``rope_parameters``, per layer type or not); 1 when the config names none."""
    v = getattr(cfg, "partial_rotary_factor", None)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    rope = getattr(cfg, "rope_parameters", None)
    stack = [rope] if isinstance(rope, dict) else []
    while stack:
        d = stack.pop()
        if isinstance(d.get("partial_rotary_factor"), (int, float)):
            return float(d["partial_rotary_factor"])
        stack += [v for v in d.values() if isinstance(v, dict)]
    return 1.0


def _new_values(cfg: Any, shape: Shape, per_kind: int = 1) -> dict[str, Any]:
    """The fields of ``cfg`` at ``shape``, by name (see the module docstring)."""
    old = _fields(cfg)
    new = dict(old)
    sizes = _sizes(shape)
    required = {k: getattr(shape, v) if isinstance(v, str) else v for k, v in _REQUIRED.items()}
    for name, value in sizes.items():
        v = old.get(name, _ABSENT)
        if (_is_int(v) and v > 0) or (v is None and name in required):  # a size of 0: the part is off
            new[name] = value
        elif isinstance(v, (list, tuple)) and v and all(_is_int(x) for x in v):  # a size per layer
            new[name] = type(v)(value for _ in v)
    for name, value in required.items():
        if name in old and old[name] is None and name not in sizes:
            new[name] = value
    if old.get("default_language") is None and old.get("languages"):  # X-MOD: no adapter picked, none runs
        new["default_language"] = old["languages"][0]
    hidden = _first(old, _HIDDEN)
    for name in _HIDDEN_SCALED:
        if hidden and _is_int(old.get(name)) and old[name] > 0:
            new[name] = max(1, round(old[name] * shape.hidden / hidden[1]))
    for name, v in old.items():  # other vocabularies (BLT's byte-group hashes, Marian's decoder's)
        if "vocab" in name and name not in sizes and _is_int(v) and v > shape.vocab:
            new[name] = shape.vocab
    heads = _first(old, _HEADS)
    for name in _KV_HEADS:
        v = old.get(name, _ABSENT)
        if _is_int(v) or v is None:
            new[name] = shape.heads if heads and v == heads[1] else (1 if v == 1 else shape.kv_heads)
    for name in _TOP_K:
        if _is_int(old.get(name)):
            new[name] = min(old[name], shape.top_k)
    if _is_int(old.get("n_group")) and old["n_group"] > 1:  # group-limited routing: 4 groups, 2 picked
        new["n_group"], new["topk_group"] = 4, min(2, old.get("topk_group") or 2)
    for name in _PERIODS:
        if _is_int(old.get(name)) and old[name] > 1:
            new[name] = 2
    for name in _OFFSETS:
        if _is_int(old.get(name)):
            new[name] = 1
    _keep_relations(cfg, old, new, shape)
    for name, v in old.items():
        if name.endswith("token_id") and _is_int(v) and v >= shape.vocab:
            new[name] = shape.vocab - 1
        elif name.endswith("token_id") and isinstance(v, list):
            new[name] = [min(t, shape.vocab - 1) if _is_int(t) else t for t in v]
    _shrink_layers(cfg, old, new, shape, per_kind)
    if "is_decoder" in old:
        new["is_decoder"] = True
    if "use_cache" in old:
        new["use_cache"] = False
    return new


def _keep_relations(cfg: Any, old: dict[str, Any], new: dict[str, Any], shape: Shape) -> None:
    """Derived sizes the default config holds, held again at the new sizes (see the module docstring)."""
    rope = old.get("qk_rope_head_dim")
    if _is_int(rope) and "head_dim" in old:  # multi-head latent attention
        head, share = vars(cfg).get("head_dim"), _partial_rotary(cfg)
        if head == rope:
            new["head_dim"] = new["qk_rope_head_dim"]
        elif _is_int(head) and head * share == rope:
            new["head_dim"] = round(new["qk_rope_head_dim"] / share)
    if _is_int(rope) and "qk_head_dim" in old:
        new["qk_head_dim"] = new["qk_nope_head_dim"] + new["qk_rope_head_dim"]
    hidden, heads = _first(old, _HIDDEN), _first(old, _HEADS)
    old_head = old["head_dim"] if _is_int(old.get("head_dim")) else None
    if old_head is None and hidden and heads:
        old_head = hidden[1] // heads[1]
    new_head = new["head_dim"] if _is_int(new.get("head_dim")) else shape.head_dim
    for name in _ROTARY_DIMS:
        if _is_int(old.get(name)) and old_head:
            new[name] = max(2, 2 * round(old[name] * new_head / old_head / 2))
    # Zamba: attention wider than the hidden state
    attn, attn_head = old.get("attention_hidden_size"), old.get("attention_head_dim")
    if heads and _is_int(attn) and _is_int(attn_head) and attn_head * heads[1] == attn:
        new["attention_head_dim"] = new["attention_hidden_size"] // new[heads[0]]
    expand = _first(old, _SSM_EXPAND)
    if expand and hidden:
        d_ssm = old.get("mamba_d_ssm")
        inner_old = d_ssm if _is_int(d_ssm) else expand[1] * hidden[1]
        inner = expand[1] * shape.hidden
        for h, d in _SSM_HEADS:
            if _is_int(old.get(h)) and _is_int(old.get(d)) and old[h] * old[d] == inner_old:
                new[d] = inner // new[h]
                if _is_int(d_ssm):
                    new["mamba_d_ssm"] = inner
    for name in _GROUPS:
        if _is_int(old.get(name)) and old[name] > 1:
            new[name] = 2
    positions = _first(old, ("max_position_embeddings",))
    for name, v in old.items():  # factors of a size (Reformer's axial position embeddings)
        if not (isinstance(v, (list, tuple)) and len(v) > 1 and all(_is_int(x) and x > 0 for x in v)):
            continue
        if hidden and sum(v) == hidden[1] and all(x * shape.hidden % hidden[1] == 0 for x in v):
            new[name] = type(v)(x * shape.hidden // hidden[1] for x in v)
        elif positions and math.prod(v) == positions[1]:
            root = round(new["max_position_embeddings"] ** (1 / len(v)))
            if root ** len(v) == new["max_position_embeddings"]:
                new[name] = type(v)(root for _ in v)


def _shrink_layers(cfg: Any, old: dict[str, Any], new: dict[str, Any], shape: Shape, per_kind: int) -> None:
    """Keep one layer of each kind (:func:`_kept_layers`): the layer count, per-layer lists, index
    lists, counts of first and last layers and per-layer overrides follow the kept layers."""
    for name in _OTHER_LAYERS:
        if _is_int(old.get(name)):
            new[name] = min(old[name], 2)
    found = _first(old, _LAYERS) or _first(vars(cfg), ("num_hidden_layers",))  # Reformer's: its layer list's length
    if found is None:
        return
    name, n = found
    keep = _kept_layers(cfg, n, per_kind)
    if name in old:
        new[name] = len(keep)
    per_layer = _layer_lists(cfg, n)
    for k, v in old.items():
        if k in per_layer:
            new[k] = type(v)(new.get(k, v)[i] for i in keep)
        elif isinstance(v, (list, tuple)) and n > 2 and _is_index_list(v, n):
            new[k] = type(v)(j for j, i in enumerate(keep) if i in v)
        elif k in _FIRST and _is_int(v):
            new[k] = sum(1 for i in keep if i < v)
        elif k in _LAST and _is_int(v):
            new[k] = sum(1 for i in keep if i >= n - v)
        elif _run_length(v) is not None and len(_run_length(v)) == n:  # GPT-Neo's [[["global", "local"], 12]]
            new[k] = type(v)([[[_run_length(v)[i] for i in keep], 1]])
    segments = _segments(old, n)
    for j, k in enumerate(segments):
        new[k] = sum(1 for i in keep if _segment_of(old, segments, i) == j)
    if vars(cfg).get("_heterogeneity_spec") is not None:
        overrides = _overrides(cfg)
        new["per_layer_config"] = {j: {a: _scaled(v, old.get(a), new.get(a)) for a, v in overrides[i].items()}
                                   for j, i in enumerate(keep) if i in overrides}  # fmt: skip


def _run_length(v: Any) -> list[Any] | None:
    """A per-layer list given as (pattern, repeats) pairs, expanded; None for anything else."""
    if not isinstance(v, (list, tuple)) or not v:
        return None
    if not all(isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], (list, tuple)) and _is_int(p[1])
               for p in v):  # fmt: skip
        return None
    return [t for pattern, repeats in v for _ in range(repeats) for t in pattern]


def _scaled(value: Any, old: Any, new: Any) -> Any:
    """A per-layer override of a field, at the new size: scaled as the field was (Gemma 4's global
    layers' head size, twice the others'); anything else as it was."""
    if _is_int(value) and _is_int(old) and _is_int(new) and old > 0:
        return max(1, round(value * new / old))
    return value


def _rebuilt(cfg: Any, shape: Shape, extra: dict[str, Any], per_kind: int) -> Any:
    """``cfg`` at ``shape``: its class called with the new values of its fields, sub-configs rebuilt
    first; what :data:`EXTRA` gave that the class does not declare is carried over."""
    values = _new_values(cfg, shape, per_kind)
    for key, v in extra.items():
        if key not in values and not isinstance(v, dict):
            values[key] = v
    for key in type(cfg).sub_configs:
        sub = getattr(cfg, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            values[key] = _rebuilt(sub, shape, extra.get(key, {}), per_kind)
    return type(cfg)(**values)


def _with_extra(cls: type, extra: dict[str, Any]) -> Any:
    """``cls``'s default config with the fields of :data:`EXTRA` (a nested dict: a sub-config's,
    over that sub-config's defaults)."""
    kwargs = {}
    for k, v in extra.items():
        # transformers >= 5.20 keeps a family's own sub-config defaults there; before, a sub-config
        # given as a dict takes its class's defaults
        spec = getattr(cls, "sub_configs_defaults", {}).get(k) if isinstance(v, dict) else None
        kwargs[k] = {**spec.init_kwargs, **v} if spec is not None else v
    return cls(**kwargs)


def shrunk_config(family: str, shape: Shape = TINY, per_kind: int = 1) -> Any:
    """The family's default config at ``shape`` (sub-configs shrunk too), with ``per_kind`` layers
    of each kind."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    extra = EXTRA.get(family, {})
    return _rebuilt(_with_extra(CONFIG_MAPPING[family], extra), shape, extra, per_kind)


def _decoder_part(family: str, cls: type) -> tuple[type, Any, dict[str, Any]]:
    """The causal LM class to build, the default config it takes and that config's :data:`EXTRA`:
    the family's own class and config, or the sub-config its class takes (Llama 4's text config);
    for a multimodal wrapper, the causal LM of its text config, unless that text decoder has an
    entry of its own (then it is swept there)."""
    import importlib
    import inspect

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as MAPPING

    if "shared_kv_states" in inspect.signature(cls.forward).parameters:
        raise NotImplementedError(f"{cls.__name__} is a draft model: it runs on its target model's KV states "
                                  "(shared_kv_states), not on input ids alone")  # fmt: skip
    extra = EXTRA.get(family, {})
    cfg = _with_extra(CONFIG_MAPPING[family], extra)
    if "ConditionalGeneration" not in cls.__name__:
        for key in type(cfg).sub_configs:
            if not isinstance(cfg, cls.config_class) and isinstance(getattr(cfg, key, None), cls.config_class):
                return cls, getattr(cfg, key), extra.get(key, {})
        return cls, cfg, extra  # or a config of another class with the same fields (Sarvam-MLA's, for DeepSeek-V3)
    key = next((k for k in type(cfg).sub_configs if getattr(cfg, k, None) is cfg.get_text_config(decoder=True)), None)
    if key is None:
        raise NotImplementedError(f"{cls.__name__} is a multimodal model without a text config")
    text = getattr(cfg, key)
    if text.model_type in MAPPING and text.model_type != family:
        raise NotImplementedError(f"{cls.__name__} is a multimodal wrapper; its text decoder is the "
                                  f"'{text.model_type}' entry")  # fmt: skip
    module = importlib.import_module(cls.__module__)
    for name in dir(module):
        lm = getattr(module, name)
        if name.endswith("ForCausalLM") and getattr(lm, "config_class", None) is type(text):
            return lm, text, extra.get(key, {})
    raise NotImplementedError(f"{cls.__name__} is a multimodal model whose text decoder has no causal LM class")


def build(family: str, shape: Shape = TINY, seed: int = 0,
          kinds: tuple[str, ...] | None = None) -> tuple[torch.nn.Module, str]:  # fmt: skip
    """The family's causal LM at ``shape``, float32, eval mode, and the attention it runs
    (SDPA where the family has it, else its eager attention). Only the part built is shrunk (a
    multimodal config's text part, not its vision tower). ``kinds``: only the layers of these
    kinds (``layer_types``), e.g. a hybrid model's attention layers for a test of its attention."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls, part, extra = _decoder_part(family, getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]))
    if kinds is not None:
        cfg = _rebuilt(part, shape, extra, 1)
        types = [t for t in (getattr(cfg, "layer_types", None) or ()) if t in kinds]
        if not types:
            raise ValueError(f"{family}: no layer of the kinds {kinds} in {getattr(cfg, 'layer_types', None)}")
        cfg.layer_types, cfg.num_hidden_layers = types, len(types)
        return _build(cls, cfg, seed)
    try:
        return _build(cls, _rebuilt(part, shape, extra, 1), seed)
    except ValueError as e:
        if "tie_weights_keys" not in str(e):
            raise
    # weights tied across the layers of a kind (Zamba's shared transformer): two layers of each kind
    return _build(cls, _rebuilt(part, shape, extra, 2), seed)


def _build(cls: type, cfg: Any, seed: int) -> tuple[torch.nn.Module, str]:
    last: Exception | None = None
    for attn in ("sdpa", "eager"):
        torch.manual_seed(seed)
        try:
            return cls._from_config(copy.deepcopy(cfg), attn_implementation=attn).eval(), attn
        except (ValueError, ImportError) as e:
            if "attn" not in str(e).lower() and "attention" not in str(e).lower():
                raise
            last = e
    assert last is not None
    raise last
