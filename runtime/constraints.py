"""What a kernel accepts: the per-call constraints an op module's :class:`providers.Kernel`
checks before it serves a call (dtype, device, alignment, layout, row width). Each returns None
when the call can be served, else the reason it cannot, which :func:`providers.dispatch` counts as
the fallback's key."""

from __future__ import annotations

import torch

HALF_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


def check_half(*tensors: torch.Tensor) -> str | None:
    """Every library's kernels take bf16/fp16 only, all tensors of one dtype (no casts inside)."""
    dtype = tensors[0].dtype
    if dtype not in HALF_DTYPES:
        return f"dtype {_short(dtype)} not bf16/fp16"
    for t in tensors[1:]:
        if t.dtype != dtype:
            return f"dtype {_short(t.dtype)} != input dtype {_short(dtype)}"
    return None


def check_same_device(x: torch.Tensor, *others: torch.Tensor) -> str | None:
    for t in others:
        if t.device != x.device:
            return f"tensor on {t.device}, input on {x.device}"
    return None


def is_aligned(t: torch.Tensor, nbytes: int, *strides: int) -> bool:
    """``t``'s address and each given stride (in elements) are multiples of ``nbytes``."""
    size = t.element_size()
    return t.data_ptr() % nbytes == 0 and all(s * size % nbytes == 0 for s in strides)


TRITON_MAX_ROW = 32768
"""Most values of one row a Triton program holds (our norm kernels reduce a row in one program)."""


def check_triton_row(n: int) -> str | None:
    return None if n <= TRITON_MAX_ROW else f"row of {n} values exceeds one Triton program ({TRITON_MAX_ROW})"


def check_float(t: torch.Tensor) -> str | None:
    """A float of 16 or 32 bits (what our Triton kernels load and store)."""
    if t.dtype.is_floating_point and t.element_size() in (2, 4):
        return None
    return f"dtype {_short(t.dtype)} is not a float of 16 or 32 bits"


def check_rows_at_one_stride(x: torch.Tensor, *others: torch.Tensor) -> str | None:
    """What a kernel that walks rows by one stride needs of ``x`` and equally shaped ``others``:
    a float of 16 or 32 bits, one dtype, non-empty, the last dim contiguous, all rows one stride
    apart (``t.view(-1, t.shape[-1])`` is a view)."""
    for t in (x, *others):
        if reason := check_float(t):
            return reason
        if t.shape != x.shape or t.dtype != x.dtype:
            return f"{t.dtype}{tuple(t.shape)} != input {x.dtype}{tuple(x.shape)}"
    if x.dim() == 0 or x.numel() == 0:
        return "empty input"
    for t in (x, *others):
        if t.stride(-1) != 1:
            return "last dim not contiguous"
        try:
            t.view(-1, t.shape[-1])
        except RuntimeError:
            return "rows not at one stride"
    return None


def check_strided_rows(*tensors: torch.Tensor) -> str | None:
    """What a strided-rows kernel (Triton's norms and activations) needs of equally shaped
    tensors: floating point, one device, a contiguous non-empty last dim, leading dims that
    :func:`leading_dims` can index, and no two at one address."""
    x = tensors[0]
    for t in tensors:
        if reason := check_float(t):
            return reason
        if t.shape != x.shape:
            return f"shape {tuple(t.shape)} != input shape {tuple(x.shape)}"
        if t.device != x.device:
            return f"{t.device} != {x.device}"
        if t.dim() and t.stride(-1) != 1:
            return "last dim not contiguous"
    if x.numel() == 0 or x.dim() == 0:
        return "empty input"
    if len({t.data_ptr() for t in tensors}) != len(tensors):
        return "inputs share memory"
    if leading_dims(*tensors) is None:
        return f"more than {LEADING_DIMS} leading dims at independent strides {tuple(x.stride())}"
    return check_triton_row(x.shape[-1])


LEADING_DIMS = 3
"""How many leading dims at independent strides a strided-rows kernel indexes (Triton's norm and
activation kernels): ``[B, T, H, D]`` read through a view of a merged projection needs two."""


def leading_dims(*tensors: torch.Tensor, most: int = LEADING_DIMS) -> tuple[list[int], list[list[int]]] | None:
    """The leading dims (all but the last) of equally shaped ``tensors``, collapsed where every
    tensor allows it (``stride[i] == stride[i + 1] * size[i + 1]``) and padded with size-1 dims
    to exactly ``most``: ``(sizes, strides per tensor)``; None when more than ``most`` remain.

        >>> qkv = torch.empty(2, 5, 768)                       # q: 8 heads of 64 from a merged projection
        >>> leading_dims(qkv[..., :512].view(2, 5, 8, 64))
        ([1, 10, 8], [[0, 768, 64]])
    """
    shape = list(tensors[0].shape[:-1])
    strides = [list(t.stride()[:-1]) for t in tensors]
    keep = [i for i, n in enumerate(shape) if n != 1]
    sizes, out = [], [[] for _ in tensors]
    for i in keep:
        if sizes and all(o[-1] == st[i] * shape[i] for o, st in zip(out, strides)):
            sizes[-1] *= shape[i]
            for o, st in zip(out, strides):
                o[-1] = st[i]
            continue
        sizes.append(shape[i])
        for o, st in zip(out, strides):
            o.append(st[i])
    if len(sizes) > most:
        return None
    pad = most - len(sizes)
    return [1] * pad + sizes, [[0] * pad + o for o in out]


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
