#!/usr/bin/env bash
# Twenty-sixth session, call c (4x H200, issue 20): the ring's forward lost ~20 ms at 128k to
# the transfers (call b: 63 ms without communication, 83 ms in the ring; NCCL on fewer channels
# made it worse, so the transfer is not hidden).  Hypothesis: the d=128 forward is persistent
# (132 CTAs hold every SM for the whole call), so the NCCL kernel of the next K/V block gets no
# SM until the step's kernel ends.  Prediction: leaving SMs free (FLASHTILE_RING_SM_MARGIN) or a
# one-tile-per-CTA forward brings the ring's forward at 128k from ~83 ms to 63-66 ms (fwd
# efficiency 0.71 -> 0.90+), fwd+bwd from ~265 to ~250 ms.
set -u
o=$1; mkdir -p "$o"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cp_run() {  # name, env...
  local name=$1; shift
  env "$@" timeout 120 torchrun --nproc_per_node=4 -m flashtile.distributed.bench --seqlens 64k,128k --no-baseline --no-single \
    --check-seqlen 0 --warmup 2 --iters 7 --out "$o/$name" > "$o/$name.log" 2>&1
  echo "$name rc $?"; grep -m1 -A3 '^| total' "$o/$name/cp.md" | tail -2; grep -A5 'Forward only' "$o/$name/cp.md" | tail -2
}
cp_run m0 FLASHTILE_RING_SM_MARGIN=0
cp_run m8 FLASHTILE_RING_SM_MARGIN=8
cp_run np FLASHTILE_FWD_FLAGS=tiles_per_cta=1
cp_run m16 FLASHTILE_RING_SM_MARGIN=16
cp_run m4 FLASHTILE_RING_SM_MARGIN=4
cp_run m0b FLASHTILE_RING_SM_MARGIN=0
tar -C "$o" -czf "$o/logs.tgz" m0 m8 np m16 m4 m0b m0.log m8.log np.log m16.log m4.log m0b.log
