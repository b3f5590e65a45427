#!/usr/bin/env bash
# Decode A/B of an older flashtile (.abtest, see ab_bench.sh) against the working tree, each
# run in its own process and tree, interleaved new, old, new:
#   bash benchmarks/ab_decode.sh OUT [decode_sweep.py arguments]
set -uo pipefail
out=$(realpath "$1"); shift
mkdir -p "$out"
site=${PYTHONPATH%%:*}
sweep=$(realpath benchmarks/decode_sweep.py)
for run in new1 old new2; do
  tree=$PWD; [ "$run" = old ] && tree=$PWD/.abtest
  echo "== $run ($tree)"
  (cd "$tree" && PYTHONPATH=$site:$tree timeout "${AB_S:-100}" python3 "$sweep" "$@" 2>&1 | grep -v INFO) | tee "$out/$run.txt"
done
