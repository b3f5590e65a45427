"""FP8 (float8_e4m3fn) attention on the host side: the CPU path (dequantize, then exact attention)
for every mask feature, dense and packed; the quantization helpers (round-trip bound, rotation);
named errors; the CUDA path's host side (V^T with its key permutation, dispatch); torch.compile and
opcheck.  The CUDA kernels themselves: ``tests/test_gpu_fp8.py``.  The error a rotation saves on
outlier inputs is measured at full size by ``benchmarks/fp8_accuracy.py``."""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from flashtile import fp8, ops, varlen
from flashtile.check import naive_attention

E4M3 = torch.float8_e4m3fn


def _real(x8, descale, cu=None):
    """Independent dequantization in float64: stored value x descale of its (batch, kv group)."""
    hs = descale.shape[1]
    g = x8.shape[-2] // hs
    per_head = descale.double().repeat_interleave(g, dim=1)  # (batch, nheads)
    if x8.dim() == 4:
        return x8.double() * per_head[:, None, :, None]
    lens = (cu[1:] - cu[:-1]).long()
    return x8.double() * per_head.repeat_interleave(lens, dim=0)[:, :, None]


def _rand(*shape, gen, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


CASES = {
    # name: (b, sq, sk, h, hkv, d, dv, causal, window, sinks, softcap)
    "full": (2, 17, 23, 4, 4, 32, 32, False, (-1, -1), False, 0.0),
    "causal_sq_lt_sk": (2, 7, 29, 4, 2, 32, 32, True, (-1, -1), False, 0.0),
    "causal_sq_gt_sk": (1, 31, 13, 4, 1, 64, 32, True, (-1, -1), False, 0.0),
    "window": (2, 33, 33, 6, 2, 16, 16, False, (5, 3), False, 0.0),
    "causal_window": (1, 40, 40, 4, 2, 32, 48, True, (7, -1), False, 0.0),
    "sinks": (2, 19, 19, 4, 2, 32, 32, True, (-1, -1), True, 0.0),
    "softcap": (2, 21, 27, 4, 4, 40, 40, False, (-1, -1), False, 5.0),
    "all": (2, 1, 37, 8, 2, 32, 32, True, (6, -1), True, 3.0),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("out_dtype", [None, torch.float16])
def test_fp8_equals_dequantize_then_exact(name, out_dtype):
    b, sq, sk, h, hkv, d, dv, causal, window, with_sinks, softcap = CASES[name]
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    q, k, v = _rand(b, sq, h, d, gen=gen), _rand(b, sk, hkv, d, gen=gen, scale=3), _rand(b, sk, hkv, dv, gen=gen)
    sinks = _rand(h, gen=gen) if with_sinks else None
    q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q, k, v)
    assert q8.dtype == k8.dtype == v8.dtype == E4M3 and qd.shape == kd.shape == vd.shape == (b, hkv)
    kw = dict(causal=causal, window_size=window, sinks=sinks, softcap=softcap, return_lse=True)
    out, lse = flashtile.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=out_dtype, **kw)
    want_dtype = out_dtype or torch.bfloat16
    assert out.dtype == want_dtype and lse.dtype == torch.float32 and out.shape == (b, sq, h, dv)
    # Same computation as the float32 path on the dequantized tensors: bitwise.
    qf, kf, vf = (_real(x, s).float() for x, s in ((q8, qd), (k8, kd), (v8, vd)))
    out32, lse32 = flashtile.flash_attn_func(qf, kf, vf, **kw)
    assert torch.equal(out, out32.to(want_dtype)) and torch.equal(lse, lse32)
    # And an independent float64 full-matrix attention on the real values.
    o64, l64 = naive_attention(_real(q8, qd), _real(k8, kd), _real(v8, vd), None, causal, window,
                               None if sinks is None else sinks.double(), softcap)
    tol = 2 ** -7 if want_dtype == torch.bfloat16 else 2 ** -10
    torch.testing.assert_close(out.double(), o64, atol=tol * o64.abs().max().item() + 1e-6, rtol=0)
    torch.testing.assert_close(lse.double(), l64, atol=1e-4, rtol=1e-5)


