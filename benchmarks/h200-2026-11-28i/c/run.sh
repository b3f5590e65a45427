#!/usr/bin/env bash
# Twenty-fifth session, call c: call b again after its failure (kernels loaded without TileLang
# missed libtilelang.so's __tvm_tensormap_create_tiled; the runtime now loads it).  Needs
# `carry: [".carry", "flashtile/kernels/prebuilt"]`; the pack holds what this call reads.
# 1. first_use.py, three configurations, a fresh TileLang cache with only the shipped bundle,
#    then a second process on it.  2. The dense and FP8 GPU tests (the no-TileLang process test
#    included).  3. tune.py A/B of defer_sum (9th field) and pingpong (6th) at d = 64 and d = 128.
set -u
o=$1; mkdir -p "$o"
bash benchmarks/first_use.sh "$o"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 tests/test_gpu_kernels.py tests/test_gpu_fp8.py \
  tests/test_degenerate.py > "$o/gpu_tests.txt" 2>&1
tail -1 "$o/gpu_tests.txt"
t() { timeout 120 python3 benchmarks/tune.py fwd --repeat 2 --jobs 4 "$@" 2>&1 | grep "^TUNE" >> "$o/tune.txt"; }
t --headdim 64 --seqlen 1024 --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,1,0,0,1 128,128,2,256,1,0,0,0,0 128,128,2,256,1,0,0,0,1
t --headdim 64 --seqlen 4096 --configs 192,128,2,384,1,1,1,0,0 192,128,2,384,1,1,1,0,1
t --headdim 128 --seqlen 1024 --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,1,0,0,1
python3 benchmarks/tune_table.py "$o/tune.txt" > "$o/tune_table.md"; cat "$o/tune_table.md"
tar -C "$o" -czf "$o/logs.tgz" first_use.txt gpu_tests.txt tune.txt tune_table.md
