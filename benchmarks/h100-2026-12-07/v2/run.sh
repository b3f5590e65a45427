#!/usr/bin/env bash
# Verification call, short form (thirty-second session; never ran: no machine could be started
# for it).  For the tree of 3be54cb..4e7c7fc (`mma_row_sum` fixed and the default of the FP8
# d = 128 long row and the d = 256 row; the d = 256 backward with `overlap`); main has those
# defaults off again: `git apply benchmarks/h100-2026-12-07/staged-defaults.patch` first, then
# `kernel_cache.sh mark; fill 2;` the A/B's prebuilds; `prune; pack` (NOTES, thirty-second
# session, "For the next session").  The whole GPU suite first, then the same-run A/B of the FP8
# rows with and without `mma_row_sum` (NOTES prediction 6); the dense bench only with
# BENCH_S > 0.  Logs are written under $OUT as they go.
set -uo pipefail
OUTDIR=$1; mkdir -p "$OUTDIR/f1"
PRECOMPILE_S=30 TESTS_S=${TESTS_S:-220} BENCH_S=0 bash benchmarks/device_session.sh "$OUTDIR/f1" > "$OUTDIR/session.log" 2>&1
timeout ${TUNE_S:-45} python3 benchmarks/tune.py fwd --fp8 --headdim 128 --seqlen 4096 16384 --repeat 2 --jobs 4 \
  --configs 192,96,2,384,1,1 192,96,2,384,1,1,1,0,0,0,1 > "$OUTDIR/tune.txt" 2>&1; echo "tune d128 rc=$?" >> "$OUTDIR/f1/summary.txt"
timeout ${TUNE_S:-45} python3 benchmarks/tune.py fwd --fp8 --headdim 256 --seqlen 4096 16384 --repeat 2 --jobs 4 \
  --configs 128,128,2,256,1,1 128,128,2,256,1,1,1,0,0,0,1 >> "$OUTDIR/tune.txt" 2>&1; echo "tune d256 rc=$?" >> "$OUTDIR/f1/summary.txt"
if [ "${BENCH_S:-0}" != 0 ]; then
  timeout "$BENCH_S" python3 -m flashtile.bench --headdim 128 256 --seqlen 4k 16k --mode fwd bwd --rounds 2 --backends flashtile flashtile-fp8 cudnn \
    --time-limit $(( BENCH_S - 15 )) --markdown "$OUTDIR/f1/bench.md" > "$OUTDIR/f1/bench.log" 2>&1; echo "bench rc=$?" >> "$OUTDIR/f1/summary.txt"
fi
cat "$OUTDIR/f1/summary.txt"
grep -E "FAILED|ERROR|passed|failed" "$OUTDIR/f1/gpu_tests.log" | tail -n 15
grep -E "^TUNE" "$OUTDIR/tune.txt" | cut -c1-150
[ -f "$OUTDIR/f1/bench.md" ] && grep -A 12 "Geometric mean" "$OUTDIR/f1/bench.md" | head -14
