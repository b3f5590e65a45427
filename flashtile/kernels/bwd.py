"""TileLang backward kernels (Hopper) and their launcher.

(No `from __future__ import annotations` here: TileLang evaluates the PrimFunc annotations
and a postponed annotation cannot see a symbol that only the annotations use.)

Three steps, as in FlashAttention-2/3:

1. ``bwd_preprocess.attention_bwd_preprocess``: per query row, ``Delta = rowsum(dO * O) - dlse`` and the
   base-2 log-sum-exp (fully masked rows get +inf so their P is exactly 0).
2. ``attention_bwd_dkdv``: one CTA per (key block, kv head, batch).  It keeps dK and dV of its
   key block in registers and walks over every (query head of its GQA group, query block)
   pair that can see the block, recomputing P from the saved lse.  GQA therefore sums dK/dV
   over the group inside the CTA: no atomics and no groups-times-larger buffer.  In the
   default mode the same CTA also emits dQ = dS K through TMA reduce-add into an fp32 buffer
   (unordered float atomics, fast, not bitwise reproducible).  With ``overlap`` (the table's
   choice up to d=128) S^T and dP^T are issued as async WGMMA and P is computed while dP^T
   runs.
3. dQ: either that fp32 buffer cast to the input dtype, or, with ``deterministic=True``,
   ``attention_bwd_dq``: one CTA per query block that owns its dQ rows and loops over the key
   blocks (recomputing S and dP), so every sum happens in a fixed order.

dsinks = -sum_{b,i} exp(sink_h - lse_i) * Delta_i is a tiny reduction done by PyTorch.
"""


import tilelang
import tilelang.language as T

from . import seqinfo
from .masks import TileMask, block_fully_visible, in_sequence, pipelined_trips, query_block_range, query_tile, visible
from .target import PASS_CONFIGS, SELF_GUARDED_PASS_CONFIGS, TARGET


def query_step(t, hk, groups, qb_lo, n_qblocks, block_m):
    """Query head and first query row of step ``t`` of a dK/dV CTA's walk: (head, m0).

    Heads of the GQA group outer, query blocks inner, one flat loop so the pipeline stays full.
    """
    return hk * groups + t // n_qblocks, (qb_lo + t % n_qblocks) * block_m


def score_gradients(rows: int, cols: int, queries_on_cols: bool, has_softcap: bool):
    """(probabilities, score_grad, keep_visible) macros for a rows x cols score tile of either
    backward kernel.

    The dK/dV kernel holds S^T (keys x queries: ``queries_on_cols``), the dQ kernel S, so the
    per-query lse and Delta are indexed by column or by row.  ``cap`` (the tanh tile) is only
    read with softcap.

    ``probabilities(s, cap, lse, score_scale, cap_in)``: raw scores -> P = exp2(s - lse)
    (softcap applied first, its tanh kept in ``cap``); masking is left to the caller.
    ``score_grad(ds, p, dp, delta, cap, sm_scale)``: dS = P (dP - Delta) d(score)/d(q.k), with
    softcap's factor 1 - tanh^2.
    ``stat_offset`` (optional, last) is where this tile's queries start in ``lse`` / ``delta``:
    the hand-written kernel keeps both ring stages in one flat buffer.
    ``keep_visible(p, interior, m0, n0, mask, tail=False)``: zero P where the key is not
    visible to the query; ``interior`` (the caller's test for a tile that needs no mask) skips
    it, except that with ``tail`` (a runtime test) an interior tile still zeroes the keys past
    the sequence's end, with one compare each instead of the mask (``key_tail_tests``).  No
    test of the query row: rows past a packed sequence's end read LSE2 = +inf from the
    statistics padding (``packed_stats.stat_start``), so their P is 0 already.
    """

    @T.macro
    def probabilities(s, cap, lse, score_scale, cap_in, stat_offset=0):
        if has_softcap:
            for i, j in T.Parallel(rows, cols):
                cap[i, j] = T.tanh(s[i, j] * cap_in)
                s[i, j] = cap[i, j]
        for i, j in T.Parallel(rows, cols):
            s[i, j] = T.exp2(s[i, j] * score_scale - lse[stat_offset + (j if queries_on_cols else i)])

    @T.macro
    def score_grad(ds, p, dp, delta, cap, sm_scale, stat_offset=0):
        if has_softcap:
            for i, j in T.Parallel(rows, cols):
                ds[i, j] = p[i, j] * (dp[i, j] - delta[stat_offset + (j if queries_on_cols else i)]) * sm_scale * (1.0 - cap[i, j] * cap[i, j])
        else:
            for i, j in T.Parallel(rows, cols):
                ds[i, j] = p[i, j] * (dp[i, j] - delta[stat_offset + (j if queries_on_cols else i)]) * sm_scale

    @T.macro
    def keep_visible(p, interior, m0, n0, mask, tail=False):
        if not interior:
            for i, j in T.Parallel(rows, cols):
                q, k = (j, i) if queries_on_cols else (i, j)
                p[i, j] = T.if_then_else(visible(m0 + q, n0 + k, mask), p[i, j], 0)
        elif tail:
            for i, j in T.Parallel(rows, cols):
                k = i if queries_on_cols else j
                p[i, j] = T.if_then_else(in_sequence(n0 + k, mask.seq), p[i, j], 0)

    return probabilities, score_grad, keep_visible


