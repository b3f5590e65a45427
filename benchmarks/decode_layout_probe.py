"""Does the cache's head interleaving limit decode bandwidth?  (developer probe, run on the device)

    python3 benchmarks/decode_layout_probe.py

A (B, L, Hkv, d) cache puts one kv head's key row (d elements: 256 bytes bf16, 128 bytes FP8)
every Hkv * d elements, so a decode CTA of one kv head reads small pieces at a stride.  Same
cache bytes, same query heads per kv head (4), d = 128, one query token, graph-replayed:
Hkv = 8 (the bench's shape) against Hkv = 1 with 8x the batch (each key row contiguous), bf16
and FP8 caches, and the split counts of the launcher's choice.  Prints us and % of the read
bandwidth measured in the same process.
"""

from __future__ import annotations

import torch

from flashtile import flash_attn_with_kvcache
from flashtile.bench_decode import bench, bench_graph, quantize_cache, read_bandwidth


def case(B, L, hkv, fp8, bw, splits=0):
    g = torch.Generator(device="cuda").manual_seed(B * 7 + hkv)
    d, group = 128, 4
    q = torch.randn(B, 1, hkv * group, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kc = torch.randn(B, L, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(B, L, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kw = {}
    if fp8:
        kc, kd = quantize_cache(kc)
        vc, vd = quantize_cache(vc)
        kw = {"k_descale": kd, "v_descale": vd}
    seqlens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    call = lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, num_splits=splits, **kw)  # noqa: E731
    call()
    t = bench_graph(call) or bench(call)
    nbytes = 2 * B * L * hkv * d * kc.element_size()
    print(f"{'fp8 ' if fp8 else 'bf16'} B={B:>3} L={L:>6} Hkv={hkv} splits={splits:>2}: {t * 1e6:8.1f} us "
          f"{100 * nbytes / t / bw:5.1f} %bw", flush=True)
    del q, kc, vc


def main():
    bw = read_bandwidth()
    print(f"{torch.cuda.get_device_name()}; read bandwidth {bw / 1e9:.0f} GB/s")
    for fp8 in (False, True):
        for B, L, hkv in ((8, 32768, 8), (64, 32768, 1), (32, 8192, 8), (256, 8192, 1)):
            case(B, L, hkv, fp8, bw)
    for splits in (2, 4, 6, 8, 16, 32):  # bf16, B=8 32k: 64 (entry, head) rows, 2 CTAs per SM
        case(8, 32768, 8, False, bw, splits)
    for splits in (2, 4, 6, 8):
        case(8, 32768, 8, True, bw, splits)


if __name__ == "__main__":
    main()
