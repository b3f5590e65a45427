# Sourced by the device session scripts (decode_session.sh, varlen_session.sh, fp8_session.sh):
# the common start and one timed step.
#
#   session_start DIR
#
# sets $out to DIR (created), the environment every session runs with, and an empty
# "$out/summary.txt".
#
#   step LABEL BUDGET_S LOG command [args...]
#
# runs the command under `timeout BUDGET_S`, stdout and stderr into LOG, then prints and appends
# to "$out/summary.txt" one line: "LABEL: <seconds>s (rc N): <LOG's last line>" (rc 124: the
# budget ran out).  Needs $out set by the caller.
step() {
  local label=$1 budget=$2 log=$3 t0 rc
  shift 3
  t0=$(date +%s)
  timeout "$budget" "$@" > "$log" 2>&1
  rc=$?
  echo "$label: $(( $(date +%s) - t0 ))s (rc $rc): $(tail -n 1 "$log")" | tee -a "$out/summary.txt"
}

session_start() {
  out=$1
  mkdir -p "$out"
  export PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache}
  : > "$out/summary.txt"
}
