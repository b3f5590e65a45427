"""Degenerate shapes get a defined answer: empty batch, empty sequences, zero query heads.

Every public entry point returns correctly shaped empty (or zero / -inf) outputs and
correctly shaped gradients instead of failing deep inside; ``nheads_kv == 0`` is a named
``ValueError``.  (Found by the fuzz tests: ``q`` of shape (0, 8, 4, 16) used to raise
``RuntimeError: cannot reshape tensor of 0 elements`` from ``reference.attention_forward``.)
"""

from __future__ import annotations

import pytest
import torch

import flashtile

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv)
SHAPES = [
    (0, 8, 8, 4, 2),  # empty batch
    (2, 0, 8, 4, 2),  # no queries
    (2, 5, 0, 4, 2),  # no keys: out 0, lse -inf (or the sink)
    (2, 8, 8, 0, 1),  # no query heads
    (0, 0, 0, 0, 1),  # everything empty
    (1, 1, 1, 1, 1),  # smallest non-empty
]


def _inputs(b, sq, sk, h, hkv, d=16, dv=8, dtype=torch.float64):
    q = torch.randn(b, sq, h, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hkv, dv, dtype=dtype, requires_grad=True)
    sinks = torch.randn(h, dtype=dtype, requires_grad=True)
    return q, k, v, sinks


@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-sq{}-sk{}-h{}-hkv{}".format(*s))
def test_flash_attn_func_degenerate(shape, causal, use_sinks):
    b, sq, sk, h, hkv = shape
    q, k, v, sinks = _inputs(*shape)
    s = sinks if use_sinks else None
    out, lse = flashtile.flash_attn_func(q, k, v, causal=causal, sinks=s, return_lse=True)
    assert out.shape == (b, sq, h, 8) and lse.shape == (b, h, sq)
    if sk == 0:
        assert torch.equal(out, torch.zeros_like(out))
        want = sinks.detach()[None, :, None].expand_as(lse) if use_sinks else torch.full_like(lse, float("-inf"))
        assert torch.equal(lse, want.to(lse.dtype))
    loss = (out * torch.randn_like(out)).sum() + lse.where(lse.isfinite(), 0).sum()
    grads = torch.autograd.grad(loss, (q, k, v, s) if use_sinks else (q, k, v), allow_unused=False)
    for g, x in zip(grads, (q, k, v, s)):
        assert g.shape == x.shape and bool(g.isfinite().all())
    if sk == 0 and use_sinks:
        # lse = sink for every row: d loss / d sink_h = number of rows of head h.
        assert torch.allclose(grads[3], torch.full_like(sinks, b * sq))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-sq{}-sk{}-h{}-hkv{}".format(*s))
def test_double_backward_degenerate(shape):
    q, k, v, sinks = _inputs(*shape)
    out, lse = flashtile.flash_attn_func(q, k, v, sinks=sinks, return_lse=True)
    loss = out.sum() + lse.where(lse.isfinite(), 0).sum()
    grads = torch.autograd.grad(loss, (q, k, v, sinks), create_graph=True)
    second = torch.autograd.grad(sum(g.square().sum() for g in grads), (q, k, v, sinks), allow_unused=True)
    for g, x in zip(second, (q, k, v, sinks)):
        assert g is None or g.shape == x.shape


