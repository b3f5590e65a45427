"""A/B of forward tile configs on packed (varlen) batches, one process (developer tool).

    python3 benchmarks/varlen_tiles.py --headdim 64 --variants default 128x128x256
    python3 benchmarks/varlen_tiles.py --precompile --headdim 64 --variants default 128x128x256

Each variant is ``default`` (``configs.fwd_config``) or ``MxNxT`` (block_m x block_n x threads,
hand-written pingpong forward, one tile per CTA), set through ``configs.overrides`` for the
packed call only; the equal-length dense batch of the same tokens always runs the default
tiles, as in ``flashtile bench --varlen``.  Batches are the bench's (``bench_varlen.batches``),
bf16, nheads x headdim = 2048; prints useful TFLOP/s (real tokens) and the ratio to the dense
equal-length batch, and checks every variant's output against the first one's.
"""

from __future__ import annotations

import argparse

import torch


def config(name: str):
    from flashtile.kernels import configs

    if name == "default":
        return None
    m, n, t = (int(x) for x in name.split("x"))
    return configs.FwdConfig(block_m=m, block_n=n, num_stages=2, threads=t, manual_ws=True, pingpong=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["default"])
    ap.add_argument("--precompile", action="store_true", help="build the variants' kernels (no GPU needed)")
    args = ap.parse_args(argv)
    from flashtile.kernels import configs
    from flashtile.kernels.launch import forward_kernel

    d, h = args.headdim, 2048 // args.headdim
    if args.precompile:
        for v in args.variants:
            cfg = config(v)
            if cfg is not None:
                configs.overrides["fwd"] = cfg
            forward_kernel(d, d, "bfloat16", False, False, varlen=True)
            configs.overrides.pop("fwd", None)
        return 0

    import triton.testing

    from flashtile import flash_attn_func, flash_attn_varlen_func
    from flashtile.bench_varlen import batches, useful_flops

    print(f"{torch.cuda.get_device_name()}; bf16 d={d} h={h}")
    for batch in batches("cuda"):
        lens = torch.tensor(batch.lengths, dtype=torch.int32)
        cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32).cuda()
        total, n = batch.total, len(batch.lengths)
        q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        eq = total // n
        qd, kd, vd = (torch.randn(n, eq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (True, False):
            flops = useful_flops(batch.lengths, h, d, causal, "fwd")
            dense = triton.testing.do_bench(lambda: flash_attn_func(qd, kd, vd, causal=causal), warmup=50, rep=200)
            dense_tf = attention_equal_flops(n, eq, h, d, causal) / dense / 1e9
            ref = None
            for name in args.variants:
                cfg = config(name)
                if cfg is not None:
                    configs.overrides["fwd"] = cfg
                try:
                    call = lambda: flash_attn_varlen_func(q, k, v, cu, cu, max(batch.lengths), max(batch.lengths),  # noqa: E731
                                                          causal=causal)
                    out = call()
                    ref = out if ref is None else ref
                    diff = (out.float() - ref.float()).abs().max().item()
                    ms = triton.testing.do_bench(call, warmup=50, rep=200)
                finally:
                    configs.overrides.pop("fwd", None)
                tf = flops / ms / 1e9
                print(f"{batch.name:>16} {'causal' if causal else 'full':6} {name:>12} {tf:7.1f} TFLOP/s"
                      f"  {tf / dense_tf:5.2f}x dense equal-length ({dense_tf:.0f})  diff {diff:.1e}", flush=True)
    return 0


def attention_equal_flops(n, s, h, d, causal):
    from flashtile.flops import attention_flops

    return attention_flops(n, h, s, s, d, d, causal=causal, mode="fwd")


if __name__ == "__main__":
    raise SystemExit(main())
