"""Calling a compiled model without Dynamo's frame evaluation: ``Backend.unguarded``.

Every call of a ``torch.compile``-d model goes through Dynamo before the graph runs: its frame
callback finds the frame's cache entries, evaluates their guards, then runs the transformed
bytecode, which gathers the graph's inputs (every parameter, read off the module) and calls the
compiled graph. On the 8B-shaped bench model (265 graph inputs) that was 0.39 ms of host time a
step on the H100 machine, time a GPU replaying one CUDA graph per step spends idle; running the
bytecode directly leaves 0.20 ms (bench/RESULTS.md, seventh run). A serving engine that
controls its inputs (the same module, dtypes and devices on every step, shapes within what was
compiled) does not need the guards: it can run the transformed bytecode as a plain function, as
vLLM's compile wrapper does.

:func:`unguarded` picks the cache entry of ``model``'s frame that one of a backend's graphs
serves and that accepts an example call (its guards are checked once, here), and returns the
entry's bytecode bound as a function. What the guards would have caught later is then the
caller's to keep true. In the CUDA-graph modes the runner still checks what it can cheaply:
shapes against the compiled ones (``ShapeError``), parameters that moved (the call runs
eagerly, with a warning); in mode "none" the graph runs on whatever it is given.
A change of a Python value the graph baked in (a module's float attribute, a global flag) is
not seen: call the compiled model instead, and ``unguarded`` again, after such a change.

The function calls the backend's graph directly, without the wrapper Dynamo puts around every
compiled graph to switch its frame evaluation off for the call, and so the helpers the bytecode
calls from ``torch._dynamo.utils`` (``call_size``, the pre-graph profiler marks), three a step
on the bench model, each switching it off and on again. Called from plain Python, as an
engine's step loop calls it, frame evaluation is off already; do not call it from inside a
function that ``torch.compile`` compiles (Dynamo would then try to trace the graph's runner).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _frame_function(model: Any) -> tuple[types.FunctionType, Any]:
    """The Python function whose frame Dynamo compiled, and what it is bound to (a module or
    None): ``forward`` of a module (``torch.compile`` output or the module itself), else the
    function itself."""
    target = getattr(model, "_torchdynamo_orig_callable", None) or getattr(model, "_orig_mod", model)
    bound = None
    if isinstance(target, torch.nn.Module):
        bound, target = target, target.forward
    if isinstance(target, types.MethodType):
        bound, target = target.__self__, target.__func__
    target = inspect.unwrap(target)
    if not isinstance(target, types.FunctionType):
        raise TypeError(f"unguarded: expected a module or a Python function, got {type(model).__name__}")
    return target, bound


def _graph_called(fn: types.FunctionType, entry: Any, graphs: Sequence[Any]) -> tuple[str, Any] | None:
    """The global name through which the entry's bytecode calls one of ``graphs``, and that
    graph; None for another backend's graph."""
    for name in entry.code.co_names:
        if name.startswith("__compiled_fn"):
            obj = inspect.unwrap(fn.__globals__.get(name))  # Dynamo's wrapper that disables it
            obj = getattr(obj, "_orig_mod", obj)  # ... which wraps a module (a GraphModule) in a module
            obj = getattr(obj, "__self__", obj)  # a GraphModule's bound forward
            return next(((name, g) for g in graphs if g is obj), None)
    return None


class _Undisabled:
    """A module the bytecode reads helpers from (``__import_torch_dot__dynamo_dot_utils``), its
    functions without ``torch._disable_dynamo``'s wrapper (see the module docstring)."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        code = getattr(value, "__code__", None)
        if code is not None and code.co_filename == torch._compile.__file__ and hasattr(value, "__wrapped__"):
            value = value.__wrapped__
        setattr(self, name, value)  # found directly from the next call on
        return value


def unguarded(model: Any, graphs: Sequence[Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """The bytecode of the cache entry that runs one of ``graphs`` for a call like ``model(*args,
    **kwargs)``, as a function taking the same arguments (see the module docstring).

    Raises RuntimeError when the model has not been compiled yet (nothing in the cache), when no
    entry is one of ``graphs``, or when none of those accepts the example call (the first
    guard that failed is quoted).
    """
    fn, bound = _frame_function(model)
    cache_entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if cache_entries is None:  # private API; tested on torch 2.11 and 2.13
        raise RuntimeError(f"unguarded: torch {torch.__version__} does not expose Dynamo's cache entries "
                           "(torch._dynamo.eval_frame._debug_get_cache_entry_list); call the compiled model instead")
    entries = cache_entries(fn.__code__)
    ours = [(e, called) for e in entries if (called := _graph_called(fn, e, graphs)) is not None]
    where = f"{fn.__qualname__} ({fn.__code__.co_filename}:{fn.__code__.co_firstlineno})"
    if not ours:
        raise RuntimeError(
            f"unguarded: {where} has no compiled graph of this backend ({len(entries)} cache entries "
            "of other backends); call the compiled model once first, then unguarded(...) with the same arguments")
    call = (bound, *args) if bound is not None else tuple(args)
    try:
        params = inspect.signature(fn).bind(*call, **kwargs)
    except TypeError as e:
        raise TypeError(f"unguarded: the example call does not fit {where}: {e}") from e
    params.apply_defaults()
    f_locals = dict(params.arguments)
    failures = []
    for entry, (name, graph) in ours:
        verdict = entry.guard_manager.check_verbose(f_locals)
        if verdict.result:
            code = entry.code
            break
        failures.append(" / ".join(verdict.verbose_code_parts) or "a guard failed")
    else:
        raise RuntimeError(
            f"unguarded: none of this backend's {len(ours)} graph(s) for {where} accepts the example call "
            f"(first failed guard: {failures[0]}); call the compiled model with these arguments first, under "
            "the same torch.no_grad() / inference_mode state")
    # the bytecode calls the graph itself, not Dynamo's wrapper around it, which switches frame
    # evaluation off and on again around the call (nothing to switch off here: see the module
    # docstring), and Dynamo's helpers unwrapped; the other globals as the model's module holds
    # them now
    scope = {**fn.__globals__, name: graph}
    for g in code.co_names:
        if g.startswith("__import_") and isinstance(scope.get(g), types.ModuleType):
            scope[g] = _Undisabled(scope[g])
    direct = types.FunctionType(code, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    direct.__kwdefaults__ = fn.__kwdefaults__
    direct.__qualname__ = f"{fn.__qualname__} (unguarded)"
    return types.MethodType(direct, bound) if bound is not None else direct
