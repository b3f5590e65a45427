"""Python host time of one ``flash_attn_with_kvcache`` CUDA call, measured on the CPU machine
(developer tool).

    python3 benchmarks/host_path_cpu.py [--profile] [--batch 1] [--keys 8192] [--paged 16]

Runs the CUDA branch of the call (validation, the schedule, ``decode.launch_decode``'s argument
preparation) on ``meta`` tensors with the kernels stubbed out and the GPU queries
(``target.sm_count``, ``target.capability``) answered as an H100's, so what it times is the
Python that a device host runs before and between the two kernel launches (decode, combine),
not the launches themselves (~12.5 us each through tvm-ffi on an H100 host: README,
Performance) nor CUDA allocation.  ``--profile`` prints cProfile's cumulative top 30.
Compare runs on one machine only.  Twenty-first session: 32-37 us per call (B=1 8k,
contiguous), 25-26 us once ``decode.decode_plan`` memoised the launcher's decisions.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import timeit

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashtile  # noqa: E402
from flashtile import kvcache  # noqa: E402
from flashtile.kernels import decode, target  # noqa: E402


def stub_gpu() -> None:
    """The CUDA branch on meta tensors: plain-eager routing, an H100's SM count and capability,
    kernels that do nothing."""
    kvcache.ops.eager_route = lambda device, *tensors: "impl"
    target.sm_count = lambda device: 132
    target.capability = lambda device: (9, 0)

    def nothing(*args, **kwargs):
        return None

    decode.get_decode_kernels = lambda *args, **kwargs: (nothing,) * 4

    def attend(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table, sinks, softmax_scale,
               window_left, window_right, softcap, num_splits, k_descale, v_descale):
        out, lse = decode.launch_decode(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table,
                                        sinks, softmax_scale, (window_left, window_right), softcap, num_splits,
                                        k_descale, v_descale)
        return out.contiguous(), lse.contiguous()

    kvcache._attend = attend  # kvcache's own dispatch sends meta tensors nowhere


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--keys", type=int, default=8192)
    ap.add_argument("--paged", type=int, default=0, help="page size (0: a contiguous cache)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    stub_gpu()
    b, h, hkv, d, cap = args.batch, 32, 8, 128, args.keys + 256
    meta = dict(dtype=torch.bfloat16, device="meta")
    q = torch.empty(b, 1, h, d, **meta)
    kw = {"cache_seqlens": torch.empty(b, dtype=torch.int32, device="meta"), "causal": True}
    if args.paged:
        pages = -(-cap // args.paged)
        kc = torch.empty(b * pages, args.paged, hkv, d, **meta)
        kw["block_table"] = torch.empty(b, pages, dtype=torch.int32, device="meta")
    else:
        kc = torch.empty(b, cap, hkv, d, **meta)
    vc = torch.empty_like(kc)

    def call():
        return flashtile.flash_attn_with_kvcache(q, kc, vc, **kw)

    call()
    # The best of 30 rounds: this machine's other tenants make single rounds noisy (+-30%).
    t = min(timeit.repeat(call, number=args.calls // 10, repeat=30)) / (args.calls // 10)
    print(f"host Python per call (meta tensors, kernels stubbed; best of 30 x {args.calls // 10}): {t * 1e6:.1f} us")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            call()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