def key_tail_tests(m0, n0, block_m, block_n, last_col, mask):
    """(interior, tail) of a dK/dV kernel's step over query rows [m0, m0 + block_m) and the
    key block at n0 (``last_col``: its last key of the sequence, ``query_block_range``).

    interior: every query row of the step that belongs to the sequence sees every key of the
    block up to ``last_col``.  tail: the block runs past the sequence's keys.  A block's extra
    key rows must not reach dQ: in a packed batch they are the next sequence's keys; in a
    dense batch TMA's zero fill (harmless for ordinary scores, and zeroed all the same, so that
    both layouts follow one rule).  An interior step zeroes them with one compare per element
    (``masks.in_sequence``) instead of the causal/window mask.  A step's query rows past the
    sequence's end need nothing: a dense step's are zero rows of Q and dO, a packed step's
    read LSE2 = +inf from the statistics padding (``packed_stats.stat_start``), so P = 0 there.
    Before that padding, the packed backward tested every row against the sequence's end;
    the H200 profile of 64 sequences of 64..1024 tokens (NOTES, eleventh session) put those
    masks at a quarter of the d=64 dK/dV kernel's warp samples."""
    seq = mask.seq
    interior = block_fully_visible(T.min(m0 + block_m, seq.len_q) - 1, n0, last_col, m0, mask)
    return interior, n0 + block_n > seq.len_k


def dkdv_prim_func(dim: int, dim_v: int, dtype: str, varlen: bool, kernel):
    """The dK/dV kernels' PrimFunc, one argument list for both schedules (see
    ``attention_bwd_dkdv``): ``kernel`` is the schedule's T.macro, called with the arguments
    and a ``seqinfo.Sequences``.  Packed (varlen) batches: tensors (1, total, heads, dim),
    LSE2/Delta (1, H, Tqp) with sequence b's entries from ``packed_stats.stat_start`` (4-aligned
    starts: TMA loads them with the row innermost); CuQ, CuK, LenQ, LenK follow dV and
    ``max_q``, ``max_k`` end the list (as ``fwd.forward_prim_func``)."""
    acc = T.float32
    if not varlen:
        B, Sq, Sqp, Sk, H, Hkv = T.dynamic("B, Sq, Sqp, Sk, H, Hkv")

        @T.prim_func
        def main(
            Q: T.Tensor([B, Sq, H, dim], dtype),
            K: T.Tensor([B, Sk, Hkv, dim], dtype),
            V: T.Tensor([B, Sk, Hkv, dim_v], dtype),
            dO: T.Tensor([B, Sq, H, dim_v], dtype),
            LSE2: T.Tensor([B, H, Sqp], acc),
            Delta: T.Tensor([B, H, Sqp], acc),
            dQacc: T.Tensor([B, Sq, H, dim], acc),
            dK: T.Tensor([B, Sk, Hkv, dim], dtype),
            dV: T.Tensor([B, Sk, Hkv, dim_v], dtype),
            Ticket: T.Tensor([1], T.int32),
            score_scale: T.float32,
            sm_scale: T.float32,
            cap_in: T.float32,
            left: T.int32,
            right: T.int32,
            rows_per_group: T.int32,
        ):
            kernel(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV, Ticket, score_scale, sm_scale, cap_in, left, right, rows_per_group, seqinfo.dense(B, Sq, Sk))

        return main

    Tq, Tqp, Tk, H, Hkv, Bc, Bn = T.dynamic("Tq, Tqp, Tk, H, Hkv, Bc, Bn")

    @T.prim_func
    def main_varlen(
        Q: T.Tensor([1, Tq, H, dim], dtype),
        K: T.Tensor([1, Tk, Hkv, dim], dtype),
        V: T.Tensor([1, Tk, Hkv, dim_v], dtype),
        dO: T.Tensor([1, Tq, H, dim_v], dtype),
        LSE2: T.Tensor([1, H, Tqp], acc),
        Delta: T.Tensor([1, H, Tqp], acc),
        dQacc: T.Tensor([1, Tq, H, dim], acc),
        dK: T.Tensor([1, Tk, Hkv, dim], dtype),
        dV: T.Tensor([1, Tk, Hkv, dim_v], dtype),
        CuQ: T.Tensor([Bc], T.int32),
        CuK: T.Tensor([Bc], T.int32),
        LenQ: T.Tensor([Bn], T.int32),
        LenK: T.Tensor([Bn], T.int32),
        Ticket: T.Tensor([1], T.int32),
        score_scale: T.float32,
        sm_scale: T.float32,
        cap_in: T.float32,
        left: T.int32,
        right: T.int32,
        rows_per_group: T.int32,
        max_q: T.int32,
        max_k: T.int32,
    ):
        seqs = seqinfo.packed(CuQ, CuK, LenQ, LenK, max_q, max_k, stats=True, rows_q=Tq, rows_k=Tk)
        kernel(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV, Ticket, score_scale, sm_scale, cap_in, left, right, rows_per_group, seqs)

    return main_varlen


