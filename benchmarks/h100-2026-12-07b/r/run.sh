#!/usr/bin/env bash
# Prediction 9's call (written in the thirty-sixth session, not yet run): `FwdConfig.producer_regs`
# on the paired forwards (the d = 64 short row, the d = 128 long row) and the one-tile short rows
# (d = 128, 256), then the forward GPU tests with the flag on every hand-written row.  ~6 minutes
# on an H100 with the kernel pack carried
# (the candidates' kernels are built on the device: TUNE_JOBS).
#
#   bash benchmarks/h100-2026-12-07b/r/run.sh $OUT
#
# Configs (tune.py's fwd notation: block_m, block_n, stages, threads, manual_ws, pingpong,
# tiles_per_cta, skip_rescale, defer_sum, explicit_syncs, producer_regs):
#   d = 64 short row, causal (pingpong) and full (no turns); d = 128 long row (persistent pairs).
set -uo pipefail
OUTDIR=$1; w=/tmp/r; mkdir -p "$w"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUTDIR/summary.txt"
bash benchmarks/kernel_cache.sh unpack > /dev/null
# tune NAME HEADDIM "SEQLENS" CONFIG...: each base config followed by the same with producer_regs.
tune() {
  local name=$1 d=$2 seqlens=$3 t0; shift 3
  t0=$(date +%s)
  timeout ${TUNE_S:-150} python3 benchmarks/tune.py fwd --headdim "$d" --seqlen $seqlens --check --repeat 2 \
    --jobs ${TUNE_JOBS:-12} --configs "$@" > "$w/tune_$name.txt" 2>&1
  echo "tune $name rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$OUTDIR/summary.txt"
}
tune d64 64 "1024 4096" 128,128,2,256,1,1,0,0,1,0 128,128,2,256,1,1,0,0,1,0,1 128,128,2,256,1,0,0,0,1,0 128,128,2,256,1,0,0,0,1,0,1
tune d128 128 "4096 16384" 128,128,2,256,1,1,0,0,0,0 128,128,2,256,1,1,0,0,0,0,1
# The one-tile short rows (table: 128 x 64 pairs of turns with skip_rescale) at d = 128 and 256.
for d in 128 256; do
  tune "d${d}_one_tile" $d "1024 4096" 128,64,2,256,1,1,1,1,0,0 128,64,2,256,1,1,1,1,0,0,1
done
grep -hE "^TUNE|^CHECK|Error|error|mismatch" "$w"/tune_d*.txt | cut -c1-170 | tee "$OUTDIR/tune_lines.txt"
# The tests' forward structures under the flag: cache hits when the pack was filled with the
# flag too (on the CPU machine, after the plain fill and before `prune`:
# `FLASHTILE_FWD_FLAGS=producer_regs=1 bash benchmarks/kernel_cache.sh fill 2 dense fp8`, 61 structures, ~9
# minutes), else built here on 14 cores.
t0=$(date +%s)
FLASHTILE_FWD_FLAGS=producer_regs=1 FILL_S=${PRECOMPILE_S:-150} bash benchmarks/kernel_cache.sh fill 14 dense fp8 > "$w/precompile.log" 2>&1
echo "precompile under the flag: rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$OUTDIR/summary.txt"
t0=$(date +%s)
FLASHTILE_FWD_FLAGS=producer_regs=1 timeout ${TESTS_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_gpu_kernels.py tests/test_gpu_fp8.py tests/test_degenerate.py > "$w/gpu_tests.log" 2>&1
echo "forward GPU tests, producer_regs=1 on every paired row: rc=$? $(( $(date +%s) - t0 ))s: $(tail -n 1 "$w/gpu_tests.log")" | tee -a "$OUTDIR/summary.txt"
grep -E "FAILED|ERROR" "$w/gpu_tests.log" | head -n 15
tar czf "$OUTDIR/logs.tgz" -C "$w" .
