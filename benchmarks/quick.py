"""Developer loop on the device: check a few shapes, then time fwd/bwd against cuDNN.

    python3 benchmarks/quick.py [--shapes small|perf|all] [--headdim 128 ...]

Prints one line per check (max abs error vs the fp32 reference, and the flash-attn bound) and
one line per timing (ms, TFLOP/s, ratio to cuDNN SDPA measured in the same process).  This is
the kernel author's tool; users run ``flashtile bench``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile import reference
from flashtile.kernels import debug


def _err(a, b):
    return (a.float() - b.float()).abs().nan_to_num(nan=float("inf")).max().item()


def check(b, sq, sk, h, hkv, d, dv, dtype, causal=False, window=(-1, -1), sinks=False, softcap=0.0, det=False):
    dev = "cuda"
    q = torch.randn(b, sq, h, d, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hkv, dv, device=dev, dtype=dtype, requires_grad=True)
    s = torch.randn(h, device=dev, dtype=torch.float32, requires_grad=True) if sinks else None
    scale = 1 / math.sqrt(d)
    with debug.poison():
        out, lse = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window, sinks=s, softcap=softcap, return_lse=True, deterministic=det)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, [q, k, v] + ([s] if sinks else []), dout)
    win = flashtile.interface.normalize_window(causal, window)
    q32, k32, v32 = q.detach().float(), k.detach().float(), v.detach().float()
    o32, l32 = reference.attention_forward(q32, k32, v32, scale, win, s, softcap)
    olp, llp = reference.attention_forward(q.detach(), k.detach(), v.detach(), scale, win, s, softcap)
    g32 = reference.attention_backward(dout.float(), q32, k32, v32, o32, l32, scale, win, s, softcap)
    glp = reference.attention_backward(dout, q.detach(), k.detach(), v.detach(), olp, llp, scale, win, s, softcap)
    rows = [("out", out, o32, olp, 2)]
    fin = torch.isfinite(l32)
    rows.append(("lse", torch.where(fin, lse, 0), torch.where(fin, l32, 0), torch.where(fin, llp, 0), 2))
    for name, g, r32, rlp in zip(["dq", "dk", "dv", "dsink"], grads, g32, glp):
        rows.append((name, g, r32, rlp, 3))
    ok = True
    msgs = []
    for name, x, r32, rlp, fac in rows:
        e, bound = _err(x, r32), fac * _err(rlp, r32) + 1e-5
        good = e <= bound and not torch.isnan(x).any().item()
        ok &= good
        msgs.append(f"{name}={e:.2e}/{bound:.2e}{'' if good else '!!'}")
    tag = f"b{b} sq{sq} sk{sk} h{h}/{hkv} d{d}/{dv} {str(dtype)[6:]} c{int(causal)} w{window} sink{int(sinks)} cap{softcap} det{int(det)}"
    print(("PASS " if ok else "FAIL ") + tag + " " + " ".join(msgs), flush=True)
    return ok


def bench(d, seqlen, causal, hkv_ratio=1, dtype=torch.bfloat16, total=16384):
    from triton.testing import do_bench

    b = max(1, total // seqlen)
    h = 2048 // d
    hkv = h // hkv_ratio
    q = torch.randn(b, seqlen, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, seqlen, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, seqlen, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    flops = 4 * b * h * seqlen * seqlen * d * (0.5 if causal else 1.0)
    res = {}
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    res["ft_fwd"] = do_bench(lambda: flashtile.flash_attn_func(q, k, v, causal=causal), warmup=50, rep=200, return_mode="median")
    res["ft_bwd"] = do_bench(lambda: torch.autograd.grad(out, [q, k, v], dout, retain_graph=True), warmup=50, rep=200, return_mode="median")
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        gqa = hkv != h
        o2 = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
        d2 = torch.randn_like(o2)
        res["cu_fwd"] = do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa), warmup=50, rep=200, return_mode="median")
        res["cu_bwd"] = do_bench(lambda: torch.autograd.grad(o2, [qt, kt, vt], d2, retain_graph=True), warmup=50, rep=200, return_mode="median")
    f = lambda ms, mult: mult * flops / ms * 1e-9
    print(
        f"BENCH d{d} s{seqlen} b{b} h{h}/{hkv} c{int(causal)}: "
        f"fwd ft {res['ft_fwd']:.3f}ms {f(res['ft_fwd'],1):.0f}TF cudnn {f(res['cu_fwd'],1):.0f}TF ratio {res['cu_fwd']/res['ft_fwd']:.3f} | "
        f"bwd ft {res['ft_bwd']:.3f}ms {f(res['ft_bwd'],2.5):.0f}TF cudnn {f(res['cu_bwd'],2.5):.0f}TF ratio {res['cu_bwd']/res['ft_bwd']:.3f}",
        flush=True,
    )


SMALL = [
    dict(b=2, sq=113, sk=203, h=4, hkv=4, d=128, dv=128, dtype=torch.bfloat16),
    dict(b=2, sq=113, sk=203, h=4, hkv=4, d=128, dv=128, dtype=torch.bfloat16, causal=True),
    dict(b=1, sq=1023, sk=1024, h=8, hkv=2, d=128, dv=128, dtype=torch.float16, causal=True, window=(127, -1)),
    dict(b=1, sq=239, sk=17, h=4, hkv=1, d=64, dv=64, dtype=torch.bfloat16, causal=True, sinks=True),
    dict(b=2, sq=300, sk=300, h=4, hkv=2, d=128, dv=128, dtype=torch.bfloat16, window=(64, 64), softcap=30.0, sinks=True),
    dict(b=1, sq=257, sk=257, h=2, hkv=2, d=192, dv=128, dtype=torch.bfloat16, causal=True),
    dict(b=1, sq=257, sk=129, h=2, hkv=1, d=256, dv=256, dtype=torch.bfloat16, window=(0, 0)),
    dict(b=2, sq=1, sk=1, h=4, hkv=4, d=96, dv=96, dtype=torch.float16),
    dict(b=1, sq=517, sk=700, h=8, hkv=2, d=128, dv=128, dtype=torch.bfloat16, causal=True, det=True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="all", choices=["small", "perf", "all"])
    ap.add_argument("--headdim", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[1024, 4096, 16384])
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    t0 = time.time()
    fails = 0
    if args.shapes in ("small", "all"):
        for case in SMALL:
            try:
                fails += not check(**case)
            except Exception as e:  # keep going: one broken variant should not hide the others
                fails += 1
                print(f"ERROR {case}: {type(e).__name__}: {str(e)[:400]}", flush=True)
        print(f"checks done in {time.time() - t0:.0f}s, failures {fails}", flush=True)
    if args.shapes in ("perf", "all"):
        for d in args.headdim:
            for s in args.seqlen:
                for causal in (False, True):
                    try:
                        bench(d, s, causal)
                    except Exception as e:
                        print(f"BENCH ERROR d{d} s{s} c{causal}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return fails


if __name__ == "__main__":
    raise SystemExit(main())
