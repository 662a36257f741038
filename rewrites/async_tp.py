"""Async tensor parallelism: the GEMMs on either side of each sequence-parallel site fused with
its collectives (``Config.async_tp``, with ``Config.sequence_parallel_min_tokens``; the ops:
``runtime/ops/async_tp.py``)::

    %x   = fxr.linear(%attn, %w_o)                          %sp  = fxr.sp_linear_reduce_add_rms_norm(
    %sp  = fxr.sp_reduce_add_rms_norm(                 ->            %attn, %w_o, %h0, %w1, eps, 512, False, '0')
             %x, %h0, %w1, eps, 512, '0')                   %out = getitem(%sp, 0)
    %out = getitem(%sp, 0)                                  %h1  = getitem(%sp, 1)
    %h1  = getitem(%sp, 1)                                  %y   = fxr.sp_all_gather_linear(%out, %w_gu, 512, True, '0')
    %y   = fxr.linear_silu_and_mul(%out, %w_gu)

i.e. reduce-scatter -> add + RMSNorm -> all-gather -> GEMM becomes GEMM + reduce-scatter -> add +
RMSNorm -> all-gather + GEMM. Where both halves fuse (every site inside a Llama stack), the two
ops are one, ``%y, %h1 = fxr.sp_linear_reduce_add_rms_norm_linear(%attn, %w_o, %h0, %w1, eps,
%w_gu, True, 512, 2048, '0')``: from ``Config.async_tp_overlap_min_tokens`` rows on it runs the
two ops' paths, below it whole GEMMs around one kernel that exchanges the rows (the GEMM halves
cost more than they hide there). A graph pass over the sites ``sequence_parallel`` made, run after
``select_gemm`` (the GEMMs are then ``fxr.linear`` / ``fxr.linear_silu_and_mul``, ``aten.linear``
in mode "none"), so that below the threshold the new ops call the very ops the graph called:
decode steps run the kernels they ran before.

Each half on its own:
- before: the reduced input is a linear without bias whose only reader is the site (a
  row-parallel projection): the GEMM moves into the site. Otherwise the site reduce-scatters
  its input as it did (``w`` None).
- after: the normed output has one reader, a linear without bias reading it as its input (a
  column-parallel projection; with SiLU-and-mul fused, ``gated``): the all-gather moves into that
  GEMM and the site leaves ``out`` sharded (``gather=False``). Otherwise (several readers: one
  all-gather would serve each; a graph output, the final norm's) the site all-gathers as before.
A site where neither half fuses stays ``fxr.sp_reduce_add_rms_norm``, a near miss naming both
reasons. Each converted site's report entry says which collective pattern it got, why a half
did not fuse, the threshold, the capture sizes on either side of it and the shape.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite import meta
from fxrewrite.report import NearMiss, PassResult, Site
from fxrewrite.rewrites.sequence_parallel import SP, _pattern, _rows

RULE = "async_tp"
REDUCE = torch.ops.fxr.sp_linear_reduce_add_rms_norm.default
GATHER = torch.ops.fxr.sp_all_gather_linear.default
SITE = torch.ops.fxr.sp_linear_reduce_add_rms_norm_linear.default
LINEARS = (torch.ops.aten.linear.default, torch.ops.fxr.linear.default)
GATED = torch.ops.fxr.linear_silu_and_mul.default


def fuse_async_tp(gm: fx.GraphModule, capture_sizes: Sequence[int] = (), mode: str = "none",
                  async_tp_overlap_min_tokens: int = 2048) -> PassResult:  # fmt: skip
    """Move the GEMM before and the GEMM after each ``fxr.sp_reduce_add_rms_norm`` site into its
    collectives (module docstring)."""
    result = PassResult()
    for n in list(gm.graph.find_nodes(op="call_function", target=SP)):
        x, residual, weight, eps, min_tokens, group_name = n.args
        producer, why_before = _producer(n)
        consumer, why_after = _consumer(n)
        if producer is None and consumer is None:
            result.near_misses.append(NearMiss(RULE, n.name, meta.source_line(n), n.name,
                                               f"before: {why_before}; after: {why_after}", meta.module_path(n)))  # fmt: skip
            continue
        reduce = (f"`{_where(producer)}` GEMM + reduce-scatter" if producer is not None
                  else f"reduce-scatter ({why_before})")  # fmt: skip
        gather = (f"all-gather + `{_where(consumer)}` GEMM" if consumer is not None
                  else f"all-gather ({why_after})")  # fmt: skip
        note = _pattern(n, _rows(n), min_tokens, capture_sizes, mode, reduce, gather)
        a, w = producer.args[:2] if producer is not None else (x, None)
        n.target = REDUCE
        n.args = (a, w, residual, weight, eps, min_tokens, consumer is None, group_name)
        if producer is not None:
            gm.graph.erase_node(producer)
        if producer is not None and consumer is not None:
            _whole_site(gm, n, consumer, async_tp_overlap_min_tokens)
            note += (f"; one op: whole GEMMs around one exchange kernel below {async_tp_overlap_min_tokens} rows, "
                     f"each GEMM split by the ranks' rows from there")  # fmt: skip
        elif consumer is not None:
            consumer.args = (consumer.args[0], consumer.args[1], min_tokens, consumer.target is GATED, group_name)
            consumer.target = GATHER
        result.sites.append(Site(RULE, n.name, meta.source_line(n), meta.module_path(n), note=note))
        result.matches += 1
    return result


def _whole_site(gm: fx.GraphModule, n: fx.Node, consumer: fx.Node, overlap_min_tokens: int) -> None:
    """``n`` (the reduce, its GEMM taken in) and the GEMM that alone reads its normed output ->
    one ``fxr.sp_linear_reduce_add_rms_norm_linear``: its first output is that GEMM's."""
    a, w, residual, weight, eps, min_tokens, _, group_name = n.args
    out = next(u for u in n.users if u.target is operator.getitem and u.args[1] == 0)
    n.target = SITE
    n.args = (a, w, residual, weight, eps, consumer.args[1], consumer.target is GATED, min_tokens, overlap_min_tokens,
              group_name)  # fmt: skip
    consumer.replace_all_uses_with(out)
    out.meta = dict(consumer.meta)
    if "val" in n.meta:
        n.meta["val"] = (consumer.meta.get("val"), n.meta["val"][1])
    gm.graph.erase_node(consumer)


