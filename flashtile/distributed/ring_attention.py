"""Ring attention (context parallelism): exact attention over a sequence sharded across ranks.

Every rank holds a shard of q, k and v along the sequence (``zigzag.py`` says which rows).  The
K/V shards travel around the ring (rank r sends to r + 1 and receives from r - 1) while each
rank attends its queries to the K/V block it holds; the next block is already in flight
(``transport.py``: NCCL / gloo point-to-point, or the GPUs' copy engines as an experimental
option; on a side CUDA stream on GPUs) while the current one is computed.
Partial outputs are merged exactly by their log-sum-exp.

Per ring step the (query shard, key shard) pair is cut into *pieces*: rectangles of local rows
and columns with one (left, right) window in the kernels' bottom-right-aligned convention that
reproduces the global mask exactly (``plan``).  Keys and queries no mask lets through are not
computed at all: with zigzag + causal a step is one call (step 0: local causal; key shard from
an earlier rank: all queries vs the first half of the keys; from a later rank: the second half
of the queries vs all keys), as in flash-attn's zigzag ring.

Backward (flash-attn's ring backward): K/V go around the ring again; every per-step backward
uses the global (merged) out and lse restricted to the step's rows, so its probabilities are the
global ones; dK/dV accumulators (float32, float64 for float64 inputs) travel around the ring
with the K/V they belong to and arrive at their owner after the last step.

Sinks are never given to the per-step kernels: a sink takes softmax mass once per row, so it is
folded in after the merge (``lse = logaddexp(lse, sink)``, ``out *= exp(lse_old - lse)``) and
its gradient ``-sum exp(sink - lse) * Delta`` is all-reduced over the ranks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops as _ops  # registers torch.ops.flashtile.*
from ..interface import normalize_window, validate
from ..reference import accum_dtype
from . import transport
from .zigzag import LAYOUTS, segments

# --- which (rows, keys, window) to compute per ring step ---------------------------------------


@dataclass(frozen=True)
class Piece:
    """Local query rows [q0, q1) against local keys [k0, k1) with kernel window (left, right)."""

    q0: int
    q1: int
    k0: int
    k1: int
    left: int
    right: int


def _pair_piece(qseg, kseg, left: int, right: int) -> Optional[Piece]:
    """The part of one (query segment, key segment) pair the global window can see.

    Segments are ``(local_start, global_start, length)``; the global mask is
    ``i - left <= j <= i + right`` (query i, key j; -1 = unbounded side).  The rectangle is
    trimmed to the rows and keys that see / are seen by something; then its bottom-right corner
    is visible, so the equivalent kernel window (shifted by that corner's diagonal offset) has
    both entries >= 0 and is exact.
    """
    ql, qs, nq = qseg
    kl, ks, nk = kseg
    qe, ke = qs + nq - 1, ks + nk - 1  # inclusive global bounds
    qs2 = qs if right < 0 else max(qs, ks - right)
    qe2 = qe if left < 0 else min(qe, ke + left)
    ks2 = ks if left < 0 else max(ks, qs - left)
    ke2 = ke if right < 0 else min(ke, qe + right)
    if qs2 > qe2 or ks2 > ke2:
        return None
    lq, lk = qe2 - qs2 + 1, ke2 - ks2 + 1
    d = qe2 - ke2  # the global diagonal offset of the trimmed rectangle's bottom-right corner
    wl = -1 if left < 0 else left - d
    wr = -1 if right < 0 else right + d
    assert wl >= -1 and wr >= -1 and (left < 0 or wl >= 0) and (right < 0 or wr >= 0)
    if (wr < 0 or wr >= lq - 1) and (wl < 0 or wl >= lk - 1):
        wl = wr = -1  # nothing masked inside the rectangle
    return Piece(ql + qs2 - qs, ql + qe2 - qs + 1, kl + ks2 - ks, kl + ke2 - ks + 1, wl, wr)


def _merge_full(pieces: list[Piece]) -> list[Piece]:
    """Fuse unmasked pieces that share their rows (adjacent keys) or keys (adjacent rows)."""
    changed = True
    while changed:
        changed = False
        for a in range(len(pieces)):
            for b in range(len(pieces)):
                pa, pb = pieces[a], pieces[b]
                if a == b or (pa.left, pa.right, pb.left, pb.right) != (-1, -1, -1, -1):
                    continue
                fused = None
                if (pa.q0, pa.q1) == (pb.q0, pb.q1) and pa.k1 == pb.k0:
                    fused = Piece(pa.q0, pa.q1, pa.k0, pb.k1, -1, -1)
                elif (pa.k0, pa.k1) == (pb.k0, pb.k1) and pa.q1 == pb.q0:
                    fused = Piece(pa.q0, pb.q1, pa.k0, pa.k1, -1, -1)
                if fused is not None:
                    pieces = [p for i, p in enumerate(pieces) if i not in (a, b)] + [fused]
                    changed = True
                    break
            if changed:
                break
    return sorted(pieces, key=lambda p: (p.q0, p.k0))


def _true_rows(qsegs, ksegs, n: int, left: int, right: int):
    """Per local row: the visible local keys as one interval [lo, hi] (empty: lo > hi), or None
    if some row's visible keys are not one contiguous local interval."""
    rows = torch.cat([torch.arange(g, g + m) for _, g, m in qsegs])
    lo = torch.full((n,), n, dtype=torch.long)
    hi = torch.full((n,), -1, dtype=torch.long)
    for kl, ks, nk in ksegs:
        a = torch.full_like(rows, ks) if left < 0 else torch.clamp(rows - left, min=ks)
        b = torch.full_like(rows, ks + nk - 1) if right < 0 else torch.clamp(rows + right, max=ks + nk - 1)
        ok = a <= b
        a, b = a - ks + kl, b - ks + kl
        both = ok & (lo <= hi)
        if bool((both & (a != hi + 1) & (b + 1 != lo)).any()):
            return None  # two visible key runs that are not adjacent locally
        lo = torch.where(ok, torch.minimum(lo, a), lo)
        hi = torch.where(ok, torch.maximum(hi, b), hi)
    return lo, hi


def _window_rows(n: int, wl: int, wr: int):
    """Per row of an n x n kernel call with window (wl, wr): visible keys [lo, hi]."""
    r = torch.arange(n)
    lo = torch.zeros(n, dtype=torch.long) if wl < 0 else torch.clamp(r - wl, min=0)
    hi = torch.full((n,), n - 1, dtype=torch.long) if wr < 0 else torch.clamp(r + wr, max=n - 1)
    return lo, hi


@functools.lru_cache(maxsize=4096)
def plan(seqlen_local: int, world_size: int, rank: int, src: int, layout: str, left: int, right: int) -> tuple[Piece, ...]:
    """Kernel calls that compute rank ``rank``'s queries against rank ``src``'s keys exactly.

    ``left``/``right`` is the global window (causal: right = 0; -1 unbounded).  First tries one
    call over the whole local rectangle (no mask, or the global window itself, which is exact
    for the step where q and k are the same shard); this is checked row by row, so it is used
    only where it is exactly the global mask.  Otherwise one piece per visible
    (query segment, key segment) pair, unmasked neighbours fused.
    """
    n = seqlen_local
    qsegs = segments(n, world_size, rank, layout)
    ksegs = segments(n, world_size, src, layout)
    if n == 0:
        return ()
    truth = _true_rows(qsegs, ksegs, n, left, right)
    if truth is not None:
        lo, hi = truth
        empty = lo > hi
        if bool(empty.all()):
            return ()
        for wl, wr in ((-1, -1), (left, right)):
            clo, chi = _window_rows(n, wl, wr)
            cempty = clo > chi
            if bool((empty == cempty).all()) and bool(((lo == clo) & (hi == chi) | empty).all()):
                return (Piece(0, n, 0, n, wl, wr),)
    pieces = [p for qs in qsegs for ks in ksegs if (p := _pair_piece(qs, ks, left, right)) is not None]
    return tuple(_merge_full(pieces))


# --- the per-step primitives ------------------------------------------------------------------


def _step_fwd(q, k, v, scale, left, right, softcap, deterministic):
    """``torch.ops.flashtile.fwd`` without sinks.  Plain eager calls take the same implementation
    without the custom-op dispatcher (as ``flashtile.ops.attention`` does): tens of microseconds
    less per call, and no import of torch._dynamo on first use.  They also share the SMs
    (``share_sms``): the next K/V block's transfer runs beside this call, and NCCL's kernels
    need SMs that a persistent schedule would hold until the call ends (4x H200, 128k causal
    d=128: ring forward 78-86 -> 69 ms, NOTES, twenty-sixth session)."""
    if q.device.type in ("cpu", "cuda") and _ops._plain_eager(q, k, v):
        return _ops._fwd_impl(q, k, v, None, scale, left, right, softcap, share_sms=True)
    return torch.ops.flashtile.fwd(q, k, v, None, scale, left, right, softcap, deterministic)


def _step_bwd(dout, dlse, q, k, v, out, lse, scale, left, right, softcap, deterministic):
    """``torch.ops.flashtile.bwd`` without sinks -> (dq, dk, dv); same fast path (and SM sharing)
    as above."""
    with torch.no_grad():
        if q.device.type in ("cpu", "cuda") and _ops.fast_eager(q.device, dout, dlse, q, k, v, out, lse):
            dq, dk, dv, _ = _ops._bwd_impl(dout, dlse, q, k, v, out, lse, None, scale, left, right, softcap, deterministic,
                                           share_sms=True)
        else:
            dq, dk, dv, _ = _ops.attention_bwd(dout, dlse, q, k, v, out, lse, None, scale, left, right, softcap, deterministic)
    return dq, dk, dv


def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("ring_flash_attn_func: a group was given but torch.distributed is not initialized")
        return None, 0, 1
    return group, dist.get_rank(group), dist.get_world_size(group)


def _merge_into(out_acc: Tensor, lse_acc: Tensor, out_p: Tensor, lse_p: Tensor) -> None:
    """In place: (out_acc, lse_acc) <- exact softmax merge with a partial (out_p, lse_p).

    Weights exp(lse_x - lse_new) lie in [0, 1]; rows where both are -inf stay 0 / -inf.
    Dense: out (B, S, H, D), lse (B, H, S); packed: out (T, H, D), lse (H, T).
    """
    lse_p = lse_p.to(lse_acc.dtype)
    new = torch.logaddexp(lse_acc, lse_p)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    # The two weights sum to 1, so out_acc + w_new (out_p - out_acc) is the merge: one pass over
    # the float32 accumulator instead of three (4x H200, 128k over 4 ranks: a whole-shard merge
    # 1.8 -> 1.0-1.2 ms beside a 15 ms step kernel).  w_new = 1 gives out_p exactly, 0 leaves out_acc.
    w_new = torch.exp(lse_p - safe).transpose(-1, -2).unsqueeze(-1)
    out_acc.lerp_(out_p.to(out_acc.dtype), w_new)
    lse_acc.copy_(new)


def _ring_forward(q, k, v, sinks, group, rank, world, scale, left, right, softcap, deterministic, layout):
    b, n, h, _ = q.shape
    acc = accum_dtype(q.dtype)
    ring = transport.ring(group, rank, world, 0, q.device) if world > 1 else None
    out_acc = lse_acc = None
    kk, vv = k, v
    for step in range(world):
        if step + 1 < world:
            nxt = ring.start([kk, vv], (0, 1))
        src = (rank - step) % world
        for p in plan(n, world, rank, src, layout, left, right):
            o, l = _step_fwd(
                q[:, p.q0 : p.q1], kk[:, p.k0 : p.k1], vv[:, p.k0 : p.k1], scale, p.left, p.right, softcap, deterministic
            )
            if out_acc is None and (p.q0, p.q1) == (0, n):
                out_acc, lse_acc = o.to(acc), l.to(acc)
                continue
            if out_acc is None:
                out_acc = q.new_zeros(b, n, h, v.shape[-1], dtype=acc)
                lse_acc = q.new_full((b, h, n), -math.inf, dtype=acc)
            _merge_into(out_acc[:, p.q0 : p.q1], lse_acc[:, :, p.q0 : p.q1], o, l)
        if step + 1 < world:
            ring.wait()
            kk, vv = nxt
    if out_acc is None:  # only possible for an empty shard
        out_acc = q.new_zeros(b, n, h, v.shape[-1], dtype=acc)
        lse_acc = q.new_full((b, h, n), -math.inf, dtype=acc)
    if sinks is not None:
        out_acc, lse_acc = _fold_sinks(out_acc, lse_acc, sinks)
    return out_acc.to(q.dtype), lse_acc


def _fold_sinks(out_acc: Tensor, lse_acc: Tensor, sinks: Tensor):
    """A sink takes softmax mass once per row: lse <- logaddexp(lse, sink), out rescaled."""
    sink = sinks.to(lse_acc.dtype)[:, None]  # (H, 1): broadcasts over (B, H, S) and (H, T)
    lse_new = torch.logaddexp(lse_acc, sink)
    safe = torch.where(torch.isfinite(lse_new), lse_new, torch.zeros_like(lse_new))
    return out_acc * torch.exp(lse_acc - safe).transpose(-1, -2).unsqueeze(-1), lse_new


def _dsinks(dout, dlse, out, lse, sinks, group, world, acc):
    """-sum exp(sink - lse) * Delta over this rank's rows, all-reduced over the ring."""
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(-1, -2)  # lse's layout
    if dlse is not None:
        delta = delta - dlse.to(acc)
    finite = torch.isfinite(lse)
    sigma = torch.exp(sinks.to(acc)[:, None] - torch.where(finite, lse, torch.zeros_like(lse)))
    sigma = torch.where(finite, sigma, torch.zeros_like(sigma))
    dsinks = -(sigma * delta).sum(dim=-1)
    if dsinks.dim() == 2:
        dsinks = dsinks.sum(0)
    if world > 1:
        dist.all_reduce(dsinks, group=group)
    return dsinks.to(sinks.dtype)


def _ring_backward(dout, dlse, q, k, v, out, lse, sinks, group, rank, world, scale, left, right, softcap, deterministic, layout):
    n = q.shape[1]
    acc = accum_dtype(q.dtype)
    kv_ring = transport.ring(group, rank, world, 0, q.device) if world > 1 else None
    d_ring = transport.ring(group, rank, world, 1, q.device) if world > 1 else None
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    rows: dict = {}  # (q0, q1) -> the per-row tensors of those rows, sliced once

    def row_slices(p):
        key = (p.q0, p.q1)
        if key not in rows:
            rows[key] = (
                dout[:, p.q0 : p.q1],
                None if dlse is None else dlse[:, :, p.q0 : p.q1].contiguous(),
                q[:, p.q0 : p.q1],
                out[:, p.q0 : p.q1],
                lse[:, :, p.q0 : p.q1].contiguous(),
            )
        return rows[key]

    kk, vv = k, v
    d_next = None
    for step in range(world):
        if step + 1 < world:
            kv_next = kv_ring.start([kk, vv], (0, 1))
        src = (rank - step) % world
        dk_step = dv_step = None
        for p in plan(n, world, rank, src, layout, left, right):
            do_p, dlse_p, q_p, out_p, lse_p = row_slices(p)
            dq_p, dk_p, dv_p = _step_bwd(
                do_p, dlse_p, q_p, kk[:, p.k0 : p.k1], vv[:, p.k0 : p.k1], out_p, lse_p,
                scale, p.left, p.right, softcap, deterministic,
            )
            dq[:, p.q0 : p.q1] += dq_p
            if dk_step is None and (p.k0, p.k1) == (0, n):
                dk_step, dv_step = dk_p.to(acc), dv_p.to(acc)
                continue
            if dk_step is None:
                dk_step = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_step = torch.zeros(v.shape, dtype=acc, device=v.device)
            dk_step[:, p.k0 : p.k1] += dk_p
            dv_step[:, p.k0 : p.k1] += dv_p
        if dk_step is None:  # nothing of this K/V block is visible to this rank
            dk_step = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_step = torch.zeros(v.shape, dtype=acc, device=v.device)
        if world == 1:
            d_next = (dk_step, dv_step)
            break
        d_next = _pass_kv_grads(step, d_ring, d_next, dk_step, dv_step)
        if step + 1 < world:
            kv_ring.wait()
            kk, vv = kv_next
    return _backward_result(q, k, v, dq, d_ring, d_next, world, dout, dlse, out, lse, sinks, group, acc)


def _pass_kv_grads(step, d_ring, d_next, dk_step, dv_step):
    """One hop of the dK/dV ring: add what arrived for this step's K/V block (step > 0) and
    send the sum on.  These accumulators belong to the K/V block this rank just used; the next
    rank holds that block next step (after the last step, the block's owner does)."""
    if step > 0:
        d_ring.wait()
        dk_step += d_next[0]
        dv_step += d_next[1]
    return d_ring.start([dk_step, dv_step], (2, 3))


def _backward_result(q, k, v, dq, d_ring, d_next, world, dout, dlse, out, lse, sinks, group, acc):
    """Wait for the last hop of the dK/dV ring, reduce dsinks, cast to the inputs' dtypes."""
    if world > 1:
        d_ring.wait()
    dk, dv = d_next
    dsinks = None if sinks is None else _dsinks(dout, dlse, out, lse, sinks, group, world, acc)
    # copy=True: dk / dv may be the copy-engine ring's pool buffers, reused by the next call
    return dq.to(q.dtype), dk.to(k.dtype, copy=True), dv.to(v.dtype, copy=True), dsinks


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, scale, left, right, softcap, deterministic, layout):
        group, rank, world = _group_info(group)
        out, lse = _ring_forward(q, k, v, sinks, group, rank, world, scale, left, right, softcap, deterministic, layout)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, rank, world, scale, left, right, softcap, deterministic, layout)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        grads = _ring_backward(dout, dlse, q, k, v, out, lse, sinks, *ctx.args)
        dq, dk, dv, dsinks = grads
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None


