"""GPU kernels against the reference with flash-attn's rule (marker ``gpu``; skipped without CUDA).

With ``ref32`` the reference in float32 on the low-precision inputs upcast, and ``ref_lp`` the
reference fed the low-precision tensors (out and grads rounded to that precision):

    err(kernel, ref32) <= 2 * err(ref_lp, ref32) + 1e-5     for out and lse
    err(kernel, ref32) <= 3 * err(ref_lp, ref32) + 1e-5     for dq, dk, dv, dsinks

with ``err`` the max abs error.  lse is compared on finite entries only and must be -inf exactly
where ref32's is.  The floor ``1e-5`` is taken relative to the pass's scale: it is
``1e-5 * max(1, S)`` with S the largest |ref32| value of that pass (out for the forward; dq, dk,
dv, dsinks together for the backward; lse on its own).  ref_lp's lse is float32 arithmetic on the
same values as ref32's, so its error is 0 and lse's bound is that floor alone; and a gradient
that is zero by cancellation (seqlen_k 1 without a sink: P = 1, so dS = 0 and dK = 0) is only
float32 noise of the size of the other gradients, which a bare 1e-5 would reject.

dsinks (one scalar per head) is a sum over batch x seqlen_q rows of ``w_i * Delta_i`` with
``w_i = exp(sink - lse_i)``; ref_lp's rounding errors in Delta cancel in that sum by chance, so
its error is a fragile scale.  For dsinks ``err(ref_lp, ref32)`` is replaced by the most those
per-row errors can add up to, ``max_h sum_i w_i |Delta_lp,i - Delta_32,i|``, still orders of
magnitude below the error of a wrong formula (``sum_i w_i |Delta_i|``).

Every kernel call runs inside ``flashtile.kernels.debug.poison()`` (outputs NaN-filled before the
launch) and no output or gradient may hold a NaN.  Inputs are fresh ``torch.randn`` draws.

The grid is a covering design (``test_grid_covers_every_axis`` keeps it honest): every seqlen
pair, head dim (each in fp16 and bf16), head layout and mask kind appears, 4224x4224 runs causal
and windowed, sinks and softcap vary at d=128 bf16 so that few structures are compiled.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
import torch

import flashtile
from flashtile import flash_attn_func, reference
from flashtile.check import naive_attention
from flashtile.kernels import cache, debug

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
MASKS = {
    "none": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "win(127,0)": (False, (127, 0)),
    "win(64,64)": (False, (64, 64)),
    "win(0,0)": (False, (0, 0)),
    "causal+win(256)": (True, (256, -1)),
}
SEQLENS = [(1, 1), (17, 113), (113, 203), (239, 1), (1023, 1024), (1024, 1023), (4224, 4224),
           (513, 700), (1025, 1030), (300, 2100)]  # the last three: d=64 on both sides of configs.SHORT_SEQLEN[64]
HEADDIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
# Head dims no kernel is built for, run on zero-padded copies (d=40 as in Stable Diffusion).
PADDED_HEADDIMS = [(40, 40, FP16), (200, 100, BF16)]
HEADS = [(4, 4), (8, 2), (4, 1)]  # MHA, GQA 4:1, MQA


@dataclass(frozen=True)
class G:
    sq: int
    sk: int
    d: int
    dv: int
    h: int
    hkv: int
    mask: str
    dtype: torch.dtype
    sinks: bool = False
    softcap: float = 0.0
    batch: int = 1
    grad: str = "out"  # which outputs the loss uses: "out", "out+lse" or "lse"

    @property
    def id(self) -> str:
        s = (
            f"{'bf16' if self.dtype == BF16 else 'fp16'}-b{self.batch}-sq{self.sq}-sk{self.sk}-d{self.d}"
            + (f"v{self.dv}" if self.dv != self.d else "")
            + f"-h{self.h}:{self.hkv}-{self.mask}"
        )
        s += "-sinks" if self.sinks else ""
        s += f"-cap{self.softcap:g}" if self.softcap else ""
        s += "" if self.grad == "out" else f"-grad({self.grad})"
        return s


GRID = [
    # d 64
    G(1, 1, 64, 64, 4, 4, "none", FP16, batch=2),
    G(17, 113, 64, 64, 8, 2, "causal", BF16, batch=2),
    G(1023, 1024, 64, 64, 4, 1, "win(64,64)", FP16),
    G(239, 1, 64, 64, 8, 2, "causal", BF16, batch=2),  # 238 fully masked rows
    # up to 1024 keys and queries d=64 takes the persistent 128-row forward (configs.short_forward),
    # past it the one-tile 192-row kernel
    # (sinks and softcap in the short kernel: the d=128 rows, same builder)
    G(513, 700, 64, 64, 8, 2, "causal", BF16, batch=2),
    G(1025, 1030, 64, 64, 8, 2, "causal", BF16, batch=2),
    G(300, 2100, 64, 64, 4, 1, "win(64,64)", FP16),
    # d 96
    G(113, 203, 96, 96, 4, 4, "win(127,0)", FP16, batch=2),
    G(1024, 1023, 96, 96, 4, 1, "causal", BF16),  # row 0 sees nothing
    G(17, 113, 96, 96, 8, 2, "win(0,0)", BF16, batch=2),
    G(239, 1, 96, 96, 4, 4, "none", FP16, batch=2),
    # d 128, plain
    G(4224, 4224, 128, 128, 8, 2, "causal", BF16),
    G(4224, 4224, 128, 128, 4, 1, "causal+win(256)", FP16),
    G(1, 1, 128, 128, 8, 2, "win(0,0)", BF16, batch=2),
    G(113, 203, 128, 128, 4, 1, "none", FP16, batch=2),
    G(1024, 1023, 128, 128, 4, 4, "win(0,0)", BF16),  # row 0 sees nothing
    G(239, 1, 128, 128, 4, 4, "win(127,0)", FP16, batch=2),  # fully masked rows
    # d 128 bf16: sinks, softcap, gradients through lse
    G(113, 203, 128, 128, 8, 2, "causal", BF16, sinks=True, batch=2, grad="out+lse"),
    G(239, 1, 128, 128, 4, 1, "causal", BF16, sinks=True, batch=2),  # masked rows with a sink
    G(1023, 1024, 128, 128, 4, 4, "none", BF16, softcap=30.0),
    G(17, 113, 128, 128, 8, 2, "win(64,64)", BF16, softcap=30.0, batch=2),
    G(4224, 4224, 128, 128, 8, 2, "win(127,0)", BF16, sinks=True, softcap=30.0, grad="out+lse"),
    G(1024, 1023, 128, 128, 4, 1, "causal+win(256)", BF16, sinks=True, softcap=30.0),
    G(1, 1, 128, 128, 4, 4, "none", BF16, sinks=True, batch=2, grad="lse"),
    G(239, 1, 128, 128, 8, 2, "win(0,0)", BF16, grad="out+lse", batch=2),  # -inf lse rows, dlse given
    # d 192 / dv 128
    G(1023, 1024, 192, 128, 8, 2, "causal+win(256)", BF16),
    G(113, 203, 192, 128, 4, 1, "win(64,64)", FP16, batch=2),
    G(239, 1, 192, 128, 8, 2, "win(0,0)", FP16, batch=2),
    G(1, 1, 192, 128, 4, 4, "causal", BF16, batch=2),
    G(17, 113, 192, 128, 4, 4, "none", FP16, batch=2),
    # d 256
    G(1024, 1023, 256, 256, 8, 2, "none", BF16),
    G(17, 113, 256, 256, 4, 1, "causal", FP16, batch=2),
    G(113, 203, 256, 256, 4, 4, "causal+win(256)", BF16, batch=2),
    G(1023, 1024, 256, 256, 4, 4, "win(127,0)", FP16),
    G(239, 1, 256, 256, 4, 1, "win(64,64)", BF16, batch=2),
    # d=256 takes 64-key blocks up to 512 keys and queries (configs.short_forward), 80 past it
    G(1025, 1030, 256, 256, 8, 2, "causal", FP16, batch=2),
    # head dims no kernel is built for: zero-padded (forward 48 and 208/112, backward 64 and 224/128)
    G(113, 203, 40, 40, 8, 2, "causal", FP16, batch=2),
    G(1023, 1024, 200, 100, 4, 1, "win(64,64)", BF16),
]


def test_grid_covers_every_axis():
    assert {(g.sq, g.sk) for g in GRID} == set(SEQLENS)
    assert {(g.d, g.dv, g.dtype) for g in GRID} == {(d, dv, t) for d, dv in HEADDIMS for t in (BF16, FP16)} | set(PADDED_HEADDIMS)
    assert {(g.h, g.hkv) for g in GRID} == set(HEADS)
    assert {g.mask for g in GRID} == set(MASKS)
    for mask in MASKS:  # every mask at several head dims and head layouts
        assert len({g.d for g in GRID if g.mask == mask}) >= 3, mask
    assert {g.mask for g in GRID if g.sq == 4224} >= {"causal", "win(127,0)"}
    assert any(g.sinks and g.softcap for g in GRID) and any(g.sinks and not g.softcap for g in GRID)
    assert {g.grad for g in GRID} == {"out", "out+lse", "lse"}
    # structures compiled for the forward: (d, dv, dtype, sinks, softcap)
    assert len({(g.d, g.dv, g.dtype, g.sinks, bool(g.softcap)) for g in GRID}) <= 16


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _ieee_fp32_reference():
    """ref32 must be real float32: no TF32 in the reference's matmuls."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a.detach().double() - b.detach().double()).abs()
    return float(torch.nan_to_num(d, nan=math.inf).max())