def _producer(n: fx.Node) -> tuple[fx.Node | None, str]:
    """The linear the site reduces, when its GEMM can move into the site; else why not."""
    x = n.args[0]
    why = _plain_linear(x, LINEARS)
    if why:
        return None, f"the reduced input {why}"
    if len(x.users) != 1:
        return None, f"the reduced input `{_where(x)}` has other readers ({', '.join(u.name for u in x.users if u is not n)})"
    return x, ""


def _consumer(n: fx.Node) -> tuple[fx.Node | None, str]:
    """The one linear that reads the site's normed output, when the all-gather can move into its
    GEMM; else why not."""
    outs = [u for u in n.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0]
    if len(outs) != 1:
        return None, "the normed output is not read through one getitem"
    readers = list(outs[0].users)
    if len(readers) != 1:
        names = ", ".join(f"`{r.name}`" for r in readers) or "nothing"
        return None, f"the normed output has {len(readers)} readers ({names}): one all-gather serves one GEMM"
    reader = readers[0]
    if reader.op == "output":
        return None, "the normed output is a graph output"
    why = _plain_linear(reader, (*LINEARS, GATED))
    if why:
        return None, f"the normed output's reader {why}"
    if reader.args[0] is not outs[0] or outs[0] in reader.args[1:]:
        return None, f"the normed output is not the input of `{_where(reader)}`"
    return reader, ""


def _plain_linear(node: object, targets: tuple) -> str:
    """'' when ``node`` is a call of one of ``targets`` with a matrix weight and no bias; else
    what it is."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in targets:
        target = getattr(node, "target", node)
        name = target.name() if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
        return f"`{getattr(node, 'name', node)}` is {name}, not a linear"
    if node.kwargs or len(node.args) > 3 or (len(node.args) == 3 and node.args[2] is not None):
        return f"`{_where(node)}` has a bias"
    w = meta.tensor(node.args[1])
    if w is None or w.dim() != 2:
        return f"`{_where(node)}`'s weight is not a matrix"
    return ""


def _where(n: fx.Node) -> str:
    """The module a node's code is in (``layers.0.mlp.down_proj``), else its name."""
    return meta.module_path(n) or n.name
