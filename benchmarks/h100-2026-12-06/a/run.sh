#!/usr/bin/env bash
# Call a (first H100 since the nineteenth session): build every fill group on the device's
# cores (this checkout's CPU cache held ~80 kernels), send the cache back, then the whole GPU
# suite, the dense bench (fwd/bwd, bf16 + FP8, cuDNN + flash SDPA) and the decode bench.
# $OUT gets three files: kernels.tar.xz, logs.tgz, summary.txt.
set -uo pipefail
OUTDIR=$1; w=/tmp/w; mkdir -p "$w" "$OUTDIR"; t_start=$(date +%s)
left() { echo $(( 570 - ($(date +%s) - t_start) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$w/summary.txt"
t0=$(date +%s)
FILL_S=230 bash benchmarks/kernel_cache.sh fill 14 > "$w/precompile.log" 2>&1
echo "fill: $(( $(date +%s) - t0 ))s, $(ls $TILELANG_CACHE_DIR/0.1.15/linux-x86_64/kernels | wc -l) kernels" | tee -a "$w/summary.txt"
tar -C "$TILELANG_CACHE_DIR/0.1.15" -cf - linux-x86_64 | xz -T14 -6 > "$OUTDIR/kernels.tar.xz"
b=$(left); ts=$(( b - 160 < 200 ? b - 160 : 200 ))
PRECOMPILE_S=5 TESTS_S=$ts BENCH_S=70 BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd bwd --backends flashtile flashtile-fp8 cudnn flash" \
  DECODE_BENCH_S=0 bash benchmarks/device_session.sh "$w/f1" > "$w/session.log" 2>&1
b=$(left); echo "before decode: ${b}s left" >> "$w/summary.txt"
if [ "$b" -gt 60 ]; then
  timeout $(( b - 5 )) python3 benchmarks/decode_bench.py --fp8 --out "$w/decode" > "$w/decode_bench.log" 2>&1
  echo "decode bench rc=$?" >> "$w/summary.txt"
fi
cat "$w/f1/summary.txt" >> "$w/summary.txt"; cp "$w/summary.txt" "$OUTDIR/"
tail -n 30 "$w/session.log"; cut -c1-160 "$w/decode_bench.log" | tail -n 40
tar -C "$w" -czf "$OUTDIR/logs.tgz" .
echo "total $(( $(date +%s) - t_start ))s"
