#!/usr/bin/env bash
# Twenty-fifth session, call g: the whole GPU suite at HEAD (after the d <= 64 short row lost its
# full-attention turns), then forward and backward against cuDNN at 1k / 4k (no precompile:
# every kernel loads by structure id from the carried pack).
set -u
o=$1; mkdir -p "$o"
PRECOMPILE_S=1 TESTS_S=150 BENCH_S=110 BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k --mode fwd bwd --backends flashtile cudnn" \
  bash benchmarks/device_session.sh "$o/f1"
rm -f "$o/f1/bench.png"
tar -C "$o" -czf "$o/logs.tgz" f1
