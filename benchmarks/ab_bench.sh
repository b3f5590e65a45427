#!/usr/bin/env bash
# A/B timing of an older flashtile against the working tree in one device call, interleaved
# (new, old, new) so clock or thermal drift shows up as a new-vs-new difference.
#
#   here:   mkdir -p .abtest && git archive REF flashtile | tar -x -C .abtest   (carry .abtest)
#           PYTHONPATH=.abtest python3 -m flashtile.kernels.precompile ...    (old kernels cached)
#   device: bash benchmarks/ab_bench.sh $OUT/ab --headdim 64 128 --seqlen 1k 4k --mode fwd
set -uo pipefail
out=$1; shift
mkdir -p "$out"
site=${PYTHONPATH%%:*}
# Each run starts in its own tree: `python3 -m` puts the working directory first on sys.path,
# so PYTHONPATH alone would import the working tree's flashtile for the old run as well (it did
# until the seventh session: the second session's "A/B" timed the same code three times).
out=$(realpath "$out")
for run in new1 old new2; do
  tree=$PWD; [ "$run" = old ] && tree=$PWD/.abtest
  (cd "$tree" && PYTHONPATH=$site:$tree timeout "${AB_S:-100}" python3 -m flashtile.bench --backends flashtile cudnn "$@" \
    --json "$out/$run.json" --markdown "$out/$run.md" > "$out/$run.log" 2>&1)
  echo "== $run ($tree): rc $? ($(python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); import flashtile; print(flashtile.__file__)' "$tree"))"
  grep -E "^\| (full|causal|window)" "$out/$run.md" | cut -d'|' -f2-8
done
