"""Forward with hand-written warp specialisation: FA3's intra- and inter-warpgroup overlap.

Same arguments, semantics and static structure as ``fwd.attention_fwd_kernel``; the tile
table (``configs.fwd_config``, ``manual_ws=True``) picks it at every head dim, where it
measured faster than the auto-pipelined kernel.

One producer warpgroup issues TMA loads of Q and of K and V into two-stage rings guarded by
full/empty mbarriers; two or three consumer warpgroups (64 query rows each) run, per key
block t >= 1 (``block_steps``):

    [take turn]  issue S_t = Q K_t^T             (async WGMMA)
                 issue O += P_{t-1} V_{t-1}      (async WGMMA, P in registers)
    [pass turn]  wait for S_t, release K_t; online softmax of S_t   <- under the P V GEMM
                 wait for P V, release V_{t-1}; P = cast(S_t); O *= alpha_t

(``O *= alpha_t`` only in warps where a row's max moved with ``skip_rescale``.)  The softmax
runs under the P V GEMM in the source and the PTX only: ptxas (CUDA 13.0) moves the second
wait up to just after the row max, in every forward (NOTES, seventeenth session, found in
SASS with ``benchmarks/sass_mix.py``), so in practice the overlap is the pingpong turns'.

With ``pingpong`` the turns (``gemm_turns``) make the warpgroups issue their GEMMs one after
the other, so one warpgroup's softmax runs under the others' GEMMs.  Without it, O is
rescaled by alpha_{t-1} between the two issues instead, under S_t.

``tiles_per_cta``: 1 = one query tile per CTA.  Otherwise a CTA walks pairs of tiles
(``tile_pair``; 0 = persistently, one CTA per SM), and a tile's first turn issues its S_0
together with the previous tile's last P V, whose epilogue then runs after S_0's softmax,
while the producer already loads the next Q into a second buffer: no tile boundary leaves
the tensor cores waiting for a launch, a load or an epilogue.

TileLang's automatic pipeliner releases a K/V stage right after the GEMM *statement*, which
is only safe for synchronous GEMMs; here stages are released after ``T.wait_wgmma``.  The
paired schedule also orders its shared memory by hand (mbarriers and ``CONSUMERS_SYNC``, built
with ``WS_PASS_CONFIGS``); the one-tile schedule keeps TileLang's sync pass.
"""

from types import SimpleNamespace

import tilelang
import tilelang.language as T

from . import seqinfo
from .fwd import forward_prim_func
from .masks import TileMask, pipelined_trips, query_tile
from .operands import Operands, tile_scales
from .pipeline import CONSUMERS_SYNC, kv_pipeline_barriers, kv_pipeline_producer
from .schedule import tile_pair
from .softmax import online_softmax, row_parts_layout, row_weights, tile_fragments
from .target import PASS_CONFIGS, TARGET, WS_PASS_CONFIGS

FULL_ROW = T.GemmWarpPolicy.FullRow  # each consumer warpgroup owns 64 query rows


# First named barrier of the pingpong turns, one per consumer warpgroup (TileLang's own
# syncs use low ids: 3 for its consumer-wide epilogue barrier).
TURN_BARRIER = 9
# Registers per thread (setmaxnreg) by consumer warpgroup count: the producer keeps 24 and
# the consumers split the rest of the 64K-entry register file.
CONSUMER_REGS = {2: 240, 3: 160}


