"""flash_attn_varlen_func's CUDA kernels against the reference (marker ``gpu``; skipped without CUDA).

Same rule as ``test_gpu_kernels.py`` (whose ``rule_failures`` this reuses): with ``ref32`` the
per-sequence reference in float32 and ``ref_lp`` the reference fed the low-precision tensors,

    err(kernel, ref32) <= 2 * err(ref_lp, ref32) + floor    for out and lse
    err(kernel, ref32) <= 3 * err(ref_lp, ref32) + floor    for dq, dk, dv, dsinks

with the floor ``1e-5 * max(1, scale)``, lse compared on finite entries (and -inf exactly where
ref32's is), every kernel call inside ``debug.poison()`` (NaN-filled outputs) so that rows the
kernel forgets show up.  Rows outside every used range (``seqused_q``) must be exact zeros with
lse -inf; keys outside ``seqused_k`` must get exact zero dk / dv.

Batches are seeded random packings that always contain lengths 0, 1, 17, 129 and 1000 (on the
query and the key side, paired differently so seqlen_q != seqlen_k per sequence).  Few kernel
structures on purpose (each is a TileLang compile): bf16 d=128 carries the mask, sinks,
softcap, seqused and determinism cases.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import pytest
import torch

from flashtile import reference
from flashtile.kernels import cache, debug
from flashtile.varlen import flash_attn_varlen_func
from test_gpu_kernels import NAMES, _ieee_fp32_reference, check_with_bwd_wide, rule_failures  # noqa: F401 (autouse fixture: ref32 without TF32)

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
I32 = torch.int32
MASKS = {
    "none": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "win(127,0)": (False, (127, 0)),
    "win(64,64)": (False, (64, 64)),
    "causal+win(256)": (True, (256, -1)),
}
MUST = (0, 1, 17, 129, 1000)  # lengths every random batch contains, on both sides


def random_lengths(seed: int, batch: int, hi: int = 700) -> list[tuple[int, int]]:
    """(len_q, len_k) pairs: MUST on both sides (shifted so pairs differ), then random ones."""
    rng = random.Random(seed)
    lq = list(MUST) + [rng.randint(0, hi) for _ in range(batch - len(MUST))]
    lk = list(MUST[2:] + MUST[:2]) + [rng.choice([rng.randint(0, hi), 0, 1, 64, 128]) for _ in range(batch - len(MUST))]
    pairs = list(zip(lq, lk))
    rng.shuffle(pairs)
    return pairs


@dataclass(frozen=True)
class V:
    seed: int
    d: int
    dv: int
    h: int
    hkv: int
    mask: str
    dtype: torch.dtype
    batch: int = 8
    sinks: bool = False
    softcap: float = 0.0
    seqused: bool = False
    grad: str = "out"  # "out", "out+lse" or "lse"

    @property
    def id(self) -> str:
        s = f"{'bf16' if self.dtype == BF16 else 'fp16'}-seed{self.seed}-b{self.batch}-d{self.d}"
        s += (f"v{self.dv}" if self.dv != self.d else "") + f"-h{self.h}:{self.hkv}-{self.mask}"
        s += "-sinks" if self.sinks else ""
        s += f"-cap{self.softcap:g}" if self.softcap else ""
        s += "-seqused" if self.seqused else ""
        s += "" if self.grad == "out" else f"-grad({self.grad})"
        return s


GRID = [
    V(0, 128, 128, 8, 2, "causal", BF16),
    V(1, 128, 128, 4, 4, "none", BF16, grad="out+lse"),
    V(2, 128, 128, 8, 2, "win(127,0)", BF16, batch=12),
    V(3, 128, 128, 4, 1, "causal+win(256)", BF16, sinks=True, softcap=30.0, grad="out+lse"),
    V(4, 128, 128, 8, 2, "causal", BF16, seqused=True),
    V(5, 128, 128, 8, 2, "win(64,64)", BF16, sinks=True, seqused=True, grad="lse"),
    V(6, 128, 128, 8, 2, "causal", FP16),
    V(7, 64, 64, 4, 1, "none", BF16),
    V(8, 64, 64, 8, 2, "causal", BF16, batch=16),
    V(9, 256, 256, 4, 2, "causal", BF16),
    V(10, 192, 128, 8, 2, "win(127,0)", BF16),
    V(11, 40, 40, 8, 2, "causal", FP16),  # padded head dim (kernel d=48/64)
    # Many more key tiles than SMs, so that the persistent packed dK/dV CTAs (d <= 96) walk
    # many tiles each: by ticket, through both K/V buffers, odd and even step counts, dead
    # slots, and under a window tiles with no step at all.
    V(12, 64, 64, 16, 16, "causal", BF16, batch=40),
    V(13, 96, 96, 12, 4, "win(64,64)", BF16, batch=48, sinks=True, seqused=True, grad="out+lse"),
]


def test_grid_covers_every_axis():
    assert {g.mask for g in GRID} == set(MASKS)
    assert {(g.d, g.dv) for g in GRID} == {(64, 64), (96, 96), (128, 128), (256, 256), (192, 128), (40, 40)}
    assert {g.dtype for g in GRID} == {BF16, FP16}
    assert {(g.h // g.hkv) for g in GRID} >= {1, 4} and any(g.hkv == 1 for g in GRID)
    assert {g.grad for g in GRID} == {"out", "out+lse", "lse"}
    assert any(g.sinks for g in GRID) and any(g.softcap for g in GRID) and any(g.seqused for g in GRID)
    # forward structures compiled: (d, dv, dtype, sinks, softcap)
    assert len({(g.d, g.dv, g.dtype, g.sinks, bool(g.softcap)) for g in GRID}) <= 9


# --- helpers ------------------------------------------------------------------------------------


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=I32, device="cuda")


def make_batch(g: V, pairs=None):
    """q, k, v, sinks, dout, cu_q, cu_k, seqused_q, seqused_k, max_q, max_k (fresh randn);
    ``pairs``: the (len_q, len_k) of each sequence, else ``random_lengths``."""
    pairs = random_lengths(g.seed, g.batch) if pairs is None else pairs
    lq, lk = [a for a, _ in pairs], [b for _, b in pairs]
    q = torch.randn(sum(lq), g.h, g.d, device="cuda", dtype=g.dtype)
    k = torch.randn(sum(lk), g.hkv, g.d, device="cuda", dtype=g.dtype)
    v = torch.randn(sum(lk), g.hkv, g.dv, device="cuda", dtype=g.dtype)
    sinks = torch.randn(g.h, device="cuda") if g.sinks else None
    dout = torch.randn(sum(lq), g.h, g.dv, device="cuda", dtype=g.dtype)
    used_q = used_k = None
    if g.seqused:  # use a random prefix of each segment (sometimes all of it, sometimes none)
        rng = random.Random(g.seed + 100)
        used_q = [rng.choice([n, rng.randint(0, n)]) for n in lq]
        used_k = [rng.choice([n, rng.randint(0, n)]) for n in lk]
    max_q = max(used_q if used_q else lq)
    max_k = max(used_k if used_k else lk)
    to_t = lambda x: None if x is None else torch.tensor(x, dtype=I32, device="cuda")  # noqa: E731
    return q, k, v, sinks, dout, _cu(lq), _cu(lk), to_t(used_q), to_t(used_k), max_q, max_k


def _window(causal, window):
    return (window[0], 0) if causal else tuple(window)


def run_kernel(q, k, v, sinks, dout, dlse, cu_q, cu_k, uq, uk, mq, mk, causal, window, softcap, deterministic=False):
    """flash_attn_varlen_func fwd + bwd with poisoned outputs: (out, lse, dq, dk, dv, dsinks)."""
    leaves = [None if x is None else x.detach().clone().requires_grad_(True) for x in (q, k, v, sinks)]
    with debug.poison():
        out, lse = flash_attn_varlen_func(
            *leaves[:3], cu_q, cu_k, mq, mk, causal=causal, window_size=window, softcap=softcap,
            deterministic=deterministic, sinks=leaves[3], seqused_q=uq, seqused_k=uk, return_lse=True,
        )
        outputs, grads = [], []
        if dout is not None:
            outputs.append(out), grads.append(dout)
        if dlse is not None:
            outputs.append(lse), grads.append(dlse)
        torch.autograd.backward(outputs, grads)
        torch.cuda.synchronize()
    return (out.detach(), lse.detach()) + tuple(None if x is None else x.grad for x in leaves)


def run_references(q, k, v, sinks, dout, dlse, cu_q, cu_k, uq, uk, causal, window, softcap):
    """(ref_lp, ref32): out, lse, dq, dk, dv, dsinks of the per-sequence reference."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    win = _window(causal, window)
    seq = dict(seqused_q=uq, seqused_k=uk, chunk=512)
    f32 = [None if x is None else x.float() for x in (q, k, v, sinks)]
    dout32 = torch.zeros(*q.shape[:2], v.shape[-1], device="cuda") if dout is None else dout.float()
    doutlp = dout32.to(q.dtype)
    o32, l32 = reference.varlen_attention_forward(*f32[:3], cu_q, cu_k, scale, win, f32[3], softcap, **seq)
    g32 = reference.varlen_attention_backward(dout32, *f32[:3], o32, l32, cu_q, cu_k, scale, win, f32[3], softcap, dlse, **seq)
    olp, llp = reference.varlen_attention_forward(q, k, v, cu_q, cu_k, scale, win, sinks, softcap, **seq)
    glp = reference.varlen_attention_backward(doutlp, q, k, v, olp, llp, cu_q, cu_k, scale, win, sinks, softcap, dlse, **seq)
    return (olp, llp) + tuple(glp), (o32, l32) + tuple(g32)


