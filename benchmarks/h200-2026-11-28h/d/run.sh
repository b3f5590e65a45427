#!/usr/bin/env bash
# Twenty-fourth session, call d: the paired forward's epilogue without consumer-wide barriers
# Ran on the direct_store experiment (reverted; NOTES, twenty-fourth session, outcome 2): the
# 9th field of the forward tuples was that flag, which FwdConfig no longer has.
# (`direct_store`, NOTES prediction 2).  $1 = out.
set -u
o=$1; mkdir -p "$o"
FLASHTILE_FWD_FLAGS=direct_store=1 timeout 260 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_fp8.py tests/test_degenerate.py > "$o/gpu_tests_flag.txt" 2>&1
tail -3 "$o/gpu_tests_flag.txt"
t() { timeout "$1" python3 benchmarks/tune.py fwd "${@:2}" --repeat 2 2>&1 | grep -E "TUNE|rror" >> "$o/tune.txt"; }
t 120 --headdim 128 --seqlen 512 1024 2048 4096 --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,1,0,0,1
t 80 --headdim 64 --seqlen 512 1024 --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,1,0,0,1
t 100 --fp8 --headdim 128 --seqlen 1024 2048 4096 --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,1,0,0,1
grep -c TUNE "$o/tune.txt"
