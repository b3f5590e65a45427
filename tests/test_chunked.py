"""Chunked local attention (``attention_chunk``) against a float64 oracle that builds the full
mask from the definition (``flashtile/chunked.py``): query row i at position
p = i + seqlen_k - seqlen_q sees key j when ``p // C == j // C`` and the causal / window rule
holds.  The oracle never splits into sequences, so it checks the packed decomposition too."""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from flashtile import chunked

F64 = torch.float64


def oracle(q, k, v, chunk, causal=False, window=(-1, -1), sinks=None, softcap=0.0, seqlens=None, leftpad=None):
    """(out, lse) by the definition, differentiable; ``seqlens[b]``: entry b's keys (a KV cache's
    length after the append), ``leftpad[b]``: its first visible key."""
    b, sq, h, d = q.shape
    group = h // k.shape[2]
    outs, lses = [], []
    for e in range(b):
        n = k.shape[1] if seqlens is None else int(seqlens[e])
        kk, vv = k[e, :n].repeat_interleave(group, 1), v[e, :n].repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[e], kk) / math.sqrt(d)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        p = torch.arange(sq)[:, None] + n - sq
        j = torch.arange(n)[None, :]
        left, right = window[0], 0 if causal else window[1]
        visible = (p // chunk == j // chunk) if chunk else torch.ones(sq, n, dtype=torch.bool)
        if left >= 0:
            visible = visible & (j >= p - left)
        if right >= 0:
            visible = visible & (j <= p + right)
        if leftpad is not None:
            visible = visible & (j >= int(leftpad[e]))
        s = s.masked_fill(~visible, -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks[:, None, None].expand(h, sq, 1).to(s.dtype)], dim=-1)
        lse = torch.logsumexp(s, dim=-1)
        probs = torch.exp(s - lse[..., None]).nan_to_num(0.0)[..., :n]
        outs.append(torch.einsum("hqk,khd->qhd", probs, vv))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def assert_matches(out, lse, want_out, want_lse, what):
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), f"{what}: lse -inf pattern differs"
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12, msg=lambda m: f"{what}: out: {m}")
    torch.testing.assert_close(lse[fin], want_lse[fin], rtol=0, atol=1e-12, msg=lambda m: f"{what}: lse: {m}")


# (batch, seqlen_q, seqlen_k, chunk): chunks dividing and not dividing the keys, seqlen_q below,
# equal to and above seqlen_k (rows before key 0), chunk 1, a chunk covering everything, a single
# query row (decode-like), no keys
SHAPES = [(2, 10, 10, 4), (1, 7, 13, 5), (2, 13, 7, 3), (1, 9, 9, 9), (3, 1, 17, 4), (1, 6, 20, 1), (2, 11, 11, 64),
          (1, 5, 0, 4), (1, 33, 40, 8)]
OPTIONS = {
    "full": {},
    "causal": dict(causal=True),
    "causal-window": dict(causal=True, window=(2, -1)),
    "window": dict(window=(3, 1)),
    "sinks-softcap": dict(causal=True, sinks=True, softcap=2.0),
}


