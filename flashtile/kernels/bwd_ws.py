"""Backward kernels with hand-written warp specialisation (head dims up to 128).

``attention_bwd_dkdv_ws``: same arguments, semantics and static structure as
``bwd.attention_bwd_dkdv``; the tile table (``configs.bwd_config``, ``manual_ws=True``) picks
it where it measured faster (H200 d=128: -9.5% time against the auto-pipelined kernel, -3..-6%
more with dQ issued before dK).  ``attention_bwd_dq_ws`` (end of file) is the deterministic
mode's dQ kernel (``configs.bwd_dq_config``).

Why by hand: under TileLang's automatic pipeliner a shared-memory stage is released right
after the last GEMM *statement* that reads it, so the dV, dK and dQ GEMMs have to be
synchronous, and each step ends in four consumer-wide barriers (dS to shared memory, dQ GEMM,
dQ to shared memory, the TMA reduce-add).  Here the stages are released after
``T.wait_wgmma`` and the dQ reduce-add belongs to its own warp.

Roles (one CTA per key block of 128 keys, K and V stationary in shared memory):

* loader warp: TMA loads of Q + lse and dO + Delta for each step into two-stage rings
  (full/empty mbarriers), walking every (query head of the GQA group, query block) pair that
  can see this key block;
* dQ writer warp (default mode): waits until the consumers have put a step's dQ tile into
  shared memory, issues its TMA reduce-add into the fp32 accumulator, waits until TMA has read
  the tile and hands the buffer back;
* two consumer warpgroups (64 keys each), per step:

      issue S^T = K Q^T and dP^T = V dO^T         (async WGMMA)
      wait S^T; P^T = exp2(S^T - lse), mask        <- under dP^T
      wait dP^T; issue dV += P^T dO                (async, P^T from registers)
      dS^T = P^T (dP^T - Delta)                    <- under dV
      dS^T -> shared; consumer barrier
      issue dQ = dS K (both halves of dS^T), then dK += dS^T Q   (async)
      wait dQ; dQ -> shared for the writer         <- under dK
      wait dK; release the Q and dO stages

dS^T is double-buffered in shared memory so that a warpgroup running a step ahead never
overwrites the half its partner's dQ GEMM still reads.

With ``dq_turns`` (d <= 96, ``configs.bwd_config``) the warpgroups take turns instead of
splitting dQ's columns: after writing its half of dS^T each arrives on an mbarrier
(``ds_full``) and issues dK; warpgroup ``t % 2`` then waits for the other half and computes step
t's whole dQ tile (N = d, one GEMM instead of two N = d/2 ones) for the writer, while the other
goes on to step t + 1.  No consumer-wide barrier per step, and each warpgroup pays the dQ wait,
stores and fence every other step (the ncu profile in NOTES, ninth session, found those
phases a quarter of a step's stalls).  The dS^T buffer stays safe: a turn's dQ completes before
its warpgroup arrives on the next step's ``ds_full``, which the other waits for before it
reuses the buffer.  The turn sits at the end of the step on purpose: issuing it a step later
(under the next step's exp2, or behind its dV) measured 4-15% slower at d=64 (NOTES, ninth
session, outcomes 2 and 4).
"""

import tilelang
import tilelang.language as T

from . import seqinfo
from .bwd import dkdv_prim_func, dq_prim_func, key_tail_tests, query_step, score_gradients
from .masks import TileMask, block_fully_visible, query_block_range, query_tile
from .pipeline import CONSUMERS_SYNC, kv_pipeline_barriers, kv_pipeline_producer
from .schedule import grouped_tile
from .target import PASS_CONFIGS, TARGET, WS_PASS_CONFIGS

FULL_ROW = T.GemmWarpPolicy.FullRow  # each consumer warpgroup owns 64 keys of the tile
FULL_COL = T.GemmWarpPolicy.FullCol  # dQ has 64 query rows: the warpgroups split its columns


