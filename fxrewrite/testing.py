"""What unit tests of rewrite rules need: compile through the backend, count ops, compare to eager.

    from fxrewrite.testing import check_rewrite

    def test_my_rule():
        result = check_rewrite(MyModule(), torch.randn(8, 64), rules=[MY_RULE],
                               expect={"fxr.my_op": 1}, absent=["aten.mul"])
        assert not result.report.near_misses
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxrewrite.backend import Backend
from fxrewrite.config import Config
from fxrewrite.report import Report
from fxrewrite.rule import Rule
from fxrewrite.tolerances import TOLERANCES


def op_name(node: fx.Node) -> str:
    """A short, stable name for what a node calls: ``fxr.rms_norm``, ``aten.mul``, ``method.to``."""
    t = node.target
    if node.op == "call_method":
        return f"method.{t}"
    if isinstance(t, torch._ops.OpOverload):
        ns, name = t._schema.name.split("::")
        return f"{ns}.{name}"
    if isinstance(t, torch._ops.OpOverloadPacket):
        return str(t).replace("::", ".")
    return f"{getattr(t, '__module__', '') or ''}.{getattr(t, '__name__', str(t))}".lstrip(".")


def op_counts(gm: fx.GraphModule) -> collections.Counter[str]:
    """How many times each op is called in ``gm`` (see :func:`op_name`)."""
    return collections.Counter(op_name(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))


@dataclasses.dataclass
class Compiled:
    """The result of compiling a function through the backend once."""

    output: Any
    eager: Any
    backend: Backend
    before: list[collections.Counter[str]] = dataclasses.field(default_factory=list)  # op counts as captured

    @property
    def report(self) -> Report:
        return self.backend.report

    @property
    def graph(self) -> fx.GraphModule:
        if len(self.backend.graphs) != 1:
            raise AssertionError(f"expected one Dynamo graph, got {len(self.backend.graphs)}")
        return self.backend.graphs[0]

    def counts(self) -> collections.Counter[str]:
        return op_counts(self.graph)

    def counts_before(self) -> collections.Counter[str]:
        """Op counts of the graph as Dynamo captured it, before any pass."""
        if len(self.before) != 1:
            raise AssertionError(f"expected one Dynamo graph, got {len(self.before)}")
        return self.before[0]


def compile_once(
    fn: Any,
    *inputs: Any,
    rules: Sequence[Rule] | None = None,
    config: Config | None = None,
    dynamic: bool = True,
    **overrides: Any,
) -> Compiled:
    """Run ``fn(*inputs)`` eagerly and through ``Backend(...).compile(fn)`` (``torch.compile``
    with ``fullgraph=True``; Python floats constant unless ``specialize_floats=False``); returns
    both outputs and the backend."""
    torch._dynamo.reset()
    backend = Backend(config, rules=rules, **overrides)
    before: list[collections.Counter[str]] = []

    def counting_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        before.append(op_counts(gm))
        return backend(gm, example_inputs)

    if hasattr(backend, "backend_ctx_ctor"):
        counting_backend.backend_ctx_ctor = backend.backend_ctx_ctor  # type: ignore[attr-defined]
    compiled = torch._dynamo.optimize(counting_backend, nopython=True, dynamic=dynamic)(fn)
    with torch.no_grad():
        eager = fn(*inputs)
        out = compiled(*inputs)
    return Compiled(out, eager, backend, before)


def assert_counts(counts: Mapping[str, int], expect: Mapping[str, int] = {}, absent: Iterable[str] = ()) -> None:
    """``expect``: exact counts of op names (prefix match on ``op_name``); ``absent``: op names
    that must not appear at all."""
    for name, n in expect.items():
        got = sum(c for op, c in counts.items() if op == name or op.startswith(name + "."))
        assert got == n, f"expected {n} x {name}, found {got}; ops: {dict(counts)}"
    for name in absent:
        found = {op: c for op, c in counts.items() if op == name or op.startswith(name + ".")}
        assert not found, f"expected no {name}, found {found}"


def assert_close(actual: Any, expected: Any, dtype: torch.dtype | None = None) -> None:
    """Compare (nested) outputs with the tolerance of their dtype (``fxrewrite.tolerances.TOLERANCES``)."""
    if isinstance(expected, torch.Tensor):
        rtol, atol = TOLERANCES.get(dtype or expected.dtype, (0.0, 0.0))
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_close(a, e, dtype)
    elif isinstance(expected, dict) or hasattr(expected, "items"):
        for k, e in expected.items():
            assert_close(actual[k], e, dtype)
    else:
        assert actual == expected


def check_rewrite(
    fn: Any,
    *inputs: Any,
    rules: Sequence[Rule] | None = None,
    expect: Mapping[str, int] = {},
    absent: Iterable[str] = (),
    dynamic: bool = True,
    **overrides: Any,
) -> Compiled:
    """Compile, assert op counts after the rewrite, and compare numerics against eager."""
    result = compile_once(fn, *inputs, rules=rules, dynamic=dynamic, **overrides)
    assert_counts(result.counts(), expect, absent)
    assert_close(result.output, result.eager)
    return result


def run_ranks(fn: Any, *args: Any, world: int = 2, backend: str = "gloo", timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined in a process group
    (``backend``: "gloo" on CPU, "nccl" with one GPU per rank, ``cuda:{rank}``); returns each
    rank's result (picklable; tensors go to the CPU first). ``fn`` must be importable by its
    module name (a module-level function of a test file is). A rank that raises fails the call
    with its traceback; past ``timeout`` seconds the ranks are killed (a collective one rank
    skipped hangs the others).

        def worker(rank, world, n):
            t = torch.ones(n) * (rank + 1)
            torch.distributed.all_reduce(t)
            return t

        assert run_ranks(worker, 3)[0].tolist() == [3.0, 3.0, 3.0]
    """
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, backend, port, queue, fn, args)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world and all(ok for ok, _ in got.values()):  # one failure ends the wait
            if not queue.empty():
                rank, ok, value = queue.get()
                got[rank] = (ok, _loads(value) if ok else value)
            elif all(p.exitcode is not None for p in procs) and queue.empty():
                raise RuntimeError(f"ranks {sorted(set(range(world)) - set(got))} died without a result "
                                   f"(exit codes {[p.exitcode for p in procs]})")
            elif time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(got))} still running after {timeout:.0f} s")
            else:
                time.sleep(0.05)
    finally:
        failed = len(got) < world or not all(ok for ok, _ in got.values())
        for p in procs:
            p.join(timeout=1 if failed else 30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [got[r][1] for r in range(world)]


def _rank_main(rank: int, world: int, backend: str, port: int, queue: Any, fn: Any, args: tuple) -> None:
    import os
    import traceback

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        out = fn(rank, world, *args)
        queue.put((rank, True, _dumps(_to_cpu(out))))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dumps(v: Any) -> bytes:
    """By value (``torch.save``: every dtype, FP8 included), not through shared memory, which
    a rank that has exited no longer serves."""
    import io

    buf = io.BytesIO()
    torch.save(v, buf)
    return buf.getvalue()


def _loads(b: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(b), weights_only=False)


def _to_cpu(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    if isinstance(v, dict):
        return {k: _to_cpu(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_to_cpu(x) for x in v)
    return v


POISON = 0x3F3F3F3F3F3F3F3F  # as an int64 index: far out of bounds of any table


def poison_allocator(device: torch.device | str = "cuda", total_mb: int = 1024) -> None:
    """Fill blocks of the CUDA caching allocator with a large integer pattern and free them:
    blocks of the small pool (512 B .. 1 MiB) and of the large one, about ``total_mb`` in all.
    Later allocations that reuse them read the pattern until written, so a kernel that reads an
    index before anything wrote it goes out of bounds at once (a device assert), instead of
    depending on what an earlier model left there."""
    blocks = []
    for size in (512, 4096, 65536, 1 << 20, 1 << 23, 1 << 25):
        for _ in range(max(1, min(64, (total_mb << 20) // (6 * size)))):
            blocks.append(torch.full((size // 8,), POISON, dtype=torch.int64, device=device))
    torch.cuda.synchronize(device)
    del blocks



def _routers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """(module that computes router logits, top-k) for every MoE router in ``model``: a module
    with an integer ``top_k`` and either a 2-D ``weight`` of its own (a router module) or a
    linear ``gate`` child; :func:`_logits_of` reads the logits of each call."""
    found = []
    for m in model.modules():
        k = getattr(m, "top_k", None)
        if not isinstance(k, int) or isinstance(k, bool):
            continue
        weight, gate = getattr(m, "weight", None), getattr(m, "gate", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            found.append((m, k))
        elif isinstance(gate, torch.nn.Linear):
            found.append((gate, k))
    return found


def _logits_of(router: torch.nn.Module, inputs: list[Any], out: Any) -> torch.Tensor:
    """One router call's logits, [tokens, experts] float32: its weight (and ``bias``) applied to
    its input, as the call computed them: the tensor of its output closest to that product in
    float32 (the router's own rounding; the logits need not come first: Llama 4's router returns
    its scores, then its logits); for an output without them, the product in the weight's dtype.
    A router whose input is not the weight's: the first tensor of its output."""
    first = out[0] if isinstance(out, tuple) else out
    weight, bias = router.weight.detach(), getattr(router, "bias", None)
    x = next((a for a in inputs if isinstance(a, torch.Tensor)), None)
    if x is None or x.shape[-1] != weight.shape[1]:
        return first.detach().float().reshape(-1, first.shape[-1])
    bias = bias.detach() if isinstance(bias, torch.Tensor) and bias.shape == weight.shape[:1] else None
    want = torch.nn.functional.linear(x.detach().float(), weight.float(), None if bias is None else bias.float())
    want = want.reshape(-1, weight.shape[0])
    outs = [t.detach().float().reshape(want.shape) for t in (out if isinstance(out, tuple) else (out,))
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape[-1:] == weight.shape[:1]
            and t.numel() == want.numel()]  # fmt: skip
    if outs:
        return min(outs, key=lambda t: (t - want).abs().nan_to_num(float("inf")).max().item())
    low = x.detach().to(weight.dtype)
    low = torch.nn.functional.linear(low, weight, None if bias is None else bias.to(weight.dtype))
    return low.float().reshape(want.shape)


def _router_logits(model: torch.nn.Module, *args: Any) -> list[tuple[torch.Tensor, int]]:
    """Call ``model(*args)`` and return each router call's logits ([tokens, experts], float32,
    :func:`_logits_of`) and top-k, in call order."""
    calls: list[tuple[torch.Tensor, int]] = []

    def record(k: int) -> Any:
        def hook(m: torch.nn.Module, m_args: tuple[Any, ...], m_kwargs: dict[str, Any], out: Any) -> None:
            calls.append((_logits_of(m, [*m_args, *m_kwargs.values()], out), k))

        return hook

    handles = [m.register_forward_hook(record(k), with_kwargs=True) for m, k in _routers(model)]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in handles:
            h.remove()
    return calls


def routing_near_ties(reference: torch.nn.Module, rounded: torch.nn.Module, *args: Any,
                      margin: float = 2.0, causal: tuple[int, int] | None = None) -> torch.Tensor | None:  # fmt: skip
    """Tokens whose top-k expert choice is too close to call for a model run in lower precision:
    ``[tokens]`` bool over ``args``' flattened tokens, True where at some MoE router of
    ``reference`` (float32) the k-th and (k+1)-th largest logits differ by at most ``margin``
    times the largest logit difference between ``reference`` and ``rounded`` (the same model in
    bf16, say) at that router. Such a token may pick another expert under any other rounding
    order, a jump in its output that a largest-error check cannot tell from a bug; compare the
    other tokens. With ``causal`` = (batch, sequence) of a causal decoder the mask has that
    shape and also marks every later token of a marked token's sequence (attention carries the
    jump to them). ``None`` for a model without routers."""
    ref, low = _router_logits(reference, *args), _router_logits(rounded, *args)
    if not ref:
        return None
    assert len(ref) == len(low), "the two models routed a different number of times"
    near = torch.zeros(ref[0][0].shape[0], dtype=torch.bool, device=ref[0][0].device)
    for (a, k), (b, _) in zip(ref, low):
        if k >= a.shape[-1]:
            continue  # every expert is chosen: no choice to flip
        top = a.topk(k + 1, dim=-1).values
        near |= (top[:, k - 1] - top[:, k]) <= margin * (a - b).abs().max()
    return near if causal is None else near.reshape(causal).int().cummax(dim=-1).values.bool()
