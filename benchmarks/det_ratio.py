"""Deterministic backward against the default one, in one process (issue 19 item 5; device only).

    python3 benchmarks/det_ratio.py [--headdim 64 128] [--seqlen 4096 16384] [--rounds 2]

Times the backward alone (``torch.autograd.grad`` of one forward's output, retained graph) with
``deterministic=False`` and ``True`` in turn, fresh random inputs per case, bf16, 16k tokens x
(2048 / d) heads, full and causal; prints ms and the ratio deterministic / default per round.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import flashtile


def backward_ms(q, k, v, causal: bool, deterministic: bool) -> float:
    out = flashtile.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
    dout = torch.randn_like(out)
    return do_bench(lambda: torch.autograd.grad(out, [q, k, v], dout, retain_graph=True), warmup=30, rep=150,
                    return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--headdim", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[4096, 16384])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for r in range(args.rounds):
        for d in args.headdim:
            for s in args.seqlen:
                for causal in (False, True):
                    b, h = max(1, 16384 // s), 2048 // d
                    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                               for _ in range(3))
                    default = backward_ms(q, k, v, causal, False)
                    det = backward_ms(q, k, v, causal, True)
                    print(f"DET round {r} d{d} s{s} causal{int(causal)} default {default:.3f}ms "
                          f"deterministic {det:.3f}ms ratio {det / default:.3f}", flush=True)


if __name__ == "__main__":
    main()
