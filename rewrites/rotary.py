"""Rotary position embedding: the rotation as model code spells it -> ``fxr.apply_rotary``.

The rules (``RULES``) match the rotation itself, whatever computed the tables::

    # HF (rotate_half, full-width tables)        # engine (half-width tables, in float32)
    x * cos + cat((-x[..., h:], x[..., :h])) * sin     xf = x.float(); x1, x2 = xf[..., :h], xf[..., h:]
                                                       cat((x1*cos - x2*sin, x2*cos + x1*sin)).to(dt)
        -> fxr.apply_rotary(x, cos, sin, interleaved, full_tables)

the GPT-J (interleaved) forms of both, each also in the other direction (``rotate_half`` as
``cat((x2, -x1))``, nanochat: the rotation by the negated angle, ``fxr.apply_rotary(x, cos, -sin,
..)``), the complex form (Llama 4, DeepSeek-V2: pairs of x as
complex numbers times complex angles ``freqs``, whose real and imaginary parts are the
half-width tables), and partial rotary (``cat((rotate(x[..., :r]), x[..., r:]))``). The next
stage (``rotary_tables.py``, the ``fold_rotary`` pass) folds the tables into a cache indexed by
position, one ``fxr.rotary_embedding_q`` per rotation, and calls :func:`pair_rotaries`, which
merges the q and k rotations of a layer into one ``fxr.rotary_embedding``.
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

import fxrewrite.runtime.ops  # noqa: F401  (registers torch.ops.fxr.*)
from fxrewrite import meta
from fxrewrite.meta import dim_key
from fxrewrite.report import PassResult, Site
from fxrewrite.rule import Bindings, Rule, Scalar, all_of

HALF = Scalar(int, lambda v: v > 0)
DTYPE = Scalar(torch.dtype)
FLAG = Scalar(bool)

# --------------------------------------------------------------------------- rules: the rotation


def _tables_guard(b: Bindings, width: Any) -> bool | str:
    """cos and sin: floating, one shape, ``width`` features, broadcasting against ``x`` without
    growing it (every table dim is 1 or x's size)."""
    x, cos, sin = b["x"], b["cos"], b["sin"]
    if not (x.dtype.is_floating_point and cos.dtype.is_floating_point):
        return f"not floating point: x {x.dtype}, cos {cos.dtype}"
    if not meta.same_sizes(cos, sin) or cos.dtype != sin.dtype:
        return f"cos {cos.dtype}{tuple(cos.shape)} and sin {sin.dtype}{tuple(sin.shape)} differ"
    return _fits(x, cos, width)


def _fits(x: Any, table: Any, width: Any) -> bool | str:
    """``table`` has ``width`` features and broadcasts against ``x`` without growing it."""
    if not meta.size_equal(table.shape[-1], width):
        return f"tables have {table.shape[-1]} features, the rotation {width}"
    if table.dim() > x.dim():
        return f"tables of rank {table.dim()} broadcast x of rank {x.dim()} up"
    for c, s in zip(reversed(table.shape[:-1]), reversed(x.shape[:-1])):
        if dim_key(c) != 1 and dim_key(c) != dim_key(s):
            return f"table shape {tuple(table.shape)} does not broadcast against x {tuple(x.shape)}"
    return True


def neox_full_guard(b: Bindings) -> bool | str:
    if not meta.size_equal(b["x"].shape[-1], 2 * b["half"]):
        return f"slices at {b['half']} do not halve the last dim {b['x'].shape[-1]}"
    return _tables_guard(b, b["x"].shape[-1])


def neox_half_guard(b: Bindings) -> bool | str:
    if not meta.size_equal(b["x"].shape[-1], 2 * b["half"]):
        return f"slices at {b['half']} do not halve the last dim {b['x'].shape[-1]}"
    return _tables_guard(b, b["half"])


def interleaved_full_guard(b: Bindings) -> bool | str:
    if b["x"].shape[-1] % 2:
        return f"odd last dim {b['x'].shape[-1]}"
    return _tables_guard(b, b["x"].shape[-1])


def interleaved_half_guard(b: Bindings) -> bool | str:
    if b["x"].shape[-1] % 2:
        return f"odd last dim {b['x'].shape[-1]}"
    return _tables_guard(b, b["x"].shape[-1] // 2)


def complex_guard(b: Bindings) -> bool | str:
    """``freqs``: complex, one angle per pair of x's features, broadcasting against x."""
    x, freqs = b["x"], b["freqs"]
    if not (x.dtype.is_floating_point and freqs.dtype.is_complex):
        return f"x {x.dtype} times freqs {freqs.dtype}: not a real tensor rotated by complex angles"
    if x.shape[-1] % 2:
        return f"odd last dim {x.shape[-1]}"
    return _fits(x, freqs, x.shape[-1] // 2)


def casts_back_guard(b: Bindings) -> bool | str:
    """An upcast rotation's final cast goes to the dtype ``fxr.apply_rotary`` returns (that of x,
    cos and sin promoted; of complex tables, their real parts'): the replacement rounds there
    first, so another target would round twice."""
    tables = (b["freqs"].dtype.to_real(),) if "freqs" in b else (b["cos"].dtype, b["sin"].dtype)
    out = functools.reduce(torch.promote_types, (b["x"].dtype, *tables))
    return b["dtype"] == out or f"casts to {b['dtype']}, the rotation of {out} values returns {out}"


def _neox_full(x, cos, sin, half):
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _neox_half(x, cos, sin, half):
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _interleaved_full(x, cos, sin):
    return x * cos + torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2) * sin


def _interleaved_half(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


# The other direction (``rotate_half`` as ``cat((x2, -x1))``): the rotation by -angle, that is the
# one above with sin negated. Its replacements rotate by ``-sin``; fold_rotary folds the sign
# into the cache's sin half.
def _neox_full_reverse(x, cos, sin, half):
    return x * cos + torch.cat((x[..., half:], -x[..., :half]), dim=-1) * sin


def _neox_half_reverse(x, cos, sin, half):
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


def _interleaved_full_reverse(x, cos, sin):
    return x * cos + torch.stack((x[..., 1::2], -x[..., 0::2]), dim=-1).flatten(-2) * sin


def _interleaved_half_reverse(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).flatten(-2)


# x * cos + rotate_half(x) * sin -> fxr.apply_rotary(x, cos, sin, False, True)   (HF)
def neox_full_pattern(x, cos, sin, half):
    return _neox_full(x, cos, sin, half)


def neox_full_replacement(x, cos, sin):
    return torch.ops.fxr.apply_rotary(x, cos, sin, False, True)


# the same computed in float32 and cast back -> fxr.apply_rotary(...).to(dtype)
def neox_full_upcast_pattern(x, cos, sin, half, dtype):
    return _neox_full(x.to(torch.float32), cos, sin, half).to(dtype)


def neox_full_upcast_replacement(x, cos, sin, dtype):
    return torch.ops.fxr.apply_rotary(x, cos, sin, False, True).to(dtype)


# cat((x1*cos - x2*sin, x2*cos + x1*sin)) -> fxr.apply_rotary(x, cos, sin, False, False)   (engine)
def neox_half_pattern(x, cos, sin, half):
    return _neox_half(x, cos, sin, half)


def neox_half_replacement(x, cos, sin):
    return torch.ops.fxr.apply_rotary(x, cos, sin, False, False)


def neox_half_upcast_pattern(x, cos, sin, half, dtype):
    return _neox_half(x.to(torch.float32), cos, sin, half).to(dtype)


def neox_half_upcast_replacement(x, cos, sin, dtype):
    return torch.ops.fxr.apply_rotary(x, cos, sin, False, False).to(dtype)


# x * cos + rotate_every_two(x) * sin -> fxr.apply_rotary(x, cos, sin, True, True)   (GPT-J)
def interleaved_full_pattern(x, cos, sin):
    return _interleaved_full(x, cos, sin)


def interleaved_full_replacement(x, cos, sin):
    return torch.ops.fxr.apply_rotary(x, cos, sin, True, True)


def interleaved_full_upcast_pattern(x, cos, sin, dtype):
    return _interleaved_full(x.to(torch.float32), cos, sin).to(dtype)


def interleaved_full_upcast_replacement(x, cos, sin, dtype):
    return torch.ops.fxr.apply_rotary(x, cos, sin, True, True).to(dtype)


# stack((x1*cos - x2*sin, x2*cos + x1*sin)).flatten(-2) -> fxr.apply_rotary(x, cos, sin, True, False)
def interleaved_half_pattern(x, cos, sin):
    return _interleaved_half(x, cos, sin)


def interleaved_half_replacement(x, cos, sin):
    return torch.ops.fxr.apply_rotary(x, cos, sin, True, False)


def interleaved_half_upcast_pattern(x, cos, sin, dtype):
    return _interleaved_half(x.to(torch.float32), cos, sin).to(dtype)


def interleaved_half_upcast_replacement(x, cos, sin, dtype):
    return torch.ops.fxr.apply_rotary(x, cos, sin, True, False).to(dtype)


def _complex(x, freqs):
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * freqs).flatten(-2)


# view_as_real(view_as_complex(x as pairs) * freqs) -> fxr.apply_rotary(x, real(freqs), imag(freqs), True, False)
def complex_pattern(x, freqs):
    return _complex(x, freqs)


def complex_replacement(x, freqs):
    return torch.ops.fxr.apply_rotary(x, torch.real(freqs), torch.imag(freqs), True, False)


def complex_upcast_pattern(x, freqs, dtype):
    return _complex(x.to(torch.float32), freqs).to(dtype)


def complex_upcast_replacement(x, freqs, dtype):
    return torch.ops.fxr.apply_rotary(x, torch.real(freqs), torch.imag(freqs), True, False).to(dtype)


# x * cos + cat((x2, -x1)) * sin -> fxr.apply_rotary(x, cos, -sin, False, True)   (rotate_half the other way)
def neox_full_reverse_pattern(x, cos, sin, half):
    return _neox_full_reverse(x, cos, sin, half)


def neox_full_reverse_replacement(x, cos, sin):
    return torch.ops.fxr.apply_rotary(x, cos, -sin, False, True)


def neox_full_reverse_upcast_pattern(x, cos, sin, half, dtype):
    return _neox_full_reverse(x.to(torch.float32), cos, sin, half).to(dtype)


def neox_full_reverse_upcast_replacement(x, cos, sin, dtype):
    return torch.ops.fxr.apply_rotary(x, cos, -sin, False, True).to(dtype)


# cat((x1*cos + x2*sin, x2*cos - x1*sin)) -> fxr.apply_rotary(x, cos, -sin, False, False)
def neox_half_reverse_pattern(x, cos, sin, half):
    return _neox_half_reverse(x, cos, sin, half)


def neox_half_reverse_replacement(x, cos, sin):
    return torch.ops.fxr.apply_rotary(x, cos, -sin, False, False)


def neox_half_reverse_upcast_pattern(x, cos, sin, half, dtype):
    return _neox_half_reverse(x.to(torch.float32), cos, sin, half).to(dtype)


def neox_half_reverse_upcast_replacement(x, cos, sin, dtype):
    return torch.ops.fxr.apply_rotary(x, cos, -sin, False, False).to(dtype)


# x * cos + stack((x[1::2], -x[0::2])).flatten(-2) * sin -> fxr.apply_rotary(x, cos, -sin, True, True)
def interleaved_full_reverse_pattern(x, cos, sin):
    return _interleaved_full_reverse(x, cos, sin)


def interleaved_full_reverse_replacement(x, cos, sin):
    return torch.ops.fxr.apply_rotary(x, cos, -sin, True, True)


def interleaved_full_reverse_upcast_pattern(x, cos, sin, dtype):
    return _interleaved_full_reverse(x.to(torch.float32), cos, sin).to(dtype)


def interleaved_full_reverse_upcast_replacement(x, cos, sin, dtype):
    return torch.ops.fxr.apply_rotary(x, cos, -sin, True, True).to(dtype)


# stack((x1*cos + x2*sin, x2*cos - x1*sin)).flatten(-2) -> fxr.apply_rotary(x, cos, -sin, True, False)
def interleaved_half_reverse_pattern(x, cos, sin):
    return _interleaved_half_reverse(x, cos, sin)


def interleaved_half_reverse_replacement(x, cos, sin):
    return torch.ops.fxr.apply_rotary(x, cos, -sin, True, False)


def interleaved_half_reverse_upcast_pattern(x, cos, sin, dtype):
    return _interleaved_half_reverse(x.to(torch.float32), cos, sin).to(dtype)


def interleaved_half_reverse_upcast_replacement(x, cos, sin, dtype):
    return torch.ops.fxr.apply_rotary(x, cos, -sin, True, False).to(dtype)


def partial_guard(b: Bindings) -> bool | str:
    """The rotated slice is exactly the table width; the rest passes through."""
    width = b["cos"].shape[-1] * (1 if b["full"] else 2)
    if not meta.size_equal(width, b["r"]):
        return f"rotates {width} features, slices at {b['r']}"
    if dim_key(b["r"]) == dim_key(b["x"].shape[-1]):
        return "nothing passes through"
    return True


# cat((apply_rotary(x[..., :r]), x[..., r:])) -> fxr.apply_rotary(x, ...)   (partial rotary)
def partial_pattern(x, cos, sin, r, interleaved, full):
    rotated = torch.ops.fxr.apply_rotary(x[..., :r], cos, sin, interleaved, full)
    return torch.cat((rotated, x[..., r:]), dim=-1)


def partial_replacement(x, cos, sin, interleaved, full):
    return torch.ops.fxr.apply_rotary(x, cos, sin, interleaved, full)


_H = {"half": HALF}
_HD = {"half": HALF, "dtype": DTYPE}
_D = {"dtype": DTYPE}
# Upcast forms first: in float32 their casts are elided and they match what the native form would.
ROTATION_RULES: list[Rule] = [
    Rule("rotary_neox_upcast", neox_full_upcast_pattern, neox_full_upcast_replacement,
         all_of(neox_full_guard, casts_back_guard), _HD),
    Rule("rotary_neox", neox_full_pattern, neox_full_replacement, neox_full_guard, _H),
    Rule("rotary_neox_half_upcast", neox_half_upcast_pattern, neox_half_upcast_replacement,
         all_of(neox_half_guard, casts_back_guard), _HD),
    Rule("rotary_neox_half", neox_half_pattern, neox_half_replacement, neox_half_guard, _H),
    Rule("rotary_interleaved_upcast", interleaved_full_upcast_pattern, interleaved_full_upcast_replacement,
         all_of(interleaved_full_guard, casts_back_guard), _D),
    Rule("rotary_interleaved", interleaved_full_pattern, interleaved_full_replacement, interleaved_full_guard),
    Rule("rotary_interleaved_half_upcast", interleaved_half_upcast_pattern, interleaved_half_upcast_replacement,
         all_of(interleaved_half_guard, casts_back_guard), _D),
    Rule("rotary_interleaved_half", interleaved_half_pattern, interleaved_half_replacement, interleaved_half_guard),
    Rule("rotary_complex_upcast", complex_upcast_pattern, complex_upcast_replacement,
         all_of(complex_guard, casts_back_guard), _D),
    Rule("rotary_complex", complex_pattern, complex_replacement, complex_guard),
]  # fmt: skip
# The other direction of each (sin negated), in the same order.
REVERSE_RULES: list[Rule] = [
    Rule("rotary_neox_reverse_upcast", neox_full_reverse_upcast_pattern, neox_full_reverse_upcast_replacement,
         all_of(neox_full_guard, casts_back_guard), _HD),
    Rule("rotary_neox_reverse", neox_full_reverse_pattern, neox_full_reverse_replacement, neox_full_guard, _H),
    Rule("rotary_neox_half_reverse_upcast", neox_half_reverse_upcast_pattern, neox_half_reverse_upcast_replacement,
         all_of(neox_half_guard, casts_back_guard), _HD),
    Rule("rotary_neox_half_reverse", neox_half_reverse_pattern, neox_half_reverse_replacement, neox_half_guard, _H),
    Rule("rotary_interleaved_reverse_upcast", interleaved_full_reverse_upcast_pattern,
         interleaved_full_reverse_upcast_replacement, all_of(interleaved_full_guard, casts_back_guard), _D),
    Rule("rotary_interleaved_reverse", interleaved_full_reverse_pattern, interleaved_full_reverse_replacement,
         interleaved_full_guard),
    Rule("rotary_interleaved_half_reverse_upcast", interleaved_half_reverse_upcast_pattern,
         interleaved_half_reverse_upcast_replacement, all_of(interleaved_half_guard, casts_back_guard), _D),
    Rule("rotary_interleaved_half_reverse", interleaved_half_reverse_pattern, interleaved_half_reverse_replacement,
         interleaved_half_guard),
]  # fmt: skip
PARTIAL = Rule(
    "rotary_partial", partial_pattern, partial_replacement, partial_guard,
    {"r": HALF, "interleaved": FLAG, "full": FLAG},
)  # fmt: skip
RULES: list[Rule] = ROTATION_RULES + REVERSE_RULES + [PARTIAL]

# --------------------------------------------------------------------------- pairing q and k

ROTARY_Q = torch.ops.fxr.rotary_embedding_q.default
ROTARY = torch.ops.fxr.rotary_embedding.default


def pair_rotaries(gm: fx.GraphModule, result: PassResult) -> None:
    """Merge consecutive ``rotary_embedding_q`` of one positions vector, cache and layout into one
    ``rotary_embedding`` (one kernel for q and k). The merged op takes the first one's place; the
    second's inputs computed after that place (its views of k) move up, unless they depend on the
    first rotation or have side effects."""
    graph = gm.graph
    groups: dict[tuple[Any, ...], list[fx.Node]] = defaultdict(list)
    for n in graph.nodes:
        if n.op == "call_function" and n.target is ROTARY_Q:
            t = meta.tensor(n.args[1])
            groups[(n.args[0], n.args[2], n.args[3], t.dtype if t is not None else None)].append(n)
    fake_mode = meta.fake_mode_of(graph)
    order = {n: float(i) for i, n in enumerate(graph.nodes)}  # kept up to date: linear in the graph
    for nodes in groups.values():
        i = 0
        while i + 1 < len(nodes):
            a, b = nodes[i], nodes[i + 1]
            moved = _inputs_after(b, a, order)
            if moved is None:
                i += 1
                continue
            for m in moved:
                a.prepend(m)
            with graph.inserting_before(a):
                pair = graph.call_function(ROTARY, (a.args[0], a.args[1], b.args[1], a.args[2], a.args[3]))
                outs = [graph.call_function(operator.getitem, (pair, k)) for k in range(2)]
            placed = [*moved, pair, *outs]
            lo = order.get(placed[0].prev, -1.0)
            for k, n in enumerate(placed, 1):  # between the node before them and `a`
                order[n] = lo + (order[a] - lo) * k / (len(placed) + 1)
            for new in [pair, *outs]:
                new.meta["fxr_rule"] = "rotary_embedding"
                meta.copy_provenance(a, new)
                meta.propagate(new, fake_mode)
            a.replace_all_uses_with(outs[0])
            b.replace_all_uses_with(outs[1])
            graph.erase_node(a)
            graph.erase_node(b)
            result.sites.append(Site("rotary_embedding", pair.name, meta.source_line(pair), meta.module_path(pair)))
            i += 2
    for n in graph.nodes:
        if n.op == "call_function" and n.target is ROTARY_Q:
            result.sites.append(Site("rotary_embedding_q", n.name, meta.source_line(n), meta.module_path(n)))


def _inputs_after(b: fx.Node, a: fx.Node, order: dict[fx.Node, float]) -> list[fx.Node] | None:
    """``b``'s ancestors that come after ``a`` in the graph (``order``: positions), in graph
    order; None when one of them is ``a``, reads it, or has side effects (then they cannot move
    before ``a``)."""
    found: set[fx.Node] = set()
    stack = [b]
    while stack:
        n = stack.pop()
        for x in n.all_input_nodes:
            if x is a:
                return None
            if order[x] > order[a] and x not in found:
                if x.op not in ("call_function", "call_method") or x.is_impure() or str(x.target).endswith("_"):
                    return None
                found.add(x)
                stack.append(x)
    return sorted(found, key=order.__getitem__)