@pytest.mark.parametrize("opts", OPTIONS, ids=list(OPTIONS))
@pytest.mark.parametrize("b, sq, sk, chunk", SHAPES, ids=lambda x: str(x))
def test_dense_matches_oracle_with_gradients(b, sq, sk, chunk, opts):
    o = dict(OPTIONS[opts])
    q, k, v = rand(b, sq, 4, 8, seed=1), rand(b, sk, 2, 8, seed=2), rand(b, sk, 2, 6, seed=3)
    sinks = rand(4, seed=4) if o.pop("sinks", False) else None
    for t in (q, k, v) + ((sinks,) if sinks is not None else ()):
        t.requires_grad_()
    window = o.pop("window", (-1, -1))
    out, lse = flashtile.flash_attn_func(q, k, v, window_size=window, sinks=sinks, attention_chunk=chunk,
                                         return_lse=True, **o)
    want_out, want_lse = oracle(q, k, v, chunk, window=window, sinks=sinks, **o)
    assert out.shape == (b, sq, 4, 6) and lse.shape == (b, 4, sq)
    assert_matches(out.detach(), lse.detach(), want_out.detach(), want_lse.detach(), "flash_attn_func(attention_chunk)")
    if sq == 0 or sk == 0:
        return
    dout = rand(*out.shape, seed=5)
    fin = torch.isfinite(want_lse)
    dlse = rand(*lse.shape, seed=6) * fin  # the lse of rows that see nothing is -inf: no gradient through it
    inputs = [t for t in (q, k, v, sinks) if t is not None]
    got = torch.autograd.grad((out * dout).sum() + (lse.masked_fill(~fin, 0) * dlse).sum(), inputs)
    want = torch.autograd.grad((want_out * dout).sum() + (want_lse.masked_fill(~fin, 0) * dlse).sum(), inputs)
    for name, a, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a, w, rtol=0, atol=1e-11, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("sq, sk, chunk", [(s, t, c) for s in (1, 3, 8, 9) for t in (0, 1, 8, 9, 30) for c in (1, 4, 8)])
def test_chunk_lengths_partition_queries_and_keys(sq, sk, chunk):
    lens_q, lens_k = chunked.chunk_lengths(sq, sk, chunk)
    assert sum(lens_q) == sq and sum(lens_k) == sk, "every query row and key in exactly one chunk"
    assert max(lens_q) <= chunk and max(lens_k) <= chunk
    # Bottom-right alignment inside each chunk: the last query row of a chunk with keys sits at
    # its last key's position; queries of a chunk without keys sit before key 0.
    off, row, key = sk - sq, 0, 0
    for nq, nk in zip(lens_q, lens_k):
        if nq:
            last = off + row + nq - 1
            assert (last == key + nk - 1) if nk else last < 0, (lens_q, lens_k)
        row, key = row + nq, key + nk


def test_packed_offsets_are_memoised_per_shape():
    a = chunked.packed_offsets(2, 10, 10, 4, torch.device("cpu"))
    assert chunked.packed_offsets(2, 10, 10, 4, torch.device("cpu")) is a
    assert a[0].tolist() == [0, 4, 8, 10, 14, 18, 20] and a[1].tolist() == a[0].tolist() and a[2:] == (4, 4, 3)


def test_within_one_chunk_runs_plain_attention():
    q, k, v = rand(1, 5, 2, 8, seed=7), rand(1, 9, 2, 8, seed=8), rand(1, 9, 2, 8, seed=9)
    got = flashtile.flash_attn_func(q, k, v, causal=True, attention_chunk=16)
    assert torch.equal(got, flashtile.flash_attn_func(q, k, v, causal=True))


def test_fp8_inputs_are_chunked_with_their_descales():
    fp8 = torch.float8_e4m3fn
    q, k, v = (rand(2, n, h, 16, seed=10 + i).to(fp8) for i, (n, h) in enumerate(((9, 4), (9, 2), (9, 2))))
    qd, kd, vd = (rand(2, 2, seed=20 + i).float().abs() + 0.5 for i in range(3))
    out = flashtile.flash_attn_func(q, k, v, causal=True, attention_chunk=4, q_descale=qd, k_descale=kd, v_descale=vd)

    def real(x, d):
        return x.double() * d.double().repeat_interleave(x.shape[2] // 2, dim=1)[:, None, :, None]

    want, _ = oracle(real(q, qd), real(k, kd), real(v, vd), 4, causal=True)
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)  # out in bfloat16


@pytest.mark.parametrize("value, kind", [(-1, ValueError), (2.5, TypeError), (True, TypeError), ("8", TypeError)])
def test_bad_chunk_sizes_are_refused(value, kind):
    q = rand(1, 4, 2, 8, seed=1)
    with pytest.raises(kind, match="attention_chunk"):
        flashtile.flash_attn_func(q, q, q, attention_chunk=value)
    with pytest.raises(kind, match="attention_chunk"):
        flashtile.flash_attn_with_kvcache(q[:, :1], q, q, cache_seqlens=4, attention_chunk=value)


