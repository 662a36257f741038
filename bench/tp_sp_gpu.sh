#!/bin/bash
# Sequence parallelism on two GPUs, from the repository root (carry .devkit), under 8 minutes:
#   1. the two-GPU tests of the SP op and of the TP model with SP (-m gpu)
#   2. bench/bench_tp.py: today's fused all-reduce + norm against + sequence parallelism,
#      decode 1 / 8 / 64 and prefill 512 / 2048 / 4096 (8B shape, 32 layers; budget 240 s)
# Logs and the markdown table go to $OUT (default /tmp/tp-sp-out); the table is printed last.
set -u
OUT="${OUT:-/tmp/tp-sp-out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast here
export PYTHONUNBUFFERED=1
T0=$(date +%s)
source .devkit/setup.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || echo "pip install failed (see pip.log)"
python3 -c "import torch, torch.distributed._symmetric_memory; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(),
  'symm_mem fused_all_gather_matmul', hasattr(torch.ops.symm_mem, 'fused_all_gather_matmul'),
  'fused_matmul_reduce_scatter', hasattr(torch.ops.symm_mem, 'fused_matmul_reduce_scatter'))" 2>&1 | tee "$OUT/env.log"

echo "== two-GPU tests ($(($(date +%s) - T0)) s)"
timeout -k 10 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/runtime/test_sequence_parallel_ops.py \
    "tests/bench/test_tp_model.py::test_sequence_parallel_tp2_equals_single_device_on_two_gpus" > "$OUT/tests.log" 2>&1
echo "tests exit code $? (124: timed out)" | tee -a "$OUT/tests.log"

echo "== bench_tp ($(($(date +%s) - T0)) s)"
timeout -k 10 300 torchrun --nproc-per-node 2 bench/bench_tp.py --shape 8b --systems pw-fi,pw-sp --decode 1,8,64 \
    --prefill 512,2048,4096 --sp-min-tokens 512 --budget-s 240 --out "$OUT/tp_sp_results.md" > "$OUT/bench.log" 2>&1
echo "bench exit code $? (124: timed out)" | tee -a "$OUT/bench.log"

echo "== summary ($(($(date +%s) - T0)) s); logs in $OUT"
grep -E "^(FAILED|ERROR)|passed|failed|exit code" "$OUT/tests.log" | cut -c1-400 | tail -20
grep -E "Error|error|exit code" "$OUT/bench.log" | grep -v "rel err" | tail -8
echo
cat "$OUT/tp_sp_results.md" 2>/dev/null || { echo "no table; bench.log tail:"; tail -30 "$OUT/bench.log"; }
