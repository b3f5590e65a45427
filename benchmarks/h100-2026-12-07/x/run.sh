#!/usr/bin/env bash
# Final-tree call (thirty-third session): the whole GPU suite and the dense bench (fwd + bwd,
# bf16 and FP8, two rounds, vs cuDNN and flash SDPA) on the tree as committed (d = 256 backward
# with `overlap`, `mma_row_sum` removed), preferably on an H200 (the last H200 bench is the
# twenty-ninth session's).  The device tool returns at most 8 files from $OUT, and
# `device_session.sh` writes more: it writes to /tmp/x, which is tarred into $OUT/logs.tgz
# (after a bounded run, so a cut-short run still returns its logs), with the summary beside it.
set -uo pipefail
OUTDIR=$1; w=/tmp/x; mkdir -p "$w"
PRECOMPILE_S=40 TESTS_S=${TESTS_S:-200} BENCH_S=${BENCH_S:-130} BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd bwd --rounds 2 --backends flashtile flashtile-fp8 cudnn flash" \
  timeout ${TOTAL_S:-420} bash benchmarks/device_session.sh "$w" > "$w/session.log" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$w" .
cp "$w/summary.txt" "$w/session.log" "$OUTDIR/" 2>/dev/null; cp "$w/bench.md" "$OUTDIR/" 2>/dev/null
cat "$w/summary.txt"
grep -E "FAILED|ERROR|passed|failed" "$w/gpu_tests.log" | tail -n 15
grep -A 20 "Geometric mean" "$w/bench.md" | head -24
