"""Where the host time of one small attention call goes (developer tool, run on the device).

    python3 benchmarks/launch_overhead.py [--profile] [--trace]

Times, per call, on a tiny input where the GPU work is a few microseconds, so the figure is
host time: each layer from ``flash_attn_func`` down to TileLang's compiled host function.
``benchmarks/host_overhead_cpu.py`` measures the same layers' Python on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import flashtile
from flashtile.kernels import debug
from flashtile.kernels import launch as fwd
from flashtile.kernels import backward as kernels_backward
from flashtile.kernels import forward as kernels_forward
from host_overhead_cpu import _Floor  # the autograd floor (this script's directory is on sys.path)


def per_call_us(fn, n=400):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def pieces(qd, kc, vc, lens, qg, kg, vg, dout):
    """Rows that split the decode launcher and the autograd path into parts (each part alone).
    The kernels' arguments are those of one real ``launch_decode`` call, recorded by a plan
    whose kernels keep their arguments instead of launching."""
    from flashtile.kernels import decode

    call = (qd, kc, vc, lens, None, None, None, None, 0.088, (-1, 0), 0.0)
    plan = decode.decode_plan(qd, kc, vc, None, False, 0.088, (-1, 0), 0.0, 0)
    recorded = {}
    recorder = plan._replace(decode=lambda *a: recorded.__setitem__("decode", a),
                             combine=plan.combine and (lambda *a: recorded.__setitem__("combine", a)))
    real_plan, decode.decode_plan = decode.decode_plan, lambda *a, **k: recorder
    try:
        decode.launch_decode(*call)
    finally:
        decode.decode_plan = real_plan
    b, sq, h, d = qd.shape
    hkv, dv = kc.shape[2], vc.shape[-1]
    dev = qd.device
    out, lse = torch.empty(b, sq, h, dv, device=dev, dtype=qd.dtype), torch.empty(b, h, sq, device=dev)
    rows = [
        ("decode piece: 4 allocations (out, lse, partials)", lambda: (
            torch.empty(b, sq, h, dv, device=dev, dtype=qd.dtype), torch.empty(b, h, sq, device=dev),
            torch.empty(max(plan.rows_total, 1), dv, device=dev), torch.empty(max(plan.rows_total, 1), device=dev))),
        ("decode piece: decode_plan (memo hit)", lambda: decode.decode_plan(qd, kc, vc, None, False, 0.088, (-1, 0),
                                                                           0.0, 0)),
        ("decode piece: 5 views", lambda: (qd.view(-1, d), kc.view(-1, hkv, d), vc.view(-1, hkv, dv),
                                           out.view(-1, dv), lse.view(-1))),
        ("decode piece: decode kernel call (21 args)", lambda: plan.decode(*recorded["decode"])),
    ]
    if plan.combine is not None:
        rows.append(("decode piece: combine kernel call (10 args)", lambda: plan.combine(*recorded["combine"])))
    rows += [
        ("autograd floor: empty Function fwd + grad (CUDA)", lambda: torch.autograd.grad(
            _Floor.apply(qg, kg, vg)[0], (qg, kg, vg), dout)),
        ("autograd floor: empty Function fwd only", lambda: _Floor.apply(qg, kg, vg)),
    ]
    return rows


class _CallsBackward(torch.autograd.Function):
    """An empty forward whose backward runs ``kernels.backward`` on saved forward results: the
    backward launchers on the autograd engine's device thread (``--attribute``)."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse):
        ctx.save_for_backward(q, k, v, out, lse)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, _ = kernels_backward(dout, None, q, k, v, out, lse, None, 0.125, (-1, -1), 0.0, False)
        return dq, dk, dv, None, None


