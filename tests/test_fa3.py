"""flash-attn 3 call sites work unchanged through ``flashtile.fa3``; flash-attn 2's remaining
signature details (``block_table`` in the varlen call, ``cache_seqlens=None``,
``return_softmax_lse`` and ``alibi_slopes`` in the KV-cache call).

Each fa3 call is compared, bitwise on CPU (the same reference runs underneath), with the
flashtile call it maps to; the orders below are copied from flash-attn 3's
``hopper/flash_attn_interface.py`` (Dao-AILab/flash-attention, 2026-08).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import flashtile
from flashtile import fa3
from flashtile.fp8 import DTYPE as FP8

FA3_DENSE = ["q", "k", "v", "softmax_scale", "causal", "qv", "q_descale", "k_descale", "v_descale", "window_size",
             "attention_chunk", "softcap", "num_splits", "pack_gqa", "deterministic", "sm_margin", "return_attn_probs"]
FA3_VARLEN = FA3_DENSE[:3] + ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_q",
                              "seqused_k"] + FA3_DENSE[3:]
FA3_KVCACHE = ["q", "k_cache", "v_cache", "k", "v", "qv", "rotary_cos", "rotary_sin", "cache_seqlens",
               "cache_batch_idx", "cache_leftpad", "page_table", "cu_seqlens_q", "cu_seqlens_k_new", "max_seqlen_q",
               "rotary_seqlens", "q_descale", "k_descale", "v_descale", "softmax_scale", "causal", "window_size",
               "attention_chunk", "softcap", "rotary_interleaved", "scheduler_metadata", "num_splits", "pack_gqa",
               "sm_margin", "return_softmax_lse"]


def rand(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def positional(fn):
    return [n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]


@pytest.mark.parametrize("fn, order", [(fa3.flash_attn_func, FA3_DENSE), (fa3.flash_attn_varlen_func, FA3_VARLEN),
                                       (fa3.flash_attn_with_kvcache, FA3_KVCACHE)])
def test_positional_orders_are_flash_attn_3s(fn, order):
    assert positional(fn) == order, f"{fn.__name__}: positional parameters differ from flash-attn 3's"


def test_dense_positional_call_site_equals_flashtile():
    q, k, v = rand(2, 9, 4, 16, seed=1), rand(2, 11, 2, 16, seed=2), rand(2, 11, 2, 8, seed=3)
    got = fa3.flash_attn_func(q, k, v, 0.3, True, None, None, None, None, (4, -1), 0, 2.5)
    want = flashtile.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, window_size=(4, -1), softcap=2.5)
    assert torch.equal(got, want), "fa3.flash_attn_func(q, k, v, scale, causal, ..., window, 0, softcap) != flashtile's"


def test_dense_return_attn_probs_is_out_and_lse_with_gradients():
    q, k, v = (x.requires_grad_() for x in (rand(1, 5, 2, 8, seed=4), rand(1, 7, 2, 8, seed=5), rand(1, 7, 2, 8, seed=6)))
    result = fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 2, "flash-attn 3 returns (out, softmax_lse)"
    out, lse = result
    want_out, want_lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    loss = lambda o, l: (o * rand(*o.shape, seed=7)).sum() + l.sin().sum()  # noqa: E731
    got = torch.autograd.grad(loss(out, lse), (q, k, v))
    want = torch.autograd.grad(loss(want_out, want_lse), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        assert torch.equal(a, b), f"d{name} through fa3.flash_attn_func differs from flashtile's"


def test_varlen_positional_call_site_with_seqused_equals_flashtile():
    cu_q = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    used_k = torch.tensor([4, 1, 7], dtype=torch.int32)
    q, k, v = rand(10, 4, 16, seed=8), rand(13, 2, 16, seed=9), rand(13, 2, 16, seed=10)
    got, got_lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, None, used_k, 0.25, True,
                                              return_attn_probs=True)
    want, want_lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, softmax_scale=0.25, causal=True,
                                                      seqused_k=used_k, return_lse=True)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse), "fa3 varlen != flashtile's"


def paged_case(dtype=torch.float32):
    b, h, hkv, d, page = 2, 4, 2, 16, 4
    k_cache, v_cache = rand(6, page, hkv, d, dtype=dtype, seed=11), rand(6, page, hkv, d, dtype=dtype, seed=12)
    table = torch.tensor([[4, 1, 3], [0, 5, 2]], dtype=torch.int32)
    seqlens = torch.tensor([5, 2], dtype=torch.int32)
    q = rand(b, 2, h, d, dtype=dtype, seed=13)
    k, v = rand(b, 2, hkv, d, dtype=dtype, seed=14), rand(b, 2, hkv, d, dtype=dtype, seed=15)
    return q, k_cache, v_cache, k, v, table, seqlens


def test_kvcache_positional_call_site_equals_flashtile():
    q, k_cache, v_cache, k, v, table, seqlens = paged_case()
    cos, sin = rand(16, 4, seed=16), rand(16, 4, seed=17)
    caches = (k_cache.clone(), v_cache.clone())
    got, got_lse, *rest = fa3.flash_attn_with_kvcache(
        q, *caches, k, v, None, cos.float(), sin.float(), seqlens, None, None, table, None, None, None, None,
        None, None, None, 0.2, True, (-1, -1), 0, 3.0, False, None, 0, None, 0, True)
    want_caches = (k_cache.clone(), v_cache.clone())
    want, want_lse = flashtile.flash_attn_with_kvcache(
        q, *want_caches, k, v, cos.float(), sin.float(), seqlens, block_table=table, softmax_scale=0.2, causal=True,
        softcap=3.0, rotary_interleaved=False, return_lse=True)
    assert rest == [], "flashtile returns (out, lse); flash-attn 3 callers unpack extra buffers with *rest"
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse), "fa3 kvcache output != flashtile's"
    for name, a, b in zip(("k_cache", "v_cache"), caches, want_caches):
        assert torch.equal(a, b), f"{name} after the fa3 append differs from flashtile's"


def fp8_qkv(b=2, sq=9, sk=12, h=4, hkv=2, d=16):
    q, k, v = (rand(b, s, n, d, dtype=torch.float32, seed=20 + i).to(FP8) for i, (s, n) in enumerate(((sq, h), (sk, hkv), (sk, hkv))))
    descales = [rand(b, hkv, dtype=torch.float32, seed=30 + i).abs() + 0.5 for i in range(3)]
    return q, k, v, descales


def test_fp8_forward_with_descales_equals_flashtile_and_none_means_one():
    q, k, v, (qd, kd, vd) = fp8_qkv()
    got = fa3.flash_attn_func(q, k, v, None, True, None, qd, kd, vd)
    want = flashtile.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want), "fa3 FP8 forward != flashtile's"
    ones = torch.ones_like(qd)
    got = fa3.flash_attn_func(q, k, v, causal=True, k_descale=kd)
    want = flashtile.flash_attn_func(q, k, v, causal=True, q_descale=ones, k_descale=kd, v_descale=ones)
    assert torch.equal(got, want), "an FP8 descale left None must count as 1.0 (flash-attn 3)"


def test_fp8_cache_takes_fp8_q_and_new_tokens_and_stores_their_bytes():
    q16, k_cache16, v_cache16, k16, v16, table, seqlens = paged_case()
    k_cache, v_cache = k_cache16.to(FP8), v_cache16.to(FP8)
    q8, k8, v8 = q16.to(FP8), k16.to(FP8), v16.to(FP8)
    qd, kd, vd = (rand(2, 2, dtype=torch.float32, seed=40 + i).abs() + 0.25 for i in range(3))
    out, lse = fa3.flash_attn_with_kvcache(q8, k_cache, v_cache, k8, v8, cache_seqlens=seqlens, page_table=table,
                                           q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
                                           return_softmax_lse=True)
    # The appended rows hold the new tokens' own bytes.
    for b in range(2):
        for t in range(2):
            pos = int(seqlens[b]) + t
            page, row = int(table[b, pos // 4]), pos % 4
            for name, cache, new in (("k", k_cache, k8), ("v", v_cache, v8)):
                assert torch.equal(cache[page, row].view(torch.uint8), new[b, t].view(torch.uint8)), \
                    f"{name}_cache[{page}, {row}] (entry {b}, token {t}) is not the appended FP8 bytes"
    # The output is flashtile's FP8-cache decode of q's real values (q8 x q_descale in bfloat16).
    q_real = (q8.float() * qd.repeat_interleave(2, dim=1)[:, None, :, None]).to(torch.bfloat16)
    want, want_lse = flashtile.flash_attn_with_kvcache(q_real, k_cache, v_cache, cache_seqlens=seqlens + 2,
                                                       block_table=table, causal=True, k_descale=kd, v_descale=vd,
                                                       return_lse=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want) and torch.equal(lse, want_lse)


def test_get_scheduler_metadata_is_a_hint_flashtile_does_not_need():
    q, k_cache, v_cache, k, v, table, seqlens = paged_case()
    meta = fa3.get_scheduler_metadata(2, 2, 12, 4, 2, 16, seqlens, torch.float32, page_size=4, causal=True)
    assert meta is None
    out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table,
                                      scheduler_metadata=meta)
    assert out.shape == (2, 2, 4, 16)


@pytest.mark.parametrize("fn_name, kwargs, arg", [
    ("flash_attn_func", dict(qv=rand(2, 9, 4, 8)), "qv"),
    ("flash_attn_with_kvcache", dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32)), "cu_seqlens_q"),
    ("flash_attn_with_kvcache", dict(cu_seqlens_k_new=torch.tensor([0, 2, 4], dtype=torch.int32)), "cu_seqlens_k_new"),
    ("flash_attn_with_kvcache", dict(max_seqlen_q=2), "max_seqlen_q"),
    ("flash_attn_with_kvcache", dict(rotary_seqlens=torch.tensor([1, 2], dtype=torch.int32)), "rotary_seqlens"),
])
def test_unimplemented_flash_attn_3_options_are_refused_naming_them(fn_name, kwargs, arg):
    with pytest.raises(NotImplementedError, match=arg):
        _call(fn_name, **kwargs)


@pytest.mark.parametrize("kwargs, kind, arg", [
    (dict(attention_chunk="64"), TypeError, "attention_chunk"),
    (dict(pack_gqa=1), TypeError, "pack_gqa"),
    (dict(sm_margin=-1), ValueError, "sm_margin"),
    (dict(num_splits=1.5), TypeError, "num_splits"),
    (dict(return_attn_probs=1), TypeError, "return_attn_probs"),
])
def test_hints_and_flags_are_type_checked(kwargs, kind, arg):
    with pytest.raises(kind, match=arg):
        _call("flash_attn_func", **kwargs)


def test_kvcache_q_descale_without_fp8_is_refused():
    with pytest.raises(ValueError, match="q_descale"):
        _call("flash_attn_with_kvcache", q_descale=torch.ones(2, 2))


def test_hints_do_not_change_results():
    q, k, v = rand(2, 9, 4, 16, seed=1), rand(2, 11, 2, 16, seed=2), rand(2, 11, 2, 16, seed=3)
    plain = fa3.flash_attn_func(q, k, v, causal=True)
    hinted = fa3.flash_attn_func(q, k, v, causal=True, num_splits=4, pack_gqa=True, sm_margin=8)
    assert torch.equal(plain, hinted)


def _call(fn_name, **kwargs):
    if fn_name == "flash_attn_func":
        return fa3.flash_attn_func(rand(2, 9, 4, 16), rand(2, 11, 2, 16), rand(2, 11, 2, 16), **kwargs)
    if fn_name == "flash_attn_varlen_func":
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        return fa3.flash_attn_varlen_func(rand(9, 4, 16), rand(9, 2, 16), rand(9, 2, 16), cu, cu, 5, 5, **kwargs)
    q, k_cache, v_cache, k, v, table, seqlens = paged_case()
    return fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table, **kwargs)


# --- flash-attn 2's remaining signature details -------------------------------------------------


def test_varlen_block_table_is_flash_attn_2s_paged_kv():
    """flash-attn 2's 16th positional argument: k / v are page caches read through the table
    (entries past a sequence's pages may be -1); equal to the call on the gathered keys, and the
    gradients reach the pages."""
    assert positional(flashtile.flash_attn_varlen_func)[15] == "block_table"
    lens_q, lens_k, page = [3, 1, 6], [5, 0, 9], 4
    cu_q = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    q = rand(10, 4, 8, seed=140)
    k_pages, v_pages = rand(8, page, 2, 8, seed=141).requires_grad_(), rand(8, page, 2, 8, seed=142).requires_grad_()
    table = torch.tensor([[3, 6, -1], [-1, -1, -1], [0, 7, 2]], dtype=torch.int32)
    got = flashtile.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 6, 9, 0.0, None, True, (-1, -1), 0.0,
                                           None, False, False, table)
    gathered = [torch.cat([x[p] for p in table[b].tolist() if p >= 0])[:n] if n else x[0, :0]
                for x in (k_pages, v_pages) for b, n in enumerate(lens_k)]
    k, v = torch.cat(gathered[:3]), torch.cat(gathered[3:])
    want = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 9, causal=True)
    assert torch.equal(got, want), "paged varlen differs from the call on the gathered keys"
    dout = rand(*got.shape, seed=143)
    g_got = torch.autograd.grad((got * dout).sum(), (k_pages, v_pages))
    g_want = torch.autograd.grad((want * dout).sum(), (k_pages, v_pages))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="block_table"):
        flashtile.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 6, 9, block_table=table.long())
    with pytest.raises(ValueError, match="paged cache"):
        flashtile.flash_attn_varlen_func(q, k.detach(), v.detach(), cu_q, cu_k, 6, 9, block_table=table)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_without_cache_seqlens_attends_to_the_whole_cache(paged):
    q, k_cache, v_cache, _, _, table, _ = paged_case()
    if paged:
        full = table.shape[1] * k_cache.shape[1]
        got = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table, causal=True)
        want = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=full, block_table=table, causal=True)
    else:
        k_cache, v_cache = rand(2, 7, 2, 16, dtype=torch.float32, seed=50), rand(2, 7, 2, 16, dtype=torch.float32, seed=51)
        got = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True)
        want = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=7, causal=True)
    assert torch.equal(got, want), "cache_seqlens=None must mean every sequence fills the cache (flash-attn)"


def test_kvcache_without_cache_seqlens_refuses_new_tokens():
    q, k_cache, v_cache, k, v, table, _ = paged_case()
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, block_table=table)


def test_kvcache_flash_attn_2_keywords():
    q, k_cache, v_cache, _, _, table, seqlens = paged_case()
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                                 alibi_slopes=None, return_softmax_lse=True)
    want = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                             return_lse=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                         alibi_slopes=torch.ones(4))
    with pytest.raises(TypeError, match="return_softmax_lse"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                         return_softmax_lse="yes")


def test_compile_fullgraph_traces_the_fa3_call():
    q, k, v = rand(1, 9, 2, 16, seed=60), rand(1, 12, 2, 16, seed=61), rand(1, 12, 2, 16, seed=62)
    fn = lambda q, k, v: fa3.flash_attn_func(q, k, v, 0.3, True, return_attn_probs=True)  # noqa: E731
    got = torch.compile(fn, fullgraph=True, backend="eager")(q, k, v)
    want = fn(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "the compiled fa3 call differs from eager"


# --- flash-attn 2's stacked-tensor entry points (flashtile.qkvpacked) ---------------------------

FA2_STACKED = {
    "flash_attn_qkvpacked_func": ["qkv"],
    "flash_attn_kvpacked_func": ["q", "kv"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
}
FA2_OPTIONS = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
               "return_attn_probs"]


@pytest.mark.parametrize("name", list(FA2_STACKED))
def test_stacked_entry_points_have_flash_attn_2s_orders(name):
    fn = getattr(flashtile, name)
    assert positional(fn) == FA2_STACKED[name] + FA2_OPTIONS, f"{name}: positional parameters differ from flash-attn 2's"


def test_qkvpacked_equals_the_split_call_with_gradients():
    qkv = rand(2, 9, 3, 4, 8, seed=100).requires_grad_()
    got, got_lse, none = flashtile.flash_attn_qkvpacked_func(qkv, 0.0, 0.3, True, (3, -1), 2.0, None, False, True)
    q, k, v = (x.detach().requires_grad_() for x in qkv.unbind(2))
    want, want_lse = flashtile.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, window_size=(3, -1),
                                               softcap=2.0, return_lse=True)
    assert none is None and torch.equal(got, want) and torch.equal(got_lse, want_lse)
    dout = rand(*got.shape, seed=101)
    (dqkv,) = torch.autograd.grad((got * dout).sum(), qkv)
    parts = torch.autograd.grad((want * dout).sum(), (q, k, v))
    assert torch.equal(dqkv, torch.stack(parts, dim=2)), "dqkv is not (dq, dk, dv) stacked"


def test_kvpacked_gqa_and_extras():
    q, kv = rand(2, 5, 4, 8, seed=102), rand(2, 7, 2, 2, 8, seed=103)
    sinks = rand(4, seed=104)
    got = flashtile.flash_attn_kvpacked_func(q, kv, causal=True, sinks=sinks, attention_chunk=3)
    want = flashtile.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=True, sinks=sinks, attention_chunk=3)
    assert torch.equal(got, want)


def test_varlen_stacked_equal_the_split_calls():
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    qkv = rand(11, 3, 4, 8, seed=105)
    got = flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, 7, causal=True)
    want = flashtile.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 7, 7, causal=True)
    assert torch.equal(got, want)
    cu_k = torch.tensor([0, 6, 7, 13], dtype=torch.int32)
    q, kv = rand(11, 4, 8, seed=106), rand(13, 2, 2, 8, seed=107)
    got = flashtile.flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, 7, 6, 0.0, None, True, return_lse=True)
    want = flashtile.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu_k, 7, 6, causal=True, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("name, args, arg", [
    ("flash_attn_qkvpacked_func", (rand(2, 9, 4, 8, seed=1),), "qkv"),       # not stacked
    ("flash_attn_qkvpacked_func", (rand(2, 9, 2, 4, 8, seed=1),), "qkv"),    # 2 where 3 go
    ("flash_attn_kvpacked_func", (rand(2, 9, 4, 8, seed=1), rand(2, 9, 3, 2, 8, seed=2)), "kv"),
    ("flash_attn_varlen_qkvpacked_func", ([1, 2], torch.tensor([0, 1], dtype=torch.int32), 1), "qkv"),
])
def test_stacked_tensors_of_the_wrong_shape_are_refused(name, args, arg):
    with pytest.raises((ValueError, TypeError), match=arg):
        getattr(flashtile, name)(*args)


def test_combine_of_key_halves_equals_attention_over_all_keys():
    """flash-attn 3's flash_attn_combine: the two halves of the keys, each attended to with its
    lse, merge into the attention over all of them (and rows that see no key stay 0 / -inf)."""
    q, k, v = rand(2, 6, 4, 8, seed=130), rand(2, 10, 2, 8, seed=131), rand(2, 10, 2, 8, seed=132)
    halves = [flashtile.flash_attn_func(q, k[:, s], v[:, s], return_lse=True) for s in (slice(0, 4), slice(4, 10))]
    out_partial = torch.stack([o for o, _ in halves]).float()
    lse_partial = torch.stack([l.transpose(1, 2) for _, l in halves]).float()  # (splits, b, s, h)
    lse_partial[:, 0, 2] = -math.inf  # a row no split saw
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.bfloat16)
    want, want_lse = flashtile.flash_attn_func(q, k, v, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 6, 4) and lse.stride(1) == 1
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, 2] = False
    torch.testing.assert_close(out[keep].float(), want[keep].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse[keep], want_lse.transpose(1, 2)[keep].float(), rtol=1e-5, atol=1e-5)
    assert (out[0, 2] == 0).all() and torch.isneginf(lse[0, 2]).all()
    target = torch.empty(2, 6, 4, 8)
    got, _ = fa3.flash_attn_combine(out_partial, lse_partial, out=target)
    assert got is target and torch.equal(target[keep], fa3.flash_attn_combine(out_partial, lse_partial)[0][keep])
    with pytest.raises(ValueError, match="lse_partial"):
        fa3.flash_attn_combine(out_partial, lse_partial[:, :, :3])
