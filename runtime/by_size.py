"""One Dynamo graph rewritten twice: the decode token counts replay one rewrite, the rest another.

A rewrite can pay at decode and cost at prefill. ``Config.gemm_fusion`` moves the norms and
residual adds into GEMMs that read their whole weight for a few rows; above 16 rows those ops
run cuBLAS and row kernels, one launch more per site than the add + norm kernel they replace.
The CUDA-graph runner captures a graph per token count anyway, so no single rewrite has to serve
every count: the backend rewrites the captured graph a second time without ``gemm_fusion`` (on a
copy taken before the passes) and :class:`BySize` hands each call to the runner of the rewrite
that serves its token count (``Config.gemm_fusion_max_tokens``; :func:`plan` splits the capture
sizes in the range Dynamo compiled the token count for, before the passes run)::

    small = Runner(fused_gm, inputs, replace(config, capture_sizes=(1, 2, 4, 8, 16)))
    large = Runner(plain_gm, inputs, replace(config, gemm_fusion=False, capture_sizes=(24, ..., 512)))
    runner = BySize(small, large, bound=16)   # n <= 16: small's graphs; above (and eager calls): large's

Each runner keeps its own static buffers, graph pool and counters: the small one holds 16 rows
of activations, little next to the large one. ``stats()`` adds the two up (what the report and
the bench tables read) and lists each under ``variants``. The backend lists the fused graph in
``Backend.graphs`` and the report; the other is ``BySize.large.gm``, its pass report under
``GraphReport.variants``.
"""

from __future__ import annotations

import collections
import copy as copy_module
import dataclasses
from collections.abc import Sequence
from typing import Any

from torch.fx import GraphModule

from fxrewrite.config import Config
from fxrewrite.runtime.cudagraph import Runner
from fxrewrite.runtime.dispatch import Dispatch


def plan(gm: GraphModule, example_inputs: Sequence[Any], config: Config) -> tuple[Config, Config | None]:
    """How ``gm`` (as captured) is rewritten: ``(config of gm's rewrite, config of the second
    rewrite or None)``. With ``gemm_fusion`` and ``gemm_fusion_max_tokens`` in a CUDA-graph mode,
    the capture sizes in the range Dynamo compiled the token count for are split at the bound:
    the small ones for ``gm`` with ``gemm_fusion``, the others for a second rewrite without it.
    All on one side: one rewrite, with ``gemm_fusion`` only where it serves a size. A graph of
    static shapes, or with several dynamic dimensions, has no token count to choose by: one
    rewrite, as configured."""
    bound = config.gemm_fusion_max_tokens
    if config.mode == "none" or not config.gemm_fusion or bound is None:
        return config, None
    d = Dispatch(gm, example_inputs, range(len(example_inputs)), config.capture_sizes or (), False, False)
    if d.symbol is None:
        return config, None
    small, large = tuple(s for s in d.sizes if s <= bound), tuple(s for s in d.sizes if s > bound)
    if not small:
        return dataclasses.replace(config, gemm_fusion=False), None
    if not large:
        return config, None
    return dataclasses.replace(config, capture_sizes=small), dataclasses.replace(config, gemm_fusion=False,
                                                                                 capture_sizes=large)


def copy_graph(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` to rewrite apart: nodes of its own, whose metadata dicts are copied (the
    values in them, fake tensors and real weights, shared), the same attributes, ``gm.meta``'s
    entries copied one level down (a pass's records of one graph are not the other's)."""
    copy = GraphModule(gm, copy_module.deepcopy(gm.graph))  # fx copies node.meta one level, not deep
    copy.meta = {k: copy_module.copy(v) for k, v in gm.meta.items()}
    return copy


_SUMMED = ("pieces", "captured_pieces", "splitting_pieces", "graphs", "capture_s", "pool_bytes", "pools",
           "buffer_bytes", "capture_saved_bytes", "calls", "replays", "padded_calls", "eager_calls",
           "static_input_copies", "activation_copies", "eager_piece_calls", "piece_input_changed")  # fmt: skip


class BySize:
    """Calls of at most ``bound`` tokens to ``small``'s runner, the others to ``large``'s (see the
    module docstring). Callable like either runner's graph; not thread-safe, as they are not."""

    def __init__(self, small: Runner, large: Runner, bound: int) -> None:
        self.small, self.large, self.bound = small, large, bound
        self._count = small.dispatch.token_count
        self._last: Runner = small

    def __call__(self, *args: Any) -> Any:
        n = self._count(args)
        runner = self._last = self.small if n is not None and n <= self.bound else self.large
        return runner(*args)

    def runner_for(self, n: int | None) -> Runner:
        """The runner a call of ``n`` tokens goes to."""
        return self.small if n is not None and n <= self.bound else self.large

    def static_inputs(self, n: int | None = None) -> list[Any]:
        """The static buffers of the runner that serves ``n`` tokens (``Runner.static_inputs``)."""
        return self.runner_for(n).static_inputs(n)

    def capture(self) -> None:
        """Capture every size of both runners now (otherwise each at its first call)."""
        self.small.capture()
        self.large.capture()

    @property
    def capture_s(self) -> float:
        return self.small.capture_s + self.large.capture_s

    def stats(self) -> dict[str, Any]:
        """``Runner.stats()`` of the two added up: counts summed, capture sizes, eager reasons and
        eager pieces merged, ``reason`` the first runner's that has one, the last call's copies
        those of the runner it went to; ``variants``: each runner's own, with the token counts
        it serves (``tokens``: ``"1-16"``, ``"17+"``)."""
        small, large = self.small.stats(), self.large.stats()
        merged = dict(large)
        for key in _SUMMED:
            merged[key] = small[key] + large[key]
        merged["cudagraphs"] = small["cudagraphs"] and large["cudagraphs"]
        merged["captured"] = small["captured"] and large["captured"]
        merged["reason"] = small["reason"] or large["reason"]
        merged["capture_sizes"] = sorted({*small["capture_sizes"], *large["capture_sizes"]})
        merged["eager_reasons"] = dict(collections.Counter(small["eager_reasons"]) + collections.Counter(large["eager_reasons"]))
        merged["eager_pieces"] = small["eager_pieces"] + large["eager_pieces"]
        last = small if self._last is self.small else large
        merged["static_input_copies_last"] = last["static_input_copies_last"]
        merged["activation_copies_last"] = last["activation_copies_last"]
        merged["variants"] = [{"tokens": f"1-{self.bound}", **small}, {"tokens": f"{self.bound + 1}+", **large}]
        return merged

    @property
    def graphs(self) -> tuple[GraphModule, GraphModule]:
        """The two rewritten graphs: with ``gemm_fusion``, without."""
        return self.small.gm, self.large.gm
