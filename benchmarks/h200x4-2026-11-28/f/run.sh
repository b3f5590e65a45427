#!/usr/bin/env bash
# Twenty-sixth session, call f (4x H200): call e's copy-engine ring passed the numerics matrix
# (8/8, bitwise deterministic) and then hung in `flashtile cp` (64k, and 256k).  Which phase:
# A. copy-engine ring alone, 64k/128k, with a watchdog that prints every rank's Python stacks;
# B. NCCL ring alone, same flags (the in-call comparison); C. copy-engine ring then torch CP.
set -u
o=$1; mkdir -p "$o"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() {  # name, timeout, env/flags...
  local name=$1 t=$2; shift 2
  local s=$(date +%s)
  env "$@" timeout "$t" torchrun --nproc_per_node=4 -m flashtile.distributed.bench $FLAGS --out "$o/$name" > "$o/$name.log" 2>&1
  echo "$name rc $? after $(( $(date +%s) - s )) s"; grep "flashtile cp" "$o/$name.log" | tail -3
  grep -m1 -A4 '^| total' "$o/$name/cp.md" 2>/dev/null; grep -A6 'Forward only' "$o/$name/cp.md" 2>/dev/null | tail -2
}
FLAGS="--seqlens 64k,128k --no-baseline --no-single --check-seqlen 0 --warmup 2 --iters 5 --watchdog-s 50" run ce 60 FLASHTILE_RING_TRANSPORT=copy_engine
grep -B2 -A12 "Thread\|Current thread" "$o/ce.log" | grep -v "^W1128" | head -60
FLAGS="--seqlens 64k,128k --no-baseline --no-single --check-seqlen 0 --warmup 2 --iters 5" run nccl 45 FLASHTILE_RING_TRANSPORT=nccl
FLAGS="--seqlens 64k --no-single --check-seqlen 0 --warmup 2 --iters 3 --watchdog-s 40" run ce_torch 50 FLASHTILE_RING_TRANSPORT=copy_engine
grep -A12 "Current thread" "$o/ce_torch.log" | head -30
tar -C "$o" -czf "$o/logs.tgz" ce nccl ce_torch ce.log nccl.log ce_torch.log 2>/dev/null; rm -rf "$o/ce" "$o/nccl" "$o/ce_torch" "$o"/*.log
