"""The CPU reference path (``flash_attn_func`` on CPU tensors) against an independent float64
full-matrix computation (``flashtile.check.naive_attention``), plus gradcheck, chunking,
layout and edge cases.

The main grid is a covering design, not a product: every (seqlens, mask) pair runs once, and the
head dims, head counts, sinks and softcap rotate with it so that each of their values meets
every mask and every seqlen pair (``test_grid_covers_every_pair`` keeps that true).
"""

from __future__ import annotations

import math

import pytest
import torch

from flashtile import flash_attn_func, reference
from flashtile.check import naive_attention, naive_mask

SEQLENS = [(1, 1), (17, 113), (113, 17), (239, 239), (1, 239), (239, 1)]
# name -> (causal, window_size)
MASKS = {
    "none": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "window(5,3)": (False, (5, 3)),
    "window(0,0)": (False, (0, 0)),
    "causal+window(7,*)": (True, (7, -1)),
}
HEADDIMS = [(32, 32), (64, 64), (80, 80), (128, 128), (192, 128)]
HEADS = [(4, 4), (8, 2), (4, 1)]  # MHA, GQA 4:1, MQA


def _grid():
    cases = []
    for s, (sq, sk) in enumerate(SEQLENS):
        for m, mask in enumerate(MASKS):
            d, dv = HEADDIMS[(s + 2 * m) % len(HEADDIMS)]
            h, hkv = HEADS[(s + m) % len(HEADS)]
            sinks = (s + m) % 2 == 1
            softcap = 5.0 if ((s + m) // 2 + s) % 2 else 0.0
            cases.append(dict(sq=sq, sk=sk, mask=mask, d=d, dv=dv, h=h, hkv=hkv, sinks=sinks, softcap=softcap))
    return cases


GRID = _grid()


def _case_id(c):
    return (
        f"sq{c['sq']}-sk{c['sk']}-{c['mask']}-d{c['d']}v{c['dv']}-h{c['h']}:{c['hkv']}"
        + ("-sinks" if c["sinks"] else "")
        + (f"-cap{c['softcap']:g}" if c["softcap"] else "")
    )


def test_grid_covers_every_pair():
    """Each head-dim / head-count / sinks / softcap value meets every mask and every seqlen pair."""
    axes = {
        "headdims": lambda c: (c["d"], c["dv"]),
        "heads": lambda c: (c["h"], c["hkv"]),
        "sinks": lambda c: c["sinks"],
        "softcap": lambda c: c["softcap"],
    }
    values = {"headdims": HEADDIMS, "heads": HEADS, "sinks": [False, True], "softcap": [0.0, 5.0]}
    for name, key in axes.items():
        assert {key(c) for c in GRID} == set(values[name]), name
        for c0 in MASKS:
            assert {key(c) for c in GRID if c["mask"] == c0} == set(values[name]), (name, c0)
        if name in ("sinks", "softcap"):
            for sq, sk in SEQLENS:
                assert {key(c) for c in GRID if (c["sq"], c["sk"]) == (sq, sk)} == set(values[name]), (name, sq, sk)
    assert {(c["sinks"], c["softcap"]) for c in GRID} == {(a, b) for a in (False, True) for b in (0.0, 5.0)}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a.detach().double() - b.detach().double()).abs()
    return float(torch.nan_to_num(d, nan=math.inf).max())


def _assert_close(name: str, case: str, got: torch.Tensor, want: torch.Tensor, rtol: float):
    """max |got - want| <= rtol * max(1, max |want|), with -inf required exactly where want has it."""
    assert got.shape == want.shape, f"[{case}] {name}: shape {tuple(got.shape)} != expected {tuple(want.shape)}"
    got, want = got.detach().double(), want.detach().double()
    assert not torch.isnan(got).any(), f"[{case}] {name}: NaN at {torch.isnan(got).nonzero()[:5].tolist()}"
    inf_got, inf_want = torch.isinf(got), torch.isinf(want)
    assert torch.equal(inf_got, inf_want) and torch.equal(got[inf_got], want[inf_want]), (
        f"[{case}] {name}: infinities differ at {(inf_got != inf_want).nonzero()[:5].tolist()}"
    )
    finite = ~inf_want
    scale = max(1.0, float(want[finite].abs().max())) if finite.any() else 1.0
    err = _err(got[finite], want[finite])
    assert err <= rtol * scale, f"[{case}] {name}: max abs error {err:.3e} > {rtol * scale:.3e} (|ref| max {scale:.3g})"


