"""Time candidate tile configs against cuDNN in one process (developer tool, run on the device).

    python3 benchmarks/tune.py fwd --headdim 128 --seqlen 4096 8192
    python3 benchmarks/tune.py bwd --headdim 128
    python3 benchmarks/tune.py bwd_dq --headdim 128      # the deterministic dQ kernel
    python3 benchmarks/tune.py fwd --fp8 --headdim 256 --configs 128,128,2,256,1,1,1 128,64,2,256,1,1,1
                                                          # the FP8 forward (--check: its GPU tests
                                                          # of that head dim under each config)

Each line: pass, config, d, seqlen, causal, ms, ratio to cuDNN SDPA.  Failures (compile or
launch) print one line and the sweep goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
import flashtile.fp8  # noqa: F401  (the --fp8 inputs)
from flashtile.kernels import configs

# (block_m, block_n, stages, threads, manual_ws, pingpong, tiles_per_cta, skip_rescale) for the forward; (block_n, block_m, stages, threads,
# overlap, manual_ws, dq_turns, persistent, dq_regs, producer_regs, replicate_scores) for the backward.  First entry of each list = the table's current choice.
FWD = {
    64: [(192, 128, 2, 384, 1, 1), (192, 128, 2, 384, 1, 1, 0), (128, 128, 2, 256, 1, 1, 0)],
    128: [(128, 128, 2, 256, 1, 1, 0), (128, 128, 2, 256, 1, 1), (128, 128, 2, 256, 1, 1, 2)],
    256: [(128, 80, 2, 256, 1, 1), (128, 80, 2, 256, 0), (128, 80, 2, 256, 1, 0)],
}
BWD = {
    64: [(128, 64, 2, 256, 1, 1), (128, 64, 2, 256, 1, 0), (128, 128, 1, 256, 0, 0)],
    128: [(128, 64, 2, 256, 1, 1), (128, 64, 2, 256, 1, 0), (128, 64, 3, 256, 1, 0)],
    256: [(64, 64, 1, 256, 1), (64, 64, 1, 256, 1, 0, 0, 0, 1), (64, 64, 2, 256, 1, 0, 0, 0, 1)],
}


DQ = {  # (block_m, block_n, stages, threads, manual_ws) of the deterministic dQ kernel
    64: [(128, 64, 2, 256, 1), (128, 64, 2, 256, 0)],
    128: [(128, 64, 2, 256, 1), (128, 64, 2, 256, 0)],
    256: [(64, 64, 1, 128, 0)],
}
TABLES = {"fwd": FWD, "bwd": BWD, "bwd_dq": DQ}  # keys are also configs.overrides' keys


def make_config(which, cfg):
    cls = {"fwd": configs.FwdConfig, "bwd": configs.BwdConfig, "bwd_dq": configs.DqConfig}[which]
    # Values in field order; flags (bool fields) as 0/1, counts (tiles_per_cta, softmax_turns) as ints.
    kinds = [f.type in (bool, "bool") for f in dataclasses.fields(cls)]
    return cls(*(bool(v) if flag else int(v) for v, flag in zip(cfg, kinds)))


def prebuild(which, d, cfg, det, fp8=False):
    """Compile one candidate into TileLang's disk cache (runs in a worker process; on the CPU
    machine too, e.g. before packing: ``python3 benchmarks/tune.py fwd --fp8 --headdim 128
    --configs ... --prebuild-only``)."""
    configs.overrides[which] = make_config(which, cfg)
    try:
        if which == "fwd" and fp8:  # every structure the FP8 GPU tests of this head dim build (--check)
            from flashtile.kernels import precompile

            for p, kw in precompile.structures([(d, d)], ["bfloat16", "float16"], list(precompile.FEATURES), ["fwd8"]):
                precompile.build(p, kw)
        elif which == "fwd":
            from flashtile.kernels.launch import forward_kernel as get_forward_kernel

            get_forward_kernel(d, d, "bfloat16", False, False)
        else:
            from flashtile.kernels.launch import backward_kernels as get_backward_kernels

            get_backward_kernels(d, d, "bfloat16", False, False, det)
        return f"built {which} d{d} {cfg}"
    except Exception as e:
        return f"TUNE {which} {cfg} d{d} BUILD FAILED {type(e).__name__}: {str(e)[:200]}"


def time_case(which, d, s, causal, total=16384, dtype=torch.bfloat16, gqa=1, det=False, fp8=False):
    from triton.testing import do_bench  # on the device only (prebuild runs on CPU machines too)

    b, h = max(1, total // s), 2048 // d
    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, s, h // gqa, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa > 1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        if which == "fwd":
            ref = do_bench(sdpa, warmup=30, rep=150, return_mode="median")
        else:
            o2 = sdpa()
            d2 = torch.randn_like(o2)
            ref = do_bench(lambda: torch.autograd.grad(o2, [qt, kt, vt], d2, retain_graph=True), warmup=30, rep=150, return_mode="median")
    if which == "fwd" and fp8:  # quantized outside the timed region (FP8 forward, no grad)
        q8, k8, v8, qd, kd, vd = flashtile.fp8.quantize_qkv(q.detach(), k.detach(), v.detach())
        fn = lambda: flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    elif which == "fwd":
        fn = lambda: flashtile.flash_attn_func(q, k, v, causal=causal)
    else:
        out = flashtile.flash_attn_func(q, k, v, causal=causal, deterministic=det)
        dout = torch.randn_like(out)
        fn = lambda: torch.autograd.grad(out, [q, k, v], dout, retain_graph=True)
    ms = do_bench(fn, warmup=30, rep=150, return_mode="median")
    return ms, ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("which", choices=list(TABLES))
    ap.add_argument("--headdim", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[4096])
    ap.add_argument("--gqa", type=int, default=1, help="nheads / nheads_kv")
    ap.add_argument("--det", action="store_true", help="deterministic backward")
    ap.add_argument("--fp8", action="store_true", help="fwd: the FP8 forward (float8_e4m3fn q, k, v)")
    ap.add_argument("--only-first", action="store_true", help="first config of each head dim only")
    ap.add_argument("--configs", nargs="*", default=None, help="e.g. 128,128,2,256 (replaces the lists above)")
    ap.add_argument("--check", action="store_true", help="check each candidate against the reference first")
    ap.add_argument("--rows-per-group", type=int, nargs="*", default=[0], help="dK/dV launch order(s) to time (0 = the table's)")
    ap.add_argument("--repeat", type=int, default=1, help="time the whole list this many times")
    ap.add_argument("--prebuild-only", action="store_true", help="compile the candidates and stop (no GPU needed)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2), help="parallel prebuild processes")
    args = ap.parse_args()
    table = TABLES[args.which]
    args.det = args.det or args.which == "bwd_dq"
    todo = []
    for d in args.headdim:
        cands = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else table[d]
        todo += [(d, cfg) for cfg in (cands[:1] if args.only_first else cands)]
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(prebuild, *zip(*[(args.which, d, cfg, args.det, args.fp8) for d, cfg in todo])):
            print(line, flush=True)
    if args.prebuild_only:
        return
    if args.check and args.fp8:  # the FP8 forward's own GPU tests (2x rule vs the rounding baseline)
        import pytest

        for d, cfg in todo:
            configs.overrides[args.which] = make_config(args.which, cfg)
            rc = pytest.main(["-q", "-p", "no:cacheprovider", "tests/test_gpu_fp8.py", "-k", f"forward and d{d}/"])
            print(f"CHECK fp8 {cfg} d{d} pytest rc {int(rc)}", flush=True)
    elif args.check:  # every candidate against the reference on awkward shapes before timing
        from quick import check

        for d, cfg in todo:
            configs.overrides[args.which] = make_config(args.which, cfg)
            print(f"CHECK {args.which} {cfg} d{d}", flush=True)
            for causal, window, sq, sk in ((False, (-1, -1), 317, 451), (True, (-1, -1), 451, 317), (False, (96, 0), 300, 300)):
                check(2, sq, sk, 4, 4 // min(args.gqa, 4), d, d, torch.bfloat16, causal=causal, window=window, det=args.det)
    for d, cfg in todo * args.repeat:  # repeats interleave configs, so drift hits all alike
        configs.overrides[args.which] = make_config(args.which, cfg)
        for rows in args.rows_per_group:
            if rows:
                configs.overrides["dkdv_rows"] = rows
            else:
                configs.overrides.pop("dkdv_rows", None)
            for s in args.seqlen:
                for causal in (False, True):
                    tag = f"{args.which}{'-fp8' * args.fp8} gqa{args.gqa} det{int(args.det)} rows{rows} {cfg} d{d} s{s} c{int(causal)}"
                    try:
                        ms, ref = time_case(args.which, d, s, causal, gqa=args.gqa, det=args.det, fp8=args.fp8)
                        print(f"TUNE {tag} {ms:.3f}ms ratio {ref / ms:.3f}", flush=True)
                    except Exception as e:
                        print(f"TUNE {tag} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
    configs.overrides.clear()


if __name__ == "__main__":
    main()