def dq_prim_func(dim: int, dim_v: int, dtype: str, varlen: bool, kernel):
    """The deterministic dQ kernels' PrimFunc (see ``attention_bwd_dq``), as ``dkdv_prim_func``."""
    acc = T.float32
    if not varlen:
        B, Sq, Sqp, Sk, H, Hkv = T.dynamic("B, Sq, Sqp, Sk, H, Hkv")

        @T.prim_func
        def main(
            Q: T.Tensor([B, Sq, H, dim], dtype),
            K: T.Tensor([B, Sk, Hkv, dim], dtype),
            V: T.Tensor([B, Sk, Hkv, dim_v], dtype),
            dO: T.Tensor([B, Sq, H, dim_v], dtype),
            LSE2: T.Tensor([B, H, Sqp], acc),
            Delta: T.Tensor([B, H, Sqp], acc),
            dQ: T.Tensor([B, Sq, H, dim], dtype),
            score_scale: T.float32,
            sm_scale: T.float32,
            cap_in: T.float32,
            left: T.int32,
            right: T.int32,
        ):
            kernel(Q, K, V, dO, LSE2, Delta, dQ, score_scale, sm_scale, cap_in, left, right, seqinfo.dense(B, Sq, Sk))

        return main

    Tq, Tqp, Tk, H, Hkv, Bc, Bn = T.dynamic("Tq, Tqp, Tk, H, Hkv, Bc, Bn")

    @T.prim_func
    def main_varlen(
        Q: T.Tensor([1, Tq, H, dim], dtype),
        K: T.Tensor([1, Tk, Hkv, dim], dtype),
        V: T.Tensor([1, Tk, Hkv, dim_v], dtype),
        dO: T.Tensor([1, Tq, H, dim_v], dtype),
        LSE2: T.Tensor([1, H, Tqp], acc),
        Delta: T.Tensor([1, H, Tqp], acc),
        dQ: T.Tensor([1, Tq, H, dim], dtype),
        CuQ: T.Tensor([Bc], T.int32),
        CuK: T.Tensor([Bc], T.int32),
        LenQ: T.Tensor([Bn], T.int32),
        LenK: T.Tensor([Bn], T.int32),
        score_scale: T.float32,
        sm_scale: T.float32,
        cap_in: T.float32,
        left: T.int32,
        right: T.int32,
        max_q: T.int32,
        max_k: T.int32,
    ):
        seqs = seqinfo.packed(CuQ, CuK, LenQ, LenK, max_q, max_k, stats=True, rows_q=Tq, rows_k=Tk)
        kernel(Q, K, V, dO, LSE2, Delta, dQ, score_scale, sm_scale, cap_in, left, right, seqs)

    return main_varlen


