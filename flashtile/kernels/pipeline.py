"""The K/V pipeline of the hand-written kernels (``fwd_ws``, ``bwd_ws``): the producer side of
their two-stage shared-memory buffer, and what those kernels share about synchronisation.
(Not ring attention: that is ``flashtile.distributed``.)

Stage ``t % 2`` holds key block ``t``; each stage has a full barrier (the producer's TMA
bytes landed) and an empty barrier (every consumer thread is done reading).  Steps are walked
two per trip so that stage indices are compile-time constants.
"""

import tilelang.language as T

CONSUMERS_SYNC = 8  # named barrier id for the consumer warpgroups (TileLang's own use low ids)


def kv_pipeline_barriers(consumer_threads: int):
    """(k_full, v_full, k_empty, v_empty), two stages each: a full barrier counts the producer
    warpgroup's 128 arrivals (plus its TMA bytes), an empty barrier every consumer thread's."""
    full = [128, 128]
    empty = [consumer_threads, consumer_threads]
    return (T.alloc_barrier(arrive_count=full), T.alloc_barrier(arrive_count=full),
            T.alloc_barrier(arrive_count=empty), T.alloc_barrier(arrive_count=empty))


def kv_pipeline_producer(block_n: int, ops=None):
    """Macro ``load_kv(K, V, k_s, v_s, k_full, v_full, k_empty, v_empty, kb_lo, n_blocks, hk, seq,
    phase=0)``: TMA-load key blocks ``kb_lo .. kb_lo + n_blocks - 1`` of head ``hk`` into the
    ring, from wherever ``seq`` (``seqinfo.Sequence``, the block source) says its rows sit.  Run by one warpgroup (the full barriers count its 128 arrivals).  ``phase``: parity
    of the ring's uses before this call (a persistent CTA walks several tiles through it).
    ``ops``: the forward's ``operands.Operands`` (FP8 loads V^T tiles), None for 16-bit V."""

    @T.macro
    def load_kv(K, V, k_s, v_s, k_full, v_full, k_empty, v_empty, kb_lo, n_blocks, hk, seq, phase=0):
        for i in T.serial(T.ceildiv(n_blocks, 2)):
            for st in T.unroll(2):
                t = i * 2 + st
                if t < n_blocks:
                    n0 = (kb_lo + t) * block_n
                    T.barrier_wait(k_empty[st], (i & 1) ^ 1 ^ phase)  # passes at once on a fresh barrier
                    T.tma_copy(seq.k_rows(K, n0, block_n, hk), k_s[st, :, :], barrier=k_full[st])
                    T.barrier_arrive(k_full[st])
                    T.barrier_wait(v_empty[st], (i & 1) ^ 1 ^ phase)
                    v_tile = seq.k_rows(V, n0, block_n, hk) if ops is None else ops.v_rows(seq, V, n0, block_n, hk)
                    T.tma_copy(v_tile, v_s[st, :, :], barrier=v_full[st])
                    T.barrier_arrive(v_full[st])

    return load_kv


PRODUCER_SYNC = 12  # named barrier id of the producer warpgroup's own 128 threads


def fp8_transpose_fits(block_n: int, dim_v: int) -> bool:
    """``kv_pipeline_transposing`` covers exactly this V tile (its lane mapping)."""
    return block_n == 128 and dim_v == 256