def _inputs(b, sq, sk, h, hkv, d, dv, sinks, dtype=torch.float64):
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, dtype=dtype)
    v = torch.randn(b, sk, hkv, dv, dtype=dtype)
    s = torch.randn(h, dtype=dtype) if sinks else None
    return q, k, v, s


def _leaves(*xs):
    return [None if x is None else x.detach().clone().requires_grad_(True) for x in xs]


def _grads(out, lse, dout, dlse, leaves):
    """Gradients of sum(out * dout) + sum(lse * dlse) over finite lse entries."""
    lse_f = lse.masked_fill(torch.isinf(lse.detach()), 0.0)
    loss = (out * dout).sum() + (lse_f * dlse).sum()
    used = [x for x in leaves if x is not None]
    g = iter(torch.autograd.grad(loss, used))
    return [None if x is None else next(g) for x in leaves]


def _compare_with_naive(case_id, q, k, v, sinks, causal, window, softcap, rtol, scale=None, with_dlse=True):
    leaves = _leaves(q, k, v, sinks)
    out, lse = flash_attn_func(
        *leaves[:3], softmax_scale=scale, causal=causal, window_size=window, sinks=leaves[3], softcap=softcap, return_lse=True
    )
    nleaves = _leaves(*(None if x is None else x.double() for x in (q, k, v, sinks)))
    n_out, n_lse = naive_attention(*nleaves[:3], scale, causal, window, nleaves[3], softcap)
    assert out.dtype == q.dtype, f"[{case_id}] out dtype {out.dtype} != q dtype {q.dtype}"
    _assert_close("out", case_id, out, n_out, rtol)
    _assert_close("lse", case_id, lse, n_lse, rtol)
    dout = torch.randn_like(n_out)
    dlse = torch.randn_like(n_lse) if with_dlse else torch.zeros_like(n_lse)
    grads = _grads(out, lse, dout.to(out.dtype), dlse.to(lse.dtype), leaves)
    n_grads = _grads(n_out, n_lse, dout, dlse, nleaves)
    for name, g, ng in zip(("dq", "dk", "dv", "dsinks"), grads, n_grads):
        if ng is not None:
            assert g.dtype == leaves[("dq", "dk", "dv", "dsinks").index(name)].dtype, f"[{case_id}] {name} dtype {g.dtype}"
            _assert_close(name, case_id, g, ng, rtol)
    return out, lse, grads


# --------------------------------------------------------------------------------------------
# the oracle itself
# --------------------------------------------------------------------------------------------


def test_naive_mask_matches_design_diagrams():
    """The diagrams in interface.py: bottom-right aligned causal and a (1, 0) window."""
    x = True
    o = False
    assert torch.equal(naive_mask(4, 4, True), torch.tensor([[x, o, o, o], [x, x, o, o], [x, x, x, o], [x, x, x, x]]))
    assert torch.equal(naive_mask(2, 5, True), torch.tensor([[x, x, x, x, o], [x, x, x, x, x]]))
    assert torch.equal(
        naive_mask(4, 4, False, (1, 0)), torch.tensor([[x, o, o, o], [x, x, o, o], [o, x, x, o], [o, o, x, x]])
    )
    # seqlen_q > seqlen_k, causal: the first rows see nothing.
    assert torch.equal(naive_mask(3, 2, True), torch.tensor([[o, o], [x, o], [x, x]]))
    # causal ignores the window's right side.
    assert torch.equal(naive_mask(6, 6, True, (2, 3)), naive_mask(6, 6, False, (2, 0)))


