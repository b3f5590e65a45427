#!/usr/bin/env bash
# Call b (thirty-fourth session): the whole GPU suite and the dense bench (fwd + bwd, bf16 and
# FP8, two rounds, vs cuDNN and flash SDPA) on the tree as committed, kernels from the carried
# pack.  Logs go to /tmp/b, tarred into $OUT/logs.tgz (the device tool returns at most 8
# files), summary and bench table beside it.  DECODE_BENCH_S=<s> adds the decode bench.
set -uo pipefail
OUTDIR=$1; w=/tmp/b; mkdir -p "$w"
PRECOMPILE_S=${PRECOMPILE_S:-60} TESTS_S=${TESTS_S:-240} BENCH_S=${BENCH_S:-140} BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd bwd --rounds 2 --backends flashtile flashtile-fp8 cudnn flash" \
  timeout ${TOTAL_S:-480} bash benchmarks/device_session.sh "$w" > "$w/session.log" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$w" .
cp "$w/summary.txt" "$w/bench.md" "$OUTDIR/" 2>/dev/null
cat "$w/summary.txt"
grep -E "FAILED|ERROR|passed|failed" "$w/gpu_tests.log" | tail -n 15
grep -A 20 "Geometric mean" "$w/bench.md" | head -24
