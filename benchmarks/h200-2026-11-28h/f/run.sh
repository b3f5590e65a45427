#!/usr/bin/env bash
# Twenty-fourth session, call f: first use with kernels found by structure id (NOTES prediction 4),
# then the dense GPU tests with every kernel loaded that way (the carried pack's entries are
# tagged).  Needs `carry: [".carry", "flashtile/kernels/prebuilt"]`.  $1 = out.
set -u
o=$1; mkdir -p "$o"
bash benchmarks/first_use.sh "$o"
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py tests/test_degenerate.py > "$o/gpu_tests.txt" 2>&1
tail -1 "$o/gpu_tests.txt"
python3 -c "
from flashtile.kernels import cache, launch
k = launch.forward_kernel(128, 128, 'bfloat16', False, False)
print('forward kernel via', type(k).__name__)" >> "$o/gpu_tests.txt" 2>&1
tail -1 "$o/gpu_tests.txt"
