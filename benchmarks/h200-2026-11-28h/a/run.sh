#!/usr/bin/env bash
# Twenty-fourth session, call a: row_sum_mma (NOTES prediction 1).  Run from the repo root on
# Ran on the row_sum_mma experiment (reverted; NOTES, twenty-fourth session, outcome 1): the
# 9th field of the forward tuples was that flag, which FwdConfig no longer has.
# the device after the usual prefix; writes into $1.
set -u
o=$1; mkdir -p "$o"
# Correctness first: the whole FP8 GPU file with the flag on every hand-written forward row.
FLASHTILE_FWD_FLAGS=row_sum_mma=1 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_fp8.py > "$o/fp8_tests_flag.txt" 2>&1
tail -3 "$o/fp8_tests_flag.txt"
t() { timeout "$1" python3 benchmarks/tune.py fwd "${@:2}" --repeat 2 2>&1 | grep -E "TUNE|CHECK|PASS|FAIL|rror" >> "$o/tune.txt"; }
t 150 --fp8 --headdim 128 --seqlen 1024 4096 16384 --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,1,0,0,1 192,96,2,384,1,1,1,0,0 192,96,2,384,1,1,1,0,1
t 70 --fp8 --headdim 256 --seqlen 4096 16384 --configs 128,128,2,256,1,1,1,0,0 128,128,2,256,1,1,1,0,1
t 70 --fp8 --headdim 64 --seqlen 4096 16384 --configs 192,128,2,384,1,1,1,0,0 192,128,2,384,1,1,1,0,1
t 80 --check --headdim 128 --seqlen 4096 16384 --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,1,0,0,1
t 80 --check --headdim 64 --seqlen 4096 16384 --configs 192,128,2,384,1,1,1,0,0 192,128,2,384,1,1,1,0,1
t 80 --check --headdim 256 --seqlen 4096 16384 --configs 128,80,2,256,1,1,1,1,0 128,80,2,256,1,1,1,1,1
grep -c TUNE "$o/tune.txt"; grep -E "FAIL|rror" "$o/tune.txt" | head
