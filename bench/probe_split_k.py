"""Probe (issue 30, item 4): the decode GEMM split along k, where a GEMM leaves SMs idle. Tried, not kept.

    source .devkit/setup.sh && python3 bench/probe_split_k.py

The 8B layer's qkv (6144 x 4096: 96 programs of 64 columns on 132 SMs), o (4096 x 4096: 128
programs of 32 columns, 8 k steps each) and down (4096 x 14336) projections, at 1 and 8 rows. A
split-k kernel gives program (p, s) the ``BN`` columns p over the k range s of ``split``, and adds
its partial sums into a float32 output with atomics. The output is zeroed by a memset in the
same graph, and the memsets alone are timed and subtracted: the split kernel is timed without the
reduction a real one would need. It is set beside ``fxr.linear`` with plain launches on the same
weights: 32 weights per shape (cold, as in a step), one CUDA graph of the 32 calls, median of 20
replays. Its error against float32 is printed too. The three fastest of the launch
configurations (BN, BK, stages, split) are printed per shape and row count.

Result (bench/RESULTS.md, nineteenth session, H100): at split 2, o 0.96-0.97x ``fxr.linear``'s
time and qkv 0.976x at 8 rows (1.011x at 1), down 1.00x, all before any reduction: about 0.6% of
the step at most, less what the reduction costs. Not kept.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import graph_ms  # noqa: E402
from bench_e2e import Clock  # noqa: E402
from bench_gemm import projections  # noqa: E402

import fxrewrite.runtime.ops  # noqa: E402, F401  (torch.ops.fxr.*)
from fxrewrite.runtime import triton_gemm  # noqa: E402

CONFIGS = [(32, 512, 4, 1), (32, 512, 4, 2), (32, 256, 4, 2), (32, 256, 4, 4), (32, 256, 3, 4), (64, 256, 4, 2),
           (64, 256, 4, 4), (32, 128, 4, 8), (64, 128, 4, 8), (16, 512, 4, 2), (16, 256, 4, 4)]  # fmt: skip


@triton.jit
def _split_kernel(x_ptr, w_ptr, y_ptr, rows, n, k, chunk, BN: tl.constexpr, BK: tl.constexpr):
    pid, split = tl.program_id(0), tl.program_id(1)
    cols = pid * BN + tl.arange(0, BN)
    r = tl.arange(0, 16)
    acc = tl.zeros([16, BN], tl.float32)
    for k0 in range(split * chunk, (split + 1) * chunk, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + r[:, None] * k + ks[None, :], mask=(r < rows)[:, None], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * k + ks[None, :])
        acc += tl.dot(x, tl.trans(w))
    tl.atomic_add(y_ptr + r[:, None] * n + cols[None, :], acc, mask=(r < rows)[:, None], sem="relaxed")


def main() -> None:
    device = torch.device("cuda")
    bandwidth = Clock(device).copy_bandwidth(device, 2 << 30)  # as bench_e2e's floor
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")  # fmt: skip
    print("| projection | rows | floor ms | fxr.linear ms | fastest split-k (BN, BK, stages, split): ms, / fxr.linear, err |")
    print("|---|---|---|---|---|")
    shapes = projections()
    for name in ("qkv", "o", "down"):
        n, k = shapes[name]
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(32)]
        floor = 1e3 * 32 * n * k * 2 / bandwidth
        for rows in (1, 8):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            y = torch.zeros(rows, n, device=device, dtype=torch.float32)
            ref = x.float() @ weights[0].float().T
            with triton_gemm.without_pdl():
                base = graph_ms(lambda: [torch.ops.fxr.linear.default(x, w) for w in weights])
            memsets = graph_ms(lambda: [y.zero_() for _ in weights])
            found = []
            for bn, bk, stages, split in CONFIGS:
                if (k // split) % bk:
                    continue

                def call(w: torch.Tensor, bn: int = bn, bk: int = bk, stages: int = stages, split: int = split) -> None:
                    y.zero_()
                    _split_kernel[(triton.cdiv(n, bn), split)](x, w, y, rows, n, k, k // split, BN=bn, BK=bk,
                                                               num_warps=4, num_stages=stages)  # fmt: skip

                call(weights[0])
                err = float((y - ref).abs().max() / ref.abs().max())
                ms = graph_ms(lambda call=call: [call(w) for w in weights]) - memsets
                found.append((ms, f"({bn}, {bk}, {stages}, {split}): {ms:.3f}, {ms / base:.3f}, {err:.0e}"))
            best = "; ".join(text for _, text in sorted(found)[:3])
            print(f"| {name} | {rows} | {floor:.3f} | {base:.3f} | {best} |", flush=True)
        del weights


if __name__ == "__main__":
    main()
