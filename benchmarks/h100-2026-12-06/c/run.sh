#!/usr/bin/env bash
# Call c (H100): B=1 8k decode with split counts that keep the combine to one round (the 16-bit
# combine merges 4 groups x 8 loads = 32 splits a round; the launcher's 33 take two), against
# cuDNN, two rounds; then the host time per eager call (launch_overhead.py, fixed for kernels
# loaded by structure id).
set -uo pipefail
OUTDIR=$1; w=/tmp/w; mkdir -p "$w" "$OUTDIR"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/summary.txt"
for r in 1 2; do
timeout 100 python3 benchmarks/decode_sweep.py --cudnn --variants num_splits=0 num_splits=32 num_splits=30 num_splits=28 num_splits=36 \
  --cases 1:8192:1:contig 1:8192:4:contig 1:8192:1:page16 1:8192:1:page256 1:4096:1:contig 1:16384:1:contig > "$w/splits_r$r.txt" 2>&1
echo "splits r$r rc=$?" >> "$w/summary.txt"
done
timeout 90 python3 benchmarks/launch_overhead.py > "$w/launch_overhead.txt" 2>&1; echo "host rc=$?" >> "$w/summary.txt"
for f in splits_r1 splits_r2 launch_overhead; do echo "== $f"; grep -v "TileLang\|compiling" "$w/$f.txt" | cut -c1-150 | tail -n 45; done
cp "$w/summary.txt" "$OUTDIR/"; tar -C "$w" -czf "$OUTDIR/logs.tgz" .
