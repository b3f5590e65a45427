#!/usr/bin/env bash
# FP8 forward A/B on the device (NOTES, 2026-11-23 fourth session): part of the exponentials on
# the FMA pipes (exp2_fma_every 0 = none, k = one column group in k), per head dim, in one
# process per head dim, configs interleaved (--repeat).  Prebuild them on the CPU machine first
# (benchmarks/tune.py's prebuild, or carry the kernel cache).
set -uo pipefail
run() { python3 benchmarks/tune.py fwd --fp8 --seqlen 4096 16384 --repeat 2 --jobs 4 "$@" 2>&1 | grep "^TUNE"; }
run --headdim 128 --configs 128,128,2,256,1,1,0,0 128,128,2,256,1,1,0,8 128,128,2,256,1,1,0,4 128,128,2,256,1,1,0,2
run --headdim 256 --configs 128,128,2,256,1,1,1,0 128,128,2,256,1,1,1,8 128,128,2,256,1,1,1,4
run --headdim 64 --configs 192,128,2,384,1,1,1,0 192,128,2,384,1,1,1,4
