"""Forward with hand-written warp specialisation: FA3's intra-warpgroup overlap.

Same arguments, semantics and static structure as ``fwd.attention_fwd_kernel``; the tile
table (``configs.fwd_config``, ``manual_ws=True``) picks it where it measured faster (head
dims 65..128 on H200: 0.93-1.08x cuDNN at 4k-16k against 0.89-0.95x).

One producer warpgroup issues TMA loads of K and V into two-stage rings guarded by full/empty
mbarriers; two consumer warpgroups (64 query rows each) run, per key block t >= 1:

    issue S_t = Q K_t^T          (async WGMMA)
    O *= alpha_{t-1}             <- under S_t
    issue O += P_{t-1} V_{t-1}   (async WGMMA, P in registers)
    wait for S_t, release K_t; online softmax of S_t   <- under the P V GEMM
    wait for P V, release V_{t-1}; P = cast(S_t)

TileLang's automatic pipeliner releases a K/V stage right after the GEMM *statement*, which
is only safe for synchronous GEMMs; here stages are released after ``T.wait_wgmma``.

CTAs walk pairs of query tiles (``tile_pair``), optionally persistently: the producer loads
the next tile's Q as soon as the consumers' last S GEMM of a tile retired, so the epilogue
of one tile overlaps the loads of the next.
"""

import tilelang
import tilelang.language as T

from .fwd import TARGET, forward_prim_func
from .masks import query_tile
from .ring import CONSUMERS_SYNC, WS_PASS_CONFIGS, kv_ring_barriers, kv_ring_producer
from .softmax import online_softmax, tile_fragments

FULL_ROW = T.GemmWarpPolicy.FullRow  # each consumer warpgroup owns 64 query rows


def tile_pair(item, half, n_qb, pairs, H):
    """Query tile ``half`` (0 or 1) of work item ``item``: (h, b, bx, real).

    An item is a pair of query blocks of one (batch, head) row: ``bx`` and its mirror
    ``n_qb - 1 - bx`` (``bx`` in ``query_tile``'s longest-first numbering), so under a causal
    mask every item holds about the same number of key blocks and a static round-robin over
    items stays balanced.  ``real`` is false for the mirror of the middle block of an odd row.
    """
    pair = item % pairs
    row = item // pairs
    mirror = n_qb - 1 - pair
    return row % H, row // H, T.if_then_else(half == 0, pair, mirror), T.Or(half == 0, mirror != pair)


