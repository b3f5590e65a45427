"""flash_attn_with_kvcache on CPU (the exact reference path) against an independent float64
computation; in-place append semantics; rotary; paged vs contiguous; validation; custom-op
checks; torch.compile.  ``test_build_*`` (marker ``compile``) build the CUDA decode kernels
for sm_90a with nvcc (no GPU needed)."""

from __future__ import annotations

import math
import random
import re
import shutil

import pytest
import torch

import flashtile
from flashtile import kvcache
from flashtile.kvcache import flash_attn_with_kvcache

F64 = torch.float64


# --- an independent float64 model of the whole call ----------------------------------------


def naive_rotary(x, cos, sin, pos, interleaved):
    """x (s, h, d) float64, pos (s,) ints: rotate the first 2 * cos.shape[1] features."""
    x = x.clone()
    half = cos.shape[1]
    for i, p in enumerate(pos):
        for f in range(half):
            c, s = float(cos[p, f]), float(sin[p, f])
            a, b = (2 * f, 2 * f + 1) if interleaved else (f, f + half)
            xa, xb = x[i, :, a].clone(), x[i, :, b].clone()
            x[i, :, a] = xa * c - xb * s
            x[i, :, b] = xa * s + xb * c
    return x


def logical_cache(cache, b, capacity, batch_idx, block_table):
    """Entry b's cache as (capacity, h, d) float64, read position by position."""
    rows = []
    for j in range(capacity):
        if block_table is None:
            row = b if batch_idx is None else int(batch_idx[b])
            rows.append(cache[row, j])
        else:
            page = cache.shape[1]
            rows.append(cache[int(block_table[b, j // page]), j % page])
    return torch.stack(rows).to(F64)


def naive_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                  cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                  window_size=(-1, -1), sinks=None, softcap=0.0, rotary_interleaved=True):
    """(out, lse) in float64, from the documented semantics, one (batch, head, token) at a time."""
    b_, sq, h, d = q.shape
    hkv = k_cache.shape[2]
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(d)
    left, right = window_size
    if causal:
        right = 0
    seqlens = [cache_seqlens] * b_ if isinstance(cache_seqlens, int) else cache_seqlens.tolist()
    snew = 0 if k is None else k.shape[1]
    out = torch.zeros(b_, sq, h, v_cache.shape[-1], dtype=F64)
    lse = torch.full((b_, h, sq), -math.inf, dtype=F64)
    for b in range(b_):
        K = logical_cache(k_cache, b, capacity, cache_batch_idx, block_table)
        V = logical_cache(v_cache, b, capacity, cache_batch_idx, block_table)
        qb = q[b].to(F64)
        n0 = seqlens[b]
        if snew:
            kb = k[b].to(F64)
            if rotary_cos is not None:
                kb = naive_rotary(kb, rotary_cos.to(F64), rotary_sin.to(F64), [n0 + i for i in range(snew)], rotary_interleaved)
            K[n0 : n0 + snew] = kb
            V[n0 : n0 + snew] = v[b].to(F64)
        if rotary_cos is not None:
            per_token = causal or tuple(window_size) != (-1, -1)
            qb = naive_rotary(qb, rotary_cos.to(F64), rotary_sin.to(F64), [n0 + (t if per_token else 0) for t in range(sq)], rotary_interleaved)
        L = n0 + snew
        lp = 0 if cache_leftpad is None else int(cache_leftpad[b])
        for hh in range(h):
            kv = hh // (h // hkv)
            for t in range(sq):
                logits, vals = [], []
                for j in range(lp, L):
                    diag = t + L - sq
                    if right >= 0 and j > diag + right:
                        continue
                    if left >= 0 and j < diag - left:
                        continue
                    s = float(qb[t, hh] @ K[j, kv]) * scale
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    logits.append(s)
                    vals.append(V[j, kv])
                terms = logits + ([float(sinks[hh])] if sinks is not None else [])
                if not terms:
                    continue
                m = max(terms)
                z = sum(math.exp(x - m) for x in terms)
                lse[b, hh, t] = m + math.log(z)
                for x, val in zip(logits, vals):
                    out[b, t, hh] += math.exp(x - m) / z * val
    return out, lse


def make_case(batch=2, sq=1, h=4, hkv=2, d=32, dv=32, capacity=40, snew=1, page=None, dtype=F64, batch_cache=None,
              seqlens=None, rotary=None, leftpad=False, batch_idx=False, gen=None):
    """Inputs of one call; ``page`` None = contiguous cache."""
    g = gen or torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=F64).to(dtype)  # noqa: E731
    q = rnd(batch, sq, h, d)
    kw = {}
    if seqlens is None:
        seqlens = torch.randint(0, capacity - snew + 1, (batch,), generator=g)
    kw["cache_seqlens"] = seqlens.to(torch.int32)
    if page is None:
        bc = batch_cache or batch
        kw["k_cache"], kw["v_cache"] = rnd(bc, capacity, hkv, d), rnd(bc, capacity, hkv, dv)
        if batch_idx:
            kw["cache_batch_idx"] = torch.randperm(bc, generator=g)[:batch].to(torch.int32)
    else:
        nb = -(-capacity // page)
        pages = batch * nb + 3
        kw["k_cache"], kw["v_cache"] = rnd(pages, page, hkv, d), rnd(pages, page, hkv, dv)
        kw["block_table"] = torch.randperm(pages, generator=g)[: batch * nb].reshape(batch, nb).to(torch.int32)
    if snew:
        kw["k"], kw["v"] = rnd(batch, snew, hkv, d), rnd(batch, snew, hkv, dv)
    if leftpad:
        kw["cache_leftpad"] = (torch.rand(batch, generator=g) * (kw["cache_seqlens"] + 1).double()).long().clamp(max=kw["cache_seqlens"]).to(torch.int32)
    if rotary:
        ro = capacity + sq + 2
        angle = torch.rand(ro, rotary // 2, generator=g, dtype=F64) * 6
        kw["rotary_cos"], kw["rotary_sin"] = angle.cos().to(dtype), angle.sin().to(dtype)
    return q, kw


def clone_kw(kw):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def to_paged(k_cache, page, gen, cache_batch_idx=None):
    """The same logical contents as a contiguous cache, stored in shuffled pages of ``page`` rows."""
    bc, cap = k_cache.shape[:2]
    batch = bc if cache_batch_idx is None else cache_batch_idx.numel()
    rows = torch.arange(batch) if cache_batch_idx is None else cache_batch_idx.long()
    nb = -(-cap // page)
    perm = torch.randperm(batch * nb, generator=gen)
    table = perm.reshape(batch, nb).to(torch.int32)
    paged = torch.zeros(batch * nb, page, *k_cache.shape[2:], dtype=k_cache.dtype)
    for b in range(batch):
        for j in range(cap):
            paged[table[b, j // page], j % page] = k_cache[rows[b], j]
    return paged, table


# --- the reference against the naive model --------------------------------------------------

CASES = [
    # (batch, sq, h, hkv, d, dv, capacity, snew, page, causal, window, sinks, softcap, rotary, interleaved, leftpad, batch_idx)
    dict(),
    dict(sq=4, causal=True),
    dict(sq=16, h=8, hkv=1, causal=True, page=3),
    dict(sq=17, h=2, hkv=2, causal=True, snew=17, capacity=50, page=16),
    dict(sq=3, snew=0, window=(5, 2), page=1),
    dict(sq=2, causal=True, window=(7, -1), sinks=True, leftpad=True),
    dict(sq=5, softcap=2.0, batch_idx=True, batch_cache=4, snew=2),
    dict(sq=4, causal=True, rotary=16, interleaved=True, snew=4, page=16),
    dict(sq=4, causal=False, rotary=32, interleaved=False, snew=2),
    dict(sq=2, causal=True, window=(3, -1), rotary=8, interleaved=False, snew=2, leftpad=True, page=256, capacity=300, batch=1),
    dict(d=48, dv=24, sq=3, h=6, hkv=3, causal=True, sinks=True, softcap=5.0, page=3),
    dict(sq=20, causal=True, snew=3, leftpad=True, sinks=True),  # seqlen_q > 16, some rows see nothing
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_matches_naive(case, gen):
    c = dict(CASES[case])
    causal, window = c.pop("causal", False), c.pop("window", (-1, -1))
    sinks, softcap = c.pop("sinks", False), c.pop("softcap", 0.0)
    interleaved = c.pop("interleaved", True)
    c.setdefault("batch", 2)
    q, kw = make_case(gen=gen, **c)
    h = q.shape[2]
    s = torch.randn(h, generator=gen, dtype=F64) if sinks else None
    ref_kw = clone_kw(kw)
    out, lse = flash_attn_with_kvcache(q, causal=causal, window_size=window, sinks=s, softcap=softcap,
                                       rotary_interleaved=interleaved, return_lse=True, **kw)
    eo, el = naive_kvcache(q, causal=causal, window_size=window, sinks=s, softcap=softcap,
                           rotary_interleaved=interleaved, **ref_kw)
    torch.testing.assert_close(out, eo, atol=1e-10, rtol=1e-10)
    assert torch.equal(torch.isinf(lse), torch.isinf(el))
    torch.testing.assert_close(lse[torch.isfinite(el)], el[torch.isfinite(el)], atol=1e-10, rtol=1e-10)


def test_fully_masked_rows_are_zero_not_nan(gen):
    """Empty caches, leftpad == length, and a window that sees nothing: out 0, lse -inf."""
    q, kw = make_case(batch=3, sq=2, snew=0, seqlens=torch.tensor([0, 5, 9]), gen=gen)
    kw["cache_leftpad"] = torch.tensor([0, 5, 2], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, window_size=(0, -1), causal=True, return_lse=True, **kw)
    assert not out.isnan().any()
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.isinf(lse[:2]).all()
    assert torch.isfinite(lse[2]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_dtypes(dtype, gen):
    q, kw = make_case(sq=3, dtype=dtype, page=16, rotary=16, gen=gen)
    ref_kw = clone_kw(kw)
    out, lse = flash_attn_with_kvcache(q, causal=True, return_lse=True, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    eo, _ = naive_kvcache(q, causal=True, **ref_kw)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.to(F64), eo, atol=tol, rtol=tol)


# --- in-place append ------------------------------------------------------------------------


@pytest.mark.parametrize("page", [None, 1, 3, 16])
def test_append_in_place(page, gen):
    q, kw = make_case(batch=3, sq=2, snew=3, page=page, rotary=16, batch_cache=5 if page is None else None,
                      batch_idx=page is None, gen=gen)
    before = clone_kw(kw)
    q0 = q.clone()
    k_cache, v_cache = kw["k_cache"], kw["v_cache"]
    flash_attn_with_kvcache(q, causal=True, **kw)
    # inputs other than the caches are untouched
    assert torch.equal(q, q0)
    for name in ("k", "v", "cache_seqlens", "block_table", "cache_batch_idx", "rotary_cos", "rotary_sin"):
        if name in kw:
            assert torch.equal(kw[name], before[name]), name
    # the caches changed exactly at the appended positions, to rotated k and plain v
    changed_k = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b in range(3):
        for i in range(3):
            j = int(kw["cache_seqlens"][b]) + i
            if page is None:
                row, col = int(kw["cache_batch_idx"][b]), j
            else:
                row, col = int(kw["block_table"][b, j // page]), j % page
            changed_k[row, col] = True
            rot = naive_rotary(kw["k"][b, i : i + 1].to(F64), kw["rotary_cos"], kw["rotary_sin"], [j], True)[0]
            torch.testing.assert_close(k_cache[row, col], rot, atol=1e-12, rtol=0)
            assert torch.equal(v_cache[row, col], kw["v"][b, i])
    assert torch.equal(k_cache[~changed_k], before["k_cache"][~changed_k])
    assert torch.equal(v_cache[~changed_k], before["v_cache"][~changed_k])


def test_int_cache_seqlens_and_no_new_kv(gen):
    q, kw = make_case(batch=2, sq=1, snew=0, seqlens=torch.tensor([7, 7]), gen=gen)
    a = flash_attn_with_kvcache(q, kw["k_cache"], kw["v_cache"], cache_seqlens=7)
    b = flash_attn_with_kvcache(q, kw["k_cache"], kw["v_cache"], cache_seqlens=kw["cache_seqlens"])
    assert torch.equal(a, b)


# --- paged vs contiguous --------------------------------------------------------------------


@pytest.mark.parametrize("page", [1, 3, 16, 256])
def test_paged_equals_contiguous(page, gen):
    q, kw = make_case(batch=3, sq=4, capacity=70, snew=2, leftpad=True, gen=gen)
    s = torch.randn(q.shape[2], generator=gen, dtype=F64)
    kp, table = to_paged(kw["k_cache"], page, gen)
    vp, _ = to_paged(kw["v_cache"], page, torch.Generator().manual_seed(gen.initial_seed()))
    # same permutation for v: rebuild with the table we got for k
    vp = torch.zeros(table.numel(), page, *kw["v_cache"].shape[2:], dtype=F64)
    for b in range(3):
        for j in range(70):
            vp[table[b, j // page], j % page] = kw["v_cache"][b, j]
    args = dict(k=kw["k"], v=kw["v"], cache_seqlens=kw["cache_seqlens"], cache_leftpad=kw["cache_leftpad"],
                causal=True, sinks=s, return_lse=True)
    oc, lc = flash_attn_with_kvcache(q, kw["k_cache"], kw["v_cache"], **args)
    op, lp = flash_attn_with_kvcache(q, kp, vp, block_table=table, **args)
    torch.testing.assert_close(op, oc, atol=1e-12, rtol=0)
    torch.testing.assert_close(lp, lc, atol=1e-12, rtol=0)


# --- validation -----------------------------------------------------------------------------


def _valid(gen, page=None):
    q, kw = make_case(batch=2, sq=1, snew=1, page=page, dtype=torch.float32, gen=gen)
    return q, kw


BAD = [
    ("q", lambda q, kw: (q[0], kw), ValueError, "q must be a 4-D"),
    ("k_cache dtype", lambda q, kw: (q, {**kw, "k_cache": kw["k_cache"].double()}), TypeError, "k_cache.dtype"),
    ("v_cache heads", lambda q, kw: (q, {**kw, "v_cache": kw["v_cache"][:, :, :1]}), ValueError, "v_cache.shape[:3]"),
    ("nheads", lambda q, kw: (q[:, :, :3], kw), ValueError, "nheads"),
    ("headdim", lambda q, kw: (q[..., :16], kw), ValueError, "headdim"),
    ("seqlens dtype", lambda q, kw: (q, {**kw, "cache_seqlens": kw["cache_seqlens"].long()}), TypeError, "cache_seqlens.dtype"),
    ("seqlens shape", lambda q, kw: (q, {**kw, "cache_seqlens": kw["cache_seqlens"][:1]}), ValueError, "cache_seqlens"),
    ("seqlens none with new tokens", lambda q, kw: (q, {**kw, "cache_seqlens": None}), ValueError, "cache_seqlens must be given when k and v"),
    ("seqlens float", lambda q, kw: (q, {**kw, "cache_seqlens": 3.0}), TypeError, "cache_seqlens"),
    ("too long", lambda q, kw: (q, {**kw, "cache_seqlens": torch.tensor([40, 0], dtype=torch.int32)}), ValueError, "cache_seqlens + seqlen_new"),
    ("negative", lambda q, kw: (q, {**kw, "cache_seqlens": torch.tensor([-1, 0], dtype=torch.int32)}), ValueError, "non-negative"),
    ("k only", lambda q, kw: (q, {**kw, "v": None}), ValueError, "k and v"),
    ("k heads", lambda q, kw: (q, {**kw, "k": kw["k"][:, :, :1]}), ValueError, "k must be"),
    ("k dtype", lambda q, kw: (q, {**kw, "k": kw["k"].half()}), TypeError, "k.dtype"),
    ("batch_idx dtype", lambda q, kw: (q, {**kw, "cache_batch_idx": torch.tensor([0, 1])}), TypeError, "cache_batch_idx.dtype"),
    ("leftpad shape", lambda q, kw: (q, {**kw, "cache_leftpad": torch.zeros(3, dtype=torch.int32)}), ValueError, "cache_leftpad"),
    ("leftpad > len", lambda q, kw: (q, {**kw, "cache_leftpad": kw["cache_seqlens"] + 1}), ValueError, "cache_leftpad"),
    ("rotary one", lambda q, kw: (q, {**kw, "rotary_cos": torch.ones(50, 8)}), ValueError, "rotary_cos and rotary_sin"),
    ("rotary dim", lambda q, kw: (q, {**kw, "rotary_cos": torch.ones(50, 17), "rotary_sin": torch.ones(50, 17)}), ValueError, "rotary_dim"),
    ("rotary short", lambda q, kw: (q, {**kw, "rotary_cos": torch.ones(2, 8), "rotary_sin": torch.ones(2, 8)}), ValueError, "seqlen_ro"),
    ("window", lambda q, kw: (q, {**kw, "window_size": (-2, 0)}), ValueError, "window_size"),
    ("softcap", lambda q, kw: (q, {**kw, "softcap": -1.0}), ValueError, "softcap"),
    ("sinks", lambda q, kw: (q, {**kw, "sinks": torch.zeros(3)}), ValueError, "sinks"),
    ("num_splits", lambda q, kw: (q, {**kw, "num_splits": -1}), ValueError, "num_splits"),
    ("causal", lambda q, kw: (q, {**kw, "causal": 1}), TypeError, "causal"),
    ("scale", lambda q, kw: (q, {**kw, "softmax_scale": float("nan")}), ValueError, "softmax_scale"),
    ("batch_idx range", lambda q, kw: (q, {**kw, "cache_batch_idx": torch.tensor([0, 2], dtype=torch.int32)}), ValueError, "cache_batch_idx must be indices"),
    ("batch_cache", lambda q, kw: (q, {**kw, "k_cache": kw["k_cache"][:1], "v_cache": kw["v_cache"][:1]}), ValueError, "batch_cache"),
]


@pytest.mark.parametrize("name,mutate,kind,text", BAD, ids=[b[0] for b in BAD])
def test_validation_errors(name, mutate, kind, text, gen):
    q, kw = _valid(gen)
    snapshot = clone_kw(kw)
    q, kw = mutate(q, kw)
    with pytest.raises(kind, match=r"flash_attn_with_kvcache: .*" + re.escape(text)):
        flash_attn_with_kvcache(q, **kw)
    # refused before any work: the caches are untouched
    for key in ("k_cache", "v_cache"):
        if kw.get(key) is not None and kw[key].shape == snapshot[key].shape and kw[key].dtype == snapshot[key].dtype:
            assert torch.equal(kw[key], snapshot[key])


BAD_PAGED = [
    ("table dtype", lambda kw: {**kw, "block_table": kw["block_table"].long()}, TypeError, "block_table.dtype"),
    ("table shape", lambda kw: {**kw, "block_table": kw["block_table"][:1]}, ValueError, "block_table"),
    ("batch_idx with table", lambda kw: {**kw, "cache_batch_idx": torch.zeros(2, dtype=torch.int32)}, ValueError, "cache_batch_idx"),
    ("too long", lambda kw: {**kw, "cache_seqlens": torch.tensor([kw["block_table"].shape[1] * 16, 0], dtype=torch.int32)}, ValueError, "capacity"),
    ("page out of range", lambda kw: {**kw, "block_table": torch.full_like(kw["block_table"], 10**6)}, ValueError, r"block_table\[0, 0\]"),
]


@pytest.mark.parametrize("name,mutate,kind,text", BAD_PAGED, ids=[b[0] for b in BAD_PAGED])
def test_paged_validation_errors(name, mutate, kind, text, gen):
    q, kw = _valid(gen, page=16)
    with pytest.raises(kind, match=text):
        flash_attn_with_kvcache(q, **mutate(kw))


# --- custom op, torch.compile ---------------------------------------------------------------


def _op_args(gen, page=16):
    """(append op args, attention op args) of one call."""
    q, kw = make_case(batch=2, sq=2, snew=2, page=page, leftpad=True, dtype=torch.float32, gen=gen)
    append = (kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw["cache_seqlens"], None, kw["block_table"], None, None)
    fwd = (q, kw["k_cache"], kw["v_cache"], kw["cache_seqlens"] + 2, None, kw["cache_leftpad"], kw["block_table"],
           torch.randn(4, generator=gen), 0.2, 5, 0, 0.0, 0, None, None)
    return append, fwd


def test_opcheck(gen):
    append, fwd = _op_args(gen)
    torch.library.opcheck(kvcache.kvcache_append, append)
    torch.library.opcheck(kvcache.kvcache_fwd, fwd)


def test_only_the_append_op_mutates():
    """The attention op is pure; only kvcache_append declares the cache mutation (a mutating
    op's eager dispatch costs ~150 us with many arguments: kvcache.py)."""
    assert not torch.ops.flashtile.kvcache_fwd.default._schema.is_mutable
    assert torch.ops.flashtile.kvcache_append.default._schema.is_mutable


def test_torch_compile_fullgraph(gen):
    q, kw = make_case(batch=2, sq=2, snew=1, page=3, dtype=torch.float32, gen=gen)
    eager_kw = clone_kw(kw)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, kw):
        return flash_attn_with_kvcache(q, causal=True, return_lse=True, **kw)

    out, lse = step(q, kw)
    eo, el = flash_attn_with_kvcache(q, causal=True, return_lse=True, **eager_kw)
    torch.testing.assert_close(out, eo)
    torch.testing.assert_close(lse, el)
    assert torch.equal(kw["k_cache"], eager_kw["k_cache"]), "the compiled call must append in place too"


def test_exported_name():
    assert flashtile.flash_attn_with_kvcache is flash_attn_with_kvcache
    assert "no gradient" in flash_attn_with_kvcache.__doc__.lower()


def test_split_heuristic():
    import math

    from flashtile.kernels.decode import MAX_SPLITS, choose_splits

    assert choose_splits(64 * 8, 1000, 132) == 1  # enough CTAs already
    assert choose_splits(8, 2, 132) == 1  # nothing to split
    # B=1, 8 kv heads, two CTAs per SM on 132 SMs: every slot (33 splits measured 6% faster
    # than flash-attn's 85% rule's 29 on an H100); 32 fills 97% of them.
    assert choose_splits(8, 132, 264) == 32
    for ctas in range(1, 140):
        for n_blocks in (3, 16, 512, 4096):
            s = choose_splits(ctas, n_blocks, 132)
            assert 1 <= s <= min(MAX_SPLITS, max(1, n_blocks // 2))
            if ctas < 0.8 * 132 and n_blocks >= 512:  # room to split: most SMs busy in every wave
                waves = ctas * s / 132
                assert waves / math.ceil(waves) >= 0.8, (ctas, n_blocks, s)


def test_ctas_per_sm():
    from flashtile.kernels.decode import ctas_per_sm

    # 128-key blocks at d = 128 take 160 KB of shared memory: one CTA per SM; 64-key blocks two.
    # A 64-block row table (16 KB) still leaves room for two.
    assert ctas_per_sm({"block_n": 128, "num_stages": 2, "chunk_blocks": 32}, 128, 128, 2) == 1
    assert ctas_per_sm({"block_n": 64, "num_stages": 2, "chunk_blocks": 32}, 128, 128, 2) == 2
    assert ctas_per_sm({"block_n": 64, "num_stages": 2, "chunk_blocks": 64}, 128, 128, 2) == 2
    assert ctas_per_sm({"block_n": 64, "num_stages": 2, "chunk_blocks": 32}, 256, 256, 2) == 1


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128), (256, 256), (96, 96)])
@pytest.mark.parametrize("cache", ["float8_e4m3fn", "bfloat16"])
def test_ws_schedule_fits_one_cta_per_sm(d, dv, cache):
    """The warp-specialised schedule's tiles (FP8 caches; 16-bit ones behind the developer
    switch) fit Hopper's 227 KB per CTA at every head dim and divide its 128 producer threads
    into whole key rows; FP8 caches with 64-key blocks (64 < d <= 128) take three consumer
    warpgroups."""
    from flashtile.kernels.decode_ws import REGS, smem_bytes, ws_config

    item = 1 if cache.startswith("float8") else 2
    cfg = ws_config(d, dv, item)
    assert smem_bytes(d, dv, cfg["block_n"], cfg["num_stages"], item, cfg["consumers"]) <= 227 * 1024 - 2048, cfg
    assert 128 % cfg["block_n"] == 0 and cfg["consumers"] in REGS, cfg
    assert cfg["num_stages"] % cfg["consumers"] == 0 and cfg["num_stages"] >= 3, cfg  # whole stages per consumer
    assert cfg["consumers"] == (3 if item == 1 and cfg["block_n"] == 64 else 2), cfg


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (64, 128), (128, 64)])
def test_warp_mma_schedule_fits_one_cta_per_sm(d, dv):
    """The FP8 cache's mma.sync consumers (``warp_mma``): 64-key blocks (four warps of 16 keys),
    whole ring stages per consumer, the ring and the merge buffers within 227 KB."""
    from flashtile.kernels.decode_ws import smem_bytes, ws_config
    from flashtile.kernels.warp_mma import BLOCK_N

    cfg = ws_config(d, dv, 1, warp_mma=True)
    assert cfg["warp_mma"] and cfg["block_n"] == BLOCK_N == 64, cfg
    assert smem_bytes(d, dv, 64, cfg["num_stages"], 1, cfg["consumers"], True) <= 227 * 1024 - 2048, cfg
    assert cfg["num_stages"] % cfg["consumers"] == 0, cfg


@pytest.mark.parametrize("d,dv,h,hkv,sq,mma", [
    (128, 128, 32, 8, 1, True), (128, 128, 32, 8, 4, True),  # 4 and 16 rows per kv head
    (128, 128, 32, 8, 5, False), (128, 128, 8, 1, 4, False),  # 20 and 32 rows
    (64, 64, 8, 8, 16, True), (192, 128, 32, 8, 1, False), (256, 256, 32, 8, 1, False),  # head dims
])
def test_fp8_cache_schedule_by_rows_and_head_dims(d, dv, h, hkv, sq, mma):
    """An FP8 cache's consumers run warp-level mma.sync when a kv head's query rows (group x Sq)
    fit one 16-row fragment and the head dims are 64 or 128, else widen into 64-row WGMMA
    tiles; a 16-bit cache keeps ``decode_kernel``; the developer switch turns ``warp_mma`` off."""
    from flashtile.kernels import decode as dm

    sched = dm.decode_schedule(d, dv, "bfloat16", "float8_e4m3fn", (h // hkv) * sq)
    assert sched.cfg.get("warp_mma", False) == mma, sched.cfg
    assert dm.decode_schedule(d, dv, "bfloat16", None, (h // hkv) * sq).kernel is dm.decode_kernel
    try:
        dm.CFG_OVERRIDE = {"warp_mma": 0}
        assert not dm.decode_schedule(d, dv, "bfloat16", "float8_e4m3fn", (h // hkv) * sq).cfg.get("warp_mma")
    finally:
        dm.CFG_OVERRIDE = None


def test_fp8_cache_takes_the_ws_schedule_with_fractional_shares():
    from flashtile.kernels.decode import MAX_SPLITS, decode_kernel, decode_schedule, split_count, worker_count
    from flashtile.kernels.decode_ws import decode_ws_kernel

    # 32 query rows per kv head: the widening consumers, three of them (``warp_mma``'s: two)
    sched = decode_schedule(128, 128, "bfloat16", "float8_e4m3fn", rows=32)
    assert sched.kernel is decode_ws_kernel and sched.consumers == 3 and sched.ctas_per_sm == 1
    assert decode_schedule(128, 128, "bfloat16", "float8_e4m3fn", rows=4).consumers == 2
    bf16 = decode_schedule(128, 128, "bfloat16", None)
    assert bf16.kernel is decode_kernel and bf16.consumers == 1
    for requested in (0, 1, 2, 3, 7, 500):
        for segments, blocks in ((8, 128), (512, 64), (1, 2), (2048, 4096), (131, 4096)):
            g = worker_count(requested, segments, blocks, 132, sched)
            assert g >= min(segments, 132), (requested, segments, blocks, g)
            if requested:
                assert g % segments == 0 and g // segments == max(1, requested // 3)  # whole CTAs per segment
            assert 1 <= split_count(requested, segments, blocks, 132, bf16, 32 * 128) <= MAX_SPLITS
    # Default: whole CTAs per segment where one wave of them fills 95% of the SMs (B=8, 8 kv
    # heads: 64 segments x 2 = 128 of 132), else one CTA per SM (B=6: 132, not 96), each
    # consumer with at least two blocks; from as many segments as SMs on, one CTA per segment,
    # or one persistent CTA per SM when the segments are short.
    assert worker_count(0, 64, 512, 132, sched) == 128
    assert worker_count(0, 8, 512, 132, sched) == 128
    assert worker_count(0, 48, 512, 132, sched) == 132
    assert worker_count(0, 96, 512, 132, sched) == 132
    assert worker_count(0, 8, 12, 132, sched) == 16
    assert worker_count(0, 512, 512, 132, sched) == 512  # long segments: one CTA each
    assert worker_count(0, 1024, 36, 132, sched) == 132  # short ones (B=128 2k): persistent CTAs
    assert worker_count(7, 8, 128, 132, sched) == 16  # a requested count rounds down to triples
    assert worker_count(1, 8, 128, 132, sched) == 8  # ... but never below one triple


def own_workers_schedule():
    from flashtile.kernels import decode as dm

    dm.CFG_OVERRIDE = {"own_workers": 1}
    try:
        return dm.decode_schedule(128, 128, "bfloat16", "float8_e4m3fn", rows=4)
    finally:
        dm.CFG_OVERRIDE = None


def test_own_workers_take_whole_segments_when_they_divide():
    """``own_workers``: with as many segments as SMs or more, 128 CTAs of 2 workers when 256
    divides the segments (B=32 8k, B=64 4k, B=128 2k at 8 kv heads: no segment cut, no
    combine), else one CTA per SM; fewer segments keep the shared schedule's CTA counts."""
    from flashtile.kernels.decode import whole_segment_ctas, worker_count

    from flashtile.kernels import decode as dm

    sched = own_workers_schedule()
    assert sched.cfg["own_workers"] and sched.consumers == 2
    if dm.OWN_WORKERS == "auto":  # the default: own workers for calls of as many segments as SMs
        assert dm.decode_schedule(128, 128, "bfloat16", "float8_e4m3fn", 4, many_segments=True) == sched
        assert not dm.decode_schedule(128, 128, "bfloat16", "float8_e4m3fn", 4).cfg.get("own_workers")
        assert not dm.decode_schedule(128, 128, "bfloat16", "float8_e4m3fn", 32, many_segments=True).cfg.get("own_workers")
    assert all(b.single_stored for b in sched.combines)
    for segments in (256, 512, 1024, 2048):
        assert worker_count(0, segments, 32, 132, sched) == 128, segments
    assert worker_count(0, 160, 32, 132, sched) == 132  # 2 x 80 would idle 40% of the SMs
    assert worker_count(0, 1056, 32, 132, sched) == 132  # 264 workers of exactly 4 segments
    assert worker_count(0, 64, 512, 132, sched) == 128  # B=8 32k: as the shared schedule
    assert worker_count(0, 8, 512, 132, sched) == 128
    # Which calls take them (``own_workers_pay``): the cases at 8 kv heads, 132 SMs.
    pays = {(b, keys): dm.own_workers_pay(8 * b, -(-keys // 64), 132)
            for b, keys in ((1, 8192), (8, 32768), (12, 32768), (20, 32768), (32, 8192), (64, 4096), (128, 2048),
                            (64, 32768))}
    assert [k for k, v in pays.items() if v] == [(20, 32768), (32, 8192), (64, 4096), (128, 2048)]
    for segments in range(132, 3000, 7):
        ctas = whole_segment_ctas(segments, 132, 2)
        assert ctas == 132 or (ctas >= 119 and segments % (2 * ctas) == 0), (segments, ctas)


def test_per_call_schedule_rules_split_producer_and_16bit_on_decode_ws():
    """FP8 pages smaller than a block (in 16-row TMA boxes) give each shared-part consumer a
    producer warp of its own (``split_producer_pays``); 16-bit long streams and many-segment
    calls whose blocks lie on one page take ``decode_ws``'s mma.sync consumers (``ws16_pays``;
    as workers of their own for many segments), the rest ``decode_kernel``.
    The issue's cases: d = 128, 8 kv heads, ``L + 256`` cache rows."""
    from flashtile.kernels import decode as dm
    from flashtile.kernels.decode_ws import decode_ws_kernel

    assert [p for p in (1, 8, 16, 32, 48, 64, 80, 256) if dm.split_producer_pays(True, p)] == [16, 32, 48]
    assert not dm.split_producer_pays(False, 16)  # a contiguous cache of 16 rows is one page: whole-block boxes
    long16 = {}
    for b, keys in ((1, 8192), (8, 32768), (12, 32768), (16, 16384), (32, 8192), (64, 4096), (128, 2048), (1, 131072)):
        blocks = -(-(keys + 256) // 64)
        long16[b, keys] = dm.ws16_pays(False, keys + 256, blocks, dm.own_workers_pay(8 * b, blocks, 132))
    assert [k for k, v in long16.items() if not v] == [(1, 8192)], "latency-bound B=1 8k keeps decode_kernel"
    assert [p for p in (16, 32, 64, 96, 128, 256) if dm.ws16_pays(True, p, 516, False)] == [64, 128, 256]
    assert not dm.ws16_pays(True, 16, 40, True) and dm.ws16_pays(True, 64, 40, True)
    if dm.WS_16BIT is None and dm.OWN_WORKERS == "auto":  # the defaults (the GPU suite may set the switches)
        fp8 = dm.decode_schedule(128, 128, "bfloat16", "float8_e4m3fn", 4, small_pages=True)
        assert fp8.cfg.get("split_producer") and fp8.cfg["warp_mma"]
        assert not dm.decode_schedule(128, 128, "bfloat16", "float8_e4m3fn", 4).cfg.get("split_producer")
        own = dm.decode_schedule(128, 128, "bfloat16", "float8_e4m3fn", 4, many_segments=True, small_pages=True)
        assert own.cfg.get("own_workers") and not own.cfg.get("split_producer"), "own workers have their warps already"
        wide = dm.decode_schedule(128, 128, "bfloat16", "float8_e4m3fn", 32, small_pages=True)
        assert not wide.cfg.get("split_producer") and not wide.cfg.get("warp_mma")
        s16 = dm.decode_schedule(128, 128, "bfloat16", None, 4, ws16=True)
        assert s16.kernel is decode_ws_kernel and s16.cfg["warp_mma"] and s16.cfg["cache_dtype"] == "bfloat16"
        assert not s16.cfg.get("split_producer") and not s16.cfg.get("own_workers")
        own16 = dm.decode_schedule(128, 128, "bfloat16", None, 4, many_segments=True, ws16=True)
        assert own16.cfg["own_workers"] and own16.kernel is decode_ws_kernel
        assert dm.decode_schedule(128, 128, "bfloat16", None, 4, many_segments=True).kernel is dm.decode_kernel
        for rows, d in ((32, 128), (4, 256)):  # no mma.sync consumers for these: decode_kernel
            assert dm.decode_schedule(d, d, "bfloat16", None, rows, ws16=True).kernel is dm.decode_kernel


def _live_parts(workers: int, segments: int):
    """(worker, part, segment, u0, u1) of every non-empty part of ``schedule.split_part``'s
    shares (the host-side walk every worker's parts loop makes in the kernels)."""
    from flashtile.kernels.schedule import max_parts, split_part

    for worker in range(workers):
        for part in range(max_parts(workers, segments)):
            g, u0, u1 = split_part(worker, part, workers, segments)
            if g < segments and u0 < u1:
                yield worker, part, g, u0, u1


@pytest.mark.parametrize("segments,ctas", [(1024, 128), (1056, 132), (160, 132), (64, 128), (8, 128), (3, 5),
                                           (250, 132)])
def test_own_workers_shares_tile_every_segment_once(segments, ctas):
    """Workers ``c C + w`` of ``ctas x C`` (``decode_ws``'s ``own_workers``): every segment's
    units are covered exactly once; a part is its whole segment (stored directly, ``tile.whole``)
    exactly when ``segment_workers`` counts one worker (the combine skips those rows), and the
    partial slots ``worker + segment`` of the others are distinct and inside the launcher's
    ``(workers + segments)`` slots."""
    from flashtile.kernels.schedule import segment_workers

    workers = ctas * 2
    covered = [[] for _ in range(segments)]
    whole, slots = set(), set()
    for worker, _, g, u0, u1 in _live_parts(workers, segments):
        covered[g].append((u0, u1))
        if (u0, u1) == (0, workers):
            whole.add(g)
        else:
            slot = worker + g
            assert slot not in slots and slot < workers + segments
            slots.add(slot)
    for g, spans in enumerate(covered):
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == workers, (g, spans)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (g, spans)
        first, count = segment_workers(g, workers, segments)
        assert (count == 1) == (g in whole), (g, count)
        assert count == len(spans), (g, count, spans)
    cut = workers > segments or segments % workers != 0  # the launcher's ``combined``
    assert cut == (len(whole) < segments)


@pytest.mark.parametrize("segments,workers", [(1024, 256), (512, 256), (256, 256), (2048, 256), (12, 4), (7, 7),
                                               (1056, 264), (160, 264), (250, 132), (1, 1)])
def test_spread_order_runs_each_segment_once_and_parts_side_by_side(segments, workers):
    """``schedule.spread_segment`` over own workers' whole-segment shares: a bijection of the
    segments; when the workers divide them into k > 1 each, the parts that run at the same
    time (part p of every worker) are the consecutive segments ``[p G, (p + 1) G)``, every kv
    head of a run of entries; otherwise the share order itself."""
    from flashtile.kernels.schedule import spread_segment

    runs = {}
    for _, part, g, _, _ in _live_parts(workers, segments):
        runs.setdefault(part, []).append((g, spread_segment(g, segments, workers)))
    spread = sorted(s for pairs in runs.values() for _, s in pairs)
    whole = segments % workers == 0 and segments // workers > 1
    if whole:  # every segment once (cut segments appear once per worker that shares them)
        assert spread == list(range(segments))
    for part, pairs in runs.items():
        if whole:
            assert sorted(s for _, s in pairs) == list(range(part * workers, (part + 1) * workers)), part
        else:
            assert all(g == s for g, s in pairs), part


def test_combine_round_is_the_smallest_that_takes_one_round():
    """``decode.combine_round``: rows of few splits take the 8-load combine (16 wastes loads
    and registers), B=1's 48 splits of an FP8 cache the 16-load one, more than 64 the last;
    the 16-bit caches' one combine is the one-row kernel."""
    from flashtile.kernels.decode import COMBINES, combine_round

    ws = COMBINES["decode_ws"]
    assert ws[combine_round(ws, 128, 6)].per_round == 8
    assert ws[combine_round(ws, 128, 32)].per_round == 8
    assert ws[combine_round(ws, 128, 48)].per_round == 16
    assert ws[combine_round(ws, 128, 200)].per_round == 16
    assert ws[combine_round(ws, 64, 48)].per_round == 8  # 8 groups of 8 at d_v = 64
    assert [b.rows for b in COMBINES["decode"]] == [1] and combine_round(COMBINES["decode"], 128, 48) == 0


@pytest.mark.parametrize("per_round", [8, 16])
@pytest.mark.parametrize("dim_v", [64, 96, 128, 256])
@pytest.mark.parametrize("splits", [1, 3, 6, 9, 17, 48, 129])
def test_combine_rows_per_cta_merges_every_split_once(dim_v, splits, per_round):
    """``decode.rows_per_cta``: R divides the CTA's chunk groups, and the groups each row gets
    (``groups / R``, split ``s`` to group ``s % per_row`` in round ``s // (per_row x 8)``)
    take each of its splits exactly once, in one round whenever R > 1."""
    from flashtile.kernels.decode import combine_groups, rows_per_cta

    groups = combine_groups(dim_v)
    r = rows_per_cta(dim_v, splits, per_round=per_round)
    assert groups % r == 0, (groups, r)
    per_row = groups // r
    rounds = -(-splits // (per_row * per_round))
    assert r == 1 or rounds == 1, f"R = {r} with {rounds} rounds"
    taken = sorted((rd * per_round + j) * per_row + gi for gi in range(per_row) for rd in range(rounds)
                   for j in range(per_round) if (rd * per_round + j) * per_row + gi < splits)
    assert taken == list(range(splits)), taken
    assert splits > per_round or r == groups, f"{splits} splits fit one group a row, yet R = {r} of {groups}"


@pytest.mark.parametrize("segments", [1, 2, 3, 7, 64, 131, 512])
@pytest.mark.parametrize("workers", [1, 2, 5, 64, 132, 199, 264])
def test_split_shares_tile_every_segment_once(segments, workers):
    """``schedule``'s worker shares: every key block of every segment in exactly one part,
    at most ``max_parts`` parts per worker (two when workers >= segments), one slot per
    (worker, segment) pair, and the combine's ``segment_workers`` naming exactly the workers
    whose parts touch the segment."""
    from flashtile.kernels.schedule import max_parts, segment_workers, share_blocks, split_part

    rng = random.Random(segments * 1000 + workers)
    n = [rng.choice([0, 1, 2, 5, 64, 513]) for _ in range(segments)]
    seen = [[0] * k for k in n]
    slots, touching = set(), {}
    for c in range(workers):
        parts = [split_part(c, p, workers, segments) for p in range(max_parts(workers, segments))]
        live = [(g, u0, u1) for g, u0, u1 in parts if g < segments and u0 < u1]
        assert live and live[0][0] == c * segments // workers, (c, parts)
        assert [g for g, _, _ in live] == list(range(live[0][0], live[0][0] + len(live))), "parts not consecutive"
        assert workers < segments or len(live) <= 2, (c, live)
        g, u0, u1 = split_part(c, max_parts(workers, segments), workers, segments)
        assert g >= segments or u0 >= u1, "a live part beyond max_parts"
        for g, u0, u1 in live:
            first, count = share_blocks(u0, u1, n[g], workers)
            for x in range(first, first + count):
                seen[g][x] += 1
            assert c + g not in slots, f"slot {c + g} written twice"
            slots.add(c + g)
            touching.setdefault(g, []).append(c)
    assert all(v == 1 for row in seen for v in row), "a key block in no part or in two"
    for g in range(segments):
        first, count = segment_workers(g, workers, segments)
        assert touching[g] == list(range(first, first + count)), (g, touching[g], first, count)


# --- kernel builds (nvcc, no GPU) -----------------------------------------------------------

BUILDS = [  # (d, dv, dtype, sinks, softcap): every static switch once, few compiles
    (128, 128, "bfloat16", False, False),
    (128, 128, "float16", True, True),
    (64, 64, "bfloat16", True, False),
    (192, 128, "bfloat16", False, True),
]


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("d,dv,dtype,sinks,softcap", BUILDS, ids=lambda x: str(x))
def test_build_decode(d, dv, dtype, sinks, softcap):
    from flashtile.kernels.decode import get_decode_kernels

    decode, combine = get_decode_kernels(d, dv, dtype, sinks, softcap)  # a bf16 cache: one combine
    src = decode.get_kernel_source()
    assert "wgmma" in src and "mma_sync" not in src, "decode GEMMs should be WGMMA"
    for name in ("int B", "int Sq", "int H", "int Hkv", "int page_size"):
        assert name in src, f"{name} should be a runtime argument"
    # num_splits: TileLang names the kernel argument after the macro parameter it reaches (store's)
    assert "int num_splits" in src or "int direct" in src, "num_splits should be a runtime argument"
    assert ("tanh" in src) == softcap
    if d == dv:
        assert "cp_async" in src, "K/V tiles should stream through cp.async"
        assert "cp_async_gs_conditional<4>" not in src and "<16>" in src, "K/V copies should be 16-byte vectors"
        # The page lookup happens once per key row (row_s), not per 16-byte copy: a division
        # in the copy's address was the decode kernel's bottleneck (64-bit, ~8 per copy).
        copies = [line for line in src.splitlines() if "cp_async_gs" in line]
        assert copies and not any(" % " in line or " / " in line for line in copies), "division in a K/V copy address"
    assert "__launch_bounds__(" in combine.get_kernel_source()


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn"])
def test_build_append(cache_dtype):
    """The append kernel (kernels/append.py) must equal the reference's tensor ops bit for bit:
    every rotary and quantization step a correctly rounded fp32 operation (fast math would fuse
    the products into FMAs and approximate the division), FP8 by a saturating conversion."""
    from flashtile.kernels.append import get_append_kernels

    for kernel in get_append_kernels(128, 128, "bfloat16", cache_dtype):
        src = kernel.get_kernel_source()
        for name in ("int B", "int Hkv", "int PS", "int SN", "int rotary_dim", "int interleaved"):
            assert name in src, f"{name} should be a runtime argument"
        assert "__fsub_rn(__fmul_rn(" in src and "__fadd_rn(__fmul_rn(" in src, "rotary not in rounded fp32 steps"
        assert ("__fdiv_rn(" in src) == (cache_dtype != "bfloat16"), "FP8 quantization should divide exactly"


def test_unused_block_table_entries_may_hold_anything(gen):
    """Pages past a sequence's end are never read: -1 there (as some servers pad) is fine."""
    q, kw = make_case(batch=2, sq=1, snew=1, page=4, capacity=40, seqlens=torch.tensor([5, 9]), gen=gen)
    ref = flash_attn_with_kvcache(q, **clone_kw(kw))
    kw["block_table"][:, 3:] = -1  # positions >= 12 are unused (lengths 6 and 10 after the append)
    assert torch.equal(flash_attn_with_kvcache(q, **kw), ref)


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_decode_kernel_does_not_spill(tmp_path):
    """ptxas report of the default d=128 decode kernel: no register spills (233 registers when
    written; 128 threads, so registers do not limit the one CTA per SM that shared memory allows)."""
    import os
    import subprocess

    import tilelang

    from flashtile.kernels.decode import get_decode_kernels

    decode, _ = get_decode_kernels(128, 128, "bfloat16", False, False)
    tl = os.path.dirname(tilelang.__file__)
    cu = tmp_path / "k.cu"
    cu.write_text(decode.get_kernel_source())
    res = subprocess.run(["nvcc", "--cubin", "-O3", "-arch=sm_90a", "-std=c++17", "--use_fast_math", f"-I{tl}/src",
                          f"-I{tl}/3rdparty/cutlass/include", "-Xptxas", "-v", str(cu), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert " 0 bytes spill stores" in res.stderr, res.stderr


# --- FP8 caches (float8_e4m3fn + k_descale / v_descale) ----------------------------------------


def fp8_case(page, gen, **kw):
    """make_case's inputs with the caches quantized to float8_e4m3fn under one descale per
    (batch entry, kv head); also the same cache dequantized (float64) for the exact comparison.
    Paged pages are shared by no two entries (make_case), so a page is quantized with its
    entry's descale; pages no entry uses keep a descale of 1."""
    q, kw = make_case(page=page, gen=gen, **kw)
    b, hkv = q.shape[0], kw["k_cache"].shape[2]
    desc = {n: 0.01 + torch.rand(b, hkv, generator=gen) * 0.02 for n in ("k_descale", "v_descale")}
    deq = {}
    for name, dname in (("k_cache", "k_descale"), ("v_cache", "v_descale")):
        cache = kw[name]
        scale = torch.ones(cache.shape[0], hkv, dtype=torch.float32)  # per cache row / page
        rows = kw["block_table"] if page is not None else torch.arange(b)[:, None]
        for e in range(b):
            scale[rows[e].long()] = desc[dname][e]
        c8 = (cache / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        kw[name] = c8
        deq[name] = c8.double() * scale[:, None, :, None].double()
    kw.update(desc)
    return q, kw, deq


@pytest.mark.parametrize("page", [None, 16])
def test_fp8_cache_equals_dequantized(page, gen):
    """An FP8 cache gives what the dequantized cache gives (flash-attn 3's descale convention),
    appended tokens quantized with the entry's descales."""
    q, kw, deq = fp8_case(page, gen, batch=3, sq=2, snew=2, h=4, hkv=2, d=32, dv=32, capacity=40)
    out, lse = flash_attn_with_kvcache(q, **clone_kw(kw), causal=True, return_lse=True)
    want_kw = {k: v for k, v in clone_kw(kw).items() if not k.endswith("descale")}
    want_kw.update(deq)
    # appended tokens as the FP8 cache stores them: quantized with the entry's descale
    for name, dname in (("k", "k_descale"), ("v", "v_descale")):
        d = kw[dname][:, None, :, None].double()
        want_kw[name] = (kw[name] / d).clamp(-448, 448).to(torch.float8_e4m3fn).double() * d
    want, wlse = flash_attn_with_kvcache(q, **want_kw, causal=True, return_lse=True)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, wlse, atol=1e-12, rtol=1e-10)


def test_fp8_cache_append_quantizes_in_place(gen):
    q, kw, _ = fp8_case(None, gen, batch=2, snew=3, capacity=20, seqlens=torch.tensor([4, 9]))
    caches = clone_kw(kw)
    flash_attn_with_kvcache(q, **caches)
    for name, dname in (("k_cache", "k_descale"), ("v_cache", "v_descale")):
        got = caches[name]
        assert got.dtype == torch.float8_e4m3fn
        for e, start in enumerate((4, 9)):
            want = (kw[name[0]][e] / kw[dname][e][None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(got[e, start:start + 3].float(), want.float()), f"{name} entry {e}"
        untouched = torch.ones(got.shape[:2], dtype=torch.bool)
        untouched[0, 4:7] = untouched[1, 9:12] = False
        assert torch.equal(got[untouched].float(), kw[name][untouched].float()), f"{name}: rows outside the append changed"


FP8_ERRORS = [
    ("k_descale missing", lambda kw: kw.pop("k_descale"), ValueError, "k_descale"),
    ("v_descale shape", lambda kw: kw.update(v_descale=kw["v_descale"][:1]), ValueError, "v_descale"),
    ("descale dtype", lambda kw: kw.update(k_descale=kw["k_descale"].double()), TypeError, "k_descale.dtype"),
    ("mixed caches", lambda kw: kw.update(v_cache=kw["v_cache"].double()), TypeError, "v_cache.dtype"),
]


@pytest.mark.parametrize("name,mutate,kind,text", FP8_ERRORS, ids=[e[0] for e in FP8_ERRORS])
def test_fp8_validation_errors(name, mutate, kind, text, gen):
    q, kw, _ = fp8_case(None, gen)
    mutate(kw)
    with pytest.raises(kind, match=re.escape(text)):
        flash_attn_with_kvcache(q, **kw)


def test_descales_need_an_fp8_cache(gen):
    q, kw = make_case(gen=gen)
    with pytest.raises(ValueError, match="k_descale"):
        flash_attn_with_kvcache(q, **kw, k_descale=torch.ones(2, 2), v_descale=torch.ones(2, 2))


def test_fp8_opcheck(gen):
    """Fake tensors and dispatch with FP8 caches.  (opcheck's test_schema multiplies the
    mutated caches, which CPU float8 tensors do not implement; the bf16 test_opcheck covers the
    schema's mutation declaration.)"""
    q, kw, _ = fp8_case(16, gen, batch=2, sq=2, snew=2, dtype=torch.float32)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(kvcache.kvcache_append, (
        kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw["cache_seqlens"], None, kw["block_table"], kw["k_descale"],
        kw["v_descale"]), test_utils=utils)
    torch.library.opcheck(kvcache.kvcache_fwd, (
        q, kw["k_cache"], kw["v_cache"], kw["cache_seqlens"] + 2, None, None, kw["block_table"], None, 0.2, -1, 0, 0.0,
        0, kw["k_descale"], kw["v_descale"]), test_utils=utils)


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("d,dv,dtype,sinks,softcap,rows,many", [(128, 128, "bfloat16", False, False, 32, False),
                                                               (192, 128, "float16", True, True, 4, False),
                                                               (128, 128, "bfloat16", False, False, 16, False),
                                                               (64, 64, "float16", True, True, 1, False),
                                                               (128, 128, "bfloat16", True, True, 4, True)],
                         ids=lambda x: str(x))
def test_build_decode_fp8_cache(d, dv, dtype, sinks, softcap, rows, many):
    """The FP8-cache decode kernel (decode_ws): FP8 bytes through TMA (one box per K/V block,
    pages of whole blocks) or explicit cp.async (16-byte copies, any page size) by a producer
    warpgroup into a raw ring handed over through mbarriers.  More than 16 query rows per kv
    head (or head dims other than 64 / 128): each consumer warpgroup widens its blocks to fp16
    pairwise (one cvt per two values) for its fp16 WGMMAs; three consumer warpgroups at
    d = 128, two at 192/128 (``ws_config``).  Up to 16 rows at d = 64 / 128 (``warp_mma``): two
    consumer warpgroups of mma.sync warps widening in registers, V through ldmatrix.trans, no
    WGMMA.  Many segments (``many``): each mma.sync consumer a worker of its own, fed by its own
    producer warp (one elected lane per warp issues its TMA), whole segments stored as O and
    lse with the sink folded in."""
    from flashtile.kernels import decode as dm

    kernels = dm.get_decode_kernels(d, dv, dtype, sinks, softcap, "float8_e4m3fn", rows=rows, many_segments=many)
    src = kernels[0].get_kernel_source()
    own = many and dm.OWN_WORKERS != "0"
    if own:
        assert "tl_shuffle_elect<32>" in src and "tl_shuffle_elect<128>" not in src, "a TMA issuer per producer warp"
        assert "sink2" in src, "the direct stores fold the sink in"
    assert "fp8_e4_t" in src and "cp_async_gs_conditional<16>" in src and "mbarrier_cp_async_arrive_noinc" in src
    assert "tl::tma_load(K_desc" in src and "tl::tma_load(V_desc" in src and "expect_transaction" in src
    mma = rows <= 16 and d in (64, 128)
    if mma:
        assert "mma_sync<tl::DataType::kFloat16, tl::DataType::kFloat16, tl::DataType::kFloat32, 16, 8, 16" in src
        assert "ptx_ldmatrix_x4_trans" in src and "flashtile_e4m3x2_to_half2" in src and "wgmma" not in src
    else:
        assert "__tl_cvt_fp8x2_to_half2" in src and "wgmma_ss<tl::DataType::kFloat16" in src
        assert "fence_proxy_async" in src
    # a producer and three (two) consumer warpgroups, registers moved to the consumers
    threads = 512 if d == 128 and not mma else 384
    assert f"__launch_bounds__({threads}, 1)" in src and "warpgroup_reg_alloc" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("dtype,cache_dtype,many", [("bfloat16", "float8_e4m3fn", False), ("float16", None, False),
                                                    ("float16", None, True)])
def test_build_decode_split_producer_and_16bit_on_decode_ws(dtype, cache_dtype, many):
    """The schedules of ``split_producer_pays`` and ``ws16_pays``: FP8 pages smaller than a
    block, each consumer's producer warp electing its own TMA lane over the shared parts; a
    16-bit cache's long streams (and, ``many``, many segments on workers of their own) on
    ``decode_ws``'s mma.sync consumers, 16-bit operands straight from the TMA-filled ring (no
    widening) and V through ldmatrix.trans."""
    from flashtile.kernels import decode as dm

    kind = {"small_pages": True} if cache_dtype else {"ws16": True, "many_segments": many}
    src = dm.get_decode_kernels(128, 128, dtype, True, False, cache_dtype, rows=4, **kind)[0].get_kernel_source()
    if many and dm.OWN_WORKERS != "0":  # 16-bit own workers: a TMA lane per producer warp, sinks folded into direct stores
        assert "tl_shuffle_elect<32>" in src and "sink2" in src
    assert "tl::tma_load(K_desc" in src and "tl::tma_load(V_desc" in src and "wgmma" not in src
    assert "ptx_ldmatrix_x4_trans" in src and "__launch_bounds__(384, 1)" in src
    if cache_dtype:
        assert "tl_shuffle_elect<32>" in src and "tl_shuffle_elect<128>" not in src, "a TMA issuer per producer warp"
        assert "flashtile_e4m3x2_to_half2" in src
    else:
        assert "mma_sync<tl::DataType::kFloat16, tl::DataType::kFloat16, tl::DataType::kFloat32, 16, 8, 16" in src
        assert "fp8_e4_t" not in src and src.count("flashtile_e4m3x2_to_half2(") == 1, "no widening (the helper unused)"


@pytest.mark.parametrize("consumers,per", [(2, 2), (3, 1), (3, 2), (2, 1)])
def test_ws_ring_stage_previous_occupant_is_the_same_consumer(consumers, per):
    """``decode_ws.ring_stage``: whatever order the producer interleaves the consumers' blocks in
    (splits of unequal length included), every stage is used by one consumer only, in its own
    block order, and consecutive uses of a stage alternate the phase parity that consumer waits
    for: so a consumer's parity wait can never match a phase it has not consumed itself."""
    from flashtile.kernels.decode_ws import ring_phase, ring_stage

    counts = [7, 7, 5][:consumers]  # blocks per split: never growing with the split index
    owner, uses = {}, {}
    for i in range(counts[0]):  # the producer's rounds (decode_ws.produce)
        for w, n in enumerate(counts):
            if i < n:
                st = ring_stage(w, i, per)
                assert 0 <= st < consumers * per
                assert owner.setdefault(st, w) == w, f"stage {st} shared by consumers {owner[st]} and {w}"
                uses.setdefault(st, []).append(i)
    for st, blocks in uses.items():
        assert blocks == sorted(blocks) and all(b - a == per for a, b in zip(blocks, blocks[1:])), (st, blocks)
        assert [ring_phase(i, per) for i in blocks] == [k & 1 for k in range(len(blocks))], (st, blocks)
