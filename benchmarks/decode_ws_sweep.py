"""A/B of decode_ws tile parameters on an FP8 cache, one process (developer tool).

    python3 benchmarks/decode_ws_sweep.py --variants by_row=1 by_row=1,self_widen=1 by_row=1,ring_rotate=1

Each variant (``decode.WS_OVERRIDE``) times flash_attn_with_kvcache graph-replayed on the cases
of flashtile/bench_decode.py (bf16 q, 32/8 heads, d = 128, an FP8 copy of the cache), checks the
output against the first variant's, and prints µs, % of the read bandwidth measured in the same
run and the speed-up over the bf16 cache.  ``--precompile`` builds the variants (no GPU needed).
"""

from __future__ import annotations

import argparse

import torch


def parse(v: str) -> dict:
    out = {}
    for kv in v.split(","):
        k, x = kv.split("=")
        out[k] = bool(int(x)) if k in ("by_row", "self_widen", "ring_rotate") else int(x)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--cases", nargs="+", default=["1:8192:1", "8:32768:1", "64:4096:1", "8:32768:4"], help="B:L:sq")
    ap.add_argument("--precompile", action="store_true")
    args = ap.parse_args(argv)
    from flashtile.kernels import decode as dm

    variants = [parse(v) for v in args.variants]
    if args.precompile:
        for v in variants:
            dm.WS_OVERRIDE = v
            dm.get_decode_kernels(128, 128, "bfloat16", False, False, "float8_e4m3fn")
        return 0
    from flashtile import flash_attn_with_kvcache
    from flashtile.bench_decode import D, DT, H, HKV, bench_graph, quantize_cache, read_bandwidth

    bw = read_bandwidth()
    print(f"{torch.cuda.get_device_name()}; read bandwidth {bw / 1e9:.0f} GB/s")
    for case in args.cases:
        B, L, sq = (int(x) for x in case.split(":"))
        kc = torch.randn(B, L + 256, HKV, D, device="cuda", dtype=DT)
        vc = torch.randn_like(kc)
        q = torch.randn(B, sq, H, D, device="cuda", dtype=DT)
        seqlens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        t16 = bench_graph(lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True))
        (k8, kd), (v8, vd) = quantize_cache(kc), quantize_cache(vc)
        del kc, vc
        nbytes = 2 * B * L * HKV * D
        ref = None
        for v in variants:
            dm.WS_OVERRIDE = v
            call = lambda: flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, causal=True, k_descale=kd,  # noqa: E731
                                                   v_descale=vd)
            out = call()
            ref = out if ref is None else ref
            diff = (out.float() - ref.float()).abs().max().item()
            t = bench_graph(call)
            print(f"{case:>12} {str(v):60s} {t * 1e6:8.1f} us {100 * nbytes / t / bw:5.1f} %bw {t16 / t:5.2f}x bf16 cache"
                  f"  diff {diff:.1e}", flush=True)
        del k8, v8
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
