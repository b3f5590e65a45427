"""Time one ``flashtile bench --varlen`` cell again and again (developer tool): is an outlier
the kernel or the host?

    python benchmarks/varlen_repeat.py --batch "64 x 64..1024" --headdim 128 [--causal] [--trials 8]

Each trial draws fresh packed q, k, v and times the packed forward and the dense forward of
the bench's equal-length twin with the bench's timer (do_bench median, L2 cleared before every
run), and the host time of one call (no sync; the GPU idles when a call's host path outlasts
the L2 clear that do_bench runs before it, and that idle time is inside the timed window).
"""

from __future__ import annotations

import argparse
import time

import torch

from flashtile import bench
from flashtile.bench_varlen import batches, useful_flops
from flashtile.flops import attention_flops
from flashtile.interface import flash_attn_func
from flashtile.varlen import flash_attn_varlen_func


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="64 x 64..1024")
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--trials", type=int, default=8)
    args = ap.parse_args(argv)
    lens = {b.name: b for b in batches("cuda")}[args.batch].lengths
    d, h, n, total = args.headdim, 2048 // args.headdim, len(lens), sum(lens)
    cu = torch.nn.functional.pad(torch.tensor(lens).cumsum(0), (1, 0)).to("cuda", torch.int32)
    timer, _ = bench.make_timer("cuda", 10, 50)
    flops_v = useful_flops(lens, h, d, args.causal, "fwd")
    flops_e = attention_flops(n, h, total // n, total // n, d, causal=args.causal, mode="fwd")
    for trial in range(args.trials):
        q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        qe, ke, ve = (torch.randn(n, total // n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

        def varlen():
            return flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=args.causal)

        def dense():
            return flash_attn_func(qe, ke, ve, causal=args.causal)

        row = []
        for name, fn, flops in (("varlen", varlen, flops_v), ("equal", dense, flops_e)):
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            host_us = (time.perf_counter() - t0) / 20 * 1e6
            torch.cuda.synchronize()
            ms = timer(fn, [q, k, v] if name == "varlen" else [qe, ke, ve])
            row.append(f"{name} {ms:.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s host {host_us:4.0f} us")
        print(f"trial {trial}: " + " | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
