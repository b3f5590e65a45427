"""Small-shape cases over every kernel family, for ``benchmarks/sanitize.sh`` (compute-sanitizer).

    python3 benchmarks/sanitize_cases.py --precompile --jobs 14   # build the cases' kernels in parallel
    python3 benchmarks/sanitize_cases.py --check                  # warm-up: poisoned outputs, compared with the reference
    compute-sanitizer --tool memcheck python3 benchmarks/sanitize_cases.py --set all

Families: the dense forward (hand-written tile and persistent kernels, the auto-pipelined one
through ``configs.overrides``), the backward (preprocess, hand-written and auto dK/dV, the
deterministic dQ kernels, the lse-gradient preprocess), packed varlen batches with empty
sequences and ``seqused``, and KV-cache decode with a paged cache of page size 1 (the last two
only where ``flashtile`` has the entry point).  Shapes carry tails: seqlens 1, 17, 129; head
dims 64, 128, 256 and 192/128; GQA; causal, window, sinks, softcap; NaN/inf inputs once.

Every flashtile kernel launch is counted (the compiled kernels are wrapped where
``kernels.cache.get_static`` hands them out); the last line is ``cases: N, flashtile kernel launches: M``.
``--set race`` is the short list for racecheck (one shape per family).  Exit status: 0, or 1
when ``--check`` finds a mismatch or a case raises.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

import flashtile
from flashtile import reference
from flashtile.kernels import cache, configs

LAUNCHES = 0
DEVICE = "cuda"  # --device cpu: a smoke test of this driver on the reference path (no launches)

# (seqlen_q, seqlen_k): tails of a 64/128-row tile, q shorter and longer than k.
SHAPES = [(1, 1), (17, 17), (129, 129), (17, 129), (129, 17)]
RACE_SHAPES = [(129, 129)]


@dataclass(frozen=True)
class Case:
    name: str
    d: int = 128
    dv: int | None = None
    h: int = 4
    hkv: int = 4
    b: int = 2
    causal: bool = False
    window: tuple = (-1, -1)
    sinks: bool = False
    softcap: float = 0.0
    deterministic: bool = False
    lse_grad: bool = False
    dtype: torch.dtype = torch.bfloat16
    override: str | None = None  # "auto-fwd": the auto-pipelined forward through configs.overrides
    fp8_cache: bool = False  # kvcache: a float8_e4m3fn cache with k/v descales
    shapes: tuple = tuple(SHAPES)
    race_shapes: tuple = tuple(RACE_SHAPES)  # racecheck's (the slow tool) shapes
    kind: str = "dense"  # "dense", "varlen", "kvcache", "nonfinite", "fp8" (forward only; extra["varlen"]: packed)
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def d_v(self) -> int:
        return self.dv or self.d


CASES = [
    Case("d64 mha", d=64),
    Case("d64 gqa4 causal sinks det lse", d=64, h=8, hkv=2, causal=True, sinks=True, deterministic=True, lse_grad=True),
    Case("d128 gqa2 window", d=128, h=4, hkv=2, window=(16, 0)),
    Case("d128 causal det sinks", d=128, causal=True, sinks=True, deterministic=True),
    Case("d128 softcap causal fp16", d=128, causal=True, softcap=20.0, dtype=torch.float16),
    Case("d128 softcap window det", d=128, h=4, hkv=1, window=(8, 8), softcap=30.0, deterministic=True),
    Case("d256 causal sinks", d=256, h=2, hkv=2, causal=True, sinks=True),
    Case("d256 window det", d=256, h=2, hkv=1, window=(32, 4), deterministic=True),
    Case("d192/128 softcap det", d=192, dv=128, h=2, hkv=2, softcap=15.0, deterministic=True),
    Case("d192/128 causal lse", d=192, dv=128, h=2, hkv=1, causal=True, lse_grad=True),
    Case("auto fwd d128 causal", d=128, causal=True, override="auto-fwd"),
    Case("varlen d128 gqa2 causal sinks", d=128, h=4, hkv=2, causal=True, sinks=True, kind="varlen"),
    Case("varlen d64 window seqused det", d=64, window=(8, 0), deterministic=True, kind="varlen", extra={"seqused": True}),
    # d <= 96: the dK/dV kernel's dQ turns (ds_full mbarriers); full mask: the key-tail row select
    Case("varlen d64 gqa2 turns", d=64, h=4, hkv=2, kind="varlen"),
    # More dK/dV key tiles than SMs (d <= 96): persistent CTAs walk 2-3 tiles each, through both
    # K/V buffers and the empty turn of odd tiles; racecheck too.
    Case("d64 persistent causal 288 tiles", d=64, h=16, hkv=16, causal=True, shapes=((1040, 1040),),
         race_shapes=((1040, 1040),)),
    Case("varlen d64 persistent 320 slots", d=64, h=16, hkv=16, kind="varlen", shapes=((2100, 1900),),
         race_shapes=((2100, 1900),)),
    Case("kvcache d128 gqa4 paged1", d=128, h=8, hkv=2, causal=True, kind="kvcache"),
    Case("kvcache d64 sinks window", d=64, h=4, hkv=4, window=(8, 0), sinks=True, kind="kvcache"),
    Case("kvcache d128 gqa4 paged1 fp8-cache", d=128, h=8, hkv=2, causal=True, kind="kvcache", fp8_cache=True),
    # page 16: TMA boxes of 16 rows, the last 64-key block's boxes past the table's last page
    Case("kvcache d128 gqa4 page16 fp8-cache", d=128, h=8, hkv=2, causal=True, kind="kvcache", fp8_cache=True,
         extra={"page": 16}),
    # the FP8-cache kernel (decode_ws): producer rows of 4 threads, sinks + softcap in fp16; MHA window
    Case("kvcache d192/128 mqa sinks softcap fp16 fp8-cache", d=192, dv=128, h=4, hkv=1, sinks=True, softcap=20.0,
         dtype=torch.float16, kind="kvcache", fp8_cache=True),
    Case("kvcache d64 mha window fp8-cache", d=64, h=4, hkv=4, window=(8, 0), kind="kvcache", fp8_cache=True),
    # 160 short segments on 132 SMs: persistent CTAs, several parts each (decode.worker_count)
    Case("kvcache d128 gqa4 persistent fp8-cache", d=128, h=16, hkv=4, b=40, causal=True, kind="kvcache",
         fp8_cache=True, extra={"page": 16}),
    # a 16-bit long stream (more than 256 blocks of 64 keys, pages of 64): decode_ws's mma.sync
    # consumers with TMA (decode.ws16_pays), the segment's last block past the table's last page
    Case("kvcache d128 gqa4 page64 long-stream", d=128, h=8, hkv=2, causal=True, kind="kvcache",
         shapes=((1, 16450),), race_shapes=((1, 16450),), extra={"page": 64}),
    # 136 short 16-bit segments: decode_ws's mma.sync consumers as workers of their own
    Case("kvcache d128 gqa4 page64 own-workers long-stream", d=128, h=16, hkv=4, b=34, causal=True, kind="kvcache",
         shapes=((1, 300),), race_shapes=((1, 300),), extra={"page": 64}),
    # 512 short segments: 256 own workers of 2 whole segments each, run in spread order
    # (schedule.spread_segment)
    Case("kvcache d128 gqa4 page64 own-workers spread", d=128, h=16, hkv=4, b=128, causal=True, kind="kvcache",
         shapes=((1, 300),), race_shapes=((1, 300),), extra={"page": 64}),
    Case("nonfinite d128 causal", d=128, causal=True, kind="nonfinite", shapes=((129, 129),)),
    Case("fp8 d128 gqa2 causal sinks", d=128, h=4, hkv=2, causal=True, sinks=True, kind="fp8"),
    Case("fp8 d256 window softcap", d=256, h=2, hkv=2, window=(16, 0), softcap=20.0, kind="fp8"),
    # Both lengths >= 4096: the d=128 FP8 forward's long row (192 x 96 tiles, three consumer warpgroups).
    Case("fp8 d128 long row gqa2 sinks softcap", d=128, h=2, hkv=1, b=1, sinks=True, softcap=20.0, kind="fp8",
         shapes=((4097, 4100),), race_shapes=((4096, 4096),)),
    Case("fp8 varlen d64 causal seqused", d=64, h=4, hkv=1, causal=True, kind="fp8", extra={"varlen": True, "seqused": True}),
]


def available(case: Case) -> bool:
    if case.kind == "varlen":
        return hasattr(flashtile, "flash_attn_varlen_func")
    if case.kind == "kvcache":
        return hasattr(flashtile, "flash_attn_with_kvcache")
    return True


# --- launch counting ----------------------------------------------------------------------------


class _Counted:
    def __init__(self, kernel):
        self._kernel = kernel

    def __call__(self, *args, **kwargs):
        global LAUNCHES
        LAUNCHES += 1
        return self._kernel(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._kernel, name)


def _count_launches():
    # Every kernel comes from ``cache.get_static`` (``cache.get`` and the launchers' memoised
    # structures both call it through the module); wrapping ``cache.get`` alone missed the
    # dense and packed launchers, which call get_static directly, and counted 0 launches for
    # them (the sanitizers still checked their kernels: they watch the whole process).
    get_static = cache.get_static

    def counting_get_static(*args, **kwargs):
        return _Counted(get_static(*args, **kwargs))

    cache.get_static = counting_get_static


# --- one case -----------------------------------------------------------------------------------


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _rand(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def _compare(what, got, want, tol, failures):
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if got.shape != want.shape:
        failures.append(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return
    both_inf = torch.isinf(got) & torch.isinf(want) & (torch.sign(got) == torch.sign(want))
    err = torch.where(both_inf, torch.zeros_like(got), (got - want).abs())
    err = err.nan_to_num(nan=float("inf")).max().item() if err.numel() else 0.0
    scale = max(1.0, want[torch.isfinite(want)].abs().max().item() if torch.isfinite(want).any() else 1.0)
    if err > tol * scale:
        failures.append(f"{what}: max abs error {err:.3g} > {tol * scale:.3g}")


def _tol(dtype):
    return 2e-2 if dtype == torch.bfloat16 else 4e-3


def run_dense(case: Case, sq: int, sk: int, check: bool, gen, failures):
    dev = DEVICE
    q = _rand(gen, case.b, sq, case.h, case.d, dtype=case.dtype, device=dev)
    k = _rand(gen, case.b, sk, case.hkv, case.d, dtype=case.dtype, device=dev)
    v = _rand(gen, case.b, sk, case.hkv, case.d_v, dtype=case.dtype, device=dev)
    sinks = _rand(gen, case.h, dtype=torch.float32, device=dev) if case.sinks else None
    if case.kind == "nonfinite":  # NaN in one query row, +inf in one key, -inf in one value
        q[0, sq // 2, 0, 0] = float("nan")
        k[0, 0, 0, 1] = float("inf")
        v[-1, sk - 1, -1, 2] = float("-inf")
    leaves = [t.requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sinks is not None else [])
    kw = dict(causal=case.causal, window_size=case.window, sinks=sinks, softcap=case.softcap,
              deterministic=case.deterministic, return_lse=True)
    old = dict(configs.overrides)
    if case.override == "auto-fwd":
        configs.overrides["fwd"] = configs.FwdConfig(block_m=128, block_n=128, num_stages=2, threads=256)
    try:
        out, lse = flashtile.flash_attn_func(q, k, v, **kw)
    finally:
        configs.overrides.clear()
        configs.overrides.update(old)
    dout = _rand(gen, *out.shape, dtype=case.dtype, device=dev)
    dlse = _rand(gen, *lse.shape, dtype=torch.float32, device=dev) if case.lse_grad else None
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:
        loss = loss + torch.where(lse.isfinite(), lse, 0.0).mul(dlse).sum()
    grads = torch.autograd.grad(loss, leaves)
    _sync()
    if case.kind == "nonfinite":
        sees = sq // 2  # row sq//2 sees keys (it is causal, bottom-right, sq == sk)
        if not bool(out[0, sees, 0].isnan().all()):
            failures.append("nonfinite: the query row with a NaN is not NaN")
        return
    if not check:
        return
    cpu = [t.detach().cpu().float() for t in leaves]
    scale = 1.0 / math.sqrt(case.d)
    left, right = case.window[0], 0 if case.causal else case.window[1]
    o_ref, l_ref = reference.attention_forward(*cpu[:3], scale, (left, right), cpu[3] if sinks is not None else None, case.softcap)
    g_ref = reference.attention_backward(
        dout.cpu().float(), *cpu[:3], o_ref, l_ref, scale, (left, right), cpu[3] if sinks is not None else None,
        case.softcap, dlse.cpu() if dlse is not None else None,
    )
    tol = _tol(case.dtype)
    _compare("out", out, o_ref, tol, failures)
    _compare("lse", lse, l_ref, tol, failures)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, g_ref):
        _compare(name, g, r, 3 * tol, failures)


def run_varlen(case: Case, sq: int, sk: int, check: bool, gen, failures):
    """A packed batch of five sequences: the case's (sq, sk), empty ones and length-1 ones."""
    dev = DEVICE
    lens_q = [sq, 0, 1, 17, 0]
    lens_k = [sk, 5, 0, 129, 0]
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    tq, tk = sum(lens_q), sum(lens_k)
    q = _rand(gen, tq, case.h, case.d, dtype=case.dtype, device=dev).requires_grad_()
    k = _rand(gen, tk, case.hkv, case.d, dtype=case.dtype, device=dev).requires_grad_()
    v = _rand(gen, tk, case.hkv, case.d_v, dtype=case.dtype, device=dev).requires_grad_()
    sinks = _rand(gen, case.h, dtype=torch.float32, device=dev).requires_grad_() if case.sinks else None
    used = {}
    if case.extra.get("seqused"):
        used = dict(seqused_q=torch.tensor([max(sq - 1, 0), 0, 1, 9, 0], dtype=torch.int32, device=dev),
                    seqused_k=torch.tensor([sk, 3, 0, 100, 0], dtype=torch.int32, device=dev))
    out, lse = flashtile.flash_attn_varlen_func(
        q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal=case.causal, window_size=case.window,
        softcap=case.softcap, deterministic=case.deterministic, sinks=sinks, return_lse=True, **used,
    )
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    dout = _rand(gen, *out.shape, dtype=case.dtype, device=dev)
    grads = torch.autograd.grad((out.float() * dout.float()).sum(), leaves)
    _sync()
    if not check:
        return
    ref_leaves = [t.detach().cpu().float().requires_grad_() for t in leaves]
    ref_sinks = ref_leaves[3] if sinks is not None else None
    ref = flashtile.flash_attn_varlen_func(
        *ref_leaves[:3], cu(lens_q).cpu(), cu(lens_k).cpu(), max(lens_q), max(lens_k),
        causal=case.causal, window_size=case.window, softcap=case.softcap, sinks=ref_sinks, return_lse=True,
        **{n: t.cpu() for n, t in used.items()},
    )
    ref_grads = torch.autograd.grad((ref[0] * dout.cpu().float()).sum(), ref_leaves)
    tol = _tol(case.dtype)
    _compare("varlen out", out, ref[0], tol, failures)
    _compare("varlen lse", lse, ref[1], tol, failures)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        _compare(f"varlen {name}", g, r, 3 * tol, failures)


