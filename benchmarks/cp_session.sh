#!/usr/bin/env bash
# The one-call routine for context parallelism on a multi-GPU machine (nvidia-h200-x2/x4/x8):
#
#   bash benchmarks/cp_session.sh OUT [NPROC]        # NPROC default: every GPU
#
# after the usual prefix (`bash .carry/install.sh && export PYTHONPATH=/tmp/site:$PWD ...
# && bash benchmarks/kernel_cache.sh unpack`).  Steps, each with its own timeout and none
# reading another's output unless it exists (a hung step costs only its own timeout):
#   1. numerics matrix on NPROC ranks + `flashtile cp` 64k,128k,256k with T1 and torch CP (NCCL)
#   2. `flashtile cp` 512k,1M, T1 extrapolated from step 1's 256k (skipped with SKIP_LONG=1)
#   3. the experimental copy-engine transport: ring alone at 64k-256k, then with torch CP at
#      64k (skipped with SKIP_CE=1); --watchdog-s prints every rank's stacks if it hangs
#   4. with P2P_SWEEP="1 2 4 8": the NCCL ring alone at 128k per NCCL_MAX_P2P_NCHANNELS value
#      (fewer send/recv CTAs beside the attention kernels; NOTES, twenty-sixth session)
# Everything ends in OUT/cp_logs.tgz (the device tool returns at most 8 files).
# Budget on 4 H200: ~240 s + ~170 s + ~120 s, plus the machine's start.
set -u
o=$1; n=${2:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
mkdir -p "$o"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md: keep multicast off
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'; } > "$o/env.txt" 2>&1
step() {  # name, timeout, command...
  local name=$1 t=$2; shift 2
  local s=$(date +%s)
  timeout "$t" "$@" > "$o/$name.log" 2>&1
  echo "$name: rc $? after $(( $(date +%s) - s )) s"
  for f in "$o/$name/numerics.md" "$o/$name/cp.md"; do [ -f "$f" ] && cat "$f"; done
}
run="torchrun --nproc_per_node=$n"
step nccl 320 $run benchmarks/ring_gpu.py --out "$o/nccl" --seqlens 64k,128k,256k
if [ -z "${SKIP_LONG:-}" ]; then
  t1=(--no-single)
  [ -f "$o/nccl/cp.json" ] && t1=(--single-max 0 --t1-from "$o/nccl/cp.json")
  step nccl_long 260 $run -m flashtile.distributed.bench --seqlens 512k,1024k "${t1[@]}" --check-seqlen 0 --warmup 1 --iters 3 --out "$o/nccl_long"
fi
if [ -z "${SKIP_CE:-}" ]; then
  FLASHTILE_RING_TRANSPORT=copy_engine step ce 100 $run -m flashtile.distributed.bench --seqlens 64k,128k,256k --no-baseline \
    --no-single --check-seqlen 0 --warmup 2 --iters 5 --watchdog-s 85 --out "$o/ce"
  FLASHTILE_RING_TRANSPORT=copy_engine step ce_torch 60 $run -m flashtile.distributed.bench --seqlens 64k --no-single \
    --check-seqlen 64k --warmup 2 --iters 5 --watchdog-s 50 --out "$o/ce_torch"
fi
for c in ${P2P_SWEEP:-}; do
  NCCL_MAX_P2P_NCHANNELS=$c NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT step "p2p$c" 60 $run -m flashtile.distributed.bench \
    --seqlens 128k --no-baseline --no-single --check-seqlen 0 --warmup 2 --iters 5 --out "$o/p2p$c"
  grep -m2 -i "p2p channels" "$o/p2p$c.log"
done
tar -C "$o" -czf "$o/cp_logs.tgz" --exclude=cp_logs.tgz . && find "$o" -mindepth 1 ! -name cp_logs.tgz -delete
