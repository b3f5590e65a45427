"""dK/dV backward for wide heads (d = 256): each consumer warpgroup owns a column half.

Same arguments, semantics and static structure as ``bwd.attention_bwd_dkdv`` (default mode:
dQ by TMA reduce-add into the fp32 accumulator).  Not in the tile table yet
(``configs.BwdConfig.replicate_scores``; NOTES, forty-second session): built so that one
device call can time it against the builder's d = 256 kernel.

Why: at d = 256 a key block of 64 keys is one WGMMA row block, so the two consumer warpgroups
cannot split rows as they do up to d = 128; the builder's kernel splits S^T's query columns
between them (N = 32 WGMMAs, 192 B of shared memory per clock where the memory gives 128) and
hands P^T and dS^T over through shared memory behind a consumer-wide barrier every step.
cuDNN's d = 256 backward (SASS of the thirty-sixth session's profile) does what this kernel
does instead: both warpgroups compute the whole 64 x 64 S^T and dP^T (N = 64, 7/5 of the
backward's FLOPs), so P^T and dS^T are in each warpgroup's own registers as the A operand of
its 128-column half of dV and dK, and the warpgroups never wait for each other inside a step.

Roles (one CTA per key block of 64 keys and kv head; K and V stationary as column halves):

* loader warp: each step's dO + Delta, then Q + lse, by TMA into one stage each (column
  halves, so every GEMM operand is a whole buffer);
* dQ writer warp: each warpgroup's 64 x 128 fp32 dQ half reduce-added into the accumulator;
* two consumer warpgroups, warpgroup w owning columns [128 w, 128 w + 128) of dK, dV, dQ:

      issue dP^T = V dO^T (both halves of the head dim)   <- dO was loaded during the last step
      wait Q; issue S^T = K Q^T; wait both
      P^T = exp2(S^T - lse), mask; dS^T = P^T (dP^T - Delta)
      issue dV_w += P^T dO_w and dK_w += dS^T Q_w            (A from registers)
      dS^T -> this warpgroup's shared copy; issue dQ_w = dS K_w
      wait dV: release dO; wait the rest: release Q; dQ_w -> shared for the writer

One Q / dO stage: two do not fit (K, V, Q, dO 128 KB, two dS^T copies 16 KB, two dQ halves
64 KB).  dP^T goes first so that the next step's Q load (issued when both warpgroups have
released Q) runs under it, while dO was already loaded halfway through the previous step.
"""

import tilelang
import tilelang.language as T

from . import seqinfo
from .bwd import dkdv_prim_func, key_tail_tests, score_gradients
from .bwd_ws import KeyTileWalk, dense_key_tile, named
from .masks import TileMask, query_block_range
from .pipeline import CONSUMERS_SYNC
from .target import TARGET, WS_PASS_CONFIGS

FULL_ROW = T.GemmWarpPolicy.FullRow  # one warpgroup, 64 key rows
HALF = 128  # head-dim columns a consumer warpgroup owns
DQ_CHUNK = 64  # dQ columns per GEMM (register budget: see compute_steps)
WG_SYNC = 10  # named barriers 10 and 11: one warpgroup's own threads (its dS^T copy is in)


def half(c):
    """Column half ``c`` of a head as ``seqinfo.Sequence.q_rows`` / ``k_rows``' ``cols``."""
    return (c * HALF, HALF)