def ring_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group=None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    sinks: Optional[Tensor] = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    layout: str = "zigzag",
):
    """Exact attention over a sequence sharded across the ranks of ``group`` (ring attention).

    Args:
        q: (batch, seqlen_local, nheads, headdim): this rank's shard of the queries.
        k: (batch, seqlen_local, nheads_kv, headdim); v: (batch, seqlen_local, nheads_kv,
            headdim_v): this rank's shards of the keys and values (same rows as q).
        group: the process group (default: the world); every rank of it must call this.
        layout: ``"zigzag"`` (rank r holds global chunks r and 2W-1-r of 2W; balanced for
            causal) or ``"contiguous"`` (rank r holds the r-th of W slices).  Use
            ``flashtile.distributed.shard`` to cut a full tensor this way.
        softmax_scale, causal, window_size, sinks, softcap, deterministic, return_lse: as in
            ``flashtile.flash_attn_func``, applied to the *global* sequence (seqlen_q ==
            seqlen_k, so causal is the plain lower triangle).

    Returns:
        out (batch, seqlen_local, nheads, headdim_v), or ``(out, lse)`` with lse this rank's
        (batch, nheads, seqlen_local) float32 shard (sink included).  q, k, v get their
        shard's gradients; sinks' gradient is the full one (all-reduced over the group), on
        every rank.
    """
    from .. import validation as V

    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_lse", return_lse)):
        V.check_flag("ring_flash_attn_func", name, flag)
    validate(q, k, v, softmax_scale, window_size, sinks, softcap, fn="ring_flash_attn_func")
    if k.shape[1] != q.shape[1]:
        raise ValueError(
            f"ring_flash_attn_func: k and v must hold the same sequence shard as q (seqlen_local {q.shape[1]}), got {k.shape[1]}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"ring_flash_attn_func: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"ring_flash_attn_func: layout 'zigzag' needs an even seqlen_local, got {q.shape[1]}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    left, right = normalize_window(causal, window_size)
    out, lse = _RingAttention.apply(
        q, k, v, sinks, group, float(softmax_scale), left, right, float(softcap), bool(deterministic), layout
    )
    return (out, lse) if return_lse else out


# --- packed (varlen) sequences -----------------------------------------------------------------
#
# Every packed sequence is sharded on its own with the same layout (zigzag: each sequence cut
# into 2W chunks, rank r holds chunks r and 2W-1-r of every sequence), so all sequences of a
# ring step share one plan, in units of half a local sequence (zigzag) or a whole one
# (contiguous).  A piece that is not whole sequences gathers its rows into a packed copy.


def _varlen_unit(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


_CANON = 8  # a local length long enough that no masked piece degenerates to a single row


@functools.lru_cache(maxsize=1024)
def _varlen_plan(world: int, rank: int, src: int, layout: str, left: int, right: int) -> tuple[Piece, ...]:
    """``plan`` in units of 1 / ``_varlen_unit`` of every local sequence.  For causal or full
    attention the plan of any local length is the same up to scale (a test checks it), so it is
    computed once at a canonical length and its boundaries expressed in units."""
    unit = _varlen_unit(layout)
    step = _CANON // unit
    pieces = plan(_CANON, world, rank, src, layout, left, right)
    assert all(b % step == 0 for p in pieces for b in (p.q0, p.q1, p.k0, p.k1)), pieces
    return tuple(Piece(p.q0 // step, p.q1 // step, p.k0 // step, p.k1 // step, p.left, p.right) for p in pieces)


class _PackedRows:
    """Rows [a, b) (in units) of every local sequence: gather index, cu_seqlens, max length."""

    def __init__(self, lens: list[int], unit: int, device):
        self.lens, self.unit, self.device = lens, unit, device
        self.starts = [0]
        for n in lens:
            self.starts.append(self.starts[-1] + n)
        self._cache: dict = {}

    def __call__(self, a: int, b: int):
        if (a, b) not in self._cache:
            parts, cu = [], [0]
            for s, n in zip(self.starts, self.lens):
                lo, hi = s + a * n // self.unit, s + b * n // self.unit
                parts.append(torch.arange(lo, hi))
                cu.append(cu[-1] + hi - lo)
            whole = (a, b) == (0, self.unit)
            idx = None if whole else torch.cat(parts).to(self.device)
            mx = max((b - a) * n // self.unit for n in self.lens) if self.lens else 0
            self._cache[(a, b)] = (idx, torch.tensor(cu, dtype=torch.int32, device=self.device), mx)
        return self._cache[(a, b)]


def _take(x: Tensor, idx: Optional[Tensor], dim: int = 0) -> Tensor:
    return x if idx is None else x.index_select(dim, idx)


def _varlen_opts(cu_q, cu_k, mq, mk, scale, left, right, softcap, deterministic):
    from ..varlen import Options

    return Options(cu_q, cu_k, None, None, mq, mk, None, scale, left, right, softcap, deterministic)


def _varlen_step_fwd(q, k, v, o):
    from .. import varlen

    if q.device.type in ("cpu", "cuda") and _ops._plain_eager(q, k, v):
        return varlen._fwd_impl(q, k, v, o, share_sms=True)  # as _step_fwd
    return torch.ops.flashtile.varlen_fwd(q, k, v, *o)


def _varlen_step_bwd(dout, dlse, q, k, v, out, lse, o):
    from .. import varlen

    with torch.no_grad():
        if q.device.type in ("cpu", "cuda") and _ops._plain_eager(dout, dlse, q, k, v, out, lse):
            dq, dk, dv, _ = varlen._bwd_impl(dout, dlse, q, k, v, out, lse, o, share_sms=True)
        else:
            dq, dk, dv, _ = torch.ops.flashtile.varlen_bwd(dout, dlse, q, k, v, out, lse, *o)
    return dq, dk, dv


def _varlen_ring_forward(q, k, v, sinks, lens, group, rank, world, scale, left, right, softcap, deterministic, layout):
    t, h, _ = q.shape
    acc = accum_dtype(q.dtype)
    rows = _PackedRows(lens, _varlen_unit(layout), q.device)
    ring = transport.ring(group, rank, world, 0, q.device) if world > 1 else None
    out_acc = q.new_zeros(t, h, v.shape[-1], dtype=acc)
    lse_acc = q.new_full((h, t), -math.inf, dtype=acc)
    kk, vv = k, v
    for step in range(world):
        if step + 1 < world:
            nxt = ring.start([kk, vv], (0, 1))
        src = (rank - step) % world
        for p in _varlen_plan(world, rank, src, layout, left, right):
            qi, cu_q, mq = rows(p.q0, p.q1)
            ki, cu_k, mk = rows(p.k0, p.k1)
            o = _varlen_opts(cu_q, cu_k, mq, mk, scale, p.left, p.right, softcap, deterministic)
            out_p, lse_p = _varlen_step_fwd(_take(q, qi), _take(kk, ki), _take(vv, ki), o)
            if qi is None:
                _merge_into(out_acc, lse_acc, out_p, lse_p)
            else:
                sub_o, sub_l = out_acc.index_select(0, qi), lse_acc.index_select(1, qi)
                _merge_into(sub_o, sub_l, out_p, lse_p)
                out_acc.index_copy_(0, qi, sub_o)
                lse_acc.index_copy_(1, qi, sub_l)
        if step + 1 < world:
            ring.wait()
            kk, vv = nxt
    if sinks is not None:
        out_acc, lse_acc = _fold_sinks(out_acc, lse_acc, sinks)
    return out_acc.to(q.dtype), lse_acc


def _varlen_ring_backward(dout, dlse, q, k, v, out, lse, sinks, lens, group, rank, world, scale, left, right, softcap, deterministic, layout):
    acc = accum_dtype(q.dtype)
    rows = _PackedRows(lens, _varlen_unit(layout), q.device)
    kv_ring = transport.ring(group, rank, world, 0, q.device) if world > 1 else None
    d_ring = transport.ring(group, rank, world, 1, q.device) if world > 1 else None
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kk, vv = k, v
    d_next = None
    for step in range(world):
        if step + 1 < world:
            kv_next = kv_ring.start([kk, vv], (0, 1))
        src = (rank - step) % world
        dk_step = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv_step = torch.zeros(v.shape, dtype=acc, device=v.device)
        for p in _varlen_plan(world, rank, src, layout, left, right):
            qi, cu_q, mq = rows(p.q0, p.q1)
            ki, cu_k, mk = rows(p.k0, p.k1)
            o = _varlen_opts(cu_q, cu_k, mq, mk, scale, p.left, p.right, softcap, deterministic)
            dq_p, dk_p, dv_p = _varlen_step_bwd(
                _take(dout, qi), None if dlse is None else _take(dlse, qi, 1).contiguous(), _take(q, qi),
                _take(kk, ki), _take(vv, ki), _take(out, qi), _take(lse, qi, 1).contiguous(), o,
            )
            for acc_t, g, idx in ((dq, dq_p, qi), (dk_step, dk_p, ki), (dv_step, dv_p, ki)):
                if idx is None:
                    acc_t += g
                else:
                    acc_t.index_add_(0, idx, g.to(acc))
        if world == 1:
            d_next = (dk_step, dv_step)
            break
        d_next = _pass_kv_grads(step, d_ring, d_next, dk_step, dv_step)
        if step + 1 < world:
            kv_ring.wait()
            kk, vv = kv_next
    return _backward_result(q, k, v, dq, d_ring, d_next, world, dout, dlse, out, lse, sinks, group, acc)


class _RingVarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, lens, group, scale, left, right, softcap, deterministic, layout):
        group, rank, world = _group_info(group)
        args = (lens, group, rank, world, scale, left, right, softcap, deterministic, layout)
        out, lse = _varlen_ring_forward(q, k, v, sinks, *args)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = args
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv, dsinks = _varlen_ring_backward(dout, dlse, q, k, v, out, lse, sinks, *ctx.args)
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None, None


def ring_flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    group=None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    sinks: Optional[Tensor] = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    layout: str = "zigzag",
):
    """Ring attention over packed sequences: every sequence sharded across the ranks.

    Args:
        q: (total_local, nheads, headdim), k: (total_local, nheads_kv, headdim), v:
            (total_local, nheads_kv, headdim_v): this rank's shard of every packed sequence,
            back to back (``flashtile.distributed.shard_varlen`` cuts them).
        cu_seqlens: int32 (batch + 1,): the *local* cumulative lengths (every sequence's
            global length / world size; the same on every rank).  Zigzag needs even local
            lengths.  max_seqlen: the largest local length.
        causal, window_size: causal or full attention per sequence; sliding windows are not
            supported here yet (``NotImplementedError``).
        Other arguments as in ``ring_flash_attn_func``.

    Returns:
        out (total_local, nheads, headdim_v), or ``(out, lse)`` with lse (nheads, total_local).
    """
    from .. import validation as V
    from .. import varlen

    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_lse", return_lse)):
        V.check_flag("ring_flash_attn_varlen_func", name, flag)
    varlen.validate(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, window_size, softcap, sinks, None, None)
    if layout not in LAYOUTS:
        raise ValueError(f"ring_flash_attn_varlen_func: layout must be one of {LAYOUTS}, got {layout!r}")
    left, right = normalize_window(causal, window_size)
    if left != -1 or right not in (-1, 0):
        raise NotImplementedError(
            f"ring_flash_attn_varlen_func: sliding windows are not supported yet (window_size={tuple(window_size)}); "
            "use causal or full attention, or ring_flash_attn_func for one sequence"
        )
    lens = [int(b) - int(a) for a, b in zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:])]
    if sum(lens) != q.shape[0]:
        raise ValueError(f"ring_flash_attn_varlen_func: cu_seqlens[-1] must be total_local = {q.shape[0]}, got {sum(lens)}")
    unit = _varlen_unit(layout)
    if any(n % unit for n in lens):
        raise ValueError(f"ring_flash_attn_varlen_func: layout 'zigzag' needs even local sequence lengths, got {lens}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = _RingVarlenAttention.apply(
        q, k, v, sinks, lens, group, float(softmax_scale), left, right, float(softcap), bool(deterministic), layout
    )
    return (out, lse) if return_lse else out
