#!/usr/bin/env bash
# (Ran with the tree of commit b02b1cf: the in-kernel V^T and fp8_breakdown.py --ab were reverted after it.)
# Call b (thirtieth session): the FP8 d = 256 forward with V^T made in the kernel by the producer
# warpgroup (no pre-pass).  The FP8 GPU tests (with the new d = 256 cases and the bitwise A/B
# against the pre-pass build), the CUDA-graph tests, then the call's time split and an A/B/A/B
# of the whole call against the pre-pass forced, full and causal, 4k and 16k; the pre-pass
# kernel with other tiles (keys per CTA x threads) for the rows that keep it.
set -uo pipefail
OUTDIR=$1; w=/tmp/w; mkdir -p "$w" "$OUTDIR"
trap 'cp "$w/summary.txt" "$OUTDIR/" 2>/dev/null; tar -C "$w" -czf "$OUTDIR/logs.tgz" .' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/summary.txt"
timeout 200 python -m pytest -q -m gpu tests/test_gpu_fp8.py > "$w/fp8_tests.txt" 2>&1; echo "fp8 tests rc=$?" >> "$w/summary.txt"
timeout 100 python -m pytest -q -m gpu tests/test_gpu_graphs.py > "$w/graphs.txt" 2>&1; echo "graphs rc=$?" >> "$w/summary.txt"
timeout 100 python3 benchmarks/fp8_breakdown.py --headdim 256 128 --seqlen 4096 16384 --ab > "$w/fp8_full.txt" 2>&1; echo "fp8 full rc=$?" >> "$w/summary.txt"
timeout 100 python3 benchmarks/fp8_breakdown.py --headdim 256 128 --seqlen 4096 16384 --causal --ab > "$w/fp8_causal.txt" 2>&1; echo "fp8 causal rc=$?" >> "$w/summary.txt"
timeout 60 python3 benchmarks/transpose_ab.py --variants 128x128 128x256 64x256 > "$w/transpose.txt" 2>&1; echo "transpose rc=$?" >> "$w/summary.txt"
cat "$w/summary.txt"
grep -E "passed|failed|FAILED|Error" "$w/fp8_tests.txt" | tail -n 12
grep -E "passed|failed|FAILED" "$w/graphs.txt" | tail -n 4
for f in fp8_full fp8_causal transpose; do echo "== $f"; grep -v "TileLang\|compiling" "$w/$f.txt" | cut -c1-170 | tail -n 16; done