def test_compile_fullgraph_traces_the_chunked_call():
    q, k, v = (rand(2, 10, 2, 16, seed=30 + i).requires_grad_() for i in range(3))
    fn = lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True, attention_chunk=4, return_lse=True)  # noqa: E731
    got = torch.compile(fn, fullgraph=True, backend="eager")(q, k, v)
    want = fn(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    g_got = torch.autograd.grad(got[0].sum(), (q, k, v))
    g_want = torch.autograd.grad(want[0].sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(g_got, g_want))


# --- KV cache ---------------------------------------------------------------------------------

KV_CASES = {
    # (batch, seqlen_q, seqlen_new, chunk, options)
    "decode": (3, 1, 1, 4, dict(causal=True)),
    "decode-no-append-full": (2, 1, 0, 5, {}),
    "speculative": (2, 4, 4, 3, dict(causal=True)),
    "speculative-window-leftpad": (2, 3, 1, 4, dict(causal=True, window=(2, -1), leftpad=True)),
    "more-queries-than-new": (1, 5, 2, 4, dict(causal=True, leftpad=True)),
    "sinks-softcap": (3, 2, 2, 8, dict(causal=True, sinks=True, softcap=3.0)),
    "chunked-prefill": (2, 11, 11, 3, dict(causal=True, leftpad=True)),  # 11 tokens over 4-5 chunks
}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", KV_CASES, ids=list(KV_CASES))
def test_kvcache_matches_oracle(case, paged):
    b, sq, snew, chunk, opts = KV_CASES[case]
    o = dict(opts)
    hkv, h, d, cap = 2, 4, 8, 32
    k_full, v_full = rand(b, cap, hkv, d, seed=40), rand(b, cap, hkv, d, seed=41)
    lens = torch.tensor([13, 7, 20][:b], dtype=torch.int32)
    q = rand(b, sq, h, d, seed=42)
    k_new = rand(b, snew, hkv, d, seed=43) if snew else None
    v_new = rand(b, snew, hkv, d, seed=44) if snew else None
    leftpad = torch.tensor([2, 5, 1][:b], dtype=torch.int32) if o.pop("leftpad", False) else None
    sinks = rand(h, seed=45) if o.pop("sinks", False) else None
    window = o.pop("window", (-1, -1))
    kw = dict(cache_seqlens=lens, cache_leftpad=leftpad, window_size=window, sinks=sinks, attention_chunk=chunk,
              return_lse=True, **o)
    if paged:  # pages of 8 in a shuffled table
        page = 8
        table = torch.randperm(b * cap // page, generator=torch.Generator().manual_seed(46)).to(torch.int32).view(b, -1)
        k_cache, v_cache = torch.empty(b * cap // page, page, hkv, d, dtype=F64), torch.empty(b * cap // page, page, hkv, d, dtype=F64)
        k_cache[table.flatten().long()] = k_full.reshape(-1, page, hkv, d)
        v_cache[table.flatten().long()] = v_full.reshape(-1, page, hkv, d)
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, block_table=table, **kw)
        keys = k_cache[table.long()].reshape(b, cap, hkv, d)
        values = v_cache[table.long()].reshape(b, cap, hkv, d)
    else:
        keys, values = k_full.clone(), v_full.clone()
        out, lse = flashtile.flash_attn_with_kvcache(q, keys, values, k_new, v_new, **kw)
    want_out, want_lse = oracle(q, keys, values, chunk, window=window, sinks=sinks, seqlens=lens + snew,
                                leftpad=leftpad, **o)
    assert_matches(out, lse, want_out, want_lse, f"flash_attn_with_kvcache(attention_chunk) {case}")


@pytest.mark.parametrize("b, sq", [(0, 1), (2, 0), (0, 0)])
def test_kvcache_empty_batch_or_queries(b, sq):
    q, cache = rand(b, sq, 2, 8, seed=1), rand(b, 16, 2, 8, seed=2)
    out, lse = flashtile.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=9, causal=True,
                                                 attention_chunk=4, return_lse=True)
    assert out.shape == (b, sq, 2, 8) and lse.shape == (b, 2, sq)


def test_kvcache_several_tokens_need_causal():
    q = rand(1, 2, 2, 8, seed=1)
    cache = rand(1, 16, 2, 8, seed=2)
    with pytest.raises(NotImplementedError, match="causal=True"):
        flashtile.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=9, attention_chunk=4)


