"""Sequence parallelism: the fused all-reduce + add + RMSNorm sites of a tensor-parallel graph,
chained through the residual stream, become ``fxr.sp_reduce_add_rms_norm`` (reduce-scatter, add
+ RMSNorm on this rank's rows, all-gather from ``Config.sequence_parallel_min_tokens`` rows on;
the fused all-reduce below: ``runtime/ops/sequence_parallel.py``)::

    %ar  = fxr.all_reduce_add_rms_norm(%o_proj, %h0, %w1, eps, '0')     %ar  = fxr.sp_reduce_add_rms_norm(%o_proj, %h0, %w1, eps, 1024, '0')
    %out = getitem(%ar, 0)    -> gate_up_proj ...                 ->    %out = getitem(%ar, 0)    -> gate_up_proj ...
    %h1  = getitem(%ar, 1)                                              %h1  = getitem(%ar, 1)
    %ar2 = fxr.all_reduce_add_rms_norm(%down_proj, %h1, %w2, eps, '0')  %ar2 = fxr.sp_reduce_add_rms_norm(%down_proj, %h1, %w2, eps, 1024, '0')

A graph pass over the ops ``fuse_collective`` made (after it: its rules proved each site), not a
rule: the unit is a chain, not a site. A sharded call leaves only this rank's rows of the sum
(the residual stream stays sharded between the two collectives), so a site may take the sharded
form only if every reader of its sum is the next site of the chain reading it as its residual
(which reads those rows alone), and then that next site must be sharded too. The pass links the
sites through their sums and converts a whole chain or none of it: a chain one of whose sums is
read elsewhere (a graph output, another op, an FP8 variant of the fused op, a site of another
process group or other shape) stays as it is, each of its sites a near miss naming the reader.
The sites of a chain see the same rows (the sum of one is the residual of the next), so the op's
branch takes one path along the chain at every call.

The threshold is applied per call, inside the op: piecewise capture compiles one graph for a
symbolic token count, and each capture size replays one fixed path (decode sizes the fused
all-reduce kernel, as before). A graph compiled for a static row count (``dynamic=False``) below
the threshold keeps ``fxr.all_reduce_add_rms_norm`` itself. Each site's report entry says which
pattern it got, at which row counts (the capture sizes on either side) and its shape.

``Config.sequence_parallel_min_tokens`` None (the default) turns the pass off: sharding alone
trades flashinfer's one-kernel fused all-reduce + norm for NCCL's reduce-scatter and all-gather
to save the norm's work on (TP - 1) / TP of the rows; what it gains depends on the GPUs and the
model (``bench/bench_tp.py`` measures it), and engines that ship it keep it opt-in (vLLM) or
from about 1000 tokens on (vLLM-Ascend's measured default). 1024 is the value to start from.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite import meta
from fxrewrite.report import NearMiss, PassResult, Site
from fxrewrite.runtime.ops.sequence_parallel import group_size_and_rank, sharded

RULE = "sequence_parallel"
AR = torch.ops.fxr.all_reduce_add_rms_norm.default
SP = torch.ops.fxr.sp_reduce_add_rms_norm.default
# fused sites with an output the sharded op has no form of: a chain that reaches one stays whole
UNSHARDED_VARIANTS = (torch.ops.fxr.all_reduce_add_rms_norm_quant_fp8.default,
                      torch.ops.fxr.all_reduce_add_rms_norm_block_quant_fp8.default,
                      torch.ops.fxr.all_reduce_add_rms_norm_quant_nvfp4.default)  # fmt: skip


def shard_sequence(
    gm: fx.GraphModule, sequence_parallel_min_tokens: int | None = None, capture_sizes: Sequence[int] = (),
    mode: str = "none",
) -> PassResult:  # fmt: skip
    """Convert each chain of fused all-reduce + add + RMSNorm sites whose sums only the chain
    reads to ``fxr.sp_reduce_add_rms_norm`` (module docstring); None: do nothing."""
    result = PassResult()
    min_tokens = sequence_parallel_min_tokens
    if min_tokens is None:
        return result
    sites = list(gm.graph.find_nodes(op="call_function", target=AR))
    for n in (n for t in UNSHARDED_VARIANTS for n in gm.graph.find_nodes(op="call_function", target=t)):
        result.near_misses.append(_miss(n, n, f"{_name(n)} (quantized output): no sharded form of it"))
    chains = _Chains(sites)
    for n in sites:
        chains.check(n)
    for chain in chains.groups():
        bad = next(((n, chains.bad[n]) for n in chain if n in chains.bad), None)
        if bad is not None:
            (first, (at, why)) = bad
            for n in chain:
                reason = why if n is first else f"in the chain of `{first.name}`: {why}"
                result.near_misses.append(_miss(n, at, reason))
            continue
        rows = _rows(chain[0])
        if isinstance(rows, int) and not sharded(rows, min_tokens):
            result.notes += [f"{RULE}: {n.name} ({meta.module_path(n) or meta.source_line(n)}): fused all-reduce kept, "
                             f"{rows} rows (static) < {min_tokens}" for n in chain]  # fmt: skip
            continue
        for n in chain:
            x, residual, weight, eps, group_name = n.args
            n.target = SP
            n.args = (x, residual, weight, eps, min_tokens, group_name)
            result.sites.append(Site(RULE, n.name, meta.source_line(n), meta.module_path(n),
                                     note=_pattern(n, rows, min_tokens, capture_sizes, mode)))  # fmt: skip
        result.matches += len(chain)
    return result


class _Chains:
    """Sites linked through their sums (union-find), and each site's first defect."""

    def __init__(self, sites: list[fx.Node]) -> None:
        self.parent = {n: n for n in sites}
        self.order = {n: i for i, n in enumerate(sites)}
        self.bad: dict[fx.Node, tuple[fx.Node, str]] = {}

    def find(self, n: fx.Node) -> fx.Node:
        while self.parent[n] is not n:
            self.parent[n] = n = self.parent[self.parent[n]]
        return n

    def check(self, n: fx.Node) -> None:
        """Link ``n`` to the sites that read its sum as their residual; note its defect."""
        x, residual = meta.tensor(n.args[0]), meta.tensor(n.args[1])
        if x is None or residual is None or x.dtype != residual.dtype or not meta.same_sizes(x, residual):
            self.bad[n] = (n, "the residual's shape or dtype differs from the reduced input's")
            return
        for reader, why in _sum_readers(n):
            if why is None and reader in self.parent and reader.args[4] == n.args[4]:
                self.parent[self.find(reader)] = self.find(n)
            else:
                self.bad.setdefault(n, (reader, why or f"the sum is the residual of `{reader.name}`, another group's site"))

    def groups(self) -> list[list[fx.Node]]:
        out: dict[fx.Node, list[fx.Node]] = {}
        for n in sorted(self.parent, key=self.order.__getitem__):
            out.setdefault(self.find(n), []).append(n)
        return list(out.values())


