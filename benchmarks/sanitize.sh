#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over every kernel family at small
# shapes with tails (benchmarks/sanitize_cases.py).  On the device machine:
#
#   bash .carry/install.sh && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/sanitize.sh $OUT/sanitize
#
# Steps: (1) build the cases' kernels in parallel into TileLang's disk cache, (2) a warm-up pass
# without the sanitizer (outputs poisoned with NaN, every case compared with the CPU reference;
# it also compiles whatever step 1 missed), (3) each tool as its own process over the same
# driver: memcheck, synccheck and initcheck on every case, racecheck on one shape per family
# (it is the slow one).  Logs: <dir>/{precompile,warmup,memcheck,racecheck,synccheck,initcheck}.log;
# one summary line per step in <dir>/summary.txt, e.g. "memcheck: 0 errors over 231 flashtile
# kernel launches (74 cases, 41s)".  Exit status non-zero when any tool reports an error, a step
# times out or a case fails.
#
# Budgets in seconds, each a hard timeout, so the whole script stays under 6 minutes (a step that
# runs out is reported as TIMEOUT and fails the run; raise its budget on a cold machine):
#   PRECOMPILE_S=90 WARMUP_S=75 MEMCHECK_S=60 RACECHECK_S=60 SYNCCHECK_S=40 INITCHECK_S=150
# initcheck runs benchmarks/initcheck_probe.py first (a TMA store and a plain store, each read by
# PyTorch) and splits its reports by the reading kernel: flashtile's own reads of unwritten memory
# always fail the run; PyTorch reads of flashtile outputs count as the TMA-store blind spot only
# when the probe shows that blind spot (plain store clean, TMA store reported).
# TOOLS="memcheck initcheck" runs a subset; CASES=<substring> restricts the driver's cases (-k; "a|b": either).
# PyTorch's caching allocator is off under the tools (PYTORCH_NO_CUDA_MEMORY_CACHING=1): every
# tensor is its own cudaMalloc, so an out-of-bounds access cannot land silently in a neighbouring
# tensor of the same segment (memcheck), and a fresh output really is uninitialized (initcheck;
# for the same reason the tools run without FLASHTILE_POISON, which would initialize outputs).
set -uo pipefail
out=${1:-${OUT:-device-out}/sanitize}
mkdir -p "$out"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
driver="$here/sanitize_cases.py"
export PYTHONUNBUFFERED=1 FLASHTILE_QUIET=1 TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache}
unset FLASHTILE_POISON
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
jobs=$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))
cases=()
[ -n "${CASES:-}" ] && cases=(-k "$CASES")
summary="$out/summary.txt"
: > "$summary"
status=0

say() { echo "$*" | tee -a "$summary"; }

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /' | tee -a "$summary"
if [ ! -x "$cs" ]; then
  say "compute-sanitizer not found (PATH or /usr/local/cuda/bin)"
  exit 2
fi
say "compute-sanitizer: $("$cs" --version 2>/dev/null | grep -iE 'version' | tail -n 1)"
help=$("$cs" --help 2>&1 || true)

# 1. build the kernels (parallel processes, disk cache)
t0=$(date +%s)
timeout "${PRECOMPILE_S:-90}" python3 "$driver" --precompile --jobs "$jobs" "${cases[@]}" > "$out/precompile.log" 2>&1
rc=$?
line=$(grep -E '^precompile:' "$out/precompile.log" | tail -n 1 | sed 's/^precompile: //')
[ "$rc" -eq 124 ] && line="TIMEOUT after $(grep -c '^built ' "$out/precompile.log") builds (the warm-up builds the rest)"
say "precompile: ${line:-no summary line} rc=$rc ($(( $(date +%s) - t0 ))s)"

# 2. warm-up without the sanitizer: poisoned outputs, compared with the reference
t0=$(date +%s)
timeout "${WARMUP_S:-75}" python3 "$driver" --check "${cases[@]}" > "$out/warmup.log" 2>&1
rc=$?
line=$(grep -E '^cases: ' "$out/warmup.log" | tail -n 1)
if [ "$rc" -ne 0 ]; then status=1; fi
[ "$rc" -eq 124 ] && line="TIMEOUT after $(grep -c '^case ' "$out/warmup.log") cases"
say "warmup (no sanitizer, poisoned outputs vs reference): ${line:-no summary line} rc=$rc ($(( $(date +%s) - t0 ))s)"
grep -E '^(FAILED|not in this)' "$out/warmup.log" | tee -a "$summary"

