#!/usr/bin/env bash
# Call s (thirty-seventh session): the whole GPU suite and the dense bench on the tree with
# `producer_regs` on in the forward rows prediction 9 made faster (NOTES), against cuDNN and
# PyTorch flash SDPA in the same run.  ~7 minutes on an H100 with the kernel pack carried.
#
#   bash benchmarks/h100-2026-12-07c/s/run.sh $OUT
set -uo pipefail
OUTDIR=$1; w=/tmp/s; mkdir -p "$w"
TOTAL_S=${TOTAL_S:-400} bash benchmarks/h200-2026-12-07/suite_bench.sh "$w" "$OUTDIR"
