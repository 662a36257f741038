#!/bin/bash
# Sequence parallelism and async TP on two GPUs (bench/tp_gpu.sh with other tests and arguments),
# about 4 minutes (at most 90 s of tests and 180 s of bench):
#   1. the two-GPU tests of fxr.sp_reduce_add_rms_norm, of the async-TP ops (symm-mem paths, one
#      CUDA graph of both) and of the TP model with async TP (piecewise and full graphs) (-m gpu)
#   2. bench_tp: today's fused all-reduce + norm (pw-fi) against + SP and async TP (pw-atp) and
#      + sequence parallelism alone (pw-sp), decode 1 / 8 / 64 and prefill 512 / 2048 / 4096 (8B shape, 32
#      layers), SP from 512 tokens; every column a capture size of every system (--max-capture
#      4096), so the prefill columns are replays, not eager runs
OUT="${OUT:-/tmp/tp-sp-out}" \
TESTS="tests/runtime/test_sequence_parallel_ops.py tests/runtime/test_async_tp_ops.py tests/bench/test_tp_model.py::test_async_tp_tp2_equals_single_device_on_two_gpus" \
TESTS_TIMEOUT=90 BENCH_TIMEOUT=180 \
BENCH_ARGS="--shape 8b --systems pw-fi,pw-sp,pw-atp --decode 1,8,64 --prefill 512,2048,4096 --max-capture 4096 --sp-min-tokens 512 --budget-s 140" \
    exec bash "$(dirname "$0")/tp_gpu.sh"
