#!/usr/bin/env bash
# Twenty-sixth session, call e (4x H200, issue 20): the copy-engine ring (transport.PeerRing:
# each rank pulls the previous rank's block out of symmetric memory with a device-to-device
# copy, no SM taken) against NCCL in the same call, and the one-pass lse merge (lerp).
# Prediction (NOTES): the transfers cost ~7 ms of the 128k forward and ~17 ms of its backward
# with NCCL; with copy engines the ring should approach its no-communication time (fwd ~62,
# bwd ~174 ms): fwd+bwd 128k 262 -> ~240 ms, efficiency 0.88 -> ~0.95, ahead of torch CP (254).
set -u
o=$1; mkdir -p "$o"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/ring_step_probe.py --seqlen 128k --world 4 --rank 3 --out "$o/probe_r3.md" > "$o/probe_r3.log" 2>&1
tail -4 "$o/probe_r3.md"
s=$(date +%s)
timeout 200 torchrun --nproc_per_node=4 benchmarks/ring_gpu.py --out "$o/ce" --seqlens 64k,128k > "$o/ce.log" 2>&1
echo "ce rc $? after $(( $(date +%s) - s )) s"; grep -i "warn\|error" "$o/ce.log" | grep -v "^W1128" | head -5
cat "$o/ce/numerics.md" "$o/ce/cp.md"
s=$(date +%s)
FLASHTILE_RING_TRANSPORT=nccl timeout 100 torchrun --nproc_per_node=4 -m flashtile.distributed.bench --seqlens 64k,128k \
  --no-baseline --single-max 0 --t1-from "$o/ce/cp.json" --check-seqlen 0 --out "$o/nccl" > "$o/nccl.log" 2>&1
echo "nccl rc $? after $(( $(date +%s) - s )) s"; grep -m1 -A4 '^| total' "$o/nccl/cp.md"; grep -A6 'Forward only' "$o/nccl/cp.md" | tail -3
s=$(date +%s)
timeout 150 torchrun --nproc_per_node=4 -m flashtile.distributed.bench --seqlens 256k --single-max 0 --t1-from benchmarks/h200x4-2026-11-28/d/cp.json \
  --check-seqlen 0 --out "$o/ce256" > "$o/ce256.log" 2>&1
echo "ce256 rc $? after $(( $(date +%s) - s )) s"; grep -m1 -A3 '^| total' "$o/ce256/cp.md"; grep -A5 'Forward only' "$o/ce256/cp.md" | tail -2
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -x tests/test_gpu_kernels.py > "$o/pytest_kernels.log" 2>&1
echo "pytest rc $?"; tail -2 "$o/pytest_kernels.log"
tar -C "$o" -czf "$o/logs.tgz" ce nccl ce256 ce.log nccl.log ce256.log probe_r3.log probe_r3.md pytest_kernels.log && rm -rf "$o/ce" "$o/nccl" "$o/ce256" "$o"/*.log "$o"/*.md
