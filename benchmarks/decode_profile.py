"""Nsight Compute over single decode calls: where does a decode step's time go?

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats python3 benchmarks/decode_profile.py 1:8192:1:contig 128:2048:1:page256

Each argument is ``B:L:sq:layout`` (layout ``contig``, ``page16`` or ``page256``; the shapes of
flashtile/bench_decode.py: bf16, 32 q heads, 8 kv heads, d = 128, causal, ``L + 256`` cache rows).
``--tiles 64x2`` forces the decode tiles (``decode.CFG_OVERRIDE``); ``--fp8`` profiles an
float8_e4m3fn copy of each cache instead (the warp-specialised ``decode_ws`` kernel).  Each case runs once
unprofiled (load, warm-up), then once between cudaProfilerStart/Stop, so ncu reports exactly
that call's kernels (decode, and combine when split) in the order of the printed case labels;
``--cudnn`` adds cuDNN SDPA's kernels on the same cache after each (16-bit) call, e.g. the
fixed cost of a near-empty call (``1:64:1:contig``: ours 5.4-5.8 us graph-replayed, cuDNN's
3.3 on an H200; NOTES, twentieth session).

Where a kernel's time goes, instruction by instruction (the twenty-first session's analysis):

    ncu --clock-control none --profile-from-start off --set full --import-source yes \
        --warp-sampling-interval 0 -o dk python3 benchmarks/decode_profile.py 1:8192:1:contig
    ncu -i dk.ncu-rep --page source --csv --print-source sass -k main_kernel \
        --launch-skip 0 --launch-count 1 > dk.csv        # launch-skip N: the N-th main_kernel
    python3 benchmarks/ncu_stalls.py dk.csv 0 --buckets 100 --warps 1024   # phases
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from flashtile.bench_decode import DT, HKV, LAYOUTS, D, H, as_layout  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="+", help="B:L:sq:layout, e.g. 1:8192:1:contig")
    ap.add_argument("--tiles", default="", help="block_n x stages, e.g. 64x2")
    ap.add_argument("--fp8", action="store_true", help="an FP8 copy of each cache, with its descales")
    ap.add_argument("--cudnn", action="store_true", help="also profile cuDNN SDPA on each 16-bit case (after flashtile's call)")
    args = ap.parse_args(argv)
    from flashtile import flash_attn_with_kvcache
    from flashtile.kernels import decode as decode_mod

    if args.tiles:
        block_n, stages = (int(x) for x in args.tiles.split("x"))
        decode_mod.CFG_OVERRIDE = {"block_n": block_n, "num_stages": stages}
        decode_mod.WS_16BIT = False  # the tiles are decode_kernel's: 16-bit calls kept off decode_ws
    dev = torch.device("cuda")
    pages = dict(LAYOUTS)
    for case in args.cases:
        B, L, sq, layout = case.split(":")
        B, L, sq = int(B), int(L), int(sq)
        kc = torch.randn(B, L + 256, HKV, D, device=dev, dtype=DT)
        vc = torch.randn_like(kc)
        q = torch.randn(B, sq, H, D, device=dev, dtype=DT)
        if args.fp8:
            from flashtile.bench_decode import quantize_cache

            (kc, kd), (vc, vd) = quantize_cache(kc), quantize_cache(vc)
        kcache, vcache, kw = as_layout(kc, vc, pages[layout])
        if args.fp8:
            kw.update(k_descale=kd, v_descale=vd)
        seqlens = torch.full((B,), L, dtype=torch.int32, device=dev)
        run = lambda: flash_attn_with_kvcache(q, kcache, vcache, cache_seqlens=seqlens, causal=True, **kw)  # noqa: E731
        run()
        torch.cuda.synchronize()
        print(f"case {case} tiles {args.tiles or 'default'}: {2 * kc[:, :L].numel() * kc.element_size() / 2**20:.0f} MB of K+V", flush=True)
        peer = None
        if args.cudnn and not args.fp8:
            from flashtile.bench_decode import sdpa_fn

            peer = sdpa_fn("cudnn", q, kc, vc, L, sq)
            peer()
            torch.cuda.synchronize()
        torch.cuda.profiler.start()
        run()
        if peer is not None:
            peer()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        del kc, vc, kcache, vcache
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
