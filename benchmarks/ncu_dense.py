"""One dense forward or backward each of flashtile and cuDNN SDPA, for a profiler (developer tool).

    ncu --profile-from-start off --kernel-name regex:'main|sdpa|fmha|attn|bprop' --set full \\
        python3 benchmarks/ncu_dense.py [--backward] [--causal] [--headdim 64] [--seqlen 4096] [--fp8]
            [--config fwd|bwd:N,N,...]

Everything runs once unprofiled (compile, load, warm-up), then once between
cudaProfilerStart/Stop, flashtile first, so the report lists exactly those launches (the
backward: flashtile's preprocess, dK/dV and dQ-convert kernels, then cuDNN's).  bf16,
nheads x headdim = 2048, batch x seqlen = 16384 tokens.  ``--fp8``: flashtile's FP8 forward
(q, k, v quantized outside the profiled range; the report then also lists its V^T pre-pass)
against the same bf16 cuDNN call, for the issue-slot and pipe view of the FP8 consumers
(NOTES, seventeenth session: what to look at next).  ``--config bwd:64,64,2,256,1,0,0,0,1``: a
tuning candidate in ``tune.py``'s notation instead of the table's (why a candidate lost).
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile

ap = argparse.ArgumentParser()
ap.add_argument("--backward", action="store_true")
ap.add_argument("--causal", action="store_true")
ap.add_argument("--headdim", type=int, default=128)
ap.add_argument("--seqlen", type=int, default=4096)
ap.add_argument("--fp8", action="store_true", help="flashtile's FP8 forward (float8_e4m3fn q, k, v)")
ap.add_argument("--config", help="fwd|bwd|bwd_dq:N,N,... (tune.py's --configs notation) over the table's choice")
args = ap.parse_args()
if args.config:
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tune import make_config

    from flashtile.kernels import configs

    which, cfg = args.config.split(":")
    configs.overrides[which] = make_config(which, [int(x) for x in cfg.split(",")])
assert not (args.fp8 and args.backward), "the FP8 forward has no backward"
d, s = args.headdim, args.seqlen
b, h = max(1, 16384 // s), 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward) for _ in range(3))
qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(args.backward) for x in (q, k, v))
dout = torch.randn_like(q)
if args.fp8:
    import flashtile.fp8

    q8, k8, v8, qd, kd, vd = flashtile.fp8.quantize_qkv(q, k, v)


def flashtile_call():
    if args.fp8:
        flashtile.flash_attn_func(q8, k8, v8, causal=args.causal, q_descale=qd, k_descale=kd, v_descale=vd)
        return
    out = flashtile.flash_attn_func(q, k, v, causal=args.causal)
    if args.backward:
        out.backward(dout)


def cudnn_call():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
    if args.backward:
        out.backward(dout.transpose(1, 2))


for call in (flashtile_call, cudnn_call):
    call()  # compile / warm up outside the profiled range
torch.cuda.synchronize()
for call in (flashtile_call, cudnn_call):
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
