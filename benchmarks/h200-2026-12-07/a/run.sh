#!/usr/bin/env bash
# Call a (thirty-fourth session): the d = 256 backward with dQ reduce-added from registers
# (`dq_regs`, NOTES prediction 8) against the table's kernel, each after `quick.check`'s odd
# shapes, then the whole GPU suite and the dense bench on the tree as committed, where the
# d = 256 backward's default is staged as two stages + `dq_regs` (kept only if the A/B wins
# and the suite passes; the earlier default is the A/B's first config), on whichever GPU comes (status offered an H200; the last H200 bench is the
# twenty-ninth session's).  Logs go to /tmp/a and are tarred into $OUT/logs.tgz (the device
# tool returns at most 8 files), summary and tune lines beside it.
set -uo pipefail
OUTDIR=$1; w=/tmp/a; mkdir -p "$w"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/ab_summary.txt"
bash benchmarks/h200-2026-12-07/ab_bwd256.sh "$w" "$OUTDIR" "$w/ab_summary.txt"
PRECOMPILE_S=40 TESTS_S=${TESTS_S:-230} BENCH_S=${BENCH_S:-130} BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd bwd --rounds 2 --backends flashtile flashtile-fp8 cudnn flash" \
  timeout ${TOTAL_S:-420} bash benchmarks/device_session.sh "$w" > "$w/session.log" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$w" .
cp "$w/summary.txt" "$w/ab_summary.txt" "$w/bench.md" "$OUTDIR/" 2>/dev/null
cat "$w/ab_summary.txt" "$w/summary.txt"
grep -E "FAILED|ERROR|passed|failed" "$w/gpu_tests.log" | tail -n 15
grep -A 20 "Geometric mean" "$w/bench.md" | head -24
