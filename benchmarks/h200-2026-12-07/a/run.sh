#!/usr/bin/env bash
# Call a (thirty-fourth session): the d = 256 backward with dQ reduce-added from registers
# (`dq_regs`, NOTES prediction 8) against the table's kernel, each after `quick.check`'s odd
# shapes, then the whole GPU suite and the dense bench on the tree as committed, where the
# d = 256 backward's default is staged as two stages + `dq_regs` (kept only if the A/B wins
# and the suite passes; the earlier default is the A/B's first config), on whichever GPU comes (status offered an H200; the last H200 bench is the
# twenty-ninth session's).  Logs go to /tmp/a and are tarred into $OUT/logs.tgz (the device
# tool returns at most 8 files), summary and tune lines beside it.
set -uo pipefail
OUTDIR=$1; w=/tmp/a; mkdir -p "$w"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/ab_summary.txt"
bash benchmarks/h200-2026-12-07/ab_bwd256.sh "$w" "$OUTDIR" "$w/ab_summary.txt"
bash benchmarks/h200-2026-12-07/suite_bench.sh "$w" "$OUTDIR"
