#!/usr/bin/env bash
# Twenty-fifth session, call e: the d <= 64 short row without pingpong turns for full attention
# (c/'s A/B: 1k full -3.5% beyond defer_sum).  The dense GPU tests at HEAD (the carried pack holds
# the dense kernels only), then the d = 64 forward against cuDNN at 512 / 1k / 2k.
set -u
o=$1; mkdir -p "$o"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py tests/test_degenerate.py \
  > "$o/gpu_tests.txt" 2>&1
tail -1 "$o/gpu_tests.txt"
timeout 100 python3 -m flashtile.bench --headdim 64 --seqlen 512 1k 2k --mode fwd --backends flashtile cudnn \
  --markdown "$o/bench.md" > "$o/bench.log" 2>&1
grep "^| " "$o/bench.md" | head -12
tar -C "$o" -czf "$o/logs.tgz" gpu_tests.txt bench.md bench.log