@tilelang.jit(target=TARGET, pass_configs=WS_PASS_CONFIGS)
def attention_fwd_ws_kernel(
    dim: int,
    dim_v: int,
    dtype: str,
    has_sinks: bool,
    has_softcap: bool,
    block_m: int = 128,
    block_n: int = 128,
    num_stages: int = 2,
    threads: int = 256,
    persistent: bool = False,
    sm_count: int = 132,
):
    """Build the PrimFunc; arguments as ``fwd.attention_fwd_kernel``.

    Each CTA walks work items (``tile_pair``): one item per CTA, or with ``persistent`` a
    grid of ``sm_count`` CTAs striding over all items, so that the next tile's Q and K/V load
    while the consumers finish the last one (no per-tile launch, prologue or epilogue gap).
    """
    assert num_stages == 2 and threads == 256 and block_m == 128, "the hand-written ring is 2 stages, 2 consumer warpgroups"
    shapes = B, Sq, Sk, H, Hkv = T.dynamic("B, Sq, Sk, H, Hkv")
    acc = T.float32
    total = threads + 128  # + one producer warpgroup
    update, finish = online_softmax(block_m, block_n, dim_v, has_sinks, has_softcap)
    load_kv = kv_ring_producer(block_n)

    @T.macro
    def rescale(o, alpha):
        for r, c in T.Parallel(block_m, dim_v):
            o[r, c] *= alpha[r]

    @T.macro
    def kernel(Q, K, V, O, LSE, Sinks, score_scale, cap_in, left, right):
        n_qb = T.ceildiv(Sq, block_m)
        pairs = T.ceildiv(n_qb, 2)
        n_items = pairs * H * B
        grid = T.min(n_items, sm_count) if persistent else n_items
        with T.Kernel(grid, threads=total) as cta:
            q_s = T.alloc_shared([block_m, dim], dtype)
            k_s = T.alloc_shared([2, block_n, dim], dtype)
            v_s = T.alloc_shared([2, block_n, dim_v], dtype)
            o_s = T.alloc_shared([block_m, dim_v], dtype)  # not Q's tile: the next Q loads under the epilogue
            s, p, o, m, m_prev, m_safe, alpha, row_sum, l, lse = tile_fragments(block_m, block_n, dim_v, dtype)

            q_full = T.alloc_barrier(arrive_count=128)
            q_empty = T.alloc_barrier(arrive_count=threads)
            k_full, v_full, k_empty, v_empty = kv_ring_barriers(threads)
            # Every tile uses both ring stages ceil(n_blocks / 2) times (an odd tile pads stage
            # 1 with an empty turn), so each tile starts on stage 0 and stage indices stay
            # compile-time constants; ``phase`` carries the barriers' parity across tiles.
            phase = T.alloc_var(T.int32, init=0)
            tiles_done = T.alloc_var(T.int32, init=0)
            # The tile's query block in a register: as an expression it lowers to a branch on
            # ``half`` at every use inside the main loop.
            tile_bx = T.alloc_var(T.int32, init=0)

            tx = T.get_thread_binding()
            off = Sk - Sq
            groups = H // Hkv
            if tx >= threads:  # producer
                T.set_max_nreg(24, 0)
                for it in T.serial(T.ceildiv(n_items - cta, grid)):
                    for half in T.serial(2):
                        h, b, bx, real = tile_pair(cta + it * grid, half, n_qb, pairs, H)
                        tile_bx = bx
                        if real:
                            m0, kb_lo, n_blocks, last_row = query_tile(tile_bx, block_m, block_n, Sq, Sk, left, right)
                            T.barrier_wait(q_empty, (tiles_done & 1) ^ 1)  # the consumers' last S GEMM read Q
                            T.tma_copy(Q[b, m0 : m0 + block_m, h, :], q_s, barrier=q_full)
                            T.barrier_arrive(q_full)
                            load_kv(K, V, k_s, v_s, k_full, v_full, k_empty, v_empty, kb_lo, n_blocks, h // groups, b, phase)
                            if n_blocks % 2 == 1:
                                T.barrier_wait(k_empty[1], ((n_blocks // 2) & 1) ^ 1 ^ phase)
                                T.barrier_arrive(k_full[1])
                                T.barrier_wait(v_empty[1], ((n_blocks // 2) & 1) ^ 1 ^ phase)
                                T.barrier_arrive(v_full[1])
                            phase = phase ^ (T.ceildiv(n_blocks, 2) & 1)
                            tiles_done = tiles_done + 1
            else:  # two consumer warpgroups
                T.set_max_nreg(240, 1)
                for it in T.serial(T.ceildiv(n_items - cta, grid)):
                    for half in T.serial(2):
                        h, b, bx, real = tile_pair(cta + it * grid, half, n_qb, pairs, H)
                        tile_bx = bx
                        if real:
                            m0, kb_lo, n_blocks, last_row = query_tile(tile_bx, block_m, block_n, Sq, Sk, left, right)
                            mask_args = (m0, last_row, off, Sk, left, right, score_scale, cap_in)
                            T.clear(o)
                            T.clear(l)
                            T.fill(m, -T.infinity(acc))
                            T.barrier_wait(q_full, tiles_done & 1)
                            # Block 0 alone: nothing to overlap yet.
                            if n_blocks > 0:
                                T.barrier_wait(k_full[0], phase)
                                T.wgmma_gemm(q_s, k_s[0, :, :], s, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                                T.wait_wgmma(0)
                                T.barrier_arrive(k_empty[0])
                                update(s, m, m_prev, m_safe, alpha, row_sum, l, kb_lo * block_n, *mask_args)
                                T.copy(s, p)
                            # Blocks t >= 1, two per trip so that ring stages are compile-time
                            # indices: K_t sits in stage 1 - st, V_{t-1} in stage st.  Every wgmma
                            # retires inside the trip (no wait behind a branch), or ptxas
                            # serialises all of them.
                            for i in T.serial(T.ceildiv(n_blocks - 1, 2)):
                                for st in T.unroll(2):
                                    t = i * 2 + 1 + st
                                    if t < n_blocks:
                                        T.barrier_wait(k_full[1 - st], ((i + st) & 1) ^ phase)
                                        T.wgmma_gemm(q_s, k_s[1 - st, :, :], s, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                                        rescale(o, alpha)  # O *= alpha_{t-1} while S_t runs
                                        T.barrier_wait(v_full[st], (i & 1) ^ phase)
                                        T.wgmma_gemm(p, v_s[st, :, :], o, policy=FULL_ROW)
                                        T.wait_wgmma(1)
                                        T.barrier_arrive(k_empty[1 - st])
                                        update(s, m, m_prev, m_safe, alpha, row_sum, l, (kb_lo + t) * block_n, *mask_args)
                                        T.wait_wgmma(0)
                                        T.barrier_arrive(v_empty[st])
                                        T.copy(s, p)
                            T.barrier_arrive(q_empty)  # every S GEMM of the tile has retired
                            # The last block's P V (its V sits in stage (n_blocks - 1) % 2).
                            if n_blocks > 0:
                                last = n_blocks - 1
                                for st in T.unroll(2):
                                    if last % 2 == st:
                                        rescale(o, alpha)
                                        T.barrier_wait(v_full[st], ((last // 2) & 1) ^ phase)
                                        T.wgmma_gemm(p, v_s[st, :, :], o, policy=FULL_ROW)
                                        T.wait_wgmma(0)
                                        T.barrier_arrive(v_empty[st])  # the next tile reuses the stage
                            if n_blocks % 2 == 1:  # stage 1's empty turn
                                T.barrier_wait(k_full[1], ((n_blocks // 2) & 1) ^ phase)
                                T.barrier_arrive(k_empty[1])
                                T.barrier_wait(v_full[1], ((n_blocks // 2) & 1) ^ phase)
                                T.barrier_arrive(v_empty[1])

                            finish(o, m, m_safe, alpha, row_sum, l, lse, Sinks[h], score_scale)
                            T.sync_threads(CONSUMERS_SYNC, threads)  # the last tile's TMA store has read o_s
                            T.copy(o, o_s)
                            T.fence_proxy_async()
                            T.sync_threads(CONSUMERS_SYNC, threads)  # all of o_s written
                            T.copy(o_s, O[b, m0 : m0 + block_m, h, :])
                            T.copy(lse, LSE[b, h, m0 : m0 + block_m])
                            phase = phase ^ (T.ceildiv(n_blocks, 2) & 1)
                            tiles_done = tiles_done + 1

    return forward_prim_func(shapes, dim, dim_v, dtype, kernel)
