#!/usr/bin/env bash
# Call a0 (thirty-fourth session), while the CPU machine still fills the kernel pack: the two
# measurements that need few kernels (built here, ~1 min on the device's cores).
# 1. Prediction 8: the d = 256 backward with dQ reduce-added from registers (`dq_regs`, one and
#    two stages) against the table's kernel, each after `quick.check`'s odd shapes, two rounds.
# 2. The thirty-third session's profile call p (ncu full set, bf16 d = 64 1k causal forward,
#    flashtile and cuDNN), for the short-forward gap.
set -uo pipefail
OUTDIR=$1
export TILELANG_CACHE_DIR=/tmp/tlcache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUTDIR/summary.txt"
TUNE_S=${TUNE_S:-300} TUNE_JOBS=12 bash benchmarks/h200-2026-12-07/ab_bwd256.sh /tmp "$OUTDIR" "$OUTDIR/summary.txt"
xz -c /tmp/tune_bwd256.txt > "$OUTDIR/tune_bwd256.txt.xz"
t0=$(date +%s)
mkdir -p /tmp/p && NCU_S=${NCU_S:-150} bash benchmarks/h100-2026-12-07/p/run.sh /tmp/p 2>&1 | tail -n 45
echo "ncu $(( $(date +%s) - t0 ))s" | tee -a "$OUTDIR/summary.txt"
cp /tmp/p/ncu.log /tmp/p/details.csv.xz /tmp/p/source.csv.xz "$OUTDIR/" 2>/dev/null
xz -T0 -c /tmp/p/d64c1k.ncu-rep > "$OUTDIR/d64c1k.ncu-rep.xz" 2>/dev/null
ls -la "$OUTDIR"
