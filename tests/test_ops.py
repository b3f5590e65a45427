"""Custom-op plumbing on CPU: opcheck, autograd (incl. double backward), torch.compile,
dynamic shapes, torch.export, the eager fast path, and ``flashtile.scaled_dot_product_attention``.

The reference path (CPU) runs behind the same ops as the kernels, so these tests cover the
PyTorch integration without a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import flashtile
from flashtile import ops

FWD = torch.ops.flashtile.fwd.default
BWD = torch.ops.flashtile.bwd.default
BWD_BWD = torch.ops.flashtile.bwd_bwd.default


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Compiled code is cached per code object; start every test from a clean cache."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(b=2, sq=5, sk=7, h=4, hkv=2, d=8, dv=6, dtype=torch.float32, sinks=False, grad=True):
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, dtype=dtype)
    v = torch.randn(b, sk, hkv, dv, dtype=dtype)
    s = torch.randn(h, dtype=dtype) if sinks else None
    out = [q, k, v, s]
    if grad:
        out = [t.requires_grad_() if t is not None else None for t in out]
    return out


# --- opcheck ----------------------------------------------------------------------------------

OPCHECK_GRID = [
    # (dtype, sinks, window, softcap)
    (torch.float32, False, (-1, -1), 0.0),
    (torch.float32, True, (2, 0), 1.5),
    (torch.float64, False, (-1, 0), 0.0),
    (torch.float64, True, (3, 1), 2.0),
]


@pytest.mark.parametrize("dtype,sinks,window,softcap", OPCHECK_GRID)
def test_opcheck_fwd(dtype, sinks, window, softcap):
    q, k, v, s = _inputs(dtype=dtype, sinks=sinks)
    torch.library.opcheck(FWD, (q, k, v, s, 0.3, *window, softcap, False))


@pytest.mark.parametrize("with_dlse", [False, True], ids=["dlse_none", "dlse"])
@pytest.mark.parametrize("dtype,sinks,window,softcap", OPCHECK_GRID)
def test_opcheck_bwd(dtype, sinks, window, softcap, with_dlse):
    q, k, v, s = _inputs(dtype=dtype, sinks=sinks)
    out, lse = ops.attention(q, k, v, s, 0.3, *window, softcap, False)
    dout = torch.randn_like(out).requires_grad_()
    dlse = torch.randn_like(lse).requires_grad_() if with_dlse else None
    args = (dout, dlse, q, k, v, out.detach().requires_grad_(), lse.detach().requires_grad_(), s, 0.3, *window, softcap, False)
    torch.library.opcheck(BWD, args)


def test_opcheck_bwd_bwd():
    q, k, v, s = _inputs(dtype=torch.float64, sinks=True, grad=False)
    out, lse = ops.attention(q, k, v, s, 0.3, 2, 0, 1.5, False)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    cotangents = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v), torch.randn_like(s))
    torch.library.opcheck(BWD_BWD, (*cotangents, dout, dlse, q, k, v, out, lse, s, 0.3, 2, 0, 1.5, False))


def test_opcheck_noncontiguous_inputs():
    """Transposed views, as the transformers integration passes them: outputs stay contiguous."""
    q = torch.randn(2, 4, 5, 8).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 2, 7, 8).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 2, 7, 8).transpose(1, 2).requires_grad_()
    torch.library.opcheck(FWD, (q, k, v, None, 0.3, -1, 0, 0.0, False))
    out, lse = FWD(q, k, v, None, 0.3, -1, 0, 0.0, False)
    assert out.is_contiguous() and lse.is_contiguous()
    grads = BWD(torch.randn_like(out).transpose(0, 1).contiguous().transpose(0, 1), None, q, k, v, out, lse, None, 0.3, -1, 0, 0.0, False)
    assert all(g.is_contiguous() for g in grads)


# --- autograd ---------------------------------------------------------------------------------


def test_gradcheck_and_double_backward_float64():
    q, k, v, s = _inputs(b=1, sq=4, sk=6, h=2, hkv=1, d=4, dv=3, dtype=torch.float64, sinks=True)

    def f(q, k, v, s):
        out, lse = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(3, -1), sinks=s, softcap=2.0, return_lse=True)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v, s))
    assert torch.autograd.gradgradcheck(f, (q, k, v, s))


def test_eager_fast_path_equals_custom_op():
    """flash_attn_func skips the dispatcher in plain eager; results and gradients are identical."""
    q, k, v, s = _inputs(sinks=True)
    args = (0.3, 2, 0, 1.5, False)
    o1, l1 = ops.attention(q, k, v, s, *args)  # fast path
    o2, l2 = FWD(q, k, v, s, *args)  # dispatcher
    assert type(o1.grad_fn).__name__ != type(o2.grad_fn).__name__  # really two paths
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    w1, w2 = torch.randn_like(o1), torch.randn_like(l1)
    g1 = torch.autograd.grad((o1 * w1).sum() + (l1 * w2).sum(), (q, k, v, s))
    g2 = torch.autograd.grad((o2 * w1).sum() + (l2 * w2).sum(), (q, k, v, s))
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_meta_tensors_use_the_fake_impl():
    q, k, v, s = _inputs(sinks=True, grad=False)
    q, k, v, s = (t.to("meta") for t in (q, k, v, s))
    out, lse = flashtile.flash_attn_func(q, k, v, sinks=s, return_lse=True)
    assert out.device.type == "meta" and out.shape == (2, 5, 4, 6) and lse.shape == (2, 4, 5)


def test_lse_only_and_out_only_gradients():
    q, k, v, _ = _inputs()
    out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    (gq_lse,) = torch.autograd.grad(lse.sum(), (q,), retain_graph=True)
    (gq_out,) = torch.autograd.grad(out.sum(), (q,))
    assert torch.isfinite(gq_lse).all() and torch.isfinite(gq_out).all()
    assert not torch.equal(gq_lse, gq_out)


# --- torch.compile ----------------------------------------------------------------------------

# Every option of flash_attn_func, one compiled function each (GQA and d_v != d throughout).
COMPILE_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(2, 1)),
    "causal_window": dict(causal=True, window_size=(3, -1)),
    "sinks": dict(sinks=True),
    "softcap": dict(softcap=2.0),
    "return_lse": dict(return_lse=True, causal=True),
    "scale_deterministic": dict(softmax_scale=0.5, deterministic=True),
    "everything": dict(causal=True, window_size=(3, -1), sinks=True, softcap=2.0, return_lse=True),
}


def _call(q, k, v, s, opts):
    opts = dict(opts)
    if opts.pop("sinks", False):
        opts["sinks"] = s
    res = flashtile.flash_attn_func(q, k, v, **opts)
    return res if isinstance(res, tuple) else (res,)


def _loss(results):
    # Fixed, non-uniform weights so every output element matters to the gradient.
    total = 0.0
    for r in results:
        w = torch.linspace(-1, 1, r.numel(), dtype=r.dtype).reshape(r.shape)
        total = total + (r * w).sum()
    return total


def _check_compiled(opts, backend, dtype=torch.float32, atol=1e-6):
    q, k, v, s = _inputs(dtype=dtype, sinks=True)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs) if backend != "eager" else gm.forward

    fn = lambda q, k, v, s: _call(q, k, v, s, opts)  # noqa: E731
    compiled = torch.compile(fn, backend=recording, fullgraph=True)
    want = fn(q, k, v, s)
    got = compiled(q, k, v, s)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)
    g_want = torch.autograd.grad(_loss(want), (q, k, v, s), allow_unused=True)
    g_got = torch.autograd.grad(_loss(got), (q, k, v, s), allow_unused=True)
    for a, b in zip(g_got, g_want):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, atol=atol, rtol=0)
    # One graph, and the op is a single node in it (not traced into).
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.flashtile.fwd.default in targets or torch.ops.flashtile.fwd in targets


@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_compile_fullgraph_aot_eager(case):
    _check_compiled(COMPILE_CASES[case], "aot_eager")


@pytest.mark.parametrize("case", ["plain", "everything"])
def test_compile_fullgraph_eager_backend(case):
    _check_compiled(COMPILE_CASES[case], "eager")


def test_compile_fullgraph_inductor():
    _check_compiled(COMPILE_CASES["everything"], "inductor", atol=1e-5)


def _assert_no_recompile(compiled, make_args, reference_fn, sizes, backward=False):
    """First size compiles; every later size must reuse that graph (error_on_recompile)."""
    for i, size in enumerate(sizes):
        args = make_args(size)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(*args)
        torch.testing.assert_close(got, reference_fn(*args), atol=1e-5, rtol=0)
        if backward:
            got.sum().backward()


def _seq_inputs(sizes):
    sq, sk = sizes
    return _inputs(sq=sq, sk=sk)[:3]


def test_compile_dynamic_true_no_recompile():
    fn = lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True, window_size=(4, -1), softcap=0.0)  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    _assert_no_recompile(compiled, _seq_inputs, fn, [(5, 9), (11, 13), (17, 17)], backward=True)


def test_compile_dynamic_true_with_defaults():
    fn = lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    _assert_no_recompile(compiled, _seq_inputs, fn, [(5, 9), (11, 13)])


def test_compile_mark_dynamic_no_recompile():
    fn = lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True, sinks=None)  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)

    def make(s):
        q, k, v, _ = _inputs(sq=s, sk=s + 3)
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 1)
        return q, k, v

    _assert_no_recompile(compiled, make, fn, [6, 10, 23], backward=True)


def test_compile_validation_error_names_the_argument():
    q, k, v, _ = _inputs(grad=False)
    compiled = torch.compile(lambda q, k, v: flashtile.flash_attn_func(q, k, v, window_size=(-2, 0)), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="window_size left must be >= -1"):
        compiled(q, k, v)


# --- torch.export -----------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, d=8, h=4, hkv=2):
        super().__init__()
        self.h, self.hkv, self.d = h, hkv, d
        self.q = torch.nn.Linear(h * d, h * d)
        self.kv = torch.nn.Linear(h * d, 2 * hkv * d)
        self.sinks = torch.nn.Parameter(torch.randn(h))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d)
        k, v = self.kv(x).view(b, s, 2, self.hkv, self.d).unbind(2)
        out = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(3, -1), sinks=self.sinks, softcap=5.0)
        return out.reshape(b, s, -1)


def test_export_module():
    model = _Block()
    x = torch.randn(2, 9, 32)
    seq = torch.export.Dim("seq", min=2, max=1024)
    ep = torch.export.export(model, (x,), dynamic_shapes=({1: seq},))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.flashtile.fwd.default in targets
    for s in (9, 20):
        x = torch.randn(2, s, 32)
        torch.testing.assert_close(ep.module()(x), model(x), atol=1e-6, rtol=0)


# --- scaled_dot_product_attention ---------------------------------------------------------------


def _bhsd(b=2, h=4, hkv=4, sq=6, sk=6, d=8, dv=8, dtype=torch.float64):
    q = torch.randn(b, h, sq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, sk, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, sk, dv, dtype=dtype, requires_grad=True)
    return q, k, v


def _assert_same_with_grads(ours, theirs, inputs, rows_valid=None):
    if rows_valid is not None:  # rows that see no key: PyTorch gives NaN, flashtile zeros
        assert torch.all(ours[:, :, ~rows_valid] == 0)
        ours, theirs = ours[:, :, rows_valid], theirs[:, :, rows_valid]
    torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=0)
    w = torch.randn_like(ours)
    g1 = torch.autograd.grad((ours * w).sum(), inputs)
    g2 = torch.autograd.grad((theirs * w).sum(), inputs)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


SDPA_CASES = {
    "full": dict(),
    "causal_square": dict(is_causal=True),
    "causal_sq_lt_sk": dict(is_causal=True, sq=3, sk=8),
    "causal_sq_gt_sk": dict(is_causal=True, sq=9, sk=4),
    "full_sq_ne_sk": dict(sq=3, sk=8),
    "scale_dv": dict(scale=0.7, dv=5),
    "gqa": dict(is_causal=True, hkv=2, enable_gqa=True, sq=5, sk=7),
    "mqa": dict(hkv=1, enable_gqa=True),
}


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_matches_pytorch(case):
    opts = dict(SDPA_CASES[case])
    shape = {key: opts.pop(key) for key in ("sq", "sk", "hkv", "dv") if key in opts}
    q, k, v = _bhsd(**shape)
    ours = flashtile.scaled_dot_product_attention(q, k, v, **opts)
    theirs = F.scaled_dot_product_attention(q, k, v, **opts)
    assert ours.shape == theirs.shape
    _assert_same_with_grads(ours, theirs, (q, k, v))


def _top_left_window_mask(sq, sk, left, right):
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    return vis


@pytest.mark.parametrize(
    "sq,sk,window,causal",
    [
        (6, 6, (2, 1), False),
        (4, 10, (2, 1), False),  # keys beyond the last row's reach are dropped
        (10, 4, (1, 0), False),  # bottom rows see no key: zeros
        (10, 4, (2, -1), True),
        (3, 9, (-1, 2), False),
        (7, 3, (0, 0), False),
    ],
)
def test_sdpa_window_top_left_matches_masked_pytorch(sq, sk, window, causal):
    q, k, v = _bhsd(sq=sq, sk=sk)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    vis = _top_left_window_mask(sq, sk, left, right)
    ours = flashtile.scaled_dot_product_attention(q, k, v, is_causal=causal, window_size=window)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=vis)
    _assert_same_with_grads(ours, theirs, (q, k, v), rows_valid=vis.any(dim=1))


def test_sdpa_sinks_softcap_match_flash_attn_func():
    q, k, v = _bhsd(hkv=2)
    s = torch.randn(4, dtype=q.dtype, requires_grad=True)
    ours = flashtile.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, sinks=s, softcap=3.0)
    ref = flashtile.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, sinks=s, softcap=3.0
    ).transpose(1, 2)
    _assert_same_with_grads(ours, ref, (q, k, v, s))


@pytest.mark.parametrize("form", ["bool-b11k", "float-b11k", "bool-1k"])
def test_sdpa_key_padding_masks_match_torch_with_gradients(form):
    """Key-padding masks (encoders' (batch, 1, 1, seqlen_k)): every query row of an entry over
    its kept keys, as PyTorch's SDPA computes them; gradients too."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(3, 4, 7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 2, 9, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    keep[0, ..., 6:] = False  # right padding
    keep[2, ..., :3] = False  # left padding and a hole
    keep[2, ..., 5] = False
    if form == "bool-1k":  # one row for every entry, query row and head
        keep = keep[0, 0]
    mask = keep if form.startswith("bool") else torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -math.inf)
    ours = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    kx, vx = (x.repeat_interleave(2, dim=1) for x in (k, v))  # PyTorch's math path with an explicit GQA expansion
    theirs = F.scaled_dot_product_attention(q, kx, vx, attn_mask=mask)
    _assert_same_with_grads(ours, theirs, (q, k, v))


