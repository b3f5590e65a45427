"""Context-parallel benchmark: flashtile ring attention against PyTorch's context_parallel.

    torchrun --nproc_per_node=2 -m flashtile.distributed.bench --seqlens 32768,131072 --out cp
    torchrun --nproc_per_node=2 -m flashtile.distributed.bench --device cpu --seqlens 256 --out cp

For every total sequence length (split over the ranks, zigzag layout), causal, bf16, d=128,
32 heads, batch 1 by default:
- flashtile ring: "flashtile.distributed.ring_flash_attn_func" forward, and forward+backward;
- torch CP: "torch.distributed.tensor.experimental.context_parallel" over cuDNN SDPA (its
  head-tail load balancer, the same chunks as zigzag; rotate method from "--rotate"), or the
  reason it could not run;
- T1: single-GPU flashtile (and cuDNN SDPA) on the full sequence, when it fits; above
  "--single-max" (or for lengths "--t1-from"'s earlier report lacks), T1 is extrapolated from
  the longest measured length by the FLOP ratio and marked so ("t1_extrapolated_from"): a
  1M-token causal step takes about a minute on one H200;
- scaling efficiency "T1 / (N * TN)" per implementation.
Timing: fresh random inputs; warm-up steps, then every step timed alone between a barrier and
"torch.cuda.synchronize" with CUDA events ("time.perf_counter" on CPU); a step's time is the
slowest rank's; the median over "--iters" steps is reported.
Numerics (at "--check-seqlen", default the smallest length): the ring's output and gradients,
gathered, against a float32 reference on the full sequence, with flash-attn's rule: error at
most 2x (output) / 3x (gradients) single-GPU flashtile's error + 1e-5.
Results: "cp.json" and "cp.md" under "--out" (rank 0); "--profile" also saves one ring
step as a chrome trace per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def _size(tok: str) -> int:
    t = tok.strip().lower()
    mult = 1024 if t.endswith("k") else 1
    return int(t[:-1] if mult > 1 else t) * mult


def _sizes(text: str) -> list[int]:
    return [_size(t) for t in text.split(",") if t.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqlens", type=_sizes, default=[32768, 131072], help="total sequence lengths, comma separated (32k,128k)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="full attention (default causal)")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda when available")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--rotate", choices=("allgather", "alltoall"), default="allgather", help="torch CP's kv rotation")
    p.add_argument("--check-seqlen", type=_size, default=None, help="numerics check length (default: smallest of --seqlens; 0: off)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip torch context_parallel")
    p.add_argument("--no-single", dest="single", action="store_false", help="skip the single-GPU T1 runs")
    p.add_argument("--single-max", type=_size, default=None,
                   help="measure T1 only up to this total length; longer ones extrapolate it (FLOP ratio)")
    p.add_argument("--t1-from", default=None, help="an earlier cp.json (same config) whose T1 runs extrapolation may use")
    p.add_argument("--watchdog-s", type=float, default=0,
                   help="after this many seconds, print every rank's Python stacks and exit (debugging a hang)")
    p.add_argument("--profile", action="store_true", help="save one ring step per rank as a chrome trace")
    p.add_argument("--out", default="cp-results", help="directory for cp.json / cp.md (/ traces)")


# --- process group -----------------------------------------------------------------------------


def _init(device: str) -> tuple[int, int, torch.device]:
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if "WORLD_SIZE" not in os.environ:  # plain `python -m`: a group of one
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        elif device == "cuda":
            dist.init_process_group(backend, device_id=dev)
        else:
            dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), dev


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def cuda_ms(step) -> float:
    """One ``step()`` timed with CUDA events on the current stream, in ms (after it ends)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _time(step, dev: torch.device, warmup: int, iters: int) -> float:
    """Median over ``iters`` of the slowest rank's time of one ``step()``, in ms."""
    for _ in range(warmup):
        step()
    _sync(dev)
    times = []
    for _ in range(iters):
        dist.barrier()
        _sync(dev)
        if dev.type == "cuda":
            times.append(cuda_ms(step))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(times, dtype=torch.float64, device=dev if dev.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def _agree(ok: bool, dev: torch.device) -> bool:
    """True when every rank says ok (keeps ranks in step after a local failure)."""
    t = torch.tensor([0 if ok else 1], device=dev if dev.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return int(t.item()) == 0


def _reason(exc: BaseException) -> str:
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


# --- inputs ------------------------------------------------------------------------------------


def _full_inputs(args, seqlen: int, dev: torch.device, dtype: torch.dtype, seed: int):
    """The full-sequence q, k, v, dout (BSHD), identical on every rank (seeded)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    hkv = args.kv_heads or args.heads

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype)

    return (
        randn(args.batch, seqlen, args.heads, args.headdim),
        randn(args.batch, seqlen, hkv, args.headdim),
        randn(args.batch, seqlen, hkv, args.headdim),
        randn(args.batch, seqlen, args.heads, args.headdim),
    )


def _leaf(x):
    return x.detach().clone().requires_grad_()


# --- the runs ----------------------------------------------------------------------------------


def _ring_steps(args, q, k, v, dout):
    from .ring_attention import ring_flash_attn_func

    def fwd():
        return ring_flash_attn_func(q, k, v, causal=args.causal, layout=args.layout)

    def fwdbwd():
        q.grad = k.grad = v.grad = None
        fwd().backward(dout)

    return fwd, fwdbwd


def _single_steps(args, q, k, v, dout, backend: str):
    from ..interface import flash_attn_func

    if backend == "flashtile":
        def fwd():
            return flash_attn_func(q, k, v, causal=args.causal)
    else:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        gqa = dict(enable_gqa=True) if kt.shape[1] != qt.shape[1] else {}

        def fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal, **gqa).transpose(1, 2)

    def fwdbwd():
        q.grad = k.grad = v.grad = None
        fwd().backward(dout)

    return fwd, fwdbwd


@contextlib.contextmanager
def _torch_cp(args, inputs, world: int, dev: torch.device):
    """Yields (fwd, fwdbwd) running torch's context_parallel over cuDNN SDPA on ``inputs()``'s
    full-sequence tensors (made here, so that none of them outlives its (B, H, S, D) copy)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        from torch.distributed.tensor.experimental._attention import set_rotate_method
    except ImportError:  # older layouts of the private module
        set_rotate_method = None
    if dev.type != "cuda":
        raise RuntimeError("not measured on CPU (torch CP is run over cuDNN SDPA, a CUDA backend)")
    if set_rotate_method is not None:
        set_rotate_method(args.rotate)
    mesh = init_device_mesh("cuda", (world,))
    bufs = [x.transpose(1, 2).contiguous() for x in inputs()]  # (B, H, S, D); sharded in place below
    torch.cuda.empty_cache()
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4, no_restore_buffers=set(bufs)):
        q, k, v = (_leaf(x) for x in bufs[:3])
        dout = bufs[3]
        gqa = dict(enable_gqa=True) if k.shape[1] != q.shape[1] else {}

        def fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal, **gqa)

        def fwdbwd():
            q.grad = k.grad = v.grad = None
            fwd().backward(dout)

        yield fwd, fwdbwd


