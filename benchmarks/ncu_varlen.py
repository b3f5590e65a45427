"""One packed (varlen) forward (``--backward``: and its backward) and the same for a dense batch
of the same total tokens, for a profiler (developer tool): the varlen lever of
benchmarks/NOTES.md ("profile the plain grid before any new tile order").

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        python3 benchmarks/ncu_varlen.py --batch "64 x 64..1024" --headdim 128 [--causal]

The batch is one of ``flashtile bench --varlen``'s (same seeded lengths; bf16, nheads x headdim
= 2048).  Each call runs once unprofiled (load, warm-up), then once between
cudaProfilerStart/Stop, varlen first, then dense ``batch x (total // batch)`` tokens (the
bench's flashtile-equal), so ncu's report lists exactly those kernels, varlen's first.
"""

from __future__ import annotations

import argparse

import torch

import flashtile
from flashtile.bench_varlen import batches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="64 x 64..1024", help="a batch name of flashtile bench --varlen")
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args(argv)
    batch = {b.name: b for b in batches("cuda")}[args.batch]
    d, h = args.headdim, 2048 // args.headdim
    lens = torch.tensor(batch.lengths, dtype=torch.int32)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    cu = cu.cuda()
    total, n = int(lens.sum()), len(lens)
    grad = args.backward
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    s = total // n
    qd, kd, vd = (x.detach()[: n * s].view(n, s, h, d).requires_grad_(grad) for x in (q, k, v))

    def run(out):
        if grad:
            out.backward(torch.randn_like(out))

    def varlen():
        run(flashtile.flash_attn_varlen_func(q, k, v, cu, cu, int(lens.max()), int(lens.max()), causal=args.causal))

    def dense():
        run(flashtile.flash_attn_func(qd, kd, vd, causal=args.causal))

    for fn in (varlen, dense):
        fn()
    torch.cuda.synchronize()
    print(f"{args.batch}: {n} sequences, {total} tokens; dense {n} x {s}; d={d} h={h} causal={args.causal}", flush=True)
    torch.cuda.profiler.start()
    varlen()
    dense()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
