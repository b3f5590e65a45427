#!/usr/bin/env bash
# Call a (28th session): the staged ordered dQ adds first (GPU test in a child process under a
# timeout, then det_ratio --ordered), the CUDA-graph tests after their refactor, the FP8 call's
# time split (V^T pre-pass vs attention kernel), and cuDNN's B=12 32k decode kernel beside ours
# under ncu (grid, bytes, L2 hit rate).
set -uo pipefail
OUTDIR=$1; w=/tmp/w; mkdir -p "$w" "$OUTDIR"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/summary.txt"
timeout 330 python -m pytest -q -m gpu tests/test_gpu_ordered_dq.py > "$w/ordered_test.txt" 2>&1; echo "ordered test rc=$?" >> "$w/summary.txt"
timeout 160 python3 benchmarks/det_ratio.py --ordered --rounds 2 > "$w/det_ratio.txt" 2>&1; echo "det_ratio rc=$?" >> "$w/summary.txt"
timeout 100 python -m pytest -q -m gpu tests/test_gpu_graphs.py > "$w/graphs.txt" 2>&1; echo "graphs rc=$?" >> "$w/summary.txt"
timeout 80 python3 benchmarks/fp8_breakdown.py --headdim 128 256 --seqlen 4096 16384 > "$w/fp8_full.txt" 2>&1; echo "fp8 full rc=$?" >> "$w/summary.txt"
timeout 80 python3 benchmarks/fp8_breakdown.py --headdim 128 256 --seqlen 4096 16384 --causal > "$w/fp8_causal.txt" 2>&1; echo "fp8 causal rc=$?" >> "$w/summary.txt"
if command -v ncu >/dev/null; then
timeout 120 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
  python3 benchmarks/decode_profile.py --cudnn 12:32768:1:contig 1:131072:1:contig > "$w/ncu_decode.txt" 2>&1; echo "ncu rc=$?" >> "$w/summary.txt"
fi
for f in ordered_test det_ratio graphs fp8_full fp8_causal; do echo "== $f"; grep -v "TileLang\|compiling" "$w/$f.txt" | cut -c1-160 | tail -n 30; done
echo "== ncu"; grep -E "main_kernel|cudnn|sm90|Duration|DRAM Throughput|Memory Throughput|Grid Size|Block Size|L2 Hit|Registers|Achieved Occ|Waves" "$w/ncu_decode.txt" | cut -c1-150 | head -80
cp "$w/summary.txt" "$OUTDIR/"; tar -C "$w" -czf "$OUTDIR/logs.tgz" .