@tilelang.jit(target=TARGET, pass_configs=WS_PASS_CONFIGS)
def attention_bwd_dkdv_wide(
    dim: int,
    dim_v: int,
    dtype: str,
    has_softcap: bool,
    with_dq: bool,
    varlen: bool = False,
    block_n: int = 64,
    block_m: int = 64,
    num_stages: int = 1,
    threads: int = 256,
    overlap: bool = True,
):
    """Build the PrimFunc; arguments as ``bwd.attention_bwd_dkdv`` (see the module docstring)."""
    assert (dim, dim_v) == (2 * HALF, 2 * HALF), "column halves of 128: d = d_v = 256"
    assert (block_n, block_m, num_stages, threads) == (64, 64, 1, 256) and overlap, "64 keys x 64 queries, one stage, two consumer warpgroups"
    assert not has_softcap, "softcap's tanh tile does not fit the registers: the builder's kernel serves it"
    acc = T.float32
    total = threads + 128  # + the producer warpgroup (loader warp, dQ writer warp)
    loader_end, writer_end = threads + 32, threads + 64
    writer_lane0 = loader_end
    probabilities, score_grad, keep_visible = score_gradients(block_n, block_m, True, False)

    @T.macro
    def load_steps(Q, dO, LSE2, Delta, sm, bars, seq, walk):
        """The loader warp: dO + Delta, then Q + lse, one stage each, column halves."""
        for t in T.serial(walk.n_steps):
            h, m0 = walk.step(t)
            T.barrier_wait(bars.do_empty, (t & 1) ^ 1)
            for c in T.unroll(2):
                T.tma_copy(seq.q_rows(dO, m0, block_m, h, half(c)), sm.do_s[c, :, :], barrier=bars.do_full)
            T.tma_copy(seq.stat(Delta, h, m0, block_m), sm.delta_s, barrier=bars.do_full)
            T.barrier_arrive(bars.do_full)
            T.barrier_wait(bars.q_empty, (t & 1) ^ 1)
            for c in T.unroll(2):
                T.tma_copy(seq.q_rows(Q, m0, block_m, h, half(c)), sm.q_s[c, :, :], barrier=bars.q_full)
            T.tma_copy(seq.stat(LSE2, h, m0, block_m), sm.lse_s, barrier=bars.q_full)
            T.barrier_arrive(bars.q_full)

    @T.macro
    def write_steps(dQacc, sm, bars, seq, walk):
        """The dQ writer warp: both warpgroups' dQ halves of each step, reduce-added by TMA."""
        for t in T.serial(walk.n_steps):
            h, m0 = walk.step(t)
            for c in T.unroll(2):
                T.barrier_wait(bars.dq_full[c], t & 1)
                T.atomic_add(seq.q_rows(dQacc, m0, block_m, h, half(c)), sm.dq_s[c, :, :], use_tma=True)
                if T.get_thread_binding() == writer_lane0:
                    T.barrier_arrive(bars.dq_empty[c])

    @T.macro
    def dq_chunk(w, c, fr, sm):
        """Issue dQ's columns [64 c, 64 c + 64) of warpgroup ``w``'s half: dS (from its shared
        dS^T copy) times those columns of its K half."""
        T.wgmma_gemm(sm.ds_s[w, :, :], sm.k_s[w, :, c * DQ_CHUNK : (c + 1) * DQ_CHUNK], fr.dq, transpose_A=True,
                     clear_accum=True, policy=FULL_ROW)

    @T.macro
    def compute_steps(w, fr, sm, bars, mask, n0, walk, last_col, score_scale, sm_scale, cap_in):
        """Consumer warpgroup ``w`` (a Python int: its buffers are compile-time): every step."""
        for t in T.serial(walk.n_steps):
            h, m0 = walk.step(t)
            T.barrier_wait(bars.do_full, t & 1)
            T.wgmma_gemm(sm.v_s[0, :, :], sm.do_s[0, :, :], fr.dpT, transpose_B=True, clear_accum=True, policy=FULL_ROW)
            T.wgmma_gemm(sm.v_s[1, :, :], sm.do_s[1, :, :], fr.dpT, transpose_B=True, policy=FULL_ROW)
            T.barrier_wait(bars.q_full, t & 1)
            T.wgmma_gemm(sm.k_s[0, :, :], sm.q_s[0, :, :], fr.sT, transpose_B=True, clear_accum=True, policy=FULL_ROW)
            T.wgmma_gemm(sm.k_s[1, :, :], sm.q_s[1, :, :], fr.sT, transpose_B=True, policy=FULL_ROW)
            T.wait_wgmma(0)
            probabilities(fr.sT, None, sm.lse_s, score_scale, cap_in)
            interior, tail = key_tail_tests(m0, n0, block_m, block_n, last_col, mask)
            keep_visible(fr.sT, interior, m0, n0, mask, tail)
            T.copy(fr.sT, fr.pT)
            # dS^T before any GEMM of the step reads P^T: S^T and dP^T (64 registers) are
            # dead before the dV / dK / dQ accumulators' GEMMs run.
            score_grad(fr.dsT, fr.sT, fr.dpT, sm.delta_s, None, sm_scale)
            T.wgmma_gemm(fr.pT, sm.do_s[w, :, :], fr.dv, policy=FULL_ROW)
            T.wgmma_gemm(fr.dsT, sm.q_s[w, :, :], fr.dk, policy=FULL_ROW)
            if with_dq:
                T.copy(fr.dsT, sm.ds_s[w, :, :])
                T.fence_proxy_async()
                T.sync_threads(WG_SYNC + w, 128)  # the whole warpgroup's dS^T is in
                dq_chunk(w, 0, fr, sm)
                T.wait_wgmma(2)
            else:
                T.wait_wgmma(1)
            T.barrier_arrive(bars.do_empty)  # dV has read dO (and Delta is read)
            T.wait_wgmma(0)
            T.barrier_arrive(bars.q_empty)  # dK has read Q (dQ reads dS^T and K only)
            if with_dq:
                # dQ in two 64-column chunks through one 32-register fragment: a whole
                # 64 x 128 one (64 registers) made ptxas serialise every WGMMA of the kernel
                # for want of registers (C7512).
                T.barrier_wait(bars.dq_empty[w], (t & 1) ^ 1)  # the writer is done with step t-1
                T.copy(fr.dq, sm.dq_s[w, :, 0:DQ_CHUNK])
                dq_chunk(w, 1, fr, sm)
                T.wait_wgmma(0)
                T.copy(fr.dq, sm.dq_s[w, :, DQ_CHUNK:HALF])
                T.fence_proxy_async()
                T.barrier_arrive(bars.dq_full[w])

    @T.macro
    def store_half(w, fr, sm, dK, dV, seq, n0, hk):
        """Warpgroup ``w``'s dK / dV columns: staged through its K / V halves by TMA, or a
        packed sequence's tail tile by row-guarded stores from registers."""
        whole = seqinfo.whole_tile(seq, n0, block_n, (HALF,), keys=True)
        if whole:
            T.copy(fr.dk, sm.k_s[w, :, :])
            T.copy(fr.dv, sm.v_s[w, :, :])
            T.fence_proxy_async()
            T.sync_threads(WG_SYNC + w, 128)
            T.copy(sm.k_s[w, :, :], seq.k_rows(dK, n0, block_n, hk, half(w)))
            T.copy(sm.v_s[w, :, :], seq.k_rows(dV, n0, block_n, hk, half(w)))
        else:
            seqinfo.store_k_tail(seq, fr.dk, dK, n0, block_n, hk, HALF, c0=w * HALF)
            seqinfo.store_k_tail(seq, fr.dv, dV, n0, block_n, hk, HALF, c0=w * HALF)

    def fragments():
        """One warpgroup's registers (each set is laid out over its own 128 threads)."""
        return named(
            sT=T.alloc_fragment([block_n, block_m], acc),
            dpT=T.alloc_fragment([block_n, block_m], acc),
            pT=T.alloc_fragment([block_n, block_m], dtype),
            dsT=T.alloc_fragment([block_n, block_m], dtype),
            dk=T.alloc_fragment([block_n, HALF], acc),
            dv=T.alloc_fragment([block_n, HALF], acc),
            dq=T.alloc_fragment([block_m, DQ_CHUNK], acc) if with_dq else None,
        )

    @T.macro
    def kernel(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV, Ticket, score_scale, sm_scale, cap_in, left, right, rows_per_group, seqs):
        H, Hkv = Q.shape[2], K.shape[2]
        key_blocks = T.ceildiv(seqs.max_k, block_n)
        extent = seqs.grid(block_n, Hkv, keys=True)[0] if seqs.varlen else key_blocks * Hkv * seqs.batch
        with T.Kernel(extent, threads=total) as cta:
            if seqs.varlen:
                bx, hk, b = seqs.tile(cta, block_n, Hkv, total, keys=True, head_group=rows_per_group)
            else:
                bx, hk, b = dense_key_tile(cta, key_blocks, Hkv, seqs.batch, rows_per_group)
            k_s = T.alloc_shared([2, block_n, HALF], dtype)
            v_s = T.alloc_shared([2, block_n, HALF], dtype)
            q_s = T.alloc_shared([2, block_m, HALF], dtype)
            do_s = T.alloc_shared([2, block_m, HALF], dtype)
            lse_s = T.alloc_shared([block_m], acc)
            delta_s = T.alloc_shared([block_m], acc)
            ds_s = T.alloc_shared([2, block_n, block_m], dtype) if with_dq else None
            dq_s = T.alloc_shared([2, block_m, HALF], acc) if with_dq else None
            sm = named(k_s=k_s, v_s=v_s, q_s=q_s, do_s=do_s, lse_s=lse_s, delta_s=delta_s, ds_s=ds_s, dq_s=dq_s)
            fr0, fr1 = fragments(), fragments()
            bar_kv = T.alloc_barrier(arrive_count=total)
            bars = named(
                q_full=T.alloc_barrier(arrive_count=32),
                do_full=T.alloc_barrier(arrive_count=32),
                q_empty=T.alloc_barrier(arrive_count=threads),
                do_empty=T.alloc_barrier(arrive_count=threads),
                dq_full=T.alloc_barrier(arrive_count=[128, 128]) if with_dq else None,
                dq_empty=T.alloc_barrier(arrive_count=[1, 1]) if with_dq else None,
            )

            tx = T.get_thread_binding()
            n0 = bx * block_n
            seq = seqs.of(b)
            mask = TileMask(seq, left, right)
            qb_lo, n_qblocks, last_col = query_block_range(n0, block_n, block_m, mask)
            walk = KeyTileWalk(hk, H // Hkv, qb_lo, n_qblocks, block_m)

            for c in T.unroll(2):
                T.tma_copy(seq.k_rows(K, n0, block_n, hk, half(c)), k_s[c, :, :], barrier=bar_kv)
                T.tma_copy(seq.k_rows(V, n0, block_n, hk, half(c)), v_s[c, :, :], barrier=bar_kv)
            T.barrier_arrive(bar_kv)

            if tx >= threads:
                T.set_max_nreg(24, 0)
                if tx < loader_end:
                    load_steps(Q, dO, LSE2, Delta, sm, bars, seq, walk)
                elif with_dq and tx < writer_end:
                    write_steps(dQacc, sm, bars, seq, walk)
            else:
                T.set_max_nreg(240, 1)
                T.barrier_wait(bar_kv, 0)
                if tx < 128:
                    T.clear(fr0.dk)
                    T.clear(fr0.dv)
                    compute_steps(0, fr0, sm, bars, mask, n0, walk, last_col, score_scale, sm_scale, cap_in)
                else:
                    T.clear(fr1.dk)
                    T.clear(fr1.dv)
                    compute_steps(1, fr1, sm, bars, mask, n0, walk, last_col, score_scale, sm_scale, cap_in)
                # Both warpgroups' last S^T / dP^T (which read all of K and V) are done before
                # either half turns into a dK / dV staging tile.
                T.sync_threads(CONSUMERS_SYNC, threads)
                if tx < 128:
                    store_half(0, fr0, sm, dK, dV, seq, n0, hk)
                else:
                    store_half(1, fr1, sm, dK, dV, seq, n0, hk)

    return dkdv_prim_func(dim, dim_v, dtype, varlen, kernel)