def dsinks_ref_err(sinks, dout, dlse, lp, r32) -> float | None:
    """max_h sum_i exp(sink_h - lse_i) |Delta_lp,i - Delta_32,i| (see test_gpu_kernels)."""
    if sinks is None:
        return None
    dout32 = torch.zeros_like(r32[0]) if dout is None else dout.float()

    def delta(out):  # (h, total_q)
        d = (dout32 * out.float()).sum(-1).transpose(0, 1)
        return d if dlse is None else d - dlse

    w = torch.exp(sinks.float()[:, None] - r32[1])
    return float((w * (delta(lp[0]) - delta(r32[0])).abs()).sum(dim=1).max())


def unused_failures(got, cu_q, cu_k, uq, uk) -> list[str]:
    """Rows past seqused_q: exact zeros, lse -inf, dq 0; keys past seqused_k: dk = dv = 0."""
    fails = []
    out, lse, dq, dk, dv = got[:5]
    for side, cu, used in (("q", cu_q, uq), ("k", cu_k, uk)):
        if used is None:
            continue
        starts, ends = cu[:-1].tolist(), cu[1:].tolist()
        idx = [i for s, e, n in zip(starts, ends, used.tolist()) for i in range(s + n, e)]
        if not idx:
            continue
        idx = torch.tensor(idx, device="cuda")
        if side == "q":
            if out[idx].any() or not torch.isneginf(lse[:, idx]).all() or (dq is not None and dq[idx].any()):
                fails.append("rows past seqused_q must have out 0, lse -inf, dq 0")
        elif (dk is not None and dk[idx].any()) or (dv is not None and dv[idx].any()):
            fails.append("keys past seqused_k must get dk = dv = 0")
    return fails