def _inputs(g: G, device="cuda"):
    """Fresh random q, k, v (low precision), sinks (float32) or None, dout (low precision)."""
    q = torch.randn(g.batch, g.sq, g.h, g.d, device=device, dtype=g.dtype)
    k = torch.randn(g.batch, g.sk, g.hkv, g.d, device=device, dtype=g.dtype)
    v = torch.randn(g.batch, g.sk, g.hkv, g.dv, device=device, dtype=g.dtype)
    sinks = torch.randn(g.h, device=device, dtype=torch.float32) if g.sinks else None
    dout = torch.randn(g.batch, g.sq, g.h, g.dv, device=device, dtype=g.dtype)
    return q, k, v, sinks, dout


def _window(causal: bool, window) -> tuple[int, int]:
    return (window[0], 0) if causal else tuple(window)


def run_kernel(q, k, v, sinks, dout, dlse, causal, window, softcap, deterministic=False, backward=True):
    """flash_attn_func fwd (+ bwd) with poisoned outputs.

    Returns (out, lse, dq, dk, dv, dsinks) and the exception the backward raised (or None);
    the gradients are None when the backward raised or was not asked for.
    """
    leaves = [None if x is None else x.detach().clone().requires_grad_(True) for x in (q, k, v, sinks)]
    with debug.poison():
        out, lse = flash_attn_func(
            *leaves[:3], causal=causal, window_size=window, sinks=leaves[3], softcap=softcap,
            deterministic=deterministic, return_lse=True,
        )
        torch.cuda.synchronize()
        error = None
        if backward:
            outputs, grads = [], []
            if dout is not None:
                outputs.append(out), grads.append(dout)
            if dlse is not None:
                outputs.append(lse), grads.append(dlse)
            try:
                torch.autograd.backward(outputs, grads)
                torch.cuda.synchronize()
            except Exception as e:  # reported beside the forward's results
                error = e
    grads = tuple(None if (x is None or error is not None or not backward) else x.grad for x in leaves)
    return (out.detach(), lse.detach()) + grads, error


