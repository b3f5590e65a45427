"""Build kernels ahead of time (no GPU needed): ``python -m flashtile.kernels.precompile``.

Compiled kernels land in TileLang's disk cache (``$TILELANG_CACHE_DIR``, default
``~/.tilelang/cache``), so a later process on a Hopper machine with the same TileLang and CUDA
versions loads them instead of compiling (about 7 s per kernel otherwise).

    python -m flashtile.kernels.precompile                      # every structure of the table
    python -m flashtile.kernels.precompile --headdim 128 --dtype bfloat16 --features plain
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import time

from . import configs

FEATURES = {"plain": (False, False), "sinks": (True, False), "softcap": (False, True), "both": (True, True)}


# bwd-lse: the backward when lse gets a gradient; the "v" passes: packed (varlen) batches;
# fwd8: the FP8 forward (float8_e4m3fn q, k, v; ``--dtype`` is then the output's dtype);
# decode: the KV-cache split-KV decode kernel, its combine kernel and the append kernels;
# decode-fp8: the same over a float8_e4m3fn cache; fwd-ring / bwd-ring / vbwd-ring: the dense
# and packed kernels as ring attention's steps run them, beside the transfers
# (``configs.sharing_sms``).
PASSES = ("fwd", "bwd", "bwd-det", "bwd-lse", "vfwd", "vbwd", "vbwd-det", "vbwd-lse", "fwd8", "vfwd8", "decode",
          "decode-fp8", "fwd-ring", "bwd-ring", "vbwd-ring")


def structures(headdims, dtypes, features, passes=PASSES):
    """Yield (pass, kwargs) for every requested static structure (user head dims are mapped to
    the kernel head dims that serve them, ``configs.kernel_headdim``)."""
    for (d, dv), dtype, feat, p in itertools.product(headdims, dtypes, features, passes):
        varlen = p.startswith("v")
        ring = p.endswith("-ring")
        base = p.removeprefix("v").removesuffix("-ring")
        dim, dim_v = configs.kernel_headdims(d, dv, base if base in ("fwd", "fwd8") else "bwd")
        has_sinks, has_softcap = FEATURES[feat]
        if p.startswith("decode"):  # the decode kernel serves user head dims as they are
            kw = dict(dim=d, dim_v=dv, dtype=dtype, has_sinks=has_sinks, has_softcap=has_softcap)
            yield p, kw if p == "decode" else {**kw, "cache_dtype": "float8_e4m3fn"}
        elif base == "fwd":
            kw = dict(dim=dim, dim_v=dim_v, dtype=dtype, has_sinks=has_sinks, has_softcap=has_softcap, varlen=varlen,
                      **({"share_sms": True} if ring else {}))
            yield p, kw
            if configs.has_short_row(dim, dim_v, varlen):  # the short-sequence row too
                yield p, {**kw, "short": True}
        elif base == "fwd8":
            kw = dict(dim=dim, dim_v=dim_v, dtype="float8_e4m3fn", has_sinks=has_sinks, has_softcap=has_softcap,
                      varlen=varlen, out_dtype=dtype)
            yield p, kw
            if configs.has_short_row(dim, dim_v, varlen, fp8=True):  # the short-sequence row too
                yield p, {**kw, "short": True}
        elif not has_sinks:  # sinks do not change the backward kernels
            yield p, dict(
                dim=dim, dim_v=dim_v, dtype=dtype, has_softcap=has_softcap, has_dlse=base == "bwd-lse",
                deterministic=base == "bwd-det", varlen=varlen, **({"share_sms": True} if ring else {}),
            )


def build(p: str, kwargs: dict) -> str:
    from .decode import get_decode_kernels
    from .launch import backward_kernels, forward_kernel

    t = time.time()
    if p.startswith("decode"):  # the decode kernels and the KV-cache append kernels
        from .append import get_append_kernels

        get_decode_kernels(**kwargs)
        if kwargs.get("cache_dtype"):  # FP8: every schedule (``decode_schedule``'s rows, segments, pages)
            get_decode_kernels(**kwargs, rows=1 << 30)
            get_decode_kernels(**kwargs, many_segments=True)
            get_decode_kernels(**kwargs, small_pages=True)
        else:  # 16-bit: long streams or many segments on decode_ws (``decode_kernel`` where it does not apply)
            get_decode_kernels(**kwargs, ws16=True)
            get_decode_kernels(**kwargs, ws16=True, many_segments=True)
        get_append_kernels(kwargs["dim"], kwargs["dim_v"], kwargs["dtype"], kwargs.get("cache_dtype"))
    elif "fwd8" in p:  # the FP8 forward and its V^T pre-pass
        from .transpose_v import get_kernel

        forward_kernel(**kwargs)
        get_kernel(kwargs["dim_v"], kwargs["varlen"])
    else:
        forward_kernel(**kwargs) if "fwd" in p else backward_kernels(**kwargs)
    return f"{p:8s} {kwargs} {time.time() - t:.1f}s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--headdim", nargs="*", default=None, help="e.g. 128 or 192/128 (default: the table's)")
    ap.add_argument("--dtype", nargs="*", default=["bfloat16", "float16"])
    ap.add_argument("--features", nargs="*", default=list(FEATURES), choices=list(FEATURES))
    ap.add_argument("--passes", nargs="*", default=list(PASSES[:4]), choices=list(PASSES))
    ap.add_argument("--jobs", type=int, default=1, help="parallel compile processes (each fills the disk cache)")
    args = ap.parse_args(argv)
    if args.headdim:
        dims = [tuple(int(x) for x in (h.split("/") * 2)[:2]) for h in args.headdim]
    else:
        dims = sorted({(d, dv) for d, dv, _, _ in configs.all_structures()})
    t0 = time.time()
    todo = list(structures(dims, args.dtype, args.features, args.passes))
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # Spawned, not forked: forking a process with torch and TileLang threads running can
        # deadlock the child.  Lines print as builds finish, so one slow build (a kernel whose
        # nvcc time blew up, 2026-11-22) cannot hide the others.
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for done in as_completed([pool.submit(build, p, kw) for p, kw in todo]):
                print(done.result(), flush=True)
    else:
        for p, kw in todo:
            print(build(p, kw), flush=True)
    print(f"done in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
