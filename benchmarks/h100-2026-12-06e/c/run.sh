#!/usr/bin/env bash
# (Never ran: no machine could be started for it; kept for the next session, see NOTES "For the next session", thirty-first.)
# Call c (thirty-first session): FP8 d = 128 tiles, second look, 1k-16k: the table's 192 x 96
# one-tile row (long) and 128 x 128 persistent pairs (short) against 128 x 160 persistent pairs
# (two consumer warpgroups; 8 bytes of spills, none in the steady step) and the 192 x 96 row
# with its row sums on the tensor cores (`mma_row_sum`, NOTES prediction 4); that flag again on
# the FP8 d = 256 row and the bf16 d = 256 row.  Each config is checked first (the FP8 GPU tests
# of its head dim; `quick.check` for bf16).  Then the decode bench (bf16 and FP8 caches vs
# cuDNN / flash SDPA, % of the read bandwidth measured in the same run) with HEAD.
# Logs are written under $OUT as they go.
set -uo pipefail
w=$1; mkdir -p "$w"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/summary.txt"
timeout 230 python3 benchmarks/tune.py fwd --fp8 --headdim 128 --seqlen 1024 2048 4096 16384 --check --repeat 2 --jobs 4 \
  --configs ${CONFIGS:-192,96,2,384,1,1 192,96,2,384,1,1,1,0,0,0,1 128,128,2,256,1,1,0 128,160,2,256,1,1,0} > "$w/tune.txt" 2>&1; echo "tune rc=$?" >> "$w/summary.txt"
# The same flag on the FP8 d = 256 row (one tile per CTA, 128 x 128), the issue-17 cell under 1.6x.
timeout 150 python3 benchmarks/tune.py fwd --fp8 --headdim 256 --seqlen 4096 16384 --check --repeat 2 --jobs 4 \
  --configs 128,128,2,256,1,1 128,128,2,256,1,1,1,0,0,0,1 > "$w/tune256.txt" 2>&1; echo "tune d256 rc=$?" >> "$w/summary.txt"
# And on the bf16 d = 256 row (128 x 80, one tile; 16 columns of ones: issue 19).
timeout 120 python3 benchmarks/tune.py fwd --headdim 256 --seqlen 4096 16384 --check --repeat 2 --jobs 4 \
  --configs 128,80,2,256,1,1,1,1 128,80,2,256,1,1,1,1,0,0,1 > "$w/tune256bf16.txt" 2>&1; echo "tune d256 bf16 rc=$?" >> "$w/summary.txt"
if [ "${DECODE_S:-170}" != 0 ]; then  # DECODE_S=0: the tile A/B only (little device time left)
  timeout "${DECODE_S:-170}" python3 benchmarks/decode_bench.py --fp8 --out "$w/decode" > "$w/decode_bench.log" 2>&1; echo "decode bench rc=$?" >> "$w/summary.txt"
fi
cat "$w/summary.txt"
grep -E "^TUNE|^CHECK|passed|failed" "$w/tune.txt" "$w/tune256.txt" "$w/tune256bf16.txt" | cut -c1-170 | tail -n 100
[ -f "$w/decode_bench.log" ] && cut -c1-150 "$w/decode_bench.log" | grep -v "TileLang\|compiling" | tail -n 45
