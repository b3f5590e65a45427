#!/usr/bin/env bash
# One device call for the FP8 forward (issue 17): precompile what tests/test_gpu_fp8.py and the
# FP8 bench use, run that suite, then `flashtile bench` with flashtile's FP8 and bf16 forwards
# beside cuDNN (same process, same inputs; q, k, v quantized outside the timed region, V's
# transposing pre-pass inside it), where an FP8 call's time goes (fp8_breakdown.py) and the
# accuracy table.  Logs under $1 (default $OUT/fp8).
#
#   bash .carry/install.sh && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/fp8_session.sh
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/session_steps.sh"
session_start "${1:-${OUT:-device-out}/fp8}"
export FLASHTILE_QUIET=1
step precompile 900 "$out/precompile.log" env FILL_S="${PRECOMPILE_S:-120}" bash benchmarks/kernel_cache.sh fill 14 fp8
step "fp8 gpu tests" "${FP8_TESTS_S:-150}" "$out/gpu_fp8.log" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_fp8.py
step "fp8 bench" "${FP8_BENCH_S:-150}" "$out/fp8_bench.log" python3 -m flashtile.bench --mode fwd \
  --backends flashtile flashtile-fp8 cudnn ${FP8_BENCH_FLAGS:---headdim 64 128 256 --seqlen 1k 4k 16k} --rounds 2 \
  --json "$out/fp8.json" --markdown "$out/fp8.md"
step "fp8 breakdown" "${FP8_BREAKDOWN_S:-90}" "$out/fp8_breakdown.md" python3 benchmarks/fp8_breakdown.py \
  --headdim 128 256 --seqlen 1024 4096 16384
cat "$out/fp8_breakdown.md"
if [ -n "${FP8_TUNE_CONFIGS:-}" ]; then  # e.g. FP8_TUNE_CONFIGS="128,128,2,256,1,1,0 128,192,2,256,1,1,1" (prebuild them first)
  step "fp8 tiles" "${FP8_TUNE_S:-120}" "$out/fp8_tune.log" python3 benchmarks/tune.py fwd --fp8 --headdim ${FP8_TUNE_D:-128} \
    --seqlen 4096 16384 --repeat 2 --jobs 4 --configs $FP8_TUNE_CONFIGS
  grep "^TUNE" "$out/fp8_tune.log"
fi
step "fp8 accuracy" "${FP8_ACC_S:-120}" "$out/fp8_accuracy.md" python3 benchmarks/fp8_accuracy.py --device cuda \
  --seqlen 2048 --seeds 2 --json "$out/fp8_accuracy.json"
cat "$out/fp8_accuracy.md"
grep -E "^(FAILED|ERROR)|Error|error" "$out"/gpu_fp8.log | head -20
head -n 60 "$out/fp8.md" 2>/dev/null
cat "$out/summary.txt"
