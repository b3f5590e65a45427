"""Split forward time into a per-tile fixed cost and a per-key-block cost (developer tool).

    python3 benchmarks/tile_cost.py [--headdim 128] [--seqlen-q 4096] [--batch 4] [--heads 16]

Holds the query side fixed (so the grid, hence the number of waves, is fixed) and sweeps the
key length, non-causal, for flashtile and cuDNN in one process.  A least-squares line through
(key blocks per tile, time per wave) gives, per backend, the fixed cost of a tile (launch,
prologue, the first block's un-overlapped S GEMM and softmax, the last P V, the epilogue)
and the cost of one 128-key block.  Waves = tiles / SMs, the fraction kept (equal tiles).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashtile
from flashtile.kernels import configs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--seqlen-q", type=int, default=4096)
    ap.add_argument("--seqlen-k", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()
    d, sq, b, h = args.headdim, args.seqlen_q, args.batch, args.heads
    cfg = configs.fwd_config(d, d, torch.bfloat16, "full")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    waves = b * h * -(-sq // cfg.block_m) / sms
    print(f"{torch.cuda.get_device_name()}  d={d} sq={sq} b={b} h={h} config={cfg} waves={waves:.2f}")
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    points = {"flashtile": [], "cudnn": []}
    for sk in args.seqlen_k:
        k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt), warmup=30, rep=200, return_mode="median")
        ours = do_bench(lambda: flashtile.flash_attn_func(q, k, v), warmup=30, rep=200, return_mode="median")
        blocks = sk / 128
        for name, ms in (("flashtile", ours), ("cudnn", ref)):
            points[name].append((blocks, ms * 1e3 / waves))
        print(f"sk={sk:6d}  flashtile {ours:.4f} ms  cudnn {ref:.4f} ms  ratio {ref / ours:.3f}")
    for name, pts in points.items():
        x = torch.tensor([p[0] for p in pts], dtype=torch.float64)
        y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
        slope, icept = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], 1), y[:, None]).solution[:, 0].tolist()
        print(f"FIT {name}: {icept:.2f} us per tile + {slope:.3f} us per 128-key block")


if __name__ == "__main__":
    main()
