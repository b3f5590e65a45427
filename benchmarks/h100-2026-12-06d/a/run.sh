#!/usr/bin/env bash
# Call a (thirtieth session): the FP8 V^T pre-pass with other tiles (keys per CTA x threads,
# A/B graph-replayed in one process, outputs bitwise against the default), ncu of the pre-pass
# at d = 256, and ncu of one FP8 d = 256 4k causal forward (how busy shared memory and the issue
# slots are: room for a transpose inside the kernel's producer warpgroup?).
set -uo pipefail
OUTDIR=$1; w=/tmp/w; mkdir -p "$w" "$OUTDIR"
trap 'cp "$w/summary.txt" "$OUTDIR/" 2>/dev/null; tar -C "$w" -czf "$OUTDIR/logs.tgz" .' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$w/summary.txt"
for r in 1 2; do
timeout 90 python3 benchmarks/transpose_ab.py --variants 128x128 128x256 64x256 > "$w/transpose_r$r.txt" 2>&1; echo "transpose r$r rc=$?" >> "$w/summary.txt"
done
cat > "$w/one_fp8.py" <<'PY'
import torch, flashtile
from flashtile import fp8
torch.manual_seed(0)
b, s, h, d = 4, 4096, 8, 256
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q, k, v)
for _ in range(3):
    flashtile.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
flashtile.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
PY
if command -v ncu >/dev/null; then
timeout 150 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
  python3 "$w/one_fp8.py" > "$w/ncu_fp8.txt" 2>&1; echo "ncu fp8 rc=$?" >> "$w/summary.txt"
fi
for r in 1 2; do echo "== transpose r$r"; grep -v "TileLang\|compiling" "$w/transpose_r$r.txt" | cut -c1-160 | tail -n 20; done
echo "== ncu"; grep -v "TileLang\|compiling\|^==PROF==" "$w/ncu_fp8.txt" | grep -E "main_kernel|Duration|Throughput|Pipe|Issue|Issued|Shared|Bank|Registers|Block Size|Grid Size|Achieved|Eligible|Active Warps|No Eligible|Warp Cycles|Dynamic Shared" | cut -c1-150 | head -90