def check(g: V, deterministic=False, pairs=None):
    causal, window = MASKS[g.mask]
    q, k, v, sinks, dout, cu_q, cu_k, uq, uk, mq, mk = make_batch(g, pairs)
    dout = None if g.grad == "lse" else dout
    dlse = None
    if "lse" in g.grad:
        with torch.no_grad():
            _, probe = reference.varlen_attention_forward(
                q.float(), k.float(), v.float(), cu_q, cu_k, 1.0, _window(causal, window),
                None if sinks is None else sinks.float(), 0.0, uq, uk, chunk=512,
            )
        dlse = torch.randn(g.h, q.shape[0], device="cuda").masked_fill(torch.isneginf(probe), 0.0)
    got = run_kernel(q, k, v, sinks, dout, dlse, cu_q, cu_k, uq, uk, mq, mk, causal, window, g.softcap, deterministic)
    lp, r32 = run_references(q, k, v, sinks, dout, dlse, cu_q, cu_k, uq, uk, causal, window, g.softcap)
    fails = rule_failures(g.id, got, lp, r32, dsinks_ref_err(sinks, dout, dlse, lp, r32))
    return fails + unused_failures(got, cu_q, cu_k, uq, uk), got


# --- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("g", GRID, ids=[g.id for g in GRID])
def test_varlen_kernel_vs_reference(g: V):
    fails, _ = check(g)
    assert not fails, f"[{g.id}]\n  " + "\n  ".join(fails)


