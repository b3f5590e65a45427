"""Exact attention in plain PyTorch: the CPU path and the oracle for every kernel test.

Both passes walk over query chunks, so memory holds one ``(batch, nheads, chunk, seqlen_k)``
score block at a time instead of the whole ``seqlen_q x seqlen_k`` matrix.  Arithmetic runs in
float32 for half-precision and float32 inputs and in float64 for float64 inputs.

The backward pass is written out by hand (not recorded by autograd) for the same reason: it
recomputes each chunk's probabilities from the saved log-sum-exp, exactly like the kernels do,
so a CPU user can train at seqlen 16k.  ``tests/test_reference.py`` checks both passes against
an independent full-matrix float64 computation and ``torch.autograd.gradcheck``.

Semantics (``design.md``), with query row ``i``, key column ``j`` and ``off = seqlen_k - seqlen_q``:
key ``j`` is visible to row ``i`` when ``j <= i + off + right`` (right >= 0) and
``j >= i + off - left`` (left >= 0); ``-1`` leaves that side unbounded.  With
``attention_chunk`` C > 0 also ``(i + off) // C == j // C`` (``flashtile/chunked.py``).
"""

from __future__ import annotations

import math

import torch

# Rows of queries per chunk; chosen so that a (1, 32, CHUNK, 16384) fp32 score block is 256 MiB.
DEFAULT_CHUNK = 128


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def visible_mask(rows: torch.Tensor, seqlen_k: int, seqlen_q: int, window: tuple[int, int],
                 attention_chunk: int = 0) -> torch.Tensor | None:
    """Boolean ``(len(rows), seqlen_k)`` mask of visible keys, or None when every key is visible.

    ``rows`` are absolute query indices.  Causal is expressed as ``window = (left, 0)``;
    ``attention_chunk`` > 0 keeps each row to its own chunk of keys.
    """
    left, right = window
    if left < 0 and right < 0 and not attention_chunk:
        return None
    off = seqlen_k - seqlen_q
    cols = torch.arange(seqlen_k, device=rows.device)
    diag = (rows + off)[:, None]
    vis = torch.ones(rows.numel(), seqlen_k, dtype=torch.bool, device=rows.device)
    if right >= 0:
        vis &= cols[None, :] <= diag + right
    if left >= 0:
        vis &= cols[None, :] >= diag - left
    if attention_chunk:
        vis &= torch.div(cols[None, :], attention_chunk, rounding_mode="floor") == \
            torch.div(diag, attention_chunk, rounding_mode="floor")
    return vis


