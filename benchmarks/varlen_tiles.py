"""A/B of forward tile configs on packed (varlen) batches, one process (developer tool).

    python3 benchmarks/varlen_tiles.py --headdim 64 --variants default 128x128x256
    python3 benchmarks/varlen_tiles.py --precompile --headdim 64 --variants default 128x128x256

Each variant is ``default`` (``configs.fwd_config``) or ``MxNxT`` (block_m x block_n x threads,
hand-written pingpong forward, one tile per CTA), set through ``configs.overrides`` for the
packed call only; the equal-length dense batch of the same tokens always runs the default
tiles, as in ``flashtile bench --varlen``.  Batches and tensors are the bench's
(``bench_varlen``), bf16, nheads x headdim = 2048; prints useful TFLOP/s (real tokens) and the ratio to the dense
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

    from flashtile.bench_varlen import Case, batches

    print(f"{torch.cuda.get_device_name()}; bf16 d={d} h={h}")
    for batch in batches("cuda"):
        for causal in (True, False):
            with torch.no_grad():  # forward only, nothing for autograd to record
                run_case(args.variants, Case(batch, d, h, causal))
    return 0


def run_case(variants, case):
    """One batch and mask: the dense equal-length batch, then every variant on the packed batch
    (both the bench's own tensors: ``bench_varlen.Packed`` and ``_dense``, same seeds)."""
    import triton.testing

    from flashtile import flash_attn_func, flash_attn_varlen_func
    from flashtile.bench_varlen import Packed, _dense, useful_flops
    from flashtile.kernels import configs

    batch, d, h, causal = case.batch, case.headdim, case.nheads, case.causal
    n = len(batch.lengths)
    eq = batch.total // n
    p = Packed(case, "cuda", torch.bfloat16)
    qd, kd, vd, _ = _dense(case, "cuda", torch.bfloat16, n, eq)
    flops = useful_flops(batch.lengths, h, d, causal, "fwd")
    dense = triton.testing.do_bench(lambda: flash_attn_func(qd, kd, vd, causal=causal), warmup=50, rep=200)
    dense_tf = useful_flops((eq,) * n, h, d, causal, "fwd") / dense / 1e9
    ref = None
    for name in variants:
        cfg = config(name)
        if cfg is not None:
            configs.overrides["fwd"] = cfg
        try:
            call = lambda: flash_attn_varlen_func(p.q, p.k, p.v, p.cu, p.cu, p.max_len, p.max_len,  # noqa: E731
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


if __name__ == "__main__":
    raise SystemExit(main())