def gemm_turns(pingpong: bool, n_wg: int, softmax_turns: int = 0):
    """The pingpong turns: macros ``take_turn(wg)`` / ``pass_turn(wg)`` around the consumer
    warpgroups' GEMM issues, ``first_turn(wg)``, by which the last warpgroup hands warpgroup 0
    the first turn (in every mode), and ``softmax_turn`` for ``online_softmax`` (None, or the
    turn it takes around each block's softmax).

    FA3's inter-warpgroup pingpong: a warpgroup issues its S and P V GEMMs only in its turn and
    hands the turn to the next warpgroup (round robin) right after issuing, so the tensor
    cores run one warpgroup's GEMMs while the others do their softmax, instead of every
    softmax landing in the same gap.  Turn barrier ``w`` completes when warpgroup ``w`` syncs
    (128 threads) and its predecessor arrives (128 threads).  Without pingpong all are empty.

    ``softmax_turns`` (with ``pingpong``): the turn guards each block's softmax instead of the
    GEMM issues (1: mask, row max, exponentials and row sums; 2: the exponentials and row sums
    only, after the row max, where cuDNN's d = 64 forward puts its turn barrier), so one
    warpgroup at a time uses an SM sub-partition's MUFU and FP pipes (each holds one warp of
    each consumer warpgroup) while the other's GEMMs run.
    """
    assert softmax_turns in (0, 1, 2), softmax_turns

    @T.macro
    def take(wg):
        T.sync_threads(TURN_BARRIER + wg, 256)

    @T.macro
    def hand_on(wg):
        T.named_barrier_arrive(TURN_BARRIER + (wg + 1) % n_wg, 256)

    def when(on: bool, body):
        """``body``, or an empty macro (a Python-level test: nothing is emitted when off)."""
        @T.macro
        def guarded(wg):
            if on:
                body(wg)
        return guarded

    gemm = pingpong and not softmax_turns
    softmax_turn = None
    if pingpong and softmax_turns:
        softmax_turn = SimpleNamespace(take=take, hand_on=hand_on, after_max=softmax_turns == 2)
    return SimpleNamespace(take_turn=when(gemm, take), pass_turn=when(gemm, hand_on),
                           first_turn=when(pingpong, hand_on), softmax_turn=softmax_turn)


def rescaler(block_m: int, dim_v: int, skip: bool):
    """Macro ``rescale(o, alpha)``: ``O *= alpha`` row by row.  ``skip``: only in warps where
    some row's alpha is not 1 (``__any_sync`` keeps the branch uniform over the warp).
    ``online_softmax`` sets alpha to exactly 1 for a row whose max did not move, so skipping
    changes no bit of the result.  At d=256 the multiply is most of a block's per-element work
    (128 accumulator values a thread against 40 scores at 80 keys); with random scores no row
    of a warp moves in ~2/3 of the blocks of a 16k row and ~1/3 at 4k."""

    @T.macro
    def multiply(o, alpha):
        for r, c in T.Parallel(block_m, dim_v):
            o[r, c] *= alpha[r]

    @T.macro
    def rescale(o, alpha):
        if skip:
            moved = T.alloc_var(T.int32, init=0)  # does any of this thread's rows need it?
            for i in T.Parallel(block_m):
                moved = moved | T.Cast(T.int32, alpha[i] != 1.0)
            if T.call_extern(T.int32, "__any_sync", T.uint32(0xFFFFFFFF), moved) != 0:
                multiply(o, alpha)
        else:
            multiply(o, alpha)

    return rescale


