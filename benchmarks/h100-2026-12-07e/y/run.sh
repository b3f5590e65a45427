#!/usr/bin/env bash
# Call y (thirty-ninth session), ~3 minutes on an H100 with the kernel pack carried: the GPU tests
# of what changed after call s (eager plans recorded on a key's second call; the FP8 d = 64 short
# row selected) and the host time per call.
#
#   bash benchmarks/h100-2026-12-07e/y/run.sh $OUT
set -uo pipefail
OUTDIR=$1; S=$OUTDIR/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
bash benchmarks/kernel_cache.sh unpack | tee -a "$S"
timeout ${TESTS_S:-120} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_eager_plans.py \
  tests/test_gpu_graphs.py tests/test_gpu_fp8.py > "$OUTDIR/gpu_tests.log" 2>&1
echo "gpu tests rc=$?: $(tail -n 1 "$OUTDIR/gpu_tests.log")" | tee -a "$S"
grep -E "^FAILED" "$OUTDIR/gpu_tests.log" | head -10 | cut -c1-200 | tee -a "$S"
(cd benchmarks && timeout ${HOST_S:-45} python3 launch_overhead.py > "$OUTDIR/launch_overhead.txt" 2>&1)
echo "launch_overhead rc=$?" | tee -a "$S"; grep -E "us  " "$OUTDIR/launch_overhead.txt" | head -16 | tee -a "$S"
