#!/usr/bin/env bash
# One device call for KV-cache decoding (flash_attn_with_kvcache): build the decode/combine
# kernels (benchmarks/kernel_cache.sh fill ... decode; hits when the cache was carried), run
# tests/test_gpu_kvcache.py, then benchmarks/decode_bench.py.  Logs under $1 (default
# $OUT/decode).  BENCH_FLAGS (e.g. "--tiles 64x2", a tile sweep) go to the benchmark.  Time limits
# (PRECOMPILE_S 100, TESTS_S 180, BENCH_S 290) keep the whole call under 10 minutes.
#
#   bash benchmarks/decode_session.sh "$OUT/decode"
set -uo pipefail
out=${1:-${OUT:-device-out}/decode}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache}
t0=$(date +%s)
FILL_S=${PRECOMPILE_S:-100} bash benchmarks/kernel_cache.sh fill 8 decode > "$out/precompile.log" 2>&1
echo "precompile: $(( $(date +%s) - t0 ))s" | tee "$out/summary.txt"
t0=$(date +%s)
timeout "${TESTS_S:-180}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kvcache.py > "$out/gpu_kvcache.log" 2>&1
echo "kvcache gpu tests: $(( $(date +%s) - t0 ))s: $(tail -n 1 "$out/gpu_kvcache.log")" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)" "$out/gpu_kvcache.log" | head -30
t0=$(date +%s)
timeout "${BENCH_S:-290}" python3 benchmarks/decode_bench.py --out "$out" ${BENCH_FLAGS:-} > "$out/decode_bench.log" 2>&1
rc=$?
echo "decode bench: $(( $(date +%s) - t0 ))s (rc $rc)" | tee -a "$out/summary.txt"
cat "$out/decode_bench.log" | tail -70
cat "$out/summary.txt"
