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
t0=$(date +%s)
timeout ${TUNE_S:-300} python3 benchmarks/tune.py bwd --headdim 256 --seqlen 4096 16384 --check --repeat 2 --jobs 12 \
  --configs 64,64,1,256,1 64,64,1,256,1,0,0,0,1 64,64,2,256,1,0,0,0,1 > /tmp/tune_bwd256.txt 2>&1
echo "tune bwd d256 rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$OUTDIR/summary.txt"
grep -hE "^TUNE|^CHECK|^built|Error|error|mismatch" /tmp/tune_bwd256.txt | cut -c1-170 | tee "$OUTDIR/tune_lines.txt"
xz -c /tmp/tune_bwd256.txt > "$OUTDIR/tune_bwd256.txt.xz"
t0=$(date +%s)
mkdir -p /tmp/p && NCU_S=${NCU_S:-150} bash benchmarks/h100-2026-12-07/p/run.sh /tmp/p 2>&1 | tail -n 45
echo "ncu $(( $(date +%s) - t0 ))s" | tee -a "$OUTDIR/summary.txt"
cp /tmp/p/ncu.log /tmp/p/details.csv.xz /tmp/p/source.csv.xz "$OUTDIR/" 2>/dev/null
xz -T0 -c /tmp/p/d64c1k.ncu-rep > "$OUTDIR/d64c1k.ncu-rep.xz" 2>/dev/null
ls -la "$OUTDIR"
