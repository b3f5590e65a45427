"""Does compute-sanitizer's initcheck see memory written by TMA (cp.async.bulk) stores?

flashtile's forward kernels write their outputs through TMA stores; under initcheck, PyTorch
kernels that later read those outputs are reported as reading uninitialized memory, although a
NaN-poisoned warm-up proves every element written (benchmarks/sanitize.sh).  This probe
separates the two explanations with two tiny kernels that copy A -> shared -> B, one storing B
through TMA (``T.copy(shared, global)``, which TileLang lowers to ``tma_store`` on Hopper) and
one with plain vectorised stores, then reads B with a PyTorch kernel (``B.float()``) and checks
that B == A:

    python3 benchmarks/initcheck_probe.py --build            # no GPU: compile both (disk cache)
    compute-sanitizer --tool initcheck python3 benchmarks/initcheck_probe.py tma
    compute-sanitizer --tool initcheck python3 benchmarks/initcheck_probe.py plain
    compute-sanitizer --tool initcheck python3 benchmarks/initcheck_probe.py tma-tilelang-read

If initcheck reports the ``tma`` run's read and not the ``plain`` one while both print
``B == A``, the reports are an initcheck blind spot for TMA stores, not an unwritten output.
``tma-tilelang-read`` reads the TMA-stored B with a TileLang kernel (plain loads, into C) instead
of PyTorch: reports there are attributed to a flashtile-style ``main_kernel``, as when the
backward reads the forward's TMA-stored O and lse.
"""

from __future__ import annotations

import argparse
import sys

import tilelang
import tilelang.language as T

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from flashtile.kernels.target import PASS_CONFIGS, TARGET  # noqa: E402

ROWS, COLS = 256, 64


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def copy_kernel(tma: bool, tma_load: bool = True):
    """B = A through shared memory; ``tma``: B stored by TMA, else plain stores; ``tma_load``:
    A loaded by TMA, else plain loads (the loads initcheck checks)."""
    dtype = "bfloat16"

    @T.prim_func
    def main(A: T.Tensor([ROWS, COLS], dtype), B: T.Tensor([ROWS, COLS], dtype)):
        with T.Kernel(ROWS // 64, threads=128) as bx:
            s = T.alloc_shared([64, COLS], dtype)
            if tma_load:
                T.copy(A[bx * 64, 0], s)
            else:
                for i, j in T.Parallel(64, COLS):
                    s[i, j] = A[bx * 64 + i, j]
            if tma:
                T.copy(s, B[bx * 64, 0])  # tma_store
            else:
                for i, j in T.Parallel(64, COLS):
                    B[bx * 64 + i, j] = s[i, j]

    return main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", nargs="?", choices=["tma", "plain", "tma-tilelang-read"])
    ap.add_argument("--build", action="store_true", help="compile both kernels and show their store instructions")
    args = ap.parse_args(argv)
    if args.build:
        for tma, tma_load in ((True, True), (False, True), (False, False)):
            src = copy_kernel(tma, tma_load).get_kernel_source()
            print(f"tma={tma} tma_load={tma_load}: tma_store in source: {'tma_store' in src}, tma_load: {'tma_load' in src}")
        return 0
    import torch

    a = torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)  # uninitialized (run with PYTORCH_NO_CUDA_MEMORY_CACHING=1)
    copy_kernel(args.store != "plain")(a, b)
    if args.store == "tma-tilelang-read":
        c = torch.empty_like(a)
        copy_kernel(False, tma_load=False)(b, c)  # TileLang reads the TMA-stored b (plain loads), stores c plainly
        b = c
    same = torch.equal(b.float(), a.float())  # the PyTorch read initcheck judges
    print(f"{args.store}: B == A: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