def test_fp8_descale_is_per_batch_and_kv_group():
    """A descale entry scales exactly its batch entry and its kv head's query-head group."""
    gen = torch.Generator().manual_seed(1)
    b, s, h, hkv, d = 2, 9, 4, 2, 16
    q8, k8, v8 = (_rand(b, s, n, d, gen=gen).to(E4M3) for n in (h, hkv, hkv))
    ones = torch.ones(b, hkv)
    base = flashtile.flash_attn_func(q8, k8, v8, q_descale=ones, k_descale=ones, v_descale=ones)
    vd = ones.clone()
    vd[1, 0] = 2.0  # batch 1, kv head 0: query heads 0, 1 (group of 2) see v doubled
    out = flashtile.flash_attn_func(q8, k8, v8, q_descale=ones, k_descale=ones, v_descale=vd)
    torch.testing.assert_close(out[1, :, :2].float(), 2 * base[1, :, :2].float(), rtol=2 ** -7, atol=0)
    assert torch.equal(out[0], base[0]) and torch.equal(out[1, :, 2:], base[1, :, 2:])
    qd = ones.clone()
    qd[0, 1] = 0.0  # batch 0, query heads 2, 3: all scores 0 -> uniform average of v
    out = flashtile.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=ones, v_descale=ones)
    mean_v = v8[0, :, 1].float().mean(0)
    torch.testing.assert_close(out[0, :, 2:].float(), mean_v.expand(s, 2, d).to(torch.bfloat16).float(), rtol=0, atol=1e-2)
    assert torch.equal(out[0, :, :2], base[0, :, :2])


@pytest.mark.parametrize("causal,window,with_sinks,softcap", [(False, (-1, -1), False, 0.0), (True, (-1, -1), True, 0.0),
                                                              (True, (4, -1), False, 2.0), (False, (3, 2), True, 0.0)])
def test_fp8_varlen_equals_dequantize_then_exact(causal, window, with_sinks, softcap):
    gen = torch.Generator().manual_seed(7)
    lens_q, lens_k = [3, 0, 11, 1], [5, 2, 9, 13]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    h, hkv, d = 6, 2, 32
    q, k, v = _rand(int(cu_q[-1]), h, d, gen=gen), _rand(int(cu_k[-1]), hkv, d, gen=gen), _rand(int(cu_k[-1]), hkv, d, gen=gen)
    sinks = _rand(h, gen=gen) if with_sinks else None
    q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert qd.shape == (4, hkv)
    kw = dict(causal=causal, window_size=window, sinks=sinks, softcap=softcap, return_lse=True,
              seqused_k=torch.tensor([5, 1, 9, 12], dtype=torch.int32))
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    out, lse = flashtile.flash_attn_varlen_func(q8, k8, v8, *args, q_descale=qd, k_descale=kd, v_descale=vd, **kw)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    qf, kf, vf = (_real(x, s, cu).float() for x, s, cu in ((q8, qd, cu_q), (k8, kd, cu_k), (v8, vd, cu_k)))
    out32, lse32 = flashtile.flash_attn_varlen_func(qf, kf, vf, *args, **kw)
    assert torch.equal(out, out32.to(torch.bfloat16)) and torch.equal(lse, lse32)
    # The descales really are per sequence: rescaling sequence 2's v scales only its rows.
    vd2 = vd.clone()
    vd2[2] *= 4
    out2 = flashtile.flash_attn_varlen_func(q8, k8, v8, *args, q_descale=qd, k_descale=kd, v_descale=vd2, **kw)[0]
    rows = slice(int(cu_q[2]), int(cu_q[3]))
    torch.testing.assert_close(out2[rows].float(), 4 * out[rows].float(), rtol=2 ** -7, atol=1e-6)
    out2[rows] = out[rows]
    assert torch.equal(out2, out)