# ``kernels/bwd_wide.py``'s d = 256 dK/dV kernel (not in the tile table yet), forced by the tuning
# hook: packed tiles that end past their sequence (row-guarded dK / dV stores), seqused, an lse gradient.
WIDE = [
    V(14, 256, 256, 4, 2, "causal", BF16),
    V(15, 256, 256, 8, 2, "none", BF16, batch=12, seqused=True, grad="out+lse"),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("g", WIDE, ids=[g.id for g in WIDE])
def test_wide_backward_vs_reference(g: V, deterministic, monkeypatch):
    check_with_bwd_wide(g.id, lambda: check(g, deterministic=deterministic)[0], deterministic, monkeypatch)


DETERMINISM = [GRID[0], GRID[3], GRID[12]]  # GRID[12]: the persistent packed dK/dV without dQ


@pytest.mark.parametrize("g", DETERMINISM, ids=[g.id for g in DETERMINISM])
def test_deterministic_backward_is_bitwise_reproducible(g: V):
    causal, window = MASKS[g.mask]
    fails, _ = check(g, deterministic=True)
    assert not fails, f"[{g.id} deterministic]\n  " + "\n  ".join(fails)
    q, k, v, sinks, dout, cu_q, cu_k, uq, uk, mq, mk = make_batch(g)
    first = run_kernel(q, k, v, sinks, dout, None, cu_q, cu_k, uq, uk, mq, mk, causal, window, g.softcap, True)
    for run in range(1, 10):
        again = run_kernel(q, k, v, sinks, dout, None, cu_q, cu_k, uq, uk, mq, mk, causal, window, g.softcap, True)
        for name, a, b in zip(NAMES, first, again):
            if a is not None:
                assert torch.equal(a, b), f"[{g.id}] {name} differs between run 0 and run {run} (deterministic=True)"


# Equal lengths: the dense kernels on views (``kernels.equal_lengths``), Sq != Sk, odd sizes.
EQUAL = [
    (V(30, 128, 128, 8, 2, "causal", BF16, batch=3, sinks=True, grad="out+lse"), [(129, 257)] * 3),
    (V(31, 64, 64, 4, 4, "win(64,64)", BF16, batch=5), [(200, 77)] * 5),
]


@pytest.mark.parametrize("g,pairs", EQUAL, ids=[g.id for g, _ in EQUAL])
@pytest.mark.parametrize("as_dense", [True, False], ids=["dense-kernels", "packed-kernels"])
def test_equal_length_batch(g: V, pairs, as_dense, monkeypatch):
    """A batch of equal lengths runs the dense kernels (or, switched off, the packed ones);
    both within the rule, and the dense route really taken."""
    from flashtile.kernels import launch

    monkeypatch.setattr("flashtile.kernels.EQUAL_AS_DENSE", as_dense)
    ranks = []  # q's rank at each launch: 4 = the dense kernels, 3 = the packed ones
    for name, q_at in (("launch_forward", 0), ("launch_backward", 2)):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, _real=real, _at=q_at: ranks.append(a[_at].dim()) or _real(*a))
    fails, _ = check(g, pairs=pairs)
    assert not fails, f"[{g.id} {'dense' if as_dense else 'packed'} kernels]\n  " + "\n  ".join(fails)
    assert ranks == [4 if as_dense else 3] * 2, f"q ranks at the forward and backward launches: {ranks}"


