#!/usr/bin/env bash
# One device call for KV-cache decoding (flash_attn_with_kvcache): build the decode/combine
# kernels (benchmarks/kernel_cache.sh fill ... decode; hits when the cache was carried), run
# tests/test_gpu_kvcache.py, then benchmarks/decode_bench.py.  Logs under $1 (default
# $OUT/decode).  BENCH_FLAGS (e.g. "--tiles 64x2", a tile sweep) go to the benchmark.  Time limits
# (PRECOMPILE_S 100, TESTS_S 180, BENCH_S 290) keep the whole call under 10 minutes.
#
#   bash benchmarks/decode_session.sh "$OUT/decode"
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/session_steps.sh"
session_start "${1:-${OUT:-device-out}/decode}"
# kernel_cache.sh enforces PRECOMPILE_S itself (killing the whole build process group)
step precompile 900 "$out/precompile.log" env FILL_S="${PRECOMPILE_S:-100}" bash benchmarks/kernel_cache.sh fill 8 decode
step "kvcache gpu tests" "${TESTS_S:-180}" "$out/gpu_kvcache.log" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kvcache.py
grep -E "^(FAILED|ERROR)" "$out/gpu_kvcache.log" | head -30
# shellcheck disable=SC2086 - BENCH_FLAGS is a list of flags
step "decode bench" "${BENCH_S:-290}" "$out/decode_bench.log" python3 benchmarks/decode_bench.py --out "$out" ${BENCH_FLAGS:-}
tail -n 70 "$out/decode_bench.log"
cat "$out/summary.txt"
