#!/usr/bin/env bash
# Time to first result on the device (issue 19, item 4): benchmarks/first_use.py for three common
# configurations, each in a fresh TileLang cache holding only the shipped bundle (build it first:
# `python -m flashtile.kernels.prebuilt build`; carry flashtile/kernels/prebuilt), then a second
# process on that cache.  Appends to $1/first_use.txt and prints the summary lines.
set -u
o=$1; mkdir -p "$o"
for args in "--headdim 128 --dtype bfloat16 --causal" "--headdim 64 --dtype float16 --gqa 4" "--headdim 256 --dtype bfloat16"; do
  d=$(mktemp -d)
  TILELANG_CACHE_DIR=$d timeout 60 python3 benchmarks/first_use.py $args >> "$o/first_use.txt" 2>&1   # cold: the shipped bundle only
  TILELANG_CACHE_DIR=$d timeout 60 python3 benchmarks/first_use.py $args >> "$o/first_use.txt" 2>&1   # the next process
done
grep "first forward" "$o/first_use.txt" || tail -5 "$o/first_use.txt"