def test_new_lengths_never_recompile():
    """After a warm-up per mask kind, batches with other cu_seqlens (sizes, batch counts,
    max_seqlen, seqused) build no kernel."""
    masks = [(True, (-1, -1)), (False, (-1, -1))]
    h, hkv, d = 8, 2, 128

    def call(seed, batch, causal, window, seqused):
        g = V(seed, d, d, h, hkv, "none", BF16, batch=batch, seqused=seqused)
        q, k, v, _, dout, cu_q, cu_k, uq, uk, mq, mk = make_batch(g)
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, window_size=window, seqused_q=uq, seqused_k=uk)
        out.backward(dout)
        torch.cuda.synchronize()

    for causal, window in masks:
        call(0, 6, causal, window, False)
        call(0, 6, causal, window, True)
    before = cache.total_builds()
    slowest = 0.0
    for seed, batch in ((21, 5), (22, 9), (23, 17), (24, 33)):
        for causal, window in masks:
            t0 = time.perf_counter()
            call(seed, batch, causal, window, seed % 2 == 0)
            slowest = max(slowest, time.perf_counter() - t0)
    assert cache.total_builds() == before, f"{cache.total_builds() - before} new kernel builds: {dict(cache.builds)}"
    assert slowest < 3.0, f"slowest warm call took {slowest:.2f} s (a hidden recompile?)"


@pytest.mark.parametrize("sinks", [False, True])
def test_all_sequences_empty_or_keyless(sinks):
    """Every sequence has no keys (and one has no queries): out 0, lse -inf or the sink."""
    h = 4
    s = torch.randn(h, device="cuda") if sinks else None
    cu_q = torch.tensor([0, 5, 5, 12], dtype=I32, device="cuda")
    cu_k = torch.zeros(4, dtype=I32, device="cuda")
    q = torch.randn(12, h, 128, device="cuda", dtype=BF16)
    k = torch.randn(0, 2, 128, device="cuda", dtype=BF16)
    with debug.poison():
        out, lse = flash_attn_varlen_func(q, k, k, cu_q, cu_k, 7, 0, sinks=s, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    want = torch.full((h, 12), -math.inf, device="cuda") if s is None else s.float()[:, None].expand(h, 12)
    assert torch.equal(lse, want)


def test_content_checks_opt_in_on_cuda(monkeypatch):
    q = torch.randn(10, 4, 64, device="cuda", dtype=BF16)
    bad_cu = torch.tensor([0, 4, 9], dtype=I32, device="cuda")  # last entry != total_q
    cu_k = torch.tensor([0, 5, 10], dtype=I32, device="cuda")
    monkeypatch.setenv("FLASHTILE_CHECK_SEQLENS", "1")
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]"):
        flash_attn_varlen_func(q, q, q, bad_cu, cu_k, 6, 6)