# 3. one process per tool
run_tool() {
  local tool=$1 set=$2 budget=$3
  shift 3
  local t0 rc errors launches n line saved_status=$status
  t0=$(date +%s)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$budget" "$cs" --tool "$tool" --error-exitcode 99 --print-limit "${PRINT_LIMIT:-200}" "$@" \
    python3 "$driver" --set "$set" "${cases[@]}" > "$out/$tool.log" 2>&1
  rc=$?
  errors=$(grep -oE 'ERROR SUMMARY: [0-9]+ error' "$out/$tool.log" | tail -n 1 | grep -oE '[0-9]+')
  launches=$(grep -oE 'flashtile kernel launches: [0-9]+' "$out/$tool.log" | tail -n 1 | grep -oE '[0-9]+$')
  n=$(grep -cE '^case ' "$out/$tool.log")
  if [ -z "$launches" ]; then  # cut short: count what the finished cases launched
    launches=$(grep -oE '^case .*: [0-9]+ launches' "$out/$tool.log" | grep -oE '[0-9]+ launches$' | awk '{s += $1} END {print s + 0}')
  fi
  line="$tool: ${errors:-?} errors over $launches flashtile kernel launches ($n cases, $(( $(date +%s) - t0 ))s"
  case $rc in
    0) line="$line)" ;;
    124|137) line="$line, TIMEOUT after ${budget}s)"; status=1 ;;
    99) line="$line, errors reported)"; status=1 ;;
    *) line="$line, rc=$rc)"; status=1 ;;
  esac
  if [ "$tool" = initcheck ] && [ "${errors:-0}" != 0 ]; then
    # Split the reports by the kernel that read: a flashtile kernel (TileLang names them
    # main_kernel) reading unwritten memory is a bug; a PyTorch kernel reading a flashtile output
    # is initcheck not tracking TMA stores when the probe says so and the poisoned warm-up
    # proved every output element written.
    local own
    python3 "$here/initcheck_attribution.py" "$out/$tool.log" > "$out/initcheck-cases.txt" 2>&1
    line="$line; $(tail -n 1 "$out/initcheck-cases.txt")"
    own=$(tail -n 1 "$out/initcheck-cases.txt" | grep -oE 'flashtile kernels: [0-9]+' | grep -oE '[0-9]+$')
    head -n 40 "$out/initcheck-cases.txt" >> "$summary"
    if [ "$own" = 0 ] && [ "$rc" = 99 ] && [ "${TMA_BLIND:-0}" = 1 ]; then
      line="$line (TMA-store blind spot: not counted as a failure)"
      status=$saved_status
    fi
  fi
  local race
  race=$(grep -oE 'RACECHECK SUMMARY: .*' "$out/$tool.log" | tail -n 1)
  [ -n "$race" ] && line="$line; $race"
  say "$line"
  grep -E '^FAILED' "$out/$tool.log" | head -n 5 | tee -a "$summary"
  if [ "${errors:-0}" != 0 ]; then  # the first distinct kernels with errors
    grep -E '^========= +(Invalid|Uninitialized|Race|Barrier|Error|Program hit|Warning)' "$out/$tool.log" | sort | uniq -c | sort -rn | head -n 5 | tee -a "$summary"
  fi
}

memcheck_flags=()
echo "$help" | grep -q -- '--padding' && memcheck_flags+=(--padding 64)
race_flags=()
echo "$help" | grep -q -- '--racecheck-report' && race_flags+=(--racecheck-report all)

for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
  case $tool in
    memcheck) run_tool memcheck all "${MEMCHECK_S:-60}" "${memcheck_flags[@]}" ;;
    racecheck) run_tool racecheck race "${RACECHECK_S:-60}" "${race_flags[@]}" ;;
    synccheck) run_tool synccheck all "${SYNCCHECK_S:-40}" ;;
    initcheck)
      # First the probe (benchmarks/initcheck_probe.py): does initcheck see TMA stores at all?
      TMA_BLIND=0
      for store in plain tma tma-tilelang-read; do
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 "$cs" --tool initcheck --show-backtrace no \
          python3 "$here/initcheck_probe.py" "$store" > "$out/initcheck-probe-$store.log" 2>&1
        n=$(grep -oE 'ERROR SUMMARY: [0-9]+ errors?$' "$out/initcheck-probe-$store.log" | tail -n 1 | grep -oE '[0-9]+')
        say "initcheck probe, $store store: ${n:-?} reports; $(grep -oE 'B == A: [A-Za-z]+' "$out/initcheck-probe-$store.log")"
        eval "probe_${store//-/_}=\${n:-x}"
      done
      [ "$probe_plain" = 0 ] && [ "$probe_tma" != 0 ] && [ "$probe_tma" != x ] && TMA_BLIND=1
      PRINT_LIMIT=100000 run_tool initcheck all "${INITCHECK_S:-150}" --show-backtrace no ;;
    *) say "unknown tool $tool"; status=1 ;;
  esac
done

say "sanitize: $([ "$status" -eq 0 ] && echo PASS || echo FAIL) (logs in $out)"
exit "$status"
