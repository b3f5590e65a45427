#!/usr/bin/env bash
# Call c (thirtieth session; the session's last device time, so one call): FP8 d = 128 long-row
# tiles, the table's 192 x 96 on three consumer warpgroups against 128 x 192 and 128 x 224
# one-tile kernels built without TileLang's sync pass (FwdConfig.explicit_syncs: the pass cannot
# lower 160-256-key FP8 blocks), each first through the d = 128 FP8 GPU tests (--check), then
# timed twice, interleaved; a second round of the V^T pre-pass tiles (64 keys x 128 threads = the
# old default); the FP8 call's time split with the 256-thread pre-pass; the whole GPU suite.
set -uo pipefail
OUTDIR=$1; w=/tmp/w; mkdir -p "$w" "$OUTDIR"
trap 'cp "$w/summary.txt" "$OUTDIR/" 2>/dev/null; tar -C "$w" -czf "$OUTDIR/logs.tgz" .' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/summary.txt"
timeout 180 python3 benchmarks/tune.py fwd --fp8 --headdim 128 --seqlen 4096 16384 --check --repeat 2 --jobs 4 \
  --configs 192,96,2,384,1,1 128,192,2,256,1,1,1,0,0,1 128,224,2,256,1,1,1,0,0,1 > "$w/tune_fp8.txt" 2>&1
echo "tune rc=$?" >> "$w/summary.txt"
timeout 30 python3 benchmarks/transpose_ab.py --variants 64x128 > "$w/transpose.txt" 2>&1; echo "transpose rc=$?" >> "$w/summary.txt"
timeout 45 python3 benchmarks/fp8_breakdown.py --headdim 256 128 --seqlen 4096 --causal > "$w/fp8_causal.txt" 2>&1; echo "fp8 causal rc=$?" >> "$w/summary.txt"
timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$w/gpu_tests.log" 2>&1; echo "gpu suite rc=$?" >> "$w/summary.txt"
cat "$w/summary.txt"
grep -E "CHECK|TUNE|FAILED|failed|passed" "$w/tune_fp8.txt" | cut -c1-150
grep -v "TileLang\|compiling" "$w/transpose.txt" | cut -c1-150 | tail -n 7
for f in fp8_causal; do grep -v "TileLang\|compiling" "$w/$f.txt" | cut -c1-150 | tail -n 3; done
grep -E "FAILED|ERROR|passed|failed" "$w/gpu_tests.log" | tail -n 12
