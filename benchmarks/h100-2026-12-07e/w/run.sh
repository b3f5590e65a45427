#!/usr/bin/env bash
# Call w (thirty-ninth session), one device call, ~9.5 minutes on an H100 with the kernel pack
# carried; each step under its own deadline, the lines worth reading in summary.txt:
# 1. The eager plans (flashtile/eager_plans.py, new this session): their GPU tests (a planned
#    call bitwise equal to the general path's) and the host time per call
#    (benchmarks/launch_overhead.py: flash_attn_func no grad with a plan, the same call through
#    the general path, torch SDPA (flash backend)).  Prediction 12 (NOTES): no grad 48.7 ->
#    20-28 us on the H100 host, at or below SDPA's ~29.
# 2. Call v (benchmarks/h100-2026-12-07d/v/run.sh) with trimmed deadlines: the FP8 d = 64
#    short row under --check, prediction 11 (softmax_turns), the forward bench.
#
#   bash benchmarks/h100-2026-12-07e/w/run.sh $OUT
set -uo pipefail
OUTDIR=$1; S=$OUTDIR/summary_w.txt
bash benchmarks/kernel_cache.sh unpack > /dev/null
timeout ${PLANS_S:-70} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_eager_plans.py tests/test_gpu_graphs.py \
  > "$OUTDIR/gpu_plans.log" 2>&1
echo "plans tests rc=$?: $(tail -n 1 "$OUTDIR/gpu_plans.log")" | tee "$S"
grep -E "^FAILED|Error" "$OUTDIR/gpu_plans.log" | head -20 | cut -c1-200 | tee -a "$S"
(cd benchmarks && timeout ${HOST_S:-50} python3 launch_overhead.py > "$OUTDIR/launch_overhead.txt" 2>&1)
echo "launch_overhead rc=$?" | tee -a "$S"; grep -E "flash_attn_func|SDPA|empty|executable|launch_forward|kernels.forward" \
  "$OUTDIR/launch_overhead.txt" | tee -a "$S"
FP8_S=${FP8_S:-110} D64S_S=${D64S_S:-90} D128_S=${D128_S:-90} D64L_S=${D64L_S:-75} BENCH_S=${BENCH_S:-105} \
  bash benchmarks/h100-2026-12-07d/v/run.sh "$OUTDIR"
