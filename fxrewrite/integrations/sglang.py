"""SGLang with fxrewrite fusing the graph its piecewise torch.compile backend splits: SGLang
captures the model, splits it at its splitting ops (attention), compiles the pieces with its
eager piece compiler and captures them as CUDA graphs; fxrewrite fuses the graph before the split.

SGLang compiles pieces only with its ``eager`` or ``inductor`` compiler; there is no setting for
another. Its general plugins (entry point group ``sglang.srt.plugins``, declared in
pyproject.toml) are where out-of-tree code hooks SGLang's functions, through its
``HookRegistry``. With ``FXREWRITE_SGLANG=1`` in the environment, :func:`register` puts an
AROUND hook on ``SGLangBackend.__call__`` (``sglang.srt.compilation.backend``).

The hook fuses the whole graph (one graph, with the real weights: the rotary tables fold), puts
SGLang's splitting ops back in the form SGLang's splitter compares (``str(node.target)`` against
``sglang.<op>``: fxrewrite's canonical form names the overload, ``sglang.<op>.default``), hands
the constants the passes added over as trailing inputs, and calls SGLang's own ``__call__``. The
report is logged (SGLang configures the root logger) and written to ``FXREWRITE_REPORT_DIR``.

Versions: SGLang 0.5.23 still ships ``SGLangBackend`` but no longer reaches it from its
settings: ``--cuda-graph-config '{"prefill": {"backend": "tc_piecewise"}}'`` raises
``ValueError: tc_piecewise was removed; select breakable, full, or disabled``, and its remaining
torch.compile use (``--enable-torch-compile``, decode) calls Inductor with no backend setting.
The hook applies where a SGLang release runs ``SGLangBackend`` (the piecewise CUDA graph option,
``--piecewise-cuda-graph-compiler eager`` in earlier releases; not run here). Without a GPU the
backend module does not import (``NotImplementedError: weak_ref_tensor is implemented only for
CUDA, XPU, and NPU.``): tests/integrations/test_sglang.py runs the adapter against SGLang's
plugin loader, hook registry and splitter.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxrewrite.integrations import engine

log = logging.getLogger(__name__)

ENABLE_ENV = "FXREWRITE_SGLANG"
TARGET = "sglang.srt.compilation.backend.SGLangBackend.__call__"


def register() -> None:
    """SGLang general plugin (entry point ``sglang.srt.plugins: fxrewrite``), run in every SGLang
    process before its hooks are applied. With ``FXREWRITE_SGLANG=1`` it hooks
    ``SGLangBackend.__call__`` with :func:`fuse_then_split`; otherwise it does nothing."""
    if os.environ.get(ENABLE_ENV, "") in ("", "0"):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, fuse_then_split, HookType.AROUND)


def fuse_then_split(original: Callable[..., Any], backend: Any, graph: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """The AROUND hook: fuse ``graph``, then ``original(backend, fused, inputs)`` (SGLang's split,
    piece compilation and CUDA-graph backends)."""
    split_ops = list(backend.compile_config.split_ops)

    def split(fused: fx.GraphModule, inputs: list[Any]) -> Any:
        restore_split_ops(fused, split_ops)
        return original(backend, fused, inputs)

    return engine.fuse_then_split(split, backend, graph, example_inputs, engine="sglang", logger=log)


def restore_split_ops(gm: fx.GraphModule, split_ops: Iterable[str]) -> int:
    """Call each of SGLang's splitting ops through its packet (``torch.ops.sglang.attn``) where
    canonicalization named the overload (``torch.ops.sglang.attn.default``): SGLang's splitter
    compares ``str(node.target)`` with ``sglang.attn``. Returns how many nodes changed::

        %o = sglang.attn.default(%q, %k, %v)   ->   %o = sglang.attn(%q, %k, %v)
    """
    names = set(split_ops)
    changed = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and str(n.target) not in names:
            packet = n.target.overloadpacket
            if str(packet) in names:
                n.target = packet
                changed += 1
    if changed:
        gm.recompile()
    return changed
