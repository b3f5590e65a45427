#!/usr/bin/env bash
# Verification call (thirty-second session): after a kernel-table change, the FP8 and CUDA-graph
# GPU tests first (the changed rows' own tests), then the whole GPU suite and the dense bench
# (fwd + bwd, bf16 and FP8, two rounds, vs cuDNN and flash SDPA) in the same call.
# Logs are written under $OUT as they go, so a run cut short still returns them.
set -uo pipefail
OUTDIR=$1; mkdir -p "$OUTDIR/f1"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUTDIR/summary.txt"
timeout 100 python -m pytest -q -m gpu tests/test_gpu_fp8.py tests/test_gpu_graphs.py > "$OUTDIR/fp8_graph_tests.txt" 2>&1; echo "fp8+graph tests rc=$?" >> "$OUTDIR/summary.txt"
PRECOMPILE_S=40 TESTS_S=${TESTS_S:-220} BENCH_S=${BENCH_S:-110} BENCH_FLAGS="--headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd bwd --rounds 2 --backends flashtile flashtile-fp8 cudnn flash" \
  bash benchmarks/device_session.sh "$OUTDIR/f1" > "$OUTDIR/session.log" 2>&1
cat "$OUTDIR/summary.txt" "$OUTDIR/f1/summary.txt"
grep -E "passed|failed|FAILED|Error" "$OUTDIR/fp8_graph_tests.txt" | tail -n 12
grep -E "FAILED|ERROR|passed|failed" "$OUTDIR/f1/gpu_tests.log" | tail -n 15
grep -A 20 "Geometric mean" "$OUTDIR/f1/bench.md" | head -20