def test_sdpa_key_padding_rows_without_keys_are_zero_and_other_masks_are_refused():
    q, k, v = _bhsd()
    keep = torch.ones(q.shape[0], 1, 1, k.shape[2], dtype=torch.bool)
    keep[0] = False  # entry 0 sees no key: zeros here, NaN in PyTorch's math backend
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert (out[0] == 0).all() and torch.isfinite(out).all()
    with pytest.raises(NotImplementedError, match="per head or per query row"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(q.shape[2], k.shape[2], dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="finite biases"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.full(keep.shape, 0.5, dtype=q.dtype))
    with pytest.raises(RuntimeError, match="is_causal"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=True)
    with pytest.raises(NotImplementedError, match="window_size"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=keep, window_size=(2, 2))
    with pytest.raises(RuntimeError, match="broadcast"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 1, 1, 3, dtype=torch.bool))


def test_sdpa_rejects_what_it_does_not_support():
    q, k, v = _bhsd()
    with pytest.raises(NotImplementedError, match="attn_mask"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(6, 6, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flashtile.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    q2, k2, v2 = _bhsd(hkv=2)
    with pytest.raises(RuntimeError):  # PyTorch's own type for this case
        F.scaled_dot_product_attention(q2, k2, v2)
    with pytest.raises(RuntimeError, match="enable_gqa"):
        flashtile.scaled_dot_product_attention(q2, k2, v2)
    with pytest.raises(ValueError, match="4-D"):
        flashtile.scaled_dot_product_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="window_size"):
        flashtile.scaled_dot_product_attention(q, k, v, window_size=(-2, 0))


def test_sdpa_compile_fullgraph_dynamic():
    fn = lambda q, k, v: flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    want = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    _assert_no_recompile(compiled, lambda s: _bhsd(sq=s[0], sk=s[1], dtype=torch.float32), want, [(5, 9), (7, 11)])


def test_sdpa_default_scale_is_pytorchs():
    q, k, v = _bhsd(d=16)
    out = flashtile.scaled_dot_product_attention(q, k, v)
    out2 = flashtile.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(16))
    assert torch.equal(out, out2)
