#!/bin/bash
# One run on a machine with two GPUs, from the repository root (carry .devkit), under 8 minutes:
#   1. the two-GPU tests (tests/runtime/test_collective_ops.py, tests/bench/test_tp_model.py, -m gpu)
#   2. bench/bench_tp.py under torchrun --nproc-per-node 2 (8B shape, 32 layers; budget 180 s)
# Logs and the markdown table go to $OUT (default /tmp/tp-out); the table is printed last.
# TESTS and BENCH_ARGS replace the tests and bench_tp's arguments, TESTS_TIMEOUT and BENCH_TIMEOUT
# their time limits in seconds (bench/tp_sp_gpu.sh sets them).
set -u
OUT="${OUT:-/tmp/tp-out}"
TESTS="${TESTS:-tests/runtime/test_collective_ops.py tests/bench/test_tp_model.py}"
BENCH_ARGS="${BENCH_ARGS:---shape 8b --budget-s 180}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast here
export PYTHONUNBUFFERED=1
T0=$(date +%s)
source .devkit/setup.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || echo "pip install failed (see pip.log)"
python3 -c "import torch, fxrewrite; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), fxrewrite.__file__)" 2>&1 | tee "$OUT/env.log"
python3 -c "import torch, torch.distributed._symmetric_memory; print('symm_mem fused_all_gather_matmul',
  hasattr(torch.ops.symm_mem, 'fused_all_gather_matmul'), 'fused_matmul_reduce_scatter',
  hasattr(torch.ops.symm_mem, 'fused_matmul_reduce_scatter'))" 2>&1 | tail -1 | tee -a "$OUT/env.log"
python3 -c "import flashinfer.comm as c; print('flashinfer.comm ok', c.trtllm_allreduce_fusion.__module__)" 2>&1 | tail -2 | tee -a "$OUT/env.log"
nvidia-smi topo -m >> "$OUT/env.log" 2>&1

echo "== two-GPU tests ($(($(date +%s) - T0)) s)"
timeout -k 10 "${TESTS_TIMEOUT:-180}" python3 -m pytest -q -s -m gpu -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
echo "tests exit code $? (124: timed out)" | tee -a "$OUT/tests.log"

echo "== bench_tp ($(($(date +%s) - T0)) s)"
timeout -k 10 "${BENCH_TIMEOUT:-250}" torchrun --nproc-per-node 2 bench/bench_tp.py $BENCH_ARGS --out "$OUT/tp_results.md" > "$OUT/bench.log" 2>&1
echo "bench exit code $? (124: timed out)" | tee -a "$OUT/bench.log"

echo "== summary ($(($(date +%s) - T0)) s); logs in $OUT"
grep -E "^(FAILED|ERROR)|passed|failed|rank [01]|exit code" "$OUT/tests.log" | cut -c1-400 | tail -40
grep -E "Error|error|exit code" "$OUT/bench.log" | grep -v "rel err" | tail -8
echo
cat "$OUT/tp_results.md" 2>/dev/null || { echo "no table; bench.log tail:"; tail -30 "$OUT/bench.log"; }
