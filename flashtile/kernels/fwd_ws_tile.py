"""Forward with hand-written warp specialisation: FA3's intra- and inter-warpgroup overlap.

Same arguments, semantics and static structure as ``fwd.attention_fwd_kernel``; the tile
table (``configs.fwd_config``, ``manual_ws=True``) picks it for head dims up to 128, where it
measured faster than the auto-pipelined kernel.

One producer warpgroup issues TMA loads of K and V into two-stage rings guarded by full/empty
mbarriers; two or three consumer warpgroups (64 query rows each) run, per key block t >= 1:

    [take turn]  issue S_t = Q K_t^T             (async WGMMA)
                 issue O += P_{t-1} V_{t-1}      (async WGMMA, P in registers)
    [pass turn]  wait for S_t, release K_t; online softmax of S_t   <- under the P V GEMM
                 wait for P V, release V_{t-1}; P = cast(S_t); O *= alpha_t

With ``pingpong`` the turns (``gemm_turns``) make the warpgroups issue their GEMMs one after
the other, so one warpgroup's softmax runs under the others' GEMMs.  Without it, O is
rescaled by alpha_{t-1} between the two issues instead, under S_t.

TileLang's automatic pipeliner releases a K/V stage right after the GEMM *statement*, which
is only safe for synchronous GEMMs; here stages are released after ``T.wait_wgmma``.
"""

import tilelang
import tilelang.language as T

from .fwd import PASS_CONFIGS, TARGET, forward_prim_func
from .masks import query_tile
from .ring import kv_ring_barriers, kv_ring_producer
from .softmax import online_softmax, tile_fragments

FULL_ROW = T.GemmWarpPolicy.FullRow  # each consumer warpgroup owns 64 query rows


# First named barrier of the pingpong turns, one per consumer warpgroup (TileLang's own
# syncs use low ids: 3 for its consumer-wide epilogue barrier).
TURN_BARRIER = 9
# Registers per thread (setmaxnreg) by consumer warpgroup count: the producer keeps 24 and
# the consumers split the rest of the 64K-entry register file.
CONSUMER_REGS = {2: 240, 3: 160}


