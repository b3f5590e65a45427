#!/usr/bin/env bash
# Call a (thirty-first session): the 256-thread V^T pre-pass at d_v >= 128 (transpose_v.threads_for)
# under the FP8 and CUDA-graph GPU tests, a second round of its timing, then the FP8 d = 128 tile
# A/B (the table's 192 x 96 long row against 128 x 192 and 128 x 224 one-tile kernels built with
# explicit epilogue syncs), each config first checked by the d = 128 FP8 GPU tests.
set -uo pipefail
OUTDIR=$1; w=${W:-/tmp/w}; mkdir -p "$w" "$OUTDIR"
[ "$w" = "$OUTDIR" ] || trap 'cp "$w/summary.txt" "$OUTDIR/" 2>/dev/null; tar -C "$w" -czf "$OUTDIR/logs.tgz" .' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/summary.txt"
timeout 100 python -m pytest -q -m gpu tests/test_gpu_fp8.py tests/test_gpu_graphs.py > "$w/fp8_graph_tests.txt" 2>&1; echo "fp8+graph tests rc=$?" >> "$w/summary.txt"
timeout 40 python3 benchmarks/transpose_ab.py --variants 64x128 > "$w/transpose.txt" 2>&1; echo "transpose rc=$?" >> "$w/summary.txt"
timeout 200 python3 benchmarks/tune.py fwd --fp8 --headdim 128 --seqlen 4096 16384 --check --repeat 2 --jobs 4 \
  --configs 192,96,2,384,1,1 128,192,2,256,1,1,1,0,0,1 128,224,2,256,1,1,1,0,0,1 > "$w/tune.txt" 2>&1; echo "tune rc=$?" >> "$w/summary.txt"
cat "$w/summary.txt"
grep -E "passed|failed|FAILED|Error" "$w/fp8_graph_tests.txt" | tail -n 12
grep -v "TileLang\|compiling" "$w/transpose.txt" | cut -c1-170 | tail -n 10
grep -E "^TUNE|^CHECK|passed|failed" "$w/tune.txt" | cut -c1-170 | tail -n 40
