"""Sustained-load test (issue 21): thousands of calls with random shapes and options, interleaved
across the entry points, each checked against the CPU reference; memory must not grow.

    python3 benchmarks/soak.py --seconds 60 [--seed 0]

Entry points, picked at random per call: ``flash_attn_func`` forward + backward (random GQA
ratio, causal / window / full, sinks, softcap, Sq != Sk), ``flash_attn_varlen_func`` forward +
backward (random packings including empty sequences), ``flash_attn_with_kvcache`` (contiguous
or paged with a random page size, 1-4 new tokens appended); each with ``attention_chunk`` in
about a quarter of the calls.  Shapes are odd and small (the CPU
reference runs every call in float32), head dims 64 and 128 and dtype bf16, so the kernels are
the handful the device sessions already build: the load, not compilation, is what is tested.

Check per call (the benchmark's rule, ``flashtile.bench.TOLERANCES``): max |out - ref| <= 0.02 *
max |ref| (+1e-3), 0.05 for gradients (bf16); the cache contents after an append equal the
reference's up to bf16 rounding.  Memory: allocated bytes
after the warm-up and at the end must agree within 64 MiB.  Exit status 1 on any mismatch,
exception or growth; the last line is a summary.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import flashtile
from flashtile.bench import TOLERANCES

DT = torch.bfloat16
TOL_OUT, TOL_GRAD = TOLERANCES[DT]


def close(got, want, tol, floor=1e-3) -> bool:
    want = want.float()
    scale = want.abs().max().item() if want.numel() else 0.0
    return got.numel() == 0 or (got.float().cpu() - want).abs().max().item() <= tol * scale + floor


def _chunk(rng: random.Random) -> int:
    """attention_chunk for a call: 0 (off) in three calls of four, else a size around the lengths."""
    return rng.choice([0, 0, 0, rng.choice([16, 64, 100])])


def dense_case(rng: random.Random):
    b, hkv = rng.choice([1, 2, 3]), rng.choice([1, 2])
    h = hkv * rng.choice([1, 2, 4])
    sq, sk = rng.choice([1, 17, 64, 129, 300]), rng.choice([1, 17, 64, 129, 300])
    d = rng.choice([64, 128])
    mask = rng.choice(["full", "causal", "window"])
    kw = dict(causal=mask == "causal", window_size=(rng.randint(0, 40), rng.randint(0, 40)) if mask == "window" else (-1, -1),
              softcap=rng.choice([0.0, 0.0, 20.0]), attention_chunk=_chunk(rng))
    q, k, v = (torch.randn(b, s, n, d) for s, n in ((sq, h), (sk, hkv), (sk, hkv)))
    sinks = torch.randn(h) if rng.random() < 0.3 else None
    dout = torch.randn(b, sq, h, d)

    def run(device, dtype):
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        s = sinks.to(device).requires_grad_() if sinks is not None else None
        out = flashtile.flash_attn_func(*leaves, sinks=s, **kw)
        grads = torch.autograd.grad(out, leaves + ([s] if s is not None else []), dout.to(device, dtype))
        return [out.detach(), *[g.detach() for g in grads]]

    return (f"dense b{b} h{h}/{hkv} sq{sq} sk{sk} d{d} {mask} sinks={sinks is not None} cap={kw['softcap']} "
            f"chunk={kw['attention_chunk']}", run)


def varlen_case(rng: random.Random):
    n = rng.randint(1, 5)
    lq = [rng.choice([0, 1, 17, 100, 257]) for _ in range(n)]
    lk = [x if rng.random() < 0.5 else rng.choice([1, 17, 100, 257]) for x in lq]
    hkv, d = rng.choice([1, 2]), rng.choice([64, 128])
    h = hkv * rng.choice([1, 4])
    causal = rng.random() < 0.5
    chunk = _chunk(rng)
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0).tolist()), dtype=torch.int32)  # noqa: E731
    cq, ck = cu(lq), cu(lk)
    q, k, v = torch.randn(sum(lq), h, d), torch.randn(sum(lk), hkv, d), torch.randn(sum(lk), hkv, d)
    dout = torch.randn(sum(lq), h, d)

    def run(device, dtype):
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        out = flashtile.flash_attn_varlen_func(*leaves, cq.to(device), ck.to(device), max(lq), max(lk), causal=causal,
                                               attention_chunk=chunk)
        if out.numel() == 0:
            return [out.detach()]
        grads = torch.autograd.grad(out, leaves, dout.to(device, dtype))
        return [out.detach(), *[g.detach() for g in grads]]

    return f"varlen q{lq} k{lk} h{h}/{hkv} d{d} causal={causal} chunk={chunk}", run


def kvcache_case(rng: random.Random):
    b, hkv, d = rng.choice([1, 3, 5]), rng.choice([1, 2]), rng.choice([64, 128])
    h = hkv * rng.choice([1, 4, 8])
    sq = rng.choice([1, 1, 2, 4])
    page = rng.choice([None, 1, 16, 64, 256])
    lengths = torch.tensor([rng.randint(0, 700) for _ in range(b)], dtype=torch.int32)
    capacity = 1024
    if page is None:
        kc, vc = torch.randn(b, capacity, hkv, d), torch.randn(b, capacity, hkv, d)
        table = None
    else:
        per = capacity // page
        kc, vc = torch.randn(b * per, page, hkv, d), torch.randn(b * per, page, hkv, d)
        table = torch.randperm(b * per, dtype=torch.int32).view(b, per)
    q, knew, vnew = torch.randn(b, sq, h, d), torch.randn(b, sq, hkv, d), torch.randn(b, sq, hkv, d)
    chunk = _chunk(rng)

    def run(device, dtype):
        kcd, vcd = kc.to(device, dtype), vc.to(device, dtype)
        out = flashtile.flash_attn_with_kvcache(
            q.to(device, dtype), kcd, vcd, k=knew.to(device, dtype), v=vnew.to(device, dtype),
            cache_seqlens=lengths.to(device), block_table=table.to(device) if table is not None else None, causal=True,
            attention_chunk=chunk)
        return [out, kcd, vcd]

    return f"kvcache b{b} h{h}/{hkv} d{d} sq{sq} page={page} lengths={lengths.tolist()} chunk={chunk}", run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (bf16 reference vs fp32)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    makers = [dense_case, varlen_case, kvcache_case]
    counts = {m.__name__: 0 for m in makers}
    failures, calls, mem0, t_end = 0, 0, None, None
    t0 = time.time()
    while True:
        if calls == 60:  # warm-up over (every structure built, allocator settled): memory baseline
            sync()
            mem0, t_end = allocated(), time.time() + args.seconds
        if t_end is not None and time.time() > t_end:
            break
        maker = rng.choice(makers)
        name, run = maker(rng)
        try:
            got = run(args.device, DT)
            want = run("cpu", torch.float32)
            tols = [TOL_OUT] + [TOL_GRAD] * (len(want) - 1)
            if maker is dense_case and len(want) == 5:
                tols[4] = 2 * TOL_GRAD  # dsinks: one sum over every row of a head, with cancellation
            if maker is kvcache_case:
                tols = [TOL_OUT, 0.01, 0.01]  # the caches: bf16 rounding of the fp32 contents
            floors = [1e-3] * len(want)
            if maker is dense_case and len(want) == 5:
                floors[4] = 0.05  # dsinks of a few rows is small: bf16 rounding of dO.O shows
            bad = [i for i, (g, w, t, f) in enumerate(zip(got, want, tols, floors)) if not close(g, w, t, f)]
            if bad:
                failures += 1
                print(f"MISMATCH {name}: outputs {bad}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and keep loading
            failures += 1
            print(f"ERROR {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        calls += 1
        counts[maker.__name__] += 1
    sync()
    grew = allocated() - (mem0 or 0)
    ok = failures == 0 and grew < 64 * 2**20
    print(f"soak: {calls} calls in {time.time() - t0:.0f}s ({counts}), {failures} failures, "
          f"allocated memory change after warm-up {grew / 2**20:+.1f} MiB, "
          f"peak reserved {torch.cuda.max_memory_reserved() / 2**20 if cuda else 0:.0f} MiB: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
