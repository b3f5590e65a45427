"""flash_attn_varlen_func on CPU (modelled on flash-attn's varlen tests).

Packed batches of random lengths (0, 1 and odd sizes, seqlen_q != seqlen_k per sequence) against
a float64 naive oracle written here (full score matrix per sequence, autograd for gradients),
against the dense ``flash_attn_func`` run per sequence, ``gradcheck``, validation messages,
``opcheck`` on the custom ops and ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch

import flashtile
from flashtile import varlen
from flashtile.varlen import flash_attn_varlen_func

I32 = torch.int32


# --- the oracle ---------------------------------------------------------------------------------


def naive_varlen(q, k, v, cu_q, cu_k, scale, causal=False, window=(-1, -1), softcap=0.0, sinks=None,
                 seqused_q=None, seqused_k=None):
    """Float64, full matrices, one sequence at a time; differentiable by autograd.

    Returns out (total_q, h, dv) and lse (h, total_q); rows outside every used range and rows
    that see no key (without a sink) get out 0 and lse -inf.
    """
    q, k, v = (x.double() for x in (q, k, v))
    total_q, h, _ = q.shape
    grp = h // k.shape[1]
    left, right = window[0], 0 if causal else window[1]
    out = torch.zeros(total_q, h, v.shape[-1], dtype=torch.float64)
    lse = torch.full((h, total_q), -math.inf, dtype=torch.float64)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        lq = cq[b + 1] - cq[b] if seqused_q is None else int(seqused_q[b])
        lk = ck[b + 1] - ck[b] if seqused_k is None else int(seqused_k[b])
        if lq == 0:
            continue
        qb = q[cq[b] : cq[b] + lq]
        kb = k[ck[b] : ck[b] + lk].repeat_interleave(grp, dim=1)
        vb = v[ck[b] : ck[b] + lk].repeat_interleave(grp, dim=1)
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(lq)[:, None] + (lk - lq)
        j = torch.arange(lk)[None, :]
        vis = torch.ones(lq, lk, dtype=torch.bool)
        if right >= 0:
            vis &= j <= i + right
        if left >= 0:
            vis &= j >= i - left
        vis = vis.expand(h, lq, lk)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(h, lq, 1)], dim=-1)
            vis = torch.cat([vis, torch.ones(h, lq, 1, dtype=torch.bool)], dim=-1)
        seen = vis.any(-1, keepdim=True)
        s = torch.where(vis, s, -math.inf)
        s = torch.where(seen, s, 0.0)  # rows that see nothing: finite dummy values, masked below
        row_lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.where(seen, torch.exp(s - row_lse), 0.0)
        out[cq[b] : cq[b] + lq] = torch.einsum("hqk,khd->qhd", p[..., :lk], vb)
        lse[:, cq[b] : cq[b] + lq] = torch.where(seen, row_lse, -math.inf)[..., 0]
    return out, lse


# --- cases --------------------------------------------------------------------------------------


def cu(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()) if lengths else [0], dtype=I32)


@dataclass(frozen=True)
class Case:
    name: str
    lens: tuple  # ((len_q, len_k), ...) segment lengths
    h: int = 4
    hkv: int = 2
    d: int = 16
    dv: int = 16
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    used: tuple | None = None  # ((used_q, used_k), ...) or None
    grad: str = "out"  # "out", "lse" or "out+lse"
    extra: dict = field(default_factory=dict, hash=False, compare=False)


def _random_lens(seed: int, batch: int, hi: int = 40) -> tuple:
    rng = random.Random(seed)
    pick = lambda: rng.choice([0, 1, 2, 7, 13, 17, 31, rng.randint(0, hi)])  # noqa: E731
    return tuple((pick(), pick()) for _ in range(batch))


MIXED = ((0, 5), (1, 1), (17, 9), (5, 23), (3, 0), (12, 12), (0, 0), (1, 33))
CASES = [
    Case("mha-full", MIXED, h=3, hkv=3),
    Case("gqa-causal", MIXED, causal=True),
    Case("mqa-causal-dv", MIXED, h=4, hkv=1, d=24, dv=8, causal=True),
    Case("window", MIXED, window=(3, 2)),
    Case("window-left-only", MIXED, window=(4, -1)),
    Case("window-0-0", MIXED, window=(0, 0)),
    Case("causal+window", MIXED, causal=True, window=(5, -1)),
    Case("sinks", MIXED, causal=True, sinks=True),
    Case("sinks-window-softcap", MIXED, window=(2, 1), sinks=True, softcap=1.5),
    Case("softcap", MIXED, causal=True, softcap=2.0),
    Case("odd-dims", MIXED, h=6, hkv=2, d=13, dv=7, causal=True),
    Case("seqused", ((9, 11), (6, 4), (0, 3), (7, 7), (4, 0)), causal=True,
         used=((5, 11), (6, 2), (0, 3), (0, 4), (4, 0))),
    Case("seqused-sinks-window", ((9, 11), (6, 4), (8, 8)), window=(2, 0), sinks=True,
         used=((9, 3), (2, 4), (7, 1))),
    Case("lse-grad", MIXED, causal=True, sinks=True, grad="lse"),
    Case("out+lse-grad", MIXED, window=(3, 3), grad="out+lse"),
    Case("random-a", _random_lens(1, 10), causal=True, sinks=True),
    Case("random-b", _random_lens(2, 12), h=8, hkv=2, d=32, dv=16, window=(6, 0), softcap=3.0, grad="out+lse"),
    Case("single-sequence", ((37, 53),), causal=True),
    Case("all-empty", ((0, 0), (0, 3))),
    Case("no-sequences", ()),
]


def _inputs(c: Case, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    total_q = sum(a for a, _ in c.lens)
    total_k = sum(b for _, b in c.lens)
    q = torch.randn(total_q, c.h, c.d, generator=g, dtype=dtype)
    k = torch.randn(total_k, c.hkv, c.d, generator=g, dtype=dtype)
    v = torch.randn(total_k, c.hkv, c.dv, generator=g, dtype=dtype)
    s = torch.randn(c.h, generator=g, dtype=dtype) if c.sinks else None
    cu_q, cu_k = cu([a for a, _ in c.lens]), cu([b for _, b in c.lens])
    used_q = used_k = None
    if c.used is not None:
        used_q = torch.tensor([a for a, _ in c.used], dtype=I32)
        used_k = torch.tensor([b for _, b in c.used], dtype=I32)
    return q, k, v, s, cu_q, cu_k, used_q, used_k


def _max_lens(c: Case):
    src = c.used if c.used is not None else c.lens
    return max([a for a, _ in src], default=0), max([b for _, b in src], default=0)


def _run(fn, c, q, k, v, s, cu_q, cu_k, used_q, used_k, **kw):
    mq, mk = _max_lens(c)
    if fn is naive_varlen:
        return naive_varlen(q, k, v, cu_q, cu_k, 1 / math.sqrt(c.d), c.causal, c.window, c.softcap, s, used_q, used_k)
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=c.causal, window_size=c.window,
                                  softcap=c.softcap, sinks=s, seqused_q=used_q, seqused_k=used_k, return_lse=True, **kw)


def _loss(c: Case, out, lse, w_out, w_lse):
    total = out.new_zeros(())
    if "out" in c.grad:
        total = total + (out * w_out).sum()
    if "lse" in c.grad:
        total = total + torch.where(torch.isfinite(lse), lse * w_lse, 0.0).sum()
    return total


def _forward_backward(fn, c, inputs, **kw):
    leaves = [None if x is None else x.detach().clone().requires_grad_(True) for x in inputs[:4]]
    out, lse = _run(fn, c, *leaves, *inputs[4:], **kw)
    g = torch.Generator().manual_seed(7)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    loss = _loss(c, out, lse, w_out, w_lse)
    grads = (None,) * 4
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, [x for x in leaves if x is not None], allow_unused=True)
        grads = tuple(grads) + (None,) * (4 - len(grads))
    return (out.detach(), lse.detach()) + tuple(grads)


NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_matches_naive_float64(c: Case):
    inputs = _inputs(c)
    got = _forward_backward(None, c, inputs)
    want = _forward_backward(naive_varlen, c, inputs)
    for name, a, b in zip(NAMES, got, want):
        if b is None and a is not None and a.numel():
            b = torch.zeros_like(a)  # the oracle's loss did not reach this input (empty batch)
        if a is None or b is None:
            assert a is None or not a.abs().any(), name
            continue
        assert a.shape == b.shape, name
        if name == "lse":
            assert torch.equal(torch.isneginf(a), torch.isneginf(b)), "lse -inf pattern"
            a, b = (torch.where(torch.isneginf(a), 0.0, x) for x in (a, b))
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m: f"{c.name} {name}: {m}")


def test_unused_rows_and_keys_are_zero():
    c = next(x for x in CASES if x.name == "seqused")
    q, k, v, s, cu_q, cu_k, uq, uk = inputs = _inputs(c)
    out, lse, dq, dk, dv, _ = _forward_backward(None, c, inputs)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b, (lq, lk) in enumerate(c.used):
        rows, keys = slice(cq[b] + lq, cq[b + 1]), slice(ck[b] + lk, ck[b + 1])
        assert not out[rows].any() and torch.isneginf(lse[:, rows]).all() and not dq[rows].any()
        assert not dk[keys].any() and not dv[keys].any()


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_low_precision_close_to_naive(dtype, atol):
    c = Case("lp", MIXED, causal=True, sinks=True, softcap=5.0, grad="out+lse")
    inputs = _inputs(c, dtype=dtype)
    got = _forward_backward(None, c, inputs)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    want = _forward_backward(naive_varlen, c, tuple(None if x is None else (x.double() if x.is_floating_point() else x) for x in inputs))
    for name, a, b in zip(NAMES, got, want):
        if name == "lse":
            a, b = (torch.where(torch.isneginf(x), 0.0, x.double()) for x in (a, b))
        torch.testing.assert_close(a.double(), b, atol=atol * (10 if name == "dsinks" else 1), rtol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("c", [CASES[1], CASES[8], CASES[11]], ids=lambda c: c.name)
def test_equals_dense_flash_attn_func_per_sequence(c: Case):
    q, k, v, s, cu_q, cu_k, uq, uk = _inputs(c, dtype=torch.float32)
    out, lse = _run(None, c, q, k, v, s, cu_q, cu_k, uq, uk)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        lq = cq[b + 1] - cq[b] if uq is None else int(uq[b])
        lk = ck[b + 1] - ck[b] if uk is None else int(uk[b])
        o, l = flashtile.flash_attn_func(
            q[None, cq[b] : cq[b] + lq], k[None, ck[b] : ck[b] + lk], v[None, ck[b] : ck[b] + lk],
            causal=c.causal, window_size=c.window, softcap=c.softcap, sinks=s, return_lse=True,
        )
        torch.testing.assert_close(out[cq[b] : cq[b] + lq], o[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(lse[:, cq[b] : cq[b] + lq], l[0], atol=1e-6, rtol=0)


def test_gradcheck_float64():
    lens = ((3, 4), (1, 1), (0, 2), (4, 2))
    c = Case("tiny", lens, h=2, hkv=1, d=5, dv=3, causal=True, sinks=True, softcap=2.0)
    q, k, v, s, cu_q, cu_k, _, _ = _inputs(c)
    uq = torch.tensor([2, 1, 0, 4], dtype=I32)
    uk = torch.tensor([4, 1, 2, 1], dtype=I32)

    def fn(q, k, v, s):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4, causal=True, softcap=2.0, sinks=s,
                                          return_lse=True, seqused_q=uq, seqused_k=uk)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, s)]
    assert torch.autograd.gradcheck(fn, leaves, atol=1e-7)


def test_return_attn_probs_and_flash_attn_2_positional_order():
    c = CASES[1]
    q, k, v, _, cu_q, cu_k, _, _ = _inputs(c, dtype=torch.float32)
    mq, mk = _max_lens(c)
    # q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size, softcap,
    # alibi_slopes, deterministic, return_attn_probs
    out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, 0.0, 0.3, True, (-1, -1), 0.0, None, True, True)
    assert probs is None
    want, want_lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.3, causal=True, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert isinstance(flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk), torch.Tensor)


def test_deterministic_flag_repeats_bitwise():
    c = CASES[8]
    inputs = _inputs(c, dtype=torch.float32)
    first = _forward_backward(None, c, inputs, deterministic=True)
    again = _forward_backward(None, c, inputs, deterministic=True)
    for a, b in zip(first, again):
        assert (a is None and b is None) or torch.equal(a, b)


def test_inputs_never_modified_and_outputs_fresh():
    c = CASES[12]
    inputs = _inputs(c, dtype=torch.float32)
    before = [None if x is None else x.clone() for x in inputs]
    leaves = [x.clone().requires_grad_(True) if x is not None else None for x in inputs[:4]]
    out, lse = _run(None, c, *leaves, *inputs[4:])
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    for x, y, leaf in zip(inputs, before, leaves + [None] * 4):
        if x is not None:
            assert torch.equal(x, y)
        if leaf is not None:
            assert torch.equal(leaf.detach(), y)
    assert out.is_contiguous() and lse.is_contiguous()


def test_non_contiguous_inputs():
    c = CASES[1]
    q, k, v, _, cu_q, cu_k, _, _ = _inputs(c, dtype=torch.float32)
    mq, mk = _max_lens(c)
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    kv = torch.cat([k, v.repeat_interleave(2, dim=-1)], dim=-1)  # k, v sliced from one projection
    kt, vt = kv[..., : k.shape[-1]], kv[..., k.shape[-1] :: 2]
    cu_qt = torch.stack([cu_q, cu_q], dim=1)[:, 0]
    assert not (qt.is_contiguous() or kt.is_contiguous() or vt.is_contiguous() or cu_qt.is_contiguous())
    a = flash_attn_varlen_func(qt, kt, vt, cu_qt, cu_k, mq, mk, causal=True)
    b = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


# --- validation ---------------------------------------------------------------------------------


def _good():
    q = torch.randn(10, 4, 16)
    k = torch.randn(12, 2, 16)
    v = torch.randn(12, 2, 8)
    return dict(q=q, k=k, v=v, cu_seqlens_q=torch.tensor([0, 4, 10], dtype=I32),
                cu_seqlens_k=torch.tensor([0, 5, 12], dtype=I32), max_seqlen_q=6, max_seqlen_k=7)


BAD = [
    # (what to change, error type, text the message must contain)
    (dict(q=torch.randn(10, 4)), ValueError, "q must be a 3-D tensor (total_q, nheads, headdim)"),
    (dict(k=torch.randn(1, 12, 2, 16)), ValueError, "k must be a 3-D tensor"),
    (dict(q="x"), TypeError, "q must be a torch.Tensor"),
    (dict(v=torch.randn(12, 2, 8, dtype=torch.float64)), TypeError, "q, k, v dtypes must be equal"),
    (dict(q=torch.randint(0, 3, (10, 4, 16))), TypeError, "q.dtype must be one of"),
    (dict(v=torch.randn(11, 2, 8)), ValueError, "v.shape[0] (total_k) must be k's total_k 12"),
    (dict(v=torch.randn(12, 1, 8)), ValueError, "v.shape[1] (nheads_kv)"),
    (dict(q=torch.randn(10, 3, 16)), ValueError, "nheads (q.shape[1]) must be a multiple of nheads_kv=2"),
    (dict(k=torch.randn(12, 2, 8), v=torch.randn(12, 2, 8)), ValueError, "k.shape[2] (headdim) must be q's headdim 16"),
    (dict(q=torch.randn(10, 2, 300), k=torch.randn(12, 2, 300), v=torch.randn(12, 2, 8)), ValueError, "headdim must be between 1 and 256"),
    (dict(v=torch.randn(12, 2, 257)), ValueError, "headdim_v must be between 1 and 256"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 10])), TypeError, "cu_seqlens_q.dtype must be torch.int32"),
    (dict(cu_seqlens_q=[0, 4, 10]), TypeError, "cu_seqlens_q must be an int32 torch.Tensor"),
    (dict(cu_seqlens_q=torch.tensor([[0, 4, 10]], dtype=I32)), ValueError, "cu_seqlens_q must be a 1-D tensor"),
    (dict(cu_seqlens_q=torch.zeros(0, dtype=I32)), ValueError, "cu_seqlens_q must be a 1-D tensor (batch + 1,) with at least 1 entry"),
    (dict(cu_seqlens_k=torch.tensor([0, 12], dtype=I32)), ValueError, "cu_seqlens_k must be shape (batch + 1,) like cu_seqlens_q = (3,)"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 10], dtype=I32, device="meta")), ValueError, "cu_seqlens_q.device must be q's device cpu"),
    (dict(seqused_q=torch.tensor([1, 2, 3], dtype=I32)), ValueError, "seqused_q must be shape (batch,) = (2,)"),
    (dict(seqused_k=torch.tensor([1, 2])), TypeError, "seqused_k.dtype must be torch.int32"),
    (dict(max_seqlen_q=6.0), TypeError, "max_seqlen_q must be a Python int"),
    (dict(max_seqlen_k=torch.tensor(7)), TypeError, "max_seqlen_k must be a Python int"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be an int >= 0"),
    (dict(dropout_p=0.1), NotImplementedError, "dropout_p"),
    (dict(alibi_slopes=torch.ones(4)), NotImplementedError, "alibi_slopes"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
    (dict(window_size=(-2, 0)), ValueError, "window_size left must be >= -1"),
    (dict(window_size=5), TypeError, "window_size must be a pair of ints"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite float >= 0"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(sinks=torch.randn(3)), ValueError, "sinks must be shape (nheads,) = (4,)"),
    # content checks (CPU: always on)
    (dict(cu_seqlens_q=torch.tensor([1, 4, 10], dtype=I32)), ValueError, "cu_seqlens_q[0] must be 0, got 1"),
    (dict(cu_seqlens_k=torch.tensor([0, 7, 5], dtype=I32)), ValueError, "cu_seqlens_k must be nondecreasing, got [0, 7, 5]"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 9], dtype=I32)), ValueError, "cu_seqlens_q[-1] must be the number of tokens, q.shape[0] = 10, got 9"),
    (dict(max_seqlen_q=5), ValueError, "max_seqlen_q must be >= every sequence length"),
    (dict(max_seqlen_k=6), ValueError, "max_seqlen_k must be >= every sequence length"),
    (dict(seqused_q=torch.tensor([5, 1], dtype=I32)), ValueError, "seqused_q must be between 0 and each segment's length"),
    (dict(seqused_k=torch.tensor([-1, 1], dtype=I32)), ValueError, "seqused_k must be between 0 and each segment's length"),
]


@pytest.mark.parametrize("change,kind,text", BAD, ids=[f"{i}-{next(iter(b[0]))}" for i, b in enumerate(BAD)])
def test_validation_names_the_argument(change, kind, text):
    args = {**_good(), **change}
    with pytest.raises(kind) as info:
        flash_attn_varlen_func(**args)
    assert text in str(info.value), str(info.value)
    assert str(info.value).startswith("flash_attn_varlen_func:")


def test_max_seqlen_checked_against_used_lengths():
    args = _good()
    # seqused shortens the sequences: max_seqlen only has to cover the used lengths
    out = flash_attn_varlen_func(**{**args, "max_seqlen_q": 3, "seqused_q": torch.tensor([3, 2], dtype=I32)})
    assert out.shape == (10, 4, 8)


def test_content_checks_on_cuda_are_opt_in(monkeypatch):
    """On CUDA the checks that read cu_seqlens / seqused cost a sync: off unless
    FLASHTILE_CHECK_SEQLENS=1; on CPU always on."""
    monkeypatch.delenv("FLASHTILE_CHECK_SEQLENS", raising=False)
    assert varlen.content_checks_enabled(torch.device("cpu"))
    assert not varlen.content_checks_enabled(torch.device("cuda"))
    monkeypatch.setenv("FLASHTILE_CHECK_SEQLENS", "1")
    assert varlen.content_checks_enabled(torch.device("cuda"))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] must be 0"):
        varlen.check_seqlens(10, 12, torch.tensor([2, 4, 10], dtype=I32), torch.tensor([0, 5, 12], dtype=I32), 6, 7, None, None)


# --- custom ops -----------------------------------------------------------------------------------


def _op_args(c: Case, dtype=torch.float32, scale=0.3):
    q, k, v, s, cu_q, cu_k, uq, uk = _inputs(c, dtype=dtype)
    mq, mk = _max_lens(c)
    left, right = c.window[0], 0 if c.causal else c.window[1]
    opts = varlen.Options(cu_q, cu_k, uq, uk, mq, mk, s, scale, left, right, c.softcap, False)
    return q, k, v, opts


@pytest.mark.parametrize("c", [CASES[2], CASES[9], CASES[12]], ids=lambda c: c.name)
def test_opcheck_varlen_fwd(c: Case):
    q, k, v, o = _op_args(c)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    o = o._replace(sinks=None if o.sinks is None else o.sinks.requires_grad_(True))
    torch.library.opcheck(varlen.varlen_fwd, (q, k, v, *o))


@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("c", [CASES[7], CASES[12]], ids=lambda c: c.name)
def test_opcheck_varlen_bwd(c: Case, with_dlse):
    q, k, v, o = _op_args(c)
    out, lse = varlen.varlen_fwd(q, k, v, *o)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    torch.library.opcheck(varlen.varlen_bwd, (dout, dlse, q, k, v, out, lse, *o))


def test_eager_fast_path_equals_custom_op():
    c = CASES[8]
    q, k, v, o = _op_args(c, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, o.sinks)]
    fast = varlen.varlen_attention(*leaves[:3], o._replace(sinks=leaves[3]))
    leaves2 = [x.clone().requires_grad_(True) for x in (q, k, v, o.sinks)]
    slow = varlen.varlen_fwd(*leaves2[:3], *o._replace(sinks=leaves2[3]))
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    w = torch.randn_like(fast[0])
    g1 = torch.autograd.grad((fast[0] * w).sum() + fast[1].sum(), leaves)
    g2 = torch.autograd.grad((slow[0] * w).sum() + slow[1].sum(), leaves2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_meta_tensors_use_the_fake_impl():
    c = CASES[2]
    q, k, v, o = _op_args(c)
    to_meta = lambda x: None if not isinstance(x, torch.Tensor) else x.to("meta")  # noqa: E731
    o = o._replace(**{n: to_meta(getattr(o, n)) for n in varlen._TENSOR_OPTIONS})
    out, lse = varlen.varlen_fwd(q.to("meta"), k.to("meta"), v.to("meta"), *o)
    assert out.shape == (q.shape[0], c.h, c.dv) and lse.shape == (c.h, q.shape[0]) and lse.dtype == torch.float32


def test_cuda_without_kernel_raises_not_implemented(monkeypatch):
    """Until ``flashtile.kernels.varlen_forward`` exists, CUDA calls raise NotImplementedError."""
    import types

    monkeypatch.setattr(varlen.ops, "_kernels", lambda: types.SimpleNamespace())
    with pytest.raises(NotImplementedError, match="varlen_forward"):
        varlen._kernel("varlen_forward")


# --- torch.compile --------------------------------------------------------------------------------


def _compile_check(backend: str):
    c = CASES[12]  # seqused, sinks, window
    q, k, v, s, cu_q, cu_k, uq, uk = _inputs(c, dtype=torch.float32)
    mq, mk = _max_lens(c)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    def fn(q, k, v, s, cu_q, cu_k, uq, uk):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, window_size=c.window, softcap=1.0,
                                      sinks=s, seqused_q=uq, seqused_k=uk, return_lse=True)

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, s)]
    leaves2 = [x.clone().requires_grad_(True) for x in (q, k, v, s)]
    want = fn(*leaves, cu_q, cu_k, uq, uk)
    got = torch.compile(fn, backend=recording, fullgraph=True)(*leaves2, cu_q, cu_k, uq, uk)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    loss = lambda r: (r[0] * torch.linspace(-1, 1, r[0].numel()).reshape(r[0].shape)).sum() + torch.where(torch.isfinite(r[1]), r[1], 0.0).sum()  # noqa: E731
    for a, b in zip(torch.autograd.grad(loss(got), leaves2), torch.autograd.grad(loss(want), leaves)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert varlen.varlen_fwd in targets or torch.ops.flashtile.varlen_fwd in targets


def test_compile_fullgraph_aot_eager():
    _compile_check("aot_eager")


def test_compile_new_lengths_do_not_recompile():
    """New cu_seqlens contents (same batch size and totals) reuse the graph."""
    c = CASES[1]
    q, k, v, _, cu_q, cu_k, _, _ = _inputs(c, dtype=torch.float32)
    fn = lambda q, k, v, cu_q, cu_k: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, causal=True)  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    compiled(q, k, v, cu_q, cu_k)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        cut_q = sorted(torch.randint(0, q.shape[0] + 1, (len(c.lens) - 1,), generator=g).tolist())
        cut_k = sorted(torch.randint(0, k.shape[0] + 1, (len(c.lens) - 1,), generator=g).tolist())
        new_q = torch.tensor([0, *cut_q, q.shape[0]], dtype=I32)
        new_k = torch.tensor([0, *cut_k, k.shape[0]], dtype=I32)
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = compiled(q, k, v, new_q, new_k)
        torch.testing.assert_close(got, fn(q, k, v, new_q, new_k), atol=1e-6, rtol=0)


def test_compile_dynamic_new_totals_batches_and_max_seqlen_do_not_recompile():
    """dynamic=True: other token totals, batch counts and max_seqlen values reuse the graph
    (the content checks' messages must not specialise on a symbolic size)."""
    def make(lengths, extra_k=3):
        g = torch.Generator().manual_seed(len(lengths))
        total = sum(lengths)
        q = torch.randn(total, 6, 16, generator=g, requires_grad=True)
        k = torch.randn(total + extra_k, 2, 16, generator=g)
        v = torch.randn(total + extra_k, 2, 16, generator=g)
        cu_q = cu(lengths)
        cu_k = cu_q.clone()
        cu_k[-1] += extra_k  # the last sequence has extra_k more keys
        return q, k, v, cu_q, cu_k, max(lengths)

    fn = lambda q, k, v, cu_q, cu_k, m: flash_attn_varlen_func(q, k, v, cu_q, cu_k, m, m + 3, causal=True)  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for i, lengths in enumerate([[3, 5, 7], [4, 9, 2, 6, 5, 5], [10, 1], [8, 8, 8, 8, 8, 1, 1, 1, 1]]):
        args = make(lengths)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(*args)
        torch.testing.assert_close(got, fn(*args), atol=1e-6, rtol=0)
        got.sum().backward()


@pytest.mark.parametrize(
    "totals,batch,max_seqlens,seqused,want",
    [
        ((3 * 129, 3 * 257), 3, (129, 257), False, (3, 129, 257)),  # every sequence max long
        ((1, 1), 1, (1, 1), False, (1, 1, 1)),
        ((3 * 129 - 1, 3 * 257), 3, (129, 257), False, None),  # one query short
        ((3 * 129, 3 * 257 - 5), 3, (129, 257), False, None),  # keys differ
        ((3 * 129, 3 * 257), 3, (130, 257), False, None),  # max_seqlen above every length
        ((3 * 129, 3 * 257), 3, (129, 257), True, None),  # seqused: rows left out, packed kernels
        ((0, 0), 0, (0, 0), False, None),  # no sequence
        ((0, 0), 2, (0, 0), False, None),  # empty sequences
    ],
)
def test_equal_length_batches_take_the_dense_kernels(totals, batch, max_seqlens, seqused, want):
    """``kernels.equal_lengths``: the packed batches the dense kernels run (host ints only)."""
    from flashtile.kernels import equal_lengths

    cu = torch.zeros(batch + 1, dtype=torch.int32)
    used = torch.zeros(batch, dtype=torch.int32) if seqused else None
    assert equal_lengths(*totals, cu, used, None, *max_seqlens) == want
    assert equal_lengths(*totals, cu, None, used, *max_seqlens) == want
