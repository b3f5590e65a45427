#!/usr/bin/env bash
# Call b (H100): experiments, each under its own timeout.
# 1. bf16 decode: split counts for B=1 (the two cases under cuDNN in call a: 8k 0.98x, 131k 0.99x),
#    and decode_kernel against decode_ws for the 131k stream (ws16=0).
# 2. FP8 d=256 forward tiles (issue 17: 4k causal was 1.42x the bf16 forward in call a).
# 3. Deterministic backward / default on the H100 (issue 19 item 5).
# 4. Host time per eager call (issue 19 item 3).
set -uo pipefail
OUTDIR=$1; w=/tmp/w; mkdir -p "$w" "$OUTDIR"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/summary.txt"
timeout 130 python3 benchmarks/decode_sweep.py --cudnn --variants num_splits=0 num_splits=16 num_splits=24 num_splits=48 num_splits=66 \
  --cases 1:8192:1:contig 1:8192:4:contig 1:8192:1:page16 > "$w/splits8k.txt" 2>&1; echo "splits8k rc=$?" >> "$w/summary.txt"
timeout 100 python3 benchmarks/decode_sweep.py --cudnn --variants num_splits=0 ws16=0 num_splits=132 num_splits=264 \
  --cases 1:131072:1:contig 1:131072:4:contig > "$w/splits131k.txt" 2>&1; echo "splits131k rc=$?" >> "$w/summary.txt"
timeout 120 python3 benchmarks/tune.py fwd --fp8 --headdim 256 --seqlen 4096 16384 --repeat 2 --configs 128,128,2,256,1,1,1,0 \
  128,128,2,256,1,1,1,1 128,96,2,256,1,1,1,0 128,128,2,256,1,0,1,0 > "$w/tune_fp8_256.txt" 2>&1; echo "tune rc=$?" >> "$w/summary.txt"
timeout 90 python3 benchmarks/det_ratio.py --rounds 2 > "$w/det.txt" 2>&1; echo "det rc=$?" >> "$w/summary.txt"
timeout 60 python3 benchmarks/launch_overhead.py > "$w/launch_overhead.txt" 2>&1; echo "host rc=$?" >> "$w/summary.txt"
for f in splits8k splits131k tune_fp8_256 det launch_overhead; do echo "== $f"; grep -v "TileLang\|compiling" "$w/$f.txt" | cut -c1-170 | tail -n 40; done
cp "$w/summary.txt" "$OUTDIR/"; tar -C "$w" -czf "$OUTDIR/logs.tgz" .
