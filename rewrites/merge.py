"""Sibling-GEMM merging: linears that read the same input become one GEMM over concatenated weights.

    %gate = aten.linear(%x, %w_gate)              %w = get_attr[fxr_merged_0]      (w_gate ; w_up)
    %up   = aten.linear(%x, %w_up)          ->    %y = aten.linear(%x, %w)
                                                  %gate = aten.slice(%y, -1, 0, I)
                                                  %up   = aten.slice(%y, -1, I, MAX)

After this, the HF two-projection MLP ``down(silu(gate(x)) * up(x))`` has the slices that the
SiLU-and-mul rule needs, and q/k/v projections run as one GEMM. A gate and up pair merges on its
own (gate rows first) even where more linears read the same input (an MoE router and a shared
expert's gate beside a shared expert): the other siblings form a GEMM of their own.

Memory does not grow: the module's parameters are re-laid as views into the concatenated buffer
(``param.data = merged[rows]``), so the module keeps working (eager calls, ``load_state_dict``
copies in place) and the old separate storages are freed. A second compilation of the same module
finds the parameters already laid out consecutively in one buffer and reuses it. Replacing a
parameter object after compiling (``module.weight = nn.Parameter(...)``) is not seen by the
compiled graph; copy into it instead.

Block-FP8 linears (``fxr.linear_block_fp8``) that read one quantized input (the same values and
scales: after canonicalization computes their one quantization once, :mod:`fxrewrite.cse`)
merge the same way, their FP8 weights and their 128 x 128 tile scales each stacked along N (every
N a whole number of tiles); the weights may be buffers, as a block-FP8 checkpoint holds them::

    %yg = fxr.linear_block_fp8(%q, %s, %wg, %sg, f32)          %y = fxr.linear_block_fp8(%q, %s, %w, %ws, f32)
    %yu = fxr.linear_block_fp8(%q, %s, %wu, %su, f32)    ->    %yg = aten.slice(%y, -1, 0, I)
                                                               %yu = aten.slice(%y, -1, I, MAX)

so ``silu(yg) * yu`` is SiLU-and-mul of one GEMM's halves, which the block-quant activation rule
takes with the quantization of its product.

Slice nodes reuse the fake value of the linear they replace (same shape and dtype; the real
slice is a strided view of the merged output). The real parameters come from the backend, which puts each parameter placeholder's tensor in
``node.meta["fxr_param"]``.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

import torch
import torch.fx as fx

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite import meta
from fxrewrite.canonicalize import GELU, LINEAR, MUL, SILU, SLICE
from fxrewrite.report import PassResult, Site
from fxrewrite.runtime.ops.linear_block_fp8 import BLOCK

BLOCK_FP8 = torch.ops.fxr.linear_block_fp8.default


def _param(arg: object, buffers: bool = False) -> torch.Tensor | None:
    """The real tensor of a parameter placeholder (``buffers``: or of a buffer placeholder)."""
    if isinstance(arg, fx.Node) and arg.op == "placeholder":
        for key in ("fxr_param", "fxr_buffer") if buffers else ("fxr_param",):
            if isinstance(p := arg.meta.get(key), torch.Tensor):
                return p
    return None


def _group_key(lin: fx.Node) -> tuple | None:
    """Linears merge when they read the same input with parameters of one dtype, device and
    input width, all with or all without bias."""
    if len(lin.args) < 2:
        return None
    w = _param(lin.args[1])
    bias = lin.args[2] if len(lin.args) > 2 else None
    if w is None or w.dim() != 2 or (bias is not None and _param(bias) is None):
        return None
    return (lin.args[0], w.dtype, w.device, w.shape[1], bias is None)


def _block_group_key(lin: fx.Node) -> tuple | None:
    """Block-FP8 linears merge when they read the same quantized values and scales, into one
    output dtype, with weights of one dtype, device and width, each a whole number of tiles
    along N (the tile scales then stack along N as the weights do)."""
    if len(lin.args) != 5:
        return None
    w, s = _param(lin.args[2], buffers=True), _param(lin.args[3], buffers=True)
    if w is None or s is None or w.dim() != 2 or s.dim() != 2 or w.shape[0] != s.shape[0] * BLOCK:
        return None
    return (lin.args[0], lin.args[1], lin.args[4], w.dtype, w.device, w.shape[1], s.dtype, s.shape[1])


def _reusable_base(params: list[torch.Tensor]) -> torch.Tensor | None:
    """The buffer ``params`` already are consecutive row blocks of (an earlier merge), or None.

    ``param.data = merged[rows]`` leaves no ``_base`` on the parameter, so the layout is read
    from the storage: one storage, contiguous blocks end to end. The result is a new tensor over
    that storage (no copy)."""
    first = params[0]
    ptr = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for p in params:
        if p.untyped_storage().data_ptr() != ptr or not p.is_contiguous() or p.storage_offset() != offset:
            return None
        if p.shape[1:] != first.shape[1:]:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in params)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())


def _merged(params: list[torch.Tensor]) -> torch.Tensor:
    """One buffer holding ``params`` end to end along dim 0; params become views into it."""
    base = _reusable_base(params)
    if base is not None:
        return base
    with torch.no_grad():
        merged = torch.cat([p.detach() for p in params], dim=0)
        offset = 0
        for p in params:
            n = p.shape[0]
            p.data = merged[offset : offset + n]
            offset += n
    return merged


def merge_sibling_linears(gm: fx.GraphModule) -> PassResult:
    """Merge every group of sibling linears in ``gm`` (see the module docstring)."""
    result = PassResult()
    fake_mode = meta.fake_mode_of(gm.graph)
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in meta.outside_transforms(gm.graph):
        if n.op == "call_function" and n.target in _KINDS:
            key = _KINDS[n.target][0](n)
            if key is not None:
                groups[(n.target, key)].append(n)
    for (target, key), lins in groups.items():
        merged = _KINDS[target][1] if target is BLOCK_FP8 or key[4] else _KINDS[target][1] + ((2, "_bias"),)
        pairs, rest = _gated_pairs(lins)
        for group in [*pairs, rest]:
            if len(group) >= 2:
                _merge(gm, group, min(group, key=order.__getitem__), merged, fake_mode, result)
    return result


# target -> (its group key, the arguments concatenated along N with their buffers' name suffixes)
_KINDS = {LINEAR: (_group_key, ((1, ""),)), BLOCK_FP8: (_block_group_key, ((2, ""), (3, "_scale")))}


def relaid(*params: torch.Tensor) -> torch.Tensor:
    """``params`` laid end to end in one buffer, which they become views of (see the module
    docstring): how the compile cache makes a merged weight again from a new process's
    parameters."""
    return _merged(list(params))


def _gated_pairs(lins: list[fx.Node]) -> tuple[list[list[fx.Node]], list[fx.Node]]:
    """The (gate, up) pairs among sibling linears, whose outputs meet in ``act(gate) * up``
    (SiLU or GELU), and the other linears. A pair merges on its own, gate rows first, so that
    the product reads the two halves of one GEMM: the form of the gated-activation rules. A
    router or a gate scalar reading the same input (Qwen2-MoE's shared expert, its router and
    its ``shared_expert_gate``) merges apart, not in between."""
    pairs: list[list[fx.Node]] = []
    paired: set[fx.Node] = set()
    for gate in lins:
        for act in gate.users:
            if act.target not in (SILU, GELU) or len(act.users) != 1:
                continue
            mul = next(iter(act.users))
            if mul.target is not MUL:
                continue
            up = mul.args[1] if mul.args[0] is act else mul.args[0]
            if up in lins and up is not gate and not paired & {gate, up}:
                pairs.append([gate, up])
                paired |= {gate, up}
    return pairs, [n for n in lins if n not in paired]


def _merge(gm: fx.GraphModule, lins: list[fx.Node], first: fx.Node, merged: tuple[tuple[int, str], ...],
           fake_mode: object, result: PassResult) -> None:  # fmt: skip
    """One GEMM for ``lins`` (their rows in that order), placed where ``first`` (the earliest
    of them in the graph) was: ``first``'s call with each argument of ``merged`` (position, name
    suffix; the weight first) replaced by the siblings' tensors laid end to end along N."""
    weights = [_param(n.args[merged[0][0]], buffers=True) for n in lins]
    index = sum(1 for name in gm.meta.get("fxr_constants", ()) if re.fullmatch(r"fxr_merged_\d+", name))
    graph = gm.graph
    args = list(first.args) + [None] * (3 - len(first.args))  # aten.linear's absent bias: None
    with graph.inserting_before(first):
        for pos, suffix in merged:
            tensor = _merged([_param(n.args[pos], buffers=True) for n in lins])  # type: ignore[misc]
            args[pos] = meta.constant_node(gm, f"fxr_merged_{index}{suffix}", tensor, fake_mode,
                                           rebuild=(relaid, [n.args[pos] for n in lins]))  # fmt: skip
        y = graph.call_function(first.target, tuple(args))
        meta.copy_provenance(first, y)
        meta.propagate(y, fake_mode)
    offset, total = 0, sum(w.shape[0] for w in weights)  # type: ignore[union-attr]
    for lin, w in zip(lins, weights):
        rows = w.shape[0]  # type: ignore[union-attr]
        end = sys.maxsize if offset + rows == total else offset + rows
        with graph.inserting_before(lin):
            part = graph.call_function(SLICE, (y, -1, offset, end, 1))
        meta.copy_provenance(lin, part)
        # Same shape and dtype as the linear it stands for (the real slice is a strided view);
        # reusing the value saves a symbolic fake dispatch per slice.
        part.meta["example_value"] = meta.value(lin)
        lin.replace_all_uses_with(part)
        graph.erase_node(lin)
        offset += rows
    names = [meta.module_path(n) or n.name for n in lins]
    result.matches += 1
    result.sites.append(Site("merge_siblings", y.name, meta.source_line(y), " + ".join(names)))
    result.notes.append(f"merged {len(lins)} linears into one GEMM: {' + '.join(names)}")