def run_fp8(case: Case, sq: int, sk: int, check: bool, gen, failures):
    """The FP8 forward (V^T pre-pass + attention): dense, or packed with run_varlen's five
    sequences; checked against the CPU path on the same FP8 values (dequantize, exact), whose
    only difference is the kernel's P rounding to e4m3 (tolerance 0.1 of the largest output)."""
    from flashtile import fp8

    dev = DEVICE
    varlen = case.extra.get("varlen", False)
    kw = dict(causal=case.causal, window_size=case.window, softcap=case.softcap, return_lse=True)
    if varlen:
        lens_q, lens_k = [sq, 0, 1, 17, 0], [sk, 5, 0, 129, 0]
        cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
        shape_q, shape_k = (sum(lens_q), case.h, case.d), (sum(lens_k), case.hkv, case.d)
        shape_v = (sum(lens_k), case.hkv, case.d_v)
        layout = dict(layout="thd", cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k))
        if case.extra.get("seqused"):
            kw.update(seqused_q=torch.tensor([max(sq - 1, 0), 0, 1, 9, 0], dtype=torch.int32),
                      seqused_k=torch.tensor([sk, 3, 0, 100, 0], dtype=torch.int32))
        lead = (cu(lens_q), cu(lens_k), max(lens_q), max(lens_k))
        call = flashtile.flash_attn_varlen_func
    else:
        shape_q, shape_k, shape_v = (case.b, sq, case.h, case.d), (case.b, sk, case.hkv, case.d), (case.b, sk, case.hkv, case.d_v)
        layout, lead, call = {}, (), flashtile.flash_attn_func
    q, k, v = (_rand(gen, *shape, dtype=torch.float32, device="cpu") for shape in (shape_q, shape_k, shape_v))
    q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q, k, v, **layout)
    sinks = _rand(gen, case.h, dtype=torch.float32, device="cpu") if case.sinks else None

    def run(device):
        to = (lambda t: t if t is None or not isinstance(t, torch.Tensor) else t.to(device))  # noqa: E731
        opts = {n: to(t) for n, t in kw.items()}
        return call(*(to(t) for t in (q8, k8, v8)), *(to(t) for t in lead), sinks=to(sinks), q_descale=to(qd),
                    k_descale=to(kd), v_descale=to(vd), **opts)

    with torch.no_grad():
        out, lse = run(dev)
        _sync()
        if not check:
            return
        ref_out, ref_lse = run("cpu")
    _compare("fp8 out", out, ref_out, 0.1, failures)
    _compare("fp8 lse", lse, ref_lse, 1e-3, failures)


