#!/usr/bin/env bash
# Call b (forty-second session): the d = 128 backward's steady-state gap to cuDNN (NOTES,
# forty-first session).  First the clocks: each backend's backward sustained for 8 s while
# nvidia-smi samples every 50 ms (benchmarks/clock_probe.py, full and causal, 16k), so the
# rate per GHz separates the power cap from the kernel.  Then the fortieth session's call b
# (ncu full set, --clock-control none, flashtile and cuDNN at 16k and 4k).
#
#   bash benchmarks/h100-2026-12-08/b/run.sh $OUT
set -uo pipefail
OUTDIR=$1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUTDIR/gpu.txt"
bash benchmarks/kernel_cache.sh unpack
for mask in "" --causal; do
  timeout 120 python3 benchmarks/clock_probe.py --seqlen 16384 $mask 2>&1 | tee -a "$OUTDIR/clock_probe.txt"
done
bash benchmarks/h100-2026-12-07f/b/run.sh "$OUTDIR"
