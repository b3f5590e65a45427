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


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def combine_kernel(dim_v: int, dtype: str, has_sinks: bool, block_r: int = BLOCK_R, threads: int = 128,
                   max_splits: int = 128):
    """Kernel arguments: Opart (P, dim_v) and LSEpart (P,) fp32, flat index
    ``((split * B + b) * Sq + t) * H + h`` (``P >= num_splits * B * Sq * H``); O (B, Sq, H,
    dim_v) out; LSE (B, H, Sq) fp32 out; Sinks (H,) fp32 (read only with sinks); num_splits
    (at most ``max_splits``, ``decode.MAX_SPLITS``)."""
    B, Sq, H, P = T.dynamic("B, Sq, H, P")
    acc = T.float32
    neg_inf = -T.infinity(acc)

    @T.prim_func
    def main(
        Opart: T.Tensor([P, dim_v], acc),
        LSEpart: T.Tensor([P], acc),
        O: T.Tensor([B, Sq, H, dim_v], dtype),
        LSE: T.Tensor([B, H, Sq], acc),
        Sinks: T.Tensor([H], acc),
        num_splits: T.int32,
    ):
        with T.Kernel(T.ceildiv(B * Sq * H, block_r), threads=threads) as bx:
            R = B * Sq * H
            lse_all = T.alloc_fragment([block_r, max_splits], acc)
            w_s = T.alloc_shared([block_r, max_splits], acc)
            m = T.alloc_fragment([block_r], acc)
            w = T.alloc_fragment([block_r], acc)
            l = T.alloc_fragment([block_r], acc)
            lse = T.alloc_fragment([block_r], acc)
            o = T.alloc_fragment([block_r, dim_v], acc)
            r0 = bx * block_r

            # Every split's lse at once (no serial chain of dependent loads), then max and sum.
            for i, s in T.Parallel(block_r, max_splits):
                lse_all[i, s] = T.if_then_else(
                    T.And(s < num_splits, r0 + i < R), LSEpart[s * R + T.min(r0 + i, R - 1)], neg_inf
                )
            T.reduce_max(lse_all, m, dim=1)
            for i in T.Parallel(block_r):
                if has_sinks:
                    m[i] = T.max(m[i], Sinks[T.min(r0 + i, R - 1) % H])
                m[i] = T.if_then_else(m[i] == neg_inf, 0, m[i])
            for i, s in T.Parallel(block_r, max_splits):
                lse_all[i, s] = T.exp2((lse_all[i, s] - m[i]) * LOG2E)  # -inf (empty split / past num_splits) -> 0
            T.reduce_sum(lse_all, l, dim=1)
            T.copy(lse_all, w_s)
            T.clear(o)
            for s in T.serial(num_splits):
                for i, c in T.Parallel(block_r, dim_v):
                    o[i, c] += w_s[i, s] * Opart[s * R + T.min(r0 + i, R - 1), c]
            for i in T.Parallel(block_r):
                if has_sinks:
                    l[i] += T.exp2((Sinks[T.min(r0 + i, R - 1) % H] - m[i]) * LOG2E)
                lse[i] = T.if_then_else(l[i] > 0, T.log2(l[i]) * LN2 + m[i], neg_inf)
                w[i] = T.if_then_else(l[i] > 0, 1.0 / l[i], 0)
            for i, c in T.Parallel(block_r, dim_v):
                r = r0 + i
                if r < R:
                    O[r // (Sq * H), (r // H) % Sq, r % H, c] = T.cast(o[i, c] * w[i], dtype)
            for i in T.Parallel(block_r):
                r = r0 + i
                if r < R:
                    LSE[r // (Sq * H), r % H, (r // H) % Sq] = lse[i]

    return main