def kv_pipeline_transposing(block_n: int, dim_v: int):
    """Macro ``load_kv(K, V, k_s, raw, raw_w, v_s, k_full, raw_full, v_full, k_empty, v_empty,
    kb_lo, n_blocks, hk, seq, ptx, w_in, w_out, w_out_bytes)``: ``kv_pipeline_producer``'s FP8
    ring with V^T made here, by the producer warpgroup (FlashAttention-3's in-kernel transpose)
    instead of by a pre-pass over all of V before the launch (``transpose_v``: 31-40 us per 67 MB
    on an H100, 9-12% of a d = 256 4k causal call; NOTES).

    V (the caller's layout, keys x dim_v, FP8) comes by TMA into two raw stages ``raw``
    ([2, block_n, dim_v], row-major; ``raw_w`` their uint32 view), one block ahead of the
    transpose: while block t's raw stage is turned into its V^T stage, block t + 1's lands.  The
    128 producer threads (``ptx``) then write ``v_s[t % 2]`` ([dim_v, block_n], the layout the P V
    WGMMA reads, 128-byte swizzle) with column j holding key ``operands.key_of_column(j)`` of its
    16-key group, as the pre-pass does.  Per step a thread moves 4 keys x 4 features: four
    4-byte loads of raw rows 16 g + {2 q, 2 q + 1, 2 q + 8, 2 q + 9} (lane = 4 g + q), words c,
    eight ``__byte_perm``s (a 4 x 4 byte transpose), four 4-byte stores of V^T rows 4 c .. 4 c + 3,
    columns 16 g + 4 q ..; c = (lane + 16 w + it) mod 64 (w the warp, it the step) covers every
    word once, and both the loads (banks c mod 32) and the stores (the swizzle's chunk XOR is
    fixed per lane) are free of bank conflicts (compile-only probe, NOTES thirtieth session).
    Then ``fence.proxy.async`` (generic stores before the WGMMA's async reads), the stage's full
    barrier (128 arrivals, no TMA bytes) and a producer-wide barrier (every thread done reading
    the raw stage before its next TMA).  Rows past the sequence's end come in as zeros (TMA's
    out-of-bounds fill), as the pre-pass writes them.  Kept rolled: unrolled, the producer's 24
    registers spilled 1 KB."""
    assert fp8_transpose_fits(block_n, dim_v), "the lane mapping covers 128 keys x 256 features"
    words = dim_v // 4  # 4-byte words of a raw row
    steps = block_n * dim_v // 16 // 128  # 4 x 4-byte squares per thread and block

    @T.macro
    def transpose_stage(raw_w, v_s, st, ptx, w_in, w_out, w_out_bytes):
        lane, w = ptx % 32, ptx // 32
        g, q = lane // 4, lane % 4
        for it in T.serial(steps):
            c = (lane + 16 * w + it) % words
            for e in T.unroll(4):  # keys 16 g + 2 q + {0, 1, 8, 9}: P / V^T columns 16 g + 4 q + e
                w_in[e] = raw_w[st, 16 * g + 2 * q + e % 2 + e // 2 * 8, c]
            lo01 = T.call_extern("uint32", "__byte_perm", w_in[0], w_in[1], T.uint32(0x5140))
            hi01 = T.call_extern("uint32", "__byte_perm", w_in[0], w_in[1], T.uint32(0x7362))
            lo23 = T.call_extern("uint32", "__byte_perm", w_in[2], w_in[3], T.uint32(0x5140))
            hi23 = T.call_extern("uint32", "__byte_perm", w_in[2], w_in[3], T.uint32(0x7362))
            w_out[0] = T.call_extern("uint32", "__byte_perm", lo01, lo23, T.uint32(0x5410))
            w_out[1] = T.call_extern("uint32", "__byte_perm", lo01, lo23, T.uint32(0x7632))
            w_out[2] = T.call_extern("uint32", "__byte_perm", hi01, hi23, T.uint32(0x5410))
            w_out[3] = T.call_extern("uint32", "__byte_perm", hi01, hi23, T.uint32(0x7632))
            for k in T.unroll(4):  # feature 4 c + k: the 4 keys' bytes in column order
                for e in T.vectorized(4):
                    v_s[st, 4 * c + k, 16 * g + 4 * q + e] = w_out_bytes[k * 4 + e]

    @T.macro
    def load_kv(K, V, k_s, raw, raw_w, v_s, k_full, raw_full, v_full, k_empty, v_empty, kb_lo, n_blocks, hk, seq, ptx,
                w_in, w_out, w_out_bytes):
        if n_blocks > 0:
            T.tma_copy(seq.k_rows(V, kb_lo * block_n, block_n, hk), raw[0, :, :], barrier=raw_full[0])
            T.barrier_arrive(raw_full[0])
        for i in T.serial(T.ceildiv(n_blocks, 2)):
            for st in T.unroll(2):
                t = i * 2 + st
                if t < n_blocks:
                    n0 = (kb_lo + t) * block_n
                    T.barrier_wait(k_empty[st], (i & 1) ^ 1)  # passes at once on a fresh barrier
                    T.tma_copy(seq.k_rows(K, n0, block_n, hk), k_s[st, :, :], barrier=k_full[st])
                    T.barrier_arrive(k_full[st])
                    if t + 1 < n_blocks:  # the other raw stage: free since the last step's barrier
                        T.tma_copy(seq.k_rows(V, n0 + block_n, block_n, hk), raw[1 - st, :, :], barrier=raw_full[1 - st])
                        T.barrier_arrive(raw_full[1 - st])
                    T.barrier_wait(raw_full[st], i & 1)
                    T.barrier_wait(v_empty[st], (i & 1) ^ 1)
                    transpose_stage(raw_w, v_s, st, ptx, w_in, w_out, w_out_bytes)
                    T.fence_proxy_async()
                    T.barrier_arrive(v_full[st])
                    T.sync_threads(PRODUCER_SYNC, 128)

    return load_kv
