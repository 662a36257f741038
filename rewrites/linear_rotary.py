"""RoPE in the epilogue of the GEMM that produces q and k (pass ``fuse_gemm_rotary``).

After ``fold_rotary`` a layer whose merged qkv projection took its norm (``fuse_gemm_norm``)
reads::

    %y = fxr.rms_norm_linear(%x, %g, eps, %w_qkv)
    %q = aten.slice(%y, -1, 0, Q) -> view [N, Hq, D];  %k = aten.slice(%y, -1, Q, Q + K) -> view [N, Hk, D]
    %qk = fxr.rotary_embedding(%pos, %q, %k, %cache, True);  %q_rot = %qk[0];  %k_rot = %qk[1]
    %v = aten.slice(%y, -1, Q + K, end) -> view

and becomes::

    %y = fxr.rms_norm_linear_rotary(%x, %g, eps, %w_qkv, None, False, %pos, %cache, Q + K)
    (%q, %k and %v the same views of %y; the readers of %q_rot and %k_rot read %q and %k)

A graph pass, not a rule: the site is a GEMM and the views of its output that lead to the
rotation, and what it proves is about every reader of that output. It takes a site where q and
k are adjacent column slices from column 0 of the GEMM's output (in either order), viewed as heads of the
cache's width (the whole head rotates, NeoX halves), read only through those views by the
rotation (and by size queries), and every other reader of the output reads columns after k
(v): they see the same values after the fusion, and the rotation's readers read views of the
GEMM's output instead of fresh tensors (strided rows, as an in-place rotation leaves them).
The positions and the cache are defined before the GEMM. Elsewhere the rotation stays its own
kernel, and the report says why.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite import meta
from fxrewrite.passes import SiteFilter
from fxrewrite.report import NearMiss, PassResult, Rejected, Site
from fxrewrite.rewrite import dead_code
from fxrewrite.runtime import providers

RULE = "rms_norm_linear_rotary"
GEMM = torch.ops.fxr.rms_norm_linear.default
FUSED = torch.ops.fxr.rms_norm_linear_rotary.default
ROTARY = torch.ops.fxr.rotary_embedding.default
SLICE = torch.ops.aten.slice.Tensor
VIEWS = {torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten.unflatten.int, "view", "reshape"}
PERMUTES = {torch.ops.aten.permute.default, torch.ops.aten.transpose.int, "permute", "transpose"}
SIZE_QUERIES = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, "size", "dim"}


class _Miss(Exception):
    """Why a rotation does not fuse; ``near``: it reads a GEMM that took its norm (a near miss
    worth reporting), not any other tensor (every rotation in a graph without such GEMMs)."""

    def __init__(self, reason: str, at: fx.Node, near: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.at, self.near = reason, at, near


def _is(n: Any, targets: set[Any]) -> bool:
    return isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and n.target in targets


def _dims(n: fx.Node) -> list[int] | None:
    """The permutation a permute or transpose node applies (None where its rank is unknown)."""
    t = meta.tensor(n.args[0])
    if t is None:
        return None
    rank = t.dim()
    if n.target in ("transpose", torch.ops.aten.transpose.int):
        a, b = (d % rank for d in n.args[1:3])
        dims = list(range(rank))
        dims[a], dims[b] = b, a
        return dims
    dims = n.args[1:] if n.target == "permute" and not isinstance(n.args[1], (list, tuple)) else n.args[1]
    return [d % rank for d in dims]


def _identity(permutes: list[fx.Node]) -> bool:
    """Adjacent permutes (``permutes``: the last applied first) that move nothing together (a
    transpose a rotation's folding undid: its q ``[B, H, S, D]`` back to ``[B, S, H, D]``)."""
    order: list[int] | None = None
    for n in reversed(permutes):
        dims = _dims(n)
        if dims is None:
            return False
        order = dims if order is None else [order[d] for d in dims]
    return order is None or order == sorted(order)


def _columns(x: fx.Node) -> tuple[fx.Node, int, int, list[fx.Node]]:
    """``x`` as reshapes of a column slice ``y[..., start:end]`` of a GEMM's output ``y`` (and
    permutes that undo one another): (the GEMM node, start, end, the slice and the nodes from
    the slice on)."""
    chain: list[fx.Node] = []
    run: list[fx.Node] = []  # adjacent permutes
    n = x
    while _is(n, VIEWS | PERMUTES):
        if _is(n, PERMUTES):
            run.append(n)
        elif run:
            if not _identity(run):
                raise _Miss(f"`{run[0].name}` moves dims of q or k", run[0], near=False)
            run = []
        chain.append(n)
        n = n.args[0]
    if run and not _identity(run):
        raise _Miss(f"`{run[0].name}` moves dims of q or k", run[0], near=False)
    if not _is(n, {SLICE}):
        raise _Miss(f"`{x.name}` is not a view of a column slice", x, near=False)
    base, dim, start, end, step = n.args
    out = meta.tensor(base) if isinstance(base, fx.Node) else None
    if not (isinstance(base, fx.Node) and base.target is GEMM):
        raise _Miss(f"`{n.name}` slices `{getattr(base, 'name', base)}`, not an fxr.rms_norm_linear", n, near=False)
    if out is None or dim not in (-1, out.dim() - 1) or step != 1 or not isinstance(start, int):
        raise _Miss(f"`{n.name}` is not a column slice of the GEMM's output", n)
    end = min(end, out.shape[-1]) if isinstance(end, int) else None
    if end is None:
        raise _Miss(f"`{n.name}` ends at a symbolic column", n)
    return base, start, end, [n, *reversed(chain)]


def _only_shape_readers(chain: list[fx.Node], rot: fx.Node) -> None:
    """Each node of a view chain is read by the next one, the rotation or a size query only."""
    allowed = {*chain[1:], rot}
    for n in chain:
        for u in n.users:
            if u not in allowed and not _is(u, SIZE_QUERIES):
                raise _Miss(f"`{n.name}` (q or k before the rotation) is also read by `{u.name}`", u)


def _site(rot: fx.Node, order: dict[fx.Node, int]) -> tuple[fx.Node, int]:
    """(the GEMM, the number of rotated columns) of a rotation that fuses, else :class:`_Miss`."""
    positions, q, k, cache, neox = rot.args
    gemm, q0, q1, q_chain = _columns(q)
    gemm_k, k0, k1, k_chain = _columns(k)
    if neox is not True:
        raise _Miss("interleaved (GPT-J) rotation: the epilogue rotates NeoX halves", rot)
    (a0, a1), (b0, b1) = sorted(((q0, q1), (k0, k1)))
    if gemm_k is not gemm or a0 != 0 or b0 != a1:
        raise _Miss(f"q [{q0}:{q1}] and k [{k0}:{k1}] are not adjacent columns from 0 of one GEMM", rot)
    rotated = b1
    qt, ct = meta.tensor(q), meta.tensor(cache)
    if qt is None or ct is None or qt.dim() != 3 or ct.dim() != 2 or qt.shape[-1] != ct.shape[-1]:
        raise _Miss("the rotation covers part of each head (partial rotary) or its shapes are unknown", rot)
    for chain in (q_chain, k_chain):
        _only_shape_readers(chain, rot)
    last = (-1, meta.tensor(gemm).dim() - 1)
    for u in gemm.users:
        if u not in (q_chain[0], k_chain[0]) and not _is(u, SIZE_QUERIES):
            if not (_is(u, {SLICE}) and isinstance(u.args[2], int) and u.args[1] in last and u.args[2] >= rotated):
                raise _Miss(f"`{u.name}` reads the GEMM's output other than past its q and k columns", u)
    late = [a for a in (positions, cache) if order[a] > order[gemm]]
    if late:
        raise _Miss(f"`{late[0].name}` is computed after the GEMM", late[0])
    if any(u.target is not operator.getitem for u in rot.users):
        raise _Miss("the rotation's outputs are read other than by index", rot)
    return gemm, rotated


def _fused_args(rot: fx.Node, gemm: fx.Node, rotated: int) -> tuple[Any, ...]:
    """``fxr.rms_norm_linear_rotary``'s arguments: the GEMM's (its defaults spelled out), the
    rotation's positions and cache, the rotated columns."""
    defaults = (None, False)  # bias, cast_last
    return (*gemm.args[:4], *(tuple(gemm.args[4:]) + defaults[len(gemm.args) - 4 :])[:2], rot.args[0], rot.args[3],
            rotated)  # fmt: skip


def _replace(graph: fx.Graph, rot: fx.Node, gemm: fx.Node, rotated: int, fake_mode: Any) -> fx.Node:
    _, q, k, _, _ = rot.args
    with graph.inserting_before(gemm):
        fused = graph.call_function(FUSED, _fused_args(rot, gemm, rotated))
    fused.meta["fxr_rule"] = RULE
    meta.copy_provenance(gemm, fused)
    meta.propagate(fused, fake_mode)
    gemm.replace_all_uses_with(fused)
    graph.erase_node(gemm)
    for u in list(rot.users):
        u.replace_all_uses_with(q if u.args[1] == 0 else k)
        graph.erase_node(u)
    graph.erase_node(rot)
    return fused


def fuse_gemm_rotary(gm: fx.GraphModule, site_filter: SiteFilter | None = None) -> PassResult:
    """Give each ``fxr.rotary_embedding`` that reads q and k straight from an
    ``fxr.rms_norm_linear`` to that GEMM (see the module docstring); its kernels are built
    ahead here (``providers.prebuild``), as a rules pass builds those of its matches."""
    result = PassResult()
    fake_mode = meta.fake_mode_of(gm.graph)
    rotations = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ROTARY]
    if not rotations:
        return result
    dead_code(gm)  # what fold_rotary replaced (the model's own indexing of q and k) reads them no more
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sites: list[tuple[fx.Node, fx.Node, int]] = []
    for rot in rotations:
        try:
            gemm, rotated = _site(rot, order)
        except _Miss as e:
            if e.near:
                result.near_misses.append(NearMiss(RULE, rot.name, meta.source_line(rot), e.at.name, e.reason,
                                                   meta.module_path(rot)))  # fmt: skip
            continue
        refusal = site_filter(rot, [gemm, rot]) if site_filter is not None else None
        if refusal is not None:
            result.rejected.append(Rejected(RULE, rot.name, meta.source_line(rot), refusal))
            continue
        sites.append((rot, gemm, rotated))
    calls = [(FUSED, meta.at_hints(tuple(_fused_args(rot, gemm, rotated))), {}) for rot, gemm, rotated in sites]
    if calls and (note := providers.prebuild(calls)):
        result.notes.append(note)
    for rot, gemm, rotated in sites:
        fused = _replace(gm.graph, rot, gemm, rotated, fake_mode)
        result.matches += 1
        result.sites.append(Site(RULE, fused.name, meta.source_line(fused), meta.module_path(fused)))
    return result
