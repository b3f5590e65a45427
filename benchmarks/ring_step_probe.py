"""Where a ring-attention rank's time goes, on one GPU and without communication.

    python3 benchmarks/ring_step_probe.py --seqlen 128k --world 4 [--rank 0] [--out probe.md]

For one rank of a ``--world``-way zigzag ring over ``--seqlen`` total tokens (causal, bf16,
32 heads, d=128 by default), times every piece of every ring step alone (CUDA events, median
of ``--iters`` after a warm-up, fresh random inputs): the forward kernel calls, the forward's
lse merges, the backward kernel calls and the backward's float32 accumulations, then the
single-GPU T1 on the full sequence.  The sums against T1 / world say how much of the ring's
loss is the kernels on the steps' shapes and the host-side arithmetic, before communication;
``flashtile cp`` measures the real ring.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch

from flashtile import flash_attn_func
from flashtile.distributed import bench
from flashtile.distributed.ring_attention import _merge_into, _step_bwd, _step_fwd, plan
from flashtile.flops import attention_flops


def _median_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    return statistics.median(bench.cuda_ms(fn) for _ in range(iters))


def _pairs(p) -> int:
    """Visible (query, key) pairs of a piece in its kernel window (bottom-right aligned)."""
    from flashtile.flops import visible_pairs

    return visible_pairs(p.q1 - p.q0, p.k1 - p.k0, False, (p.left, p.right))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlen", type=bench._size, default=131072)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    n, h, d, w, r = args.seqlen // args.world, args.heads, args.headdim, args.world, args.rank
    scale = 1.0 / math.sqrt(d)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16)

    q, k, v, dout = rnd(1, n, h, d), rnd(1, n, h, d), rnd(1, n, h, d), rnd(1, n, h, d)
    out = rnd(1, n, h, d)
    lse = torch.randn(1, h, n, device=dev) + 10.0
    rows = []
    tot = {"fwd": 0.0, "merge": 0.0, "bwd": 0.0, "accum": 0.0}
    acc = torch.zeros(1, n, h, d, device=dev)
    acc_lse = torch.full((1, h, n), -math.inf, device=dev)
    dq = torch.zeros(1, n, h, d, device=dev)
    dk_step = torch.zeros(1, n, h, d, device=dev)
    for step in range(w):
        src = (r - step) % w
        for p in plan(n, w, r, src, "zigzag", -1, 0):
            qs, ks, vs = q[:, p.q0:p.q1], k[:, p.k0:p.k1], v[:, p.k0:p.k1]
            o, l = _step_fwd(qs, ks, vs, scale, p.left, p.right, 0.0, False)
            t_f = _median_ms(lambda: _step_fwd(qs, ks, vs, scale, p.left, p.right, 0.0, False), args.iters)
            t_m = _median_ms(lambda: _merge_into(acc[:, p.q0:p.q1], acc_lse[:, :, p.q0:p.q1], o, l), args.iters) if step else 0.0
            do_p, q_p, out_p, lse_p = dout[:, p.q0:p.q1], q[:, p.q0:p.q1], out[:, p.q0:p.q1], lse[:, :, p.q0:p.q1].contiguous()
            grads = _step_bwd(do_p, None, q_p, ks, vs, out_p, lse_p, scale, p.left, p.right, 0.0, False)
            t_b = _median_ms(lambda: _step_bwd(do_p, None, q_p, ks, vs, out_p, lse_p, scale, p.left, p.right, 0.0, False), args.iters)

            def accum():
                dq[:, p.q0:p.q1] += grads[0]
                dk_step[:, p.k0:p.k1] += grads[1]
                dk_step[:, p.k0:p.k1] += grads[2]

            t_a = _median_ms(accum, args.iters)
            flops = 2 * h * _pairs(p) * 2 * d  # forward; the backward's is 2.5x (flashtile.flops)
            rows.append((step, f"q[{p.q0}:{p.q1}] x k[{p.k0}:{p.k1}] window ({p.left},{p.right})", t_f, flops / t_f / 1e9,
                         t_m, t_b, 2.5 * flops / t_b / 1e9, t_a))
            for key, t in zip(("fwd", "merge", "bwd", "accum"), (t_f, t_m, t_b, t_a)):
                tot[key] += t
    del acc, dq, dk_step
    torch.cuda.empty_cache()
    S = args.seqlen
    qf, kf, vf = rnd(1, S, h, d), rnd(1, S, h, d), rnd(1, S, h, d)
    t1_f = _median_ms(lambda: flash_attn_func(qf, kf, vf, causal=True), max(2, args.iters // 2))
    leaves = [x.detach().requires_grad_() for x in (qf, kf, vf)]
    dfull = rnd(1, S, h, d)

    def fb():
        for x in leaves:
            x.grad = None
        flash_attn_func(*leaves, causal=True).backward(dfull)

    t1_fb = _median_ms(fb, max(2, args.iters // 2))
    f1 = attention_flops(1, h, S, S, d, d, causal=True, mode="fwd")
    lines = [f"# Ring step probe: {torch.cuda.get_device_name()}, total {S}, world {w}, rank {r}, causal bf16, {h} heads, d={d}", "",
             "| step | piece | fwd ms | fwd TFLOP/s | merge ms | bwd ms | bwd TFLOP/s | accum ms |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {s} | {desc} | {tf:.2f} | {ff:.0f} | {tm:.2f} | {tb:.2f} | {fb_:.0f} | {ta:.2f} |" for s, desc, tf, ff, tm, tb, fb_, ta in rows]
    ideal_f, ideal_b = t1_f / w, (t1_fb - t1_f) / w
    lines += ["", f"T1 (single GPU, full sequence): fwd {t1_f:.2f} ms ({f1 / t1_f / 1e9:.0f} TFLOP/s), fwd+bwd {t1_fb:.2f} ms", "",
              "| pass | T1 / world | kernels | host arithmetic (merge / accum) | kernels + arithmetic | efficiency without communication |",
              "| --- | ---: | ---: | ---: | ---: | ---: |",
              f"| forward | {ideal_f:.2f} | {tot['fwd']:.2f} | {tot['merge']:.2f} | {tot['fwd'] + tot['merge']:.2f} | {ideal_f / (tot['fwd'] + tot['merge']):.3f} |",
              f"| backward | {ideal_b:.2f} | {tot['bwd']:.2f} | {tot['accum']:.2f} | {tot['bwd'] + tot['accum']:.2f} | {ideal_b / (tot['bwd'] + tot['accum']):.3f} |"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