def test_naive_attention_matches_softmax_formula():
    """Cross-check the oracle against torch's softmax on a small MHA case with a sink column."""
    q, k, v, s = _inputs(2, 5, 7, 3, 3, 8, 6, sinks=True)
    out, lse = naive_attention(q, k, v, 0.3, sinks=s)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
    full = torch.cat([scores, s.view(1, 3, 1, 1).expand(2, 3, 5, 1)], dim=-1)
    p = torch.softmax(full, dim=-1)[..., :7]
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", p, v))
    torch.testing.assert_close(lse, torch.logsumexp(full, dim=-1))


# --------------------------------------------------------------------------------------------
# the grid
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", GRID, ids=[_case_id(c) for c in GRID])
def test_reference_vs_naive_float64(c):
    causal, window = MASKS[c["mask"]]
    q, k, v, s = _inputs(1, c["sq"], c["sk"], c["h"], c["hkv"], c["d"], c["dv"], c["sinks"])
    _compare_with_naive(_case_id(c), q, k, v, s, causal, window, c["softcap"], rtol=1e-10)


# A float32 subset: same semantics, float32 accumulation.
FP32 = [GRID[i] for i in (1, 7, 12, 18, 24, 29)]


@pytest.mark.parametrize("c", FP32, ids=[_case_id(c) for c in FP32])
def test_reference_vs_naive_float32(c):
    causal, window = MASKS[c["mask"]]
    q, k, v, s = _inputs(2, c["sq"], c["sk"], c["h"], c["hkv"], c["d"], c["dv"], c["sinks"], dtype=torch.float32)
    _compare_with_naive(_case_id(c), q, k, v, s, causal, window, c["softcap"], rtol=1e-5)


def test_batch_and_explicit_scale():
    q, k, v, s = _inputs(3, 9, 13, 6, 2, 16, 16, sinks=True)
    _compare_with_naive("b3 scale0.7", q, k, v, s, True, (4, -1), 0.0, rtol=1e-10, scale=0.7)


@pytest.mark.parametrize("sinks", [False, True])
def test_fully_masked_rows(sinks):
    """Causal with seqlen_q > seqlen_k and window (0, 0) with off < 0: early rows see nothing.

    Without a sink they output 0 with lse -inf; with one, 0 with lse = the sink.  No NaN anywhere.
    """
    b, sq, sk, h, hkv = 2, 23, 9, 4, 2
    off = sk - sq
    for causal, window in ((True, (-1, -1)), (False, (0, 0)), (True, (3, -1))):
        case = f"causal={causal} window={window} sinks={sinks}"
        q, k, v, s = _inputs(b, sq, sk, h, hkv, 16, 8, sinks)
        out, lse, grads = _compare_with_naive(case, q, k, v, s, causal, window, 0.0, rtol=1e-10)
        dead = -off  # rows 0 .. -off-1 see no key in all three masks
        assert torch.equal(out[:, :dead], torch.zeros_like(out[:, :dead])), f"[{case}] masked rows not zero"
        if sinks:
            torch.testing.assert_close(lse[:, :, :dead], s.view(1, h, 1).expand(b, h, dead))
        else:
            assert torch.isneginf(lse[:, :, :dead]).all(), f"[{case}] masked rows' lse not -inf"
        assert torch.isfinite(lse[:, :, dead:]).all()
        for name, g in zip(("dq", "dk", "dv", "dsinks"), grads):
            if g is not None:
                assert torch.isfinite(g).all(), f"[{case}] {name} not finite"
        assert torch.equal(grads[0][:, :dead], torch.zeros_like(grads[0][:, :dead])), f"[{case}] dq of masked rows"


