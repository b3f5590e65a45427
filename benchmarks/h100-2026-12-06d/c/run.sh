#!/usr/bin/env bash
# Call c (thirtieth session; the last ~300 s of device time after failed starts and a machine
# taken back mid-call): the FP8 and CUDA-graph GPU tests with the 256-thread V^T pre-pass, then
# a second round of the pre-pass tiles (64 keys x 128 threads = the old default).  The FP8
# d = 128 tile A/B (tune.py with FwdConfig.explicit_syncs) did not fit; NOTES give its command.
set -uo pipefail
OUTDIR=$1; w=/tmp/w; mkdir -p "$w" "$OUTDIR"
trap 'cp "$w/summary.txt" "$OUTDIR/" 2>/dev/null; tar -C "$w" -czf "$OUTDIR/logs.tgz" .' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/summary.txt"
timeout 50 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu_graphs.py > "$w/gpu_tests.log" 2>&1; echo "fp8+graphs tests rc=$?" >> "$w/summary.txt"
grep -E "FAILED|ERROR|passed|failed" "$w/gpu_tests.log" | tail -n 6
timeout 25 python3 benchmarks/transpose_ab.py --variants 64x128 > "$w/transpose.txt" 2>&1; echo "transpose rc=$?" >> "$w/summary.txt"
grep -v "TileLang\|compiling" "$w/transpose.txt" | cut -c1-150 | tail -n 7
cat "$w/summary.txt"
