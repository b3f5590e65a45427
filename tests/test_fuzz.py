"""Property-based tests (Hypothesis) over every public entry point, on CPU.

Each example draws a shape (batch, sequence lengths and heads down to 0 and 1, odd head dims,
``d_v != d``, GQA ratios) and a combination of options (causal, window incl. -1 and 0, sinks
incl. -inf, softcap, scale, float32/float64, non-contiguous layouts), and checks

* the output, lse and the gradients of q, k, v and sinks against ``oracle`` below: a plain
  full-matrix float64 attention written from the documented semantics (design.md), with its
  gradients from torch.autograd;
* invariants that need no oracle: batch permutation commutes, GQA equals MHA on expanded K/V
  (gradients summed over the group), query prefixes/suffixes, combining two key halves by their
  lse equals attending to all keys (the split-KV / ring rule), varlen equals the per-sequence
  dense call, a KV-cache append equals attending over the concatenation;
* NaN/inf inputs: propagation as in PyTorch's math SDPA backend, confined to the rows and
  columns they can reach;
* on CPU, the float16/bfloat16 forward is the float32 arithmetic rounded once;
* any input, however inconsistent (shapes, ranks, dtypes, options, offsets, cache lengths),
  gives an answer or a named error (ValueError / TypeError / NotImplementedError).

``flashtile.distributed.ring_flash_attn_func`` is not fuzzed here (it needs processes); the
lse-combination property is the rule it relies on.

Profiles: ``ci`` (default; bounded, derandomized so CI is reproducible) and ``nightly``
(``HYPOTHESIS_PROFILE=nightly``, thousands of examples per test, random).  Tensors' values come
from a drawn seed (Hypothesis draws the seed and every shape and option, and shrinks them).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import flashtile

_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile("ci", max_examples=60, derandomize=True, database=None, **_COMMON)
settings.register_profile("nightly", max_examples=3000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

F64 = torch.float64
INF = float("inf")


pytestmark = pytest.mark.usefixtures("one_thread")


# --- the float64 oracle -------------------------------------------------------------------------


def visible(sq: int, sk: int, left: int, right: int, off: Optional[int] = None, chunk: int = 0,
            base: int = 0) -> torch.Tensor:
    """(sq, sk) bool: row i sees key j when ``i + off - left <= j <= i + off + right`` (and, with
    ``chunk``, when ``(base + i + off) // chunk == (base + j) // chunk``: key j at position
    ``base + j``)."""
    off = sk - sq if off is None else off
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if chunk:
        vis &= (base + i + off) // chunk == (base + j) // chunk
    if right >= 0:
        vis &= j <= i + off + right
    if left >= 0:
        vis &= j >= i + off - left
    return vis


def oracle_scores(q, k, scale, softcap, left, right, off=None, chunk=0, base=0):
    """(b, h, sq, sk) float64 scores after softcap and mask (masked: -inf)."""
    h, hkv = q.shape[2], k.shape[2]
    kx = k.repeat_interleave(h // hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kx) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    return s.masked_fill(~visible(q.shape[1], k.shape[1], left, right, off, chunk, base), -INF)


def oracle(q, k, v, scale, left=-1, right=-1, sinks=None, softcap=0.0, off=None, chunk=0, base=0):
    """Naive attention, (b, sq, h, d) layout; differentiable.  Returns out, lse (b, h, sq).

    Rows that see no key (and no sink) output 0 with lse -inf; a sink adds exp(sink) to the
    softmax denominator and no value.
    """
    b, sq, h, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    s = oracle_scores(q, k, scale, softcap, left, right, off, chunk, base)
    logits = s if sinks is None else torch.cat([s, sinks[None, :, None, None].expand(b, h, sq, 1)], dim=-1)
    if logits.shape[-1]:
        m = logits.detach().amax(dim=-1)
    else:
        m = logits.new_full((b, h, sq), -INF)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # only a stabilizer: exact either way
    e = torch.exp(logits - m[..., None])
    l = e.sum(dim=-1)
    seen = l > 0
    one = torch.ones_like(l)
    lse = torch.where(seen, torch.log(torch.where(seen, l, one)) + m, torch.full_like(l, -INF))
    p = e[..., :sk] / torch.where(seen, l, one)[..., None]
    out = torch.einsum("bhij,bjhd->bihd", p, v.repeat_interleave(h // hkv, dim=2))
    return out, lse


# --- strategies ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    b: int
    sq: int
    sk: int
    hkv: int
    group: int
    d: int
    dv: int
    causal: bool
    window: tuple
    sinks: Optional[str]  # None, "finite", "some -inf"
    softcap: float
    scale: Optional[float]
    dtype: torch.dtype
    layout: str  # "contiguous" or "bhsd" (non-contiguous transposed views)
    deterministic: bool
    magnitude: float
    seed: int

    @property
    def h(self) -> int:
        return self.hkv * self.group

    @property
    def right(self) -> int:
        return 0 if self.causal else self.window[1]

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.d) if self.scale is None else self.scale


seqlens = st.one_of(st.integers(0, 9), st.integers(120, 140))  # 120..140 crosses the reference's 128-row chunk
window_sides = st.one_of(st.just(-1), st.integers(0, 8))
head_dims = st.one_of(st.integers(1, 24), st.sampled_from([31, 33, 40, 64]))


@st.composite
def cases(draw, empty=True, dtypes=(F64, torch.float32), **fixed):
    def pick(name, strategy):  # a fixed value, a strategy replacing the default, or the default
        value = fixed.get(name, strategy)
        return draw(value) if isinstance(value, st.SearchStrategy) else value

    d = pick("d", head_dims)
    return Case(
        b=pick("b", st.integers(0 if empty else 1, 3)),
        sq=pick("sq", seqlens if empty else seqlens.filter(bool)),
        sk=pick("sk", seqlens if empty else seqlens.filter(bool)),
        hkv=pick("hkv", st.integers(1, 3)),
        group=pick("group", st.sampled_from([1, 2, 3, 0] if empty else [1, 2, 3])),
        d=d,
        dv=pick("dv", st.one_of(st.just(d), head_dims)),
        causal=pick("causal", st.booleans()),
        window=pick("window", st.tuples(window_sides, window_sides)),
        sinks=pick("sinks", st.sampled_from([None, "finite", "some -inf"])),
        softcap=pick("softcap", st.one_of(st.just(0.0), st.floats(0.5, 30.0))),
        scale=pick("scale", st.one_of(st.none(), st.floats(0.05, 1.5))),
        dtype=pick("dtype", st.sampled_from(list(dtypes))),
        layout=pick("layout", st.sampled_from(["contiguous", "bhsd"])),
        deterministic=pick("deterministic", st.booleans()),
        magnitude=pick("magnitude", st.sampled_from([1.0, 3.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sinks: Optional[torch.Tensor]
    dout: torch.Tensor
    dlse: torch.Tensor


def make_inputs(c: Case, requires_grad: bool = True) -> Inputs:
    gen = torch.Generator().manual_seed(c.seed)

    def rnd(*shape, scale=c.magnitude):
        return torch.randn(*shape, generator=gen, dtype=F64) * scale

    def tensor(s, h, d):
        if c.layout == "bhsd":  # non-contiguous (b, s, h, d) view of (b, h, s, d) storage
            x = rnd(c.b, h, s, d).to(c.dtype).transpose(1, 2)
        else:
            x = rnd(c.b, s, h, d).to(c.dtype)
        return x.requires_grad_(requires_grad) if x.is_leaf else x.detach().requires_grad_(requires_grad)

    q, k, v = tensor(c.sq, c.h, c.d), tensor(c.sk, c.hkv, c.d), tensor(c.sk, c.hkv, c.dv)
    sinks = None
    if c.sinks is not None:
        sinks = rnd(c.h, scale=2.0)
        if c.sinks == "some -inf":
            sinks[::2] = -INF
        sinks = sinks.to(c.dtype).requires_grad_(requires_grad)
    dout = rnd(c.b, c.sq, c.h, c.dv, scale=1.0).to(c.dtype)
    dlse = rnd(c.b, c.h, c.sq, scale=1.0)
    return Inputs(q, k, v, sinks, dout, dlse)


def leaves(x: Inputs):
    return [t for t in (x.q, x.k, x.v, x.sinks) if t is not None]


def as_f64_leaves(x: Inputs) -> Inputs:
    def conv(t):
        return None if t is None else t.detach().to(F64).requires_grad_(True)

    return Inputs(conv(x.q), conv(x.k), conv(x.v), conv(x.sinks), x.dout.to(F64), x.dlse)


def loss_of(out, lse, x: Inputs):
    """Scalar whose gradient exercises dout and (finite entries of) dlse."""
    loss = (out.to(F64) * x.dout.to(F64)).sum()
    if lse is not None:
        lse64 = lse.to(F64)
        loss = loss + torch.where(lse64.isfinite(), lse64, torch.zeros_like(lse64)).mul(x.dlse).sum()
    return loss


def grads(loss, tensors):
    if not loss.requires_grad:  # nothing reached the loss (e.g. empty output)
        return [torch.zeros_like(t) for t in tensors]
    gs = torch.autograd.grad(loss, tensors, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(gs, tensors)]


def tolerance(c: Case, ref: torch.Tensor, score_max: float) -> float:
    """Absolute tolerance: a few hundred ulps of the input dtype, scaled by the magnitudes."""
    eps = torch.finfo(c.dtype).eps
    mag = ref.detach().abs().max().item() if ref.numel() else 0.0
    if not math.isfinite(mag):
        mag = 0.0
    return 300 * eps * (1 + score_max) * (1 + mag) * max(1, c.d, c.dv) ** 0.5


def score_max(x64: Inputs, c: Case, off=None, chunk=0, base=0) -> float:
    with torch.no_grad():
        s = oracle_scores(x64.q, x64.k, c.softmax_scale, c.softcap, c.window[0], c.right, off, chunk, base)
        s = s[s.isfinite()]
        return s.abs().max().item() if s.numel() else 0.0


def assert_close(got, want, tol, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.detach().to(F64), want.detach().to(F64)
    # -inf must match exactly (rows that see nothing); everything else within tol.
    assert torch.equal(got.isneginf(), want.isneginf()), f"{what}: -inf pattern differs"
    assert not got.isnan().any(), f"{what}: NaN"
    fin = want.isfinite()
    if fin.any():
        err = (got[fin] - want[fin]).abs().max().item()
        assert err <= tol, f"{what}: max abs error {err:.3g} > tol {tol:.3g}"


def check_against_oracle(c: Case, x: Inputs, out, lse, off=None, check_lse=True, chunk=0):
    """Compare (out, lse) and the gradients of x's leaves with the float64 oracle."""
    x64 = as_f64_leaves(x)
    o_ref, l_ref = oracle(x64.q, x64.k, x64.v, c.softmax_scale, c.window[0], c.right, x64.sinks, c.softcap, off, chunk)
    smax = score_max(x64, c, off, chunk)
    assert out.dtype == c.dtype
    assert_close(out, o_ref, tolerance(c, o_ref, smax), "out")
    if check_lse:
        assert_close(lse, l_ref, tolerance(c, l_ref, smax), "lse")
    g_got = grads(loss_of(out, lse if check_lse else None, x), leaves(x))
    g_ref = grads(loss_of(o_ref, l_ref if check_lse else None, x64), leaves(x64))
    for name, g, r, t in zip("qkvs", g_got, g_ref, leaves(x)):
        assert g.dtype == t.dtype
        assert_close(g, r, tolerance(c, r, smax) * 4 * (1 + smax), f"d{name}")


