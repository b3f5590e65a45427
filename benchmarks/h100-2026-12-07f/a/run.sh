#!/usr/bin/env bash
# Call a (fortieth session), ~6 minutes on an H100 with the kernel pack carried: the whole GPU
# suite and the dense bench on the tree the thirty-ninth session ended with (eager plans recorded
# on a key's second call, the FP8 d = 64 short row selected: neither had run on a GPU), then where
# the training path's and the packed forward's host time goes (launch_overhead.py --profile).
#
#   bash benchmarks/h100-2026-12-07f/a/run.sh $OUT
set -uo pipefail
OUTDIR=$1; w=/tmp/a; mkdir -p "$w"
TOTAL_S=${TOTAL_S:-400} bash benchmarks/h200-2026-12-07/suite_bench.sh "$w" "$OUTDIR"
(cd benchmarks && timeout ${HOST_S:-100} python3 launch_overhead.py --profile > "$OUTDIR/launch_overhead.txt" 2>&1)
echo "launch_overhead rc=$?"; grep -E "us  " "$OUTDIR/launch_overhead.txt" | head -30