def dkdv_kernel(
    dim: int,
    dim_v: int,
    dtype: str,
    has_softcap: bool,
    with_dq: bool,
    varlen: bool = False,
    block_n: int = 128,
    block_m: int = 64,
    num_stages: int = 2,
    threads: int = 256,
    overlap: bool = False,
    dq_regs: bool = False,
):
    """dK, dV (and with ``with_dq`` the fp32 dQ accumulation) for one key block per CTA.

    ``dq_regs``: each step's dQ tile is reduce-added into ``dQacc`` straight from the GEMM's
    registers (vector ``red.global.add.f32``), not staged in shared memory for a TMA
    reduce-add.  At d = 256 the staged tile is 64 KB of fp32, which is what keeps the Q / dO
    loads to one stage; without it two stages fit.  Built by ``attention_bwd_dkdv_regs``.

    Arguments: Q, K, V, dO, LSE2, Delta, dQacc (B, Sq, H, dim) fp32 (zeroed by the caller;
    untouched without ``with_dq``), dK, dV outputs, then scalars ``score_scale`` (log2 units,
    as in the forward), ``sm_scale``, ``cap_in``, ``left``, ``right``, ``rows_per_group`` (the
    launch order of key blocks, ``schedule.grouped_tile``; rows are (batch, kv head); only
    the hand-written schedule honours it).
    """
    acc = T.float32
    # A WGMMA warpgroup owns 64 rows of its tile.  When the key block is shorter than the
    # consumer warpgroups stacked (d=256: 64 keys, but dK + dV need two warpgroups' registers)
    # the warpgroups split columns instead, and P^T / dS^T go through shared memory: a
    # column-split fragment cannot be the register A operand of the dV / dK GEMMs.
    split_cols = block_n < 64 * (threads // 128)
    probabilities, score_grad, keep_visible = score_gradients(block_n, block_m, True, has_softcap)
    policy = T.GemmWarpPolicy.FullCol if split_cols else T.GemmWarpPolicy.FullRow

    @T.macro
    def kernel(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV, Ticket, score_scale, sm_scale, cap_in, left, right, rows_per_group, seqs):
        H, Hkv = Q.shape[2], K.shape[2]
        # Row-major launch order whatever rows_per_group says: with the grouped order's
        # computed indices TileLang 0.1.15's ThreadSync pass rejects this schedule at d=256.
        with T.Kernel(*seqs.grid(block_n, Hkv, keys=True), threads=threads) as ids:
            bx, hk, b = seqs.tile(ids, block_n, Hkv, threads, keys=True)
            k_s = T.alloc_shared([block_n, dim], dtype)
            v_s = T.alloc_shared([block_n, dim_v], dtype)
            q_s = T.alloc_shared([block_m, dim], dtype)
            do_s = T.alloc_shared([block_m, dim_v], dtype)
            lse_s = T.alloc_shared([block_m], acc)
            delta_s = T.alloc_shared([block_m], acc)
            ds_s = T.alloc_shared([block_n, block_m], dtype)
            if split_cols:
                p_s = T.alloc_shared([block_n, block_m], dtype)
            dk_s = T.alloc_shared([block_n, dim], dtype)
            dv_s = T.alloc_shared([block_n, dim_v], dtype)
            sT = T.alloc_fragment([block_n, block_m], acc)
            dpT = T.alloc_fragment([block_n, block_m], acc)
            if not split_cols:
                pT = T.alloc_fragment([block_n, block_m], dtype)
            dsT = T.alloc_fragment([block_n, block_m], dtype)
            dk = T.alloc_fragment([block_n, dim], acc)
            dv = T.alloc_fragment([block_n, dim_v], acc)
            capT = T.alloc_fragment([block_n, block_m], acc) if has_softcap else None
            if with_dq:
                dq = T.alloc_fragment([block_m, dim], acc)
                if not dq_regs:
                    dq_s = T.alloc_shared([block_m, dim], acc)

            n0 = bx * block_n
            groups = H // Hkv
            seq = seqs.of(b)
            mask = TileMask(seq, left, right)
            qb_lo, n_qblocks, last_col = query_block_range(n0, block_n, block_m, mask)

            T.copy(seq.k_rows(K, n0, block_n, hk), k_s)
            T.copy(seq.k_rows(V, n0, block_n, hk), v_s)
            T.clear(dk)
            T.clear(dv)

            # One flat loop over (query head in the GQA group, query block) keeps the pipeline full.
            # A key block no query sees still takes one trip, over query block qb_lo.
            for t in T.Pipelined(pipelined_trips(groups * n_qblocks), num_stages=num_stages):
                h, m0 = query_step(t, hk, groups, qb_lo, pipelined_trips(n_qblocks), block_m)
                T.copy(seq.q_rows(Q, m0, block_m, h), q_s)
                T.copy(seq.stat(LSE2, h, m0, block_m), lse_s)
                if overlap:
                    # S^T and dP^T issued together; P is computed while dP^T is still running.
                    # Safe inside T.Pipelined: q_s and do_s are read again by the synchronous
                    # dK / dV GEMMs below, so their stages are not released at these statements.
                    T.copy(seq.q_rows(dO, m0, block_m, h), do_s)
                    T.copy(seq.stat(Delta, h, m0, block_m), delta_s)
                    T.wgmma_gemm(k_s, q_s, sT, transpose_B=True, clear_accum=True, policy=policy)
                    T.wgmma_gemm(v_s, do_s, dpT, transpose_B=True, clear_accum=True, policy=policy)
                    T.wait_wgmma(1)
                else:
                    T.gemm(k_s, q_s, sT, transpose_B=True, clear_accum=True, policy=policy)
                probabilities(sT, capT, lse_s, score_scale, cap_in)
                interior, tail = key_tail_tests(m0, n0, block_m, block_n, last_col, mask)
                keep_visible(sT, interior, m0, n0, mask, tail)
                if overlap:
                    T.wait_wgmma(0)
                else:
                    T.copy(seq.q_rows(dO, m0, block_m, h), do_s)
                    T.copy(seq.stat(Delta, h, m0, block_m), delta_s)
                    T.gemm(v_s, do_s, dpT, transpose_B=True, clear_accum=True, policy=policy)
                if split_cols:
                    T.copy(sT, p_s)
                    T.gemm(p_s, do_s, dv, policy=policy)
                else:
                    T.copy(sT, pT)
                    T.gemm(pT, do_s, dv, policy=policy)
                score_grad(dsT, sT, dpT, delta_s, capT, sm_scale)
                if split_cols or with_dq:
                    T.copy(dsT, ds_s)
                T.gemm(ds_s if split_cols else dsT, q_s, dk, policy=policy)
                if with_dq:
                    T.gemm(ds_s, k_s, dq, transpose_A=True, clear_accum=True)
                    if dq_regs:
                        # The step's head and first row in registers: as expressions (divisions
                        # by the group's block count) nvcc re-derived them for every element's
                        # address (~120 SASS instructions per vector atomic).  Rows past the
                        # sequence's end are skipped here, tested per element only in a query
                        # block that has such rows: a test around each element splits the
                        # unrolled loop into blocks and nvcc recomputes every 64-bit address
                        # (~20 instructions per atomic, as with TileLang's own guards, which
                        # are off for this builder).
                        dq_h = T.alloc_var(T.int32, init=h)[0]
                        dq_m0 = T.alloc_var(T.int32, init=m0)[0]
                        if dq_m0 + block_m <= seq.len_q:
                            for i, j in T.Parallel(block_m, dim):
                                T.atomic_add(dQacc[seq.b, seq.q0 + dq_m0 + i, dq_h, j], dq[i, j])
                        else:
                            for i, j in T.Parallel(block_m, dim):
                                if dq_m0 + i < seq.len_q:
                                    T.atomic_add(dQacc[seq.b, seq.q0 + dq_m0 + i, dq_h, j], dq[i, j])
                    else:
                        T.copy(dq, dq_s)
                        # Rows past a packed sequence's end add exact zeros (their P is masked).
                        T.atomic_add(seq.q_rows(dQacc, m0, block_m, h), dq_s, use_tma=True)

            seqinfo.store_k_tile(seq, dk, dk_s, dK, n0, block_n, hk, dim)
            seqinfo.store_k_tile(seq, dv, dv_s, dV, n0, block_n, hk, dim_v)

    return dkdv_prim_func(dim, dim_v, dtype, varlen, kernel)


attention_bwd_dkdv = tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)(dkdv_kernel)
# ``dq_regs``: TileLang's safe-memory pass (a row and a head test around every element of the dQ
# reduction) is off.  The reduction tests its own rows; every other global access is TMA, or in a
# packed batch the sequence search's reads of cu_seqlens / lengths at entries below the batch
# size and the tail tile's dK / dV stores (``seqinfo.store_k_tail``, rows tested against the
# sequence's end), in bounds by construction: the pass's tests there were redundant (generated
# CUDA read; ``tests/test_kernel_build.py`` keeps the dense kernel's pointers to dQacc alone).
attention_bwd_dkdv_regs = tilelang.jit(target=TARGET, pass_configs=SELF_GUARDED_PASS_CONFIGS)(dkdv_kernel)


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def attention_bwd_dq(
    dim: int,
    dim_v: int,
    dtype: str,
    has_softcap: bool,
    varlen: bool = False,
    block_m: int = 128,
    block_n: int = 64,
    num_stages: int = 2,
    threads: int = 256,
):
    """Deterministic dQ: one CTA per (query block, head, batch), keys in a fixed order.

    Arguments: Q, K, V, dO, LSE2, Delta, dQ (B, Sq, H, dim) output in the input dtype, then
    the same scalars as ``attention_bwd_dkdv``.
    """
    acc = T.float32
    probabilities, score_grad, keep_visible = score_gradients(block_m, block_n, False, has_softcap)

    @T.macro
    def kernel(Q, K, V, dO, LSE2, Delta, dQ, score_scale, sm_scale, cap_in, left, right, seqs):
        H, Hkv = Q.shape[2], K.shape[2]
        with T.Kernel(*seqs.grid(block_m, H), threads=threads) as ids:
            bx, h, b = seqs.tile(ids, block_m, H, threads)
            q_s = T.alloc_shared([block_m, dim], dtype)
            do_s = T.alloc_shared([block_m, dim_v], dtype)
            k_s = T.alloc_shared([block_n, dim], dtype)
            v_s = T.alloc_shared([block_n, dim_v], dtype)
            ds_s = T.alloc_shared([block_m, block_n], dtype)
            dq_s = T.alloc_shared([block_m, dim], dtype)
            lse = T.alloc_fragment([block_m], acc)
            delta = T.alloc_fragment([block_m], acc)
            s = T.alloc_fragment([block_m, block_n], acc)
            dp = T.alloc_fragment([block_m, block_n], acc)
            ds = T.alloc_fragment([block_m, block_n], dtype)
            dq = T.alloc_fragment([block_m, dim], acc)
            cap = T.alloc_fragment([block_m, block_n], acc) if has_softcap else None

            seq = seqs.of(b)
            mask = TileMask(seq, left, right)
            m0, kb_lo, n_blocks, last_row = query_tile(bx, block_m, block_n, mask)
            hk = h // (H // Hkv)

            T.copy(seq.q_rows(Q, m0, block_m, h), q_s)
            T.copy(seq.q_rows(dO, m0, block_m, h), do_s)
            T.copy(seq.stat(LSE2, h, m0, block_m), lse)
            T.copy(seq.stat(Delta, h, m0, block_m), delta)
            T.clear(dq)

            for t in T.Pipelined(pipelined_trips(n_blocks), num_stages=num_stages):
                n0 = (kb_lo + t) * block_n
                T.copy(seq.k_rows(K, n0, block_n, hk), k_s)
                T.copy(seq.k_rows(V, n0, block_n, hk), v_s)
                T.gemm(q_s, k_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(do_s, v_s, dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                probabilities(s, cap, lse, score_scale, cap_in)
                keep_visible(s, block_fully_visible(last_row, n0, n0 + block_n - 1, m0, mask), m0, n0, mask)
                score_grad(ds, s, dp, delta, cap, sm_scale)
                T.copy(ds, ds_s)
                T.gemm(ds_s, k_s, dq, policy=T.GemmWarpPolicy.FullRow)

            seqinfo.store_q_tile(seq, dq, dq_s, dQ, m0, block_m, h, dim)

    return dq_prim_func(dim, dim_v, dtype, varlen, kernel)