def _group(q: torch.Tensor, nheads_kv: int) -> torch.Tensor:
    """(b, s, h, d) -> (b, s, h_kv, g, d): query heads of one KV head side by side (no copy)."""
    b, s, h, d = q.shape
    return q.reshape(b, s, nheads_kv, h // nheads_kv, d)


def _chunk_scores(qc, k, scale, softcap, rows, seqlen_q, window, attention_chunk=0):
    """Scores of one query chunk, shape (b, h_kv, g, cq, sk), masked entries -inf.

    Returns ``(scores, capped_tanh)`` where ``capped_tanh`` is tanh(raw / softcap) (needed for
    softcap's derivative) or None.
    """
    s = torch.einsum("bqhgd,bkhd->bhgqk", qc, k) * scale
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    vis = visible_mask(rows, k.shape[1], seqlen_q, window, attention_chunk)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    return s, t


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    chunk: int = DEFAULT_CHUNK,
    round_p=None,
    attention_chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference forward.

    Args:
        q: (batch, seqlen_q, nheads, headdim); k: (batch, seqlen_k, nheads_kv, headdim);
        v: (batch, seqlen_k, nheads_kv, headdim_v); sinks: (nheads,) logits or None.
        window: (left, right) after causal has been folded in (causal == right 0).
        round_p: None, or a function applied to the weights ``exp(s - row max)`` (in (0, 1])
            before they multiply V (the normaliser stays unrounded): the FP8 accuracy baseline
            rounds them as the FP8 kernel rounds P (``tests/test_gpu_fp8.py``).
        attention_chunk: > 0: chunked local attention (the module docstring), in the mask.
    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype and
        lse (batch, nheads, seqlen_q) float32 (float64 for float64 input), natural log.
    """
    acc = accum_dtype(q.dtype)
    b, sq, h, _ = q.shape
    hkv = k.shape[2]
    kf, vf = k.to(acc), v.to(acc)
    sink = None if sinks is None else sinks.to(acc).reshape(1, hkv, h // hkv, 1)
    outs, lses = [], []
    for start in range(0, sq, chunk):
        rows = torch.arange(start, min(start + chunk, sq), device=q.device)
        qc = _group(q[:, start : start + chunk].to(acc), hkv)
        s, _ = _chunk_scores(qc, kf, softmax_scale, softcap, rows, sq, window, attention_chunk)
        m = s.amax(dim=-1) if s.shape[-1] else s.new_full(s.shape[:-1], float("-inf"))
        if sink is not None:
            m = torch.maximum(m, sink)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully masked rows: avoid inf - inf
        e = torch.exp(s - m[..., None])
        l = e.sum(dim=-1)
        if sink is not None:
            l = l + torch.exp(sink - m)
        lse = torch.log(l) + m  # l == 0 gives -inf, as the contract asks
        p = (e if round_p is None else round_p(e)) / torch.where(l > 0, l, torch.ones_like(l))[..., None]
        o = torch.einsum("bhgqk,bkhd->bqhgd", p, vf)
        outs.append(o.reshape(b, rows.numel(), h, v.shape[-1]))  # explicit sizes: any may be 0
        lses.append(lse.reshape(b, h, rows.numel()))
    out = torch.cat(outs, dim=1).to(q.dtype) if outs else q.new_zeros(b, 0, h, v.shape[-1])
    lse = torch.cat(lses, dim=2) if lses else q.new_zeros(b, h, 0, dtype=acc)
    return out, lse


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    dlse: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
    attention_chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reference backward from the saved ``out`` and ``lse``.

    ``dlse`` (batch, nheads, seqlen_q) is the incoming gradient of lse when the caller used it;
    since d lse_i / d s_ij = P_ij it enters as ``Delta_i - dlse_i``.
    Returns dq, dk, dv in the inputs' dtypes and dsinks (nheads,) in sinks' dtype (or None).
    """
    acc = accum_dtype(q.dtype)
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    kf, vf = k.to(acc), v.to(acc)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # (b, h, sq)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    dq = torch.zeros(b, sq, h, d, dtype=acc, device=q.device)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    lse = lse.to(acc)
    for start in range(0, sq, chunk):
        stop = min(start + chunk, sq)
        rows = torch.arange(start, stop, device=q.device)
        qc = _group(q[:, start:stop].to(acc), hkv)
        doc = _group(dout[:, start:stop].to(acc), hkv)
        s, t = _chunk_scores(qc, kf, softmax_scale, softcap, rows, sq, window, attention_chunk)
        lse_c = lse[:, :, start:stop].reshape(b, hkv, h // hkv, stop - start)[..., None]
        finite = torch.isfinite(lse_c)
        p = torch.where(finite, torch.exp(s - torch.where(finite, lse_c, torch.zeros_like(lse_c))), torch.zeros_like(s))
        dv += torch.einsum("bhgqk,bqhgd->bkhd", p, doc)
        dp = torch.einsum("bqhgd,bkhd->bhgqk", doc, vf)
        delta_c = delta[:, :, start:stop].reshape(b, hkv, h // hkv, stop - start)[..., None]
        ds = p * (dp - delta_c)
        if t is not None:
            ds = ds * (1 - t * t)
        ds = ds * softmax_scale
        dq[:, start:stop] = torch.einsum("bhgqk,bkhd->bqhgd", ds, kf).reshape(b, stop - start, h, d)
        dk += torch.einsum("bhgqk,bqhgd->bkhd", ds, qc)
    dsinks = None
    if sinks is not None:
        sink = sinks.to(acc)[None, :, None]
        # lse = -inf only when the row saw nothing and the sink is -inf too: no mass, no gradient
        # (exp(-inf - -inf) would be NaN).
        seen = torch.isfinite(lse)
        mass = torch.where(seen, torch.exp(sink - torch.where(seen, lse, torch.zeros_like(lse))), torch.zeros_like(lse))
        dsinks = (-(mass * delta)).sum(dim=(0, 2)).to(sinks.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


def default_scale(headdim: int) -> float:
    return 1.0 / math.sqrt(headdim)


# --- variable-length (packed) sequences ---------------------------------------------------------


def sequence_ranges(cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None) -> list[tuple[int, int, int, int]]:
    """``[(q_start, len_q, k_start, len_k), ...]`` per sequence of a packed batch (Python ints).

    ``len = seqused[b]`` when given (the first tokens of the segment), else the segment length
    ``cu_seqlens[b + 1] - cu_seqlens[b]``.  Reads the tensors' contents (a sync on CUDA).
    """
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    uq = None if seqused_q is None else seqused_q.tolist()
    uk = None if seqused_k is None else seqused_k.tolist()
    ranges = []
    for b in range(len(cq) - 1):
        len_q = cq[b + 1] - cq[b] if uq is None else uq[b]
        len_k = ck[b + 1] - ck[b] if uk is None else uk[b]
        ranges.append((cq[b], len_q, ck[b], len_k))
    return ranges


def varlen_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
    round_p=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference forward over packed sequences: ``attention_forward`` on each sequence's slice
    (``round_p`` as there).

    q: (total_q, nheads, d); k: (total_k, nheads_kv, d); v: (total_k, nheads_kv, d_v).
    Returns out (total_q, nheads, d_v) and lse (nheads, total_q) in ``accum_dtype``; query rows
    outside every used range (``seqused_q``) get out 0 and lse -inf.
    """
    total_q, h, _ = q.shape
    out = q.new_zeros(total_q, h, v.shape[-1])
    lse = torch.full((h, total_q), float("-inf"), dtype=accum_dtype(q.dtype), device=q.device)
    for qs, lq, ks, lk in sequence_ranges(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        if lq == 0:
            continue
        o, l = attention_forward(
            q[None, qs : qs + lq], k[None, ks : ks + lk], v[None, ks : ks + lk], softmax_scale, window, sinks, softcap, chunk,
            round_p,
        )
        out[qs : qs + lq] = o[0]
        lse[:, qs : qs + lq] = l[0]
    return out, lse


def varlen_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    dlse: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reference backward over packed sequences: ``attention_backward`` on each slice.

    ``dlse`` is (nheads, total_q) or None.  Rows and keys outside every used range get zero
    gradients.  Returns dq, dk, dv in the inputs' dtypes and dsinks (nheads,) or None.
    """
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    acc = accum_dtype(q.dtype)
    sinks_acc = None if sinks is None else sinks.to(acc)  # per-sequence dsinks summed in acc
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=acc, device=q.device)
    for qs, lq, ks, lk in sequence_ranges(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        if lq == 0:
            continue
        rows, keys = slice(qs, qs + lq), slice(ks, ks + lk)
        g = attention_backward(
            dout[None, rows], q[None, rows], k[None, keys], v[None, keys], out[None, rows], lse[None, :, rows],
            softmax_scale, window, sinks_acc, softcap, None if dlse is None else dlse[None, :, rows], chunk,
        )
        dq[rows], dk[keys], dv[keys] = g[0][0], g[1][0], g[2][0]
        if dsinks is not None:
            dsinks += g[3]
    return dq, dk, dv, None if dsinks is None else dsinks.to(sinks.dtype)


# --- KV-cache decoding (flash_attn_with_kvcache) ------------------------------------------------


def kvcache_gather(cache: torch.Tensor, b: int, start: int, stop: int, cache_batch_idx=None, block_table=None) -> torch.Tensor:
    """Rows ``[start, stop)`` of batch entry ``b``'s cache, (stop - start, nheads_kv, d).

    Contiguous cache (batch_cache, seqlen_cache, h, d): row ``cache_batch_idx[b]`` (or ``b``).
    Paged cache (num_blocks, page_size, h, d): position j lives at
    ``cache[block_table[b, j // page_size], j % page_size]``.
    """
    if block_table is None:
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        return cache[row, start:stop]
    pos = torch.arange(start, stop, device=cache.device)
    page = cache.shape[1]
    return cache[block_table[b].long()[pos // page], pos % page]


def kvcache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (batch, seqlen_q, nheads, d) over each entry's cache keys
    ``[cache_leftpad[b], seqlens_k[b])`` (after the append), bottom-right aligned on that length,
    by ``attention_forward`` per batch entry.  An FP8 cache comes with ``k_descale`` /
    ``v_descale`` (batch, nheads_kv) float32: entry b's keys are ``k8.float() * k_descale[b, j]``
    for kv head j (fp8.py's convention), dequantized here before the exact attention.  Returns
    out (batch, seqlen_q, nheads, d_v) and lse (batch, nheads, seqlen_q), as ``attention_forward``."""
    lens = seqlens_k.tolist()
    pads = [0] * q.shape[0] if cache_leftpad is None else cache_leftpad.tolist()
    acc = accum_dtype(q.dtype)
    outs, lses = [], []
    for b in range(q.shape[0]):
        kb = kvcache_gather(k_cache, b, pads[b], lens[b], cache_batch_idx, block_table)
        vb = kvcache_gather(v_cache, b, pads[b], lens[b], cache_batch_idx, block_table)
        if k_descale is not None:
            kb = kb.to(acc) * k_descale[b].to(acc)[None, :, None]
            vb = vb.to(acc) * v_descale[b].to(acc)[None, :, None]
        o, l = attention_forward(q[b : b + 1], kb[None], vb[None], softmax_scale, window, sinks, softcap)
        outs.append(o)
        lses.append(l)
    if not outs:  # batch 0
        b, sq, h, _ = q.shape
        return q.new_zeros(b, sq, h, v_cache.shape[-1]), q.new_zeros(b, h, sq, dtype=accum_dtype(q.dtype))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=0)