def fwd_ws_prim_func(
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
    tiles_per_cta: int = 1,
    varlen: bool = False,
    num_sms: int = 132,
    out_dtype: str = None,
    skip_rescale: bool = False,
    defer_sum: bool = False,
    explicit_syncs: bool = False,
    producer_regs: bool = False,
    softmax_turns: int = 0,
):
    """Build the PrimFunc; arguments as ``fwd.attention_fwd_kernel`` (FP8 with ``out_dtype``), plus ``pingpong`` (the
    consumer warpgroups take turns issuing their GEMMs, ``gemm_turns``) and ``tiles_per_cta``:
    1 = one query tile per CTA, 2 = one pair of tiles, 0 = persistent (``num_sms`` CTAs, one
    per SM of the device, walk all pairs).  ``skip_rescale``: a warp whose rows all kept their max
    skips ``O *= alpha`` (``rescaler``).  ``defer_sum``: ``online_softmax``'s (per-thread partial
    row sums, one all-reduce per tile).  Packed (``varlen``) batches take the one-tile
    schedule: the pairs mirror blocks of one row, which needs every row's block count.
    ``explicit_syncs`` (one tile, dense): the epilogue orders its shared memory itself (the
    paired schedule's ``epilogue``), for a build without TileLang's sync pass.  ``producer_regs``:
    the producer keeps the tile's coordinates in registers (paired: query head, kv head, batch
    entry; one tile: first key block, block count, kv head); as expressions (``tile_pair``'s,
    ``query_tile``'s) they are re-derived, integer divisions included, for every K/V load.
    ``softmax_turns``: the pingpong turns guard each block's softmax (1) or its exponentials (2),
    not the GEMM issues (``gemm_turns``)."""
    n_wg = threads // 128  # consumer warpgroups, 64 query rows each
    assert num_stages == 2 and n_wg in CONSUMER_REGS and block_m == 64 * n_wg, "2-stage ring, 2 or 3 consumer warpgroups of 64 rows"
    assert tiles_per_cta == 1 or not varlen, "packed batches run one tile per CTA"
    assert not explicit_syncs or (tiles_per_cta == 1 and not varlen), "explicit syncs: the dense one-tile schedule"
    ops = Operands(dtype, out_dtype)
    acc = T.float32
    total = threads + 128  # + one producer warpgroup
    turns = gemm_turns(pingpong, n_wg, softmax_turns)
    take_turn, pass_turn = turns.take_turn, turns.pass_turn
    update, finish = online_softmax(block_m, block_n, dim_v, has_sinks, has_softcap, ops.p_offset, defer_sum,
                                    turns.softmax_turn)
    cast_p = ops.p_caster(block_m, block_n)
    v_ring = [2, *ops.v_tile(block_n, dim_v)]  # two stages of V tiles (FP8: V^T tiles)
    load_kv = kv_pipeline_producer(block_n, ops)

    # Tiles end at the sequence's end (``query_tile``) where that saves key blocks: with
    # block_m == block_n both alignments visit the same blocks, and the clamp costs the paired
    # d=128 kernel an 8-byte spill.
    bottom_aligned = block_m != block_n

    rescale = rescaler(block_m, dim_v, skip_rescale)

    @T.macro
    def block_steps(q_tile, k_s, v_s, s, p, o, m, m_prev, m_safe, alpha, row_sum, l, k_full, v_full, k_empty, v_empty,
                    wg, kb_lo, trips, phase, m0, last_row, mask, score_scale, cap_in):
        """Key blocks 1 .. trips - 1 of a tile whose block 0 is done (its P in ``p``)."""
        mask_args = (m0, last_row, mask, score_scale, cap_in)
        # Blocks t >= 1, two per trip so that ring stages are compile-time
        # indices: K_t sits in stage 1 - st, V_{t-1} in stage st.  Every
        # wgmma retires inside the trip (no wait behind a branch), or ptxas
        # serialises all of them.
        for i in T.serial(T.ceildiv(trips - 1, 2)):
            for st in T.unroll(2):
                t = i * 2 + 1 + st
                if t < trips:
                    T.barrier_wait(k_full[1 - st], ((i + st) & 1) ^ phase)
                    take_turn(wg)
                    T.wgmma_gemm(q_tile, k_s[1 - st, :, :], s, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                    if not pingpong:
                        rescale(o, alpha)  # O *= alpha_{t-1} while S_t runs
                    T.barrier_wait(v_full[st], (i & 1) ^ phase)
                    T.wgmma_gemm(p, v_s[st, :, :], o, transpose_B=ops.fp8, policy=FULL_ROW)
                    pass_turn(wg)
                    T.wait_wgmma(1)
                    T.barrier_arrive(k_empty[1 - st])
                    update(s, m, m_prev, m_safe, alpha, row_sum, l, (kb_lo + t) * block_n, *mask_args, None, wg)
                    T.wait_wgmma(0)
                    T.barrier_arrive(v_empty[st])
                    cast_p(s, p)
                    if pingpong:
                        rescale(o, alpha)  # O *= alpha_t: the turn is another warpgroup's

    @T.macro
    def epilogue(o, m, m_safe, alpha, row_sum, l, lse, o_s, O, LSE, sink, score_scale, m0, h, seq, out_scale=None):
        """Normalise and store one tile's output (through ``o_s``, by TMA) and log-sum-exp
        (the paired schedule: dense batches only)."""
        finish(o, m, m_safe, alpha, row_sum, l, lse, sink, score_scale, out_scale)
        T.sync_threads(CONSUMERS_SYNC, threads)  # the last TMA store has read o_s
        T.copy(o, o_s)
        T.fence_proxy_async()
        T.sync_threads(CONSUMERS_SYNC, threads)  # all of o_s written
        T.copy(o_s, seq.q_rows(O, m0, block_m, h))
        T.copy(lse, seq.stat(LSE, h, m0, block_m))

    @T.macro
    def one_tile_kernel(Q, K, V, O, LSE, Sinks, score_scale, cap_in, left, right, seqs):
        H, Hkv = Q.shape[2], K.shape[2]
        with T.Kernel(*seqs.grid(block_m, H), threads=total) as ids:
            bx, h, b = seqs.tile(ids, block_m, H, total)
            q_s = T.alloc_shared([block_m, dim], dtype)
            k_s = T.alloc_shared([2, block_n, dim], dtype)
            v_s = T.alloc_shared(v_ring, dtype)
            # Q is dead after the last S GEMM: its tile holds the output when shapes agree.
            o_s = q_s if dim_v == dim and not ops.fp8 else T.alloc_shared([block_m, dim_v], ops.out_dtype)
            s, p, o, m, m_prev, m_safe, alpha, row_sum, l, lse = tile_fragments(block_m, block_n, dim_v, dtype, defer_sum)
            if defer_sum:
                T.annotate_layout({l: row_parts_layout(block_m)})
            bar_q = T.alloc_barrier(arrive_count=total)
            k_full, v_full, k_empty, v_empty = kv_pipeline_barriers(threads)

            tx = T.get_thread_binding()
            wg = tx // 128  # consumer warpgroup
            # A packed tile's rows past its sequence's end (the next sequence's queries) get
            # their own softmax rows and are never stored (``masks``: no row test).
            seq = seqs.of(b)
            mask = TileMask(seq, left, right)
            m0, kb_lo, n_blocks, last_row = query_tile(bx, block_m, block_n, mask, bottom_aligned=bottom_aligned)
            score_scale, cap_in, out_scale = tile_scales(ops, Sinks, H, Hkv, seqs.batch, seq.batch, h // (H // Hkv), score_scale, cap_in, has_softcap)
            mask_args = (m0, last_row, mask, score_scale, cap_in)
            # Q's load starts before the register hand-over (setmaxnreg) the consumers wait for.
            T.tma_copy(seq.q_rows(Q, m0, block_m, h), q_s, barrier=bar_q)
            T.barrier_arrive(bar_q)
            if tx >= threads:  # producer
                T.set_max_nreg(24, 0)
                coords = (kb_lo, n_blocks, h // (H // Hkv))
                if producer_regs:  # registers: as expressions they are re-derived for every load
                    coords = tuple(T.alloc_var(T.int32, init=x)[0] for x in coords)
                load_kv(K, V, k_s, v_s, k_full, v_full, k_empty, v_empty, *coords, seq)
            else:  # consumer warpgroups
                T.set_max_nreg(CONSUMER_REGS[n_wg], 1)
                T.clear(o)
                T.clear(l)
                T.fill(m, -T.infinity(acc))
                T.barrier_wait(bar_q, 0)
                # A tile that sees no key skips every GEMM (the one-tile schedule, unlike the
                # paired one, has no next tile whose turns it must keep in step with).
                if wg == n_wg - 1 and n_blocks > 0:
                    turns.first_turn(wg)  # the last warpgroup hands warpgroup 0 the first turn
                if n_blocks > 0:  # block 0 alone: nothing to overlap yet
                    T.barrier_wait(k_full[0], 0)
                    take_turn(wg)
                    T.wgmma_gemm(q_s, k_s[0, :, :], s, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                    pass_turn(wg)
                    T.wait_wgmma(0)
                    T.barrier_arrive(k_empty[0])
                    update(s, m, m_prev, m_safe, alpha, row_sum, l, kb_lo * block_n, *mask_args, None, wg)
                    cast_p(s, p)
                block_steps(q_s, k_s, v_s, s, p, o, m, m_prev, m_safe, alpha, row_sum, l, k_full, v_full, k_empty, v_empty, wg, kb_lo, n_blocks, 0, *mask_args)
                if n_blocks > 0:  # the last block's P V (its V sits in stage (n_blocks - 1) % 2)
                    last = n_blocks - 1
                    for st in T.unroll(2):
                        if last % 2 == st:
                            if not pingpong:
                                rescale(o, alpha)
                            T.barrier_wait(v_full[st], (last // 2) & 1)
                            T.wgmma_gemm(p, v_s[st, :, :], o, transpose_B=ops.fp8, policy=FULL_ROW)
                            T.wait_wgmma(0)
                if explicit_syncs:
                    epilogue(o, m, m_safe, alpha, row_sum, l, lse, o_s, O, LSE, Sinks[h], score_scale, m0, h, seq, out_scale)
                else:
                    finish(o, m, m_safe, alpha, row_sum, l, lse, Sinks[h], score_scale, out_scale)
                    # Dense: through o_s by TMA, ordered by TileLang's sync pass (PASS_CONFIGS).
                    seqinfo.store_q_tile(seq, o, o_s, O, m0, block_m, h, dim_v, lse, LSE)

    @T.macro
    def paired_kernel(Q, K, V, O, LSE, Sinks, score_scale, cap_in, left, right, seqs):
        H, Hkv = Q.shape[2], K.shape[2]
        n_qb = T.ceildiv(seqs.max_q, block_m)
        pairs = T.ceildiv(n_qb, 2)
        n_items = pairs * H * seqs.batch
        grid = T.min(n_items, num_sms) if tiles_per_cta == 0 else n_items
        with T.Kernel(grid, threads=total) as cta:
            # Two Q buffers: the next tile's Q loads while this tile's last GEMMs read its own.
            q_s = T.alloc_shared([2, block_m, dim], dtype)
            k_s = T.alloc_shared([2, block_n, dim], dtype)
            v_s = T.alloc_shared(v_ring, dtype)
            o_s = T.alloc_shared([block_m, dim_v], ops.out_dtype)
            s, p, o, m, m_prev, m_safe, alpha, row_sum, l, lse = tile_fragments(block_m, block_n, dim_v, dtype, defer_sum)
            m_last = T.alloc_fragment([block_m], acc)
            l_last = row_weights(block_m, defer_sum)
            if defer_sum:
                T.annotate_layout({l: row_parts_layout(block_m), l_last: row_parts_layout(block_m)})

            q_full = T.alloc_barrier(arrive_count=[128, 128])
            q_empty = T.alloc_barrier(arrive_count=[threads, threads])
            k_full, v_full, k_empty, v_empty = kv_pipeline_barriers(threads)
            # Every tile uses both ring stages ceil(trips / 2) times (an odd tile pads stage 1
            # with an empty turn), so each tile starts on stage 0 and stage indices stay
            # compile-time constants; ``phase`` carries the barriers' parity across tiles.
            phase = T.alloc_var(T.int32, init=0)
            tiles = T.alloc_var(T.int32, init=0)  # tiles this CTA has started
            # Held in registers: as expressions they lower to branches at every use.
            tile_bx = T.alloc_var(T.int32, init=0)
            tile_m0 = T.alloc_var(T.int32, init=0)
            tile_kb_lo = T.alloc_var(T.int32, init=0)
            tile_last_row = T.alloc_var(T.int32, init=0)
            tile_trips = T.alloc_var(T.int32, init=0)
            # The previous tile: its last P V and its epilogue run under this tile's first S.
            prev_m0 = T.alloc_var(T.int32, init=0)
            prev_h = T.alloc_var(T.int32, init=0)
            prev_b = T.alloc_var(T.int32, init=0)
            prev_last = T.alloc_var(T.int32, init=0)
            # The tile's scales and the previous tile's (its epilogue runs in this tile's turn):
            # the kernel's scalars for 16-bit inputs; for FP8, registers set per tile from the
            # tile's batch entry's descales (``operands.tile_scales``).
            if ops.fp8:
                tile_sc = T.alloc_var(acc, init=score_scale)
                tile_cap = T.alloc_var(acc, init=cap_in)
                tile_vd = T.alloc_var(acc, init=1.0)
                prev_sc = T.alloc_var(acc, init=score_scale)
                prev_vd = T.alloc_var(acc, init=1.0)
            else:
                tile_sc, tile_cap, prev_sc, prev_vd = score_scale, cap_in, score_scale, None

            tx = T.get_thread_binding()
            wg = tx // 128  # consumer warpgroup
            groups = H // Hkv

            if producer_regs:
                load_h = T.alloc_var(T.int32, init=0)
                load_hk = T.alloc_var(T.int32, init=0)
                load_b = T.alloc_var(T.int32, init=0)

            if tx >= threads:  # producer
                T.set_max_nreg(24, 0)
                for it in T.serial(T.ceildiv(n_items - cta, grid)):
                    for half in T.serial(2):
                        h, b, bx, real = tile_pair(cta + it * grid, half, n_qb, pairs, H)
                        tile_bx = bx
                        hk = h // groups
                        if producer_regs:  # registers: as expressions they are re-derived for every load
                            load_h = h
                            load_b = b
                            load_hk = hk
                            h, b, hk = load_h, load_b, load_hk
                        seq = seqs.of(b)
                        mask = TileMask(seq, left, right)
                        if real:
                            m0_e, kb_lo_e, n_blocks, _ = query_tile(tile_bx, block_m, block_n, mask, bottom_aligned=bottom_aligned)
                            tile_m0 = m0_e
                            tile_kb_lo = kb_lo_e
                            tile_trips = pipelined_trips(n_blocks)  # a tile that sees no key takes one masked trip
                            m0, kb_lo, trips = tile_m0, tile_kb_lo, tile_trips
                            slot = tiles % 2
                            T.barrier_wait(q_empty[slot], ((tiles // 2) & 1) ^ 1)
                            T.tma_copy(seq.q_rows(Q, m0, block_m, h), q_s[slot, :, :], barrier=q_full[slot])
                            T.barrier_arrive(q_full[slot])
                            load_kv(K, V, k_s, v_s, k_full, v_full, k_empty, v_empty, kb_lo, trips, hk, seq, phase)
                            if trips % 2 == 1:  # stage 1's empty turn
                                T.barrier_wait(k_empty[1], ((trips // 2) & 1) ^ 1 ^ phase)
                                T.barrier_arrive(k_full[1])
                                T.barrier_wait(v_empty[1], ((trips // 2) & 1) ^ 1 ^ phase)
                                T.barrier_arrive(v_full[1])
                            phase = phase ^ (T.ceildiv(trips, 2) & 1)
                            tiles = tiles + 1
            else:  # consumer warpgroups
                T.set_max_nreg(CONSUMER_REGS[n_wg], 1)
                # The first turn's P V has no previous tile: it adds 0 to O = 0.
                T.clear(p)
                T.clear(o)
                T.clear(l)
                T.fill(m, -T.infinity(acc))
                if wg == n_wg - 1:
                    turns.first_turn(wg)  # the last warpgroup hands warpgroup 0 the first turn
                for it in T.serial(T.ceildiv(n_items - cta, grid)):
                    for half in T.serial(2):
                        h, b, bx, real = tile_pair(cta + it * grid, half, n_qb, pairs, H)
                        tile_bx = bx
                        seq = seqs.of(b)
                        mask = TileMask(seq, left, right)
                        if real:
                            m0_e, kb_lo_e, n_blocks, last_row_e = query_tile(tile_bx, block_m, block_n, mask, bottom_aligned=bottom_aligned)
                            tile_m0 = m0_e
                            tile_kb_lo = kb_lo_e
                            tile_last_row = last_row_e
                            # As the producer's: a T.macro cannot store into registers it
                            # receives as arguments (TileLang 0.1.15 drops the stores).
                            tile_trips = pipelined_trips(n_blocks)
                            m0, kb_lo, last_row, trips = tile_m0, tile_kb_lo, tile_last_row, tile_trips
                            if ops.fp8:
                                sc_e, cap_e, vd_e = tile_scales(ops, Sinks, H, Hkv, seqs.batch, b, h // groups, score_scale, cap_in, has_softcap)
                                tile_sc = sc_e
                                tile_cap = cap_e
                                tile_vd = vd_e
                            mask_args = (m0, last_row, mask, tile_sc, tile_cap)
                            slot = tiles % 2
                            T.barrier_wait(q_full[slot], (tiles // 2) & 1)
                            T.barrier_wait(k_full[0], phase)
                            # One turn: this tile's S_0, then the previous tile's last P V, whose
                            # wait, V release and epilogue follow S_0's softmax.
                            if tiles == 0:  # the first turn's P V adds P = 0 times a real V block
                                T.barrier_wait(v_full[0], phase)
                            take_turn(wg)
                            T.wgmma_gemm(q_s[slot, :, :], k_s[0, :, :], s, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                            T.wgmma_gemm(p, v_s[prev_last % 2, :, :], o, transpose_B=ops.fp8, policy=FULL_ROW)  # a runtime stage: no branch between the wgmmas
                            pass_turn(wg)
                            T.wait_wgmma(1)
                            T.barrier_arrive(k_empty[0])
                            T.copy(m, m_last)  # the previous tile's statistics, for its epilogue
                            T.copy(l, l_last)
                            T.fill(m, -T.infinity(acc))
                            T.clear(l)
                            update(s, m, m_prev, m_safe, alpha, row_sum, l, kb_lo * block_n, *mask_args, None, wg)
                            T.wait_wgmma(0)
                            if tiles > 0:
                                T.barrier_arrive(v_empty[prev_last % 2])
                                epilogue(o, m_last, m_safe, alpha, row_sum, l_last, lse, o_s, O, LSE, Sinks[prev_h], prev_sc, prev_m0, prev_h, seqs.of(prev_b), prev_vd)
                            T.clear(o)
                            cast_p(s, p)
                            block_steps(q_s[slot, :, :], k_s, v_s, s, p, o, m, m_prev, m_safe, alpha, row_sum, l, k_full, v_full, k_empty, v_empty, wg, kb_lo, trips, phase, *mask_args)
                            T.barrier_arrive(q_empty[slot])  # every S GEMM of the tile has retired
                            if not pingpong:
                                rescale(o, alpha)
                            # The last block's V, so the next turn issues its P V at once.
                            last = trips - 1
                            T.barrier_wait(v_full[last % 2], ((last // 2) & 1) ^ phase)
                            if trips % 2 == 1:  # stage 1's empty turn
                                T.barrier_wait(k_full[1], ((trips // 2) & 1) ^ phase)
                                T.barrier_arrive(k_empty[1])
                                T.barrier_wait(v_full[1], ((trips // 2) & 1) ^ phase)
                                T.barrier_arrive(v_empty[1])
                            prev_m0 = m0
                            prev_h = h
                            prev_b = b
                            prev_last = last
                            if ops.fp8:
                                prev_sc = tile_sc
                                prev_vd = tile_vd
                            phase = phase ^ (T.ceildiv(trips, 2) & 1)
                            tiles = tiles + 1
                # The CTA's last tile: its P V and epilogue with nothing to overlap.
                take_turn(wg)
                T.wgmma_gemm(p, v_s[prev_last % 2, :, :], o, transpose_B=ops.fp8, policy=FULL_ROW)  # a runtime stage: no branch between the wgmmas
                pass_turn(wg)
                T.wait_wgmma(0)
                T.barrier_arrive(v_empty[prev_last % 2])
                epilogue(o, m, m_safe, alpha, row_sum, l, lse, o_s, O, LSE, Sinks[prev_h], prev_sc, prev_m0, prev_h, seqs.of(prev_b), prev_vd)

    return forward_prim_func(dim, dim_v, dtype, varlen, one_tile_kernel if tiles_per_cta == 1 else paired_kernel, out_dtype)


# Two compilations of one builder.  The paired schedule orders its shared memory by hand
# (WS_PASS_CONFIGS: TileLang's sync pass cannot place barriers inside its tile loop).  The
# one-tile schedule keeps TileLang's sync pass: built without it (same source, explicit
# syncs), d=64 causal ran 10-26% slower on H100 for reasons not found.
attention_fwd_ws_kernel = tilelang.jit(target=TARGET, pass_configs=WS_PASS_CONFIGS)(fwd_ws_prim_func)
attention_fwd_ws_tile_kernel = tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)(fwd_ws_prim_func)
