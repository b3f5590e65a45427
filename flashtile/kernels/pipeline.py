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
