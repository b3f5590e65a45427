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

Persistent schedule (``persistent``, d <= 96 where two K/V buffers fit beside the rings):
``num_sms`` CTAs walk the key tiles.  A CTA's first tile is its own index, later ones come from a
ticket counter (one atomic, zeroed per call with the dQ accumulator), taken once the current
tile's last loads are issued, so tiles go to whichever CTA is about to be free, in the one-tile
grid's order.  The loader warp decodes the next tile (a packed batch's sequence search runs on
that warp alone), waits for the K/V buffer the tile before last used, loads K and V into it
and writes (batch entry, key block, kv head, the sequence's offsets) into a small hand-over
buffer beside it; the consumers and the dQ writer read the hand-over after the K/V buffer's
full barrier and release both through its empty barrier once done (the consumers after storing
dK/dV from it).  A batch entry of -1 ends the walk.  The rings' barrier parities run on across
tiles (``phase``, ``dq_phase``, ``flip``); a tile with an odd step count ends with an empty turn
on ring stage 1 (``empty_turn``) so every tile starts on stage 0.  What it saves is each tile's
launch, sequence search and K/V load latency: +8.7% on 64 packed sequences of 64..1024 tokens
(d=64 causal), +4-5% on dense 1k sequences (NOTES, tenth session).
"""

from types import SimpleNamespace

import tilelang
import tilelang.language as T
from tvm.script.ir_builder import IRBuilder

from . import seqinfo
from .bwd import dkdv_prim_func, dq_prim_func, key_tail_tests, query_step, score_gradients
from .masks import TileMask, block_fully_visible, query_block_range, query_tile
from .pipeline import CONSUMERS_SYNC, kv_pipeline_barriers, kv_pipeline_producer
from .schedule import grouped_tile
from .target import PASS_CONFIGS, TARGET, WS_PASS_CONFIGS

FULL_ROW = T.GemmWarpPolicy.FullRow  # each consumer warpgroup owns 64 keys of the tile
FULL_COL = T.GemmWarpPolicy.FullCol  # dQ has 64 query rows: the warpgroups split its columns


def named(**buffers):
    """A namespace of buffers allocated by a helper, each given its name as a kernel body's
    own assignment would (``IRBuilder.name``): the generated CUDA, read while tuning, keeps
    ``q_s`` rather than ``v_3``, and shared memory keeps its layout."""
    for name, buf in buffers.items():
        if buf is not None and not isinstance(buf, list):
            IRBuilder.name(name, buf)
    return SimpleNamespace(**buffers)


def dense_key_tile(slot, key_blocks, Hkv, batch, rows_per_group):
    """(key block, kv head, batch entry) of a dense dK/dV grid's ``slot``, in registers: the
    grid walks ``rows_per_group`` (batch entry, kv head) rows key-block-major at a time
    (``configs.dkdv_rows_per_group``).  As expressions (divisions by a runtime group size) they
    are re-derived at every use, and nvcc took 3.6x longer over the kernel at d=64."""
    block, row = grouped_tile(slot, key_blocks, Hkv * batch, rows_per_group)
    regs = named(bx=T.alloc_var(T.int32, init=block), hk=T.alloc_var(T.int32, init=row % Hkv),
                 b=T.alloc_var(T.int32, init=row // Hkv))
    return regs.bx, regs.hk, regs.b


def flip(parity, phase):
    """A barrier's ``parity`` within a tile, turned by ``phase``, the parity its uses by the
    CTA's earlier tiles left (a persistent CTA's register; 0, a Python int, for a CTA of one
    tile: the expression stays as it was)."""
    return parity if isinstance(phase, int) and phase == 0 else parity ^ phase


class KeyTileWalk:
    """The steps of one dK/dV tile: every (query head of kv head ``hk``'s GQA group, query
    block) pair that can see it, heads outer (``bwd.query_step``)."""

    def __init__(self, hk, groups, qb_lo, n_qblocks, block_m):
        self.hk, self.groups, self.qb_lo, self.n_qblocks, self.block_m = hk, groups, qb_lo, n_qblocks, block_m
        self.n_steps = groups * n_qblocks
        self.n_pairs = T.ceildiv(self.n_steps, 2)  # two steps per trip: ring stages stay constants

    def step(self, t):
        """(query head, first query row) of step ``t``."""
        return query_step(t, self.hk, self.groups, self.qb_lo, self.n_qblocks, self.block_m)

    def advance(self):
        """Nothing: ``step`` derives each step from its index (``StepCursor`` keeps state)."""


class StepCursor:
    """A ``KeyTileWalk`` in registers, stepped in order: ``h`` and ``m0`` are the current step's
    query head and first row, ``advance`` moves to the next step (the next query block, past
    the tile's last one the group's next head), so no step re-derives them by a division and a
    remainder (``query_step``).  For the producer's warps (``BwdConfig.producer_regs``)."""

    def __init__(self, walk: KeyTileWalk):
        first = walk.qb_lo * walk.block_m
        regs = named(n_steps=T.alloc_var(T.int32, init=walk.n_steps), m_first=T.alloc_var(T.int32, init=first),
                     m_end=T.alloc_var(T.int32, init=first + walk.n_qblocks * walk.block_m),
                     h=T.alloc_var(T.int32, init=walk.hk * walk.groups), m0=T.alloc_var(T.int32, init=first))
        self.block_m, self._regs = walk.block_m, regs
        # Reads (the kernel body's parser loads a register named by a bare name, not an attribute).
        self.n_steps, self.h, self.m0 = regs.n_steps[0], regs.h[0], regs.m0[0]

    def step(self, t):
        """(query head, first query row) of the current step, which must be step ``t``."""
        return self.h, self.m0

    def advance(self):
        r = self._regs
        wrap = r.m0[0] + self.block_m == r.m_end[0]
        # Selects, not ``T.if_then_else`` (which TileLang emits as branches: nvcc then duplicated
        # the loads' code per branch, 16 -> 40 TMA issue sites at d = 128).
        T.buffer_store(r.h, T.Select(wrap, r.h[0] + 1, r.h[0]), [0])
        T.buffer_store(r.m0, T.Select(wrap, r.m_first[0], r.m0[0] + self.block_m), [0])


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
    persistent: bool = False,
    num_sms: int = 132,
    producer_regs: bool = False,
):
    """Build the PrimFunc; arguments as ``bwd.attention_bwd_dkdv``.  ``dq_turns``: the two
    consumer warpgroups take turns computing a step's whole dQ tile (see the module docstring).
    ``persistent``: ``num_sms`` CTAs walk the key tiles (see the module docstring), taking the
    next tile from the zeroed counter Ticket.  ``producer_regs``: the loader and dQ writer warps
    keep each step's query head and first row in registers, advanced step by step
    (``StepCursor``), instead of re-deriving them (``KeyTileWalk.step``: a division and a
    remainder by the tile's query block count) after each barrier wait."""
    assert (block_n, block_m, num_stages, threads) == (128, 64, 2, 256) and overlap, "the hand-written ring is 128 keys x 64 queries, 2 stages, 2 consumer warpgroups"
    acc = T.float32
    total = threads + 128  # + the producer warpgroup (loader warp, dQ writer warp)
    loader_end, writer_end = threads + 32, threads + 64  # producer warps 0 and 1
    writer_lane0 = loader_end  # issues the dQ reduce-add (TileLang elects the range's first thread)
    turns = with_dq and dq_turns
    # A persistent CTA's dS^T buffer is safe across tiles only with turns (``empty_turn``); the
    # split dQ (d = 128) would need a second K/V buffer that does not fit shared memory anyway.
    assert not persistent or turns or not with_dq, "persistent: dQ by turns or no dQ"
    probabilities, score_grad, keep_visible = score_gradients(block_n, block_m, True, has_softcap)

    @T.macro
    def staged_store(dk, dv, k_t, v_t, dK, dV, seq, n0, hk):
        """dK/dV tiles -> memory through the K/V tiles (TMA stores; this schedule orders its
        shared memory by hand)."""
        # Both warpgroups' last GEMMs (dQ reads all of K) are done before K/V turn into the
        # dK/dV staging tiles.
        T.sync_threads(CONSUMERS_SYNC, threads)
        T.copy(dk, k_t)
        T.copy(dv, v_t)
        T.fence_proxy_async()
        T.sync_threads(CONSUMERS_SYNC, threads)
        T.copy(k_t, seq.k_rows(dK, n0, block_n, hk))
        T.copy(v_t, seq.k_rows(dV, n0, block_n, hk))

    @T.macro
    def store_tile(dk, dv, k_t, v_t, dK, dV, seq, n0, hk):
        """The tile's dK/dV: staged through K/V by TMA, or a packed sequence's tail tile by
        row-guarded stores from registers."""
        whole = seqinfo.whole_tile(seq, n0, block_n, (dim, dim_v), keys=True)
        if whole:
            staged_store(dk, dv, k_t, v_t, dK, dV, seq, n0, hk)
        else:
            seqinfo.store_k_tail(seq, dk, dK, n0, block_n, hk, dim)
            seqinfo.store_k_tail(seq, dv, dV, n0, block_n, hk, dim_v)

    @T.macro
    def dq_turn(ds_s, k_t, dq, dq_s, bars, st, i, phase, dq_phase):
        """One warpgroup's turn: step 2i+st's dQ = dS K over all 128 keys -> dq_s for the writer."""
        T.barrier_wait(bars.ds_full[st], flip(i & 1, phase))  # the other warpgroup's half of dS^T is in too
        T.wgmma_gemm(ds_s[st, :, :], k_t, dq, transpose_A=True, clear_accum=True, policy=FULL_ROW)
        T.wait_wgmma(0)
        T.barrier_wait(bars.dq_empty, flip(st ^ 1, dq_phase))  # the writer is done with step t-1
        T.copy(dq, dq_s)
        T.fence_proxy_async()
        T.barrier_arrive(bars.dq_full)

    def producer_walk(walk):
        """The walk the producer's warps step through: ``walk`` itself, or with
        ``producer_regs`` a ``StepCursor`` over it (registers stepped in order)."""
        return StepCursor(walk) if producer_regs else walk

    @T.macro
    def load_steps(Q, dO, LSE2, Delta, sm, bars, seq, walk, phase):
        """The loader warp: each step's Q + lse and dO + Delta by TMA into the two-stage rings."""
        steps = producer_walk(walk)
        for i in T.serial(walk.n_pairs):
            for st in T.unroll(2):
                t = i * 2 + st
                if t < steps.n_steps:
                    h, m0 = steps.step(t)
                    T.barrier_wait(bars.q_empty[st], flip((i & 1) ^ 1, phase))
                    T.tma_copy(seq.q_rows(Q, m0, block_m, h), sm.q_s[st, :, :], barrier=bars.q_full[st])
                    T.tma_copy(seq.stat(LSE2, h, m0, block_m), sm.lse_s[st * block_m : (st + 1) * block_m], barrier=bars.q_full[st])
                    T.barrier_arrive(bars.q_full[st])
                    T.barrier_wait(bars.do_empty[st], flip((i & 1) ^ 1, phase))
                    T.tma_copy(seq.q_rows(dO, m0, block_m, h), sm.do_s[st, :, :], barrier=bars.do_full[st])
                    T.tma_copy(seq.stat(Delta, h, m0, block_m), sm.delta_s[st * block_m : (st + 1) * block_m], barrier=bars.do_full[st])
                    T.barrier_arrive(bars.do_full[st])
                    steps.advance()

    @T.macro
    def write_steps(dQacc, sm, bars, seq, walk, dq_phase):
        """The dQ writer warp: each step's dQ tile reduce-added into the fp32 accumulator."""
        steps = producer_walk(walk)
        for i in T.serial(walk.n_pairs):
            for st in T.unroll(2):
                t = i * 2 + st
                if t < steps.n_steps:
                    h, m0 = steps.step(t)
                    T.barrier_wait(bars.dq_full, flip(st, dq_phase))  # one use per step: parity = t & 1
                    # Issued and waited for (TMA has read dq_s) by the warp's first lane.
                    # Rows past a packed sequence's end add exact zeros (masked P).
                    T.atomic_add(seq.q_rows(dQacc, m0, block_m, h), sm.dq_s, use_tma=True)
                    if T.get_thread_binding() == writer_lane0:
                        T.barrier_arrive(bars.dq_empty)
                    steps.advance()

    @T.macro
    def compute_steps(k_t, v_t, sm, fr, bars, mask, n0, walk, last_col, score_scale, sm_scale, cap_in, phase, dq_phase):
        """The two consumer warpgroups (64 keys each): every step of the tile (module docstring)."""
        tx = T.get_thread_binding()
        for i in T.serial(walk.n_pairs):
            for st in T.unroll(2):
                t = i * 2 + st
                if t < walk.n_steps:
                    h, m0 = walk.step(t)
                    T.barrier_wait(bars.q_full[st], flip(i & 1, phase))
                    T.wgmma_gemm(k_t, sm.q_s[st, :, :], fr.sT, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                    T.barrier_wait(bars.do_full[st], flip(i & 1, phase))
                    T.wgmma_gemm(v_t, sm.do_s[st, :, :], fr.dpT, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                    T.wait_wgmma(1)
                    probabilities(fr.sT, fr.capT, sm.lse_s, score_scale, cap_in, st * block_m)
                    interior, tail = key_tail_tests(m0, n0, block_m, block_n, last_col, mask)
                    keep_visible(fr.sT, interior, m0, n0, mask, tail)
                    T.wait_wgmma(0)
                    T.copy(fr.sT, fr.pT)
                    T.wgmma_gemm(fr.pT, sm.do_s[st, :, :], fr.dv, policy=FULL_ROW)
                    score_grad(fr.dsT, fr.sT, fr.dpT, sm.delta_s, fr.capT, sm_scale, st * block_m)
                    if with_dq:  # dS^T -> shared memory for the dQ GEMM
                        T.copy(fr.dsT, sm.ds_s[st, :, :])
                        T.fence_proxy_async()
                    if turns:
                        T.barrier_arrive(bars.ds_full[st])
                        T.wgmma_gemm(fr.dsT, sm.q_s[st, :, :], fr.dk, policy=FULL_ROW)
                        # Warpgroup st computes this step's dQ (both halves of dS^T, all
                        # 128 keys); the other one goes on to the next step meanwhile.
                        # (Each branch names its own fragment: st is not a Python int.)
                        if tx < 128:
                            if st == 0:
                                dq_turn(sm.ds_s, k_t, fr.dq[0], sm.dq_s, bars, st, i, phase, dq_phase)
                        elif st == 1:
                            dq_turn(sm.ds_s, k_t, fr.dq[1], sm.dq_s, bars, st, i, phase, dq_phase)
                    elif with_dq:
                        T.sync_threads(CONSUMERS_SYNC, threads)  # both halves of dS^T written
                        # dQ before dK: dQ's tile goes to the writer while dK runs.
                        T.wgmma_gemm(sm.ds_s[st, :, :], k_t, fr.dq, transpose_A=True, clear_accum=True, policy=FULL_COL)
                        T.wgmma_gemm(fr.dsT, sm.q_s[st, :, :], fr.dk, policy=FULL_ROW)
                        T.wait_wgmma(1)
                        T.barrier_wait(bars.dq_empty, flip(st ^ 1, dq_phase))  # the writer is done with step t-1
                        T.copy(fr.dq, sm.dq_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(bars.dq_full)
                    else:
                        T.wgmma_gemm(fr.dsT, sm.q_s[st, :, :], fr.dk, policy=FULL_ROW)
                    T.wait_wgmma(0)
                    T.barrier_arrive(bars.q_empty[st])
                    T.barrier_arrive(bars.do_empty[st])

    @T.macro
    def empty_turn(bars, walk, phase, loader):
        """A persistent CTA's tile with an odd step count ends with an empty turn on ring stage
        1, so that every tile starts on stage 0 (stages stay compile-time constants and one
        ``phase`` serves every ring barrier) and the two warpgroups keep alternating on the
        dS^T buffers: with turns, warpgroup 1 waits on ``ds_full[1]`` here, which warpgroup 0
        reaches only after its dQ turn of the tile's last step, before either writes
        ``ds_s[0]`` for the next tile's first step."""
        i = walk.n_pairs - 1
        if walk.n_steps % 2 == 1:
            if loader:
                T.barrier_wait(bars.q_empty[1], flip((i & 1) ^ 1, phase))
                T.barrier_arrive(bars.q_full[1])
                T.barrier_wait(bars.do_empty[1], flip((i & 1) ^ 1, phase))
                T.barrier_arrive(bars.do_full[1])
            else:
                T.barrier_wait(bars.q_full[1], flip(i & 1, phase))
                T.barrier_wait(bars.do_full[1], flip(i & 1, phase))
                if turns:
                    T.barrier_arrive(bars.ds_full[1])
                    if T.get_thread_binding() >= 128:
                        T.barrier_wait(bars.ds_full[1], flip(i & 1, phase))
                T.barrier_arrive(bars.q_empty[1])
                T.barrier_arrive(bars.do_empty[1])

    def step_buffers():
        """(shared memory, fragments) of the steps: the Q/dO rings, their statistics, dS^T and
        the dQ tile; the score tiles and the dK/dV (and dQ) accumulators.  (Allocated in this
        order; namespaces built at the end: the jit's rewriting takes no attribute stores.)"""
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
        dq, dq_s = None, None
        if with_dq:
            # Turns: one dQ fragment per warpgroup (each laid out over its own 128 threads).
            dq = [T.alloc_fragment([block_m, dim], acc) for _ in range(2)] if turns else T.alloc_fragment([block_m, dim], acc)
            dq_s = T.alloc_shared([block_m, dim], acc)
        sm = named(q_s=q_s, do_s=do_s, lse_s=lse_s, delta_s=delta_s, ds_s=ds_s, dq_s=dq_s)
        fr = named(sT=sT, dpT=dpT, pT=pT, dsT=dsT, dk=dk, dv=dv, capT=capT, dq=dq)
        return sm, fr

    def ring_barriers():
        return named(
            q_full=T.alloc_barrier(arrive_count=[32, 32]),
            do_full=T.alloc_barrier(arrive_count=[32, 32]),
            q_empty=T.alloc_barrier(arrive_count=[threads, threads]),
            do_empty=T.alloc_barrier(arrive_count=[threads, threads]),
            # Turns: only the warpgroup whose turn it is fills dq_s; ds_full says both halves of
            # a step's dS^T are in shared memory.
            dq_full=T.alloc_barrier(arrive_count=threads // 2 if turns else threads),
            ds_full=T.alloc_barrier(arrive_count=[threads, threads]) if turns else None,
            dq_empty=T.alloc_barrier(arrive_count=1),
        )

    @T.macro
    def kernel(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV, Ticket, score_scale, sm_scale, cap_in, left, right, rows_per_group, seqs):
        H, Hkv = Q.shape[2], K.shape[2]
        key_blocks = T.ceildiv(seqs.max_k, block_n)
        # Packed batches: real key tiles only, sequence-major (``seqinfo.packed_slots``).
        extent = seqs.grid(block_n, Hkv, keys=True)[0] if seqs.varlen else key_blocks * Hkv * seqs.batch
        with T.Kernel(extent, threads=total) as cta:
            if seqs.varlen:
                # rows_per_group: kv heads of a sequence walked together (``configs.head_group``).
                bx, hk, b = seqs.tile(cta, block_n, Hkv, total, keys=True, head_group=rows_per_group)
            else:
                bx, hk, b = dense_key_tile(cta, key_blocks, Hkv, seqs.batch, rows_per_group)
            # K and V stay for the whole CTA; after the last step they stage dK and dV.
            k_s = T.alloc_shared([block_n, dim], dtype)
            v_s = T.alloc_shared([block_n, dim_v], dtype)
            sm, fr = step_buffers()
            bar_kv = T.alloc_barrier(arrive_count=total)
            bars = ring_barriers()

            tx = T.get_thread_binding()
            n0 = bx * block_n
            seq = seqs.of(b)
            mask = TileMask(seq, left, right)
            qb_lo, n_qblocks, last_col = query_block_range(n0, block_n, block_m, mask)
            walk = KeyTileWalk(hk, H // Hkv, qb_lo, n_qblocks, block_m)

            T.tma_copy(seq.k_rows(K, n0, block_n, hk), k_s, barrier=bar_kv)
            T.tma_copy(seq.k_rows(V, n0, block_n, hk), v_s, barrier=bar_kv)
            T.barrier_arrive(bar_kv)

            if tx >= threads:
                T.set_max_nreg(24, 0)
                if tx < loader_end:
                    load_steps(Q, dO, LSE2, Delta, sm, bars, seq, walk, 0)
                elif with_dq and tx < writer_end:
                    write_steps(dQacc, sm, bars, seq, walk, 0)
            else:
                T.set_max_nreg(240, 1)
                T.clear(fr.dk)
                T.clear(fr.dv)
                T.barrier_wait(bar_kv, 0)
                compute_steps(k_s, v_s, sm, fr, bars, mask, n0, walk, last_col, score_scale, sm_scale, cap_in, 0, 0)
                store_tile(fr.dk, fr.dv, k_s, v_s, dK, dV, seq, n0, hk)

    # What the loader hands the other roles per tile (``tile_s``): batch entry (-1: no more
    # tiles), key block, kv head, then the sequence's ``seqinfo.FOUND_FIELDS``.  (Each role
    # derives the tile's mask and steps in its own body: in the kernel body an assignment binds
    # the expression once, while a plain helper's returned expressions are re-derived at every
    # use; folded into one helper, the generated CUDA doubled, 49 -> 97 KB.)
    n_fields = 3 + len(seqinfo.FOUND_FIELDS)

    def handed_tile(tile_s, buf):
        """(batch entry, key block, kv head) in hand-over slot ``buf`` (shared-memory reads,
        assigned to the reading role's registers)."""
        return tile_s[buf, 0], tile_s[buf, 1], tile_s[buf, 2]

    def handed_over(seqs, b, tile_s, buf):
        """The ``Sequence`` of the tile in hand-over slot ``buf`` (batch entry ``b``)."""
        if not seqs.varlen:
            return seqs.of(b)
        return seqs.of_fields(b, [tile_s[buf, 3 + f] for f in range(len(seqinfo.FOUND_FIELDS))])

    @T.macro
    def persistent_kernel(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV, Ticket, score_scale, sm_scale, cap_in, left, right, rows_per_group, seqs):
        H, Hkv = Q.shape[2], K.shape[2]
        groups = H // Hkv
        key_blocks = T.ceildiv(seqs.max_k, block_n)
        extent = seqs.grid(block_n, Hkv, keys=True)[0] if seqs.varlen else key_blocks * Hkv * seqs.batch
        grid = T.min(extent, num_sms)
        with T.Kernel(grid, threads=total) as cta:
            # Two K/V buffers: the next tile's K/V load under this tile's steps.
            k_s = T.alloc_shared([2, block_n, dim], dtype)
            v_s = T.alloc_shared([2, block_n, dim_v], dtype)
            sm, fr = step_buffers()
            tile_s = T.alloc_shared([2, n_fields], T.int32)  # the hand-over, one per K/V buffer
            found = seqinfo.found_buffer() if seqs.varlen else None  # the loader's search
            kv_full = T.alloc_barrier(arrive_count=[32, 32])  # the loader warp (+ TMA bytes)
            # Consumers done with K/V (and dK/dV stored from them); every writer lane has read
            # tile_s (one lane's arrive would not order its warp-mates' reads: racecheck).
            kv_empty = T.alloc_barrier(arrive_count=[threads + 32, threads + 32] if with_dq else [threads, threads])
            bars = ring_barriers()

            tiles = T.alloc_var(T.int32, init=0)  # tiles this role has started
            phase = T.alloc_var(T.int32, init=0)  # ring and ds_full parity left by earlier tiles
            dq_phase = T.alloc_var(T.int32, init=0)  # dq_full / dq_empty parity (one use per step)
            running = T.alloc_var(T.int32, init=1)
            b = T.alloc_var(T.int32, init=0)
            bx = T.alloc_var(T.int32, init=0)
            hk = T.alloc_var(T.int32, init=0)
            tx = T.get_thread_binding()

            if tx >= threads:
                T.set_max_nreg(24, 0)
                if tx < loader_end:
                    # The first tile of every CTA is its own slot, later ones come by ticket.
                    slot = T.alloc_var(T.int32, init=cta)
                    ticket = T.alloc_var(T.int32, init=0)
                    while slot < extent:
                        if seqs.varlen:
                            found_bx, found_hk, found_b = seqs.tile(slot, block_n, Hkv, 32, keys=True, head_group=rows_per_group, found=found, warp=True)
                        else:
                            found_bx, found_hk, found_b = dense_key_tile(slot, key_blocks, Hkv, seqs.batch, rows_per_group)
                        if found_bx < seqinfo.DEAD_SLOT:
                            buf = tiles % 2
                            T.barrier_wait(kv_empty[buf], ((tiles // 2) & 1) ^ 1)
                            if tx == threads:
                                tile_s[buf, 0] = found_b
                                tile_s[buf, 1] = found_bx
                                tile_s[buf, 2] = found_hk
                                if seqs.varlen:
                                    for f in T.unroll(len(seqinfo.FOUND_FIELDS)):
                                        tile_s[buf, 3 + f] = found[3 + f]
                            seq = seqs.of(found_b)
                            mask = TileMask(seq, left, right)
                            n0 = found_bx * block_n
                            qb_lo, n_qblocks, _ = query_block_range(n0, block_n, block_m, mask)
                            walk = KeyTileWalk(found_hk, groups, qb_lo, n_qblocks, block_m)
                            T.tma_copy(seq.k_rows(K, n0, block_n, found_hk), k_s[buf, :, :], barrier=kv_full[buf])
                            T.tma_copy(seq.k_rows(V, n0, block_n, found_hk), v_s[buf, :, :], barrier=kv_full[buf])
                            T.barrier_arrive(kv_full[buf])
                            load_steps(Q, dO, LSE2, Delta, sm, bars, seq, walk, phase)
                            empty_turn(bars, walk, phase, True)
                            phase = phase ^ (walk.n_pairs & 1)
                            tiles = tiles + 1
                        # The next slot, asked for once this tile's last loads are issued (the
                        # consumers are then two steps from its end): asked for at the tile's
                        # start, a CTA on a long causal tile held on to the next one a whole
                        # tile early, and 16k causal ran 2-3% slower.
                        if tx == threads:
                            ticket = T.atomic_add(Ticket[0], 1, return_prev=True)
                        slot = T.shfl_sync(ticket, 0) + grid
                    buf = tiles % 2  # no more tiles: say so
                    T.barrier_wait(kv_empty[buf], ((tiles // 2) & 1) ^ 1)
                    if tx == threads:
                        tile_s[buf, 0] = -1
                    T.barrier_arrive(kv_full[buf])
                elif with_dq and tx < writer_end:
                    while running == 1:
                        buf = tiles % 2
                        T.barrier_wait(kv_full[buf], (tiles // 2) & 1)
                        b, bx, hk = handed_tile(tile_s, buf)
                        seq = handed_over(seqs, b, tile_s, buf)
                        T.barrier_arrive(kv_empty[buf])
                        if b < 0:
                            running = 0
                        else:
                            mask = TileMask(seq, left, right)
                            qb_lo, n_qblocks, _ = query_block_range(bx * block_n, block_n, block_m, mask)
                            walk = KeyTileWalk(hk, groups, qb_lo, n_qblocks, block_m)
                            write_steps(dQacc, sm, bars, seq, walk, dq_phase)
                            dq_phase = dq_phase ^ (walk.n_steps & 1)
                            tiles = tiles + 1
            else:
                T.set_max_nreg(240, 1)
                while running == 1:
                    buf = tiles % 2
                    T.barrier_wait(kv_full[buf], (tiles // 2) & 1)
                    b, bx, hk = handed_tile(tile_s, buf)
                    if b < 0:
                        running = 0
                    else:
                        seq = handed_over(seqs, b, tile_s, buf)
                        mask = TileMask(seq, left, right)
                        n0 = bx * block_n
                        qb_lo, n_qblocks, last_col = query_block_range(n0, block_n, block_m, mask)
                        walk = KeyTileWalk(hk, groups, qb_lo, n_qblocks, block_m)
                        T.clear(fr.dk)
                        T.clear(fr.dv)
                        compute_steps(k_s[buf, :, :], v_s[buf, :, :], sm, fr, bars, mask, n0, walk, last_col, score_scale, sm_scale, cap_in, phase, dq_phase)
                        empty_turn(bars, walk, phase, False)
                        store_tile(fr.dk, fr.dv, k_s[buf, :, :], v_s[buf, :, :], dK, dV, seq, n0, hk)
                        T.barrier_arrive(kv_empty[buf])
                        phase = phase ^ (walk.n_pairs & 1)
                        dq_phase = dq_phase ^ (walk.n_steps & 1)
                        tiles = tiles + 1

    return dkdv_prim_func(dim, dim_v, dtype, varlen, persistent_kernel if persistent else kernel)


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