def test_gqa_head_mapping():
    """Query head h reads kv head h // (nheads // nheads_kv): contiguous groups."""
    b, sq, sk, h, hkv, d = 1, 3, 5, 6, 3, 4
    q = torch.randn(b, sq, h, d, dtype=torch.float64)
    k = torch.randn(b, sk, hkv, d, dtype=torch.float64)
    v = torch.arange(hkv, dtype=torch.float64).view(1, 1, hkv, 1).expand(b, sk, hkv, d)
    out = flash_attn_func(q, k, v)
    want = (torch.arange(h) // (h // hkv)).double().view(1, 1, h, 1).expand_as(out)
    torch.testing.assert_close(out, want)


def test_causal_is_right_zero_and_ignores_window_right():
    q, k, v, _ = _inputs(1, 11, 15, 2, 1, 8, 8, False)
    a = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(a, flash_attn_func(q, k, v, window_size=(-1, 0)), rtol=0, atol=0)
    b = flash_attn_func(q, k, v, causal=True, window_size=(3, 5))
    torch.testing.assert_close(b, flash_attn_func(q, k, v, window_size=(3, 0)), rtol=0, atol=0)


def test_default_scale():
    q, k, v, _ = _inputs(1, 4, 6, 2, 2, 16, 16, False)
    torch.testing.assert_close(flash_attn_func(q, k, v), flash_attn_func(q, k, v, softmax_scale=0.25), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# gradcheck
# --------------------------------------------------------------------------------------------

GRADCHECK = [
    # name, sq, sk, h, hkv, causal, window, sinks, softcap, return_lse
    ("mha-full-lse", 5, 7, 2, 2, False, (-1, -1), False, 0.0, True),
    ("gqa-causal-sinks-lse", 6, 4, 4, 2, True, (-1, -1), True, 0.0, True),
    ("mqa-window-softcap", 5, 7, 2, 1, False, (2, 1), False, 2.0, False),
    ("masked-rows-out", 7, 3, 2, 1, True, (1, -1), False, 0.0, False),
    ("everything-lse", 5, 6, 4, 2, True, (3, -1), True, 3.0, True),
]


@pytest.mark.parametrize("name,sq,sk,h,hkv,causal,window,sinks,softcap,return_lse", GRADCHECK, ids=[g[0] for g in GRADCHECK])
def test_gradcheck(name, sq, sk, h, hkv, causal, window, sinks, softcap, return_lse):
    q, k, v, s = _leaves(*_inputs(1, sq, sk, h, hkv, 4, 3, sinks))

    def f(q, k, v, s=None):
        return flash_attn_func(
            q, k, v, causal=causal, window_size=window, sinks=s, softcap=softcap, return_lse=return_lse
        )

    args = (q, k, v) + ((s,) if sinks else ())
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5), name


# --------------------------------------------------------------------------------------------
# implementation details of the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunking_does_not_change_results(dtype):
    q, k, v, s = _inputs(2, 30, 23, 4, 2, 16, 8, True, dtype)
    window, scale, cap = (6, 0), 0.3, 4.0
    o1, l1 = reference.attention_forward(q, k, v, scale, window, s, cap, chunk=7)
    o2, l2 = reference.attention_forward(q, k, v, scale, window, s, cap, chunk=4096)
    tol = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=0, atol=1e-6)
    torch.testing.assert_close(o1, o2, **tol)
    torch.testing.assert_close(l1, l2, **tol)
    dout, dlse = torch.randn_like(o1), torch.randn_like(l1)
    g1 = reference.attention_backward(dout, q, k, v, o2, l2, scale, window, s, cap, dlse, chunk=7)
    g2 = reference.attention_backward(dout, q, k, v, o2, l2, scale, window, s, cap, dlse, chunk=4096)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), g1, g2):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_non_contiguous_inputs_and_inputs_unmodified():
    b, s, h, hkv, d = 2, 19, 4, 2, 16
    qkv = torch.randn(b, s, h + 2 * hkv, d, dtype=torch.float64)  # packed, as in a fused projection
    q, k, v = qkv[:, :, :h], qkv[:, :, h : h + hkv], qkv[:, :, h + hkv :]
    sinks = torch.randn(2 * h, dtype=torch.float64)[::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or sinks.is_contiguous())
    before = [x.clone() for x in (qkv, sinks)]
    # requires_grad leaves that keep the strided views' layout
    ql, kl, vl, sl = (x.detach().requires_grad_(True) for x in (q, k, v, sinks))
    out, lse = flash_attn_func(ql, kl, vl, causal=True, sinks=sl, return_lse=True)
    (out.sum() + lse.sum()).backward()
    qc, kc, vc, sc = _leaves(q.contiguous(), k.contiguous(), v.contiguous(), sinks.contiguous())
    out_c, lse_c = flash_attn_func(qc, kc, vc, causal=True, sinks=sc, return_lse=True)
    (out_c.sum() + lse_c.sum()).backward()
    torch.testing.assert_close(out, out_c, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, lse_c, rtol=0, atol=1e-13)
    for a, c in ((ql, qc), (kl, kc), (vl, vc), (sl, sc)):
        torch.testing.assert_close(a.grad, c.grad, rtol=0, atol=1e-12)
    assert torch.equal(qkv, before[0]) and torch.equal(sinks, before[1]), "inputs were modified"


