"""Time one ``flashtile bench --varlen`` cell again and again (developer tool): is an outlier
the kernel or the host?

    python benchmarks/varlen_repeat.py --batch "64 x 64..1024" --headdim 128 [--causal] [--trials 8]

Each trial builds the cell's inputs anew (``flashtile bench --varlen``'s own backends: seeded
packed q, k, v in new allocations) and times the packed forward and the dense forward of the
bench's equal-length twin with the bench's timer (do_bench median, L2 cleared before every
run), and the host time of one call (no sync; the GPU idles when a call's host path outlasts
the L2 clear that do_bench runs before it, and that idle time is inside the timed window).
"""

from __future__ import annotations

import argparse
import time

import torch

from flashtile import bench, bench_varlen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="64 x 64..1024")
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--trials", type=int, default=8)
    args = ap.parse_args(argv)
    batch = {b.name: b for b in bench_varlen.batches("cuda")}[args.batch]
    case = bench_varlen.Case(batch, args.headdim, 2048 // args.headdim, args.causal)
    timer, _ = bench.make_timer("cuda", 10, 50)
    for trial in range(args.trials):
        p = bench_varlen.Packed(case, "cuda", torch.bfloat16)
        row = []
        for backend in ("flashtile-varlen", "flashtile-equal"):
            runner = bench_varlen.FACTORIES[backend](case, p, "cuda", torch.bfloat16)
            runner.fwd()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                runner.fwd()
            host_us = (time.perf_counter() - t0) / 20 * 1e6
            torch.cuda.synchronize()
            ms = timer(runner.fwd, runner.leaves)
            tflops = bench_varlen._flops(case, backend, "fwd") / ms / 1e9
            row.append(f"{backend.removeprefix('flashtile-')} {ms:.3f} ms {tflops:5.0f} TFLOP/s host {host_us:4.0f} us")
        print(f"trial {trial}: " + " | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
