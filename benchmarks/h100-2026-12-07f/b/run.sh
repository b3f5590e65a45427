#!/usr/bin/env bash
# Call b (fortieth session): why the full-attention backward falls behind cuDNN as sequences
# grow (call a, H100: d = 128 full 1k 0.96x, 4k 0.95x, 16k 0.90x; d = 64 0.98 / 0.93 / 0.90x,
# while causal stays 0.96-1.04x).  Nsight Compute's full set on one bf16 d = 128 full backward
# of flashtile (preprocess, dK/dV kernel) and cuDNN at 16k and at 4k (batch x seqlen = 16k
# tokens, 16 heads), details and SASS source pages as CSV (xz) for benchmarks/ncu_stalls.py.
#
#   bash benchmarks/h100-2026-12-07f/b/run.sh $OUT
set -uo pipefail
OUTDIR=$1; repo=$PWD
bash benchmarks/kernel_cache.sh unpack
for s in ${NCU_SEQLENS:-16384 4096}; do
  (cd /tmp && timeout ${NCU_S:-150} ncu --clock-control none --profile-from-start off \
    --kernel-name regex:'main|sdpa|fmha|attn|bprop|dkdv|bwd' --set full --import-source yes -o "/tmp/b$s" \
    python3 "$repo/benchmarks/ncu_dense.py" --backward --headdim 128 --seqlen $s > "$OUTDIR/ncu$s.log" 2>&1)
  echo "ncu $s rc=$?" | tee -a "$OUTDIR/ncu$s.log"
  ncu -i "/tmp/b$s.ncu-rep" --page details --csv 2>/dev/null | xz > "$OUTDIR/details$s.csv.xz"
  ncu -i "/tmp/b$s.ncu-rep" --page source --csv --print-source sass 2>/dev/null | xz > "$OUTDIR/source$s.csv.xz"
  ncu -i "/tmp/b$s.ncu-rep" --page details 2>/dev/null | grep -E "^  [a-zA-Z_]|Duration|Registers Per|Issue Slots Busy|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Warp Cycles Per Issued|Executed Ipc A|Achieved Occupancy" | head -60
done
