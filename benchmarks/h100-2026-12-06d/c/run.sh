#!/usr/bin/env bash
# Call c (thirtieth session; the session's last device time, 388 s after failed starts and a
# machine taken back mid-call): the FP8 and CUDA-graph GPU tests with the 256-thread V^T
# pre-pass; a second round of the pre-pass tiles (64 keys x 128 threads = the old default);
# FP8 d = 128 long-row tiles, the table's 192 x 96 on three consumer warpgroups against
# 128 x 192 and 128 x 224 one-tile kernels built without TileLang's sync pass
# (FwdConfig.explicit_syncs), each first through the d = 128 FP8 GPU tests (--check).
set -uo pipefail
OUTDIR=$1; w=/tmp/w; mkdir -p "$w" "$OUTDIR"
trap 'cp "$w/summary.txt" "$OUTDIR/" 2>/dev/null; tar -C "$w" -czf "$OUTDIR/logs.tgz" .' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/summary.txt"
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu_graphs.py > "$w/gpu_tests.log" 2>&1; echo "fp8+graphs tests rc=$?" >> "$w/summary.txt"
grep -E "FAILED|ERROR|passed|failed" "$w/gpu_tests.log" | tail -n 6
timeout 25 python3 benchmarks/transpose_ab.py --variants 64x128 > "$w/transpose.txt" 2>&1; echo "transpose rc=$?" >> "$w/summary.txt"
grep -v "TileLang\|compiling" "$w/transpose.txt" | cut -c1-150 | tail -n 7
timeout 130 python3 benchmarks/tune.py fwd --fp8 --headdim 128 --seqlen 4096 16384 --check --repeat 2 --jobs 4 \
  --configs 192,96,2,384,1,1 128,192,2,256,1,1,1,0,0,1 128,224,2,256,1,1,1,0,0,1 > "$w/tune_fp8.txt" 2>&1
echo "tune rc=$?" >> "$w/summary.txt"
cat "$w/summary.txt"
grep -E "CHECK|TUNE|FAILED|failed|passed" "$w/tune_fp8.txt" | cut -c1-150
