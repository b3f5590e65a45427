#!/usr/bin/env bash
# Call c (forty-first session), ~7 minutes on an H100 with the refilled kernel pack: prediction 13
# (NOTES): the dK/dV walk from each key tile's diagonal (`BwdConfig.diagonal_start`) against the
# table's backward at d = 128, 64 (hand-written kernels) and 256 (the builder's kernel, new this
# session), 1k / 4k / 16k, full and causal, two rounds after tune.py's --check; the GQA / Sq != Sk
# / mask check; then the dense and packed GPU tests with FLASHTILE_BWD_FLAGS=diagonal_start=1 (which
# now reaches the builder's rows too: d = 192 / 256 and softcap).  In priority order, each under
# its own deadline; the lines worth reading go to summary.txt.
#
#   bash benchmarks/h100-2026-12-07g/c/run.sh $OUT
# Kept as the record of prediction 13's call: diagonal_start was reverted after it ran
# (NOTES, forty-first session), so its flagged configs no longer exist in this tree.
set -uo pipefail
OUTDIR=$1; S=$OUTDIR/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
bash benchmarks/kernel_cache.sh unpack | tee -a "$S"
for spec in "128 128,64,2,256,1,1,0,0 0,0,1" "64 128,64,2,256,1,1,1,1 0,0,1" "256 64,64,1,256,1 0,0,0,0,0,1"; do
  set -- $spec
  timeout ${BWD_S:-80} python3 benchmarks/tune.py bwd --headdim $1 --seqlen ${SEQLENS:-1024 4096 16384} --check --repeat 2 --jobs 12 \
    --configs $2 $2,$3 > "$OUTDIR/tune_bwd$1.txt" 2>&1
  echo "tune bwd d$1 rc=$?" | tee -a "$S"; grep -E "^TUNE|^CHECK|^PASS|^FAIL|rror" "$OUTDIR/tune_bwd$1.txt" | cut -c1-160 | tee -a "$S"
done
timeout ${GQA_S:-40} python3 benchmarks/bwd_flag_check.py diagonal_start 2>&1 | grep -E "^PASS|^FAIL|rror" | cut -c1-150 | tee -a "$S"
[ "${BWD_TESTS_S:-220}" -gt 1 ] && FLASHTILE_BWD_FLAGS=diagonal_start=1 timeout ${BWD_TESTS_S:-220} python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_gpu_kernels.py tests/test_gpu_varlen.py > "$OUTDIR/bwd_flag_tests.log" 2>&1
echo "GPU tests, FLASHTILE_BWD_FLAGS=diagonal_start=1: rc=$? $(tail -n 1 "$OUTDIR/bwd_flag_tests.log")" | tee -a "$S"
grep -E "FAILED|ERROR" "$OUTDIR/bwd_flag_tests.log" | head -n 10 | cut -c1-200 | tee -a "$S"
