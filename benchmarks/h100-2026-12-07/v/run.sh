#!/usr/bin/env bash
# (Never ran: no machine could be started for it; see v2/run.sh for the defaults it assumes.)
# Verification call (thirty-second session), kernels as committed: `mma_row_sum` (fixed: each
# block's sums GEMM cleared, added into fp32 `l`) as the default of the FP8 d = 128 long row and
# the FP8 d = 256 row, the d = 256 backward with `overlap`.  The FP8 and CUDA-graph GPU tests,
# the same-run A/B of the FP8 rows with and without `mma_row_sum` (NOTES prediction 6), then
# the whole GPU suite and the dense bench (fwd + bwd, bf16 and FP8, two rounds, vs cuDNN and
# flash SDPA).  Logs are written under $OUT as they go, so a run cut short still returns them.
set -uo pipefail
OUTDIR=$1; mkdir -p "$OUTDIR/f1"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUTDIR/summary.txt"
timeout 100 python -m pytest -q -m gpu tests/test_gpu_fp8.py tests/test_gpu_graphs.py > "$OUTDIR/fp8_graph_tests.txt" 2>&1; echo "fp8+graph tests rc=$?" >> "$OUTDIR/summary.txt"
timeout ${TUNE_S:-50} python3 benchmarks/tune.py fwd --fp8 --headdim 128 --seqlen 4096 16384 --repeat 2 --jobs 4 \
  --configs 192,96,2,384,1,1 192,96,2,384,1,1,1,0,0,0,1 > "$OUTDIR/tune.txt" 2>&1; echo "tune d128 rc=$?" >> "$OUTDIR/summary.txt"
timeout ${TUNE_S:-50} python3 benchmarks/tune.py fwd --fp8 --headdim 256 --seqlen 4096 16384 --repeat 2 --jobs 4 \
  --configs 128,128,2,256,1,1 128,128,2,256,1,1,1,0,0,0,1 >> "$OUTDIR/tune.txt" 2>&1; echo "tune d256 rc=$?" >> "$OUTDIR/summary.txt"
PRECOMPILE_S=40 TESTS_S=${TESTS_S:-210} BENCH_S=${BENCH_S:-110} BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd bwd --rounds 2 --backends flashtile flashtile-fp8 cudnn flash" \
  bash benchmarks/device_session.sh "$OUTDIR/f1" > "$OUTDIR/session.log" 2>&1
cat "$OUTDIR/summary.txt" "$OUTDIR/f1/summary.txt"
grep -E "passed|failed|FAILED|Error" "$OUTDIR/fp8_graph_tests.txt" | tail -n 12
grep -E "^TUNE" "$OUTDIR/tune.txt" | cut -c1-150
grep -E "FAILED|ERROR|passed|failed" "$OUTDIR/f1/gpu_tests.log" | tail -n 15
grep -A 20 "Geometric mean" "$OUTDIR/f1/bench.md" | head -24
