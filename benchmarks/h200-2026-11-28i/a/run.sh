#!/usr/bin/env bash
# Twenty-fifth session, call a: the whole GPU suite with kernels loaded by structure id (first
# time since that change), then the dense forward bench against cuDNN and the decode bench.
set -u
o=$1; mkdir -p "$o"
PRECOMPILE_S=40 TESTS_S=230 BENCH_S=110 BENCH_FLAGS="--headdim 128 256 --seqlen 4k 16k --mode fwd --backends flashtile flashtile-fp8 cudnn" \
  DECODE_BENCH_S=170 bash benchmarks/device_session.sh "$o/f1"
grep -E "passed|failed|error" "$o/f1/gpu_tests.log" | tail -5
tar -C "$o" -czf "$o/logs.tgz" f1
