#!/usr/bin/env bash
# Call x (thirty-ninth session), ~4 minutes on an H100 with the refilled kernel pack:
# 1. The FP8 GPU tests with d = 64's short row selected (configs.FP8_SHORT_SEQLEN[64] = 1024).
# 2. The forward bench, d = 64, 1k / 2k / 4k, bf16 and FP8 against cuDNN (the short row's 1k,
#    and 2k on the long row).
# 3. Where the host time of the training path and of the packed forward goes on the device
#    host: launch_overhead.py --profile (cProfile of each layer; kernels.backward took 172 us
#    and flash_attn_varlen_func 177 us in call w against 35 / 40 us on the CPU machine's stub).
#
#   bash benchmarks/h100-2026-12-07e/x/run.sh $OUT
set -uo pipefail
OUTDIR=$1; S=$OUTDIR/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
bash benchmarks/kernel_cache.sh unpack | tee -a "$S"
timeout ${FP8_S:-90} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_fp8.py > "$OUTDIR/gpu_fp8.log" 2>&1
echo "fp8 tests rc=$?: $(tail -n 1 "$OUTDIR/gpu_fp8.log")" | tee -a "$S"
grep -E "^FAILED" "$OUTDIR/gpu_fp8.log" | head -10 | cut -c1-200 | tee -a "$S"
timeout ${BENCH_S:-80} python3 -m flashtile.bench --headdim 64 --seqlen 1k 2k 4k --mode fwd --rounds 2 \
  --backends flashtile flashtile-fp8 cudnn --time-limit $(( ${BENCH_S:-80} - 10 )) > "$OUTDIR/bench.md" 2>&1
echo "bench rc=$?" | tee -a "$S"; grep -E "^\| (full|causal)|^│ (full|causal)" "$OUTDIR/bench.md" | head -20 | tee -a "$S"
(cd benchmarks && timeout ${HOST_S:-100} python3 launch_overhead.py --profile > "$OUTDIR/launch_overhead.txt" 2>&1)
echo "launch_overhead rc=$?" | tee -a "$S"; grep -E "us  " "$OUTDIR/launch_overhead.txt" | head -30 | tee -a "$S"
