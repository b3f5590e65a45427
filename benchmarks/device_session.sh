#!/usr/bin/env bash
# One device call that does everything a kernel change must show: build the kernels (in
# parallel, into TileLang's disk cache), run the GPU test suite, then benchmark against cuDNN,
# PyTorch flash SDPA and FlexAttention.  Logs go to $1 (default $OUT or ./device-out).
#
#   bash .carry/install.sh && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/device_session.sh
#
# Phase budgets (seconds) can be overridden: PRECOMPILE_S, TESTS_S, BENCH_S (VARLEN_BENCH_S and
# DECODE_BENCH_S add those benchmarks; SANITIZE_CASES=<substring>, e.g. kvcache, adds
# compute-sanitizer memcheck + racecheck over those cases of benchmarks/sanitize_cases.py).  Carry the kernel
# cache built here (benchmarks/kernel_cache.sh fill; pack) and the precompile phase is seconds.  BENCH_FLAGS
# replaces the short bench grid; BENCH_FLAGS=" " runs `flashtile bench`'s full default grid.
# The device tool returns at most 8 files from $OUT and this writes more (summary, logs of each
# phase, smi.log, bench.{json,csv,md,png,log}): point $1 at a folder under /tmp and tar it into
# $OUT after a bounded run, as benchmarks/h100-2026-12-07/x/run.sh does.
set -uo pipefail
out=${1:-${OUT:-device-out}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache}
jobs=$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/summary.txt"
bash benchmarks/kernel_cache.sh unpack | tee -a "$out/summary.txt"
# Clocks, temperature and throttle reasons every 5 s (smi.log; summarised at the end): a
# thermally throttled H100 (0x20, 585-1365 MHz) once made a whole benchmark meaningless (NOTES,
# eleventh session).
smi="nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active --format=csv,noheader"
(while true; do $smi >> "$out/smi.log"; sleep 5; done) &
smi_pid=$!
trap 'kill $smi_pid 2>/dev/null' EXIT

t0=$(date +%s)
# What the GPU suite and the benchmarks run (dense, packed, decode): all hits when the kernel
# cache built on the CPU machine was carried (benchmarks/kernel_cache.sh pack).
FILL_S=${PRECOMPILE_S:-240} bash benchmarks/kernel_cache.sh fill "$jobs" > "$out/precompile.log" 2>&1
echo "precompile: $(( $(date +%s) - t0 ))s, $(grep -c "s$" "$out/precompile.log") structures" | tee -a "$out/summary.txt"

t0=$(date +%s)
timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 ${TESTS:-tests} > "$out/gpu_tests.log" 2>&1
echo "gpu tests: $(( $(date +%s) - t0 ))s: $(tail -n 1 "$out/gpu_tests.log")" | tee -a "$out/summary.txt"

if [ "${BENCH_S:-220}" != 0 ]; then
  t0=$(date +%s)
  bench_flags=${BENCH_FLAGS:---headdim 64 128 256 --seqlen 1k 4k 16k --mode fwd bwd --backends flashtile flashtile-fp8 cudnn flash flex}
  timeout "${BENCH_S:-220}" python3 -m flashtile.bench $bench_flags --time-limit $(( ${BENCH_S:-220} - 20 )) \
    --json "$out/bench.json" --csv "$out/bench.csv" --plot "$out/bench.png" --markdown "$out/bench.md" > "$out/bench.log" 2>&1
  rc=$?
  echo "bench: $(( $(date +%s) - t0 ))s rc=$rc" | tee -a "$out/summary.txt"
fi

# Packed (varlen) batches against padded/equal-length flashtile, nested-tensor SDPA and a loop.
if [ "${VARLEN_BENCH_S:-0}" != 0 ]; then
  t0=$(date +%s)
  timeout "$VARLEN_BENCH_S" python3 -m flashtile.bench --varlen ${VARLEN_FLAGS:-} --json "$out/varlen.json" \
    --markdown "$out/varlen.md" > "$out/varlen.log" 2>&1
  echo "varlen bench: $(( $(date +%s) - t0 ))s rc=$?" | tee -a "$out/summary.txt"
  tail -n 60 "$out/varlen.log"
fi
# KV-cache decode (bf16 and FP8 caches) against cuDNN / flash SDPA / FlexAttention, % of the
# read bandwidth measured in the same run; DECODE_FLAGS e.g. --quick.
if [ "${DECODE_BENCH_S:-0}" != 0 ]; then
  t0=$(date +%s)
  timeout "$DECODE_BENCH_S" python3 benchmarks/decode_bench.py --fp8 ${DECODE_FLAGS:-} --out "$out/decode" \
    > "$out/decode_bench.log" 2>&1
  echo "decode bench: $(( $(date +%s) - t0 ))s rc=$?" | tee -a "$out/summary.txt"
  cut -c1-150 "$out/decode_bench.log" | tail -n 60
fi
if [ -n "${SANITIZE_CASES:-}" ]; then
  CASES="$SANITIZE_CASES" TOOLS="memcheck racecheck" bash benchmarks/sanitize.sh "$out/sanitize" > "$out/sanitize.log" 2>&1
  cat "$out/sanitize/summary.txt" | tee -a "$out/summary.txt"
fi
kill $smi_pid 2>/dev/null
echo "gpu: max $(awk -F, '{print $4}' "$out/smi.log" | sort -n | tail -n 1) C; throttle reasons (samples):" \
  $(awk -F, '{print $6}' "$out/smi.log" | sort | uniq -c | tr -s ' ') | tee -a "$out/summary.txt"
grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests.log" | tail -n 15
tail -n 40 "$out/bench.log"
cat "$out/summary.txt"