def _sum_readers(n: fx.Node) -> list[tuple[fx.Node, str | None]]:
    """Each reader of ``n``'s sum (output 1), with why it cannot read a sharded sum (None: it is
    a fused site reading it as its residual, and nothing else of it)."""
    out: list[tuple[fx.Node, str | None]] = []
    for user in n.users:
        if user.op != "call_function" or user.target is not operator.getitem or len(user.args) != 2:
            out.append((user, f"its outputs are read whole by `{user.name}`"))
            continue
        if user.args[1] != 1:
            continue
        for reader in user.users:
            if reader.op == "output":
                why: str | None = "the sum is a graph output (only this rank's rows of it would be right)"
            elif reader.target is not AR:
                why = f"the sum is read by `{reader.name}` ({_name(reader)}), which would see only this rank's rows"
            elif reader.args[1] is not user or user in (reader.args[0], reader.args[2]):
                why = f"the sum is read by `{reader.name}` other than as its residual"
            else:
                why = None
            out.append((reader, why))
    return out


def _rows(n: fx.Node) -> object:
    """The rows of a site's input: an int when static, else a symbolic expression."""
    return math.prod(meta.tensor(n.args[0]).shape[:-1])  # type: ignore[union-attr]


def _pattern(n: fx.Node, rows: object, min_tokens: int, capture_sizes: Sequence[int], mode: str,
             reduce: str = "reduce-scatter", gather: str = "all-gather") -> str:  # fmt: skip
    """What the report says of a converted site: the pattern at which rows, and its shape
    (``reduce`` and ``gather``: what the async-TP pass made of the collectives)."""
    x = meta.tensor(n.args[0])
    try:
        world: object = group_size_and_rank(n.args[-1])[0]
    except Exception:  # noqa: BLE001 - the group is named but not joined here (a compile-only run)
        world = "TP"
    say = (f"{reduce} -> add + RMSNorm on 1/{world} of the rows -> {gather} at >= {min_tokens} rows, "
           f"fused all-reduce + add + RMSNorm below; rows {rows}, hidden {x.shape[-1]}, {x.dtype}")  # type: ignore[union-attr]  # fmt: skip
    if mode != "none" and not isinstance(rows, int) and capture_sizes:
        above = [s for s in capture_sizes if sharded(s, min_tokens)]
        say += f"; capture sizes sharded: {above or 'none'}, all-reduce: {len(capture_sizes) - len(above)} smaller"
    return say


def _name(n: fx.Node) -> str:
    target = n.target
    return target.name() if isinstance(target, torch._ops.OpOverload) else str(getattr(target, "__name__", target))


def _miss(n: fx.Node, at: fx.Node, reason: str) -> NearMiss:
    return NearMiss(RULE, n.name, meta.source_line(n), at.name, reason, meta.module_path(n))
