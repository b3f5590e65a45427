"""A/B of decode tile parameters, one process (developer tool).

    python3 benchmarks/decode_sweep.py --variants chunk_blocks=32 chunk_blocks=64
    python3 benchmarks/decode_sweep.py --fp8 --variants num_stages=4 num_stages=3
    python3 benchmarks/decode_sweep.py --variants num_splits=0 num_splits=33 --cases 1:131072:1:contig
    python3 benchmarks/decode_sweep.py --variants ws16=0 ws16=1 ws16=1,consumers=3

Each variant (``decode.CFG_OVERRIDE``: parameters of whichever schedule runs, ``decode_kernel``
for a bf16 cache, ``decode_ws.decode_ws_kernel`` with ``--fp8``) times flash_attn_with_kvcache
graph-replayed on the cases (``B:L:sq:layout``, the shapes of flashtile/bench_decode.py: bf16 q,
32/8 heads, d = 128, causal, ``L + 256`` cache rows; layout contig, page16 or page256, the pages
scattered by a shuffled block table, or e.g. page16-ordered: the identity table), checks
the output against the first variant's and prints µs, % of the read bandwidth measured in the
same run, and (``--fp8``) the speed-up over the bf16 cache.  ``--precompile`` builds the
variants (no GPU needed).  ``num_splits`` is not a tile parameter but the call's own argument
(0: the launcher's choice), so it varies without a new kernel.  ``ws16=1`` sends a 16-bit
cache through ``decode_ws``'s schedule (``decode.WS_16BIT``) for that variant, ``ws16=0`` through
``decode_kernel`` (without ``ws16``: the launcher's choice, ``decode.ws16_pays``); ``fractional=0/1``
forces whole or fractional CTA shares of the FP8 schedule (``decode.FRACTIONAL``);
``combine_round=8`` or ``16`` compiles and runs only that combine, rows per CTA chosen per call
(``decode.COMBINES``); ``own_workers=0/1`` forces the FP8 ``mma.sync`` consumers to share their
CTA's parts or to be workers of their own (default: ``decode.own_workers_pay`` per call);
``split_producer=0/1`` gives each consumer its own producer warp over the shared parts or not
(default: pages smaller than a block, ``decode.split_producer_pays``);
``ws16=1,warp_mma=1`` runs a 16-bit cache on ``decode_ws``'s mma.sync consumers with TMA.
"""

from __future__ import annotations

import argparse

import torch


def parse(v: str) -> dict:
    out = {}
    for kv in v.split(","):
        k, x = kv.split("=")
        out[k] = int(x)  # every knob is an int (block_n, num_stages, tma_box, chunk_blocks, ...)
    return out


def tiles(variant: dict) -> dict | None:
    """A variant's tile parameters (``decode.CFG_OVERRIDE``): all but ``num_splits`` and ``ws16``."""
    return {k: x for k, x in variant.items() if k not in ("num_splits", "ws16", "fractional")} or None


def ws16(variant: dict) -> bool | None:
    """``decode.WS_16BIT`` for a variant: ``ws16=1`` every 16-bit call through ``decode_ws``,
    ``ws16=0`` none (``decode_kernel``), absent the launcher's own choice (``ws16_pays``)."""
    return None if "ws16" not in variant else bool(variant["ws16"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--cases", nargs="+", default=["1:8192:1:contig", "8:32768:1:contig", "8:32768:1:page16",
                                                   "64:4096:1:contig", "8:32768:4:contig"], help="B:L:sq:layout")
    ap.add_argument("--fp8", action="store_true", help="an FP8 copy of each cache (decode_ws)")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--cudnn", action="store_true", help="also time cuDNN SDPA on each contiguous 16-bit case")
    args = ap.parse_args(argv)
    from flashtile.kernels import decode as dm

    variants = [parse(v) for v in args.variants]
    cache_dtype = "float8_e4m3fn" if args.fp8 else None
    if args.precompile:
        for v in variants:
            dm.CFG_OVERRIDE, dm.WS_16BIT = tiles(v), ws16(v)
            dm.get_decode_kernels(128, 128, "bfloat16", False, False, cache_dtype)
        return 0
    from flashtile import flash_attn_with_kvcache
    from flashtile.bench_decode import D, DT, H, HKV, LAYOUTS, as_layout, bench_graph, quantize_cache, read_bandwidth, sdpa_fn

    bw = read_bandwidth()
    print(f"{torch.cuda.get_device_name()}; read bandwidth {bw / 1e9:.0f} GB/s")
    for case in args.cases:
        B, L, sq, layout = case.split(":")
        B, L, sq = int(B), int(L), int(sq)
        kc = torch.randn(B, L + 256, HKV, D, device="cuda", dtype=DT)
        vc = torch.randn_like(kc)
        q = torch.randn(B, sq, H, D, device="cuda", dtype=DT)
        seqlens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        ordered = layout.endswith("-ordered")  # e.g. page16-ordered: the identity block table
        page = dict(LAYOUTS)[layout.removesuffix("-ordered")]
        t16 = None
        if args.fp8:
            kcache, vcache, kw = as_layout(kc, vc, page, ordered)
            t16 = bench_graph(lambda: flash_attn_with_kvcache(q, kcache, vcache, cache_seqlens=seqlens, causal=True, **kw))
            (kc, kd), (vc, vd) = quantize_cache(kc), quantize_cache(vc)
        kcache, vcache, kw = as_layout(kc, vc, page, ordered)
        if args.fp8:
            kw.update(k_descale=kd, v_descale=vd)
        nbytes = 2 * B * L * HKV * D * kc.element_size()
        ref = None
        for v in variants:
            dm.CFG_OVERRIDE, dm.WS_16BIT = tiles(v), ws16(v)
            dm.FRACTIONAL = None if "fractional" not in v else bool(v["fractional"])
            splits = v.get("num_splits", 0)
            call = lambda: flash_attn_with_kvcache(q, kcache, vcache, cache_seqlens=seqlens, causal=True,  # noqa: E731
                                                   num_splits=splits, **kw)
            out = call()
            ref = out if ref is None else ref
            diff = (out.float() - ref.float()).abs().max().item()
            t = bench_graph(call)
            vs = f" {t16 / t:5.2f}x bf16 cache" if t16 else ""
            print(f"{case:>18} {str(v):56s} {t * 1e6:8.1f} us {100 * nbytes / t / bw:5.1f} %bw{vs}  diff {diff:.1e}",
                  flush=True)
        dm.CFG_OVERRIDE, dm.WS_16BIT, dm.FRACTIONAL = None, None, None
        if args.cudnn and layout == "contig" and not args.fp8:
            t = bench_graph(sdpa_fn("cudnn", q, kc, vc, L, sq))
            if t:
                print(f"{case:>18} {'cuDNN SDPA':56s} {t * 1e6:8.1f} us {100 * nbytes / t / bw:5.1f} %bw", flush=True)
        del kc, vc, kcache, vcache
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