def run_references(q, k, v, sinks, dout, dlse, causal, window, softcap):
    """(ref_lp, ref32) tuples of out, lse, dq, dk, dv, dsinks from the reference on q's device."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    win = _window(causal, window)
    f32 = [None if x is None else x.float() for x in (q, k, v, sinks)]
    dout32 = torch.zeros_like(f32[0][..., :1]).expand(*q.shape[:3], v.shape[-1]) if dout is None else dout.float()
    doutlp = dout32.to(q.dtype) if dout is None else dout
    o32, l32 = reference.attention_forward(*f32[:3], scale, win, f32[3], softcap, chunk=512)
    g32 = reference.attention_backward(dout32, *f32[:3], o32, l32, scale, win, f32[3], softcap, dlse, chunk=512)
    olp, llp = reference.attention_forward(q, k, v, scale, win, sinks, softcap, chunk=512)
    glp = reference.attention_backward(doutlp, q, k, v, olp, llp, scale, win, sinks, softcap, dlse, chunk=512)
    return (olp, llp) + tuple(glp), (o32, l32) + tuple(g32)


def dsinks_ref_err(q, v, sinks, dout, dlse, lp, r32) -> float | None:
    """max_h sum_{b,i} exp(sink_h - lse_i) |Delta_lp,i - Delta_32,i|: how far ref_lp's per-row
    rounding errors could move dsinks if they did not cancel (None without sinks)."""
    if sinks is None:
        return None
    dout32 = torch.zeros(*q.shape[:3], v.shape[-1], device=q.device) if dout is None else dout.float()

    def delta(out):
        d = (dout32 * out.float()).sum(-1).transpose(1, 2)
        return d if dlse is None else d - dlse

    w = torch.exp(sinks.float()[None, :, None] - r32[1])
    return float((w * (delta(lp[0]) - delta(r32[0])).abs()).sum(dim=(0, 2)).max())


NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def _scale(*tensors) -> float:
    """max(1, largest finite |x| over the tensors)."""
    m = 1.0
    for x in tensors:
        if x is not None and x.numel():
            x = x.detach()
            finite = x[torch.isfinite(x)]
            if finite.numel():
                m = max(m, float(finite.abs().max()))
    return m


def rule_failures(case: str, got, lp, r32, dsinks_err: float | None = None) -> list[str]:
    """The flash-attn rule on every tensor; one line per violation (empty when all pass).

    ``dsinks_err``, when given, replaces err(ref_lp, ref32) for dsinks (see the module doc)."""
    fails = []
    floors = {"out": 1e-5 * _scale(r32[0]), "lse": 1e-5 * _scale(r32[1])}
    floors.update(dict.fromkeys(NAMES[2:], 1e-5 * _scale(*r32[2:])))
    for name, a, b, c in zip(NAMES, got, lp, r32):
        if c is None:
            continue
        if a is None:
            fails.append(f"{name}: missing (no gradient)")
            continue
        if a.shape != c.shape:
            fails.append(f"{name}: shape {tuple(a.shape)} != {tuple(c.shape)}")
            continue
        nan = torch.isnan(a)
        if nan.any():
            fails.append(f"{name}: {int(nan.sum())} NaN (unwritten/poisoned or invalid), first at {nan.nonzero()[0].tolist()}")
            continue
        full_shape = a.shape
        if name == "lse":
            masked = torch.isneginf(c)
            if not torch.equal(torch.isneginf(a), masked):
                bad = (torch.isneginf(a) != masked).nonzero()
                fails.append(f"lse: -inf pattern differs from ref32 at {bad.shape[0]} rows, first {bad[0].tolist()}")
                continue
            # compare finite entries only (masked ones become 0 - 0)
            a, b, c = (x.masked_fill(masked, 0.0) for x in (a, b, c))
        floor = floors[name]
        factor = 2 if name in ("out", "lse") else 3
        err, ref_err = _max_err(a, c), _max_err(b, c)
        if name == "dsinks" and dsinks_err is not None:
            ref_err = max(ref_err, dsinks_err)
        if not err <= factor * ref_err + floor:
            flat = int((a.double() - c.double()).abs().flatten().argmax())
            idx = [int(i) for i in torch.unravel_index(torch.tensor(flat), full_shape)]
            fails.append(f"{name}: kernel err {err:.3e} > {factor} * ref_lp err {ref_err:.3e} + {floor:.1e} (worst at {idx})")
    return fails


def check_case(g: G, deterministic=False):
    causal, window = MASKS[g.mask]
    q, k, v, sinks, dout = _inputs(g)
    dout = None if g.grad == "lse" else dout
    dlse = None
    if "lse" in g.grad:
        # -inf rows get no lse gradient (their lse is constant); others a random one.
        with torch.no_grad():
            _, lse_probe = reference.attention_forward(
                q.float(), k.float(), v.float(), 1.0, _window(causal, window), None if sinks is None else sinks.float(), 0.0, chunk=512
            )
        dlse = torch.randn(g.batch, g.h, g.sq, device="cuda").masked_fill(torch.isneginf(lse_probe), 0.0)
    got, error = run_kernel(q, k, v, sinks, dout, dlse, causal, window, g.softcap, deterministic)
    lp, r32 = run_references(q, k, v, sinks, dout, dlse, causal, window, g.softcap)
    if error is not None:
        return rule_failures(g.id, got[:2], lp[:2], r32[:2]) + [f"backward raised {type(error).__name__}: {error}"]
    return rule_failures(g.id, got, lp, r32, dsinks_ref_err(q, v, sinks, dout, dlse, lp, r32))


# --------------------------------------------------------------------------------------------
# the grid
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g", GRID, ids=[g.id for g in GRID])
def test_kernel_vs_reference(g: G):
    fails = check_case(g)
    assert not fails, f"[{g.id}]\n  " + "\n  ".join(fails)


# Many more dK/dV key tiles than SMs (576 and 540), so that the persistent dK/dV CTAs (d <= 96,
# ``configs.bwd_config``) walk many tiles each: by ticket, through both K/V buffers, tiles of odd
# and even step counts, under a window tiles that end early.
MANY_TILES = [
    G(1500, 1500, 64, 64, 16, 16, "causal", BF16, batch=3),
    G(1100, 1473, 96, 96, 12, 4, "win(127,0)", FP16, batch=9, sinks=True, grad="out+lse"),
]


@pytest.mark.parametrize("g", MANY_TILES, ids=[g.id for g in MANY_TILES])
def test_persistent_backward_over_many_tiles(g: G):
    fails = check_case(g)
    assert not fails, f"[{g.id}]\n  " + "\n  ".join(fails)


def test_persistent_deterministic_backward_is_bitwise_reproducible():
    """The persistent dK/dV kernel without dQ (deterministic mode), many tiles per CTA: the
    backward of one forward graph, repeated, gives bitwise equal gradients, close to the
    default mode's (test_deterministic_backward_is_bitwise_reproducible repeats the forward
    too)."""
    g = MANY_TILES[0]
    causal, window = MASKS[g.mask]
    q, k, v, _, dout = _inputs(g)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    with debug.poison():
        out = flash_attn_func(*leaves, causal=causal, window_size=window, deterministic=True)
        first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        for run in range(1, 10):
            again = torch.autograd.grad(out, leaves, dout, retain_graph=True)
            for name, a, b in zip(("dq", "dk", "dv"), first, again):
                assert torch.equal(a, b), f"[{g.id}] {name} differs between run 0 and run {run} (deterministic=True)"
        # Against the default mode (test_persistent_backward_over_many_tiles checks that one
        # against the reference; its forward's lse may differ by an ulp, so not bitwise).
        out_default = flash_attn_func(*leaves, causal=causal, window_size=window)
        default = torch.autograd.grad(out_default, leaves, dout)
    for name, a, b in zip(("dq", "dk", "dv"), first, default):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m, n=name: f"[{g.id}] {n} vs the default mode: {m}")


# Calls that share the GPU with other kernels (ring attention's transfers run beside each step)
# take no persistent schedule (``configs.sharing_sms``): the d=128 forward, the d=64 short
# forward's pairs and the d <= 96 persistent dK/dV kernel each have a one-tile-per-CTA twin.
SHARING_SMS = [
    G(4224, 4224, 128, 128, 4, 4, "causal", BF16),
    G(1023, 1024, 128, 128, 8, 2, "win(127,0)", BF16, grad="out+lse"),
    G(513, 700, 64, 64, 4, 2, "none", BF16),
    MANY_TILES[0],
]


def spy_configs(monkeypatch) -> list:
    """The tile configs of every kernel the test then looks up (``cache.get_static``), in order:
    which kernels a case really ran, so a forced config cannot pass by not running."""
    from flashtile.kernels import cache

    launched = []
    real_get = cache.get_static

    def spy(builder, config, static, key_):
        launched.append(config)
        return real_get(builder, config, static, key_)

    monkeypatch.setattr(cache, "get_static", spy)
    return launched


@pytest.mark.parametrize("g", SHARING_SMS, ids=[g.id for g in SHARING_SMS])
def test_kernels_sharing_sms(g: G, monkeypatch):
    """Every launch of the case asks for ``share_sms=True`` (as ring attention's steps do), and
    every forward and dK/dV kernel it runs has no persistent grid."""
    from flashtile import kernels
    from flashtile.kernels import configs

    for name in ("forward", "backward"):
        def forced(*args, _real=getattr(kernels, name), **kwargs):
            kwargs["share_sms"] = True  # over the callers' own share_sms=False
            return _real(*args, **kwargs)

        monkeypatch.setattr(kernels, name, forced)
    launched = spy_configs(monkeypatch)
    fails = check_case(g)
    assert not fails, f"[{g.id}] share_sms=True\n  " + "\n  ".join(fails)
    fwd = [c for c in launched if isinstance(c, configs.FwdConfig)]
    bwd = [c for c in launched if isinstance(c, configs.BwdConfig)]
    assert fwd and bwd, f"[{g.id}] launched {launched}"
    assert all(c.tiles_per_cta == 1 for c in fwd) and not any(c.persistent for c in bwd), f"[{g.id}] persistent: {launched}"


# The d = 256 dK/dV kernel of ``kernels/bwd_wide.py`` (both warpgroups compute the whole
# S^T / dP^T, each owns a column half of dK, dV, dQ), not in the tile table yet: forced here by
# the tuning hook on odd lengths, Sq != Sk both ways, GQA, masks, sinks with an lse gradient,
# fp16, many key tiles, and the deterministic mode (the kernel without dQ).
WIDE = [
    G(113, 203, 256, 256, 4, 4, "none", BF16, batch=2),
    G(451, 317, 256, 256, 8, 2, "causal", BF16),
    G(300, 700, 256, 256, 4, 1, "causal", FP16),
    G(255, 255, 256, 256, 4, 2, "win(64,64)", BF16, sinks=True, grad="out+lse"),
    G(1, 1024, 256, 256, 4, 4, "causal+win(256)", BF16),
    G(2048, 2048, 256, 256, 8, 8, "none", BF16, batch=2),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("g", WIDE, ids=[g.id for g in WIDE])
def test_wide_backward_vs_reference(g: G, deterministic, monkeypatch):
    check_with_bwd_wide(g.id, lambda: check_case(g, deterministic=deterministic), deterministic, monkeypatch)


def check_with_bwd_wide(case_id: str, run, deterministic: bool, monkeypatch) -> None:
    """``run()`` (a case's failure list) with ``bwd_wide``'s kernel forced by the tuning hook,
    asserting that it really ran and that the case passed (dense and packed tests share it)."""
    from flashtile.kernels import configs

    wide = configs.BwdConfig(block_n=64, block_m=64, num_stages=1, threads=256, overlap=True, replicate_scores=True)
    monkeypatch.setitem(configs.overrides, "bwd", wide)
    launched = spy_configs(monkeypatch)
    fails = run()
    assert wide in launched, f"[{case_id}] bwd_wide was not launched: {launched}"
    assert not fails, f"[{case_id}] bwd_wide {'deterministic' if deterministic else 'default'}\n  " + "\n  ".join(fails)


# --------------------------------------------------------------------------------------------
# determinism, recompilation, dispatch, layouts, empty sequences
# --------------------------------------------------------------------------------------------

DETERMINISM = [
    # d <= 128: dQ adds ordered by tickets inside the hand-written dK/dV kernel
    G(333, 517, 128, 128, 8, 2, "causal", BF16, batch=2),  # GQA, causal, odd lengths
    G(255, 255, 128, 128, 4, 1, "win(64,64)", BF16, sinks=True, batch=2),
    G(700, 301, 64, 64, 4, 4, "none", FP16, batch=2),  # Sq > Sk, 11 query blocks per key block
    # The persistent dK/dV kernel without dQ over many tiles; also the d=64 forward's
    # overlapping bottom-aligned first tiles (S = 1500), whose lse once differed by 1 ulp.
    MANY_TILES[0],
    # dQ by its own kernel: softcap (hand-written dQ kernel) and d=256 (auto-pipelined)
    G(257, 190, 128, 128, 4, 2, "causal", BF16, softcap=30.0),
    G(200, 333, 256, 256, 2, 2, "none", BF16),
]


@pytest.mark.parametrize("g", DETERMINISM, ids=[g.id for g in DETERMINISM])
def test_deterministic_backward_is_bitwise_reproducible(g: G):
    causal, window = MASKS[g.mask]
    q, k, v, sinks, dout = _inputs(g)
    first, error = run_kernel(q, k, v, sinks, dout, None, causal, window, g.softcap, deterministic=True)
    if error is not None:
        raise error
    lp, r32 = run_references(q, k, v, sinks, dout, None, causal, window, g.softcap)
    fails = rule_failures(g.id, first, lp, r32, dsinks_ref_err(q, v, sinks, dout, None, lp, r32))
    assert not fails, f"[{g.id} deterministic]\n  " + "\n  ".join(fails)
    for run in range(1, 20):
        again, error = run_kernel(q, k, v, sinks, dout, None, causal, window, g.softcap, deterministic=True)
        if error is not None:
            raise error
        for name, a, b in zip(NAMES, first, again):
            if a is not None:
                assert torch.equal(a, b), f"[{g.id}] {name} differs between run 0 and run {run} (deterministic=True)"


def test_no_recompile_for_new_batch_seqlen_heads():
    """After one warm call per structure, new batch sizes, sequence lengths (odd ones too), head
    counts, GQA ratios and window values compile nothing."""
    dtype, d = BF16, 64
    masks = [(False, (-1, -1)), (True, (-1, -1)), (False, (31, 7))]

    def call(b, sq, sk, h, hkv, causal, window):
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
        out = flash_attn_func(q, k, v, causal=causal, window_size=window)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()

    for causal, window in masks:  # warm: one call per mask kind
        call(1, 128, 128, 2, 2, causal, window)
    before = cache.total_builds()
    slowest = (0.0, None)
    for b, sq, sk, h, hkv in [(1, 1, 1, 2, 1), (3, 17, 113, 4, 4), (2, 129, 257, 6, 3), (1, 333, 333, 8, 2), (4, 64, 1000, 2, 2), (1, 1000, 64, 16, 1)]:
        for causal, window in masks:
            t0 = time.perf_counter()
            call(b, sq, sk, h, hkv, causal, window)
            dt = time.perf_counter() - t0
            slowest = max(slowest, (dt, (b, sq, sk, h, hkv, causal, window)), key=lambda x: x[0])
    assert cache.total_builds() == before, f"{cache.total_builds() - before} new kernel builds: {dict(cache.builds)}"
    # A compile takes seconds; a warm call on these sizes takes milliseconds.
    assert slowest[0] < 3.0, f"slowest warm call took {slowest[0]:.2f} s at {slowest[1]} (a hidden recompile?)"


_NO_TILELANG_PROBE = """
import sys, torch, flashtile
torch.manual_seed(0)
q, k, v = (torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16)
out = flashtile.flash_attn_func(q, k, v, causal=True)  # eager, default stream
out.backward(dout)
grads = [x.grad.clone() for x in (q, k, v)]
# The same forward captured in a CUDA graph on a side stream, replayed on new inputs: a kernel
# launched on any stream but the caller's would break the capture or miss the replay.
qs, ks, vs = (torch.randn_like(x).detach() for x in (q, k, v))
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    flashtile.flash_attn_func(qs, ks, vs, causal=True)  # warm-up on the capturing stream
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        graphed = flashtile.flash_attn_func(qs, ks, vs, causal=True)
torch.cuda.current_stream().wait_stream(side)
for x, y in zip((qs, ks, vs), (q, k, v)):
    x.copy_(y.detach())
graph.replay()
# A packed batch (three sequences), forward and backward.
cu = torch.tensor([0, 100, 333, 666], dtype=torch.int32, device="cuda")
pq, pk, pv = (x.detach().reshape(666, 4, 64).clone().requires_grad_() for x in (q, k, v))
pout = flashtile.flash_attn_varlen_func(pq, pk, pv, cu, cu, 333, 333, causal=True)
pout.backward(dout.reshape(666, 4, 64))
torch.cuda.synchronize()
print("tilelang imported:", "tilelang" in sys.modules)
torch.save({"out": out.detach().cpu(), "graphed": graphed.cpu(), "grads": [g.cpu() for g in grads],
            "packed": [pout.detach().cpu()] + [x.grad.cpu() for x in (pq, pk, pv)]}, sys.argv[1])
"""


def test_kernels_loaded_by_id_run_without_tilelang(tmp_path):
    """A new process whose kernels are all tagged in the disk cache (this process built or
    loaded them first) runs a forward and a backward, eagerly and in a CUDA graph captured on
    a side stream, and a packed batch's forward and backward, without importing TileLang
    (``cache._load_executable``: tvm-ffi and the TVM runtime only; ``packed_stats``), and its
    results equal this process's bit for bit (out) and within the atomics' reordering
    (gradients)."""
    import subprocess
    import sys

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 333, 4, 64, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 333, 4, 64, device="cuda", dtype=BF16)
    out = flash_attn_func(q, k, v, causal=True)
    out.backward(dout)  # builds or loads (and tags) every kernel the probe needs
    cu = torch.tensor([0, 100, 333, 666], dtype=torch.int32, device="cuda")
    pq, pk, pv = (x.detach().reshape(666, 4, 64).clone().requires_grad_() for x in (q, k, v))
    pout = flashtile.flash_attn_varlen_func(pq, pk, pv, cu, cu, 333, 333, causal=True)
    pout.backward(dout.reshape(666, 4, 64))
    torch.cuda.synchronize()
    saved = tmp_path / "probe.pt"
    run = subprocess.run([sys.executable, "-c", _NO_TILELANG_PROBE, str(saved)], capture_output=True, text=True)
    assert run.returncode == 0, f"probe failed:\n{run.stderr[-3000:]}"
    assert "tilelang imported: False" in run.stdout, f"TileLang was imported: {run.stdout!r}"
    got = torch.load(saved)
    assert torch.equal(got["out"], out.detach().cpu()), "eager out differs from this process's"
    assert torch.equal(got["graphed"], out.detach().cpu()), "graph-replayed out differs from the eager one"
    for name, a, b in zip("qkv", got["grads"], (q.grad, k.grad, v.grad)):
        err = (a.float() - b.detach().cpu().float()).abs().max().item()
        assert err <= 1e-2 * max(1.0, b.abs().max().item()), f"d{name} differs by {err}"
    assert torch.equal(got["packed"][0], pout.detach().cpu()), "packed out differs from this process's"
    for name, a, b in zip("qkv", got["packed"][1:], (pq.grad, pk.grad, pv.grad)):
        err = (a.float() - b.detach().cpu().float()).abs().max().item()
        assert err <= 1e-2 * max(1.0, b.abs().max().item()), f"packed d{name} differs by {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_precision_on_cuda_is_not_implemented(dtype):
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=dtype)
    with pytest.raises(NotImplementedError, match="dtype"):
        flash_attn_func(q, q, q)


def test_non_contiguous_inputs_match_contiguous():
    """q, k, v sliced from a packed qkv projection (and a transposed dout) give bitwise the same
    results as contiguous copies (deterministic backward so dq is reproducible)."""
    b, s, h, hkv, d = 2, 301, 8, 2, 128
    qkv = torch.randn(b, s, h + 2 * hkv, d, device="cuda", dtype=BF16)
    q, k, v = qkv[:, :, :h], qkv[:, :, h : h + hkv], qkv[:, :, h + hkv :]
    dout = torch.randn(b, h, s, d, device="cuda", dtype=BF16).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or dout.is_contiguous())
    before = qkv.clone()
    strided, e1 = run_kernel(q, k, v, None, dout, None, True, (-1, -1), 0.0, deterministic=True)
    dense, e2 = run_kernel(q.contiguous(), k.contiguous(), v.contiguous(), None, dout.contiguous(), None, True, (-1, -1), 0.0, deterministic=True)
    if e1 or e2:
        raise e1 or e2
    for name, a, c in zip(NAMES, strided, dense):
        if c is not None:
            assert torch.equal(a, c), f"{name}: non-contiguous input changes the result (max diff {_max_err(a, c):.3e})"
    assert torch.equal(qkv, before), "inputs were modified"


@pytest.mark.parametrize("sinks", [False, True])
def test_empty_sequences(sinks):
    """seqlen_k == 0: out 0 and lse -inf (or the sink); seqlen_q == 0: empty outputs. No NaN."""
    h = 4
    s = torch.randn(h, device="cuda") if sinks else None
    q = torch.randn(2, 37, h, 128, device="cuda", dtype=BF16)
    k = torch.randn(2, 0, 2, 128, device="cuda", dtype=BF16)
    v = torch.randn(2, 0, 2, 128, device="cuda", dtype=BF16)
    with debug.poison():
        out, lse = flash_attn_func(q, k, v, sinks=s, return_lse=True)
    want_out, want_lse = naive_attention(q, k, v, sinks=s)
    assert torch.equal(out.float(), want_out.float()), "seqlen_k == 0: out must be 0"
    assert torch.equal(lse, want_lse.float()), "seqlen_k == 0: lse must be -inf or the sink"
    q0 = torch.randn(2, 0, h, 128, device="cuda", dtype=BF16)
    k0 = torch.randn(2, 9, 2, 128, device="cuda", dtype=BF16)
    with debug.poison():
        out0, lse0 = flash_attn_func(q0, k0, k0, sinks=s, causal=True, return_lse=True)
    assert out0.shape == (2, 0, h, 128) and lse0.shape == (2, h, 0)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_very_negative_scores_with_a_key_tail(packed):
    """Every score below -100 (lse2 < -128) and 200 keys, not a multiple of the backward's
    128-key block: the block's rows past the last key (a dense tensor's zero fill; in a packed
    batch the next sequence's keys) must not reach dQ, where a zero key row's exp2(-lse2) would
    overflow.  The flash-attn rule against the float32 reference, as
    ``test_kernel_vs_reference``."""
    d, h, n = 64, 2, 200
    base = torch.rand(d, device="cuda") + 0.5  # q . k ~ -16 |base|^2: scores ~ -130 at scale 1/8
    q = (4 * base + 0.1 * torch.randn(2, n, h, d, device="cuda")).to(BF16)
    k = (-4 * base + 0.1 * torch.randn(2, n, h, d, device="cuda")).to(BF16)
    v = torch.randn(2, n, h, d, device="cuda", dtype=BF16)
    dout = torch.randn(2, n, h, d, device="cuda", dtype=BF16)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(d)
    assert scores.max() < -100, "the case needs every score below -100"
    if packed:  # two sequences of 200: the first one's key tail is the second one's keys
        cu = torch.tensor([0, n, 2 * n], dtype=torch.int32, device="cuda")
        leaves = [x.reshape(2 * n, h, -1).clone().requires_grad_(True) for x in (q, k, v)]
        with debug.poison():
            out, lse = flashtile.flash_attn_varlen_func(*leaves, cu, cu, n, n, return_lse=True)
            grads = torch.autograd.grad(out, leaves, dout.reshape(2 * n, h, d))
        got = (out.view(2, n, h, d), lse.view(h, 2, n).transpose(0, 1)) + tuple(g.view(2, n, h, d) for g in grads) + (None,)
    else:
        got, error = run_kernel(q, k, v, None, dout, None, False, (-1, -1), 0.0)
        assert error is None, error
    lp, r32 = run_references(q, k, v, None, dout, None, False, (-1, -1), 0.0)
    fails = rule_failures("very negative scores", got, lp, r32)
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("d,dv,softcap", [(64, 64, 0.0), (192, 128, 0.0), (256, 256, 0.0), (128, 128, 30.0)], ids=["d64", "d192v128", "d256", "d128-softcap"])
def test_tiles_that_see_nothing_write_exact_zeros(d, dv, softcap):
    """Window (0, 0) with lengths far apart leaves whole query tiles with no visible key
    (seqlen_q >> seqlen_k) and whole key blocks that no query sees (seqlen_k >> seqlen_q).
    Their outputs must be exact zeros (out, dk, dv) and lse -inf, on every run.  The
    auto-pipelined kernels (these head dims; softcap's backward) once raced there: the tile's
    first TMA loads were waited for only inside the skipped loop and landed on the output's
    staging tile (seen on an H100)."""
    torch.manual_seed(0)
    for sq, sk in ((700, 3), (3, 700)):
        q = torch.randn(2, sq, 4, d, device="cuda", dtype=BF16, requires_grad=True)
        k = torch.randn(2, sk, 2, d, device="cuda", dtype=BF16, requires_grad=True)
        v = torch.randn(2, sk, 2, dv, device="cuda", dtype=BF16, requires_grad=True)
        dout = torch.randn(2, sq, 4, dv, device="cuda", dtype=BF16)
        off = sk - sq  # row i sees key i + off only (bottom-right aligned window (0, 0))
        blind_rows = [i for i in range(sq) if not 0 <= i + off < sk]
        unseen_keys = [j for j in range(sk) if not 0 <= j - off < sq]
        for run in range(10):
            with debug.poison():
                out, lse = flash_attn_func(q, k, v, window_size=(0, 0), softcap=softcap, return_lse=True)
                _, dk, dv_ = torch.autograd.grad(out, (q, k, v), dout)
            where = f"sq={sq} sk={sk} run {run}"
            assert torch.equal(out[:, blind_rows], torch.zeros_like(out[:, blind_rows])), f"{where}: rows that see no key must output exact zeros"
            assert torch.isneginf(lse[:, :, blind_rows]).all(), f"{where}: rows that see no key must have lse -inf"
            assert (dk[:, unseen_keys] == 0).all() and (dv_[:, unseen_keys] == 0).all(), f"{where}: keys no query sees must get zero dk/dv"


def rising_qk(b, sq, sk, h, hkv, d, rise, dtype, device="cuda", gen=None):
    """q, k in ``dtype`` whose scores rise along the key axis: ``q . k_j / sqrt(d)`` grows by
    about ``rise`` (nats) from the first key to the last, over random scores of unit spread.  A
    row's max then moves in most blocks, so the forward's warps take the O rescale in some
    blocks and skip it in others (``fwd_ws.rescaler``), where random inputs, whose max settles
    within a row's first blocks, mostly skip it."""
    u = torch.nn.functional.normalize(torch.randn(d, generator=gen), dim=0)
    c0 = 8.0  # q's component along u; k_j's is t_j, so the scores gain c0 t_j / sqrt(d)
    t = torch.linspace(0, rise * math.sqrt(d) / c0, sk)
    q = torch.randn(b, sq, h, d, generator=gen) + c0 * u
    k = torch.randn(b, sk, hkv, d, generator=gen) + t[None, :, None, None] * u
    return q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype)


@pytest.mark.parametrize("d,mask,rise,dtype", [
    (64, "none", 40.0, BF16), (128, "none", 40.0, FP16), (128, "causal", 6.0, BF16),
    (128, "none", 6.0, BF16), (256, "causal", 40.0, BF16), (192, "none", 12.0, FP16),
    (256, "none", 6.0, FP16), (64, "causal", 6.0, FP16),
], ids=lambda x: str(x).replace("torch.", ""))
def test_rising_scores_move_the_row_max(d, mask, rise, dtype):
    """Scores that rise along each row (``rising_qk``, slowly and steeply) move the row max in
    many blocks: warps rescale O in some blocks and skip it in others; out, lse and the
    gradients must satisfy flash-attn's rule against the float32 reference
    (``rule_failures``)."""
    causal, window = MASKS[mask]
    dv = 128 if d == 192 else d
    q, k = rising_qk(2, 777, 1500, 4, 2, d, rise, dtype)
    v = torch.randn(2, 1500, 2, dv, device="cuda", dtype=dtype)
    dout = torch.randn(2, 777, 4, dv, device="cuda", dtype=dtype)
    got, error = run_kernel(q, k, v, None, dout, None, causal, window, 0.0)
    assert error is None, error
    lp, r32 = run_references(q, k, v, None, dout, None, causal, window, 0.0)
    fails = rule_failures(f"rising scores d={d} {mask} rise={rise}", got, lp, r32)
    assert not fails, "\n".join(fails)
