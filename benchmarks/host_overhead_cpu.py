"""Host (Python) time per call of the public entry points, on a CPU-only machine.

    python3 benchmarks/host_overhead_cpu.py [--profile NAME] [--n 2000] [--rows SUBSTRING]

The CUDA path's Python runs end to end on CPU tensors with the GPU parts stubbed out, so the
figures are the host time that ``benchmarks/launch_overhead.py`` measures on the device, minus
TileLang's adapter and the tvm-ffi call (~16 us on an H100 host, not reproducible here) and
with CPU allocations in place of the CUDA caching allocator's.

How the CUDA path is reached from CPU tensors (``install_stubs``; only this script does it):

- the entry points' device dispatch sends CPU tensors to ``flashtile.reference``; its
  functions are replaced by adapters that call the CUDA launchers (``flashtile.kernels.forward``
  / ``backward`` / ``varlen_*`` and ``kernels.decode.launch_decode``) with the same tensors;
- ``target.capability`` answers sm_90 and ``target.sm_count`` 132;
- ``cache._build`` returns a no-op kernel (so ``cache.get``'s lookup still runs), kernels
  tagged in the disk cache are not loaded by id, and the prebuilt bundle is not installed;
- checks that read tensor contents and run on CPU only (varlen's ``cu_seqlens`` checks, the KV
  cache's length checks) are switched off, as they are on CUDA by default;
- ``torch.cuda.is_current_stream_capturing`` answers False (the CPU wheel raises).

Cost differences kept: the CPU branch's ``torch.no_grad()`` around the reference call (~1 us),
and one extra adapter frame per launcher call.  ``--profile NAME`` prints cProfile's top
entries for the row whose name contains NAME.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the checkout's flashtile

import flashtile  # noqa: E402
from flashtile import eager_plans, kvcache, ops, reference, varlen  # noqa: E402
from flashtile import kernels as K  # noqa: E402
from flashtile.kernels import cache, launch, prebuilt, target  # noqa: E402

# The varlen reference has no max_seqlen arguments (the CUDA launcher needs them): the rows set
# the values of their inputs here.
_VARLEN_MAX = {"q": 0, "k": 0}


def _noop_kernel(*args):
    return None


def install_stubs() -> None:
    """Route the CPU path of every entry point into the CUDA launchers with no-op kernels."""
    from flashtile.kernels import decode

    target.capability = lambda device: (9, 0)
    K._capability = target.capability  # bound by name in kernels/__init__
    target.sm_count = lambda device: 132
    cache._build = lambda builder, name, kwargs, static: _noop_kernel
    cache._load_indexed = lambda sid, what: None  # not this machine's compiled kernels (they take CUDA tensors)
    prebuilt.install = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    varlen.content_checks_enabled = lambda device: False
    kvcache._check_lengths = lambda *a: None
    kvcache._readable = lambda t: False
    eager_plans.planned_device = lambda q: True  # flash_attn_func's repeated calls run their plans

    def fwd(q, k, v, softmax_scale, window=(-1, -1), sinks=None, softcap=0.0):
        return K.forward(q, k, v, sinks, softmax_scale, window, softcap)

    def bwd(dout, q, k, v, out, lse, softmax_scale, window=(-1, -1), sinks=None, softcap=0.0, dlse=None):
        return K.backward(dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window, softcap, False)

    def vfwd(q, k, v, cu_q, cu_k, softmax_scale, window=(-1, -1), sinks=None, softcap=0.0, seqused_q=None,
             seqused_k=None):
        return K.varlen_forward(q, k, v, cu_q, cu_k, seqused_q, seqused_k, _VARLEN_MAX["q"], _VARLEN_MAX["k"],
                                sinks, softmax_scale, window, softcap)

    def vbwd(dout, q, k, v, out, lse, cu_q, cu_k, softmax_scale, window=(-1, -1), sinks=None, softcap=0.0,
             dlse=None, seqused_q=None, seqused_k=None):
        return K.varlen_backward(dout, dlse, q, k, v, out, lse, cu_q, cu_k, seqused_q, seqused_k, _VARLEN_MAX["q"],
                                 _VARLEN_MAX["k"], sinks, softmax_scale, window, softcap, False)

    def kv(q, k_cache, v_cache, seqlens_k, softmax_scale, window=(-1, -1), sinks=None, softcap=0.0,
           cache_batch_idx=None, cache_leftpad=None, block_table=None, k_descale=None, v_descale=None):
        return decode.launch_decode(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table, sinks,
                                    softmax_scale, window, softcap, 0, k_descale, v_descale)

    reference.attention_forward = fwd
    reference.attention_backward = bwd
    reference.varlen_attention_forward = vfwd
    reference.varlen_attention_backward = vbwd
    reference.kvcache_attention = kv


class _Floor(torch.autograd.Function):
    """The least a Python autograd.Function with flash_attn_func's outputs costs: (out, lse)
    allocations, q, k, v saved, three gradients allocated, no kernels (the autograd floor; also
    ``launch_overhead.py``'s on the device)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q), q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def per_call_us(fn, n: int, rounds: int = 30) -> float:
    """The fastest of ``rounds`` rounds of ``n // 10`` calls, mean time per call, after a
    warm-up.  The lower envelope, not a median: this machine's neighbours slow whole rounds by
    up to 2x at random (twenty-first session), so a median of a few long rounds moved +-30%
    between runs of one tree."""
    for _ in range(max(20, n // 10)):
        fn()
    per = max(1, n // 10)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(per):
            fn()
        times.append((time.perf_counter() - t) / per * 1e6)
    return min(times)


def rows():
    """(name, fn) per measured layer, outermost last in each group."""
    from flashtile.kernels.decode import launch_decode

    b, s, h, d = 1, 128, 4, 64
    bf = torch.bfloat16
    q, k, v = (torch.randn(b, s, h, d, dtype=bf) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s)
    dout = torch.randn_like(q)
    scale = 1 / math.sqrt(d)
    kernel = launch.forward_kernel(d, d, "bfloat16", False, False)

    def fwd_bwd():
        o = flashtile.flash_attn_func(qg, kg, vg)
        torch.autograd.grad(o, (qg, kg, vg), dout)

    def floor_fwd_bwd():  # the autograd engine's own cost for a 3-input, 2-output node
        o, _ = _Floor.apply(qg, kg, vg)
        torch.autograd.grad(o, (qg, kg, vg), dout)

    # varlen: 2 sequences of 48 and 80 tokens (unequal: equal lengths take the dense kernels,
    # ``kernels.equal_lengths``)
    tq = torch.randn(s, h, d, dtype=bf)
    tk, tv = torch.randn(s, h, d, dtype=bf), torch.randn(s, h, d, dtype=bf)
    tqg, tkg, tvg = (x.clone().requires_grad_() for x in (tq, tk, tv))
    cu = torch.tensor([0, 48, 128], dtype=torch.int32)
    _VARLEN_MAX.update(q=80, k=80)
    tdout = torch.randn_like(tq)

    def varlen_fwd_bwd():
        o = flashtile.flash_attn_varlen_func(tqg, tkg, tvg, cu, cu, 80, 80)
        torch.autograd.grad(o, (tqg, tkg, tvg), tdout)

    # decode: B=1, one token, 32/8 heads, d=128, a 1k-key cache (as launch_overhead.py)
    qd = torch.randn(1, 1, 32, 128, dtype=bf)
    kc, vc = (torch.randn(1, 1024 + 64, 8, 128, dtype=bf) for _ in range(2))
    kn, vn = (torch.randn(1, 1, 8, 128, dtype=bf) for _ in range(2))
    lens = torch.full((1,), 1024, dtype=torch.int32)

    return [
        ("alloc: torch.empty x2 (CPU allocation floor)", lambda: (torch.empty_like(q), torch.empty(b, h, s))),
        ("fwd: stub kernel call", lambda: kernel(q, k, v, out, lse, None, 0.18, 0.0, 1 << 30, 1 << 30)),
        ("fwd: launch.launch_forward", lambda: launch.launch_forward(q, k, v, None, scale, (-1, -1), 0.0)),
        ("fwd: kernels.forward (+checks, _prepare)", lambda: K.forward(q, k, v, None, scale, (-1, -1), 0.0)),
        ("fwd: ops.attention", lambda: ops.attention(q, k, v, None, scale, -1, -1, 0.0, False)),
        ("fwd: flash_attn_func, no grad", lambda: flashtile.flash_attn_func(q, k, v)),  # a recorded plan (eager_plans)
        # the same call through the general path: a window given as a list is never planned
        ("fwd: flash_attn_func, no grad, general path", lambda: flashtile.flash_attn_func(q, k, v, window_size=[-1, -1])),
        ("fwd: flash_attn_func, requires_grad", lambda: flashtile.flash_attn_func(qg, kg, vg)),
        ("fwd+bwd: floor, empty autograd.Function + grad", floor_fwd_bwd),
        ("fwd+bwd: kernels.backward", lambda: K.backward(dout, None, q, k, v, out, lse, None, scale, (-1, -1), 0.0, False)),
        ("fwd+bwd: flash_attn_func + backward", fwd_bwd),
        ("varlen: kernels.varlen_forward", lambda: K.varlen_forward(tq, tk, tv, cu, cu, None, None, 80, 80, None, scale, (-1, -1), 0.0)),
        ("varlen: flash_attn_varlen_func, no grad", lambda: flashtile.flash_attn_varlen_func(tq, tk, tv, cu, cu, 80, 80)),
        ("varlen: flash_attn_varlen_func + backward", varlen_fwd_bwd),
        ("decode: launch_decode", lambda: launch_decode(qd, kc, vc, lens, None, None, None, None, 0.088, (-1, 0), 0.0)),
        ("decode: flash_attn_with_kvcache, no new tokens", lambda: flashtile.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, causal=True)),
        ("decode: flash_attn_with_kvcache, append 1 token", lambda: flashtile.flash_attn_with_kvcache(qd, kc, vc, k=kn, v=vn, cache_seqlens=lens, causal=True)),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="calls per timing")
    ap.add_argument("--rows", default="", help="only rows whose name contains this")
    ap.add_argument("--profile", default=None, help="cProfile the row whose name contains this")
    args = ap.parse_args()
    torch.set_num_threads(1)
    install_stubs()
    table = rows()
    print(f"CPU host time per call (GPU parts stubbed), torch {torch.__version__}")
    failed = 0
    for name, fn in table:
        if args.rows not in name:
            continue
        try:
            print(f"{per_call_us(fn, args.n):9.1f} us  {name}", flush=True)
        except Exception as e:  # a measurement tool: report, go on, and exit non-zero
            failed += 1
            print(f"   failed  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if args.profile:
        name, fn = next((r for r in table if args.profile in r[0]))
        for _ in range(50):
            fn()
        print(f"--- profile: {name}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.n):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