# --- quantization helpers -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("heads_per_scale", [1, 2])
def test_quantize_round_trip_bound(layout, heads_per_scale):
    gen = torch.Generator().manual_seed(3)
    if layout == "bshd":
        x, cu = _rand(3, 50, 4, 64, gen=gen) * torch.logspace(-4, 2, 64), None
        x[1] *= 1e-3  # batch entries get their own scale
        batch = 3
    else:
        cu = torch.tensor([0, 10, 10, 47], dtype=torch.int32)
        x = _rand(47, 4, 64, gen=gen) * torch.logspace(-4, 2, 64)
        batch = 3
    x8, descale = fp8.quantize_fp8(x, layout, cu, heads_per_scale=heads_per_scale)
    assert x8.dtype == E4M3 and descale.dtype == torch.float32 and descale.shape == (batch, 4 // heads_per_scale)
    assert x8.float().abs().max() <= 448
    back = fp8.dequantize(x8, descale, cu)
    per_elem_descale = _real(torch.ones_like(x).to(E4M3), descale, cu)
    bound = torch.maximum(x.double().abs() * 2 ** -4, per_elem_descale * 2 ** -10) * (1 + 1e-5) + 1e-30
    assert ((back.double() - x.double()).abs() <= bound).all()
    # amax lands on 448 exactly (per scale group with any nonzero entry); empty groups get descale 1.
    if layout == "thd":
        assert descale[1].eq(1).all()


def test_quantize_zero_and_nonfinite():
    x8, d = fp8.quantize_fp8(torch.zeros(2, 3, 2, 8))
    assert torch.equal(d, torch.ones(2, 2)) and x8.float().eq(0).all()
    with pytest.raises(ValueError, match="quantize_fp8: x must be finite"):
        fp8.quantize_fp8(torch.full((1, 2, 1, 4), float("inf")))
    with pytest.raises(ValueError, match="heads_per_scale must be a divisor of nheads=3"):
        fp8.quantize_fp8(torch.ones(1, 2, 3, 4), heads_per_scale=2)
    with pytest.raises(ValueError, match="cu_seqlens must be nondecreasing from 0 to the number of tokens 5"):
        fp8.quantize_fp8(torch.ones(5, 1, 4), "thd", torch.tensor([0, 3, 4]))


@pytest.mark.parametrize("d", [64, 128, 48, 40])
def test_rotation_is_orthogonal_and_preserves_scores(d):
    r = fp8.random_rotation(d, seed=5, dtype=torch.float64)
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(r, fp8.random_rotation(d, seed=5, dtype=torch.float64))
    assert not torch.equal(r, fp8.random_rotation(d, seed=6, dtype=torch.float64))
    if d & (d - 1) == 0:  # randomized Hadamard: every entry is +-1/sqrt(d)
        torch.testing.assert_close(r.abs(), torch.full_like(r, d ** -0.5), atol=1e-15, rtol=0)
    gen = torch.Generator().manual_seed(d)
    q, k = _rand(2, 16, 4, d, gen=gen), _rand(2, 16, 4, d, gen=gen)
    r32 = fp8.random_rotation(d, seed=5)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    s_rot = torch.einsum("bqhd,bkhd->bhqk", q @ r32, k @ r32)
    torch.testing.assert_close(s_rot, s, atol=2e-5 * math.sqrt(d), rtol=1e-5)


def _outlier_channels(gen, b=2, s=128, h=2, d=64, nch=2, mult=30.0):
    q, k, v = (_rand(b, s, h, d, gen=gen) for _ in range(3))
    ch = torch.randperm(d, generator=gen)[:nch]
    q[..., ch] *= mult
    k[..., ch] *= mult
    return q, k, v


def test_rotation_reduces_error_on_outlier_channels():
    """FlashAttention-3's incoherent processing: with outlier channels shared by q and k, the
    rotated FP8 output is much closer to exact attention than plain FP8 (about 4x in
    ``benchmarks/fp8_accuracy.py``; here at least 2x on every seed).  Without outliers it costs
    nothing."""
    def rmse(q, k, v, rotate, seed):
        q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q, k, v, rotate=rotate, seed=seed)
        out = flashtile.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float16)
        want = naive_attention(q.double(), k.double(), v.double())[0]
        return (out.double() - want).pow(2).mean().sqrt().item()

    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = _outlier_channels(gen)
        plain, rotated = rmse(q, k, v, False, seed), rmse(q, k, v, True, seed)
        assert rotated * 2 < plain, (seed, plain, rotated)
        g = (_rand(2, 128, 2, 64, gen=gen) for _ in range(3))
        q, k, v = g
        plain, rotated = rmse(q, k, v, False, seed), rmse(q, k, v, True, seed)
        assert rotated < 1.25 * plain, (seed, plain, rotated)


