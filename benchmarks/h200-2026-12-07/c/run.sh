#!/usr/bin/env bash
# Call c (thirty-fifth session): prediction 8 decided on the device, then the whole GPU suite and
# the dense bench on the tree the A/B chose, in one call (device starts are rare: NOTES).
# 1. `ab_bwd256.sh`: the d = 256 backward's table kernel, one stage + `dq_regs`, two stages +
#    `dq_regs`, each after `quick.check`'s odd shapes; 4k / 16k, full / causal, two rounds.
# 2. `decide.py`: the two-stage variant wins only if it is faster than the table kernel in every
#    one of the eight timings; then `staged-dq-regs.patch`'s config line replaces the default's
#    in this copy of the tree (the kernel pack holds both trees' kernels).
# 3. `suite_bench.sh` (`device_session.sh`): the whole GPU suite and the dense bench on that tree.
# Logs go to /tmp/c and are tarred into $OUT/logs.tgz (the device tool returns at most 8 files).
set -uo pipefail
OUTDIR=$1; w=/tmp/c; here=benchmarks/h200-2026-12-07; mkdir -p "$w"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/ab_summary.txt"
bash benchmarks/kernel_cache.sh unpack >/dev/null
TUNE_S=${TUNE_S:-150} TUNE_JOBS=12 bash $here/ab_bwd256.sh "$w" "$OUTDIR" "$w/ab_summary.txt"
if python3 $here/c/decide.py "$OUTDIR/tune_lines.txt" | tee -a "$w/ab_summary.txt" | grep -q "^KEEP"; then
  python3 $here/c/decide.py --stage flashtile/kernels/configs.py | tee -a "$w/ab_summary.txt"
fi
TOTAL_S=${TOTAL_S:-380} bash $here/suite_bench.sh "$w" "$OUTDIR"
