#!/usr/bin/env bash
# (Never ran: no machine could be started for it; see v2/run.sh for the defaults it assumes.)
# Verification call, shortest form (thirty-second session: refused starts left ~300 s of device
# time): the whole GPU suite under a deadline (the FP8 and graph tests run early in it), then
# one round of the FP8 d = 128 16k A/B with and without `mma_row_sum`.  Logs under $OUT.
set -uo pipefail
OUTDIR=$1; mkdir -p "$OUTDIR/f1"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUTDIR/summary.txt"
timeout ${TESTS_S:-165} python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$OUTDIR/f1/gpu_tests.log" 2>&1; echo "gpu tests rc=$?" >> "$OUTDIR/summary.txt"
timeout ${TUNE_S:-25} python3 benchmarks/tune.py fwd --fp8 --headdim 128 --seqlen 4096 16384 --jobs 4 \
  --configs 192,96,2,384,1,1 192,96,2,384,1,1,1,0,0,0,1 > "$OUTDIR/tune.txt" 2>&1; echo "tune rc=$?" >> "$OUTDIR/summary.txt"
cat "$OUTDIR/summary.txt"
grep -E "FAILED|ERROR|passed|failed" "$OUTDIR/f1/gpu_tests.log" | tail -n 15
grep -E "^TUNE" "$OUTDIR/tune.txt" | cut -c1-150
