"""Online softmax of the forward kernels, as TileLang macros shared by both schedules
(``fwd.attention_fwd_kernel`` and ``fwd_ws.attention_fwd_ws_kernel``).

Scores arrive raw (q.k in fp32); ``score_scale`` folds the softmax scale and log2(e) (or the
softcap and log2(e)) so the exponentials are ``exp2``.  Running statistics per query row:
``m`` the max raw score, ``l`` the sum of exp2 weights relative to ``m``; ``alpha`` rescales
what the output accumulator holds whenever ``m`` grows.
"""

from ..lazy import LazyAttributes
from .masks import block_fully_visible, visible

T = LazyAttributes("tilelang.language")  # imported by the first kernel build, not by the launcher (``lazy``)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# The scalar rules of the online softmax, one row at a time: the macros below apply them to
# fragments, ``warp_mma.py`` to its per-lane registers.


def scaled_max(m, score_scale):
    """The exp2 reference of a row whose raw max is ``m``: ``m * score_scale``, or 0 for a row
    that saw no visible key yet (m = -inf), so exp2 sees -inf - 0, not -inf - -inf."""
    return T.if_then_else(m == -T.infinity(T.float32), 0, m * score_scale)


def rescale_factor(m_prev, m, m_safe, score_scale):
    """The factor for what a row accumulated under max ``m_prev`` now that it is ``m``
    (``m_safe = scaled_max(m)``): exactly 1 when the max did not move.  As an FMA (m_prev *
    scale unrounded minus the rounded m_safe) the exponent is a rounding residual, not 0, and a
    row's l then depended on how many blocks it visited: the two overlapping first tiles of a
    bottom-aligned grid (``masks.query_tile``) wrote lse values 1 ulp apart, in either order
    (NOTES, tenth session).  The rescale skips (``fwd_ws.rescaler``, ``warp_mma``) rely on the 1."""
    return T.if_then_else(m_prev == m, 1.0, T.exp2(m_prev * score_scale - m_safe))


def natural_lse(l, top):
    """Natural-log log-sum-exp of a row whose exp2 weights, relative to ``top`` (log2 units),
    sum to ``l``; -inf for a row with no weight."""
    return T.if_then_else(l > 0, (T.log2(l) + top) * LN2, -T.infinity(T.float32))


# Columns of ``l`` when a thread keeps its own part of each row's sum (``online_softmax``'s
# ``defer_sum``): the WGMMA accumulator's column pattern repeats every 8 columns, and a thread
# holds 2 of each 8 (for each of its 2 rows of a warp's 16).
ROW_PARTS = 8


def row_weights(block_m: int, defer_sum: bool = False):
    """The fragment of the rows' weight sums ``l``: one per row, or with ``defer_sum`` a
    ``[block_m, ROW_PARTS]`` fragment of per-thread partial sums (``row_parts_layout``)."""
    return T.alloc_fragment([block_m, ROW_PARTS] if defer_sum else [block_m], T.float32)


