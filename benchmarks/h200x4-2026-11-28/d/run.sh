#!/usr/bin/env bash
# Twenty-sixth session, call d (4x H200, issue 20): ring steps without persistent grids
# (configs.sharing_sms).  1. the SM-sharing kernels against the reference (GPU 0);
# 2. ring numerics matrix on 4 ranks + flashtile cp 64k/128k/256k with measured T1;
# 3. flashtile cp 512k and 1M, T1 extrapolated from step 2's 256k runs (FLOP ratio).
set -u
o=$1; mkdir -p "$o"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q tests/test_gpu_kernels.py -k sharing > "$o/pytest_sharing.log" 2>&1
echo "pytest rc $?"; tail -2 "$o/pytest_sharing.log"
s=$(date +%s)
timeout 300 torchrun --nproc_per_node=4 benchmarks/ring_gpu.py --out "$o/cp4" --seqlens 64k,128k,256k > "$o/cp4.log" 2>&1
echo "ring_gpu rc $? after $(( $(date +%s) - s )) s"
cat "$o/cp4/numerics.md" "$o/cp4/cp.md"
s=$(date +%s)
timeout 250 torchrun --nproc_per_node=4 -m flashtile.distributed.bench --seqlens 512k,1024k --single-max 0 \
  --t1-from "$o/cp4/cp.json" --check-seqlen 0 --warmup 1 --iters 3 --out "$o/cp4long" > "$o/cp4long.log" 2>&1
echo "long rc $? after $(( $(date +%s) - s )) s"
cat "$o/cp4long/cp.md"
tar -C "$o" -czf "$o/logs.tgz" cp4 cp4long cp4.log cp4long.log pytest_sharing.log && rm -rf "$o/cp4" "$o/cp4long" "$o"/*.log
