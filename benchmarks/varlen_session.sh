#!/usr/bin/env bash
# One device call for the packed (varlen) kernels: precompile what tests/test_gpu_varlen.py and
# `flashtile bench --varlen` use, run that suite, the varlen benchmark, then as much of the
# dense GPU suite as the remaining budget allows.  Logs under $1 (default $OUT/varlen).
#
#   bash .carry/install.sh && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/varlen_session.sh
set -uo pipefail
out=${1:-${OUT:-device-out}/varlen}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache} FLASHTILE_QUIET=1
t0=$(date +%s)
FILL_S=${PRECOMPILE_S:-130} bash benchmarks/kernel_cache.sh fill 14 varlen > "$out/precompile.log" 2>&1
echo "precompile: $(( $(date +%s) - t0 ))s" | tee "$out/summary.txt"
t0=$(date +%s)
timeout "${VARLEN_TESTS_S:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_varlen.py > "$out/gpu_varlen.log" 2>&1
echo "varlen gpu tests: $(( $(date +%s) - t0 ))s: $(tail -n 1 "$out/gpu_varlen.log")" | tee -a "$out/summary.txt"
t0=$(date +%s)
timeout "${VARLEN_BENCH_S:-60}" python3 -m flashtile.bench --varlen --json "$out/varlen.json" --markdown "$out/varlen.md" > "$out/varlen_bench.log" 2>&1
echo "varlen bench: $(( $(date +%s) - t0 ))s" | tee -a "$out/summary.txt"
t0=$(date +%s)
[ "${DENSE_TESTS_S:-90}" != 0 ] && timeout "${DENSE_TESTS_S:-90}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py > "$out/gpu_dense.log" 2>&1
echo "dense gpu tests: $(( $(date +%s) - t0 ))s: $(tail -n 1 "$out/gpu_dense.log")" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)" "$out"/gpu_*.log | head -20
cat "$out/varlen.md" 2>/dev/null | head -40
cat "$out/summary.txt"
