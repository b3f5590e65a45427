"""FLOP counts for attention, in flash-attn's convention (``design.md``, Performance method).

Forward: two GEMMs per visible (query, key) pair, ``2 * B * H * pairs * (D + Dv)`` FLOPs
(``4 * B * H * Sq * Sk * D`` for full attention with ``Dv == D``).  Backward counts 2.5 times
the forward, forward+backward 3.5 times.  ``pairs`` is the exact number of visible (i, j)
pairs under the mask (causal is bottom-right aligned, ``off = seqlen_k - seqlen_q``; row i sees
key j when ``i + off - left <= j <= i + off + right``), so causal is "half" the keys plus the
diagonal, and sliding windows count only what they show.
"""

from __future__ import annotations

from .interface import normalize_window

MODES = ("fwd", "bwd", "fwdbwd")
# FLOPs per unit of B * H * pairs * (D + Dv): forward 2, backward 2.5 x 2, fwd+bwd 3.5 x 2.
_UNITS = {"fwd": 2, "bwd": 5, "fwdbwd": 7}


def _clamped_row_sum(start: int, rows: int, hi: int) -> int:
    """``sum(min(max(start + i, 0), hi) for i in range(rows))`` in closed form."""
    first, last = start, start + rows - 1
    total = 0
    lo_t, hi_t = max(first, 1), min(last, hi)  # terms that are neither clamped to 0 nor to hi
    if hi_t >= lo_t:
        total += (lo_t + hi_t) * (hi_t - lo_t + 1) // 2
    lo_cap = max(first, hi + 1)  # terms clamped to hi
    if last >= lo_cap:
        total += hi * (last - lo_cap + 1)
    return total


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1), chunk: int = 0) -> int:
    """Exact count of (query, key) pairs the mask lets through, for any lengths and window
    (``chunk`` > 0: chunked attention, the sum over ``chunked.chunk_lengths``' sequences, each
    with the same rule).

    Row i sees keys ``[max(lo_i, 0), min(hi_i, seqlen_k - 1)]`` with ``lo_i = i + off - left``
    and ``hi_i = i + off + right``; since ``lo_i <= hi_i + 1`` its count is
    ``clamp(hi_i + 1, 0, Sk) - clamp(lo_i, 0, Sk)``, and each of the two sums over i is an
    arithmetic series cut at 0 and Sk.
    """
    if seqlen_q < 0 or seqlen_k < 0:
        raise ValueError(f"visible_pairs: lengths must be >= 0, got {seqlen_q}, {seqlen_k}")
    if chunk and seqlen_q:
        from .chunked import chunk_lengths

        return sum(visible_pairs(nq, nk, causal, window_size) for nq, nk in zip(*chunk_lengths(seqlen_q, seqlen_k, chunk)))
    left, right = normalize_window(causal, window_size)
    off = seqlen_k - seqlen_q
    upper = seqlen_q * seqlen_k if right < 0 else _clamped_row_sum(off + right + 1, seqlen_q, seqlen_k)
    lower = 0 if left < 0 else _clamped_row_sum(off - left, seqlen_q, seqlen_k)
    return upper - lower


def attention_flops(
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    headdim: int,
    headdim_v: int | None = None,
    causal: bool = False,
    window_size=(-1, -1),
    mode: str = "fwd",
    chunk: int = 0,
) -> int:
    """FLOPs of one attention call (``mode`` in ``fwd``, ``bwd``, ``fwdbwd``); an exact int."""
    if mode not in _UNITS:
        raise ValueError(f"attention_flops: mode must be one of {MODES}, got {mode!r}")
    headdim_v = headdim if headdim_v is None else headdim_v
    pairs = visible_pairs(seqlen_q, seqlen_k, causal, window_size, chunk)
    return _UNITS[mode] * batch * nheads * pairs * (headdim + headdim_v)
