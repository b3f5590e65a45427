#!/usr/bin/env bash
# Prediction 8's A/B (thirty-fourth session), shared by calls a0, a and a1: the d = 256 backward's
# table kernel, one stage + `dq_regs`, two stages + `dq_regs`, each after `quick.check`'s odd
# shapes, 4k / 16k, full / causal, two interleaved rounds.
#
#   ab_bwd256.sh LOGDIR OUTDIR SUMMARY    # TUNE_S: time limit (default 170), TUNE_JOBS: prebuild jobs
#
# The full log goes to LOGDIR/tune_bwd256.txt, its result lines to OUTDIR/tune_lines.txt, the
# exit code and duration to SUMMARY.
set -uo pipefail
log=$1; out=$2; summary=$3
t0=$(date +%s)
timeout "${TUNE_S:-170}" python3 benchmarks/tune.py bwd --headdim 256 --seqlen 4096 16384 --check --repeat 2 --jobs "${TUNE_JOBS:-8}" \
  --configs 64,64,1,256,1 64,64,1,256,1,0,0,0,1 64,64,2,256,1,0,0,0,1 > "$log/tune_bwd256.txt" 2>&1
echo "tune bwd d256 rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$summary"
grep -hE "^TUNE|^CHECK|^built|Error|error|mismatch" "$log/tune_bwd256.txt" | cut -c1-170 | tee "$out/tune_lines.txt"