@pytest.mark.parametrize("sq, sk, chunk, causal, window, sinks", [
    (1000, 1000, 256, True, (-1, -1), False),  # Llama 4's pattern: causal inside each chunk
    (700, 1000, 129, False, (100, 50), True),  # rows start mid-chunk; a chunk size that is no tile multiple
], ids=["causal", "window-offset-sinks"])
def test_chunked_attention_vs_reference(sq, sk, chunk, causal, window, sinks):
    """``attention_chunk`` on CUDA: the packed kernels over one sequence per (entry, chunk)
    (``flashtile/chunked.py``), forward and backward (through out and lse), against the CPU path
    in float32 and bf16 with the flash-attn rule.  bf16 d=128 with the structures of this
    file's grid: causal (seed 0; its backward without an lse gradient) and the two-sided window
    with sinks and an lse gradient (seed 5)."""
    import flashtile

    q = torch.randn(2, sq, 8, 128, device="cuda", dtype=BF16)
    k, v = (torch.randn(2, sk, 2, 128, device="cuda", dtype=BF16) for _ in range(2))
    s = torch.randn(8, device="cuda", dtype=BF16) if sinks else None
    dout = torch.randn_like(q)
    opts = dict(causal=causal, window_size=window, attention_chunk=chunk, return_lse=True)

    dlse = torch.linspace(-1, 1, 2 * 8 * sq).view(2, 8, sq) if sinks else None  # rows without keys: lse = sink

    def run(q, k, v, s, dout, dtype=None):
        leaves = [None if x is None else x.detach().clone().to(dtype or x.dtype).requires_grad_(True) for x in (q, k, v, s)]
        out, lse = flashtile.flash_attn_func(*leaves[:3], sinks=leaves[3], **opts)
        outputs, grads = [out], [dout.to(out.dtype)]
        if dlse is not None:
            outputs.append(lse), grads.append(dlse.to(lse.device))
        torch.autograd.backward(outputs, grads)
        return (out.detach(), lse.detach()) + tuple(None if x is None else x.grad for x in leaves)

    with debug.poison():
        got = run(q, k, v, s, dout)
        torch.cuda.synchronize()
    cpu = [None if x is None else x.cpu() for x in (q, k, v, s, dout)]
    lp, r32 = run(*cpu), run(*cpu, dtype=torch.float32)
    sink_err = None
    if sinks:  # as dsinks_ref_err: dsinks sums exp(sink - lse) * Delta over rows, Delta from each out
        def delta(out):
            return (cpu[4].float() * out.float()).sum(-1).transpose(1, 2) - dlse

        weight = torch.exp(cpu[3].float()[None, :, None] - r32[1])
        sink_err = float((weight * (delta(lp[0]) - delta(r32[0])).abs()).sum(dim=(0, 2)).max())
    fails = rule_failures("chunked", tuple(None if x is None else x.cpu() for x in got), lp, r32, sink_err)
    assert not fails, "\n".join(fails)


def test_chunked_packed_batch_vs_reference():
    """``attention_chunk`` over a packed batch with seqused (the grid's seed-4 structures: bf16
    d=128 causal): chunk sequences whose offsets the device computes, forward and backward,
    against the CPU path in float32 and bf16 with the flash-attn rule."""
    g = V(4, 128, 128, 8, 2, "causal", BF16, seqused=True)
    q, k, v, _, dout, cu_q, cu_k, uq, uk, mq, mk = make_batch(g)

    def run(q, k, v, dout, cu_q, cu_k, uq, uk, dtype=None):
        leaves = [x.detach().clone().to(dtype or x.dtype).requires_grad_(True) for x in (q, k, v)]
        out, lse = flash_attn_varlen_func(*leaves, cu_q, cu_k, mq, mk, causal=True, seqused_q=uq, seqused_k=uk,
                                          attention_chunk=200, return_lse=True)
        torch.autograd.backward([out], [dout.to(out.dtype)])
        return (out.detach(), lse.detach()) + tuple(x.grad for x in leaves) + (None,)

    with debug.poison():
        got = run(q, k, v, dout, cu_q, cu_k, uq, uk)
        torch.cuda.synchronize()
    cpu = [x.cpu() for x in (q, k, v, dout, cu_q, cu_k, uq, uk)]
    lp, r32 = run(*cpu), run(*cpu, dtype=torch.float32)
    fails = rule_failures("chunked packed", tuple(None if x is None else x.cpu() for x in got), lp, r32)
    fails += unused_failures(got, cu_q, cu_k, uq, uk)
    assert not fails, "\n".join(fails)
