"""Split-KV combine (Hopper): merge the decode kernel's per-split partial outputs by their lse.

The splits of a query row are the parts of its segment (entry, kv head, row tile) that the
decode workers ran (``schedule.split_part``); ``schedule.segment_workers`` names their slots
from the segment index and the worker count alone.  Split ``s`` of a query row wrote ``o_s`` (its softmax-normalised output over its keys, fp32)
and ``lse_s`` (natural log; -inf for a split that saw no key).  The row's result is

    lse = log(sum_s exp(lse_s) + exp(sink))          (the sink term only with sinks)
    out = sum_s exp(lse_s - lse) * o_s

computed around the largest term so nothing overflows; the sink is folded in here, exactly
once.  A row where every split is empty (and no sink) gets out = 0 and lse = -inf.

Static structure: dtype, dim_v, sinks on/off.  Rows, splits, workers and shapes are runtime.
"""

import tilelang
import tilelang.language as T

from .decode import BLOCK_M, segment_count, segment_index
from .schedule import segment_workers
from .softmax import LN2, LOG2E
from .target import PASS_CONFIGS, TARGET

# Splits a thread loads per round, all in flight at once (the decode schedule compiles 8, or
# 8 and 16, and each call picks: ``decode.COMBINES``).
PER_ROUND = 8


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def combine_kernel(dim_v: int, dtype: str, has_sinks: bool, threads: int = 128, per_round: int = PER_ROUND,
                   min_ctas: int = 1, rows: int = 0, single_stored: bool = False):
    """Kernel arguments: Opart (P, dim_v) and LSEpart (P,) fp32, the decode's partials (row
    ``slot x tile_rows + tile row``, ``decode.SplitTile.partial_row``); O (RQ, dim_v) out, row
    ``r = (b * Sq + t) * H + h`` per query; LSE (RQ,) fp32 out, the (B, H, Sq) lse flat; Sinks
    (H,) fp32 (read only with sinks; its length is H); ``seqlen_q`` (Sq), ``num_kv_heads``,
    ``workers`` (the decode's G), ``consumers`` (partials per worker part: C slots each) and
    ``rows_per_cta`` (R, a divisor of ``groups``: ``decode.rows_per_cta`` picks it).  ``min_ctas``:
    CTAs per SM the build is bounded for (``__launch_bounds__``' second argument).  ``rows``:
    0 for R from ``rows_per_cta``, else R fixed at build time (the argument then unused): 1
    gives the one-row kernel's indices, uniform over the CTA (``decode.COMBINES``).
    ``single_stored``: rows of a segment with one split are skipped (its worker stored them).

    R query rows per CTA.  Its threads split a row's columns in 4-wide chunks, and the CTA's
    ``groups = threads // (dim_v / 4)`` chunk groups are dealt to its rows, ``groups / R``
    each, which interleave the row's splits; each thread loads the lse and its chunk of
    ``per_round`` splits at once (one round trip: no load waits for the lse), keeps a running
    (max, sum, output) over its rounds, and a row's groups merge through shared memory.  B=1
    decode at d=128: R = 1, one round of 16 for an FP8 cache's 48 splits, two of 8 for a bf16
    cache's 33 (``decode.COMBINES`` says why).  Few splits a row (many segments, the
    persistent FP8 decode: 3-6) take R = groups, one group per row, so the grid is RQ / 4 CTAs
    instead of RQ (one row per CTA ran B=128 2k's 4096 rows in 17 us under ncu).  (The first
    kernel, 4 rows per CTA, loaded every lse, reduced, then the partials 8 splits at a time:
    4 dependent rounds, ~6 us under ncu at B=1.)"""
    P, RQ, H = T.dynamic("P, RQ, H")
    acc = T.float32
    neg_inf = -T.infinity(acc)
    chunks = dim_v // 4
    groups = threads // chunks
    assert dim_v % 4 == 0 and groups >= 1, "dim_v a multiple of 4, at most 4 * threads"

    def reference(m):
        """The largest lse so far as the merge's reference point: 0 while every term is empty
        (-inf), so that the weights below are exp(-inf) = 0 rather than NaN."""
        return T.if_then_else(m == neg_inf, 0.0, m)

    def rows_of(rows_per_cta):
        """R: ``rows`` when fixed at build time, else the kernel argument."""
        return rows if rows else rows_per_cta

    def weight(lse, top):
        """exp(lse - top) by exp2."""
        return T.exp2((lse - top) * LOG2E)

    @T.prim_func
    def main(
        Opart: T.Tensor([P, dim_v], acc),
        LSEpart: T.Tensor([P], acc),
        O: T.Tensor([RQ, dim_v], dtype),
        LSE: T.Tensor([RQ], acc),
        Sinks: T.Tensor([H], acc),
        seqlen_q: T.int32,
        num_kv_heads: T.int32,
        workers: T.int32,
        consumers: T.int32,
        rows_per_cta: T.int32,
    ):
        with T.Kernel(T.ceildiv(RQ, rows_of(rows_per_cta)), threads=threads) as cta:
            if min_ctas > 1:  # a register cap (launch bounds): ``decode.COMBINES`` says why
                T.annotate_min_blocks_per_sm(min_ctas)
            m_s = T.alloc_shared([groups], acc)
            l_s = T.alloc_shared([groups], acc)
            o_s = T.alloc_shared([groups, dim_v], acc)
            lse_r = T.alloc_local([per_round], acc)
            val = T.alloc_local([per_round * 4], acc)
            o_t = T.alloc_local([4], acc)
            m_t = T.alloc_var(acc, init=neg_inf)
            l_t = T.alloc_var(acc, init=0.0)
            m_new = T.alloc_var(acc, init=neg_inf)
            m_safe = T.alloc_var(acc, init=0.0)
            alpha = T.alloc_var(acc, init=0.0)
            w = T.alloc_var(acc, init=0.0)
            tx = T.get_thread_binding()
            g = tx // chunks  # split group; threads past groups * chunks idle
            c0 = (tx % chunks) * 4
            # R rows, each taking ``per_row`` of the groups (the host makes them divide): group
            # g merges splits g % per_row, + per_row, ... of row g // per_row (``gi``: its place
            # among the row's groups; ``live``: a group of a row that exists).
            if rows == 1:  # every group on the CTA's one row
                per_row, row, gi, live = groups, cta, g, T.if_then_else(g < groups, 1, 0)
            else:
                per_row = T.alloc_var(T.int32, init=groups // rows_of(rows_per_cta))
                row = T.alloc_var(T.int32, init=T.min(cta * rows_of(rows_per_cta) + g // per_row, RQ - 1))
                gi = T.alloc_var(T.int32, init=g % per_row)
                live = T.alloc_var(T.int32, init=T.if_then_else(
                    T.And(g < groups, cta * rows_of(rows_per_cta) + g // per_row < RQ), 1, 0))
            g0 = 0 if rows == 1 else g  # the row's first group, in the merge (where gi == 0)
            # The row's segment and tile row, then its splits: C consumers' slots for each
            # worker touching it (``schedule``), partial rows ``slot * tile_rows + tile row``.
            group = T.alloc_var(T.int32, init=H // num_kv_heads)
            row_tiles = T.alloc_var(T.int32, init=T.ceildiv(group * seqlen_q, BLOCK_M))
            krow = T.alloc_var(T.int32, init=(row // H) % seqlen_q * group + row % H % group)  # among its kv head's rows
            seg = T.alloc_var(T.int32, init=segment_index(row // H // seqlen_q, row % H // group, krow // BLOCK_M,
                                                          num_kv_heads, row_tiles))
            segments = T.alloc_var(T.int32, init=segment_count(RQ // H // seqlen_q, num_kv_heads, row_tiles))
            first, count = segment_workers(seg, workers, segments)
            base = T.alloc_var(T.int32, init=(first + seg) * consumers)  # the segment's first slot
            num_splits = T.alloc_var(T.int32, init=count * consumers)
            if single_stored:
                # One split: the segment lay within one worker's share, which stored O and lse
                # itself (``decode_ws``'s ``own_workers``; otherwise every combined row has 2+).
                live = T.alloc_var(T.int32, init=T.if_then_else(num_splits > 1, live, 0))
            tile_rows = T.alloc_var(T.int32, init=T.min(group * seqlen_q, BLOCK_M))
            prow = T.alloc_var(T.int32, init=base * tile_rows + krow % BLOCK_M)  # split 0's partial row
            for e in T.unroll(4):
                o_t[e] = 0.0
            # Programmatic dependent launch (the decode kernels trigger at their start, and
            # TileLang launches a kernel that syncs with the PDL attribute): the launch and the
            # setup above overlap the decode kernel's tail; the partials are read only after
            # griddepcontrol.wait (the decode grid finished, its writes visible).
            T.pdl_sync()
            if live == 1:
                for r in T.serial(T.ceildiv(num_splits, per_row * per_round)):
                    # Loads first, all independent (clamped indices: no branch around a load).
                    for j in T.unroll(per_round):
                        s = (r * per_round + j) * per_row + gi
                        sc = T.min(s, num_splits - 1)
                        lse_r[j] = T.if_then_else(s < num_splits, LSEpart[prow + sc * tile_rows], neg_inf)
                        for e in T.vectorized(4):
                            val[j * 4 + e] = Opart[prow + sc * tile_rows, c0 + e]
                    m_new = m_t
                    for j in T.unroll(per_round):
                        m_new = T.max(m_new, lse_r[j])
                    m_safe = reference(m_new)
                    alpha = weight(m_t, m_safe)  # 0 while m_t is -inf
                    l_t = l_t * alpha
                    for e in T.unroll(4):
                        o_t[e] = o_t[e] * alpha
                    for j in T.unroll(per_round):
                        w = weight(lse_r[j], m_safe)  # empty split / past num_splits: 0
                        l_t = l_t + w
                        for e in T.unroll(4):
                            o_t[e] = o_t[e] + w * val[j * 4 + e]
                    m_t = m_new
                if tx % chunks == 0:
                    m_s[g] = m_t
                    l_s[g] = l_t
                for e in T.unroll(4):
                    o_s[g, c0 + e] = o_t[e]
            T.sync_threads()
            if T.And(live == 1, gi == 0):  # each row's first group merges the row's groups and stores
                m_new = m_s[g0]
                for gg in T.unroll(groups):
                    if gg < per_row:
                        m_new = T.max(m_new, m_s[g0 + gg])
                if has_sinks:
                    m_new = T.max(m_new, Sinks[row % H])
                m_safe = reference(m_new)
                l_t = 0.0
                for e in T.unroll(4):
                    o_t[e] = 0.0
                for gg in T.unroll(groups):
                    if gg < per_row:
                        alpha = weight(m_s[g0 + gg], m_safe)
                        l_t = l_t + l_s[g0 + gg] * alpha
                        for e in T.unroll(4):
                            o_t[e] = o_t[e] + o_s[g0 + gg, c0 + e] * alpha
                if has_sinks:
                    l_t = l_t + weight(Sinks[row % H], m_safe)
                w = T.if_then_else(l_t > 0, 1.0 / l_t, 0.0)
                for e in T.unroll(4):
                    O[row, c0 + e] = T.cast(o_t[e] * w, dtype)
                if tx % chunks == 0:
                    lrow = ((row // H // seqlen_q) * H + row % H) * seqlen_q + (row // H) % seqlen_q
                    LSE[lrow] = T.if_then_else(l_t > 0, T.log2(l_t) * LN2 + m_safe, neg_inf)

    return main