def flash(c: Case, x: Inputs, q=None, k=None, v=None, **kw):
    kwargs = dict(
        softmax_scale=c.scale, causal=c.causal, window_size=c.window, sinks=x.sinks,
        softcap=c.softcap, deterministic=c.deterministic, return_lse=True,
    )
    kwargs.update(kw)
    return flashtile.flash_attn_func(x.q if q is None else q, x.k if k is None else k, x.v if v is None else v, **kwargs)


# --- flash_attn_func and SDPA against the oracle ------------------------------------------------


@given(cases())
def test_flash_attn_func_matches_oracle(c):
    note(c)
    x = make_inputs(c)
    before = [t.detach().clone() for t in leaves(x)]
    out, lse = flash(c, x)
    assert out.shape == (c.b, c.sq, c.h, c.dv) and out.is_contiguous()
    assert lse.shape == (c.b, c.h, c.sq) and lse.dtype == (F64 if c.dtype == F64 else torch.float32)
    check_against_oracle(c, x, out, lse)
    for t, t0 in zip(leaves(x), before):  # inputs are never modified
        assert torch.equal(t.detach(), t0)


@given(cases(), st.integers(1, 9))
def test_chunked_attention_matches_oracle(c, chunk):
    """``attention_chunk``: the oracle with the chunk rule in its mask (no decomposition)."""
    note((c, chunk))
    x = make_inputs(c)
    out, lse = flash(c, x, attention_chunk=chunk)
    assert out.shape == (c.b, c.sq, c.h, c.dv) and lse.shape == (c.b, c.h, c.sq)
    check_against_oracle(c, x, out, lse, chunk=chunk)


