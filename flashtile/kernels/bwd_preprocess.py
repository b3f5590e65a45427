"""The backward's preprocess kernel: per query row, Delta and the base-2 log-sum-exp.

Dense batches: one CTA per (row block, head, batch entry), writing the statistics row-ordered.
Packed (varlen) batches: one CTA per real row block (``seqinfo.packed_slots``), writing each
sequence's rows where the main kernels read them (``packed_stats.stat_start``: 16-byte aligned
starts), so the host moves no statistics between the two launches.

(No `from __future__ import annotations` here: TileLang evaluates the PrimFunc annotations.)
"""

import tilelang
import tilelang.language as T

from . import seqinfo
from .softmax import LOG2E
from .target import PASS_CONFIGS, TARGET


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def attention_bwd_preprocess(dim_v: int, dtype: str, has_dlse: bool, varlen: bool = False, block: int = 64,
                             threads: int = 128):
    """Delta = rowsum(dO * O) [- dLSE]; LSE2 = lse * log2(e), -inf -> +inf.

    Dense: O, dO (B, Sq, H, Dv), LSE, dLSE (B, H, Sq), Delta, LSE2 (B, H, Sqp) with ``Sqp`` Sq
    rounded up to a multiple of 4 (rows 16-byte aligned, as the main kernels' TMA loads of
    lse/Delta tiles require); padding rows get Delta = 0, LSE2 = 0 (their Q and dO tiles are
    zero-filled, so they contribute nothing).  Packed: O, dO (1, Tq, H, Dv), LSE, dLSE
    (1, H, Tq), Delta, LSE2 (1, H, Tqp) (``packed_stats.stat_rows``), then CuQ (batch + 1,),
    LenQ (batch,) and max_q; the kernel writes each sequence's used rows only, the caller
    fills the buffers (gaps and unused rows: Delta = 0, LSE2 = +inf, ``packed_stats.stat_start``).
    """
    acc = T.float32
    cols = 32 if dim_v % 32 == 0 else 16

    @T.macro
    def body(O, dO, LSE, dLSE, Delta, LSE2, seqs, rows_q):
        H = O.shape[2]
        with T.Kernel(*seqs.grid(block, H), threads=threads) as ids:
            bx, h, b = seqs.tile(ids, block, H, threads)
            o = T.alloc_fragment([block, cols], dtype)
            do = T.alloc_fragment([block, cols], dtype)
            prod = T.alloc_fragment([block, cols], acc)
            delta = T.alloc_fragment([block], acc)
            lse = T.alloc_fragment([block], acc)
            seq = seqs.of(b)
            m0 = bx * block
            r0 = seq.q0 + m0  # first row of the tile in the tensors
            if m0 < seq.len_q:  # a packed grid's empty slot has no rows
                T.clear(prod)
                # Column chunks: layout inference finds no thread mapping for e.g. [64, 96] tiles.
                for c in T.serial(dim_v // cols):
                    T.copy(O[seq.b, r0 : r0 + block, h, c * cols : (c + 1) * cols], o)
                    T.copy(dO[seq.b, r0 : r0 + block, h, c * cols : (c + 1) * cols], do)
                    for i, j in T.Parallel(block, cols):
                        prod[i, j] += T.cast(o[i, j], acc) * T.cast(do[i, j], acc)
                T.reduce_sum(prod, delta, dim=1)
                if has_dlse:
                    for i in T.Parallel(block):
                        delta[i] -= T.if_then_else(m0 + i < seq.len_q, dLSE[seq.b, h, T.min(r0 + i, rows_q - 1)], 0)
                for i in T.Parallel(block):
                    lse[i] = T.if_then_else(m0 + i < seq.len_q, LSE[seq.b, h, T.min(r0 + i, rows_q - 1)], 0)
                    lse[i] = T.if_then_else(lse[i] == -T.infinity(acc), T.infinity(acc), lse[i] * LOG2E)
                if varlen:  # rows past the sequence's end are the next sequence's
                    for i in T.Parallel(block):
                        if m0 + i < seq.len_q:
                            Delta[0, h, seq.s0 + m0 + i] = delta[i]
                            LSE2[0, h, seq.s0 + m0 + i] = lse[i]
                else:
                    T.copy(delta, seq.stat(Delta, h, m0, block))
                    T.copy(lse, seq.stat(LSE2, h, m0, block))

    if not varlen:
        B, Sq, Sqp, H = T.dynamic("B, Sq, Sqp, H")

        @T.prim_func
        def main(
            O: T.Tensor([B, Sq, H, dim_v], dtype),
            dO: T.Tensor([B, Sq, H, dim_v], dtype),
            LSE: T.Tensor([B, H, Sq], acc),
            dLSE: T.Tensor([B, H, Sq], acc),
            Delta: T.Tensor([B, H, Sqp], acc),
            LSE2: T.Tensor([B, H, Sqp], acc),
        ):
            body(O, dO, LSE, dLSE, Delta, LSE2, seqinfo.dense(B, Sq, Sq), Sq)

        return main

    Tq, Tqp, H, Bc, Bn = T.dynamic("Tq, Tqp, H, Bc, Bn")

    @T.prim_func
    def main_varlen(
        O: T.Tensor([1, Tq, H, dim_v], dtype),
        dO: T.Tensor([1, Tq, H, dim_v], dtype),
        LSE: T.Tensor([1, H, Tq], acc),
        dLSE: T.Tensor([1, H, Tq], acc),
        Delta: T.Tensor([1, H, Tqp], acc),
        LSE2: T.Tensor([1, H, Tqp], acc),
        CuQ: T.Tensor([Bc], T.int32),
        LenQ: T.Tensor([Bn], T.int32),
        max_q: T.int32,
    ):
        seqs = seqinfo.packed_rows(CuQ, LenQ, max_q, Tq, stats=True)
        body(O, dO, LSE, dLSE, Delta, LSE2, seqs, Tq)

    return main_varlen
