#!/usr/bin/env bash
# Call b (forty-second session), in priority order (a cut call still returns the first logs):
# 1. d = 256 backward without atomics (prediction 14, NOTES): cuDNN's d = 256 bprop recomputes S
#    and dP for dQ (7 GEMMs instead of 5, no dQ reduce-add; SASS of h100-2026-12-07b/p2) and is
#    1.18x faster than our atomic kernel.  Our deterministic mode is the same split (dK/dV kernel
#    without dQ + a dQ kernel): its time against the default at d = 256, then its two kernels'
#    candidate tiles (the dK/dV kernel without the 64 KB dQ tile has room for two Q / dO stages).
# 2. Clocks: each backend's d = 128 backward sustained for 8 s while nvidia-smi samples every
#    50 ms (benchmarks/clock_probe.py, full and causal, 16k): rate per GHz.
# 3. The fortieth session's call b (ncu full set, --clock-control none, d = 128 full backward,
#    flashtile and cuDNN at 16k, then 4k).
#
#   bash benchmarks/h100-2026-12-08/b/run.sh $OUT
set -uo pipefail
OUTDIR=$1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUTDIR/gpu.txt"
bash benchmarks/kernel_cache.sh unpack
t="timeout 150 python3 benchmarks/tune.py"
{
  timeout 60 python3 benchmarks/det_ratio.py --headdim 256 --seqlen 4096 16384 --rounds 2
  $t bwd --det --headdim 256 --seqlen 4096 16384 --configs 64,64,1,256,1 64,64,2,256,1 --check --repeat 2 --jobs 8
  $t bwd_dq --headdim 256 --seqlen 4096 16384 --configs 64,64,1,128,0 64,64,2,128,0 128,64,1,256,0 128,32,2,256,1 --check --repeat 2 --jobs 8
} 2>&1 | grep -v "INFO\|^built" | tee "$OUTDIR/d256_split.txt"
for mask in "" --causal; do
  timeout 60 python3 benchmarks/clock_probe.py --seqlen 16384 --seconds 5 $mask 2>&1 | tee -a "$OUTDIR/clock_probe.txt"
done
NCU_SEQLENS=${NCU_SEQLENS:-16384} bash benchmarks/h100-2026-12-07f/b/run.sh "$OUTDIR"
