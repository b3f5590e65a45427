#!/usr/bin/env bash
# Twenty-sixth session, call a (4x H200, issue 20): the ring-attention numerics matrix on 4 ranks
# (NCCL), then `flashtile cp` at 64k, 128k and 256k total tokens (causal bf16, 32 heads, d=128,
# zigzag) against torch's context_parallel over cuDNN, with measured single-GPU T1.
set -u
o=$1; mkdir -p "$o"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c 'import torch; print("devices", torch.cuda.device_count(), torch.__version__, torch.cuda.nccl.version())'; } > "$o/env.txt" 2>&1
s=$(date +%s)
timeout 480 torchrun --nproc_per_node=4 benchmarks/ring_gpu.py --out "$o/cp4" --seqlens 64k,128k,256k > "$o/cp4.log" 2>&1
echo "rc $? after $(( $(date +%s) - s )) s" >> "$o/cp4.log"
grep -v '^W1128' "$o/cp4.log" | tail -60
