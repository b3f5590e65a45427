#!/usr/bin/env bash
# Call c (thirty-second session): the thirty-first session's call c without its decode bench
# (no decode kernel changed since the twenty-ninth session's numbers), then the d = 256 backward
# tiles: the table's 64 x 64 one-stage kernel (Q / dO loads not overlapped: two stages of
# 64 x 64 do not fit beside the 64 KB fp32 dQ tile) against 64 x 32 with two stages (fits:
# ~170 KB), each with and without async S^T / dP^T (`overlap`), after `quick.check`.
# Logs are written under $OUT as they go.
set -uo pipefail
w=$1; mkdir -p "$w"
DECODE_S=0 bash benchmarks/h100-2026-12-06e/c/run.sh "$w"
timeout 150 python3 benchmarks/tune.py bwd --headdim 256 --seqlen 4096 16384 --check --repeat 2 --jobs 4 \
  --configs 64,64,1,256,0 64,64,1,256,1 64,32,2,256,0 64,32,2,256,1 > "$w/tune_bwd256.txt" 2>&1; echo "tune bwd d256 rc=$?" >> "$w/summary.txt"
tail -n 1 "$w/summary.txt"
grep -E "^TUNE|^CHECK|Error|error" "$w/tune_bwd256.txt" | cut -c1-170 | tail -n 30