@given(cases())
def test_sdpa_matches_oracle(c):
    """PyTorch layout and top-left alignment: row i sees j when i - left <= j <= i + right."""
    note(c)
    x = make_inputs(c)
    q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
    out = flashtile.scaled_dot_product_attention(
        q, k, v, is_causal=c.causal, scale=c.scale, enable_gqa=True, window_size=c.window,
        sinks=x.sinks, softcap=c.softcap,
    )
    assert out.shape == (c.b, c.h, c.sq, c.dv)
    check_against_oracle(c, x, out.transpose(1, 2), None, off=0, check_lse=False)


@given(cases(empty=False, dtypes=(F64,), window=(-1, -1), sinks=None, softcap=0.0, layout="contiguous"))
def test_sdpa_matches_torch_sdpa(c):
    """Where the features overlap, flashtile's SDPA equals PyTorch's math backend (float64)."""
    note(c)
    x = make_inputs(c)
    q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
    ours = flashtile.scaled_dot_product_attention(q, k, v, is_causal=c.causal, scale=c.scale, enable_gqa=True)
    x64 = as_f64_leaves(x)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        theirs = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (x64.q, x64.k, x64.v)), is_causal=c.causal, scale=c.scale, enable_gqa=True
        )
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
    dout = x.dout.transpose(1, 2)
    g_ours = torch.autograd.grad(ours, (x.q, x.k, x.v), dout)
    g_theirs = torch.autograd.grad(theirs, (x64.q, x64.k, x64.v), dout)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)


# --- invariants (no oracle) ---------------------------------------------------------------------


@given(cases(dtypes=(torch.float32,), layout="contiguous"), st.sampled_from([torch.float16, torch.bfloat16]))
def test_cpu_low_precision_is_float32_rounded(c, low):
    """On CPU, float16/bfloat16 run the float32 arithmetic (reference.py): the output is the
    float32 path's rounded once to the input dtype, and lse is the float32 path's.  (Gradients
    differ: the backward's Delta = dO . O uses the rounded output, as the kernels do.)"""
    note((c, low))
    x = make_inputs(c, requires_grad=False)
    q, k, v = (t.to(low) for t in (x.q, x.k, x.v))
    sinks = None if x.sinks is None else x.sinks.to(low)
    out_l, lse_l = flash(c, x, q=q, k=k, v=v, sinks=sinks)
    out_32, lse_32 = flash(c, x, q=q.float(), k=k.float(), v=v.float(), sinks=None if sinks is None else sinks.float())
    assert out_l.dtype == low and lse_l.dtype == torch.float32
    assert torch.equal(out_l, out_32.to(low)) and torch.equal(lse_l, lse_32)



def same(a, b, c: Case, what=""):
    """Two computations that differ only in summation order: equal up to rounding, which grows
    with the score magnitude (bounded by scale * magnitude^2 * sqrt(d) for these inputs)."""
    scores = 1 + c.softmax_scale * c.magnitude**2 * math.sqrt(c.d)
    growth = scores * (1 + c.magnitude**2)
    tol = max(1e-10, 2e-14 * growth) if c.dtype == F64 else max(2e-5 * (1 + c.magnitude**2), 2e-6 * growth)
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


@given(cases(), st.data())
def test_batch_permutation_commutes(c, data):
    note(c)
    x = make_inputs(c)
    perm = torch.tensor(data.draw(st.permutations(range(c.b))), dtype=torch.long)
    out, lse = flash(c, x)
    out_p, lse_p = flash(c, x, q=x.q[perm], k=x.k[perm], v=x.v[perm])
    same(out_p, out[perm], c, "out")
    same(lse_p, lse[perm], c, "lse")
    g = grads(loss_of(out, lse, x), [x.q, x.k, x.v])
    xp = Inputs(x.q, x.k, x.v, x.sinks, x.dout[perm], x.dlse[perm])
    g_p = grads(loss_of(out_p, lse_p, xp), [x.q, x.k, x.v])
    for a, b, n in zip(g, g_p, "qkv"):
        same(a, b, c, f"d{n}")


@given(cases(group=st.sampled_from([2, 3, 4]), b=st.integers(1, 3)))
def test_gqa_equals_expanded_mha(c):
    """Query head h reads kv head h // group: same as MHA on K/V repeated per group; the
    gradients of the repeated K/V summed over each group are GQA's dK/dV."""
    note(c)
    x = make_inputs(c)
    ke = x.k.detach().repeat_interleave(c.group, dim=2).requires_grad_(True)
    ve = x.v.detach().repeat_interleave(c.group, dim=2).requires_grad_(True)
    out, lse = flash(c, x)
    out_e, lse_e = flash(c, x, k=ke, v=ve)
    same(out_e, out, c, "out")
    same(lse_e, lse, c, "lse")
    gq, gk, gv = grads(loss_of(out, lse, x), [x.q, x.k, x.v])
    gq_e, gk_e, gv_e = grads(loss_of(out_e, lse_e, x), [x.q, ke, ve])
    same(gq_e, gq, c, "dq")
    same(gk_e.unflatten(2, (c.hkv, c.group)).sum(3), gk, c, "dk")
    same(gv_e.unflatten(2, (c.hkv, c.group)).sum(3), gv, c, "dv")


@given(cases(), st.data())
def test_query_suffix_gives_output_suffix(c, data):
    """Bottom-right alignment: the last p query rows against all keys give the last p rows."""
    note(c)
    p = data.draw(st.integers(0, c.sq))
    x = make_inputs(c)
    out, lse = flash(c, x)
    out_s, lse_s = flash(c, x, q=x.q[:, c.sq - p :])
    same(out_s, out[:, c.sq - p :], c, "out")
    same(lse_s, lse[:, :, c.sq - p :], c, "lse")


