#!/bin/bash
# Sequence parallelism and async TP on two GPUs (bench/tp_gpu.sh with other tests and arguments),
# about 9 minutes (at most 120 s of tests and 400 s of bench):
#   1. the two-GPU tests of fxr.sp_reduce_add_rms_norm, of the async-TP ops (symm-mem paths, three
#      back to back, one CUDA graph of both) and of the TP model with async TP (modes none,
#      piecewise and full) (-m gpu)
#   2. bench_tp, issue 32's table: plain TP (pw-none), today's fused all-reduce + norm (pw-fi),
#      + sequence parallelism (pw-sp), + async TP (pw-atp); then today's fusion and async TP with
#      prefill in full CUDA graphs too (full-fi-all, full-atp: no host launches between pieces,
#      where piecewise prefill 512 is host-bound). Decode 1 / 8 / 64 and prefill 512 / 2048 / 4096
#      (8B shape, 32 layers), SP from 512 tokens, every column a capture size (--max-capture 4096).
#      Rows on a noisy pair move between runs: name a system twice in --systems to repeat it.
OUT="${OUT:-/tmp/tp-sp-out}" \
TESTS="tests/runtime/test_sequence_parallel_ops.py tests/runtime/test_async_tp_ops.py tests/bench/test_tp_model.py::test_async_tp_tp2_equals_single_device_on_two_gpus" \
TESTS_TIMEOUT=120 BENCH_TIMEOUT=400 \
BENCH_ARGS="--shape 8b --systems pw-none,pw-fi,pw-sp,pw-atp,full-fi-all,full-atp --decode 1,8,64 --prefill 512,2048,4096 --max-capture 4096 --sp-min-tokens 512 --budget-s 330" \
    exec bash "$(dirname "$0")/tp_gpu.sh"