def row_parts_layout(block_m: int):
    """``l``'s layout with ``defer_sum``: part (r, c) sits on the thread whose scores of row r
    are the columns c, c + 8, c + 16, ... of the WGMMA accumulator (warp r // 16 of the
    consumer warpgroups, lane (r % 8) * 4 + c // 2), so summing them needs no shuffle."""
    from tilelang import layout

    return layout.Fragment([block_m, ROW_PARTS], forward_thread_fn=lambda r, c: (r // 16) * 32 + (r % 8) * 4 + c // 2,
                           forward_index_fn=lambda r, c: (r % 16) // 8 * 2 + c % 2)


def tile_fragments(block_m: int, block_n: int, dim_v: int, dtype: str, defer_sum: bool = False):
    """Register fragments of one query tile, in the order the macros below name them:
    scores s (fp32), P (``dtype``), the output accumulator o, then the row statistics m,
    m_prev, m_safe, alpha, row_sum, l (``row_weights``), lse (fp32).  With ``defer_sum`` the
    caller annotates ``l``'s layout (``row_parts_layout``)."""
    acc = T.float32
    return (
        T.alloc_fragment([block_m, block_n], acc),
        T.alloc_fragment([block_m, block_n], dtype),
        T.alloc_fragment([block_m, dim_v], acc),
        *(T.alloc_fragment([block_m], acc) for _ in range(5)),
        row_weights(block_m, defer_sum),
        T.alloc_fragment([block_m], acc),
    )


def online_softmax(block_m: int, block_n: int, dim_v: int, has_sinks: bool, has_softcap: bool, p_offset: float = 0.0,
                   defer_sum: bool = False, turn=None):
    """(update, finish) macros for one tile shape.

    ``turn``: None, or the hand-written forward's pingpong turn (``fwd_ws.gemm_turns``,
    ``softmax_turns``): macros ``take(wg)`` / ``hand_on(wg)`` that ``update`` (given ``wg``) runs
    around the whole block (``after_max`` False) or around the exponentials and row sums only.

    ``defer_sum``: ``l`` holds each thread's partial sums of its rows (``row_weights``), so a
    block adds its weights without the two shuffles per row that a row's all-reduce costs; one
    all-reduce per tile in ``finish`` (WGMMA accumulator layouts only: the hand-written
    forward).  The sums then run in another order: ``l`` may differ in the last bits.

    ``p_offset``: the weights are ``exp2(score - row max + p_offset)`` (FP8 P: 8, so they use
    e4m3's range up to 256, ``operands``); ``l`` carries the same factor, and ``finish`` takes it
    out of the log-sum-exp and puts it into the sink's weight.

    ``update(s, m, m_prev, m_safe, alpha, row_sum, l, n0, m0, last_row, mask, score_scale,
    cap_in, rows=None)``: scores of key block ``n0`` in ``s`` -> exp2 weights in ``s`` (the
    caller casts them to P); masks (``masks.TileMask``) only when the block is not fully
    visible.  Tile row i is query row ``m0 + i`` (``m0`` .. ``last_row``), or ``rows.query(i)``
    where a tile packs several heads' rows (decode; ``m0`` / ``last_row`` then bound the
    tile's query rows).

    ``finish(o, m, m_safe, alpha, row_sum, l, lse, sink, score_scale, out_scale=None)``: folds in the sink
    logit (natural-log units, read only with sinks; an object with ``at(i)`` gives one per row), normalises ``o`` and writes the natural-log
    log-sum-exp into ``lse`` (-inf for a row that saw no key and has no sink); ``out_scale``
    (FP8: v_descale) multiplies the output.
    """
    assert not defer_sum or block_n % ROW_PARTS == 0, f"defer_sum: {block_n} keys per block is not a multiple of {ROW_PARTS}"
    acc = T.float32
    neg_inf = -T.infinity(acc)
    shifted = p_offset != 0.0

    @T.macro
    def update(s, m, m_prev, m_safe, alpha, row_sum, l, n0, m0, last_row, mask, score_scale, cap_in, rows=None, wg=None):
        if turn is not None and not turn.after_max:
            turn.take(wg)
        if has_softcap:
            for i, j in T.Parallel(block_m, block_n):
                s[i, j] = T.tanh(s[i, j] * cap_in)
        if not block_fully_visible(last_row, n0, n0 + block_n - 1, m0, mask):
            for i, j in T.Parallel(block_m, block_n):
                s[i, j] = T.if_then_else(visible(m0 + i if rows is None else rows.query(i), n0 + j, mask), s[i, j], neg_inf)
        T.copy(m, m_prev)
        T.reduce_max(s, m, dim=1, clear=False)
        for i in T.Parallel(block_m):
            m_safe[i] = scaled_max(m[i], score_scale)
            alpha[i] = rescale_factor(m_prev[i], m[i], m_safe[i], score_scale)
            if shifted:  # once per row, so each weight below stays one FFMA (finish recomputes m_safe)
                m_safe[i] = m_safe[i] - p_offset
        if turn is not None and turn.after_max:
            turn.take(wg)
        for i, j in T.Parallel(block_m, block_n):
            s[i, j] = T.exp2(s[i, j] * score_scale - m_safe[i])
        if defer_sum:
            # One index pattern per fragment in a T.Parallel loop (TileLang): the columns by a
            # loop, not as one expression over c, c + 8, ...
            for i, c in T.Parallel(block_m, ROW_PARTS):
                l[i, c] = l[i, c] * alpha[i]
                for k in T.unroll(block_n // ROW_PARTS):
                    l[i, c] = l[i, c] + s[i, c + ROW_PARTS * k]
        else:
            T.reduce_sum(s, row_sum, dim=1)
            for i in T.Parallel(block_m):
                l[i] = l[i] * alpha[i] + row_sum[i]
        if turn is not None:
            turn.hand_on(wg)

    @T.macro
    def finish(o, m, m_safe, alpha, row_sum, l, lse, sink, score_scale, out_scale=None):
        # alpha becomes the output scale, lse the log-sum-exp.
        if defer_sum:  # the rows' totals, held in lse until it is written from them
            T.reduce_sum(l, lse, dim=1)
            l = lse
        for i in T.Parallel(block_m):
            m_safe[i] = T.if_then_else(m[i] == neg_inf, neg_inf, m[i] * score_scale)
            # l is relative to top; the output scale is num / l.  A row with l = 0 (no key and
            # no sink, or a -inf sink) gets out 0 and lse -inf.
            top, num = m_safe[i], 1.0
            if has_sinks:
                sink2 = (sink.at(i) if hasattr(sink, "at") else sink) * LOG2E
                # top is -inf only for a row that saw no key and has a -inf sink: use 0 so
                # that the exponentials are exp2(-inf) = 0, not exp2(-inf - -inf) = NaN.
                top = T.max(m_safe[i], sink2)
                top = T.if_then_else(top == neg_inf, 0, top)
                row_sum[i] = T.exp2(m_safe[i] - top)
                if shifted:
                    l[i] = l[i] * row_sum[i] + T.exp2(sink2 - top + p_offset)
                else:
                    l[i] = l[i] * row_sum[i] + T.exp2(sink2 - top)
                num = row_sum[i]
            if out_scale is None:
                alpha[i] = T.if_then_else(l[i] > 0, num / l[i], 0)
            else:
                alpha[i] = T.if_then_else(l[i] > 0, num / l[i] * out_scale, 0)
            if shifted:
                lse[i] = T.if_then_else(l[i] > 0, (T.log2(l[i]) - p_offset + top) * LN2, neg_inf)
            else:
                lse[i] = natural_lse(l[i], top)
        for i, j in T.Parallel(block_m, dim_v):
            o[i, j] *= alpha[i]

    return update, finish
