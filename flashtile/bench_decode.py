"""KV-cache decode benchmark: flashtile.flash_attn_with_kvcache against the GPU's measured HBM
read bandwidth, cuDNN / flash SDPA on the contiguous cache, and flash-attn if installed.

    flashtile bench --decode [--out DIR] [--quick] [--fp8] [--tiles 64x2,128x2]
    python -m flashtile.bench_decode --out DIR [--quick]          # the same

bf16, 32 query heads, 8 kv heads, d = 128; (batch, cache length) in CASES (issue 16's list: B=1
8k and 128k, B=8 32k, B=32 8k, B=64 4k, B=128 2k, plus B=12 32k and B=64 32k) x seqlen_q {1, 4} x layout
{contiguous, paged 16, paged 256}.  For each case:

- ``flashtile``: attention over the cache (no new keys), ``num_splits=0`` (heuristic);
  ``+append``: the same call also appending ``seqlen_q`` new k/v tokens in place (the host-side
  index_put_ counted in the time);
- ``graph``: the same call captured in a CUDA graph and replayed (``do_bench_cudagraph``), as
  a serving engine runs decode: host time (Python, the custom op, argument checks) drops out, so
  this is the number the bandwidth roofline is about; cuDNN is timed the same way;
- achieved bandwidth = (K and V bytes the call must read + q + out) / time, and that as a % of
  the read bandwidth measured in the same run (``x.sum()`` over a 2 GiB tensor);
- ``flex``: FlexAttention (``torch.compile``d once, graph-replayed) on the same views;
- ``cudnn`` / ``flash``: PyTorch SDPA with that backend forced, dense q over the contiguous
  cache (a strided view, GQA through ``enable_gqa``; for seqlen_q > 1 a bottom-right causal
  mask, ``causal_lower_right``); ``fa``: flash_attn.flash_attn_with_kvcache on the same cache.
  A backend that refuses a case shows ``-``.

Every flashtile result is checked against fp32 SDPA math on batch entry 0 before timing
(max abs error printed; > 2e-2 marks the row ``WRONG``).  Inputs are ``randn``, never zeros.
Times are ``triton.testing.do_bench`` medians (L2 flushed between runs).  Writes
``decode.json`` and ``decode.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

H, HKV, D = 32, 8, 128
DT = torch.bfloat16


# B=12: 96 (entry, kv head) segments, a batch whose splits do not divide into the SMs
CASES = [(1, 8192), (1, 131072), (8, 32768), (12, 32768), (32, 8192), (64, 4096), (128, 2048), (64, 32768)]
QUICK = [(1, 8192), (8, 32768)]


LAYOUTS = (("contig", None), ("page16", 16), ("page256", 256))


def as_layout(kc, vc, page, ordered: bool = False):
    """The contiguous caches (B, cap, Hkv, D) as flash_attn_with_kvcache's arguments for one
    layout: themselves (page None), or the same memory as pages of ``page`` rows with a shuffled
    block table (pages scattered; ``ordered``: the identity table, the pages in memory order,
    which separates the page lookups' cost from the scatter's).  Returns (k_cache, v_cache,
    extra kwargs)."""
    if page is None:
        return kc, vc, {}
    B, cap = kc.shape[:2]
    nb = cap // page
    perm = torch.arange(B * nb, device=kc.device, dtype=torch.int32) if ordered else \
        torch.randperm(B * nb, device=kc.device).to(torch.int32)
    return kc.view(B * nb, page, *kc.shape[2:]), vc.view(B * nb, page, *vc.shape[2:]), {"block_table": perm.view(B, nb)}


def bench(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


def bench_graph(fn):
    """Median seconds of ``fn`` replayed from a CUDA graph, or None when it cannot be captured."""
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3
    except Exception:  # noqa: BLE001 - a backend that cannot be captured shows "-"
        torch.cuda.synchronize()
        return None


def read_bandwidth() -> float:
    x = torch.randn(2**29, device="cuda")  # 2 GiB fp32
    t = bench(lambda: x.sum())
    del x
    return 2**31 / t


def sdpa_fn(backend, q, kc, vc, L, sq):
    """Dense SDPA over the first L cache rows (contiguous cache, (B, L, Hkv, D) -> BHSD views)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    qt = q.transpose(1, 2)
    kt, vt = kc[:, :L].transpose(1, 2), vc[:, :L].transpose(1, 2)
    mask = None if sq == 1 else causal_lower_right(sq, L)

    def run():
        with sdpa_kernel([be]):
            if mask is None:
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)

    return run


