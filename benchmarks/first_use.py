"""Time to first result on a fresh machine (issue 19, item 4), one configuration per process.

Run in a new process with an empty TileLang cache (``TILELANG_CACHE_DIR`` pointing to a new
directory), so nothing is cached but what the package ships (``kernels/prebuilt``):

    TILELANG_CACHE_DIR=$(mktemp -d) python3 benchmarks/first_use.py --headdim 128 --dtype bfloat16 --causal

Prints seconds from interpreter start for: torch imported, CUDA initialised, flashtile imported,
first forward result, first backward result (each includes the steps before it), and whether
TileLang was imported (not when every kernel loaded by structure id: ``kernels/cache.py``).
"""

from __future__ import annotations

import argparse
import sys
import time

T0 = time.perf_counter()

import torch  # noqa: E402

t_torch = time.perf_counter() - T0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--gqa", type=int, default=1)
    a = ap.parse_args()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t_cuda = time.perf_counter() - T0
    import flashtile

    t_ft = time.perf_counter() - T0
    dt = getattr(torch, a.dtype)
    h = 16
    q = torch.randn(2, 1000, h, a.headdim, device="cuda", dtype=dt, requires_grad=True)
    k, v = (torch.randn(2, 1000, h // a.gqa, a.headdim, device="cuda", dtype=dt, requires_grad=True) for _ in range(2))
    out = flashtile.flash_attn_func(q, k, v, causal=a.causal)
    torch.cuda.synchronize()
    t_fwd = time.perf_counter() - T0
    out.sum().backward()
    torch.cuda.synchronize()
    t_bwd = time.perf_counter() - T0
    from flashtile.kernels import cache

    indexed = sum(isinstance(k, cache.IndexedKernel) for k in cache._kernels.values())
    print(f"d={a.headdim} {a.dtype} causal={a.causal} gqa={a.gqa}: torch {t_torch:.2f} s, cuda {t_cuda:.2f} s, "
          f"flashtile {t_ft:.2f} s, first forward {t_fwd:.2f} s, first backward {t_bwd:.2f} s "
          f"(forward alone {t_fwd - t_ft:.2f} s; kernels first used in process: {cache.total_builds()}, "
          f"{indexed} of them loaded by structure id; TileLang imported: {'tilelang' in sys.modules})", flush=True)


if __name__ == "__main__":
    main()
