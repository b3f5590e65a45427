#!/usr/bin/env bash
# Call c (thirty-second session): the thirty-first session's call c (`h100-2026-12-06e/c/`:
# FP8 d = 128 128 x 160 pairs and `mma_row_sum` on the FP8 d = 128 / 256 and bf16 d = 256 rows,
# NOTES predictions 3 and 4) without its decode bench (no decode kernel changed), then the
# d = 256 backward tiles (NOTES prediction 5): the table's 64 x 64 one-stage kernel (+ `overlap`),
# 64 x 32 with two stages, and 64 x 64 with two stages and dQ in four column chunks
# (`dq_chunks` = 4, ~225 KB; reverted after this call, in git history at f3ef8b5), each after `quick.check`.  Logs are written under $OUT as they go.
set -uo pipefail
w=$1; mkdir -p "$w"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/summary.txt"
timeout 200 python3 benchmarks/tune.py fwd --fp8 --headdim 128 --seqlen 1024 2048 4096 16384 --check --repeat 2 --jobs 4 \
  --configs 192,96,2,384,1,1 192,96,2,384,1,1,1,0,0,0,1 128,128,2,256,1,1,0 128,160,2,256,1,1,0 > "$w/tune.txt" 2>&1; echo "tune rc=$?" >> "$w/summary.txt"
timeout 110 python3 benchmarks/tune.py fwd --fp8 --headdim 256 --seqlen 4096 16384 --check --repeat 2 --jobs 4 \
  --configs 128,128,2,256,1,1 128,128,2,256,1,1,1,0,0,0,1 > "$w/tune256.txt" 2>&1; echo "tune d256 rc=$?" >> "$w/summary.txt"
timeout 90 python3 benchmarks/tune.py fwd --headdim 256 --seqlen 4096 16384 --check --repeat 2 --jobs 4 \
  --configs 128,80,2,256,1,1,1,1 128,80,2,256,1,1,1,1,0,0,1 > "$w/tune256bf16.txt" 2>&1; echo "tune d256 bf16 rc=$?" >> "$w/summary.txt"
timeout 170 python3 benchmarks/tune.py bwd --headdim 256 --seqlen 4096 16384 --check --repeat 2 --jobs 4 \
  --configs 64,64,1,256,0 64,64,2,256,0,0,0,0,4 64,64,2,256,1,0,0,0,4 64,32,2,256,0 64,64,1,256,1 > "$w/tune_bwd256.txt" 2>&1; echo "tune bwd d256 rc=$?" >> "$w/summary.txt"
cat "$w/summary.txt"
grep -hE "^TUNE|^CHECK|passed|failed|Error" "$w/tune.txt" "$w/tune256.txt" "$w/tune256bf16.txt" "$w/tune_bwd256.txt" | cut -c1-150 | tail -n 140