@given(cases(causal=True), st.data())
def test_causal_prefix_gives_output_prefix(c, data):
    """seqlen_q == seqlen_k, causal: the first p queries over the first p keys give the first
    p rows (flash_attn_func), and over all keys with top-left alignment (SDPA)."""
    c = Case(**{**c.__dict__, "sk": c.sq})
    note(c)
    p = data.draw(st.integers(0, c.sq))
    x = make_inputs(c)
    out, lse = flash(c, x)
    out_p, lse_p = flash(c, x, q=x.q[:, :p], k=x.k[:, :p], v=x.v[:, :p])
    same(out_p, out[:, :p], c, "out")
    same(lse_p, lse[:, :, :p], c, "lse")
    sdpa = flashtile.scaled_dot_product_attention
    kw = dict(is_causal=True, scale=c.scale, enable_gqa=True, window_size=c.window, sinks=x.sinks, softcap=c.softcap)
    full = sdpa(*(t.transpose(1, 2) for t in (x.q, x.k, x.v)), **kw)
    pre = sdpa(*(t.transpose(1, 2) for t in (x.q[:, :p], x.k, x.v)), **kw)
    same(pre, full[:, :, :p], c, "sdpa out")


@given(cases(causal=False, window=(-1, -1)), st.data())
def test_key_split_combines_by_lse(c, data):
    """Attending to K = K1 ++ K2 equals combining the two partial results by their lse
    (the split-KV / ring-attention rule); the sink is counted in one half only."""
    note(c)
    split = data.draw(st.integers(0, c.sk))
    x = make_inputs(c)
    out, lse = flash(c, x)
    o1, l1 = flash(c, x, k=x.k[:, :split], v=x.v[:, :split])
    o2, l2 = flash(c, x, k=x.k[:, split:], v=x.v[:, split:], sinks=None)
    l = torch.logaddexp(l1, l2)
    safe = torch.where(l.isfinite(), l, torch.zeros_like(l))
    w1 = torch.exp(l1 - safe).transpose(1, 2)[..., None]
    w2 = torch.exp(l2 - safe).transpose(1, 2)[..., None]
    comb = (w1 * o1.to(w1.dtype) + w2 * o2.to(w2.dtype)).to(out.dtype)
    same(l, lse, c, "lse")
    same(comb, out, c, "out")


# --- NaN / inf ----------------------------------------------------------------------------------

special_values = st.sampled_from([float("nan"), INF, -INF])


@given(cases(empty=False, dtypes=(F64,), sinks=None, softcap=0.0, layout="contiguous"), st.data())
def test_nonfinite_q_or_k_stays_in_reach(c, data):
    """A NaN/inf in q row i changes only row i; one in k row j changes only rows that see j."""
    note(c)
    which = data.draw(st.sampled_from(["q", "k"]))
    val = data.draw(special_values)
    x = make_inputs(c, requires_grad=False)
    out, lse = flash(c, x)
    t = (x.q if which == "q" else x.k).clone()
    bi = data.draw(st.integers(0, c.b - 1))
    row = data.draw(st.integers(0, t.shape[1] - 1))
    hi = data.draw(st.integers(0, t.shape[2] - 1))
    t[bi, row, hi, data.draw(st.integers(0, c.d - 1))] = val
    out_n, lse_n = flash(c, x, **{which: t})
    vis = visible(c.sq, c.sk, c.window[0], c.right)
    reach = torch.zeros(c.b, c.sq, c.h, dtype=torch.bool)
    heads = slice(hi, hi + 1) if which == "q" else slice(hi * c.group, (hi + 1) * c.group)
    if which == "q":
        reach[bi, row, heads] = True
    else:
        reach[bi, :, heads] = vis[:, row, None]
    # Untouched rows: exactly the clean result.
    assert torch.equal(out_n[~reach], out[~reach])
    assert torch.equal(lse_n.transpose(1, 2)[~reach], lse.transpose(1, 2)[~reach])
    if which == "q" and val != val:  # NaN in q: the row is NaN if it sees any key, else 0 / -inf
        sees = bool(vis[row].any())
        r_out, r_lse = out_n[bi, row, hi], lse_n[bi, hi, row]
        assert bool(r_out.isnan().all()) if sees else bool((r_out == 0).all()), r_out
        assert bool(r_lse.isnan()) if sees else bool(r_lse == -INF), r_lse


@given(cases(empty=False, dtypes=(F64,), sinks=None, softcap=0.0, layout="contiguous"), st.data())
def test_nan_in_v_poisons_one_column(c, data):
    """A NaN in v[j, c] makes column c NaN in every row that sees key j; other columns and
    other batches/kv groups are untouched.  (Rows that do not see j may get NaN in column c too,
    from 0 * NaN, as in PyTorch's SDPA.)"""
    note(c)
    x = make_inputs(c, requires_grad=False)
    out, _ = flash(c, x)
    v = x.v.clone()
    bi, row = data.draw(st.integers(0, c.b - 1)), data.draw(st.integers(0, c.sk - 1))
    hi, col = data.draw(st.integers(0, c.hkv - 1)), data.draw(st.integers(0, c.dv - 1))
    v[bi, row, hi, col] = float("nan")
    out_n, _ = flash(c, x, v=v)
    heads = slice(hi * c.group, (hi + 1) * c.group)
    sees = visible(c.sq, c.sk, c.window[0], c.right)[:, row]
    assert bool(out_n[bi, sees, heads, col].isnan().all())
    other = torch.ones_like(out, dtype=torch.bool)
    other[bi, :, heads, col] = False
    assert torch.equal(out_n[other], out[other])


@given(cases(empty=False, dtypes=(F64,), sinks="finite"), st.data())
def test_nan_sink_poisons_its_head(c, data):
    """A NaN sink makes its head's outputs and lse NaN (every row takes softmax mass from it);
    other heads are untouched."""
    note(c)
    x = make_inputs(c, requires_grad=False)
    out, lse = flash(c, x)
    hi = data.draw(st.integers(0, c.h - 1))
    sinks = x.sinks.clone()
    sinks[hi] = float("nan")
    out_n, lse_n = flash(c, x, sinks=sinks)
    assert bool(out_n[:, :, hi].isnan().all()) and bool(lse_n[:, hi].isnan().all())
    others = [j for j in range(c.h) if j != hi]
    assert torch.equal(out_n[:, :, others], out[:, :, others]) and torch.equal(lse_n[:, others], lse[:, others])