@pytest.mark.parametrize("shape", [(0, 4, 6, 2, 2), (2, 4, 0, 2, 2), (2, 0, 6, 2, 2), (1, 4, 6, 2, 2)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_degenerate(shape, is_causal):
    b, sq, sk, h, hkv = shape
    q, k, v, _ = _inputs(*shape)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out = flashtile.scaled_dot_product_attention(qt, kt, vt, is_causal=is_causal)
    assert out.shape == (b, h, sq, 8)
    if sk == 0:
        assert torch.equal(out, torch.zeros_like(out))
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert gq.shape == q.shape and gk.shape == k.shape and gv.shape == v.shape


def test_zero_kv_heads_is_a_named_error():
    q, k, v, _ = _inputs(2, 4, 4, 0, 1)
    with pytest.raises(ValueError, match="nheads_kv"):
        flashtile.flash_attn_func(q, k[:, :, :0], v[:, :, :0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_empty_batch(dtype):
    q, k, v, _ = _inputs(0, 8, 8, 4, 4, dtype=dtype)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert out.shape == (0, 8, 4, 8) and out.dtype == dtype
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_minus_inf_sink_on_a_row_that_sees_nothing():
    """A -inf sink means "no sink"; on a row that sees no key lse is -inf and the sink's
    gradient must be 0, not exp(-inf - -inf) = NaN.  (Found by tests/test_fuzz.py:
    b=1, sq=1, sk=0, sinks=[-inf] gave dsinks = nan.)"""
    q = torch.randn(1, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 1, 4, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([-float("inf"), 0.5], dtype=torch.float64, requires_grad=True)
    for kk, vv, window in ((k[:, :0], v[:, :0], (-1, -1)), (k, v, (0, 0))):  # no keys / row 0 sees none
        out, lse = flashtile.flash_attn_func(q, kk, vv, sinks=sinks, window_size=window, return_lse=True)
        loss = out.sum() + lse.where(lse.isfinite(), 0).sum()
        gs = torch.autograd.grad(loss, (q, kk, vv, sinks) if kk.shape[1] else (q, sinks))
        assert all(bool(g.isfinite().all()) for g in gs)


# --- the same on CUDA (marker gpu): the kernels' launchers against the CPU reference -----------

GPU_SHAPES = SHAPES + [(2, 17, 0, 4, 2)]


def _cuda_vs_cpu(shape, *, sinks_value=None, causal=False, window=(-1, -1), deterministic=False, d=64, dv=64,
                 devices=("cuda", "cpu")):
    b, sq, sk, h, hkv = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, h, d, generator=gen).bfloat16()
    k = torch.randn(b, sk, hkv, d, generator=gen).bfloat16()
    v = torch.randn(b, sk, hkv, dv, generator=gen).bfloat16()
    sinks = None if sinks_value is None else torch.full((h,), sinks_value)
    dout = torch.randn(b, sq, h, dv, generator=gen).bfloat16()
    dlse = torch.randn(b, h, sq, generator=gen)
    results = []
    for device in devices:
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        s = None if sinks is None else sinks.to(device).requires_grad_()
        out, lse = flashtile.flash_attn_func(*leaves, sinks=s, causal=causal, window_size=window,
                                             deterministic=deterministic, return_lse=True)
        loss = (out.float() * dout.to(device).float()).sum() + torch.where(lse.isfinite(), lse, 0.0).mul(dlse.to(device)).sum()
        grads = torch.autograd.grad(loss, leaves + ([s] if s is not None else []))
        results.append([t.detach().float().cpu() for t in (out, lse, *grads)])
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("sinks_value", [None, 0.5])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "b{}-sq{}-sk{}-h{}-hkv{}".format(*s))
def test_cuda_degenerate_matches_reference(shape, sinks_value, deterministic):
    """Empty batch/sequences/heads on CUDA: same shapes and values as the CPU reference,
    including dsinks when no key exists (lse = sink, so d lse / d sink = 1 per row)."""
    got, want = _cuda_vs_cpu(shape, sinks_value=sinks_value, causal=True, deterministic=deterministic)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, atol=3e-2, rtol=3e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
def test_cuda_minus_inf_sink_on_rows_that_see_nothing():
    """Window (0, 0) with seqlen_q > seqlen_k: the first rows see no key; with a -inf sink their
    lse is -inf and dsinks must stay finite (exp(-inf - -inf) is NaN)."""
    got, want = _cuda_vs_cpu((1, 9, 4, 2, 1), sinks_value=-float("inf"), window=(0, 0))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(g, w, atol=3e-2, rtol=3e-2, msg=lambda m: f"{name}: {m}")


# --- flash_attn_with_kvcache --------------------------------------------------------------------


@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize(
    "b, sq, h, hkv, snew, lens",
    [(0, 1, 4, 2, 1, []), (2, 0, 4, 2, 1, [3, 4]), (2, 1, 0, 2, 1, [3, 4]), (2, 3, 4, 2, 0, [0, 5]), (1, 2, 2, 1, 0, [0])],
    ids=["batch0", "sq0", "nheads0", "one-entry-no-keys", "no-keys"],
)
def test_kvcache_degenerate(b, sq, h, hkv, snew, lens, use_sinks):
    """Batch 0, no query tokens, no query heads, entries with no key: defined outputs
    (zeros and lse -inf, or the sink's logit, where no key is visible).  (Batch 0 used to fail
    in ``reference.kvcache_attention`` with ``torch.cat(): expected a non-empty list``.)"""
    q = torch.randn(b, sq, h, 16)
    k_cache, v_cache = torch.randn(b, 8, hkv, 16), torch.randn(b, 8, hkv, 8)
    kw = dict(k=torch.randn(b, snew, hkv, 16), v=torch.randn(b, snew, hkv, 8)) if snew else {}
    sinks = torch.randn(h) if use_sinks else None
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                                 causal=True, sinks=sinks, return_lse=True, **kw)
    assert out.shape == (b, sq, h, 8) and lse.shape == (b, h, sq)
    for i, n in enumerate(lens):
        if n + snew == 0:  # nothing to attend to
            assert torch.equal(out[i], torch.zeros_like(out[i]))
            want = sinks[:, None].expand(h, sq) if use_sinks else torch.full((h, sq), -float("inf"))
            assert torch.equal(lse[i], want)


def test_kvcache_empty_cache_is_a_named_error():
    q = torch.randn(2, 1, 4, 16)
    with pytest.raises(ValueError, match=r"k_cache\.shape\[1\]"):
        flashtile.flash_attn_with_kvcache(q, torch.randn(2, 0, 2, 16), torch.randn(2, 0, 2, 8), cache_seqlens=0)


@pytest.mark.parametrize("what", ["block_table=-1", "block_table=num_blocks", "cache_batch_idx=-1", "cache_batch_idx=batch_cache"])
def test_kvcache_out_of_range_indices_are_named_errors(what):
    """Found by tests/test_fuzz.py::test_kvcache_any_lengths_give_an_answer_or_a_named_error
    (negative entries wrapped silently, large ones raised IndexError; on CUDA they would have
    read outside the cache); kvcache.py range-checks the used entries now."""
    q = torch.randn(1, 1, 4, 8)
    if what.startswith("block_table"):
        k_cache, v_cache = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
        table = torch.tensor([[-1 if what.endswith("-1") else 2, 0]], dtype=torch.int32)
        kw = dict(block_table=table)
    else:
        k_cache, v_cache = torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8)
        kw = dict(cache_batch_idx=torch.tensor([-1 if what.endswith("-1") else 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table|cache_batch_idx"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1, **kw)

