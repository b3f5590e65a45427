#!/usr/bin/env bash
# The whole GPU suite and the dense bench after an A/B (calls a and c): `device_session.sh` under
# one deadline, its logs tarred into OUTDIR/logs.tgz (the device tool returns at most 8 files),
# the summaries and bench beside it, and the lines worth reading printed.
#
#   suite_bench.sh WORKDIR OUTDIR      # TOTAL_S: the deadline (default 420); TESTS_S, BENCH_S
set -uo pipefail
w=$1; OUTDIR=$2
PRECOMPILE_S=40 TESTS_S=${TESTS_S:-230} BENCH_S=${BENCH_S:-130} BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd bwd --rounds 2 --backends flashtile flashtile-fp8 cudnn flash" \
  timeout ${TOTAL_S:-420} bash benchmarks/device_session.sh "$w" > "$w/session.log" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$w" .
cp "$w/summary.txt" "$w/ab_summary.txt" "$w/bench.md" "$OUTDIR/" 2>/dev/null
cat "$w/ab_summary.txt" "$w/summary.txt"
grep -E "FAILED|ERROR|passed|failed" "$w/gpu_tests.log" | tail -n 15
grep -A 20 "Geometric mean" "$w/bench.md" | head -24