def run_kvcache(case: Case, sq: int, sk: int, check: bool, gen, failures):
    """Decode on a paged cache of page size ``extra["page"]`` (1 by default; a shuffled block
    table of exactly the pages each entry's ``sk + min(sq, 17)`` keys need, so a kernel that
    looks pages up past a sequence's last page reads past the table): (1) ``min(sq, 17)`` new
    tokens appended at ``cache_seqlens`` = (sk, sk - 1, ...) with the heuristic split count;
    (2) the same cache without new tokens, three splits (the combine kernel), left padding on
    entry 0 and an entry with no key at all.  Checked against the same calls on CPU copies."""
    dev = DEVICE
    sq = min(sq, 17)
    b = case.b
    page = case.extra.get("page", 1)
    pages = -(-(sk + sq) // page)  # per entry
    table = torch.randperm(b * pages, generator=gen).reshape(b, pages).to(torch.int32)
    k_cache = _rand(gen, b * pages, page, case.hkv, case.d, dtype=case.dtype, device="cpu")
    v_cache = _rand(gen, b * pages, page, case.hkv, case.d_v, dtype=case.dtype, device="cpu")
    q = _rand(gen, b, sq, case.h, case.d, dtype=case.dtype, device="cpu")
    k_new = _rand(gen, b, sq, case.hkv, case.d, dtype=case.dtype, device="cpu")
    v_new = _rand(gen, b, sq, case.hkv, case.d_v, dtype=case.dtype, device="cpu")
    lens = torch.tensor([sk] + [max(sk - 1, 0)] * (b - 1), dtype=torch.int32)
    sinks = _rand(gen, case.h, dtype=torch.float32, device="cpu") if case.sinks else None
    opts = dict(causal=case.causal, window_size=case.window, softcap=case.softcap, sinks=sinks, return_lse=True)
    if case.fp8_cache:  # FP8 bytes and descales drawn directly (their meaning: value = byte x descale)
        from flashtile.fp8 import saturate

        k_cache, v_cache = (saturate(c.float() * 16) for c in (k_cache, v_cache))
        opts["k_descale"] = 0.01 + torch.rand(b, case.hkv, generator=gen) * 0.02
        opts["v_descale"] = 0.01 + torch.rand(b, case.hkv, generator=gen) * 0.02
    lens2 = lens + sq
    lens2[-1] = 0
    pad = torch.zeros(b, dtype=torch.int32)
    pad[0] = min(3, int(lens2[0]))

    def calls(device, caches, dtype=None):
        kc, vc = caches

        def to(t):
            if t is None:
                return None
            return t.to(device, dtype) if dtype is not None and t.is_floating_point() else t.to(device)

        o1 = {n: to(t) if isinstance(t, torch.Tensor) else t for n, t in opts.items()}
        r1 = flashtile.flash_attn_with_kvcache(to(q), kc, vc, k=to(k_new), v=to(v_new), cache_seqlens=to(lens),
                                               block_table=to(table), num_splits=0, **o1)
        r2 = flashtile.flash_attn_with_kvcache(to(q), kc, vc, cache_seqlens=to(lens2), cache_leftpad=to(pad),
                                               block_table=to(table), num_splits=3, **o1)
        return r1, r2

    cpu_caches = (k_cache.clone(), v_cache.clone())
    got = calls(dev, (k_cache.to(dev), v_cache.to(dev)))
    _sync()
    if not check:
        return
    up = (lambda c: c) if case.fp8_cache else (lambda c: c.float())  # noqa: E731 - FP8 stays FP8 (dequantized there)
    want = calls("cpu", (up(cpu_caches[0]), up(cpu_caches[1])), torch.float32)  # the reference path
    for i, ((o, l), (ro, rl)) in enumerate(zip(got, want)):
        _compare(f"kvcache call {i + 1} out", o, ro, _tol(case.dtype), failures)
        _compare(f"kvcache call {i + 1} lse", l, rl, _tol(case.dtype), failures)


RUNNERS = {"dense": run_dense, "nonfinite": run_dense, "varlen": run_varlen, "kvcache": run_kvcache, "fp8": run_fp8}


# --- precompile ---------------------------------------------------------------------------------


def structures(cases):
    """(pass, kwargs) of the kernels the cases use ("fwd", "bwd", "decode"), for ``_build``
    (the auto-pipelined forward of the override case is built by the warm-up)."""
    from flashtile.kernels import target

    sms = target.sm_count(torch.device("cuda")) if torch.cuda.is_available() else 132
    seen = []
    for c in cases:
        dt = str(c.dtype).removeprefix("torch.")
        if c.kind == "kvcache":
            s = ("decode", dict(dim=c.d, dim_v=c.d_v, dtype=dt, has_sinks=c.sinks, has_softcap=c.softcap > 0,
                                **({"cache_dtype": "float8_e4m3fn"} if c.fp8_cache else {})))
            if s not in seen:
                seen.append(s)
            continue
        if c.override:
            continue
        if c.kind == "fp8":  # forward only; the kernel's output dtype is bf16
            varlen = c.extra.get("varlen", False)
            dp, dvp = configs.kernel_headdims(c.d, c.d_v, "fwd8")
            window = (-1, -1) if c.window == (-1, -1) and not c.causal else (0, 0)
            s = ("fwd8", dict(dim=dp, dim_v=dvp, dtype="float8_e4m3fn", has_sinks=c.sinks, has_softcap=c.softcap > 0,
                              window=window, varlen=varlen, num_sms=sms, out_dtype="bfloat16"))
            short = [("fwd8", {**s[1], "short": True})] if configs.has_short_row(dp, dvp, varlen, fp8=True) else []
            for s in [s, *short]:  # short: the d=128 FP8 forward's second kernel (the sanitizer's sizes take it)
                if s not in seen:
                    seen.append(s)
            continue
        # Kernels are compiled per mask kind (configs.mask_kind), not per window value.
        window = (-1, -1) if c.window == (-1, -1) and not c.causal else (0, 0)
        varlen = c.kind == "varlen"
        dp, dvp = configs.kernel_headdims(c.d, c.d_v, "fwd")
        fwd = dict(dim=dp, dim_v=dvp, dtype=dt, has_sinks=c.sinks, has_softcap=c.softcap > 0, window=window, varlen=varlen, num_sms=sms)
        dp, dvp = configs.kernel_headdims(c.d, c.d_v, "bwd")
        bwd = dict(dim=dp, dim_v=dvp, dtype=dt, has_softcap=c.softcap > 0, has_dlse=c.lse_grad,
                   deterministic=c.deterministic, window=window, varlen=varlen)
        short = [("fwd", {**fwd, "short": True})] if configs.has_short_row(dp, dvp, varlen) else []
        for s in [("fwd", fwd), *short, ("bwd", bwd)]:  # short: the d=64 forward's second kernel
            if s not in seen:
                seen.append(s)
    return seen


def _build(p, kwargs):
    from flashtile.kernels.precompile import build

    return "built " + build(p, kwargs)


def precompile(cases, jobs: int) -> int:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    todo = structures(cases)
    bad = 0
    with ProcessPoolExecutor(max(1, jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_build, p, kw): (p, kw) for p, kw in todo}
        for f in as_completed(futures):
            try:
                print(f.result(), flush=True)
            except Exception as e:  # the serial warm-up will build (and report) it again
                bad += 1
                print(f"precompile failed for {futures[f]}: {type(e).__name__}: {e}", flush=True)
    print(f"precompile: {len(todo)} structures, {bad} failed", flush=True)
    return 0


# --- main ---------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", choices=["all", "race"], default="all", help="race: one shape per family (racecheck)")
    ap.add_argument("--check", action="store_true", help="poison outputs and compare with the CPU reference")
    ap.add_argument("--precompile", action="store_true", help="only build the cases' kernels (parallel, disk cache)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("-k", default="", help="run only cases whose name contains this (alternatives split by '|')")
    ap.add_argument("--device", default=os.environ.get("SANITIZE_DEVICE", "cuda"),
                    help="cpu: smoke-test the driver on the reference path (env SANITIZE_DEVICE)")
    ap.add_argument("--list", action="store_true", help="print the cases and the kernel structures, run nothing")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device

    cases = [c for c in CASES if any(k in c.name for k in args.k.split("|")) and available(c)]
    skipped = [c.name for c in CASES if not available(c)]
    if skipped:
        print(f"not in this flashtile (skipped): {', '.join(skipped)}", flush=True)
    if args.list:
        for c in cases:
            print(f"case {c.name}: {c.kind}, shapes {list(c.shapes)}")
        for p, kw in structures(cases):
            print(f"structure {p} {kw}")
        return 0
    if args.precompile:
        return precompile(cases, args.jobs)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", flush=True)
        return 1
    if args.check:
        from flashtile.kernels import debug

        debug._poison = True  # unwritten output elements show up as NaN in the comparison
    _count_launches()
    gen = torch.Generator().manual_seed(0)
    n_cases = 0
    errors = []
    t0 = time.time()
    for case in cases:
        shapes = case.race_shapes if args.set == "race" and case.kind != "nonfinite" else case.shapes
        if args.set == "race" and case.kind == "nonfinite":
            continue
        for sq, sk in shapes:
            failures: list[str] = []
            before = LAUNCHES
            try:
                RUNNERS[case.kind](case, sq, sk, args.check, gen, failures)
            except Exception as e:
                failures.append(f"raised {type(e).__name__}: {e}")
                traceback.print_exc()
            n_cases += 1
            status = "ok" if not failures else "FAIL " + "; ".join(failures)
            print(f"case {case.name} sq={sq} sk={sk}: {LAUNCHES - before} launches, {status}", flush=True)
            if failures:
                errors.append(f"{case.name} sq={sq} sk={sk}: {'; '.join(failures)}")
    print(f"cases: {n_cases}, flashtile kernel launches: {LAUNCHES}, failed cases: {len(errors)}, {time.time() - t0:.0f}s", flush=True)
    for e in errors:
        print("FAILED", e, flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
