#!/usr/bin/env bash
# Verification call (thirty-third session): the two staged defaults on (`mma_row_sum`, fixed
# form with per-block sums and a thread-strided ones fill, on the FP8 d = 128 long row and the
# FP8 d = 256 row; `overlap` on the bf16/fp16 d = 256 backward).  In order, logs under $OUT as
# they go: the same-run A/B of the FP8 rows with and without `mma_row_sum` (NOTES prediction 6)
# and of bf16 d = 128's one-tile kernel with it against the table's persistent pairs
# (prediction 7), each config after its GPU tests (`--check`); then the whole GPU suite and the
# dense bench (fwd + bwd, bf16 and FP8, two rounds, vs cuDNN and flash SDPA).  Ran once (logs/);
# its 11-field tuples and the staged patch need the tree before 358a509 (`mma_row_sum` removed).
set -uo pipefail
OUTDIR=$1; mkdir -p "$OUTDIR/f1"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUTDIR/summary.txt"
tune() {  # tune <label> <seconds> <args...>: one A/B, bounded, appended to tune.txt
  local label=$1 limit=$2; shift 2
  timeout $limit python3 benchmarks/tune.py "$@" --check --repeat 2 --jobs 4 >> "$OUTDIR/tune.txt" 2>&1
  echo "tune $label rc=$?" >> "$OUTDIR/summary.txt"
}
tune fp8-d128 60 fwd --fp8 --headdim 128 --seqlen 4096 16384 --configs 192,96,2,384,1,1 192,96,2,384,1,1,1,0,0,0,1
tune fp8-d256 60 fwd --fp8 --headdim 256 --seqlen 4096 16384 --configs 128,128,2,256,1,1 128,128,2,256,1,1,1,0,0,0,1
tune bf16-d128 50 fwd --headdim 128 --seqlen 4096 16384 --configs 128,128,2,256,1,1,0 128,128,2,256,1,1,1,0,0,0,1
PRECOMPILE_S=40 TESTS_S=${TESTS_S:-200} BENCH_S=${BENCH_S:-110} BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd bwd --rounds 2 --backends flashtile flashtile-fp8 cudnn flash" \
  bash benchmarks/device_session.sh "$OUTDIR/f1" > "$OUTDIR/session.log" 2>&1
cat "$OUTDIR/summary.txt" "$OUTDIR/f1/summary.txt"
grep -E "^TUNE|passed|failed" "$OUTDIR/tune.txt" | cut -c1-150
grep -E "FAILED|ERROR|passed|failed" "$OUTDIR/f1/gpu_tests.log" | tail -n 15
grep -A 20 "Geometric mean" "$OUTDIR/f1/bench.md" | head -24