@given(cases(empty=False, dtypes=(F64,), window=(-1, -1), sinks=None, softcap=0.0, layout="contiguous"), st.data())
def test_nonfinite_matches_torch_math_sdpa(c, data):
    """NaN/inf anywhere in q, k or v: same NaN/inf pattern and values as PyTorch's math SDPA
    backend (full or top-left causal mask), except a row whose every visible score is -inf
    (possible only with infinite inputs): flashtile treats it as a row that sees no key
    (output 0), PyTorch returns NaN."""
    note(c)
    x = make_inputs(c, requires_grad=False)
    which = data.draw(st.sampled_from(["q", "k", "v"]))
    t = {"q": x.q, "k": x.k, "v": x.v}[which].clone()
    idx = tuple(data.draw(st.integers(0, n - 1)) for n in t.shape)
    t[idx] = data.draw(special_values)
    q, k, v = (({"q": x.q, "k": x.k, "v": x.v} | {which: t})[n].transpose(1, 2) for n in "qkv")
    ours = flashtile.scaled_dot_product_attention(q, k, v, is_causal=c.causal, scale=c.scale, enable_gqa=True)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=c.causal, scale=c.scale, enable_gqa=True)
    s = oracle_scores(q.transpose(1, 2), k.transpose(1, 2), c.softmax_scale, 0.0, -1, 0 if c.causal else -1, off=0)
    dead = (s == -INF).all(dim=-1)  # (b, h, sq): every visible score -inf
    assert bool((ours[dead] == 0).all())
    # PyTorch adds the mask to the scores, so a NaN in a masked key reaches every row
    # (NaN + -inf); flashtile masks by selection: compare the rows that see the key.
    sees = torch.ones_like(dead)
    if which != "q" and c.causal:
        sees[:, :, : idx[1]] = False
    keep = sees & ~dead
    torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-9, atol=1e-9, equal_nan=True)


# --- entry points that land during the session --------------------------------------------------

needs_varlen = pytest.mark.skipif(not hasattr(flashtile, "flash_attn_varlen_func"), reason="no flash_attn_varlen_func yet")
needs_kvcache = pytest.mark.skipif(not hasattr(flashtile, "flash_attn_with_kvcache"), reason="no flash_attn_with_kvcache yet")


@st.composite
def varlen_cases(draw):
    c = draw(cases(b=st.integers(0, 4), sq=0, sk=0, layout="contiguous"))
    lens = st.one_of(st.integers(0, 9), st.integers(120, 133))
    lq = draw(st.lists(lens, min_size=c.b, max_size=c.b))
    lk = draw(st.lists(lens, min_size=c.b, max_size=c.b))
    used_q = draw(st.one_of(st.none(), st.tuples(*(st.integers(0, n) for n in lq))))
    used_k = draw(st.one_of(st.none(), st.tuples(*(st.integers(0, n) for n in lk))))
    chunk = draw(st.sampled_from([0, 0, 1, 3, 7, 64]))  # attention_chunk
    return c, lq, lk, used_q, used_k, chunk


@needs_varlen
@given(varlen_cases())
def test_varlen_matches_oracle_and_dense(vc):
    """Packed sequences (empty ones included, seqused_q/k, attention_chunk): each sequence's rows
    equal the oracle and the dense flash_attn_func call on that sequence alone; rows past seqused_q
    output 0 with lse -inf; gradients match the oracle's."""
    c, lq, lk, used_q, used_k, chunk = vc
    note((c, lq, lk, used_q, used_k, chunk))
    gen = torch.Generator().manual_seed(c.seed)

    def rnd(*shape, scale=c.magnitude):
        return (torch.randn(*shape, generator=gen, dtype=F64) * scale).to(c.dtype)

    tq, tk = sum(lq), sum(lk)
    q = rnd(tq, c.h, c.d).requires_grad_(True)
    k = rnd(tk, c.hkv, c.d).requires_grad_(True)
    v = rnd(tk, c.hkv, c.dv).requires_grad_(True)
    sinks = None if c.sinks is None else rnd(c.h, scale=2.0).requires_grad_(True)
    dout, dlse = rnd(tq, c.h, c.dv, scale=1.0), torch.randn(c.h, tq, generator=gen, dtype=F64)
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
    cu_q, cu_k = cu(lq), cu(lk)
    opt = lambda u: None if u is None else torch.tensor(u, dtype=torch.int32)
    out, lse = flashtile.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lq, default=0), max(lk, default=0), softmax_scale=c.scale, causal=c.causal,
        window_size=c.window, softcap=c.softcap, deterministic=c.deterministic, sinks=sinks, return_lse=True,
        seqused_q=opt(used_q), seqused_k=opt(used_k), attention_chunk=chunk,
    )
    assert out.shape == (tq, c.h, c.dv) and lse.shape == (c.h, tq)
    # The oracle, per sequence, assembled into the packed layout.
    q64, k64, v64 = (t.detach().to(F64).requires_grad_(True) for t in (q, k, v))
    s64 = None if sinks is None else sinks.detach().to(F64).requires_grad_(True)
    o_ref = torch.zeros(tq, c.h, c.dv, dtype=F64)
    l_ref = torch.full((c.h, tq), -INF, dtype=F64)
    o_parts, l_parts, rows_all = [], [], []
    smax = 0.0
    for b in range(c.b):
        nq = lq[b] if used_q is None else used_q[b]
        nk = lk[b] if used_k is None else used_k[b]
        qs, ks = int(cu_q[b]), int(cu_k[b])
        if nq == 0:
            continue
        qb, kb, vb = q64[None, qs : qs + nq], k64[None, ks : ks + nk], v64[None, ks : ks + nk]
        ob, lb = oracle(qb, kb, vb, c.softmax_scale, c.window[0], c.right, s64, c.softcap, chunk=chunk)
        o_parts.append(ob[0])
        l_parts.append(lb[0])
        rows_all.append(torch.arange(qs, qs + nq))
        with torch.no_grad():
            sb = oracle_scores(qb, kb, c.softmax_scale, c.softcap, c.window[0], c.right, chunk=chunk)
            sb = sb[sb.isfinite()]
            smax = max(smax, sb.abs().max().item() if sb.numel() else 0.0)
        # the dense entry point on the sequence alone
        od, ld = flashtile.flash_attn_func(
            q[None, qs : qs + nq].detach(), k[None, ks : ks + nk].detach(), v[None, ks : ks + nk].detach(),
            softmax_scale=c.scale, causal=c.causal, window_size=c.window,
            sinks=None if sinks is None else sinks.detach(), softcap=c.softcap, return_lse=True,
            attention_chunk=chunk,
        )
        same(out[qs : qs + nq].detach(), od[0], c, f"seq {b} out vs dense")
        same(lse[:, qs : qs + nq].detach(), ld[0], c, f"seq {b} lse vs dense")
    if rows_all:
        rows = torch.cat(rows_all)
        o_ref = o_ref.index_put((rows,), torch.cat(o_parts))
        l_ref = l_ref.clone()
        l_ref[:, rows] = torch.cat(l_parts, dim=-1)
    assert_close(out, o_ref, tolerance(c, o_ref, smax), "out")
    assert_close(lse, l_ref.detach(), tolerance(c, l_ref, smax), "lse")

    def loss(o, l):
        l = l.to(F64)
        return (o.to(F64) * dout.to(F64)).sum() + torch.where(l.isfinite(), l, torch.zeros_like(l)).mul(dlse).sum()

    ts = [t for t in (q, k, v, sinks) if t is not None]
    ts64 = [t for t in (q64, k64, v64, s64) if t is not None]
    g_got = grads(loss(out, lse), ts)
    g_ref = grads(loss(o_ref, l_ref), ts64)
    for name, g, r in zip("qkvs", g_got, g_ref):
        assert_close(g, r, tolerance(c, r, smax) * 4 * (1 + smax), f"d{name}")