def test_kvcache_compile_fullgraph():
    q, kc, vc = rand(2, 3, 2, 16, seed=50), rand(2, 16, 2, 16, seed=51), rand(2, 16, 2, 16, seed=52)
    lens = torch.tensor([9, 14], dtype=torch.int32)
    fn = lambda q, kc, vc, lens: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,  # noqa: E731
                                                                   attention_chunk=4)
    assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(q, kc, vc, lens), fn(q, kc, vc, lens))


# --- packed batches -----------------------------------------------------------------------------

VARLEN_LENGTHS = [(3, 5), (0, 1), (7, 7), (9, 4), (1, 0), (12, 12)]  # rows before key 0, empty sequences


def packed(lengths, seed=60):
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    cu_q, cu_k = cu([a for a, _ in lengths]), cu([b for _, b in lengths])
    q = rand(int(cu_q[-1]), 4, 8, seed=seed)
    k, v = rand(int(cu_k[-1]), 2, 8, seed=seed + 1), rand(int(cu_k[-1]), 2, 6, seed=seed + 2)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("opts", OPTIONS, ids=list(OPTIONS))
@pytest.mark.parametrize("chunk", [1, 4, 5])
@pytest.mark.parametrize("seqused", [False, True], ids=["all", "seqused"])
def test_varlen_matches_oracle_per_sequence_with_gradients(opts, chunk, seqused):
    o = dict(OPTIONS[opts])
    q, k, v, cu_q, cu_k = packed(VARLEN_LENGTHS)
    used_q = torch.tensor([2, 0, 7, 5, 1, 9], dtype=torch.int32) if seqused else None
    used_k = torch.tensor([5, 1, 3, 4, 0, 11], dtype=torch.int32) if seqused else None
    sinks = rand(4, seed=4) if o.pop("sinks", False) else None
    window = o.pop("window", (-1, -1))
    for t in (q, k, v) + ((sinks,) if sinks is not None else ()):
        t.requires_grad_()
    out, lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, window_size=window, sinks=sinks,
                                                attention_chunk=chunk, return_lse=True, seqused_q=used_q,
                                                seqused_k=used_k, **o)
    want_out, want_lse = torch.zeros_like(out), torch.full_like(lse, -math.inf)
    for b in range(len(VARLEN_LENGTHS)):
        qs, ks = int(cu_q[b]), int(cu_k[b])
        nq = int(cu_q[b + 1]) - qs if used_q is None else int(used_q[b])
        nk = int(cu_k[b + 1]) - ks if used_k is None else int(used_k[b])
        ob, lb = oracle(q[None, qs : qs + nq], k[None, ks : ks + nk], v[None, ks : ks + nk], chunk, window=window,
                        sinks=sinks, **o)
        want_out[qs : qs + nq] = ob[0]
        want_lse[:, qs : qs + nq] = lb[0]
    assert_matches(out.detach(), lse.detach(), want_out.detach(), want_lse.detach(), "varlen attention_chunk")
    fin = torch.isfinite(want_lse)
    dout, dlse = rand(*out.shape, seed=70), rand(*lse.shape, seed=71) * fin
    inputs = [t for t in (q, k, v, sinks) if t is not None]
    got = torch.autograd.grad((out * dout).sum() + (lse.masked_fill(~fin, 0) * dlse).sum(), inputs)
    want = torch.autograd.grad((want_out * dout).sum() + (want_lse.masked_fill(~fin, 0) * dlse).sum(), inputs)
    for name, a, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a, w, rtol=0, atol=1e-11, msg=lambda m: f"{name}: {m}")


