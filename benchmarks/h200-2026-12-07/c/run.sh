#!/usr/bin/env bash
# Call c (thirty-fifth session): prediction 8 decided on the device, then the whole GPU suite and
# the dense bench on the tree the A/B chose, in one call (device starts are rare: NOTES).
# 1. `ab_bwd256.sh`: the d = 256 backward's table kernel, one stage + `dq_regs`, two stages +
#    `dq_regs`, each after `quick.check`'s odd shapes; 4k / 16k, full / causal, two rounds.
# 2. `decide.py`: the two-stage variant wins only if it is faster than the table kernel in every
#    one of the eight timings; then `staged-dq-regs.patch`'s config line replaces the default's
#    in this copy of the tree (the kernel pack holds both trees' kernels).
# 3. `device_session.sh`: the whole GPU suite and the dense bench on that tree.
# Logs go to /tmp/c and are tarred into $OUT/logs.tgz (the device tool returns at most 8 files).
set -uo pipefail
OUTDIR=$1; w=/tmp/c; here=benchmarks/h200-2026-12-07; mkdir -p "$w"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/ab_summary.txt"
bash benchmarks/kernel_cache.sh unpack >/dev/null
TUNE_S=${TUNE_S:-150} TUNE_JOBS=12 bash $here/ab_bwd256.sh "$w" "$OUTDIR" "$w/ab_summary.txt"
if python3 $here/c/decide.py "$OUTDIR/tune_lines.txt" | tee -a "$w/ab_summary.txt" | grep -q "^KEEP"; then
  python3 $here/c/decide.py --stage flashtile/kernels/configs.py | tee -a "$w/ab_summary.txt"
fi
PRECOMPILE_S=40 TESTS_S=${TESTS_S:-230} BENCH_S=${BENCH_S:-130} BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd bwd --rounds 2 --backends flashtile flashtile-fp8 cudnn flash" \
  timeout ${TOTAL_S:-380} bash benchmarks/device_session.sh "$w" > "$w/session.log" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$w" .
cp "$w/summary.txt" "$w/ab_summary.txt" "$w/bench.md" "$OUTDIR/" 2>/dev/null
cat "$w/ab_summary.txt" "$w/summary.txt"
grep -E "FAILED|ERROR|passed|failed" "$w/gpu_tests.log" | tail -n 15
grep -A 20 "Geometric mean" "$w/bench.md" | head -24
