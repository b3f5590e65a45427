#!/usr/bin/env bash
# Call b (thirty-first session): the verification routine with call a's outcome in the tree: the
# whole GPU suite, the dense bench (fwd + bwd, bf16 and FP8, two rounds, vs cuDNN and flash
# SDPA) and the decode bench (bf16 and FP8 caches, % of the read bandwidth measured in the
# same run).
set -uo pipefail
OUTDIR=$1; w=/tmp/w; mkdir -p "$w/f1" "$OUTDIR"
trap 'cp "$w/f1/summary.txt" "$OUTDIR/" 2>/dev/null; tar -C "$w" -czf "$OUTDIR/logs.tgz" .' EXIT
PRECOMPILE_S=50 TESTS_S=230 BENCH_S=100 BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd bwd --rounds 2 --backends flashtile flashtile-fp8 cudnn flash" \
  DECODE_BENCH_S=150 bash benchmarks/device_session.sh "$w/f1" > "$w/session.log" 2>&1
cat "$w/f1/summary.txt"
grep -E "FAILED|ERROR|passed|failed" "$w/f1/gpu_tests.log" | tail -n 15
grep -A 20 "Geometric mean" "$w/f1/bench.md" | head -20
cut -c1-150 "$w/f1/decode_bench.log" | grep -v "TileLang\|compiling" | tail -n 45
