#!/bin/bash
# Sequence parallelism on two GPUs (bench/tp_gpu.sh with other tests and arguments), under 8 minutes:
#   1. the two-GPU tests of fxr.sp_reduce_add_rms_norm and of the TP model with it (-m gpu)
#   2. bench_tp: today's fused all-reduce + norm (pw-fi) against + sequence parallelism (pw-sp),
#      decode 1 / 8 / 64 and prefill 512 / 2048 / 4096 (8B shape, 32 layers), SP from 512 tokens
OUT="${OUT:-/tmp/tp-sp-out}" \
TESTS="tests/runtime/test_sequence_parallel_ops.py tests/bench/test_tp_model.py::test_sequence_parallel_tp2_equals_single_device_on_two_gpus" \
BENCH_ARGS="--shape 8b --systems pw-fi,pw-sp --decode 1,8,64 --prefill 512,2048,4096 --sp-min-tokens 512 --budget-s 200" \
    exec bash "$(dirname "$0")/tp_gpu.sh"
