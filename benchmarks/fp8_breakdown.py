"""Where an FP8 forward call's time goes (device tool): the V^T pre-pass kernel, the attention
kernel alone, the whole call (GPU time, L2 not cleared), and the host time per call.

    python3 benchmarks/fp8_breakdown.py --headdim 128 256 --seqlen 1024 4096 [--profile-small]

``--profile-small``: torch.profiler's table (host and GPU time per op) of the small call whose
host time the last two columns report, once per head dim.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import flashtile
from flashtile import fp8
from flashtile.kernels import configs, launch, operands
from flashtile.kernels.masks import host_window
from flashtile.kernels.softmax import LOG2E
from flashtile.kernels.transpose_v import launch_transpose_v
from launch_overhead import per_call_us  # benchmarks/ is on sys.path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdim", type=int, nargs="*", default=[128, 256])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[1024, 4096])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--profile-small", action="store_true", help="torch.profiler table of the small FP8 call")
    a = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}; us per call; batch = 16k / seqlen, heads = 2048 / d")
    print("| d | seqlen | V^T pre-pass | attention kernel | whole call (GPU) | bf16 call | host per FP8 call | host per bf16 call |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for d in a.headdim:
        for s in a.seqlen:
            b, h = max(1, 16384 // s), 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q, k, v)
            window = (-1, 0) if a.causal else (-1, -1)
            vt = launch_transpose_v(v8)
            kern = launch.forward_kernel(d, d, "float8_e4m3fn", False, False, window, False, 132, "bfloat16",
                                         configs.short_forward(d, d, s, s, fp8=True))  # the row the call takes
            out = torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
            params = operands.params(torch.zeros(h, device="cuda"), qd, kd, vd)
            left, right = host_window(window)
            scal = (d ** -0.5 * LOG2E, 0.0, left, right, configs.head_group(d, configs.mask_kind(window)))  # as launch.forward
            t_vt = do_bench(lambda: launch_transpose_v(v8), warmup=20, rep=100, return_mode="median") * 1e3
            t_k = do_bench(lambda: kern(q8, k8, vt, out, lse, params, *scal), warmup=20, rep=100, return_mode="median") * 1e3
            call = lambda: flashtile.flash_attn_func(q8, k8, v8, causal=a.causal, q_descale=qd, k_descale=kd, v_descale=vd)
            t_call = do_bench(call, warmup=20, rep=100, return_mode="median") * 1e3
            t_bf16 = do_bench(lambda: flashtile.flash_attn_func(q, k, v, causal=a.causal), warmup=20, rep=100,
                              return_mode="median") * 1e3
            small = [x[:1, :128, :2].contiguous() for x in (q8, k8, v8)]
            sq, sk, sv = small
            tq, tk, tv = (x[:1, :128, :2].contiguous() for x in (q, k, v))
            hd = [x[:1, :2].contiguous() for x in (qd, kd, vd)]
            small_fp8 = lambda: flashtile.flash_attn_func(sq, sk, sv, causal=a.causal, q_descale=hd[0], k_descale=hd[1],
                                                          v_descale=hd[2])
            h8 = per_call_us(small_fp8)
            h16 = per_call_us(lambda: flashtile.flash_attn_func(tq, tk, tv, causal=a.causal))
            print(f"| {d} | {s} | {t_vt:.0f} | {t_k:.0f} | {t_call:.0f} | {t_bf16:.0f} | {h8:.0f} | {h16:.0f} |", flush=True)
            if a.profile_small and s == a.seqlen[-1]:
                profile_small(small_fp8, d)


def profile_small(call, d: int, n: int = 50) -> None:
    """Host and GPU time per op of ``n`` small FP8 calls (where the host time per call goes)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    print(f"# small FP8 call, d = {d}, {n} calls (totals)")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
