"""Every CUDA entry point captured in a CUDA graph and replayed on new inputs (marker ``gpu``).

Issue 19 asks that every kernel entry point be capturable, issue 16 that a decode step be: no
host synchronisation, no allocation outside the graph's pool, no Python branching on device
values.  Each test warms the call up eagerly (kernels loaded, constants made), captures one call
on static tensors, then for two rounds writes fresh ``torch.randn`` draws into the static inputs
(for decode: advances the cache lengths in place, as a serving loop does), replays, and compares
the graph's outputs with an eager call on the same inputs.  The kernels are deterministic
except for the default backward's dQ (fp32 atomic adds in the order CTAs finish, then rounded to
bf16), so outputs must be bitwise equal, and the default backward's dQ within 1% of its largest
entry (a bf16 rounding step is 0.4%).

Shapes are odd (257 queries, 8 query heads over 2 kv heads) and use the head dims and features
``benchmarks/kernel_cache.sh fill`` builds, so a carried kernel cache makes this file fast.

One command: ``python -m pytest -q -m gpu tests/test_gpu_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch

import flashtile

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def _fill(static, fresh):
    """Copy ``fresh`` tensors into the graph's ``static`` ones (in place: the graph keeps the addresses)."""
    with torch.no_grad():
        for s, f in zip(static, fresh):
            s.copy_(f)


def _capture(fn):
    """Warm ``fn`` up on a side stream, then capture one call: (graph, its outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _same(name, got, want, rtol=0.0):
    """Bitwise equal (``rtol`` 0), or within ``rtol`` of the largest |want| (the atomics' order)."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape}/{got.dtype} vs {want.shape}/{want.dtype}"
    if rtol == 0.0:
        assert torch.equal(got, want), f"{name}: graph replay differs from the eager call " \
            f"(max |diff| {(got.float() - want.float()).abs().max().item():.3e})"
    else:
        err = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        assert err <= rtol * max(scale, 1e-6), f"{name}: graph replay differs from eager by {err:.3e} (scale {scale:.3e})"


def _replays_match(static, draw, call, names, rtol=lambda name: 0.0):
    """Capture ``call`` on ``static``, then twice: ``draw()`` fresh inputs into ``static``,
    replay, and compare the graph's outputs (``names`` in order) with an eager ``call()``."""
    graph, got = _capture(call)
    for _ in range(2):
        _fill(static, draw())
        graph.replay()
        for name, g, w in zip(names, got, call()):
            _same(name, g, w, rtol(name))


def _qkv(b=2, sq=257, sk=257, h=8, hkv=2, d=128, requires_grad=False):
    q = torch.randn(b, sq, h, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=BF16) for _ in range(2))
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_replays(causal):
    static = _qkv()
    _replays_match(static, _qkv, lambda: flashtile.flash_attn_func(*static, causal=causal, return_lse=True),
                   ("out", "lse"))


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_training_step_replays(deterministic):
    """Forward and backward (``autograd.grad``) in one graph, as ``torch.cuda.make_graphed_callables`` records them."""
    static = _qkv(requires_grad=True)
    dout = torch.randn(2, 257, 8, 128, device="cuda", dtype=BF16)

    def step():
        out = flashtile.flash_attn_func(*static, causal=True, deterministic=deterministic)
        return (out, *torch.autograd.grad(out, static, dout))

    # The default dQ adds fp32 tiles atomically in whatever order CTAs finish.
    _replays_match([*static, dout], lambda: [*_qkv(), torch.randn_like(dout)], step, ("out", "dq", "dk", "dv"),
                   lambda name: 0.0 if deterministic or name != "dq" else 1e-2)


def test_varlen_training_step_replays():
    """Packed sequences (lengths 1, 130, 257 and 0 keys for one entry): forward + deterministic backward."""
    lens_q, lens_k = [1, 130, 257, 40], [5, 130, 257, 0]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    tq, tk = sum(lens_q), sum(lens_k)

    def draw():
        return [torch.randn(tq, 8, 128, device="cuda", dtype=BF16)] + \
               [torch.randn(tk, 2, 128, device="cuda", dtype=BF16) for _ in range(2)]

    static = [x.requires_grad_() for x in draw()]
    dout = torch.randn(tq, 8, 128, device="cuda", dtype=BF16)

    def step():
        out = flashtile.flash_attn_varlen_func(*static, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                               deterministic=True)
        return (out, *torch.autograd.grad(out, static, dout))

    _replays_match([*static, dout], lambda: [*draw(), torch.randn_like(dout)], step, ("out", "dq", "dk", "dv"))