@tilelang.jit(target=TARGET, pass_configs=WS_PASS_CONFIGS)
def attention_bwd_dkdv_ws(
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
    overlap: bool = True,
    dq_turns: bool = False,
):
    """Build the PrimFunc; arguments as ``bwd.attention_bwd_dkdv``.  ``dq_turns``: the two
    consumer warpgroups take turns computing a step's whole dQ tile (see the module docstring)."""
    assert (block_n, block_m, num_stages, threads) == (128, 64, 2, 256) and overlap, "the hand-written ring is 128 keys x 64 queries, 2 stages, 2 consumer warpgroups"
    acc = T.float32
    total = threads + 128  # + the producer warpgroup (loader warp, dQ writer warp)
    loader_end, writer_end = threads + 32, threads + 64  # producer warps 0 and 1
    writer_lane0 = loader_end  # issues the dQ reduce-add (TileLang elects the range's first thread)
    turns = with_dq and dq_turns
    probabilities, score_grad, keep_visible = score_gradients(block_n, block_m, True, has_softcap)

    @T.macro
    def staged_store(dk, dv, k_s, v_s, dK, dV, seq, n0, hk):
        """dK/dV tiles -> memory through the K/V tiles (TMA stores; this schedule orders its
        shared memory by hand)."""
        # Both warpgroups' last GEMMs (dQ reads all of K) are done before K/V turn into the
        # dK/dV staging tiles.
        T.sync_threads(CONSUMERS_SYNC, threads)
        T.copy(dk, k_s)
        T.copy(dv, v_s)
        T.fence_proxy_async()
        T.sync_threads(CONSUMERS_SYNC, threads)
        T.copy(k_s, seq.k_rows(dK, n0, block_n, hk))
        T.copy(v_s, seq.k_rows(dV, n0, block_n, hk))

    @T.macro
    def dq_turn(ds_s, k_s, dq, dq_s, ds_full, dq_empty, dq_full, st, i):
        """One warpgroup's turn: step 2i+st's dQ = dS K over all 128 keys -> dq_s for the writer."""
        T.barrier_wait(ds_full[st], i & 1)  # the other warpgroup's half of dS^T is in too
        T.wgmma_gemm(ds_s[st, :, :], k_s, dq, transpose_A=True, clear_accum=True, policy=FULL_ROW)
        T.wait_wgmma(0)
        T.barrier_wait(dq_empty, st ^ 1)  # the writer is done with step t-1
        T.copy(dq, dq_s)
        T.fence_proxy_async()
        T.barrier_arrive(dq_full)

    @T.macro
    def kernel(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV, score_scale, sm_scale, cap_in, left, right, rows_per_group, seqs):
        H, Hkv = Q.shape[2], K.shape[2]
        key_blocks = T.ceildiv(seqs.max_k, block_n)
        # Packed batches: real key tiles only, sequence-major (``seqinfo.packed_slots``).
        extent = seqs.grid(block_n, Hkv, keys=True)[0] if seqs.varlen else key_blocks * Hkv * seqs.batch
        with T.Kernel(extent, threads=total) as cta:
            if seqs.varlen:
                # rows_per_group: kv heads of a sequence walked together (``configs.head_group``).
                bx, hk, b = seqs.tile(cta, block_n, Hkv, total, keys=True, head_group=rows_per_group)
            else:
                block, row = grouped_tile(cta, key_blocks, Hkv * seqs.batch, rows_per_group)
                # In registers: as expressions (divisions by a runtime group size) they are
                # re-derived at every use, and nvcc took 3.6x longer over this kernel at d=64.
                bx = T.alloc_var(T.int32, init=block)
                hk = T.alloc_var(T.int32, init=row % Hkv)
                b = T.alloc_var(T.int32, init=row // Hkv)
            # K and V stay for the whole CTA; after the last step they stage dK and dV.
            k_s = T.alloc_shared([block_n, dim], dtype)
            v_s = T.alloc_shared([block_n, dim_v], dtype)
            q_s = T.alloc_shared([2, block_m, dim], dtype)
            do_s = T.alloc_shared([2, block_m, dim_v], dtype)
            lse_s = T.alloc_shared([2 * block_m], acc)  # both stages in one flat buffer
            delta_s = T.alloc_shared([2 * block_m], acc)
            ds_s = T.alloc_shared([2, block_n, block_m], dtype)
            sT = T.alloc_fragment([block_n, block_m], acc)
            dpT = T.alloc_fragment([block_n, block_m], acc)
            pT = T.alloc_fragment([block_n, block_m], dtype)
            dsT = T.alloc_fragment([block_n, block_m], dtype)
            dk = T.alloc_fragment([block_n, dim], acc)
            dv = T.alloc_fragment([block_n, dim_v], acc)
            capT = T.alloc_fragment([block_n, block_m], acc) if has_softcap else None
            if with_dq:
                # Turns: one dQ fragment per warpgroup (each laid out over its own 128 threads).
                dq = [T.alloc_fragment([block_m, dim], acc) for _ in range(2)] if turns else T.alloc_fragment([block_m, dim], acc)
                dq_s = T.alloc_shared([block_m, dim], acc)

            bar_kv = T.alloc_barrier(arrive_count=total)
            q_full = T.alloc_barrier(arrive_count=[32, 32])
            do_full = T.alloc_barrier(arrive_count=[32, 32])
            q_empty = T.alloc_barrier(arrive_count=[threads, threads])
            do_empty = T.alloc_barrier(arrive_count=[threads, threads])
            # Turns: only the warpgroup whose turn it is fills dq_s; ds_full says both halves of
            # a step's dS^T are in shared memory.
            dq_full = T.alloc_barrier(arrive_count=threads // 2 if turns else threads)
            ds_full = T.alloc_barrier(arrive_count=[threads, threads]) if turns else None
            dq_empty = T.alloc_barrier(arrive_count=1)

            tx = T.get_thread_binding()
            n0 = bx * block_n
            groups = H // Hkv
            seq = seqs.of(b)
            mask = TileMask(seq, left, right)
            qb_lo, n_qblocks, last_col = query_block_range(n0, block_n, block_m, mask)
            n_steps = groups * n_qblocks
            n_pairs = T.ceildiv(n_steps, 2)

            T.tma_copy(seq.k_rows(K, n0, block_n, hk), k_s, barrier=bar_kv)
            T.tma_copy(seq.k_rows(V, n0, block_n, hk), v_s, barrier=bar_kv)
            T.barrier_arrive(bar_kv)

            if tx >= threads:
                T.set_max_nreg(24, 0)
                if tx < loader_end:
                    # Two steps per trip so that ring stages are compile-time indices.
                    for i in T.serial(n_pairs):
                        for st in T.unroll(2):
                            t = i * 2 + st
                            if t < n_steps:
                                h, m0 = query_step(t, hk, groups, qb_lo, n_qblocks, block_m)
                                T.barrier_wait(q_empty[st], (i & 1) ^ 1)
                                T.tma_copy(seq.q_rows(Q, m0, block_m, h), q_s[st, :, :], barrier=q_full[st])
                                T.tma_copy(seq.stat(LSE2, h, m0, block_m), lse_s[st * block_m : (st + 1) * block_m], barrier=q_full[st])
                                T.barrier_arrive(q_full[st])
                                T.barrier_wait(do_empty[st], (i & 1) ^ 1)
                                T.tma_copy(seq.q_rows(dO, m0, block_m, h), do_s[st, :, :], barrier=do_full[st])
                                T.tma_copy(seq.stat(Delta, h, m0, block_m), delta_s[st * block_m : (st + 1) * block_m], barrier=do_full[st])
                                T.barrier_arrive(do_full[st])
                elif with_dq and tx < writer_end:
                    for i in T.serial(n_pairs):
                        for st in T.unroll(2):
                            t = i * 2 + st
                            if t < n_steps:
                                h, m0 = query_step(t, hk, groups, qb_lo, n_qblocks, block_m)
                                T.barrier_wait(dq_full, st)  # one use per step: parity = t & 1
                                # Issued and waited for (TMA has read dq_s) by the warp's first lane.
                                # Rows past a packed sequence's end add exact zeros (masked P).
                                T.atomic_add(seq.q_rows(dQacc, m0, block_m, h), dq_s, use_tma=True)
                                if tx == writer_lane0:
                                    T.barrier_arrive(dq_empty)
            else:
                T.set_max_nreg(240, 1)
                T.clear(dk)
                T.clear(dv)
                T.barrier_wait(bar_kv, 0)
                for i in T.serial(n_pairs):
                    for st in T.unroll(2):
                        t = i * 2 + st
                        if t < n_steps:
                            h, m0 = query_step(t, hk, groups, qb_lo, n_qblocks, block_m)
                            T.barrier_wait(q_full[st], i & 1)
                            T.wgmma_gemm(k_s, q_s[st, :, :], sT, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                            T.barrier_wait(do_full[st], i & 1)
                            T.wgmma_gemm(v_s, do_s[st, :, :], dpT, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                            T.wait_wgmma(1)
                            probabilities(sT, capT, lse_s, score_scale, cap_in, st * block_m)
                            interior, key_tail = key_tail_tests(m0, n0, block_m, block_n, last_col, mask)
                            keep_visible(sT, interior, m0, n0, mask, key_tail)
                            T.wait_wgmma(0)
                            T.copy(sT, pT)
                            T.wgmma_gemm(pT, do_s[st, :, :], dv, policy=FULL_ROW)
                            score_grad(dsT, sT, dpT, delta_s, capT, sm_scale, st * block_m)
                            if with_dq:  # dS^T -> shared memory for the dQ GEMM
                                T.copy(dsT, ds_s[st, :, :])
                                T.fence_proxy_async()
                            if turns:
                                T.barrier_arrive(ds_full[st])
                                T.wgmma_gemm(dsT, q_s[st, :, :], dk, policy=FULL_ROW)
                                # Warpgroup st computes this step's dQ (both halves of dS^T, all
                                # 128 keys); the other one goes on to the next step meanwhile.
                                # (Each branch names its own fragment: st is not a Python int.)
                                if tx < 128:
                                    if st == 0:
                                        dq_turn(ds_s, k_s, dq[0], dq_s, ds_full, dq_empty, dq_full, st, i)
                                elif st == 1:
                                    dq_turn(ds_s, k_s, dq[1], dq_s, ds_full, dq_empty, dq_full, st, i)
                            elif with_dq:
                                T.sync_threads(CONSUMERS_SYNC, threads)  # both halves of dS^T written
                                # dQ before dK: dQ's tile goes to the writer while dK runs.
                                T.wgmma_gemm(ds_s[st, :, :], k_s, dq, transpose_A=True, clear_accum=True, policy=FULL_COL)
                                T.wgmma_gemm(dsT, q_s[st, :, :], dk, policy=FULL_ROW)
                                T.wait_wgmma(1)
                                T.barrier_wait(dq_empty, st ^ 1)  # the writer is done with step t-1
                                T.copy(dq, dq_s)
                                T.fence_proxy_async()
                                T.barrier_arrive(dq_full)
                            else:
                                T.wgmma_gemm(dsT, q_s[st, :, :], dk, policy=FULL_ROW)
                            T.wait_wgmma(0)
                            T.barrier_arrive(q_empty[st])
                            T.barrier_arrive(do_empty[st])

                whole = seqinfo.whole_tile(seq, n0, block_n, (dim, dim_v), keys=True)
                if whole:
                    staged_store(dk, dv, k_s, v_s, dK, dV, seq, n0, hk)
                else:  # a packed sequence's tail tile: row-guarded stores from registers
                    seqinfo.store_k_tail(seq, dk, dK, n0, block_n, hk, dim)
                    seqinfo.store_k_tail(seq, dv, dV, n0, block_n, hk, dim_v)

    return dkdv_prim_func(dim, dim_v, dtype, varlen, kernel)


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def attention_bwd_dq_ws(
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
    """Deterministic dQ with hand-written warp specialisation; arguments as ``bwd.attention_bwd_dq``.

    One CTA per (query block, head, batch) owns its dQ rows and walks the key blocks in order,
    so the sum is fixed.  Q and dO stay in shared memory; a producer warpgroup streams K and V
    through the two-stage K/V pipeline of ``pipeline.py``.  Each consumer warpgroup (64 query rows) runs,
    per key block: S = Q K^T and dP = dO V^T issued together, P under dP, then
    dQ += dS K with dS straight from registers (no shared-memory round trip, no consumer
    barrier: the two warpgroups run free of each other and fill each other's gaps).
    """
    assert (block_m, num_stages, threads) == (128, 2, 256), "the hand-written ring is 2 stages, 2 consumer warpgroups"
    acc = T.float32
    total = threads + 128
    probabilities, score_grad, keep_visible = score_gradients(block_m, block_n, False, has_softcap)
    load_kv = kv_pipeline_producer(block_n)

    @T.macro
    def kernel(Q, K, V, dO, LSE2, Delta, dQ, score_scale, sm_scale, cap_in, left, right, seqs):
        H, Hkv = Q.shape[2], K.shape[2]
        with T.Kernel(*seqs.grid(block_m, H), threads=total) as ids:
            bx, h, b = seqs.tile(ids, block_m, H, total)
            q_s = T.alloc_shared([block_m, dim], dtype)  # holds dQ for the store at the end
            do_s = T.alloc_shared([block_m, dim_v], dtype)
            k_s = T.alloc_shared([2, block_n, dim], dtype)
            v_s = T.alloc_shared([2, block_n, dim_v], dtype)
            lse = T.alloc_fragment([block_m], acc)
            delta = T.alloc_fragment([block_m], acc)
            s = T.alloc_fragment([block_m, block_n], acc)
            dp = T.alloc_fragment([block_m, block_n], acc)
            ds = T.alloc_fragment([block_m, block_n], dtype)
            dq = T.alloc_fragment([block_m, dim], acc)
            cap = T.alloc_fragment([block_m, block_n], acc) if has_softcap else None

            bar_qdo = T.alloc_barrier(arrive_count=total)
            k_full, v_full, k_empty, v_empty = kv_pipeline_barriers(threads)

            tx = T.get_thread_binding()
            seq = seqs.of(b)
            mask = TileMask(seq, left, right)
            m0, kb_lo, n_blocks, last_row = query_tile(bx, block_m, block_n, mask)
            hk = h // (H // Hkv)

            T.tma_copy(seq.q_rows(Q, m0, block_m, h), q_s, barrier=bar_qdo)
            T.tma_copy(seq.q_rows(dO, m0, block_m, h), do_s, barrier=bar_qdo)
            T.barrier_arrive(bar_qdo)

            if tx >= threads:  # producer
                T.set_max_nreg(24, 0)
                load_kv(K, V, k_s, v_s, k_full, v_full, k_empty, v_empty, kb_lo, n_blocks, hk, seq)
            else:  # two consumer warpgroups
                T.set_max_nreg(240, 1)
                T.copy(seq.stat(LSE2, h, m0, block_m), lse)
                T.copy(seq.stat(Delta, h, m0, block_m), delta)
                T.clear(dq)
                T.barrier_wait(bar_qdo, 0)
                for i in T.serial(T.ceildiv(n_blocks, 2)):
                    for st in T.unroll(2):
                        t = i * 2 + st
                        if t < n_blocks:
                            n0 = (kb_lo + t) * block_n
                            T.barrier_wait(k_full[st], i & 1)
                            T.wgmma_gemm(q_s, k_s[st, :, :], s, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                            T.barrier_wait(v_full[st], i & 1)
                            T.wgmma_gemm(do_s, v_s[st, :, :], dp, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                            T.wait_wgmma(1)
                            probabilities(s, cap, lse, score_scale, cap_in)
                            keep_visible(s, block_fully_visible(last_row, n0, n0 + block_n - 1, m0, mask), m0, n0, mask)
                            T.wait_wgmma(0)
                            T.barrier_arrive(v_empty[st])
                            score_grad(ds, s, dp, delta, cap, sm_scale)
                            T.wgmma_gemm(ds, k_s[st, :, :], dq, policy=FULL_ROW)
                            T.wait_wgmma(0)
                            T.barrier_arrive(k_empty[st])

                seqinfo.store_q_tile(seq, dq, q_s, dQ, m0, block_m, h, dim)

    return dq_prim_func(dim, dim_v, dtype, varlen, kernel)
