#!/usr/bin/env bash
# Call d (staged in the forty-third session, no device then): the session's new GPU tests first
# (flashtile.fa3 call sites; attention_chunk dense, packed and KV cache; stacked qkv; a tiny Llama 4 with chunked layers; ~1 minute, every kernel
# structure they use is one the suite already builds, so the carried pack covers them), then
# the whole GPU suite (its time limit raised for this session's extra cases) and the dense bench
# with the default kernels (call a's routine without its host profile; ~9 minutes in all).  Run it when call b's bwd_wide does not win (call c, which runs the whole suite
# with the switch on, covers the new tests otherwise).
#
#   bash benchmarks/h100-2026-12-08/d/run.sh $OUT
set -uo pipefail
OUTDIR=$1
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache}
bash benchmarks/kernel_cache.sh unpack
timeout ${NEW_S:-120} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_integration.py \
  tests/test_gpu_kvcache.py tests/test_gpu_varlen.py tests/test_gpu_graphs.py -k "fa3 or chunk or qkvpacked or llama4" > "$OUTDIR/new_tests.log" 2>&1
echo "new GPU tests rc=$?: $(tail -n 1 "$OUTDIR/new_tests.log")"
grep -E "FAILED|Error" "$OUTDIR/new_tests.log" | head -20
w=/tmp/d; mkdir -p "$w"
TOTAL_S=${TOTAL_S:-430} TESTS_S=${TESTS_S:-270} bash benchmarks/h200-2026-12-07/suite_bench.sh "$w" "$OUTDIR"
