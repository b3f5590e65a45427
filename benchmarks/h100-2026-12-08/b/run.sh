#!/usr/bin/env bash
# Call b (forty-second session), in priority order (a cut call still returns the first logs):
# 1. Prediction 15 (NOTES): the d = 256 dK/dV kernel of kernels/bwd_wide.py (both consumer
#    warpgroups compute the whole S^T / dP^T and own a column half of dK, dV, dQ, as cuDNN's
#    d = 256 bprop does) against the table's builder kernel, checked and timed in one process,
#    then its GPU tests (tests/test_gpu_kernels.py -k wide: GQA, masks, sinks, fp16, det mode).
# 2. Prediction 14: our deterministic mode's split (dK/dV without dQ, then a dQ kernel) at
#    d = 256 against the default, then its two kernels' candidate tiles.
# 3. Clocks: each backend's d = 128 backward sustained for 5 s while nvidia-smi samples every
#    50 ms (benchmarks/clock_probe.py, full and causal, 16k): rate per GHz.
# 4. The fortieth session's call b (ncu full set, --clock-control none, d = 128 full backward,
#    flashtile and cuDNN at 16k).
#
#   bash benchmarks/h100-2026-12-08/b/run.sh $OUT
set -uo pipefail
OUTDIR=$1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUTDIR/gpu.txt"
bash benchmarks/kernel_cache.sh unpack
t="timeout 150 python3 benchmarks/tune.py"
{
  $t bwd --headdim 256 --seqlen 4096 16384 --configs 64,64,1,256,1 64,64,1,256,1,0,0,0,0,0,1 --check --repeat 2 --jobs 8
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_varlen.py -k wide 2>&1 | tail -15
} 2>&1 | grep -v "INFO\|^built" | tee "$OUTDIR/d256_wide.txt"
{
  timeout 60 python3 benchmarks/det_ratio.py --headdim 256 --seqlen 4096 16384 --rounds 2
  $t bwd --det --headdim 256 --seqlen 4096 16384 --configs 64,64,1,256,1 64,64,2,256,1 --check --repeat 2 --jobs 8
  $t bwd_dq --headdim 256 --seqlen 4096 16384 --configs 64,64,1,128,0 64,64,2,128,0 128,64,1,256,0 128,32,2,256,1 --check --repeat 2 --jobs 8
} 2>&1 | grep -v "INFO\|^built" | tee "$OUTDIR/d256_split.txt"
for mask in "" --causal; do
  timeout 60 python3 benchmarks/clock_probe.py --seqlen 16384 --seconds 5 $mask 2>&1 | tee -a "$OUTDIR/clock_probe.txt"
done
NCU_SEQLENS=${NCU_SEQLENS:-16384} bash benchmarks/h100-2026-12-07f/b/run.sh "$OUTDIR"
