#!/usr/bin/env bash
# Twenty-fifth session, call d (final): the whole GPU suite and the forward bench against cuDNN
# at HEAD (d <= 64 rows with per-thread partial row sums; kernels loaded without TileLang).
set -u
o=$1; mkdir -p "$o"
PRECOMPILE_S=60 TESTS_S=230 BENCH_S=150 BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd --backends flashtile flashtile-fp8 cudnn" \
  bash benchmarks/device_session.sh "$o/f1"
tar -C "$o" -czf "$o/logs.tgz" f1
