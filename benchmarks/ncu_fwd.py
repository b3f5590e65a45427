"""One forward launch each of flashtile and cuDNN SDPA, for a profiler (developer tool).

    ncu --kernel-name regex:'main|sdpa|fmha|attn' --metrics ... python3 benchmarks/ncu_fwd.py [--causal]
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile

ap = argparse.ArgumentParser()
ap.add_argument("--causal", action="store_true")
ap.add_argument("--headdim", type=int, default=128)
ap.add_argument("--seqlen", type=int, default=4096)
args = ap.parse_args()
d, s = args.headdim, args.seqlen
b, h = max(1, 16384 // s), 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
flashtile.flash_attn_func(q, k, v, causal=args.causal)  # compile outside the profiled launch
qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
torch.cuda.synchronize()
