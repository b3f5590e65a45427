"""Clocks and power under each backend's sustained dense backward (developer tool).

Is the full-mask backward gap (NOTES, forty-first session: our steady-state step ~10% slower
than cuDNN's) partly the power cap?  The bench interleaves backends, so its smi log cannot say
which one ran at which clock.  Here each backend runs the same backward back to back for
``--seconds`` while ``nvidia-smi`` samples every 50 ms; the report gives per backend the median
SM clock, power and throttle reasons over its window (the first second dropped: ramp), the
rate in TFLOP/s and the rate per GHz (work per clock: the kernel's own speed with the clock
taken out).  Two rounds, alternating, so a drift in the GPU's temperature shows.

    python3 benchmarks/clock_probe.py [--headdim 128] [--seqlen 16384] [--causal] [--seconds 8]
"""

import argparse
import statistics
import subprocess
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile

ap = argparse.ArgumentParser()
ap.add_argument("--headdim", type=int, default=128)
ap.add_argument("--seqlen", type=int, default=16384)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--seconds", type=float, default=8.0)
ap.add_argument("--rounds", type=int, default=2)
args = ap.parse_args()

d, s = args.headdim, args.seqlen
b, h = max(1, 16384 // s), 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
dout = torch.randn_like(q)
dout_t = dout.transpose(1, 2)
# Backward FLOPs (2.5 forward GEMM pairs), the visible half under a causal mask.
flops = 2.5 * 4 * b * h * s * s * d * (0.5 if args.causal else 1.0)


def flashtile_step():
    out = flashtile.flash_attn_func(q, k, v, causal=args.causal)
    torch.autograd.grad(out, (q, k, v), dout)


def cudnn_step():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
    torch.autograd.grad(out, (qt, kt, vt), dout_t)


def sustained(name, fn, log):
    """Run ``fn`` for ``args.seconds``; (window start, end, calls, seconds per call)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.time()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    calls = 0
    while time.time() - t0 < args.seconds:
        for _ in range(4):
            fn()
        calls += 4
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    t1 = time.time()
    per_call = start.elapsed_time(end) / 1e3 / calls
    log.append((name, t0, t1, calls, per_call))


def forward_time(fn_fwd):
    """Seconds per forward alone (to subtract from a forward + backward step)."""
    for _ in range(3):
        fn_fwd()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        fn_fwd()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / 20


def cudnn_forward():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)


with torch.no_grad():
    fwd_s = {"flashtile": forward_time(lambda: flashtile.flash_attn_func(q, k, v, causal=args.causal)),
             "cudnn": forward_time(cudnn_forward)}

smi_log = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
smi = subprocess.Popen(
    ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
     "--format=csv,noheader,nounits", "-lms", "50", "-f", smi_log])
time.sleep(1.0)
log = []
for _ in range(args.rounds):
    sustained("flashtile", flashtile_step, log)
    time.sleep(1.0)
    sustained("cudnn", cudnn_step, log)
    time.sleep(1.0)
smi.terminate()
smi.wait()

samples = []
for line in open(smi_log):
    parts = [p.strip() for p in line.split(",")]
    try:
        stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + parts[0].split(".")[1])
        samples.append((stamp, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
    except (ValueError, IndexError):
        continue

print(f"d={d} seqlen={s} batch={b} heads={h} {'causal' if args.causal else 'full'}; "
      f"forward alone: flashtile {fwd_s['flashtile'] * 1e3:.3f} ms, cuDNN {fwd_s['cudnn'] * 1e3:.3f} ms")
print(f"{'backend':<10} {'calls':>5} {'bwd ms':>8} {'TFLOP/s':>8} {'MHz':>6} {'W':>5} {'C':>3} {'TFLOP/s/GHz':>11}  throttle reasons")
for name, t0, t1, calls, per_call in log:
    window = [x for x in samples if t0 + 1.0 <= x[0] <= t1]
    bwd = per_call - fwd_s[name]
    rate = flops / bwd / 1e12
    if not window:
        print(f"{name:<10} {calls:>5} {bwd * 1e3:8.3f} {rate:8.1f}  (no smi samples in the window)")
        continue
    mhz = statistics.median(x[1] for x in window)
    watts = statistics.median(x[2] for x in window)
    temp = statistics.median(x[3] for x in window)
    reasons = sorted({x[4] for x in window})
    print(f"{name:<10} {calls:>5} {bwd * 1e3:8.3f} {rate:8.1f} {mhz:6.0f} {watts:5.0f} {temp:3.0f} {rate / (mhz / 1e3):11.1f}  {' '.join(reasons)}")
