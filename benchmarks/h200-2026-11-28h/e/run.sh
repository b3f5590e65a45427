#!/usr/bin/env bash
# Twenty-fourth session, call e: the row max folded in halves first (`max_halvings`, NOTES
# Ran on the max_halvings experiment (reverted; NOTES, twenty-fourth session, outcome 3): the
# 9th field of the forward tuples was that count, which FwdConfig no longer has.
# prediction 3); the 9th field of the forward tuples.  $1 = out.
set -u
o=$1; mkdir -p "$o"
t() { timeout "$1" python3 benchmarks/tune.py fwd "${@:2}" --repeat 2 2>&1 | grep -E "TUNE|CHECK|PASS|FAIL|rror" >> "$o/tune.txt"; }
t 130 --check --headdim 128 --seqlen 1024 4096 --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,1,0,0,2 128,128,2,256,1,1,0,0,3
t 70 --check --headdim 64 --seqlen 1024 --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,1,0,0,2
t 70 --check --headdim 64 --seqlen 4096 --configs 192,128,2,384,1,1,1,0,0 192,128,2,384,1,1,1,0,2
t 70 --check --headdim 256 --seqlen 4096 --configs 128,80,2,256,1,1,1,1,0 128,80,2,256,1,1,1,1,1
t 80 --fp8 --headdim 128 --seqlen 1024 4096 --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,1,0,0,2
t 70 --fp8 --headdim 128 --seqlen 16384 --configs 192,96,2,384,1,1,1,0,0 192,96,2,384,1,1,1,0,2
grep -c TUNE "$o/tune.txt"; grep -E "FAIL|rror|CHECK fp8" "$o/tune.txt" | head