@dataclass(frozen=True)
class KvCase:
    c: Case
    s_new: int  # new tokens appended (k, v)
    lens: tuple  # cache_seqlens
    leftpad: Optional[tuple]  # cache_leftpad or None
    extra: int  # spare cache rows after the last used one
    page: Optional[int]  # None: contiguous cache; else the page size of a paged cache
    spare_rows: Optional[int]  # contiguous only: cache_batch_idx over batch + spare_rows cache rows
    rotary: Optional[str]  # None, "interleaved", "halves"
    rotary_dim: int
    num_splits: int
    chunk: int = 0  # attention_chunk (0: off); several query tokens only when causal


@st.composite
def kvcache_cases(draw):
    """A decode step: ``s_new`` new tokens appended at ``cache_seqlens[b]`` to a cache of
    ``seqlen_cache`` rows (contiguous, possibly through ``cache_batch_idx``, or paged with page
    size 1..3 and a shuffled table), with left padding, rotary and split-KV drawn too."""
    c = draw(cases(b=st.integers(0, 3), sq=st.integers(0, 4), sk=0, layout="contiguous"))
    s_new = draw(st.integers(0, 4))
    lens = tuple(draw(st.lists(st.integers(0, 12), min_size=c.b, max_size=c.b)))
    leftpad = draw(st.one_of(st.none(), st.tuples(*(st.integers(0, n) for n in lens))))
    page = draw(st.sampled_from([None, 1, 2, 3]))
    spare = draw(st.one_of(st.none(), st.integers(0, 2))) if page is None else None
    rotary = draw(st.sampled_from([None, "interleaved", "halves"])) if s_new else None
    rotary_dim = 2 * draw(st.integers(1, max(1, c.d // 2))) if rotary else 0
    assume_ok = rotary is None or c.d >= 2
    if not assume_ok:
        rotary, rotary_dim = None, 0
    chunk = draw(st.sampled_from([0, 0, 1, 2, 3, 5]))
    if c.sq > 1 and not c.causal:
        chunk = 0
    return KvCase(c, s_new, lens, leftpad, draw(st.integers(0, 3)), page, spare, rotary, rotary_dim,
                  draw(st.sampled_from([0, 1, 2, 3])), chunk)


def rotate(x, cos, sin, positions, interleaved):
    """Rotary embedding (float64) of the first 2 * cos.shape[1] features of x (b, s, h, d) at
    integer positions (b, s): pairs (x0, x1), (x2, x3), ... (GPT-J) or halves (GPT-NeoX)."""
    half = cos.shape[1]
    c, s = cos[positions][:, :, None, :], sin[positions][:, :, None, :]
    xr, rest = x[..., : 2 * half], x[..., 2 * half :]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xr[..., :half], xr[..., half:]
        rot = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((rot, rest), dim=-1)


@needs_kvcache
@given(kvcache_cases())
def test_kvcache_append_equals_attention_over_concatenation(kc):
    """flash_attn_with_kvcache writes k/v (rotated, with rotary) at cache_seqlens in place
    (nothing else in the cache changes) and returns the oracle's attention of q (rotated at
    cache_seqlens + t when causal/windowed, else at cache_seqlens) over the keys
    [cache_leftpad, cache_seqlens + s_new) of the updated cache, bottom-right aligned on that
    length; lse likewise."""
    c = kc.c
    note(kc)
    gen = torch.Generator().manual_seed(c.seed)

    def rnd(*shape, scale=c.magnitude):
        return torch.randn(*shape, generator=gen, dtype=F64) * scale

    s_new, lens = kc.s_new, kc.lens
    seqlen_cache = max(1, max(lens, default=0) + s_new + kc.extra)  # an empty cache is a named error (test_degenerate)
    rows = c.b + (kc.spare_rows or 0)
    q = rnd(c.b, c.sq, c.h, c.d).to(c.dtype)
    k_rows, v_rows = rnd(rows, seqlen_cache, c.hkv, c.d).to(c.dtype), rnd(rows, seqlen_cache, c.hkv, c.dv).to(c.dtype)
    k_new, v_new = rnd(c.b, s_new, c.hkv, c.d).to(c.dtype), rnd(c.b, s_new, c.hkv, c.dv).to(c.dtype)
    sinks = None if c.sinks is None else rnd(c.h, scale=2.0).to(c.dtype)
    batch_idx = None
    if kc.spare_rows is not None:
        batch_idx = torch.randperm(rows, generator=gen)[: c.b].to(torch.int32)
    idx = torch.arange(c.b) if batch_idx is None else batch_idx.long()
    kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32), softmax_scale=c.scale, causal=c.causal,
              window_size=c.window, softcap=c.softcap, num_splits=kc.num_splits, return_lse=True, sinks=sinks,
              cache_batch_idx=batch_idx, cache_leftpad=None if kc.leftpad is None else torch.tensor(kc.leftpad, dtype=torch.int32),
              attention_chunk=kc.chunk)
    if s_new:
        kw.update(k=k_new, v=v_new)
    per_token = c.causal or c.window != (-1, -1)
    if kc.rotary:
        seqlen_ro = max(lens, default=0) + max(s_new, c.sq if per_token else 1)
        angles = rnd(seqlen_ro, kc.rotary_dim // 2, scale=3.0)
        kw.update(rotary_cos=angles.cos().to(c.dtype), rotary_sin=angles.sin().to(c.dtype),
                  rotary_interleaved=kc.rotary == "interleaved")
    k0, v0 = k_rows.clone(), v_rows.clone()
    if kc.page is None:
        k_cache, v_cache = k_rows, v_rows
    else:  # the same cache, paged: position j of entry b lives in page table[b, j // page], slot j % page
        page = kc.page
        n_pages = -(-seqlen_cache // page)
        perm = torch.randperm(c.b * n_pages, generator=gen)
        table = perm.reshape(c.b, n_pages).to(torch.int32)
        pad = n_pages * page - seqlen_cache
        k_cache = torch.zeros(c.b * n_pages, page, c.hkv, c.d, dtype=c.dtype)
        v_cache = torch.zeros(c.b * n_pages, page, c.hkv, c.dv, dtype=c.dtype)
        k_cache[perm] = F.pad(k_rows, (0, 0, 0, 0, 0, pad)).reshape(c.b * n_pages, page, c.hkv, c.d)
        v_cache[perm] = F.pad(v_rows, (0, 0, 0, 0, 0, pad)).reshape(c.b * n_pages, page, c.hkv, c.dv)
        kw["block_table"] = table
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert out.shape == (c.b, c.sq, c.h, c.dv) and out.dtype == c.dtype and lse.shape == (c.b, c.h, c.sq)
    if kc.page is not None:  # back to (b, seqlen_cache, hkv, d) to check the append
        k_after = k_cache[table.long()].reshape(c.b, n_pages * page, c.hkv, c.d)[:, :seqlen_cache]
        v_after = v_cache[table.long()].reshape(c.b, n_pages * page, c.hkv, c.dv)[:, :seqlen_cache]
    else:
        k_after, v_after = k_cache[idx], v_cache[idx]
        untouched = torch.ones(rows, dtype=torch.bool)
        untouched[idx] = False
        assert torch.equal(k_cache[untouched], k0[untouched]) and torch.equal(v_cache[untouched], v0[untouched])
    k0, v0 = k0[idx] if kc.page is None else k0, v0[idx] if kc.page is None else v0
    # The oracle, per entry, in float64.
    q64, knew64 = q.to(F64), k_new.to(F64)
    base = torch.tensor(lens, dtype=torch.long)[:, None]
    if kc.rotary:
        cos64, sin64 = kw["rotary_cos"].to(F64), kw["rotary_sin"].to(F64)
        qpos = base + (torch.arange(c.sq) if per_token else torch.zeros(c.sq, dtype=torch.long))
        q64 = rotate(q64, cos64, sin64, qpos, kc.rotary == "interleaved")
        knew64 = rotate(knew64, cos64, sin64, base + torch.arange(s_new), kc.rotary == "interleaved")
    c32 = c.dtype != F64
    for b in range(c.b):
        n, lp = lens[b], 0 if kc.leftpad is None else kc.leftpad[b]
        want_k = torch.cat([k0[b, :n].to(F64), knew64[b], k0[b, n + s_new :].to(F64)])
        want_v = torch.cat([v0[b, :n], v_new[b], v0[b, n + s_new :]])
        assert torch.equal(v_after[b], want_v), f"v cache of entry {b}"
        if kc.rotary is None:
            assert torch.equal(k_after[b], want_k.to(c.dtype)), f"k cache of entry {b}"
        else:  # rotated in the input dtype's arithmetic: within rounding
            torch.testing.assert_close(k_after[b].to(F64), want_k, rtol=1e-5 if c32 else 1e-12, atol=1e-5 if c32 else 1e-12)
        kb, vb = want_k[None, lp : n + s_new], want_v[None, lp : n + s_new].to(F64)
        s64 = None if sinks is None else sinks.to(F64)
        o_ref, l_ref = oracle(q64[b : b + 1], kb, vb, c.softmax_scale, c.window[0], c.right, s64, c.softcap,
                              chunk=kc.chunk, base=lp)
        c1 = replace_case(c, b=1, sk=kb.shape[1])
        x64 = Inputs(q64[b : b + 1], kb, vb, s64, torch.zeros(1), torch.zeros(1))
        smax = score_max(x64, c1, chunk=kc.chunk, base=lp)
        rot = 10 if kc.rotary else 1  # q and k are rounded after the rotation
        assert_close(out[b : b + 1], o_ref, rot * tolerance(c1, o_ref, smax), f"entry {b} out")
        assert_close(lse[b : b + 1], l_ref, rot * tolerance(c1, l_ref, smax), f"entry {b} lse")


def replace_case(c: Case, **changes) -> Case:
    return Case(**{**c.__dict__, **changes})


# --- any input: an answer or a named error ------------------------------------------------------

NAMED_ERRORS = (ValueError, TypeError, NotImplementedError)
small_dims = st.integers(0, 3)


def _zeros_like_dtype(shape, dtype):
    return torch.ones(shape, dtype=dtype)


@st.composite
def loose_inputs(draw):
    """Shapes that may or may not agree (batch, heads, head dims, ranks), odd dtypes and options."""
    b, sq, sk, hkv, g, d, dv = (draw(small_dims) for _ in range(7))
    h = hkv * g if draw(st.booleans()) else draw(small_dims)

    def t(shape):
        shape = list(shape)
        if draw(st.integers(0, 9)) == 0:  # perturb one dimension or the rank
            if draw(st.booleans()) and shape:
                shape[draw(st.integers(0, len(shape) - 1))] = draw(small_dims)
            else:
                shape = shape[:-1] if draw(st.booleans()) else shape + [1]
        dtype = draw(st.sampled_from([torch.float64] * 6 + [torch.float32, torch.float16, torch.int32]))
        return _zeros_like_dtype(shape, dtype)

    q, k, v = t((b, sq, h, d)), t((b, sk, hkv, d)), t((b, sk, hkv, dv))
    sinks = draw(st.one_of(st.none(), st.builds(lambda n: torch.zeros(n, dtype=F64), st.integers(0, 4))))
    window = draw(st.tuples(st.integers(-3, 4), st.integers(-3, 4)))
    softcap = draw(st.sampled_from([0.0, 1.0, -1.0, float("inf"), float("nan")]))
    scale = draw(st.sampled_from([None, 0.5, 0.0, -1.0, float("nan")]))
    return q, k, v, sinks, window, softcap, scale


@given(loose_inputs(), st.booleans(), st.sampled_from([0, 0, 1, 2, 5, -1, 2.5]))
def test_any_input_gives_an_answer_or_a_named_error(inp, causal, chunk):
    """flash_attn_func and SDPA on arbitrary (often inconsistent) shapes, dtypes and options
    either return well-shaped outputs or raise ValueError/TypeError/NotImplementedError, never
    an error from deep inside (RuntimeError, IndexError, ZeroDivisionError...)."""
    q, k, v, sinks, window, softcap, scale = inp
    note((tuple(q.shape), q.dtype, tuple(k.shape), k.dtype, tuple(v.shape), v.dtype,
          None if sinks is None else tuple(sinks.shape), window, softcap, scale, causal, chunk))
    try:
        out = flashtile.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window, sinks=sinks,
                                        softcap=softcap, attention_chunk=chunk)
        assert out.shape == (*q.shape[:3], v.shape[-1])
    except NAMED_ERRORS:
        pass
    try:  # flash-attn 3's order over the same inputs
        out = flashtile.fa3.flash_attn_func(q, k, v, scale, causal, None, None, None, None, window, chunk, softcap)
        assert out.shape == (*q.shape[:3], v.shape[-1])
    except NAMED_ERRORS:
        pass
    if q.dim() == 4 and k.dim() == 4 and v.dim() == 4:
        try:
            out = flashtile.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale,
                enable_gqa=True, window_size=window, sinks=sinks, softcap=softcap,
            )
            assert out.shape == (q.shape[0], q.shape[2], q.shape[1], v.shape[-1])
        except (*NAMED_ERRORS, RuntimeError) as e:  # RuntimeError: PyTorch's own for unequal heads
            if isinstance(e, RuntimeError) and "same number of heads" not in str(e):
                raise


@needs_varlen
@given(st.data())
def test_varlen_any_offsets_give_an_answer_or_a_named_error(data):
    """flash_attn_varlen_func with arbitrary cu_seqlens / seqused / max_seqlen (unsorted, past
    the end, negative, wrong dtype or length) answers or raises a named error."""
    draw = data.draw
    tq, tk, h, hkv, d = (draw(st.integers(0, 6)) for _ in range(5))
    hkv = max(hkv, 1)
    q, k, v = torch.randn(tq, hkv * max(h, 0), d or 1), torch.randn(tk, hkv, d or 1), torch.randn(tk, hkv, 2)
    n = draw(st.integers(0, 4))
    ints = st.integers(-2, 8)
    offsets = lambda: torch.tensor(draw(st.lists(ints, min_size=n, max_size=n)), dtype=draw(st.sampled_from([torch.int32] * 4 + [torch.int64])))
    cu_q, cu_k = offsets(), offsets()
    used = lambda: draw(st.one_of(st.none(), st.builds(lambda xs: torch.tensor(xs, dtype=torch.int32), st.lists(ints, min_size=max(n - 1, 0), max_size=max(n - 1, 0)))))
    kw = dict(seqused_q=used(), seqused_k=used(), causal=draw(st.booleans()), return_lse=True,
              attention_chunk=draw(st.sampled_from([0, 0, 1, 3])))
    note((tq, tk, cu_q, cu_k, kw))
    try:
        out, lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, draw(ints), draw(ints), **kw)
        assert out.shape == (tq, q.shape[1], 2) and lse.shape == (q.shape[1], tq)
    except NAMED_ERRORS:
        pass


