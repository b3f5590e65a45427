#!/usr/bin/env bash
# Call a1 (thirty-fourth session): call a cut to what ~250 s of device time holds: the d = 256
# backward A/B of prediction 8 (table kernel, one stage + `dq_regs`, two stages + `dq_regs`,
# each after `quick.check`), then the GPU tests that run d = 256 / 192 kernels on the staged
# default (dense, packed, deterministic; 23 tests), not the whole suite.
set -uo pipefail
OUTDIR=$1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUTDIR/summary.txt"
TUNE_S=${TUNE_S:-120} bash benchmarks/h200-2026-12-07/ab_bwd256.sh /tmp "$OUTDIR" "$OUTDIR/summary.txt"
t0=$(date +%s)
timeout ${TESTS_S:-110} python3 -m pytest -q -m gpu -p no:cacheprovider tests/ \
  -k "(256 or 192) and not fp8 and not decode and not kvcache and not Fp8" > /tmp/gpu_tests.log 2>&1
echo "gpu tests (d=256/192 subset): rc=$? $(( $(date +%s) - t0 ))s: $(tail -n 1 /tmp/gpu_tests.log)" | tee -a "$OUTDIR/summary.txt"
grep -E "FAILED|ERROR|passed|failed" /tmp/gpu_tests.log | tail -n 15
xz -c /tmp/gpu_tests.log > "$OUTDIR/gpu_tests.log.xz"; xz -c /tmp/tune_bwd256.txt > "$OUTDIR/tune_bwd256.txt.xz"