def _flops(args, seqlen: int, mode: str) -> int:
    from ..flops import attention_flops

    return attention_flops(args.batch, args.heads, seqlen, seqlen, args.headdim, args.headdim, causal=args.causal, mode=mode)


def _progress(rank: int, what: str) -> None:
    """Rank 0's progress on stderr (a 1M-token step takes about 16 s on four H200s)."""
    if rank == 0:
        print(f"[flashtile cp {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def _measure(name, make, dev, args, rank, record) -> None:
    """Time fwd and fwd+bwd of ``make()`` -> (fwd, fwdbwd); failures become reasons."""
    try:
        fwd, fwdbwd = make()
        ok, reason = True, None
    except Exception as exc:  # noqa: BLE001 - reported
        ok, reason = False, _reason(exc)
    if not _agree(ok, dev):
        record[name] = {"status": reason or "failed on another rank"}
        return
    try:
        _progress(rank, f"{record['seqlen']} {name}: forward")
        with torch.no_grad():
            t_f = _time(fwd, dev, args.warmup, args.iters)
        _progress(rank, f"{record['seqlen']} {name}: forward + backward")
        t_fb = _time(fwdbwd, dev, args.warmup, args.iters)
        record[name] = {"status": "ok", "fwd_ms": t_f, "fwdbwd_ms": t_fb}
    except Exception as exc:  # noqa: BLE001
        record[name] = {"status": _reason(exc)}
        if rank == 0:
            traceback.print_exc()
    _agree(True, dev)


def _extrapolate(args, name: str, seqlen: int, measured: list[dict]) -> dict:
    """T1 of ``name`` at ``seqlen`` from the longest measured length, scaled by the FLOP ratio.

    At these lengths the kernels run at a flat rate (H200 T1, 64k-256k causal d=128: 533-539
    TFLOP/s), so the ratio of FLOPs is the ratio of times."""
    runs = [r for r in measured if r.get(name, {}).get("status") == "ok" and "t1_extrapolated_from" not in r[name]]
    if not runs:
        return {"status": "not measured (no shorter T1 run to extrapolate from)"}
    base = max(runs, key=lambda r: r["seqlen"])
    out = {"status": "ok", "t1_extrapolated_from": base["seqlen"]}
    for mode in ("fwd", "fwdbwd"):
        out[f"{mode}_ms"] = base[name][f"{mode}_ms"] * _flops(args, seqlen, mode) / _flops(args, base["seqlen"], mode)
    return out


def _bench_seqlen(args, seqlen: int, rank: int, world: int, dev: torch.device, dtype: torch.dtype, measured: list[dict]) -> dict:
    from .zigzag import shard

    rec: dict = {"seqlen": seqlen, "seqlen_local": seqlen // world}

    def inputs():  # the same seeded tensors each time; each run holds only what it needs (1M: 8.6 GB a tensor)
        return _full_inputs(args, seqlen, dev, dtype, seed=seqlen)

    q, k, v, dout = (shard(x, world, rank, layout=args.layout) for x in inputs())  # copies
    q, k, v = (_leaf(x) for x in (q, k, v))

    _measure("ring", lambda: _ring_steps(args, q, k, v, dout), dev, args, rank, rec)
    if rec["ring"]["status"] == "ok":
        from .transport import chosen

        rec["ring"]["transport"] = chosen() or "gloo"
    if args.profile and rec["ring"]["status"] == "ok":
        _, step = _ring_steps(args, q, k, v, dout)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        dist.barrier()
        with torch.profiler.profile(activities=acts) as prof:
            step()
            _sync(dev)
        path = os.path.join(args.out, f"trace_ring_{seqlen}_rank{rank}.json")
        prof.export_chrome_trace(path)
        rec.setdefault("traces", []).append(path)
    del q, k, v, dout
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if args.baseline:
        try:
            with _torch_cp(args, inputs, world, dev) as (fwd, fwdbwd):
                _measure("torch_cp", lambda: (fwd, fwdbwd), dev, args, rank, rec)
                if args.layout == "zigzag" and rec["torch_cp"]["status"] == "ok":
                    rec["torch_cp"]["rotate"] = args.rotate
        except Exception as exc:  # noqa: BLE001 - unavailable: say why
            rec["torch_cp"] = {"status": f"unavailable: {_reason(exc)}"}
        _agree(True, dev)
    if args.single and args.single_max is not None and seqlen > args.single_max:
        for name in ("single_flashtile", "single_cudnn"):
            rec[name] = _extrapolate(args, name, seqlen, measured)
    elif args.single:
        for name, backend in (("single_flashtile", "flashtile"), ("single_cudnn", "cudnn")):
            if backend == "cudnn" and dev.type != "cuda":
                rec[name] = {"status": "not measured on CPU"}
                continue
            full = inputs()
            ql, kl, vl = (_leaf(x) for x in full[:3])
            _measure(name, lambda: _single_steps(args, ql, kl, vl, full[3], backend), dev, args, rank, rec)
            del ql, kl, vl, full
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    for mode in ("fwd", "fwdbwd"):
        flops = _flops(args, seqlen, mode)
        for name, r in list(rec.items()):
            if isinstance(r, dict) and r.get("status") == "ok":
                n = 1 if name.startswith("single") else world
                r[f"{mode}_tflops_per_gpu"] = flops / (n * r[f"{mode}_ms"] * 1e-3) / 1e12
    for impl, single in (("ring", "single_flashtile"), ("torch_cp", "single_cudnn")):
        a, b = rec.get(impl, {}), rec.get(single, {})
        if a.get("status") == "ok" and b.get("status") == "ok":
            a["scaling_efficiency"] = b["fwdbwd_ms"] / (world * a["fwdbwd_ms"])
            a["fwd_scaling_efficiency"] = b["fwd_ms"] / (world * a["fwd_ms"])
    r, t = rec.get("ring", {}), rec.get("torch_cp", {})
    if r.get("status") == "ok" and t.get("status") == "ok":
        rec["ring_speedup_vs_torch_cp"] = t["fwdbwd_ms"] / r["fwdbwd_ms"]
    return rec


def _check(args, seqlen: int, rank: int, world: int, dev: torch.device, dtype: torch.dtype) -> dict:
    """flash-attn's rule on the full sequence: ring vs single-GPU flashtile vs float32 reference."""
    from .. import reference
    from ..interface import flash_attn_func
    from .ring_attention import ring_flash_attn_func
    from .zigzag import shard, unshard_gather

    q, k, v, dout = _full_inputs(args, seqlen, dev, dtype, seed=seqlen + 1)
    scale = 1.0 / math.sqrt(args.headdim)
    window = (-1, 0) if args.causal else (-1, -1)
    with torch.no_grad():
        f32 = [x.float() for x in (q, k, v, dout)]
        out32, lse32 = reference.attention_forward(*f32[:3], scale, window, chunk=256)
        ref = (out32,) + reference.attention_backward(f32[3], *f32[:3], out32, lse32, scale, window, chunk=256)[:3]
        del f32, lse32
    leaves = [_leaf(x) for x in (q, k, v)]
    out = flash_attn_func(*leaves, causal=args.causal)
    out.backward(dout)
    single = (out.detach(),) + tuple(x.grad for x in leaves)
    del leaves, out
    mine = [_leaf(shard(x, world, rank, layout=args.layout)) for x in (q, k, v)]
    out = ring_flash_attn_func(*mine, causal=args.causal, layout=args.layout)
    out.backward(shard(dout, world, rank, layout=args.layout))
    ring = tuple(unshard_gather(x.detach(), layout=args.layout) for x in (out, *(m.grad for m in mine)))
    res = {"seqlen": seqlen, "rule": "err(ring) <= 2x (out) / 3x (grads) err(single-GPU flashtile) + 1e-5, max abs vs float32 reference"}
    ok = True
    for name, factor, r32, s, g in zip(("out", "dq", "dk", "dv"), (2, 3, 3, 3), ref, single, ring):
        e_single = (s.float() - r32).abs().max().item()
        e_ring = (g.float() - r32).abs().max().item()
        bound = factor * e_single + 1e-5
        res[name] = {"err_ring": e_ring, "err_single": e_single, "bound": bound, "pass": e_ring <= bound}
        ok &= e_ring <= bound
    res["pass"] = ok
    return res


# --- report ------------------------------------------------------------------------------------


def _short_status(r: dict) -> str:
    """Table cell for a run that has no time: 'unavailable', 'oom', ... (details in cp.json)."""
    return str(r.get("status", "-")).split(":")[0]


def _fmt(r: dict, key: str, spec: str = ".2f") -> str:
    if not isinstance(r, dict):
        return "-"
    if r.get("status") != "ok":
        return _short_status(r)
    mark = "~" if "t1_extrapolated_from" in r else ""
    return mark + format(r[key], spec) if key in r else "-"


def _markdown(report: dict) -> str:
    c = report["config"]
    lines = [
        f"# Context parallelism: flashtile ring attention vs torch context_parallel ({report['device']}, {c['world']} ranks)",
        "",
        f"{c['dtype']}, batch {c['batch']}, {c['heads']} heads ({c['kv_heads']} kv), d={c['headdim']}, "
        f"{'causal' if c['causal'] else 'full'}, layout {c['layout']}; median of {c['iters']} steps after {c['warmup']} "
        f"warm-up, slowest rank; torch {report['torch']}; {report['date']}.",
        "",
        "Ring transport: " + (", ".join(sorted({r["ring"]["transport"] for r in report["results"] if "transport" in r.get("ring", {})}))
                              or "-") + " (flashtile.distributed.transport).",
        "",
        "Forward + backward, ms per step (TFLOP/s per GPU):",
        "",
        "| total seqlen | flashtile ring | torch CP (cuDNN) | ring speed vs torch CP | T1 flashtile | T1 cuDNN | efficiency ring T1/(N*TN) | efficiency torch CP |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for rec in report["results"]:
        def cell(name):
            r = rec.get(name, {"status": "-"})
            if r.get("status") != "ok":
                return _short_status(r)
            tf = r["fwdbwd_tflops_per_gpu"]
            mark = "~" if "t1_extrapolated_from" in r else ""
            return f"{mark}{r['fwdbwd_ms']:.2f} ({tf:.0f})" if tf >= 10 else f"{mark}{r['fwdbwd_ms']:.2f} ({tf:.2g})"

        sp = rec.get("ring_speedup_vs_torch_cp")
        lines.append(
            f"| {rec['seqlen']} | {cell('ring')} | {cell('torch_cp')} | {f'{sp:.2f}x' if sp else '-'} | "
            f"{cell('single_flashtile')} | {cell('single_cudnn')} | {_fmt(rec.get('ring', {}), 'scaling_efficiency')} | "
            f"{_fmt(rec.get('torch_cp', {}), 'scaling_efficiency')} |"
        )
    lines += ["", "Forward only, ms:", "", "| total seqlen | flashtile ring | torch CP (cuDNN) | T1 flashtile | T1 cuDNN | efficiency ring | efficiency torch CP |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for rec in report["results"]:
        lines.append(
            f"| {rec['seqlen']} | " + " | ".join(_fmt(rec.get(n, {}), "fwd_ms") for n in ("ring", "torch_cp", "single_flashtile", "single_cudnn"))
            + " | " + " | ".join(_fmt(rec.get(n, {}), "fwd_scaling_efficiency") for n in ("ring", "torch_cp")) + " |"
        )
    extra = sorted({r["t1_extrapolated_from"] for rec in report["results"] for r in rec.values()
                    if isinstance(r, dict) and "t1_extrapolated_from" in r})
    if extra:
        src = f" (T1 runs of {report['t1_from']})" if report.get("t1_from") else ""
        lines += ["", f"~ T1 extrapolated by the FLOP ratio from the {', '.join(map(str, extra))}-token run{src}, not measured; "
                  "the efficiencies on those rows use it."]
    notes = sorted({f"{name}: {r['status']}" for rec in report["results"] for name, r in rec.items()
                    if isinstance(r, dict) and r.get("status") not in (None, "ok")})
    if notes:
        lines += ["", "Not measured:", ""] + [f"- {n}" for n in notes]
    chk = report.get("check")
    if report.get("check_error"):
        lines += ["", f"Numerics check failed to run: {report['check_error']}"]
    if chk:
        lines += ["", f"Numerics at seqlen {chk['seqlen']} ({chk['rule']}): **{'pass' if chk['pass'] else 'FAIL'}**", "",
                  "| tensor | err ring | err single-GPU flashtile | bound | pass |", "| --- | ---: | ---: | ---: | --- |"]
        for name in ("out", "dq", "dk", "dv"):
            r = chk[name]
            lines.append(f"| {name} | {r['err_ring']:.3e} | {r['err_single']:.3e} | {r['bound']:.3e} | {r['pass']} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("WORLD_SIZE", "1")))))
    rank, world, dev = _init(device)
    if args.watchdog_s:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    dtype = DTYPES[args.dtype]
    os.makedirs(args.out, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "world": world, "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads or args.heads,
            "headdim": args.headdim, "dtype": args.dtype, "causal": args.causal, "layout": args.layout,
            "warmup": args.warmup, "iters": args.iters, "rotate": args.rotate, "device_type": dev.type,
        },
        "results": [],
    }
    status = 0
    earlier = []  # T1 runs of an earlier report with this config, for extrapolation
    if args.t1_from:
        with open(args.t1_from) as f:
            prev = json.load(f)
        same = {k: v for k, v in prev["config"].items() if k not in ("world", "warmup", "iters", "rotate")}
        mine = {k: v for k, v in report["config"].items() if k in same}
        if same != mine:
            raise SystemExit(f"--t1-from {args.t1_from}: config {same} differs from this run's {mine}")
        earlier = prev["results"]
        report["t1_from"] = args.t1_from
    for seqlen in args.seqlens:
        if seqlen % (2 * world if args.layout == "zigzag" else world):
            raise SystemExit(f"seqlen {seqlen} must be a multiple of {2 * world} for {args.layout} over {world} ranks")
        rec = _bench_seqlen(args, seqlen, rank, world, dev, dtype, earlier + report["results"])
        report["results"].append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    check_len = min(args.seqlens) if args.check_seqlen is None else args.check_seqlen
    if check_len:
        try:
            report["check"] = _check(args, check_len, rank, world, dev, dtype)
            status |= 0 if report["check"]["pass"] else 1
        except Exception as exc:  # noqa: BLE001
            report["check"] = None
            report["check_error"] = _reason(exc)
            status = 1
            if rank == 0:
                traceback.print_exc()
    if rank == 0:
        with open(os.path.join(args.out, "cp.json"), "w") as f:
            json.dump(report, f, indent=2)
        md = _markdown(report)
        with open(os.path.join(args.out, "cp.md"), "w") as f:
            f.write(md)
        print(md, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashtile.distributed.bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
