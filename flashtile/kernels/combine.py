"""Split-KV combine (Hopper): merge the decode kernel's per-split partial outputs by their lse.

Split ``s`` of a query row wrote ``o_s`` (its softmax-normalised output over its keys, fp32)
and ``lse_s`` (natural log; -inf for a split that saw no key).  The row's result is

    lse = log(sum_s exp(lse_s) + exp(sink))          (the sink term only with sinks)
    out = sum_s exp(lse_s - lse) * o_s

computed around the largest term so nothing overflows; the sink is folded in here, exactly
once.  A row where every split is empty (and no sink) gets out = 0 and lse = -inf.

Static structure: dtype, dim_v, sinks on/off.  Rows, splits and shapes are runtime.
"""

import tilelang
import tilelang.language as T

from .target import PASS_CONFIGS, TARGET
from .softmax import LN2, LOG2E

BLOCK_R = 4  # query rows per CTA
UNROLL = 8  # splits whose partial outputs are loaded at once (independent loads in flight)


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def combine_kernel(dim_v: int, dtype: str, has_sinks: bool, block_r: int = BLOCK_R, threads: int = 128,
                   max_splits: int = 128):
    """Kernel arguments: Opart (P, dim_v) and LSEpart (P,) fp32, row ``split * RQ + r`` where
    ``r = (b * Sq + t) * H + h`` is the query row (``P >= num_splits * RQ``); O (RQ, dim_v) out,
    rows like Opart's; LSE (RQ,) fp32 out, the (B, H, Sq) lse flat; Sinks (H,) fp32 (read only
    with sinks; its length is H); ``seqlen_q`` (Sq); ``num_splits`` (at most ``max_splits``,
    ``decode.MAX_SPLITS``)."""
    P, RQ, H = T.dynamic("P, RQ, H")
    acc = T.float32
    neg_inf = -T.infinity(acc)

    @T.prim_func
    def main(
        Opart: T.Tensor([P, dim_v], acc),
        LSEpart: T.Tensor([P], acc),
        O: T.Tensor([RQ, dim_v], dtype),
        LSE: T.Tensor([RQ], acc),
        Sinks: T.Tensor([H], acc),
        seqlen_q: T.int32,
        num_splits: T.int32,
    ):
        with T.Kernel(T.ceildiv(RQ, block_r), threads=threads) as bx:
            lse_all = T.alloc_fragment([block_r, max_splits], acc)
            w_s = T.alloc_shared([block_r, max_splits], acc)
            row_s = T.alloc_shared([block_r], T.int32)  # the CTA's query rows, clamped
            head_s = T.alloc_shared([block_r], T.int32)
            lrow_s = T.alloc_shared([block_r], T.int32)  # their index in the (B, H, Sq) lse
            m = T.alloc_fragment([block_r], acc)
            w = T.alloc_fragment([block_r], acc)
            l = T.alloc_fragment([block_r], acc)
            lse = T.alloc_fragment([block_r], acc)
            o = T.alloc_fragment([block_r, dim_v], acc)
            r0 = bx * block_r

            # Per-row indices once (32-bit divisions), not inside the copy and store loops.
            for i in T.Parallel(block_r):
                row_s[i] = T.min(r0 + i, RQ - 1)
                head_s[i] = row_s[i] % H
                lrow_s[i] = ((row_s[i] // H // seqlen_q) * H + head_s[i]) * seqlen_q + (row_s[i] // H) % seqlen_q
            # Programmatic dependent launch (the decode kernels trigger at their start, and
            # TileLang launches a kernel that syncs with the PDL attribute): everything above
            # (this CTA's launch and row indices) overlaps the decode kernel's tail; the
            # partials are read only after griddepcontrol.wait, which waits for the decode
            # grid to finish and its writes to be visible.
            T.pdl_sync()
            # Every split's lse at once (no serial chain of dependent loads), then max and sum.
            for i, s in T.Parallel(block_r, max_splits):
                lse_all[i, s] = T.if_then_else(T.And(s < num_splits, r0 + i < RQ), LSEpart[s * RQ + row_s[i]], neg_inf)
            T.reduce_max(lse_all, m, dim=1)
            for i in T.Parallel(block_r):
                if has_sinks:
                    m[i] = T.max(m[i], Sinks[head_s[i]])
                m[i] = T.if_then_else(m[i] == neg_inf, 0, m[i])
            for i, s in T.Parallel(block_r, max_splits):
                lse_all[i, s] = T.exp2((lse_all[i, s] - m[i]) * LOG2E)  # -inf (empty split / past num_splits) -> 0
            T.reduce_sum(lse_all, l, dim=1)
            T.copy(lse_all, w_s)
            T.clear(o)
            # UNROLL splits per step, unguarded: their loads are independent, so they overlap
            # instead of paying one round trip per split (B = 1 decode: 29 splits); then the
            # remainder one by one.  (A guarded step, loads inside `sp < num_splits`, ran the
            # combine 2x slower than the plain serial loop on the H100.)
            for s0 in T.serial(num_splits // UNROLL):
                for u in T.unroll(UNROLL):
                    for i, c in T.Parallel(block_r, dim_v):
                        o[i, c] += w_s[i, s0 * UNROLL + u] * Opart[(s0 * UNROLL + u) * RQ + row_s[i], c]
            for s1 in T.serial(num_splits % UNROLL):
                for i, c in T.Parallel(block_r, dim_v):
                    sp = num_splits - num_splits % UNROLL + s1
                    o[i, c] += w_s[i, sp] * Opart[sp * RQ + row_s[i], c]
            for i in T.Parallel(block_r):
                if has_sinks:
                    l[i] += T.exp2((Sinks[head_s[i]] - m[i]) * LOG2E)
                lse[i] = T.if_then_else(l[i] > 0, T.log2(l[i]) * LN2 + m[i], neg_inf)
                w[i] = T.if_then_else(l[i] > 0, 1.0 / l[i], 0)
            for i, c in T.Parallel(block_r, dim_v):
                if r0 + i < RQ:
                    O[row_s[i], c] = T.cast(o[i, c] * w[i], dtype)
            for i in T.Parallel(block_r):
                if r0 + i < RQ:
                    LSE[lrow_s[i]] = lse[i]

    return main