_FLEX = {}


def flex_fn(q, kc, vc, L, sq, compile=True):
    """FlexAttention over the first L cache rows (BHSD views, GQA through ``enable_gqa``; for
    seqlen_q > 1 a bottom-right causal block mask), compiled once per process as users run it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if compile and "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention)  # shapes turn dynamic after the first recompile
    fn = _FLEX["fn"] if compile else flex_attention
    qt = q.transpose(1, 2)
    kt, vt = kc[:, :L].transpose(1, 2), vc[:, :L].transpose(1, 2)
    mask = None
    if sq > 1:
        off = L - sq
        mask = create_block_mask(lambda b, h, qi, ki: ki <= qi + off, None, None, sq, L, device=q.device)
    return lambda: fn(qt, kt, vt, block_mask=mask, enable_gqa=True)


def reference_entry0(q, kc, vc, L, sq):
    """fp32 math for batch entry 0: (sq, H, D)."""
    k0 = kc[0, :L].float().repeat_interleave(H // HKV, dim=1)  # (L, H, D)
    v0 = vc[0, :L].float().repeat_interleave(H // HKV, dim=1)
    s = torch.einsum("qhd,khd->hqk", q[0].float(), k0) / math.sqrt(D)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(L, device=q.device)[None, :]
    s = s.masked_fill(j > i + L - sq, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v0)


def quantize_cache(kc):
    """kc (B, cap, Hkv, D) -> (float8_e4m3fn copy, descale (B, Hkv) float32): flashtile.fp8's
    amax scaling per (entry, kv head), one entry at a time (no full-size float32 temporary)."""
    from flashtile.fp8 import quantize_fp8

    parts = [quantize_fp8(kc[b : b + 1]) for b in range(kc.shape[0])]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def entry0_rows(cache, L, page, kw):
    """Entry 0's first L logical cache rows (L, Hkv, D): through the block table when paged."""
    if page is None:
        return cache[0, :L]
    pos = torch.arange(L, device=cache.device)
    return cache[kw["block_table"][0].long()[pos // page], pos % page]


def fp8_rows(rows, q, kc, vc, L, sq, bw, bf16_rows):
    """FP8-cache rows (contiguous, page 16 and page 256) beside the bf16 ones: graph time, % of the
    bandwidth for the FP8 bytes, and the speed-up over the bf16 cache in the same layout."""
    from flashtile import flash_attn_with_kvcache

    B = kc.shape[0]
    k8, kd = quantize_cache(kc)
    v8, vd = quantize_cache(vc)
    seqlens = torch.full((B,), L, dtype=torch.int32, device=kc.device)
    kv_bytes = 2 * B * L * HKV * D  # one byte per element
    io_bytes = kv_bytes + 2 * q.numel() * DT.itemsize
    for layout, page in (("contig", None), ("page16", 16), ("page256", 256)):
        kcache, vcache, kw = as_layout(k8, v8, page)
        call = lambda: flash_attn_with_kvcache(q, kcache, vcache, cache_seqlens=seqlens, causal=True,  # noqa: E731
                                               k_descale=kd, v_descale=vd, **kw)
        out = call()
        # entry 0's logical rows, dequantized with its descales
        deq = lambda c, d: (entry0_rows(c, L, page, kw).float() * d[0][None, :, None])[None]  # noqa: E731
        err = (out[0].float() - reference_entry0(q, deq(kcache, kd), deq(vcache, vd), L, sq)).abs().max().item()
        tg = bench_graph(call) or bench(call)
        ref = bf16_rows.get(layout, {})
        t16 = ref.get("flashtile_graph_s") or ref.get("flashtile_s")
        rows.append(dict(batch=B, seqlen_cache=L, seqlen_q=sq, layout=f"{layout}-fp8", cache_mb=kv_bytes / 2**20,
                         flashtile_s=tg, flashtile_graph_s=tg, flashtile_append_s=None,
                         flashtile_gbs=io_bytes / tg / 1e9, flashtile_pct_bw=100 * io_bytes / tg / bw,
                         speedup_vs_bf16_cache=(t16 / tg) if t16 else None, err_vs_fp32=err, wrong=err > 5e-2,
                         cudnn_s=None, cudnn_graph_s=None, flash_s=None, fa_s=None, flex_graph_s=None, sdpa_notes={},
                         tiles={}))
        print(f"{B:>3} {L:>7} {sq:>2} {layout + '-fp8':>12} {kv_bytes / 2**20:7.0f} | graph {tg * 1e6:9.1f} us "
              f"{100 * io_bytes / tg / bw:5.1f} %bw, {t16 / tg if t16 else float('nan'):.2f}x the bf16 cache | err {err:.1e}"
              f"{' WRONG' if err > 5e-2 else ''}", flush=True)


def ratio_table(rows) -> list:
    """Markdown lines of the run's ratios per (batch, cache length, query tokens): flashtile's
    speed against cuDNN's (cuDNN time / flashtile time, both graph-replayed on the contiguous
    cache: > 1 is faster), and each FP8 cache's speed-up over the bf16 cache of its layout."""
    cases = {}
    for r in rows:
        cases.setdefault((r["batch"], r["seqlen_cache"], r["seqlen_q"]), {})[r["layout"]] = r
    fp8_layouts = [lay for lay, _ in LAYOUTS if any(f"{lay}-fp8" in c for c in cases.values())]
    lines = ["| B | cache len | sq | vs cuDNN | " + " | ".join(f"FP8 {lay} vs bf16" for lay in fp8_layouts) + " |",
             "|---:|---:|---:|---:|" + "---:|" * len(fp8_layouts)]
    for (b, length, sq), by in cases.items():
        contig = by.get("contig", {})
        ours = contig.get("flashtile_graph_s") or contig.get("flashtile_s")
        peer = contig.get("cudnn_graph_s") or contig.get("cudnn_s")
        cells = [f"{peer / ours:.2f}x" if ours and peer else "-"]
        cells += [f"{by[f'{lay}-fp8']['speedup_vs_bf16_cache']:.2f}x"
                  if by.get(f"{lay}-fp8", {}).get("speedup_vs_bf16_cache") else "-" for lay in fp8_layouts]
        lines.append(f"| {b} | {length} | {sq} | " + " | ".join(cells) + " |")
    return lines


def write(out_dir, rows, props, bw):
    """decode.json and decode.md under out_dir (rewritten after every case, so a timeout keeps what ran)."""
    import flashtile

    meta = dict(device=props.name, sms=props.multi_processor_count, read_bw_gbs=bw / 1e9, torch=torch.__version__,
                flashtile=flashtile.__version__, time=time.strftime("%Y-%m-%d %H:%M:%S"),
                cudnn=torch.backends.cudnn.version(), heads=H, heads_kv=HKV, headdim=D, dtype="bfloat16")
    with open(os.path.join(out_dir, "decode.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, "decode.md"), "w") as f:
        f.write(f"# decode, {props.name}, read bandwidth {bw / 1e9:.0f} GB/s (x.sum over 2 GiB)\n\n")
        f.write("bf16, 32 q heads, 8 kv heads, d=128, causal; times in us (do_bench median; graph: replayed from a CUDA "
                "graph); % bw = of measured read bandwidth, from the graph time where there is one\n\n")
        f.write("| B | cache len | sq | layout | K+V MB | flashtile us | graph us | GB/s | % bw | +append us | cuDNN us | cuDNN graph us | % bw | flash us | % bw | FlexAttention us | % bw | flash-attn us | max err |\n")
        f.write("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in rows:
            io = r["flashtile_gbs"] * 1e9 * (r["flashtile_graph_s"] or r["flashtile_s"])
            c = lambda s: f"{s * 1e6:.1f}" if s else "-"  # noqa: E731
            p = lambda s: f"{100 * io / s / bw:.1f}" if s else "-"  # noqa: E731
            f.write(f"| {r['batch']} | {r['seqlen_cache']} | {r['seqlen_q']} | {r['layout']} | {r['cache_mb']:.0f} | "
                    f"{r['flashtile_s'] * 1e6:.1f} | {c(r['flashtile_graph_s'])} | {r['flashtile_gbs']:.0f} | {r['flashtile_pct_bw']:.1f} | "
                    f"{c(r['flashtile_append_s'])} | {c(r['cudnn_s'])} | {c(r['cudnn_graph_s'])} | {p(r['cudnn_graph_s'] or r['cudnn_s'])} | {c(r['flash_s'])} | "
                    f"{p(r['flash_s'])} | {c(r.get('flex_graph_s'))} | {p(r.get('flex_graph_s'))} | {c(r['fa_s'])} | {r['err_vs_fp32']:.1e}{' WRONG' if r['wrong'] else ''} |\n")
        f.write("\nRatios in this run (vs cuDNN: cuDNN's graph time / flashtile's, contiguous; FP8: the FP8 cache's "
                "speed-up over the bf16 cache of the same layout):\n\n")
        f.write("\n".join(ratio_table(rows)) + "\n")


def add_arguments(ap) -> None:
    """The decode sweep's flags (``flashtile bench --decode`` takes them in their own group)."""
    ap.add_argument("--out", default="decode-bench", metavar="DIR", help="decode.json and decode.md go here")
    ap.add_argument("--quick", action="store_true", help="B=1 8k and B=8 32k only")
    ap.add_argument("--fp8", action="store_true", help="also an FP8 (float8_e4m3fn) copy of each cache, contiguous, page 16 and page 256")
    ap.add_argument("--tiles", default="", help="also time these decode tiles, e.g. '64x2,128x2' (block_n x stages; graph-replayed)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args) -> int:
    """The sweep with parsed ``args`` (``out``, ``quick``, ``fp8``, ``tiles``); 2 without a CUDA GPU,
    1 when a flashtile result is wrong."""
    if not torch.cuda.is_available():
        print("flashtile bench --decode: needs a CUDA GPU (the sweep times the decode kernels)", flush=True)
        return 2
    os.makedirs(args.out, exist_ok=True)
    import flashtile
    from flashtile import flash_attn_with_kvcache
    from flashtile.kernels import decode as decode_mod

    tile_sweep = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",") if t]

    try:
        from flash_attn import flash_attn_with_kvcache as fa_kvcache
    except Exception:  # noqa: BLE001
        fa_kvcache = None
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    bw = read_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs; measured read bandwidth {bw / 1e9:.0f} GB/s")
    rows = []
    header = (f"{'B':>3} {'L':>7} {'sq':>2} {'layout':>8} {'MB':>7} | {'flashtile us':>12} {'graph us':>8} {'GB/s':>6} {'%bw':>5} "
              f"{'+append us':>10} | {'cudnn us':>9} {'graph us':>8} {'%bw':>5} {'flash us':>9} {'%bw':>5} {'flex us':>9} {'%bw':>5} "
              f"{'fa us':>8} | err")
    print(header)
    for B, L in QUICK if args.quick else CASES:
        torch.cuda.empty_cache()
        cap = L + 256  # room for appends; multiple of 16 and 256
        try:
            kc = torch.randn(B, cap, HKV, D, device=dev, dtype=DT)
            vc = torch.randn(B, cap, HKV, D, device=dev, dtype=DT)
        except torch.OutOfMemoryError:
            print(f"{B:>3} {L:>7}: cache does not fit, skipped")
            continue
        for sq in (1, 4):
            q = torch.randn(B, sq, H, D, device=dev, dtype=DT)
            knew = torch.randn(B, sq, HKV, D, device=dev, dtype=DT)
            vnew = torch.randn(B, sq, HKV, D, device=dev, dtype=DT)
            kv_bytes = 2 * B * L * HKV * D * DT.itemsize
            io_bytes = kv_bytes + 2 * q.numel() * DT.itemsize
            ref0 = reference_entry0(q, kc, vc, L, sq)
            sdpa = {}
            for be in ("cudnn", "flash", "flex"):
                try:
                    fn = flex_fn(q, kc, vc, L, sq) if be == "flex" else sdpa_fn(be, q, kc, vc, L, sq)
                    fn()
                    sdpa[be] = bench(fn)
                    sdpa[be + "_graph"] = bench_graph(fn)
                except Exception as e:  # noqa: BLE001
                    sdpa[be] = None
                    sdpa[be + "_why"] = f"{type(e).__name__}: {str(e)[:80]}"
            for layout, page in LAYOUTS:
                seqlens = torch.full((B,), L, dtype=torch.int32, device=dev)
                seqlens_append = torch.full((B,), L - sq, dtype=torch.int32, device=dev)
                kcache, vcache, kw = as_layout(kc, vc, page)
                call = lambda: flash_attn_with_kvcache(q, kcache, vcache, cache_seqlens=seqlens, causal=True, **kw)  # noqa: E731
                call_append = lambda: flash_attn_with_kvcache(q, kcache, vcache, k=knew, v=vnew, cache_seqlens=seqlens_append, causal=True, **kw)  # noqa: E731
                out = call()
                if page is None:
                    err = (out[0].float() - ref0).abs().max().item()
                else:  # entry 0's logical rows through the table, against the same fp32 math
                    r = reference_entry0(q, entry0_rows(kcache, L, page, kw)[None], entry0_rows(vcache, L, page, kw)[None], L, sq)
                    err = (out[0].float() - r).abs().max().item()
                t = bench(call)
                tg = bench_graph(call)
                sweep = {}  # before the append below rewrites the cache's last sq rows
                for tiles in tile_sweep:  # decode_kernel's tiles: 16-bit calls kept off decode_ws
                    decode_mod.CFG_OVERRIDE = {"block_n": tiles[0], "num_stages": tiles[1]}
                    ws16, decode_mod.WS_16BIT = decode_mod.WS_16BIT, False
                    try:
                        o2 = call()
                        e2 = (o2.float() - out.float()).abs().max().item()
                        sweep[f"{tiles[0]}x{tiles[1]}"] = {"s": bench_graph(call) or bench(call), "diff_vs_default": e2}
                    finally:
                        decode_mod.CFG_OVERRIDE, decode_mod.WS_16BIT = None, ws16
                ta = bench(call_append)
                fa_t = None
                if fa_kvcache is not None:
                    try:
                        fa_call = lambda: fa_kvcache(q, kcache, vcache, cache_seqlens=seqlens, causal=True, **kw)  # noqa: E731
                        fa_call()
                        fa_t = bench(fa_call)
                    except Exception:  # noqa: BLE001
                        fa_t = None
                row = dict(batch=B, seqlen_cache=L, seqlen_q=sq, layout=layout, cache_mb=kv_bytes / 2**20,
                           flashtile_s=t, flashtile_graph_s=tg, flashtile_append_s=ta,
                           flashtile_gbs=io_bytes / (tg or t) / 1e9, flashtile_pct_bw=100 * io_bytes / (tg or t) / bw,
                           err_vs_fp32=err, wrong=err > 2e-2,
                           cudnn_s=sdpa["cudnn"] if page is None else None,
                           cudnn_graph_s=sdpa.get("cudnn_graph") if page is None else None,
                           flash_s=sdpa["flash"] if page is None else None, fa_s=fa_t,
                           flex_graph_s=(sdpa.get("flex_graph") or sdpa.get("flex")) if page is None else None,
                           sdpa_notes={k: v for k, v in sdpa.items() if k.endswith("_why")}, tiles=sweep)
                rows.append(row)
                fmt = lambda s: f"{s * 1e6:9.1f}" if s else f"{'-':>9}"  # noqa: E731
                pct = lambda s: f"{100 * io_bytes / s / bw:5.1f}" if s else f"{'-':>5}"  # noqa: E731
                best = tg or t
                cg = row["cudnn_graph_s"] or row["cudnn_s"]
                print(f"{B:>3} {L:>7} {sq:>2} {layout:>8} {kv_bytes / 2**20:7.0f} | {t * 1e6:12.1f} {fmt(tg)[1:]} {io_bytes / best / 1e9:6.0f} "
                      f"{100 * io_bytes / best / bw:5.1f} {ta * 1e6:10.1f} | {fmt(row['cudnn_s'])} {fmt(row['cudnn_graph_s'])[1:]} {pct(cg)} "
                      f"{fmt(row['flash_s'])} {pct(row['flash_s'])} {fmt(row['flex_graph_s'])} {pct(row['flex_graph_s'])} "
                      f"{fmt(fa_t)[1:]} | {err:.1e}{' WRONG' if err > 2e-2 else ''}",
                      flush=True)
                write(args.out, rows, props, bw)
                for name, r in sweep.items():
                    print(f"{'':>33}tiles {name}: {r['s'] * 1e6:9.1f} us {100 * io_bytes / r['s'] / bw:5.1f} %bw (diff {r['diff_vs_default']:.1e})", flush=True)
            if args.fp8:
                fp8_rows(rows, q, kc, vc, L, sq, bw, {r["layout"]: r for r in rows[-len(LAYOUTS):]})
                write(args.out, rows, props, bw)
        del kc, vc
    write(args.out, rows, props, bw)
    print(f"wrote {args.out}/decode.json and decode.md")
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