@needs_kvcache
@given(st.data())
def test_kvcache_any_lengths_give_an_answer_or_a_named_error(data):
    """flash_attn_with_kvcache with arbitrary cache_seqlens / leftpad / block tables / new-token
    counts (overflowing the cache, negative, out-of-range pages) answers or raises a named error."""
    draw = data.draw
    b, sq, snew, cap = draw(st.integers(0, 3)), draw(st.integers(0, 3)), draw(st.integers(0, 3)), draw(st.integers(0, 5))
    paged = draw(st.booleans())
    ints = st.integers(-2, 7)
    vec = lambda n: torch.tensor(draw(st.lists(ints, min_size=n, max_size=n)), dtype=torch.int32)
    rows = draw(st.integers(0, 4))
    k_cache, v_cache = torch.randn(rows, cap, 2, 8), torch.randn(rows, cap, 2, 8)
    kw = dict(cache_seqlens=draw(st.one_of(ints, st.just(None), st.builds(lambda: vec(b)))), causal=draw(st.booleans()),
              cache_leftpad=draw(st.one_of(st.none(), st.builds(lambda: vec(b)))), return_lse=True)
    # Page and row indices out of range too (-2 .. rows + 1): kvcache.py range-checks the
    # entries it uses (tests/test_degenerate.py::test_kvcache_out_of_range_indices_are_named_errors).
    if paged and rows:
        pages = st.lists(st.lists(st.integers(-2, rows + 1), min_size=2, max_size=2), min_size=b, max_size=b)
        kw["block_table"] = torch.tensor(draw(pages), dtype=torch.int32).reshape(b, 2)
    elif not paged and rows and draw(st.booleans()):
        kw["cache_batch_idx"] = torch.tensor(draw(st.lists(st.integers(-2, rows + 1), min_size=b, max_size=b)), dtype=torch.int32)
    if snew:
        kw.update(k=torch.randn(b, snew, 2, 8), v=torch.randn(b, snew, 2, 8))
    note((b, sq, snew, cap, rows, kw))
    try:
        out, lse = flashtile.flash_attn_with_kvcache(torch.randn(b, sq, 4, 8), k_cache, v_cache, **kw)
        assert out.shape == (b, sq, 4, 8) and lse.shape == (b, 4, sq)
    except NAMED_ERRORS:
        pass
