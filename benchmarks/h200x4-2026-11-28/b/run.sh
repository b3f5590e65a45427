#!/usr/bin/env bash
# Twenty-sixth session, call b (4x H200, issue 20): why the ring's forward runs at 0.77 of T1/4
# at 128k (call a) while its backward runs at 0.91.
# 1. ring_step_probe.py: rank 0's and rank 3's step kernels and merges alone, no communication.
# 2. flashtile cp 128k with --profile (one fwd+bwd step per rank as a chrome trace).
# 3. The same ring bench with NCCL limited to 1 and 4 channels (fewer SMs taken by the P2P
#    kernels): if the forward's loss is SM contention with NCCL, it moves.
set -u
o=$1; mkdir -p "$o"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/ring_step_probe.py --seqlen 128k --world 4 --rank 0 --out "$o/probe_r0.md" > "$o/probe_r0.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 python3 benchmarks/ring_step_probe.py --seqlen 128k --world 4 --rank 3 --out "$o/probe_r3.md" > "$o/probe_r3.log" 2>&1 &
wait
tail -3 "$o/probe_r0.log"; cat "$o/probe_r0.md" "$o/probe_r3.md"
cp_run() {  # name, extra env...
  local name=$1; shift
  env "$@" timeout 150 torchrun --nproc_per_node=4 -m flashtile.distributed.bench --seqlens 128k --no-baseline --no-single \
    --check-seqlen 0 --warmup 2 --iters 5 $EXTRA --out "$o/$name" > "$o/$name.log" 2>&1
  echo "$name rc $?"; grep -m1 -A2 '^| total' "$o/$name/cp.md" | tail -1; grep -A4 'Forward only' "$o/$name/cp.md" | tail -1
}
EXTRA=--profile cp_run prof X=1
EXTRA= cp_run ch4 NCCL_MAX_NCHANNELS=4
EXTRA= cp_run ch1 NCCL_MAX_NCHANNELS=1
EXTRA= cp_run ch_default X=1
cd "$o" && tar -cJf traces.tar.xz prof/trace_*.json && rm -f prof/trace_*.json