def test_varlen_sequences_are_computed_without_reading_lengths_on_the_host():
    cu_q = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    got_q, got_k, su_q, su_k, max_q, max_k, per_seq = chunked.varlen_sequences(cu_q, cu_k, None, None, 7, 7, 4)
    assert per_seq == 5 and (max_q, max_k) == (4, 4) and su_q is None and su_k is None
    lens_q, lens_k = (x[1:] - x[:-1] for x in (got_q, got_k))
    for b, (lq, lk) in enumerate([(3, 5), (0, 1), (7, 7)]):
        want_q, want_k = chunked.chunk_lengths(lq, lk, 4) if lq else ([0], [lk])
        assert lens_q[5 * b : 5 * b + len(want_q)].tolist() == want_q and lens_k[5 * b : 5 * b + len(want_k)].tolist() == want_k
        assert lens_q[5 * b : 5 * b + 5].sum() == lq and lens_k[5 * b : 5 * b + 5].sum() == lk


def test_varlen_compile_fullgraph():
    q, k, v, cu_q, cu_k = packed(VARLEN_LENGTHS)
    fn = lambda q, k, v: flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, causal=True,  # noqa: E731
                                                          attention_chunk=4, return_lse=True)
    got = torch.compile(fn, fullgraph=True, backend="eager")(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(got, fn(q, k, v)))


def test_varlen_fp8_descales_follow_each_sequence_into_its_chunks():
    fp8 = torch.float8_e4m3fn
    lengths = [(6, 9), (9, 9)]
    q, k, v, cu_q, cu_k = packed(lengths, seed=80)
    q8, k8, v8 = (x.float().to(fp8) for x in (q, k, v))
    qd, kd, vd = (rand(2, 2, seed=90 + i).float().abs() + 0.5 for i in range(3))
    out = flashtile.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, 9, 9, causal=True, attention_chunk=4, q_descale=qd,
                                           k_descale=kd, v_descale=vd)
    for b in range(2):
        qs, ks = int(cu_q[b]), int(cu_k[b])
        nq, nk = lengths[b]
        real = lambda x, d: x.double() * d[b].double().repeat_interleave(x.shape[1] // 2)[None, :, None]  # noqa: E731
        want, _ = oracle(real(q8[qs : qs + nq], qd)[None], real(k8[ks : ks + nk], kd)[None],
                         real(v8[ks : ks + nk], vd)[None], 4, causal=True)
        torch.testing.assert_close(out[qs : qs + nq].double(), want[0], rtol=1e-2, atol=1e-2,
                                   msg=lambda m: f"sequence {b} (its own descales): {m}")


def test_kvcache_fp8_cache_with_chunks():
    """An FP8 cache with chunks: the oracle over the dequantized cache (and the appended tokens
    as the cache stores them)."""
    fp8 = torch.float8_e4m3fn
    b, hkv, h, d = 2, 2, 4, 16
    k_cache = rand(b, 32, hkv, d, seed=120).float().to(fp8)
    v_cache = rand(b, 32, hkv, d, seed=121).float().to(fp8)
    kd, vd = (rand(b, hkv, seed=122 + i).float().abs() + 0.5 for i in range(2))
    lens = torch.tensor([13, 7], dtype=torch.int32)
    q = rand(b, 3, h, d, seed=124).float()
    k_new, v_new = rand(b, 3, hkv, d, seed=125).float(), rand(b, 3, hkv, d, seed=126).float()
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True,
                                            k_descale=kd, v_descale=vd, attention_chunk=4)
    real = lambda c, dsc: c.double() * dsc.double()[:, None, :, None]  # noqa: E731
    want, _ = oracle(q.double(), real(k_cache, kd), real(v_cache, vd), 4, causal=True, seqlens=lens + 3)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
