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


def bench(d, seqlen, causal, hkv_ratio=1):
    """One timing line: forward and backward against cuDNN (timing shared with tune.py)."""
    from flashtile.flops import attention_flops
    from tune import time_case

    b, h = max(1, 16384 // seqlen), 2048 // d
    cols = []
    for mode in ("fwd", "bwd"):
        ms, ref = time_case(mode, d, seqlen, causal, gqa=hkv_ratio)
        flops = attention_flops(b, h, seqlen, seqlen, d, causal=causal, mode=mode)
        cols.append(f"{mode} ft {ms:.3f}ms {flops / ms * 1e-9:.0f}TF cudnn {flops / ref * 1e-9:.0f}TF ratio {ref / ms:.3f}")
    print(f"BENCH d{d} s{seqlen} b{b} h{h}/{h // hkv_ratio} c{int(causal)}: " + " | ".join(cols), flush=True)


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
