#!/usr/bin/env bash
# Profile call (thirty-third session, for the next session's short-forward work, NOTES "For
# the next session" 2): Nsight Compute's full set on one bf16 d = 64 1k causal forward of
# flashtile and of cuDNN SDPA (batch 16, 32 heads: the bench case at 0.80x), with the SASS
# source page for benchmarks/ncu_stalls.py.  Files under $OUT: the report, its details and
# source pages as CSV (xz), the log.
set -uo pipefail
OUTDIR=$1; repo=$PWD
cd /tmp && timeout ${NCU_S:-120} ncu --clock-control none --profile-from-start off --kernel-name regex:'main|sdpa|fmha|attn' \
  --set full --import-source yes -o "$OUTDIR/d64c1k" python3 "$repo/benchmarks/ncu_dense.py" --causal --headdim 64 --seqlen 1024 \
  > "$OUTDIR/ncu.log" 2>&1
echo "ncu rc=$?" >> "$OUTDIR/ncu.log"
ncu -i "$OUTDIR/d64c1k.ncu-rep" --page details --csv 2>/dev/null | xz > "$OUTDIR/details.csv.xz"
ncu -i "$OUTDIR/d64c1k.ncu-rep" --page source --csv --print-source sass 2>/dev/null | xz > "$OUTDIR/source.csv.xz"
tail -n 5 "$OUTDIR/ncu.log"; ls -la "$OUTDIR"
ncu -i "$OUTDIR/d64c1k.ncu-rep" --page details 2>/dev/null | grep -E "^  [a-z_]|Duration|Registers|Achieved Occupancy|Issue Slots Busy|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|Executed Ipc A" | head -40