def gemm_turns(pingpong: bool, n_wg: int):
    """Macros ``take_turn(wg)`` / ``pass_turn(wg)`` ordering the consumer warpgroups' GEMM issues.

    FA3's inter-warpgroup pingpong: a warpgroup issues its S and P V GEMMs only in its turn and
    hands the turn to the next warpgroup (round robin) right after issuing, so the tensor
    cores run one warpgroup's GEMMs while the others do their softmax, instead of every
    softmax landing in the same gap.  Turn barrier ``w`` completes when warpgroup ``w`` syncs
    (128 threads) and its predecessor arrives (128 threads).  Without pingpong both are empty.
    """

    @T.macro
    def take_turn(wg):
        if pingpong:
            T.sync_threads(TURN_BARRIER + wg, 256)

    @T.macro
    def pass_turn(wg):
        if pingpong:
            T.named_barrier_arrive(TURN_BARRIER + (wg + 1) % n_wg, 256)

    return take_turn, pass_turn


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def attention_fwd_ws_tile_kernel(
    dim: int,
    dim_v: int,
    dtype: str,
    has_sinks: bool,
    has_softcap: bool,
    block_m: int = 128,
    block_n: int = 128,
    num_stages: int = 2,
    threads: int = 256,
    pingpong: bool = False,
    tiles_per_cta: int = 0,
):
    """Build the PrimFunc; arguments as ``fwd.attention_fwd_kernel``, plus ``pingpong``: the
    two consumer warpgroups take turns issuing their GEMMs (see ``gemm_turns``)."""
    n_wg = threads // 128  # consumer warpgroups, 64 query rows each
    assert num_stages == 2 and n_wg in CONSUMER_REGS and block_m == 64 * n_wg, "2-stage ring, 2 or 3 consumer warpgroups of 64 rows"
    shapes = B, Sq, Sk, H, Hkv = T.dynamic("B, Sq, Sk, H, Hkv")
    acc = T.float32
    total = threads + 128  # + one producer warpgroup
    update, finish = online_softmax(block_m, block_n, dim_v, has_sinks, has_softcap)
    load_kv = kv_ring_producer(block_n)
    take_turn, pass_turn = gemm_turns(pingpong, n_wg)

    @T.macro
    def rescale(o, alpha):
        for r, c in T.Parallel(block_m, dim_v):
            o[r, c] *= alpha[r]

    @T.macro
    def kernel(Q, K, V, O, LSE, Sinks, score_scale, cap_in, left, right):
        with T.Kernel(T.ceildiv(Sq, block_m), H, B, threads=total) as (bx, h, b):
            q_s = T.alloc_shared([block_m, dim], dtype)
            k_s = T.alloc_shared([2, block_n, dim], dtype)
            v_s = T.alloc_shared([2, block_n, dim_v], dtype)
            # Q is dead after the last S GEMM: its tile holds the output when shapes agree
            # (d=256 would not fit 227 KB of shared memory otherwise).
            o_s = q_s if dim_v == dim else T.alloc_shared([block_m, dim_v], dtype)
            s, p, o, m, m_prev, m_safe, alpha, row_sum, l, lse = tile_fragments(block_m, block_n, dim_v, dtype)

            bar_q = T.alloc_barrier(arrive_count=total)
            k_full, v_full, k_empty, v_empty = kv_ring_barriers(threads)

            tx = T.get_thread_binding()
            wg = tx // 128  # consumer warpgroup
            m0, kb_lo, n_blocks, last_row = query_tile(bx, block_m, block_n, Sq, Sk, left, right)
            hk = h // (H // Hkv)
            off = Sk - Sq
            mask_args = (m0, last_row, off, Sk, left, right, score_scale, cap_in)

            T.tma_copy(Q[b, m0 : m0 + block_m, h, :], q_s, barrier=bar_q)
            T.barrier_arrive(bar_q)

            if tx >= threads:  # producer
                T.set_max_nreg(24, 0)
                load_kv(K, V, k_s, v_s, k_full, v_full, k_empty, v_empty, kb_lo, n_blocks, hk, b)
            else:  # two consumer warpgroups
                T.set_max_nreg(CONSUMER_REGS[n_wg], 1)
                T.clear(o)
                T.clear(l)
                T.fill(m, -T.infinity(acc))
                T.barrier_wait(bar_q, 0)
                if wg == n_wg - 1 and n_blocks > 0:
                    pass_turn(wg)  # the last warpgroup hands warpgroup 0 the first turn
                # Block 0 alone: nothing to overlap yet.
                if n_blocks > 0:
                    T.barrier_wait(k_full[0], 0)
                    take_turn(wg)
                    T.wgmma_gemm(q_s, k_s[0, :, :], s, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                    pass_turn(wg)
                    T.wait_wgmma(0)
                    T.barrier_arrive(k_empty[0])
                    update(s, m, m_prev, m_safe, alpha, row_sum, l, kb_lo * block_n, *mask_args)
                    T.copy(s, p)
                # Blocks t >= 1, two per trip so that ring stages are compile-time indices:
                # K_t sits in stage 1 - st, V_{t-1} in stage st.  Every wgmma retires inside
                # the trip (no wait behind a branch), or ptxas serialises all of them.
                for i in T.serial(T.ceildiv(n_blocks - 1, 2)):
                    for st in T.unroll(2):
                        t = i * 2 + 1 + st
                        if t < n_blocks:
                            T.barrier_wait(k_full[1 - st], (i + st) & 1)
                            take_turn(wg)
                            T.wgmma_gemm(q_s, k_s[1 - st, :, :], s, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                            if not pingpong:
                                rescale(o, alpha)  # O *= alpha_{t-1} while S_t runs
                            T.barrier_wait(v_full[st], i & 1)
                            T.wgmma_gemm(p, v_s[st, :, :], o, policy=FULL_ROW)
                            pass_turn(wg)
                            T.wait_wgmma(1)
                            T.barrier_arrive(k_empty[1 - st])
                            update(s, m, m_prev, m_safe, alpha, row_sum, l, (kb_lo + t) * block_n, *mask_args)
                            T.wait_wgmma(0)
                            T.barrier_arrive(v_empty[st])
                            T.copy(s, p)
                            if pingpong:
                                rescale(o, alpha)  # O *= alpha_t: the turn is the other warpgroup's
                # The last block's P V (its V sits in stage (n_blocks - 1) % 2).
                if n_blocks > 0:
                    last = n_blocks - 1
                    for st in T.unroll(2):
                        if last % 2 == st:
                            if not pingpong:
                                rescale(o, alpha)
                            T.barrier_wait(v_full[st], (last // 2) & 1)
                            T.wgmma_gemm(p, v_s[st, :, :], o, policy=FULL_ROW)
                            T.wait_wgmma(0)

                finish(o, m, m_safe, alpha, row_sum, l, lse, Sinks[h], score_scale)
                T.copy(o, o_s)
                T.copy(o_s, O[b, m0 : m0 + block_m, h, :])
                T.copy(lse, LSE[b, h, m0 : m0 + block_m])

    return forward_prim_func(shapes, dim, dim_v, dtype, kernel)
