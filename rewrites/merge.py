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

Slice nodes reuse the fake value of the linear they replace (same shape and dtype; the real
slice is a strided view of the merged output). The real parameters come from the backend, which puts each parameter placeholder's tensor in
``node.meta["fxr_param"]``.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
import torch.fx as fx

from fxrewrite import meta
from fxrewrite.canonicalize import GELU, LINEAR, MUL, SILU, SLICE
from fxrewrite.report import PassResult, Site


def _param(arg: object) -> torch.nn.Parameter | None:
    if isinstance(arg, fx.Node) and arg.op == "placeholder":
        p = arg.meta.get("fxr_param")
        return p if isinstance(p, torch.Tensor) else None
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
        if n.op == "call_function" and n.target is LINEAR:
            key = _group_key(n)
            if key is not None:
                groups[key].append(n)
    for key, lins in groups.items():
        pairs, rest = _gated_pairs(lins)
        for group in [*pairs, rest]:
            if len(group) >= 2:
                _merge(gm, group, min(group, key=order.__getitem__), key[4], fake_mode, result)
    return result


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


def _merge(gm: fx.GraphModule, lins: list[fx.Node], first: fx.Node, no_bias: bool, fake_mode: object,
           result: PassResult) -> None:  # fmt: skip
    """One GEMM for ``lins`` (their rows in that order), placed where ``first`` (the earliest
    of them in the graph) was."""
    weights = [_param(n.args[1]) for n in lins]
    merged_w = _merged(weights)  # type: ignore[arg-type]
    merged_b = None if no_bias else _merged([_param(n.args[2]) for n in lins])  # type: ignore[misc]
    index = sum(1 for name in gm.meta.get("fxr_constants", ()) if name.startswith("fxr_merged_") and not name.endswith("_bias"))
    graph = gm.graph
    with graph.inserting_before(first):
        w = meta.constant_node(gm, f"fxr_merged_{index}", merged_w, fake_mode, rebuild=(relaid, [n.args[1] for n in lins]))
        args = [first.args[0], w]
        if merged_b is not None:
            b = meta.constant_node(gm, f"fxr_merged_{index}_bias", merged_b, fake_mode,
                                   rebuild=(relaid, [n.args[2] for n in lins]))  # fmt: skip
            args.append(b)
        y = graph.call_function(LINEAR, tuple(args) + ((None,) if merged_b is None else ()))
        meta.copy_provenance(first, y)
        meta.propagate(y, fake_mode)
    offset, total = 0, merged_w.shape[0]
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
