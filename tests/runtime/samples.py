"""Sample arguments for the fused ops, by parameter name (shared by the tests in this folder)."""

from __future__ import annotations

import functools
import math
import inspect
from typing import Any

import moe_samples
import rotary_samples
import torch

from fxrewrite.runtime.providers import OpDef

EPS = 1e-6


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def op_args(op: OpDef, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> list[Any]:
    """Arguments of ``op`` on CPU: ``x`` (and ``residual``) of ``shape``, a [hidden] weight, eps
    1e-6, a static FP8 scale 0.02, an NVFP4 global scale 300, GELU's tanh approximation, the norms'
    ``cast_last`` order, a gated norm's gate (grouped, gate first, SiLU), act_mul's ``a`` and ``b``
    of ``shape``, a lone quantizer's ``y`` of ``shape``, the default process group's name, rotary
    arguments from :mod:`rotary_samples`, MoE arguments from :mod:`moe_samples`, a linear's
    [hidden, hidden] matrix ``w`` and [hidden] bias, a fused norm's ``norm_weight`` near 1, block
    FP8's group (32 where the row allows)."""
    values = {
        "weight": lambda: rand(gen, shape[-1], dtype=dtype) * 0.5,
        "norm_weight": lambda: 1.0 + rand(gen, shape[-1], dtype=dtype) * 0.1,
        "w": lambda: rand(gen, shape[-1], shape[-1], dtype=dtype) * shape[-1] ** -0.5,
        "bias": lambda: rand(gen, shape[-1], dtype=dtype),
        "eps": lambda: EPS,
        "scale": lambda: torch.tensor([0.02]),
        "global_scale": lambda: torch.tensor([300.0]),  # NVFP4: 448 * 6 / 9, an amax of 9 at the top scale
        "approximate": lambda: "tanh",
        "cast_last": lambda: True,
        # the norm variants: a gate of x's shape, groups of half the row (when it is even), gate first
        "gate": lambda: rand(gen, *shape, dtype=dtype),
        "group_size": lambda: shape[-1] // 2 if shape[-1] % 2 == 0 else None,
        "gate_first": lambda: True,
        "activation": lambda: "silu",
        "round_scale": lambda: False,
        # act_mul: the product's operand order (the values are the same)
        "act_first": lambda: False,
        # block FP8: a group that divides the row and the half row (an activation's output), at most 32
        "group": lambda: math.gcd(shape[-1], shape[-1] // 2 or 1, 32),
        # the collective ops: the default group (test_ops.py makes a fake one)
        "group_name": lambda: torch.distributed.group.WORLD.group_name,
        # sequence parallelism: the all-reduce path (a sharded call leaves other ranks' rows of the
        # sum unwritten: opcheck would compare them); the sharded path: test_sequence_parallel_ops.py
        "min_tokens": lambda: 2**30,
        # async TP (its GEMMs are "w", [hidden, hidden]): the all-gather's two forms, the plain linear
        "gather": lambda: True,
        "gated": lambda: False,
        "w_next": lambda: rand(gen, shape[-1], shape[-1], dtype=dtype) * shape[-1] ** -0.5,
        "overlap_min_tokens": lambda: 2048,
        # the norm GEMMs' hand-off: none (their own squares; the hand-off: test_linear_fused_ops.py)
        "parts": lambda: None,
    }
    values.update(block_fp8_gemm_args(shape, gen, dtype))
    for name in rotary_samples.NAMES:
        values[name] = functools.partial(rotary_samples.rotary_arg, name, shape, dtype, gen)
    for name in moe_samples.NAMES:
        values[name] = functools.partial(moe_samples.moe_arg, name, shape, dtype, gen)
    names = inspect.signature(op.reference).parameters
    if "scale_b" in names:  # the FP8 GEMMs
        return fp8_gemm_args(op, shape, gen, dtype)
    if "rotated" in names:  # a GEMM rotating its output: a position per row of x, two heads of [hidden] rotated
        values["positions"] = lambda: torch.randint(0, rotary_samples.POSITIONS, (math.prod(shape[:-1]),), generator=gen)
        values["w"] = lambda: rand(gen, 2 * shape[-1], shape[-1], dtype=dtype) * shape[-1] ** -0.5
        values["bias"] = lambda: rand(gen, 2 * shape[-1], dtype=dtype)
        values["rotated"] = lambda: 2 * shape[-1]
    return [rand(gen, *shape, dtype=dtype) if name in ("x", "y", "residual", "a", "b") else values[name]() for name in names]


def e4m3(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (rand(gen, *shape) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)


def fp8_gemm_args(op: OpDef, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> list[Any]:
    """The FP8 GEMMs' arguments: an e4m3 ``x`` of ``shape`` (a hand-off's reader: ``s * g`` in
    ``dtype`` with the squares of ``s`` by slot, g = 1), an e4m3 [hidden (x2 gated), hidden]
    weight, per-tensor scales (the input's 0.013, or 0.02 where the op quantizes it; the
    weight's 0.0021; the output's 0.01), the output in ``dtype``; a residual and norm weight as
    :func:`op_args` makes them."""
    from fxrewrite.runtime.ops.linear_fused import hand_off

    names = inspect.signature(op.reference).parameters
    gated = "silu_and_mul" in op.name
    values: dict[str, Any] = {"w": e4m3(gen, (1 + gated) * shape[-1], shape[-1]), "scale_a": torch.tensor(0.013),
                              "scale_b": torch.tensor(0.0021), "out_dtype": dtype, "eps": EPS,
                              "out_scale": torch.tensor(0.01), "residual": rand(gen, *shape, dtype=dtype),
                              "norm_weight": 1.0 + rand(gen, shape[-1], dtype=dtype) * 0.1}  # fmt: skip
    if "parts" in names:
        s = rand(gen, *shape, dtype=dtype)
        _, values["x"], values["parts"] = hand_off(s, torch.ones(shape[-1], dtype=dtype))
        values["scale"] = torch.tensor(0.02)
    else:
        values["x"], values["scale"] = e4m3(gen, *shape), torch.tensor(0.01)  # linear_fp8_silu_and_mul_quant's output
    return [values[name] for name in names]


def with_arg(op: OpDef, args: list[Any], name: str, value: Any) -> list[Any]:
    """``args`` with ``op``'s argument ``name`` set to ``value`` (unchanged when ``op`` has none)."""
    names = list(inspect.signature(op.reference).parameters)
    return [value if n == name else a for n, a in zip(names, args)]


def block_fp8_gemm_args(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> dict[str, Any]:
    """``fxr.linear_block_fp8``'s arguments, as makers: activations of ``shape``'s leading dims and
    K the last dim rounded up to 128, quantized per group of 128; a [128, K] weight per 128 x 128
    tile; the output in ``dtype``."""
    from fxrewrite.runtime.ops.linear_block_fp8 import quant_weight_block
    from fxrewrite.runtime.ops.quant_block import quant_fp8_block

    k = 128 * -(-shape[-1] // 128)
    made: dict[str, Any] = {}

    def make() -> None:
        if not made:
            made["a_q"], made["a_scale"] = quant_fp8_block(torch.randn(*shape[:-1], k, generator=gen))
            made["w_q"], made["w_scale"] = quant_weight_block(torch.randn(128, k, generator=gen) * k**-0.5)

    def get(name: str) -> Any:
        make()
        return made[name]

    return {**{n: functools.partial(get, n) for n in ("a_q", "a_scale", "w_q", "w_scale")}, "out_dtype": lambda: dtype}