def test_chunked_training_step_replays():
    """``attention_chunk`` (chunks of 100 over 257 tokens: packed chunk sequences whose offsets
    were made on the warm-up call): forward + deterministic backward in one graph."""
    static = _qkv(requires_grad=True)
    dout = torch.randn(2, 257, 8, 128, device="cuda", dtype=BF16)

    def step():
        out = flashtile.flash_attn_func(*static, causal=True, deterministic=True, attention_chunk=100)
        return (out, *torch.autograd.grad(out, static, dout))

    _replays_match([*static, dout], lambda: [*_qkv(), torch.randn_like(dout)], step, ("out", "dq", "dk", "dv"))


def test_fp8_forward_replays():
    """The FP8 forward, its V^T pre-pass included; the descales are graph inputs too."""
    import flashtile.fp8

    def draw():
        return list(flashtile.fp8.quantize_qkv(*_qkv()))  # q8, k8, v8, q_descale, k_descale, v_descale

    static = draw()
    _replays_match(static, draw, lambda: flashtile.flash_attn_func(*static[:3], causal=True, q_descale=static[3],
                                                                 k_descale=static[4], v_descale=static[5],
                                                                 return_lse=True), ("out", "lse"))


@pytest.mark.parametrize("page, chunk", [(None, 0), (16, 0), (16, 96)], ids=["contig", "page16", "page16-chunk96"])
@pytest.mark.parametrize("sq", [1, 4])
def test_decode_step_replays(page, sq, chunk):
    """A serving loop's step: append ``sq`` new tokens per sequence (rotary on), attend over the
    cache, then advance ``cache_seqlens`` in place; the replayed graph must write the same cache
    rows and return the same output as eager steps on a copy of the cache.  With ``chunk``, each
    token's chunk start is a left pad computed on the device from the lengths the loop advances
    (``attention_chunk``; 4 tokens at 700 + 8k cross a chunk boundary of 96 in later steps)."""
    b, hkv, d, capacity = 3, 2, 128, 1024
    lens0 = torch.tensor([700, 1, 333], dtype=torch.int32, device="cuda")
    if page is None:
        k_cache, v_cache = (torch.randn(b, capacity, hkv, d, device="cuda", dtype=BF16) for _ in range(2))
        block_table = None
    else:
        n_pages = b * capacity // page
        k_cache, v_cache = (torch.randn(n_pages, page, hkv, d, device="cuda", dtype=BF16) for _ in range(2))
        block_table = torch.randperm(n_pages, device="cuda").to(torch.int32).view(b, capacity // page)
    pos = torch.arange(capacity + 8, device="cuda", dtype=torch.float32)[:, None]
    freq = 1.0 / 10000 ** (torch.arange(0, d // 2, device="cuda", dtype=torch.float32)[None, :] / (d // 2))
    cos, sin = (f(pos * freq).to(BF16) for f in (torch.cos, torch.sin))

    def draw():
        return [torch.randn(b, sq, 8, d, device="cuda", dtype=BF16)] + \
               [torch.randn(b, sq, hkv, d, device="cuda", dtype=BF16) for _ in range(2)]

    static = draw()
    seqlens = lens0.clone()

    def step(kc, vc, lens):
        return flashtile.flash_attn_with_kvcache(static[0], kc, vc, k=static[1], v=static[2], rotary_cos=cos,
                                                 rotary_sin=sin, cache_seqlens=lens, block_table=block_table,
                                                 causal=True, return_lse=True, attention_chunk=chunk)

    # Warm-up and capture write into scratch copies of the caches; the graph then runs on the
    # caches it captured, so give it those and check against eager steps on twin copies.
    k_twin, v_twin = k_cache.clone(), v_cache.clone()
    graph, (out, lse) = _capture(lambda: step(k_cache, v_cache, seqlens))
    k_twin.copy_(k_cache)  # warm-up and capture appended at the same lengths: start both equal
    v_twin.copy_(v_cache)
    twin_lens = seqlens.clone()
    for _ in range(2):
        _fill(static, draw())
        graph.replay()
        want_out, want_lse = step(k_twin, v_twin, twin_lens)
        _same("out", out, want_out)
        _same("lse", lse, want_lse)
        _same("k_cache", k_cache, k_twin)
        _same("v_cache", v_cache, v_twin)
        seqlens += sq  # the serving loop advances the lengths in place; the graph reads them
        twin_lens += sq