def test_transposed_layout_accepted():
    """A (b, h, s, d) tensor transposed to (b, s, h, d) is a strided view; it must just work."""
    q = torch.randn(1, 4, 9, 8, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(1, 2, 11, 8, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(1, 2, 11, 8, dtype=torch.float64).transpose(1, 2)
    want, _ = naive_attention(q, k, v)
    torch.testing.assert_close(flash_attn_func(q, k, v), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lse_is_float32(dtype):
    q, k, v, s = _inputs(1, 5, 6, 2, 1, 16, 16, True, dtype)
    out, lse = flash_attn_func(q, k, v, sinks=s, return_lse=True)
    assert out.dtype == dtype
    assert lse.dtype == torch.float32, f"lse dtype {lse.dtype} for {dtype} input"
    assert lse.shape == (1, 2, 5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_reference_close_to_float64(dtype):
    """Half-precision inputs: float32 arithmetic, output rounded once to the input dtype."""
    q, k, v, s = _inputs(1, 33, 47, 4, 2, 32, 32, True, dtype)
    out, lse = flash_attn_func(q, k, v, causal=True, sinks=s.float(), return_lse=True)
    n_out, n_lse = naive_attention(q, k, v, None, True, (-1, -1), s.float())
    eps = torch.finfo(dtype).eps
    _assert_close("out", str(dtype), out, n_out, rtol=eps)  # one rounding: <= half an ulp of |out| max
    _assert_close("lse", str(dtype), lse, n_lse, rtol=1e-5)


def test_seqlen_q_zero():
    q, k, v, s = _leaves(*_inputs(2, 0, 7, 4, 2, 16, 8, True))
    out, lse = flash_attn_func(q, k, v, causal=True, sinks=s, return_lse=True)
    assert out.shape == (2, 0, 4, 8) and lse.shape == (2, 4, 0)
    (out.sum() + lse.sum()).backward()
    for name, x in (("q", q), ("k", k), ("v", v), ("sinks", s)):
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any(), name


@pytest.mark.parametrize("sinks", [False, True])
def test_seqlen_k_zero(sinks):
    """No keys: out is 0, lse is -inf (or the sink), gradients are finite."""
    q, k, v, s = _leaves(*_inputs(2, 5, 0, 4, 2, 16, 8, sinks))
    out, lse = flash_attn_func(q, k, v, sinks=s, return_lse=True)
    n_out, n_lse = naive_attention(q, k, v, sinks=s)
    _assert_close("out", "sk=0", out, n_out, 1e-12)
    _assert_close("lse", "sk=0", lse, n_lse, 1e-12)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and not q.grad.any()
