#!/usr/bin/env bash
# One device call for the packed (varlen) kernels: precompile what tests/test_gpu_varlen.py and
# `flashtile bench --varlen` use, run that suite, the varlen benchmark, then as much of the
# dense GPU suite as the remaining budget allows.  Logs under $1 (default $OUT/varlen).
#
#   bash .carry/install.sh && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/varlen_session.sh
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/session_steps.sh"
session_start "${1:-${OUT:-device-out}/varlen}"
export FLASHTILE_QUIET=1
# kernel_cache.sh enforces PRECOMPILE_S itself (killing the whole build process group)
step precompile 900 "$out/precompile.log" env FILL_S="${PRECOMPILE_S:-130}" bash benchmarks/kernel_cache.sh fill 14 varlen
step "varlen gpu tests" "${VARLEN_TESTS_S:-120}" "$out/gpu_varlen.log" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_varlen.py
step "varlen bench" "${VARLEN_BENCH_S:-60}" "$out/varlen_bench.log" python3 -m flashtile.bench --varlen --json "$out/varlen.json" --markdown "$out/varlen.md"
if [ "${DENSE_TESTS_S:-90}" != 0 ]; then
  step "dense gpu tests" "${DENSE_TESTS_S:-90}" "$out/gpu_dense.log" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py
fi
grep -E "^(FAILED|ERROR)" "$out"/gpu_*.log | head -20
head -n 40 "$out/varlen.md" 2>/dev/null
cat "$out/summary.txt"
