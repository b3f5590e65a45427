#!/usr/bin/env bash
# Call ab (thirty-first session; machines scarce, so calls a and b in one): call a's tests and
# A/Bs, then the verification routine without the decode bench (no decode kernel changed): the
# whole GPU suite and the dense bench (fwd + bwd, bf16 and FP8, two rounds, vs cuDNN and flash
# SDPA).  Logs are written under $OUT as they go, so a run cut short still returns them.
set -uo pipefail
OUTDIR=$1; mkdir -p "$OUTDIR/a" "$OUTDIR/f1"
W="$OUTDIR/a" bash benchmarks/h100-2026-12-06e/a/run.sh "$OUTDIR/a"
PRECOMPILE_S=40 TESTS_S=220 BENCH_S=110 BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd bwd --rounds 2 --backends flashtile flashtile-fp8 cudnn flash" \
  bash benchmarks/device_session.sh "$OUTDIR/f1" > "$OUTDIR/session.log" 2>&1
cat "$OUTDIR/f1/summary.txt"
grep -E "FAILED|ERROR|passed|failed" "$OUTDIR/f1/gpu_tests.log" | tail -n 15
grep -A 20 "Geometric mean" "$OUTDIR/f1/bench.md" | head -20
