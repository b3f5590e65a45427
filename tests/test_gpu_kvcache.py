"""flash_attn_with_kvcache's CUDA kernels (split-KV decode + combine) against the reference,
with flash-attn's rule (marker ``gpu``; skipped without CUDA).

With ``ref32`` the CPU reference on the inputs upcast to float32 and ``ref_lp`` the CPU
reference on the low-precision inputs (output rounded to that precision):

    err(kernel, ref32) <= 2 * err(ref_lp, ref32) + 1e-5 * max(1, max|ref32|)    (out and lse)

lse is compared on finite entries and must be -inf exactly where ref32's is.  Outputs are
NaN-poisoned before the launch (``debug.poison``), and every cache position that is not part
of a sequence (past its length, before its left padding, unused pages) holds NaN and unused
block-table entries hold -1, so a kernel that reads or writes outside its range fails.  The caches after the call must equal the
reference's caches (the in-place append).  Inputs are fresh ``torch.randn`` draws.

One command: ``python -m pytest -q -m gpu tests/test_gpu_kvcache.py``.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.kernels import debug

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16


@dataclass(frozen=True)
class C:
    batch: int = 1
    length: int = 129  # keys of the longest entry after the append (others are shorter)
    sq: int = 1
    snew: int = 1
    page: int | None = None  # None = contiguous cache
    h: int = 8
    hkv: int = 2
    d: int = 128
    dv: int = 128
    dtype: torch.dtype = BF16
    splits: int = 0
    causal: bool = True
    window: tuple = (-1, -1)
    leftpad: bool = False
    sinks: bool = False
    softcap: float = 0.0
    rotary: str = ""  # "", "inter", "halves"
    batch_idx: bool = False
    fp8: bool = False  # a float8_e4m3fn cache with per-(entry, kv head) descales

    @property
    def id(self) -> str:
        parts = [
            "bf16" if self.dtype == BF16 else "fp16", f"b{self.batch}", f"L{self.length}", f"sq{self.sq}", f"new{self.snew}",
            "contig" if self.page is None else f"page{self.page}", f"h{self.h}-{self.hkv}", f"d{self.d}-{self.dv}",
            f"splits{self.splits}", "causal" if self.causal else "full",
        ]
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]},{self.window[1]}")
        parts += [x for x, on in (("leftpad", self.leftpad), ("sinks", self.sinks), ("bidx", self.batch_idx),
                                  ("fp8cache", self.fp8)) if on]
        if self.softcap:
            parts.append(f"cap{self.softcap}")
        if self.rotary:
            parts.append(f"rot-{self.rotary}")
        return "-".join(parts)


GRID = [
    # plain decode, every cache length, page size and split choice
    C(batch=1, length=1, splits=7),
    C(batch=1, length=17, page=1, splits=1),
    C(batch=3, length=129, page=16),
    C(batch=7, length=1000, page=64, splits=7),
    C(batch=1, length=8191, page=256),
    C(batch=3, length=8191, splits=1, h=32, hkv=8),
    C(batch=7, length=1000, h=8, hkv=1, causal=False),
    # several row-lookup chunks per CTA (2048 keys each at the default tiles), each chunk's
    # page-table loads issued together; a page size that is not a power of two
    C(batch=1, length=9000, page=16, splits=2, h=32, hkv=8),
    C(batch=2, length=5000, page=48, splits=1, h=32, hkv=8),
    # several query tokens (speculative decoding)
    C(batch=3, length=1000, sq=2, snew=2, page=16, h=32, hkv=8),
    C(batch=1, length=8191, sq=4, snew=4, h=32, hkv=8, splits=7),
    C(batch=7, length=129, sq=16, snew=16, page=64, h=8, hkv=1),
    C(batch=3, length=17, sq=4, snew=0, page=1, dtype=FP16),
    C(batch=1, length=1000, sq=40, snew=40, h=4, hkv=4, splits=1),  # more rows than one tile
    # mask features
    C(batch=3, length=1000, sq=4, snew=4, window=(64, -1), page=16),
    C(batch=7, length=8191, sq=2, snew=2, window=(100, -1), splits=7, h=32, hkv=8),
    C(batch=3, length=1000, sq=4, snew=1, causal=False, window=(50, 50), dtype=FP16),
    C(batch=3, length=1000, sq=4, snew=2, leftpad=True, page=64),
    C(batch=7, length=129, sq=1, leftpad=True, splits=7, batch_idx=True),
    C(batch=3, length=1000, sq=4, snew=4, sinks=True, splits=1),
    C(batch=3, length=8191, sq=1, sinks=True, splits=7, page=256, dtype=FP16),
    C(batch=1, length=1000, sq=2, snew=2, softcap=30.0, page=16),
    C(batch=3, length=129, sq=4, snew=4, rotary="inter", page=16),
    C(batch=3, length=1000, sq=4, snew=4, rotary="halves", causal=False),
    C(batch=3, length=1000, sq=2, snew=2, rotary="inter", window=(200, -1), leftpad=True, sinks=True, softcap=20.0,
      page=1, splits=7, dtype=FP16),
    # head dims
    C(batch=3, length=1000, sq=4, snew=4, d=64, dv=64, page=16, dtype=FP16),
    C(batch=7, length=1000, sq=1, d=64, dv=64, splits=7),
    C(batch=3, length=1000, sq=4, snew=4, d=192, dv=128, page=64),
    C(batch=1, length=8191, sq=2, snew=2, d=192, dv=128, dtype=FP16, sinks=True, splits=7),
    C(batch=3, length=17, sq=16, snew=16, d=192, dv=128, page=1, h=32, hkv=8),
    # FP8 caches (float8_e4m3fn + descales): layouts, splits, GQA, features, head dims
    C(batch=3, length=1000, fp8=True, page=16),
    C(batch=7, length=8191, sq=4, snew=4, h=32, hkv=8, fp8=True),
    C(batch=3, length=1000, sq=2, snew=2, sinks=True, softcap=30.0, page=1, splits=7, dtype=FP16, fp8=True),
    C(batch=1, length=129, sq=4, snew=4, d=192, dv=128, page=64, window=(50, -1), fp8=True),
    C(batch=3, length=1000, d=64, dv=64, leftpad=True, batch_idx=True, splits=1, fp8=True),
    # ... run in split pairs (decode_ws): an odd request, a pair whose second split is empty,
    # 64 query rows of one tile, more rows than a tile, head dim 256, MQA
    C(batch=2, length=300, sq=16, snew=16, page=16, splits=5, fp8=True),
    C(batch=1, length=129, sq=1, splits=8, h=32, hkv=8, fp8=True),
    C(batch=1, length=1000, sq=40, snew=40, h=4, hkv=4, splits=1, fp8=True),
    C(batch=2, length=4000, sq=2, snew=2, d=256, dv=256, sinks=True, softcap=30.0, dtype=FP16, fp8=True),
    C(batch=5, length=2049, sq=1, h=8, hkv=1, causal=False, window=(700, 0), page=256, fp8=True),
    # TMA in 16-row boxes on a page size that is a multiple of 16 but not a power of two
    C(batch=2, length=3000, page=48, h=32, hkv=8, fp8=True),
    C(batch=3, length=1000, sq=2, snew=2, d=64, dv=128, page=16, h=16, hkv=2, fp8=True),  # mma.sync, d != d_v
]


def test_grid_covers_every_axis():
    seen = lambda f: {f(c) for c in GRID}  # noqa: E731
    assert seen(lambda c: c.batch) >= {1, 3, 7}
    assert seen(lambda c: c.length) >= {1, 17, 129, 1000, 8191}
    assert seen(lambda c: c.sq) >= {1, 2, 4, 16}
    assert seen(lambda c: c.page) >= {None, 1, 16, 64, 256}
    assert seen(lambda c: c.h // c.hkv) >= {1, 4, 8}
    assert seen(lambda c: c.splits) >= {0, 1, 7}
    assert seen(lambda c: (c.d, c.dv)) >= {(64, 64), (128, 128), (192, 128)}
    for d in ((64, 64), (128, 128), (192, 128)):
        assert {c.dtype for c in GRID if (c.d, c.dv) == d} == {BF16, FP16}
    assert all(any(f(c) for c in GRID) for f in (
        lambda c: c.leftpad, lambda c: c.sinks, lambda c: c.softcap > 0, lambda c: c.rotary == "inter",
        lambda c: c.rotary == "halves", lambda c: c.window != (-1, -1), lambda c: not c.causal, lambda c: c.batch_idx,
    ))


def make_inputs(c: C):
    """CUDA inputs; cache positions outside every sequence hold NaN."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(zlib.crc32(c.id.encode()))
    rnd = lambda *s: torch.randn(*s, device=dev, generator=g).to(c.dtype)  # noqa: E731
    lengths = torch.tensor([max(c.snew, c.length - (b * c.length) // (c.batch + 1)) for b in range(c.batch)])
    lengths[0] = c.length
    cache_seqlens = (lengths - c.snew).to(torch.int32)
    # FP8: entry b's rows of kv head j are stored as x / desc[b, j] (saturated), desc drawn so
    # that |x| < ~5 fits e4m3's range; the reference dequantizes with the same descales.
    kdesc = (5 / 448) * (1 + torch.rand(c.batch, c.hkv, device=dev, generator=g))
    vdesc = (5 / 448) * (1 + torch.rand(c.batch, c.hkv, device=dev, generator=g))
    if c.fp8:
        rnd_k = lambda b, n, d: (rnd(n, c.hkv, d).float() / kdesc[b][None, :, None]).clamp(-448, 448)  # noqa: E731
        rnd_v = lambda b, n, d: (rnd(n, c.hkv, d).float() / vdesc[b][None, :, None]).clamp(-448, 448)  # noqa: E731
    else:
        rnd_k = rnd_v = lambda b, n, d: rnd(n, c.hkv, d)  # noqa: E731
    capacity = c.length + 5
    kw = {"cache_seqlens": cache_seqlens.to(dev)}
    leftpad = (cache_seqlens.long() * torch.tensor([(b % 3) / 4 for b in range(c.batch)])).long() if c.leftpad else torch.zeros(c.batch, dtype=torch.long)
    if c.leftpad:
        kw["cache_leftpad"] = leftpad.to(torch.int32).to(dev)
    if c.page is None:
        bc = c.batch + (2 if c.batch_idx else 0)
        k_cache = torch.full((bc, capacity, c.hkv, c.d), float("nan"), dtype=c.dtype, device=dev)
        v_cache = torch.full((bc, capacity, c.hkv, c.dv), float("nan"), dtype=c.dtype, device=dev)
        rows = torch.randperm(bc, device=dev, generator=g)[: c.batch] if c.batch_idx else torch.arange(c.batch, device=dev)
        if c.batch_idx:
            kw["cache_batch_idx"] = rows.to(torch.int32)
        for b in range(c.batch):
            lo, hi = int(leftpad[b]), int(cache_seqlens[b])
            k_cache[rows[b], lo:hi] = rnd_k(b, hi - lo, c.d).to(c.dtype)
            v_cache[rows[b], lo:hi] = rnd_v(b, hi - lo, c.dv).to(c.dtype)
    else:
        nb = -(-capacity // c.page)
        pages = c.batch * nb + 2
        k_cache = torch.full((pages, c.page, c.hkv, c.d), float("nan"), dtype=c.dtype, device=dev)
        v_cache = torch.full((pages, c.page, c.hkv, c.dv), float("nan"), dtype=c.dtype, device=dev)
        table = torch.randperm(pages, device=dev, generator=g)[: c.batch * nb].reshape(c.batch, nb).to(torch.int32)
        kw["block_table"] = table
        for b in range(c.batch):
            pos = torch.arange(int(leftpad[b]), int(cache_seqlens[b]), device=dev)
            idx = (table[b].long()[pos // c.page], pos % c.page)
            k_cache[idx] = rnd_k(b, pos.numel(), c.d).to(c.dtype)
            v_cache[idx] = rnd_v(b, pos.numel(), c.dv).to(c.dtype)
        for b in range(c.batch):  # pages past a sequence's end are never read: -1 there
            table[b, -(-int(lengths[b]) // c.page):] = -1
    if c.fp8:  # the stored values fit e4m3 (saturated above); NaN stays NaN
        k_cache, v_cache = k_cache.float().to(torch.float8_e4m3fn), v_cache.float().to(torch.float8_e4m3fn)
        kw["k_descale"], kw["v_descale"] = kdesc, vdesc
    kw["k_cache"], kw["v_cache"] = k_cache, v_cache
    if c.snew:
        kw["k"], kw["v"] = rnd(c.batch, c.snew, c.hkv, c.d), rnd(c.batch, c.snew, c.hkv, c.dv)
    if c.rotary:
        angle = torch.rand(capacity + c.sq, c.d // 4, device=dev, generator=g) * 2 * math.pi
        kw["rotary_cos"], kw["rotary_sin"] = angle.cos().to(c.dtype), angle.sin().to(c.dtype)
    q = rnd(c.batch, c.sq, c.h, c.d)
    sinks = torch.randn(c.h, device=dev, generator=g) if c.sinks else None
    return q, kw, sinks


def _to(kw, device, upcast):
    out = {}
    for k, v in kw.items():
        v = v.to(device)
        # FP8 caches stay FP8 (the reference dequantizes them in float32 either way)
        out[k] = v.float() if (upcast and v.dtype in (BF16, FP16)) else v.clone()
    return out


def _err(a, b):
    return (a.float().cpu() - b.float().cpu()).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("c", GRID, ids=lambda c: c.id)
def test_kernel_matches_reference(c: C):
    check_against_reference(c)


# Chunked attention (``attention_chunk``): each query token's chunk start becomes its left pad
# (``kvcache.attend_chunked``: one call per chunk the tokens touch); one token, and several,
# where the chunk sizes put a chunk boundary between the tokens of entry 1 (positions 748 | 749,
# and 746..747 | 748..749).  Grid cases, so their kernel structures.
CHUNKED_CASES = [
    (C(batch=3, length=1000, page=16), 192),
    (C(batch=3, length=1000, sq=2, snew=2, page=16, h=32, hkv=8), 749),
    (C(batch=3, length=1000, sq=4, snew=2, leftpad=True, page=64), 748),
]


@pytest.mark.parametrize("c, chunk", CHUNKED_CASES, ids=lambda x: x.id if isinstance(x, C) else f"chunk{x}")
def test_chunked_attention_matches_reference(c: C, chunk: int):
    check_against_reference(c, attention_chunk=chunk)


def check_against_reference(c: C, **extra):
    """The kernel's out and lse against the CPU reference in float32 and in c's dtype (the rule
    in the module docstring), and the caches after the append against the reference's."""
    q, kw, sinks = make_inputs(c)
    args = dict(causal=c.causal, window_size=c.window, softcap=c.softcap, rotary_interleaved=c.rotary != "halves",
                return_lse=True, **extra)
    kw32, kwlp = _to(kw, "cpu", True), _to(kw, "cpu", False)
    s_cpu = None if sinks is None else sinks.cpu()
    with debug.poison():
        out, lse = flash_attn_with_kvcache(q, sinks=sinks, num_splits=c.splits, **kw, **args)
    torch.cuda.synchronize()
    o32, l32 = flash_attn_with_kvcache(q.cpu().float(), sinks=s_cpu, **kw32, **args)
    olp, llp = flash_attn_with_kvcache(q.cpu(), sinks=s_cpu, **kwlp, **args)
    assert not out.isnan().any(), "NaN in the output (unwritten element, or a NaN cache row was read)"
    assert not lse.isnan().any()
    scale = max(1.0, o32.abs().max().item())
    bound = 2 * _err(olp, o32) + 1e-5 * scale
    assert _err(out, o32) <= bound, f"out error {_err(out, o32):.3g} > {bound:.3g}"
    lse_c = lse.cpu()
    assert torch.equal(torch.isinf(lse_c), torch.isinf(l32)), "lse -inf pattern differs"
    fin = torch.isfinite(l32)
    lbound = 2 * _err(llp[fin], l32[fin]) + 1e-5 * max(1.0, l32[fin].abs().max().item() if fin.any() else 1.0)
    assert _err(lse_c[fin], l32[fin]) <= lbound, f"lse error {_err(lse_c[fin], l32[fin]):.3g} > {lbound:.3g}"
    # the in-place append: same caches as the reference's (NaN where untouched)
    for name in ("k_cache", "v_cache"):
        got, want = kw[name].cpu().float(), kwlp[name].float()
        if c.rotary and name == "k_cache":
            torch.testing.assert_close(got, want, equal_nan=True, atol=1e-2, rtol=1e-2)
        else:
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), f"{name} differs after the append"


def test_fa3_fp8_call_site_equals_the_16_bit_route():
    """flash-attn 3's FP8 decode call (``flashtile.fa3``: FP8 q and new k / v beside an FP8
    paged cache, ``page_table``) equals flashtile's call on the dequantized bf16 q and new
    tokens, output and caches bitwise (the grid's page-16 FP8-cache case)."""
    from flashtile import fa3

    b, length, h, hkv, d, page = 3, 1000, 8, 2, 128, 16
    pages = -(-length // page)
    k_cache = torch.randn(b * pages, page, hkv, d, device="cuda").to(torch.float8_e4m3fn)
    v_cache = torch.randn(b * pages, page, hkv, d, device="cuda").to(torch.float8_e4m3fn)
    table = torch.randperm(b * pages, device="cuda", dtype=torch.int32).reshape(b, pages)
    seqlens = torch.tensor([length - 1, 500, 17], device="cuda", dtype=torch.int32)
    q8 = torch.randn(b, 1, h, d, device="cuda").to(torch.float8_e4m3fn)
    k8, v8 = (torch.randn(b, 1, hkv, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
    qd, kd, vd = (torch.rand(b, hkv, device="cuda") + 0.5 for _ in range(3))
    caches = (k_cache.clone(), v_cache.clone())
    out, lse = fa3.flash_attn_with_kvcache(q8, *caches, k8, v8, cache_seqlens=seqlens, page_table=table,
                                           q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
                                           return_softmax_lse=True)

    def real(x8, descale):
        return (x8.float() * descale.repeat_interleave(x8.shape[2] // hkv, dim=1)[:, None, :, None]).to(BF16)

    want_caches = (k_cache.clone(), v_cache.clone())
    want, want_lse = flash_attn_with_kvcache(real(q8, qd), *want_caches, real(k8, kd), real(v8, vd),
                                             cache_seqlens=seqlens, block_table=table, causal=True, k_descale=kd,
                                             v_descale=vd, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), "fa3 FP8 decode differs from the bf16-q route"
    for name, got_c, want_c in zip(("k_cache", "v_cache"), caches, want_caches):
        assert torch.equal(got_c.view(torch.uint8), want_c.view(torch.uint8)), f"{name} differs after the append"
    pos = seqlens.long()
    rows = table.long().gather(1, (pos // page)[:, None])[:, 0]
    assert torch.equal(caches[0][rows, pos % page].view(torch.uint8), k8[:, 0].view(torch.uint8)), \
        "the appended k_cache rows are not the new tokens' own FP8 bytes"


# Splits merged several query rows per combine CTA (``decode.rows_per_cta`` > 1: few splits a
# row, after the FP8 decode), which are also the CTA-share cases (``decode.worker_count``): 96
# segments on 132 CTAs (fractional, two parts each), 160 and 280 short segments on one
# persistent CTA per SM (several parts each).
SEVERAL_ROW_CASES = [
    C(batch=12, length=3000, h=32, hkv=8, fp8=True),
    C(batch=40, length=1000, h=16, hkv=4, page=16, fp8=True),
    C(batch=70, length=300, sq=2, snew=2, h=16, hkv=4, fp8=True),
]


@pytest.mark.parametrize("c", SEVERAL_ROW_CASES, ids=lambda c: c.id)
def test_combine_of_several_rows_per_cta(c: C, monkeypatch):
    from flashtile.kernels import decode as dm

    seen = []
    real = dm.rows_per_cta
    monkeypatch.setattr(dm, "rows_per_cta", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    test_kernel_matches_reference(c)
    assert seen and max(seen) > 1, f"the call's combine ran one row per CTA ({seen}): the case no longer tests several"


# 256 segments: with ``own_workers`` (``FLASHTILE_DECODE_OWN=1``) 128 CTAs of two workers, each
# a whole number of whole segments (``decode.whole_segment_ctas``), so the consumers store O
# and lse themselves (the sink folded in there) and no combine runs; the shared schedule runs
# them on persistent CTAs.  512 and 1024 segments (the launcher's own workers by default): 2 and
# 4 whole segments per worker, run in ``schedule.spread_segment`` order (entries of unequal lengths).
WHOLE_SEGMENT_CASES = [
    C(batch=32, length=700, h=32, hkv=8, fp8=True),
    C(batch=64, length=300, sq=2, snew=2, h=16, hkv=4, page=16, sinks=True, softcap=30.0, fp8=True),
    C(batch=64, length=700, h=32, hkv=8),
    C(batch=256, length=200, sq=2, snew=2, h=16, hkv=4, page=64, sinks=True, softcap=30.0, fp8=True),
]


@pytest.mark.parametrize("c", WHOLE_SEGMENT_CASES, ids=lambda c: c.id)
def test_whole_segments_per_worker(c: C):
    test_kernel_matches_reference(c)


@pytest.mark.parametrize("c", [C(batch=1, length=8000, h=32, hkv=8, fp8=True),
                               C(batch=1, length=5000, h=8, hkv=2, sinks=True, fp8=True)], ids=lambda c: c.id)
def test_combine_of_many_splits_in_one_round(c: C, monkeypatch):
    """B=1 over an FP8 cache: 16 CTAs x 2 consumers per segment (34 slots a row), merged by the
    16-load combine."""
    from flashtile.kernels import decode as dm

    seen = []
    real = dm.combine_round
    monkeypatch.setattr(dm, "combine_round", lambda builds, *a: seen.append(builds[real(builds, *a)].per_round)
                        or real(builds, *a))
    test_kernel_matches_reference(c)
    assert seen == [16], f"the call's combine took {seen} loads a round, not one 16-load round"


APPEND_CASES = [c for c in GRID if c.snew and (c.rotary or c.fp8 or c.batch_idx or c.page == 1)] + [
    C(batch=3, length=300, sq=2, snew=3, rotary="halves", fp8=True, page=16, h=32, hkv=8),
    C(batch=2, length=500, sq=4, snew=4, rotary="inter", fp8=True, batch_idx=True, causal=False, d=64, dv=64),
]


def _bits(t):
    """The tensor's bits (NaN payloads included), for a bitwise comparison."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


@pytest.mark.parametrize("cos32", [False, True], ids=["cos-qdtype", "cos-fp32"])
@pytest.mark.parametrize("c", APPEND_CASES, ids=lambda c: c.id)
def test_append_kernel_bitwise_equals_tensor_ops(c: C, cos32: bool):
    """The one-launch append (kernels/append.py: rotary, quantization, page lookup) against the
    tensor ops it replaces (kvcache.rotate_new_tokens, append_kv) on the same GPU: the caches equal
    bit for bit, and the output equals a decode over the tensor ops' rotated q."""
    from flashtile.kvcache import append_kv, rotate_new_tokens

    if cos32 and not c.rotary:
        pytest.skip("no rotary")
    q, kw, sinks = make_inputs(c)
    if cos32:
        kw["rotary_cos"], kw["rotary_sin"] = kw["rotary_cos"].float(), kw["rotary_sin"].float()
    ref = {k: v.clone() for k, v in kw.items()}
    args = dict(causal=c.causal, window_size=c.window, softcap=c.softcap, return_lse=True)
    inter = c.rotary != "halves"
    out, lse = flash_attn_with_kvcache(q, sinks=sinks, num_splits=c.splits, rotary_interleaved=inter, **kw, **args)
    k, v, seq = ref.pop("k"), ref.pop("v"), ref["cache_seqlens"]
    cos, sin = ref.pop("rotary_cos", None), ref.pop("rotary_sin", None)
    q_ref = q
    if cos is not None:
        q_ref, k = rotate_new_tokens(q, k, cos, sin, seq, inter, c.causal or c.window != (-1, -1))
    append_kv(ref["k_cache"], ref["v_cache"], k, v, seq, ref.get("cache_batch_idx"), ref.get("block_table"),
              ref.get("k_descale"), ref.get("v_descale"))
    for name in ("k_cache", "v_cache"):
        assert torch.equal(_bits(kw[name]), _bits(ref[name])), f"{name} differs from the tensor ops' append"
    ref["cache_seqlens"] = seq + c.snew
    out_ref, lse_ref = flash_attn_with_kvcache(q_ref, sinks=sinks, num_splits=c.splits, **ref, **args)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref), "output differs: the rotated q is not the tensor ops'"


def test_splits_agree():
    """The same call with 1, 3 and 16 splits: the same output up to fp32 reassociation."""
    c = C(batch=2, length=4000, sq=4, snew=0, page=16, h=32, hkv=8)
    q, kw, _ = make_inputs(c)
    outs = [flash_attn_with_kvcache(q, num_splits=s, causal=True, **kw) for s in (1, 3, 16)]
    for o in outs[1:]:
        assert _err(o, outs[0]) <= 2e-2


def test_no_recompile_across_shapes():
    """Batch, lengths, page size, heads, GQA ratio, query tokens and splits are runtime values."""
    from flashtile.kernels import cache

    q, kw, _ = make_inputs(C())
    flash_attn_with_kvcache(q, causal=True, **kw)  # builds the bf16 d=128 kernels once
    before = cache.total_builds()
    for c in (C(batch=3, length=1000, page=16), C(batch=7, length=17, page=1, sq=4, snew=4, h=32, hkv=8),
              C(batch=1, length=8191, splits=7, h=4, hkv=4), C(batch=2, length=300, page=64, sq=16, snew=3, h=8, hkv=1)):
        q, kw, _ = make_inputs(c)
        flash_attn_with_kvcache(q, num_splits=c.splits, causal=True, **kw)
    torch.cuda.synchronize()
    assert cache.total_builds() == before


def test_torch_compile_cuda():
    c = C(batch=2, length=500, sq=2, snew=2, page=16)
    q, kw, _ = make_inputs(c)
    ref_kw = {k: v.clone() for k, v in kw.items()}

    @torch.compile(fullgraph=True)
    def step(q, kw):
        return flash_attn_with_kvcache(q, causal=True, **kw)

    out = step(q, kw)
    ref = flash_attn_with_kvcache(q, causal=True, **ref_kw)
    assert _err(out, ref) == 0.0
    assert torch.equal(kw["k_cache"].nan_to_num(7.0), ref_kw["k_cache"].nan_to_num(7.0))


def test_cache_over_2_31_elements():
    """A paged cache of more than 2^31 elements (64-bit addresses), the sequences in its last
    pages; compared with the reference on the same keys in a small contiguous cache."""
    page, hkv, d, h, b, L, sq = 16, 8, 128, 32, 2, 300, 2
    n_pages = 2**31 // (page * hkv * d) + 64
    dev = "cuda"
    k_cache = torch.empty(n_pages, page, hkv, d, dtype=BF16, device=dev)
    v_cache = torch.empty(n_pages, page, hkv, d, dtype=BF16, device=dev)
    nb = -(-L // page)
    table = (n_pages - 1 - torch.arange(b * nb, device=dev)).reshape(b, nb).to(torch.int32)  # the last pages
    kc_small = torch.randn(b, L, hkv, d, dtype=BF16, device=dev)
    vc_small = torch.randn(b, L, hkv, d, dtype=BF16, device=dev)
    pos = torch.arange(L, device=dev)
    for i in range(b):
        idx = (table[i].long()[pos // page], pos % page)
        k_cache[idx], v_cache[idx] = kc_small[i], vc_small[i]
    q = torch.randn(b, sq, h, d, dtype=BF16, device=dev)
    seqlens = torch.full((b,), L, dtype=torch.int32, device=dev)
    for splits in (1, 5):
        with debug.poison():
            out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                               causal=True, num_splits=splits, return_lse=True)
        o32, l32 = flash_attn_with_kvcache(q.cpu().float(), kc_small.cpu().float(), vc_small.cpu().float(),
                                           cache_seqlens=seqlens.cpu(), causal=True, return_lse=True)
        olp, _ = flash_attn_with_kvcache(q.cpu(), kc_small.cpu(), vc_small.cpu(), cache_seqlens=seqlens.cpu(), causal=True, return_lse=True)
        assert _err(out, o32) <= 2 * _err(olp, o32) + 1e-5 * max(1.0, o32.abs().max().item())
        assert _err(lse, l32) <= 1e-5 * max(1.0, l32.abs().max().item()) + 1e-4


@pytest.mark.parametrize("sq", [1, 4])
def test_fp8_cache_decode_repeats_bitwise_under_full_load(sq):
    """An FP8 cache large enough to stream at full bandwidth (B=8, 32k keys, 512 MB), decoded 20
    times: every result bitwise equal to the first, and entry 0 within tolerance of exact math
    on the dequantized cache.  The warp-specialised kernel's consumers share one producer; a
    stage hand-over that depended on TMA loads completing in issue order failed here (a launch
    failure on an H100, ``decode_ws.stage``), which the small shapes above never showed."""
    from flashtile.bench_decode import D, H, HKV, reference_entry0
    from flashtile.fp8 import quantize_fp8

    b, L, h, hkv, d = 8, 32768, H, HKV, D
    q = torch.randn(b, sq, h, d, dtype=BF16, device="cuda")
    k8, kd = quantize_fp8(torch.randn(b, L, hkv, d, dtype=BF16, device="cuda"))
    v8, vd = quantize_fp8(torch.randn(b, L, hkv, d, dtype=BF16, device="cuda"))
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    call = lambda: flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, causal=True, k_descale=kd, v_descale=vd)  # noqa: E731
    first = call()
    outs = [call() for _ in range(20)]
    torch.cuda.synchronize()
    assert all(torch.equal(o, first) for o in outs), "FP8-cache decode not reproducible under load"
    deq = lambda c, scale: (c[0].float() * scale[0][None, :, None])[None]  # noqa: E731 - entry 0, dequantized
    ref = reference_entry0(q, deq(k8, kd), deq(v8, vd), L, sq)  # the decode bench's fp32 check, same shapes
    assert (first[0].double() - ref).abs().max().item() < 2e-2, "FP8-cache decode far from the dequantized reference"