# --- named errors -------------------------------------------------------------------------------


def _fp8_inputs(b=2, s=5, h=4, hkv=2, d=16):
    gen = torch.Generator().manual_seed(0)
    return fp8.quantize_qkv(_rand(b, s, h, d, gen=gen), _rand(b, s, hkv, d, gen=gen), _rand(b, s, hkv, d, gen=gen))


def _bad_calls():
    q8, k8, v8, qd, kd, vd = _fp8_inputs()
    d3 = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    qb = q8.float().bfloat16()
    e5 = q8.float().to(torch.float8_e5m2)
    return [
        ("mixed", (qb, k8, v8), d3, TypeError, r"q, k, v dtypes must be all float8_e4m3fn \(FP8 attention\) or none"),
        ("e5m2", (e5, k8, v8), d3, TypeError, r"q.dtype must be float8_e4m3fn for FP8 attention.*e5m2 has 2"),
        ("missing", (q8, k8, v8), dict(q_descale=qd, k_descale=kd), ValueError,
         r"v_descale must be a float32 tensor of shape \(batch, nheads_kv\) = \(2, 2\).*got None"),
        ("non_fp8", (qb, qb, qb), dict(k_descale=kd), ValueError, r"k_descale must be None for non-FP8 inputs"),
        ("out_dtype_non_fp8", (qb, qb, qb), dict(out_dtype=torch.float16), ValueError, r"out_dtype must be None or q's dtype"),
        ("shape", (q8, k8, v8), dict(d3, q_descale=qd[:1]), ValueError, r"q_descale must be shape \(batch, nheads_kv\) = \(2, 2\), got shape \(1, 2\)"),
        ("shape_per_qhead", (q8, k8, v8), dict(d3, q_descale=torch.ones(2, 4)), ValueError, r"q_descale must be shape"),
        ("dtype", (q8, k8, v8), dict(d3, k_descale=kd.double()), TypeError, r"k_descale.dtype must be torch.float32, got torch.float64"),
        ("not_tensor", (q8, k8, v8), dict(d3, v_descale=1.0), TypeError, r"v_descale must be a float32 tensor"),
        ("device", (q8, k8, v8), dict(d3, v_descale=vd.to("meta")), ValueError, r"v_descale.device must be q's device cpu, got meta"),
        ("out_dtype", (q8, k8, v8), dict(d3, out_dtype=torch.float32), TypeError, r"out_dtype must be None \(bfloat16\), torch.bfloat16 or torch.float16"),
        ("out_dtype_str", (q8, k8, v8), dict(d3, out_dtype="bf16"), TypeError, r"out_dtype must be None \(bfloat16\)"),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_named_errors(case, monkeypatch):
    _, qkv, kw, kind, msg = case

    def boom(*a, **k):
        raise AssertionError("attention ran for invalid input")

    monkeypatch.setattr(ops, "attention", boom)
    with pytest.raises(kind, match="flash_attn_func: " + msg):
        flashtile.flash_attn_func(*qkv, **kw)


def test_named_errors_varlen():
    q8, k8, v8, qd, kd, vd = _fp8_inputs()
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    flat = [x.reshape(-1, *x.shape[2:]) for x in (q8, k8, v8)]
    out = flashtile.flash_attn_varlen_func(*flat, cu, cu, 5, 5, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"flash_attn_varlen_func: q_descale must be shape \(batch, nheads_kv\) = \(2, 2\)"):
        flashtile.flash_attn_varlen_func(*flat, cu, cu, 5, 5, q_descale=qd[:1], k_descale=kd, v_descale=vd)
    with pytest.raises(TypeError, match=r"flash_attn_varlen_func: q, k, v dtypes must be all float8_e4m3fn"):
        flashtile.flash_attn_varlen_func(flat[0], flat[1].float(), flat[2], cu, cu, 5, 5, q_descale=qd, k_descale=kd, v_descale=vd)
    with pytest.raises(NotImplementedError, match="forward-only"):
        flashtile.flash_attn_varlen_func(*flat, cu, cu, 5, 5, q_descale=qd, k_descale=kd, v_descale=vd.requires_grad_())


def test_other_entry_points_still_refuse_fp8():
    """FP8 is flash_attn_func / flash_attn_varlen_func's; the ring's validation refuses it."""
    from flashtile.interface import validate
    q8, k8, v8, *_ = _fp8_inputs()
    with pytest.raises(TypeError, match=r"ring_flash_attn_func: q.dtype must be one of"):
        validate(q8, k8, v8, None, (-1, -1), None, 0.0, fn="ring_flash_attn_func")


@pytest.mark.parametrize("which", ["q", "sinks", "k_descale"])
def test_fp8_is_forward_only(which):
    q8, k8, v8, qd, kd, vd = _fp8_inputs()
    args = dict(q=q8, k=k8, v=v8, q_descale=qd, k_descale=kd, v_descale=vd, sinks=torch.zeros(4))
    args[which] = args[which].clone().requires_grad_()
    with pytest.raises(NotImplementedError, match=f"flash_attn_func: {which} requires grad, but FP8 .* forward-only, as in flash-attn 3"):
        flashtile.flash_attn_func(**args)
    with torch.no_grad():  # no graph recorded: allowed
        out = flashtile.flash_attn_func(**args)
    assert not out.requires_grad
    # Reached directly (bypassing validation), the op's backward refuses too.
    q = q8.clone().requires_grad_()
    out, lse = ops.attention_fwd(q, k8, v8, None, 0.25, -1, -1, 0.0, False, qd, kd, vd, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="FP8 .* forward-only"):
        out.float().sum().backward()


# --- the CUDA path's host side: V^T and its key permutation, dispatch ------------------------------


def _key_perm_reference(n):
    """Column j of a 16-key group holds key 8a + 2q + c where j = 4q + 2a + c (written out)."""
    out = []
    for j in range(n):
        g, r = divmod(j, 16)
        q, rest = divmod(r, 4)
        a, c = divmod(rest, 2)
        out.append(16 * g + 8 * a + 2 * q + c)
    return out


def test_key_of_column_is_a_permutation_of_each_group():
    from flashtile.kernels.operands import key_of_column

    cols = torch.arange(64)
    assert key_of_column(cols).tolist() == _key_perm_reference(64)
    assert [key_of_column(j) for j in range(64)] == _key_perm_reference(64)
    assert sorted(_key_perm_reference(16)) == list(range(16))


def _e4m3(*shape, gen):
    return (torch.randn(*shape, generator=gen) * 3).to(E4M3)


@pytest.mark.parametrize("sk", [1, 15, 16, 17, 40, 64])
def test_transpose_v_dense(sk):
    """V^T column n of (b, kv head, channel) is key perm(n) of that row; zero past Sk."""
    from flashtile.kernels.operands import padded_keys, transpose_v

    gen = torch.Generator().manual_seed(sk)
    v = _e4m3(2, sk, 3, 24, gen=gen)
    vt = transpose_v(v)
    skp = padded_keys(sk)
    assert vt.shape == (2, 3, 24, skp) and vt.dtype == E4M3 and skp % 16 == 0 and skp >= sk
    keys = torch.tensor(_key_perm_reference(skp))
    want = torch.zeros(2, 3, 24, skp)
    valid = keys < sk
    want[..., valid] = v.float()[:, keys[valid]].permute(0, 2, 3, 1)
    assert torch.equal(vt.float(), want), f"transpose_v wrong for Sk={sk}"


def test_transpose_v_packed():
    """Sequence b's keys start at the 16-aligned column v_offsets[b], permuted per group; keys past
    seqused and every gap are zero; a length-0 sequence takes no key."""
    from flashtile.kernels.operands import packed_v_columns, transpose_v_packed, v_offsets

    gen = torch.Generator().manual_seed(7)
    cu = torch.tensor([0, 5, 5, 22, 39], dtype=torch.int32)
    lens = torch.tensor([5, 0, 17, 12], dtype=torch.int32)  # the last sequence uses 12 of 17 keys
    v = _e4m3(39, 2, 8, gen=gen)
    vt = transpose_v_packed(v, cu, lens)
    cols = packed_v_columns(39, 4)
    assert vt.shape == (1, 2, 8, cols)
    starts = v_offsets(cu).tolist()
    want = torch.zeros(2, 8, cols)
    for b in range(4):
        assert starts[b] % 16 == 0 and (b == 0 or starts[b] >= starts[b - 1] + int(lens[b - 1]))
        n = int(lens[b])
        span = (n + 15) // 16 * 16
        keys = _key_perm_reference(span)
        for j, key in enumerate(keys):
            if key < n:
                want[:, :, starts[b] + j] = v[int(cu[b]) + key].float()
    assert starts[-1] + 16 <= cols
    assert torch.equal(vt[0].float(), want)


def test_permuted_p_times_permuted_vt_is_p_times_v():
    """What the kernel computes per key block: P's column j is S's column key_of_column(j) (the
    register renaming) and V^T's column j is key key_of_column(j) (the pre-pass), so their product
    is P V for every 16-aligned block start."""
    from flashtile.kernels.operands import key_of_column, transpose_v

    gen = torch.Generator().manual_seed(3)
    s = torch.rand(5, 48, generator=gen)
    v = _e4m3(1, 48, 1, 8, gen=gen)
    vt = transpose_v(v)[0, 0].float()  # (8, 48)
    want = s @ v[0, :, 0].float()
    for n0 in (0, 16, 32):
        cols = torch.arange(16)
        p = s[:, n0 + key_of_column(cols)]
        got = p @ vt[:, n0 : n0 + 16].T
        torch.testing.assert_close(got, s[:, n0 : n0 + 16] @ v[0, n0 : n0 + 16, 0].float(), msg=f"block {n0}")
    assert torch.allclose(sum(s[:, n0 + key_of_column(torch.arange(16))] @ vt[:, n0 : n0 + 16].T for n0 in (0, 16, 32)), want)


def test_cuda_fp8_dispatches_to_the_fp8_kernel(monkeypatch):
    """Fake CUDA tensors (no GPU needed): the ops' CUDA branch hands FP8 calls to the kernels with the
    descales and the output dtype, dense and packed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = []

    class Kernels:
        @staticmethod
        def forward(q, k, v, sinks, scale, window, softcap, packed=None, fp8=None):
            calls.append(("dense", fp8))
            return q.new_empty(*q.shape[:-1], v.shape[-1], dtype=fp8[3]), q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)

        @staticmethod
        def varlen_forward(q, k, v, *args, fp8=None):
            calls.append(("varlen", fp8))
            return q.new_empty(*q.shape[:-1], v.shape[-1], dtype=fp8[3]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)

    monkeypatch.setattr(ops, "_kernels", lambda: Kernels)
    with FakeTensorMode():
        q8, k8, v8 = (torch.empty(2, 5, n, 16, device="cuda", dtype=E4M3) for n in (4, 2, 2))
        qd = kd = vd = torch.empty(2, 2, device="cuda")
        out, _ = ops._fwd_impl(q8, k8, v8, None, 0.25, -1, -1, 0.0, qd, kd, vd, torch.float16)
        assert out.dtype == torch.float16
        cu = torch.empty(3, device="cuda", dtype=torch.int32)
        flat = [x.reshape(10, x.shape[2], 16) for x in (q8, k8, v8)]
        o = varlen.Options(cu, cu, None, None, 5, 5, None, 0.25, -1, -1, 0.0, False, qd, kd, vd, None)
        varlen._fwd_impl(*flat, o)
    assert [c[0] for c in calls] == ["dense", "varlen"]
    assert calls[0][1][3] == torch.float16 and calls[1][1][3] is None and all(c[1][0] is qd for c in calls)


def test_compile_fullgraph_fp8():
    q8, k8, v8, qd, kd, vd = _fp8_inputs(s=9)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)

    def f(q8, k8, v8, qd, kd, vd):
        a = flashtile.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float16)
        flat = [x.reshape(-1, *x.shape[2:]) for x in (q8, k8, v8)]
        b = flashtile.flash_attn_varlen_func(*flat, cu, cu, 9, 9, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
        return a, b

    torch._dynamo.reset()
    a, b = torch.compile(f, fullgraph=True, backend="aot_eager")(q8, k8, v8, qd, kd, vd)
    ea, eb = f(q8, k8, v8, qd, kd, vd)
    assert a.dtype == torch.float16 and b.dtype == torch.bfloat16
    assert torch.equal(a, ea) and torch.equal(b, eb)


_OPCHECK_UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")  # test_schema: allclose has no FP8 kernel


def test_opcheck_fp8():
    q8, k8, v8, qd, kd, vd = _fp8_inputs(s=7)
    torch.library.opcheck(ops.attention_fwd, (q8, k8, v8, torch.randn(4), 0.3, 3, 0, 2.0, False, qd, kd, vd, torch.float16),
                          test_utils=_OPCHECK_UTILS)
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    flat = [x.reshape(-1, *x.shape[2:]) for x in (q8, k8, v8)]
    o = varlen.Options(cu, cu, None, None, 7, 7, None, 0.3, -1, 0, 0.0, False, qd, kd, vd, torch.bfloat16)
    torch.library.opcheck(varlen.varlen_fwd, (*flat, *o), test_utils=_OPCHECK_UTILS)
    # The options default to None: calls written before them still match the schema.
    q = torch.randn(2, 7, 4, 16)
    torch.library.opcheck(ops.attention_fwd, (q, q[:, :, :2], q[:, :, :2], None, 0.3, -1, 0, 0.0, False))


def test_descale_vector_layout_is_what_the_kernel_reads():
    """The host's parameter vector (operands.params) and the kernel's reads (operands.tile_scales)
    agree: sinks first, then q_descale * k_descale and v_descale, each (batch, Hkv) row-major;
    softcap folds the q/k product into the tanh's input scale instead of the score scale."""
    from flashtile.kernels.operands import FP8, Operands, params, tile_scales

    gen = torch.Generator().manual_seed(5)
    B, H, HKV = 3, 8, 2
    sinks = torch.randn(H, generator=gen)
    qd, kd, vd = (torch.rand(B, HKV, generator=gen) + 0.5 for _ in range(3))
    vec = params(sinks, qd, kd, vd)
    assert vec.shape == (H + 2 * B * HKV,) and torch.equal(vec[:H], sinks)
    ops = Operands(FP8)
    for b in range(B):
        for hk in range(HKV):
            sc, cap, out = tile_scales(ops, vec, H, HKV, B, b, hk, 2.0, 0.5, has_softcap=False)
            assert math.isclose(float(sc), 2.0 * float(qd[b, hk] * kd[b, hk]), rel_tol=1e-6) and cap == 0.5
            assert math.isclose(float(out), float(vd[b, hk]), rel_tol=1e-6)
            sc, cap, _ = tile_scales(ops, vec, H, HKV, B, b, hk, 2.0, 0.5, has_softcap=True)
            assert sc == 2.0 and math.isclose(float(cap), 0.5 * float(qd[b, hk] * kd[b, hk]), rel_tol=1e-6)
    assert tile_scales(Operands("bfloat16"), vec, H, HKV, B, 0, 0, 2.0, 0.5, False) == (2.0, 0.5, None)


def test_v_column_starts_match_the_kernel_formula():
    from flashtile.kernels.operands import v_offsets
    from flashtile.kernels.seqinfo import v_column_start

    cu = torch.tensor([0, 5, 5, 22, 39, 40], dtype=torch.int32)
    starts = v_offsets(cu).tolist()
    assert starts == [v_column_start(int(k0), b, 16) for b, k0 in enumerate(cu.tolist())]
    lens = (cu[1:] - cu[:-1]).tolist()
    for b in range(len(lens)):  # whole groups of one sequence end before the next one starts
        assert starts[b] % 16 == 0 and starts[b] + -(-lens[b] // 16) * 16 <= starts[b + 1]
