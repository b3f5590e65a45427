#!/usr/bin/env bash
# Call u (thirty-eighth session): the FP8 d = 64 short row (128 x 128 persistent pairs up to
# 1024, configs.FP8_SHORT_SEQLEN) on the device: the FP8 tests first, then FP8 d = 64 at 2k
# (the bound's next step, both rows), then the whole GPU suite and the dense bench with the FP8
# rows, against cuDNN and flash SDPA in the same run.  ~8 minutes on an H100 with the pack.
#
#   bash benchmarks/h100-2026-12-07d/u/run.sh $OUT
set -uo pipefail
OUTDIR=$1; w=/tmp/u; mkdir -p "$w"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUTDIR/ab_head.txt"
bash benchmarks/kernel_cache.sh unpack > /dev/null
timeout ${TUNE_S:-45} python3 benchmarks/tune.py fwd --fp8 --headdim 64 --seqlen 2048 --repeat 2 --jobs 12 \
  --configs 192,128,2,384,1,1,1,0,0,0 128,128,2,256,1,1,0,0,0,0,1 > "$w/tune2k.txt" 2>&1
echo "tune 2k rc=$?" | tee -a "$OUTDIR/ab_head.txt"; grep -E "^TUNE|rror" "$w/tune2k.txt" | cut -c1-150 | tee -a "$OUTDIR/ab_head.txt"
TOTAL_S=${TOTAL_S:-480} TESTS_S=${TESTS_S:-260} bash benchmarks/h200-2026-12-07/suite_bench.sh "$w" "$OUTDIR"