def attribute(qg, kg, vg, dout, out_fwd, lse_fwd, n=400):
    """Where ``flash_attn_func + backward``'s host time goes: per call, the whole step, the time
    inside ``_EagerAttention.backward`` and inside ``kernels.backward`` (timers wrapped around
    them), and two controls (an empty Function; one whose backward only calls the launchers)."""
    from flashtile import ops
    import flashtile.kernels as kernels_mod

    spent = {"Function.backward": 0.0, "kernels.backward": 0.0, "_bwd_impl": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t
        return wrapper

    orig_bwd, orig_k, orig_impl = ops._EagerAttention.backward, kernels_mod.backward, ops._bwd_impl
    ops._EagerAttention.backward = staticmethod(timed("Function.backward", orig_bwd))
    kernels_mod.backward = timed("kernels.backward", orig_k)
    ops._bwd_impl = timed("_bwd_impl", orig_impl)
    try:
        step = lambda: torch.autograd.grad(flashtile.flash_attn_func(qg, kg, vg), (qg, kg, vg), dout)
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        for key in spent:
            spent[key] = 0.0
        total = per_call_us(step, n)
        # per_call_us warms up 20 calls first: n + 20 calls were timed by the wrappers
        print(f"--- attribute: flash_attn_func + backward {total:.1f} us per call")
        for key, v in spent.items():
            print(f"    {v / (n + 20) * 1e6:8.1f} us  inside {key}")
    finally:
        ops._EagerAttention.backward, kernels_mod.backward, ops._bwd_impl = orig_bwd, orig_k, orig_impl
    # The same steps with the autograd engine's device threads off (backward on the calling
    # thread): how much of each step is the hand-over to the engine's CUDA thread.
    steps = {
        "flash_attn_func + backward": lambda: torch.autograd.grad(flashtile.flash_attn_func(qg, kg, vg), (qg, kg, vg), dout),
        "torch SDPA (flash backend) + backward": lambda: torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
            qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2)), (qg, kg, vg), dout.transpose(1, 2)),
        "empty Function fwd + grad": lambda: torch.autograd.grad(_Floor.apply(qg, kg, vg)[0], (qg, kg, vg), dout),
    }
    for name, fn in steps.items():
        on = per_call_us(fn, n)
        with torch.autograd.set_multithreading_enabled(False):
            off = per_call_us(fn, n)
        print(f"    {on:8.1f} us -> {off:8.1f} us with multithreaded backward off: {name}")
    ctl = lambda: torch.autograd.grad(_CallsBackward.apply(qg, kg, vg, out_fwd, lse_fwd), (qg, kg, vg), dout)
    print(f"    {per_call_us(ctl, n):8.1f} us  control: empty forward, backward = kernels.backward only")
    print(f"    {per_call_us(lambda: kernels_backward(dout, None, qg.detach(), kg.detach(), vg.detach(), out_fwd, lse_fwd, None, 0.125, (-1, -1), 0.0, False), n):8.1f} us  control: kernels.backward on the main thread")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true", help="cProfile of the Python layers")
    ap.add_argument("--attribute", action="store_true",
                    help="timers inside the eager backward path (where fwd + backward's host time goes)")
    ap.add_argument("--trace", action="store_true",
                    help="torch.profiler per call: the ATen ops and CUDA kernels each call launches")
    args = ap.parse_args()
    b, s, h, d = 1, 128, 4, 64
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kernel = fwd.forward_kernel(d, d, "bfloat16", False, False)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda")
    sinks = debug.dummy_sinks(h, q.device)
    scalars = (0.18, 0.0, 1 << 30, 1 << 30, 1)  # score scale, cap_in, window, head group
    args_ = (q, k, v, out, lse, sinks, *scalars)
    # A kernel loaded by structure id (``cache.IndexedKernel``) is the tvm-ffi executable
    # itself, with no TileLang adapter around it; a freshly built one has the adapter.
    adapter = getattr(kernel, "adapter", None)
    exe = adapter._get_executable() if adapter is not None else kernel.torch_function
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    cu = torch.tensor([0, 64, 128], dtype=torch.int32, device="cuda")
    out_fwd, lse_fwd = kernels_forward(q, k, v, None, 0.125, (-1, -1), 0.0)
    rows = [
        ("torch.empty x2 (allocation floor)", lambda: (torch.empty_like(q), torch.empty(b, h, s, device="cuda"))),
        ("tvm-ffi executable(*args)", lambda: exe(*args_)),
        ("kernel(*args) (direct: cache._direct_calls)", lambda: kernel(*args_)),
        *([("kernel.adapter.func(*args) (TileLang adapter)", lambda: adapter.func(*args_))] if adapter is not None else []),
        ("launch_forward", lambda: fwd.launch_forward(q, k, v, None, 0.125, (-1, -1), 0.0)),
        ("kernels.forward (+checks, _prepare)", lambda: kernels_forward(q, k, v, None, 0.125, (-1, -1), 0.0)),
        ("flash_attn_func, no grad", lambda: flashtile.flash_attn_func(q, k, v)),  # a recorded plan (eager_plans)
        # the same call through the general path: a window given as a list is never planned
        ("flash_attn_func, no grad, general path", lambda: flashtile.flash_attn_func(q, k, v, window_size=[-1, -1])),
        ("flash_attn_func, requires_grad", lambda: flashtile.flash_attn_func(qg, kg, vg)),
        ("flash_attn_func + backward (autograd.grad)", lambda: torch.autograd.grad(flashtile.flash_attn_func(qg, kg, vg), (qg, kg, vg), dout)),
        ("kernels.backward (launchers only)", lambda: kernels_backward(dout, None, q, k, v, out_fwd, lse_fwd, None, 0.125, (-1, -1), 0.0, False)),
        ("flash_attn_varlen_func, no grad (2 x 64 tokens)", lambda: flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 64, 64)),
        ("torch SDPA (flash backend), no grad", lambda: torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))),
        ("torch SDPA (flash backend) + backward", lambda: torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
            qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2)), (qg, kg, vg), dout.transpose(1, 2))),
    ]
    # decode: B=1, one token, 32/8 heads, d=128, a 1k-key cache (GPU work a few us)
    qd = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(1, 1024 + 64, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kn, vn = (torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
    from flashtile.kernels.decode import launch_decode

    rows += [
        ("launch_decode (kernels only)", lambda: launch_decode(qd, kc, vc, lens, None, None, None, None, 0.088, (-1, 0), 0.0)),
        ("flash_attn_with_kvcache, no new tokens", lambda: flashtile.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, causal=True)),
        ("flash_attn_with_kvcache, append 1 token", lambda: flashtile.flash_attn_with_kvcache(qd, kc, vc, k=kn, v=vn, cache_seqlens=lens, causal=True)),
        ("torch SDPA (cuDNN), decode", lambda: torch.nn.functional.scaled_dot_product_attention(
            qd.transpose(1, 2), kc[:, :1024].transpose(1, 2), vc[:, :1024].transpose(1, 2), enable_gqa=True)),
    ]
    rows += pieces(qd, kc, vc, lens, qg, kg, vg, dout)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    for name, fn in rows:
        try:
            print(f"{per_call_us(fn):9.1f} us  {name}", flush=True)
        except Exception as e:  # report and keep going: this is a measurement tool
            print(f"   failed  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    named = dict(rows)
    if args.attribute:
        attribute(qg, kg, vg, dout, out_fwd, lse_fwd)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        for name in ("flash_attn_func + backward (autograd.grad)", "kernels.backward (launchers only)",
                     "flash_attn_varlen_func, no grad (2 x 64 tokens)",
                     "launch_decode (kernels only)", "flash_attn_with_kvcache, no new tokens",
                     "flash_attn_with_kvcache, append 1 token"):
            fn = named[name]
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            print(f"--- trace: {name} (20 calls)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    if args.profile:
        for name in ("flash_attn_func, no grad", "flash_attn_func, requires_grad", "kernels.backward (launchers only)",
                     "flash_attn_varlen_func, no grad (2 x 64 tokens)",
                     "launch_decode (kernels only)", "flash_attn_with_kvcache, no new tokens", "flash_attn_with_kvcache, append 1 token"):
            print(f"--- profile: {name}")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                named[name]()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
