#!/usr/bin/env bash
# Twenty-fifth session, call b (NOTES predictions 1 and 2).  Needs `carry: [".carry",
# "flashtile/kernels/prebuilt"]` (the bundle built by `python -m flashtile.kernels.prebuilt build`).
# 1. First use without TileLang's import: first_use.py, three configurations, each in a fresh
#    TileLang cache holding only the shipped bundle, then a second process on that cache.
# 2. The dense and FP8 GPU tests (the new no-TileLang process test included; the carried pack holds
#    only what this call reads: kernel_cache.sh pack-used), and at the end the same under
#    FLASHTILE_FWD_FLAGS=defer_sum=1.
# 3. tune.py A/B of defer_sum (0 / 1 as the 9th field), configs interleaved, two rounds; at d = 64
#    1k and FP8 d = 128 also without pingpong turns (6th field 0: both softmax-bound).
set -u
o=$1; mkdir -p "$o"
bash benchmarks/first_use.sh "$o"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 tests/test_gpu_kernels.py tests/test_gpu_fp8.py \
  tests/test_degenerate.py > "$o/gpu_tests.txt" 2>&1
tail -1 "$o/gpu_tests.txt"
t() { timeout 110 python3 benchmarks/tune.py fwd --repeat 2 --jobs 4 "$@" 2>&1 | grep "^TUNE" >> "$o/tune.txt"; }
t --headdim 64 --seqlen 1024 --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,1,0,0,1 128,128,2,256,1,0,0,0,0 128,128,2,256,1,0,0,0,1
t --headdim 64 --seqlen 4096 --configs 192,128,2,384,1,1,1,0,0 192,128,2,384,1,1,1,0,1
t --fp8 --headdim 128 --seqlen 4096 16384 --configs 192,96,2,384,1,1,1,0,0 192,96,2,384,1,1,1,0,1 192,96,2,384,1,0,1,0,0 192,96,2,384,1,0,1,0,1
t --headdim 128 --seqlen 1024 4096 --configs 128,128,2,256,1,1,0,0,0 128,128,2,256,1,1,0,0,1
t --headdim 256 --seqlen 4096 --configs 128,80,2,256,1,1,1,1,0 128,80,2,256,1,1,1,1,1
python3 benchmarks/tune_table.py "$o/tune.txt" | tee "$o/tune_table.md"
FLASHTILE_FWD_FLAGS=defer_sum=1 timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py \
  tests/test_gpu_fp8.py tests/test_degenerate.py > "$o/gpu_tests_defer.txt" 2>&1
tail -1 "$o/gpu_tests_defer.txt"
tar -C "$o" -czf "$o/logs.tgz" first_use.txt gpu_tests.txt gpu_tests_defer.txt tune.txt tune_table.md
