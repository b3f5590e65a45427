"""A/B of the FP8 forward's V^T pre-pass kernels, GPU time only (developer tool, device).

    python3 benchmarks/transpose_ab.py [--old benchmarks/_transpose_v_bytes.py]

Times ``transpose_v``'s dense launcher and, when ``--old`` names a module file with another
``launch_transpose_v`` (e.g. an earlier version from git, its relative imports made
absolute), that one, each replayed from a CUDA graph
(``bench_decode.bench_graph``; ``fp8_breakdown.py``'s V^T column includes host time), on 16k
tokens x 2048 / d heads as ``fp8_breakdown.py``; checks the two outputs are bitwise equal.
``--precompile`` builds both (no GPU needed).  The fourteenth session's word-wise variant
measured 1.2-2x slower than the byte-wise kernel this way (NOTES).

``--variants 128x128 128x256`` also times the current kernel built with other tiles (keys per
CTA x threads, ``transpose_v_kernel``'s ``block`` and ``threads``), each checked bitwise
against the default launcher's output.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch


def load_old(path):
    spec = importlib.util.spec_from_file_location("old_transpose_v", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def variant_kernel(module, d: int, block: int, threads: int):
    """``module``'s dense pre-pass for head dim ``d`` built with ``block`` keys per CTA and ``threads``."""
    from flashtile.kernels import cache

    return cache.get(module.transpose_v_kernel, dim_v=d, varlen=False, block=block, threads=threads)


def launch_variant(module, v, block: int, threads: int):
    """``module.launch_transpose_v(v)`` (dense) with the kernel built with ``block`` keys per CTA
    and ``threads``: the launcher's own allocation and views, only its kernel lookup swapped."""
    kernel = variant_kernel(module, v.shape[-1], block, threads)
    real, module.get_kernel = module.get_kernel, lambda dim_v, varlen: kernel
    try:
        return module.launch_transpose_v(v)
    finally:
        module.get_kernel = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=None)
    ap.add_argument("--headdim", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--variants", nargs="*", default=[], help="BLOCKxTHREADS tiles of the current kernel")
    ap.add_argument("--precompile", action="store_true")
    a = ap.parse_args()
    variants = [tuple(int(x) for x in v.split("x")) for v in a.variants]
    from flashtile.bench_decode import bench_graph
    from flashtile.kernels import debug
    from flashtile.kernels import transpose_v as new

    old = load_old(a.old) if a.old else None
    if a.precompile:
        for d in a.headdim:
            new.get_kernel(d, False)
            for block, threads in variants:
                variant_kernel(new, d, block, threads)
            if old:
                old.get_kernel(d, False)
        return
    print(f"# {torch.cuda.get_device_name()}; V^T pre-pass, us per launch (graph-replayed); 16k tokens, 2048 / d heads")
    print("| d | MB read + written | current | GB/s | --old | GB/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for d in a.headdim:
        h, s = 2048 // d, 16384
        v = (torch.randn(1, s, h, d, device="cuda") * 3).to(torch.float8_e4m3fn)
        # Each module's own launcher (its kernel's view of V^T included); the output's
        # allocation is replayed from the graph's pool.
        t_new = bench_graph(lambda: new.launch_transpose_v(v)) * 1e6
        mb = 2 * v.numel() / 1e6
        row = f"| {d} | {mb:.1f} | {t_new:.1f} | {mb * 1e3 / t_new:.0f} |"
        if old:
            t_old = bench_graph(lambda: old.launch_transpose_v(v)) * 1e6
            with debug.poison():
                vt_new, vt_old = new.launch_transpose_v(v), old.launch_transpose_v(v)
            assert torch.equal(vt_new.view(torch.int8), vt_old.view(torch.int8)), f"d={d}: the two V^T differ"
            row += f" {t_old:.1f} | {mb * 1e3 / t_old:.0f} |"
        print(row, flush=True)
        for block, threads in variants:
            launch = lambda: launch_variant(new, v, block, threads)  # noqa: E731
            t = bench_graph(launch) * 1e6
            with debug.poison():
                same = torch.equal(launch().view(torch.int8), new.launch_transpose_v(v).view(torch.int8))
            print(f"| {d} | {mb:.1f} | {block} keys x {threads} threads: {t:.1f} | {mb * 1e3 / t:.0f} | "
                  f"{'bitwise equal' if same else 'DIFFERS'} | |", flush=True)


if __name__ == "__main__":
    main()
