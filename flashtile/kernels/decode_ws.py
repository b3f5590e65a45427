"""Split-KV decode over an FP8 (float8_e4m3fn) KV cache, warp-specialised (Hopper).

An FP8 cache halves the bytes a decode step reads, so the step should take half the time of
a bf16 cache's.  It did not in ``decode.py``'s one-warpgroup schedule (0.96-0.98x the bf16
cache's time: NOTES, 2026-11-23 third session): widening the FP8 tiles for the 16-bit WGMMAs
sat on the same warps as the softmax, with two cp.async stages (16 KB) in flight per CTA.
Here the work is split the way FlashAttention-3 splits its FP8 V transpose:

- a producer warpgroup streams key blocks of FP8 K and V rows from HBM into a ring of raw
  stages, ``num_stages`` blocks ahead: by TMA (one box per block when blocks sit on one page:
  a contiguous cache or pages of a multiple of ``block_n`` keys; else boxes of ``TMA_BOX`` = 16
  rows, each looked up through the block table) when the page size is a multiple of 16,
  else by ``cp.async`` (16 bytes per copy; each producer thread looks up its own key row
  through the block table, so any page size works, as in ``decode.py``), each stage's full
  mbarrier completed by the copies themselves;
- the grid is ``num_splits`` CTAs over the (entry, kv head, row tile) segments, each CTA a
  fraction of a segment's key blocks that may cross into the next segment (``schedule``'s
  worker shares: the CTA count need not be a multiple of the segment count, so every SM gets
  work; NOTES, fifteenth session).  The CTA runs its parts in turn (one or two; several
  back to back when there are more segments than CTAs: persistent CTAs);
- two or three consumer warpgroups take every C-th key block of each part (consumer ``w``
  the ``w``-th; the producer streams the part's blocks in order, each into a stage its
  consumer owns: ``ring_stage``): a consumer widens its block from the raw stage into its own
  fp16 tile (``cvt`` of e4m3 pairs, exact; rows outside the sequence as 0), releases the
  stage, and runs the GEMMs (Q K^T, P V in fp16, fp32 accumulation) and the online softmax as
  ``decode.py`` does, so one consumer's widening and softmax run under the others' GEMMs.  Each
  consumer writes an fp32 partial per part (slot ``(c + g) C + w``), which ``combine.py``
  merges, so an FP8 cache always runs at least C splits;
- or (``warp_mma``, kv heads of at most 16 query rows at d = 64 / 128, the common GQA decode):
  two consumer warpgroups of four ``mma.sync`` warps each, which take 16 keys of every block
  from the raw stage straight into registers, widen them there and run the softmax on 16-row
  fragments; the four warps merge once per part (``warp_mma.py``).  H100, B=8 32k: 1.97x the
  bf16 cache (96.5% of the bandwidth); H200 1.95x, where the widening consumers gave 1.32x
  (NOTES, eighteenth session).

Measured on an H100 (B=8 32k, FP8 vs the bf16 cache): 1.53x with the consumers widening
(74% of the bandwidth); the producer widening every block was its own serial chain (1.24x with
per-thread copies, 1.33x with TMA), and a single consumer set the pace before that (1.21-1.27x);
three consumers at d = 128, one stage each: 1.76x (85% of the bandwidth; page 16 1.58x).

The WGMMA operands are fp16 whatever q's dtype: every e4m3 value is exact in fp16 and the
conversion is one instruction per pair (to bf16 it is three), so q is converted to fp16 in the
kernel (exact for bf16 queries of magnitude 6.1e-5 .. 65504; smaller ones lose low bits as
fp16 subnormals, larger ones overflow) and P is rounded to fp16 (3 more mantissa bits than
bf16).  Output and lse are as ``decode.py``'s (same kernel arguments, same combine kernel).

A 16-bit cache can take the same schedule (``cache_dtype == dtype``: no widening, the
consumers read the ring): on the ``warp_mma`` consumers with TMA for long streams and many
segments (``decode.ws16_pays``: 0.8-3.4% faster than ``decode.py`` on an H200), on the WGMMA ones only
under the developer switch ``decode.WS_16BIT`` (slower than ``decode.py`` everywhere).

Shared memory at d = 128, 64-key blocks, three consumers: the Q tile once per consumer (48 KB)
+ 3 raw stages (48 KB) + three fp16 K/V tiles (96 KB) = 195 KB, one CTA (512 threads) per SM;
two consumers (other head dims): two Q copies, 4 raw stages, two fp16 tiles.
"""

import tilelang
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from .decode import BLOCK_M, GroupRows, cache_page, cache_row, decode_prim_func, row_tables, split_tile_io
from .decode import TMA_BOX, part_count, part_tile as shared_part_tile
from .softmax import online_softmax, tile_fragments
from .target import TARGET, WS_PASS_CONFIGS
from . import warp_mma as wm

FULL_ROW = T.GemmWarpPolicy.FullRow
WIDE = "float16"  # the WGMMAs' operand type over an FP8 cache (see the module docstring)
PRODUCER_SYNC = 10  # named barrier of the producer warpgroup (TileLang's own use low ids)
CONSUMER_SYNC = 11  # named barriers 11, 12 (, 13): one per consumer warpgroup (FP8: after its widening)
COPY_BYTES = 16  # one cp.async
CONSUMERS = 2  # consumer warpgroups (each a partial per part) where ``ws_config`` does not choose
SMEM_LIMIT = 227 * 1024  # shared memory one CTA may take on Hopper
# Registers per thread (setmaxnreg) by consumer count: the producer copies and computes
# addresses; the consumers hold S, P and O (167 registers measured with one consumer).  128
# producer threads plus 128 per consumer stay within the 64K-entry register file: 64 x 128 +
# 208 x 256, and 32 x 128 + 160 x 384.
REGS = {2: (64, 208), 3: (32, 160)}  # consumers -> (producer, consumer) registers


def ws_config(dim: int, dim_v: int, cache_itemsize: int = 1, consumers: int = 0, warp_mma: bool = False) -> dict:
    """Tiles for one head-dim pair: 64-key blocks at d = 128 (128 at d <= 64, 32 above 128, so
    a block's FP8 K+V is 16 KB at d = dim_v); ``consumers`` warpgroups (0: three for an FP8
    cache with 64-key blocks, else two), each owning ``num_stages / consumers`` raw stages: two
    each with two consumers (one where shared memory is short), one each with three (two do not
    fit at d = 128).

    ``warp_mma`` (``warp_mma.py``'s consumers): 64-key blocks, two consumers with two stages
    each.  Measured on an H100 (`h100-2026-11-28d/r2/`, `r3/`; B=8 32k contiguous / page 16 /
    4 query tokens / B=128 2k / B=1 8k, us): three consumers with two stages each 192.8 /
    194.6 / 199.9 / 215.5 / 13.5, with one each 180.5 / 193.6 / 192.5 / 213.3 / 13.1, two
    consumers with one each 188.4 / 202.0 / 194.5 / 215.5 / 12.5, with two each 182.4 / 189.7
    / 189.2 / 208.5 / 12.5: 48-64 KB of raw stages in flight per SM, not 32 or 96.

    The copies (not a tile parameter): by row (each producer thread looks up one key row and
    copies a share of it) for FP8 caches whose page size is not a multiple of ``TMA_BOX`` (the
    others take TMA), warp-coalesced through a row table for 16-bit ones.  Measured on an H100 (FP8, B=8 32k,
    `h100-2026-11-23f/`): the consumers widening their own blocks 1.53x the bf16 cache's speed,
    the producer widening them 1.33x with TMA and 1.24x with by-row copies; 4 raw stages as
    fast as 7 or faster.  The consumers' own step sets the pace (NOTES, eleventh session), so a
    third consumer adds a third split per SM: H200, d = 128 (`h200-2026-11-27b/c2/`), B=8 32k
    234 -> 206 us, B=1 131k 128 -> 108, B=128 2k 310 -> 246, page 16 248 -> 228.  Not at
    other block sizes: three consumers' 128-key S tiles (d <= 64) spill 324 bytes under the
    160-register share, and 32-key blocks (d > 128) were not measured."""
    width = max(dim, dim_v)
    block_n = 128 if width <= 64 else 64 if width <= 128 else 32
    if warp_mma:
        block_n = wm.BLOCK_N
    three = cache_itemsize == 1 and block_n == 64 and not warp_mma
    for c in [consumers] if consumers else [3, 2] if three else [CONSUMERS]:
        for num_stages in (2 * c, c):
            if smem_bytes(dim, dim_v, block_n, num_stages, cache_itemsize, c, warp_mma) <= SMEM_LIMIT - 2048:
                cfg = {"block_n": block_n, "num_stages": num_stages, "consumers": c}
                if warp_mma:
                    cfg["warp_mma"] = True
                return {**cfg, "tma_box": TMA_BOX} if cache_itemsize == 1 else cfg
    raise ValueError(f"no decode_ws tiles fit for head dims {dim}/{dim_v}")


def smem_bytes(dim: int, dim_v: int, block_n: int, num_stages: int, cache_itemsize: int = 1,
               consumers: int = CONSUMERS, warp_mma: bool = False) -> int:
    """Shared memory of one CTA: the 16-bit Q tile (once per consumer), the ring of K/V
    stages in the cache's element size, one widened fp16 K/V tile per consumer when the cache is
    FP8, row tables; with ``warp_mma`` the ring and each consumer's merge buffer (Q and the
    widened K/V live in registers)."""
    if warp_mma:
        return num_stages * block_n * (dim + dim_v) * cache_itemsize + wm.merge_bytes(dim_v, consumers)
    widened = consumers * block_n * (dim + dim_v) * 2 if cache_itemsize == 1 else 0
    return (consumers * BLOCK_M * dim * 2 + num_stages * block_n * (dim + dim_v) * cache_itemsize + widened
            + 4 * consumers * BLOCK_M * 4)


def ring_stage(w, i, per: int):
    """Ring stage of consumer ``w``'s ``i``-th block when each consumer owns ``per`` stages
    (ints or TIR expressions): each consumer cycles through its own stages, so the previous
    occupant of a stage is always the same consumer's block ``i - per``, whose phase that
    consumer has already waited for.  (A ring shared in stream order let a consumer wait on a
    stage whose previous phase, another consumer's block, had not landed yet: the parity wait
    then matched the phase before it and passed at once.  With three consumers over four stages
    that happened whenever two TMA loads completed out of issue order: an H100 launch failure,
    h100-2026-11-27b/fin.)"""
    return w * per + i % per


def ring_phase(i, per: int):
    """Parity of the phase of ``ring_stage(w, i, per)`` that holds block ``i``."""
    return (i // per) & 1


@tilelang.jit(target=TARGET, pass_configs=WS_PASS_CONFIGS)
def decode_ws_kernel(
    dim: int,
    dim_v: int,
    dtype: str,
    has_sinks: bool,
    has_softcap: bool,
    block_n: int = 64,
    num_stages: int = 4,
    cache_dtype: str = "float8_e4m3fn",
    tma_box: int = 0,
    consumers: int = CONSUMERS,
    warp_mma: bool = False,
    own_workers: bool = False,
    split_producer: bool = False,
):
    """Build the PrimFunc: arguments as ``decode.decode_prim_func``'s, with K and V in
    ``cache_dtype`` and KDescale / VDescale (B, Hkv) read when it is FP8, and ``num_splits``
    the number of CTAs (``schedule``'s workers; ``decode.worker_count`` picks it): CTA ``c``
    runs its share of the segments (``part_tile``) on its ``consumers`` (C, 2 or 3)
    warpgroups, which share the producer and the block stream (every C-th block each), and
    write partials that ``combine.py`` merges.

    An FP8 cache: the producer copies FP8 blocks into the raw ring (TMA: one box per block
    when blocks sit on one page, boxes of ``tma_box`` rows when the page size is a multiple of
    it; else by-row cp.async) and each consumer widens its own blocks into its
    own fp16 tile.  (Tried and measured slower, then removed: the producer widening every block
    (1.24-1.33x the bf16 cache against 1.53x), each producer thread widening its own copies,
    and the raw ring rotated against bank conflicts: NOTES, fifth and sixth sessions.)

    ``cache_dtype == dtype`` (a 16-bit cache) is the same schedule without the widening: the
    consumers read the ring's stages themselves, each stage's full barrier completed by the
    producer threads' ``cp.async.mbarrier.arrive`` (no wait in the producer at all).  Needs head
    dims whose rows are whole 16-byte copies.

    A consumer warp whose 16 tile rows are all padding (GQA decode: group x Sq real rows, all
    in warp 0 when at most 16) skips the softmax, the P cast and the O rescale; those rows' P
    and O are never stored (H100, B=8 32k FP8: 0.5% faster contiguous, 1-2% with pages of 16
    or 4 query tokens: NOTES, sixteenth session).

    ``warp_mma`` (an FP8 cache; the launcher's choice for at most 16 query rows per kv head at
    d, d_v in {64, 128}): the consumers are ``warp_mma.py``'s -- no Q tile, no widened tiles,
    the raw ring 128-byte swizzled for their 16-byte loads, a merge buffer per consumer, the
    tile's first 16 rows only.

    ``own_workers`` (with ``warp_mma``): each consumer is a worker of its own, the grid's
    ``num_splits`` CTAs ``num_splits x C`` workers (consumer w of CTA c is worker ``c C + w``),
    so a consumer runs whole parts (every block of its share of a segment) instead of every
    C-th block of the CTA's parts: half the parts per consumer, and a segment that lies within
    one worker's share is stored as O and lse directly (no partial, no combine).  Producer warp
    w streams worker ``c C + w``'s blocks into consumer w's stages (one lane issues the TMA);
    the producer's other warps idle.  ``split_producer`` (pages smaller than a block:
    ``decode.split_producer_pays``): the same producer warps for the shared parts (warp w
    issues consumer w's every C-th block), so one thread's lookups and TMA issues per block no
    longer serialise both consumers' streams.  When the workers divide the segments (each k
    whole ones), worker w's part p runs segment ``p x workers + w`` (``schedule.spread_segment``), so
    the segments in flight at once cover every kv head (H200, B=128 2k: 247.3 -> 239.6 us).

    A part's key range (SeqlensK's load, ``SplitTile``'s divisions) is built only once the part
    is known live (``decode.part_tile``'s ``build``), so a CTA's empty last part (most CTAs'
    at B=1: 8 segments over 128 CTAs) costs only its share arithmetic before the producer and
    the consumers exit (H200: FP8 B=1 8k 12.3 -> 11.5 us, B=1 131k 88.8 -> 89.6% of the
    bandwidth: NOTES, twenty-first session)."""
    widen = cache_dtype != dtype
    item = 1 if widen else 2  # bytes per cache element
    per_copy = COPY_BYTES // item  # elements per 16-byte copy
    assert dim % per_copy == 0 and dim_v % per_copy == 0 and 128 % block_n == 0
    assert num_stages % consumers == 0, "each consumer owns num_stages / consumers ring stages (``stage``)"
    box = tma_box or block_n  # rows per TMA box for pages smaller than a block (FP8; a multiple of it)
    assert block_n % box == 0 and consumers in REGS
    assert not warp_mma or (block_n == wm.BLOCK_N and wm.supports(dim, dim_v))
    tma = widen or warp_mma  # the producer's copies: TMA (by-row cp.async for odd pages), else ``fetch``
    assert not own_workers or warp_mma
    assert not split_producer or tma, "16-bit caches' copies need the whole producer warpgroup (``fetch``)"
    per_warp = own_workers or split_producer  # one producer warp per consumer
    acc = T.float32
    producer_regs, consumer_regs = REGS[consumers]
    rows = consumers * BLOCK_M  # consumer warpgroup w holds rows 64w .. 64w + 63: the tile's 64 query rows
    consumer_threads = consumers * 128
    wide = WIDE if widen else dtype  # the WGMMAs' operand type
    k_copies, v_copies = dim // per_copy, dim_v // per_copy  # 16-byte copies per row
    neg_inf = -T.infinity(acc)
    update, _ = online_softmax(rows, block_n, dim_v, has_sinks, has_softcap)
    if warp_mma:
        wm_state, wm_queries, wm_step, wm_merge = wm.warp_mma_macros(dim, dim_v, dtype, has_softcap, consumers,
                                                                     own_workers, has_sinks, cache_dtype)
    _, store = split_tile_io(dim, dim_v, dtype, wide, has_sinks, has_softcap, block_n, rows, synced=False)

    def consumer_blocks(tile, w):
        """Blocks of the part that consumer ``w`` runs: every C-th from the part's ``w``-th
        (so counts never grow with ``w``, and the stream reads the part's blocks in order);
        with ``own_workers`` all of them (the part is the consumer's own)."""
        if own_workers:
            return tile.my_blocks
        return (tile.my_blocks - w + consumers - 1) // consumers

    def consumer_counts(tile, serves):
        """``consumer_blocks`` of the part for each consumer in ``serves``, as registers."""
        return [T.alloc_var(T.int32, init=consumer_blocks(tile, w))[0] for w in serves]

    def key_block(tile, w, i):
        """Consumer ``w``'s ``i``-th key block of the part."""
        if own_workers:
            return tile.kb_first + i
        return tile.kb_first + w + consumers * i

    def part_tile(args, part):
        """(build, live) of CTA ``c``'s part ``part`` (``decode.part_tile``); its consumers'
        partials: slots ``(c + g) C + w``.  ``own_workers``: ``args`` are a worker's
        (``worker_args``), its partials slot ``c + g``, and the tile says whether the part is
        its whole segment."""
        if own_workers:
            return shared_part_tile(args, part, block_n, widen, has_softcap, 1, whole=True, spread=True)
        return shared_part_tile(args, part, block_n, widen, has_softcap, consumers)

    def worker_args(parts, w):
        """``part_tile``'s arguments for consumer ``w``: with ``own_workers`` its own worker's
        (worker ``c C + w`` of ``num_splits x C``), else the CTA's ``parts`` as they are."""
        if not own_workers:
            return parts
        c, num_splits = parts[:2]
        return (c * consumers + w, num_splits * consumers, *parts[2:])

    per = num_stages // consumers  # ring stages of each consumer

    def stage(w, i):
        return ring_stage(w, i, per)

    def phase(i):
        return ring_phase(i, per)

    def whole_block_box(page_size, page_shift):
        """One TMA box per key block: a contiguous cache, or pages of a multiple of the block."""
        return T.Or(page_shift == 31, page_size % block_n == 0)

    def page_boxes(page_size):
        """Boxes of ``box`` rows per key block: pages of a multiple of ``box`` (False when
        ``box`` is the whole block)."""
        return box < block_n and page_size % box == 0

    @T.macro
    def lookup(rows_s, BlockTable, tile, u, kb, pt, page_size, page_shift):
        """Threads 0 .. block_n - 1 of the producer: the cache row of each key of key block
        ``kb`` (the stream's ``u``-th) into ``rows_s[u % 2]`` (read by ``issue`` after a
        producer barrier)."""
        if pt < block_n:
            j = T.alloc_var(T.int32, init=tile.key(kb * block_n + pt))
            pg = T.alloc_var(T.int32, init=cache_page(j, page_size, page_shift))
            rows_s[u % 2, pt] = cache_row(BlockTable, tile.b, j, pg, page_size)

    @T.macro
    def issue(X, ring, rows_s, tile, u, st, pt, copies):
        """This thread's cp.async copies of the stream's ``u``-th block of X (K or V: ``copies``
        16-byte pieces per row) into ring stage ``st``: consecutive threads take
        consecutive pieces of a row, so a warp reads whole 128-byte lines (one thread per key
        row, 32 bytes of each row per instruction, ran at 61% of the bandwidth)."""
        for it in T.serial(T.ceildiv(block_n * copies, 128)):
            e = it * 128 + pt
            if (block_n * copies) % 128 == 0 or e < block_n * copies:
                r = e // copies
                col = (e % copies) * per_copy
                T.ptx_cp_async(T.access_ptr(ring[st, r, col], "w", per_copy),
                               T.access_ptr(X[rows_s[u % 2, r], tile.hk, col], "r", per_copy), per_copy)

    def by_row_copies(threads: int):
        """``issue_by_row`` for a producer of ``threads`` threads: a 128-thread warpgroup
        (two threads a row at 64-key blocks), or one warp (a producer warp per consumer:
        ``block_n / 32`` whole rows a thread)."""
        rows_per_pass = min(block_n, threads)
        row_threads = threads // rows_per_pass

        @T.macro
        def issue_by_row(K, V, k_ring, v_ring, BlockTable, tile, st, kb, pt, page_size, page_shift):
            """Pages that TMA cannot take: each thread looks up its key rows of block ``kb``
            itself and copies its share of them."""
            for p in list(range(block_n // rows_per_pass)):  # unrolled in Python: one pass (a warpgroup) or more
                if p == 0:
                    r = pt // row_threads
                else:
                    r = p * rows_per_pass + pt // row_threads
                sub = pt % row_threads
                j = T.alloc_var(T.int32, init=tile.key(kb * block_n + r))
                pg = T.alloc_var(T.int32, init=cache_page(j, page_size, page_shift))
                row = T.alloc_var(T.int32, init=cache_row(BlockTable, tile.b, j, pg, page_size))
                for c in T.serial(T.ceildiv(k_copies, row_threads)):
                    if k_copies % row_threads == 0 or sub + c * row_threads < k_copies:
                        col = (sub + c * row_threads) * per_copy
                        T.ptx_cp_async(T.access_ptr(k_ring[st, r, col], "w", per_copy),
                                       T.access_ptr(K[row, tile.hk, col], "r", per_copy), per_copy)
                for c in T.serial(T.ceildiv(v_copies, row_threads)):
                    if v_copies % row_threads == 0 or sub + c * row_threads < v_copies:
                        col = (sub + c * row_threads) * per_copy
                        T.ptx_cp_async(T.access_ptr(v_ring[st, r, col], "w", per_copy),
                                       T.access_ptr(V[row, tile.hk, col], "r", per_copy), per_copy)

        return issue_by_row

    @T.macro
    def tma_rows(rows_r, BlockTable, tile, kb, page_size, page_shift, box):
        """The first cache row of each ``box``-row TMA box of key block ``kb`` into registers
        ``rows_r`` (a box's keys sit on one page: the kernel takes this path only for page
        sizes that are multiples of ``box``, or a contiguous cache).  A box that starts past the
        entry's last key holds no key of it: its page is looked up at the last key instead, so
        the block table is never read past the entry's last page (the last 64-key block of a
        sequence can reach three 16-row pages past it).  Run before the producer waits for the
        stage, so the table loads' round trip overlaps the wait instead of delaying the copies
        (with pages of 16 rows, four dependent loads per block)."""
        n0 = T.alloc_var(T.int32, init=kb * block_n)
        for t in T.unroll(block_n // box):
            start = T.alloc_var(T.int32, init=T.min(n0 + t * box, tile.seqlen_k - 1))
            pg = T.alloc_var(T.int32, init=cache_page(start, page_size, page_shift))
            rows_r[t] = cache_row(BlockTable, tile.b, start, pg, page_size)

    @T.macro
    def tma_issue(K, V, k_ring, v_ring, raw_full, rows_r, tile, st, box):
        """Key block of K and V by TMA, as ``block_n // box`` boxes of ``box`` cache rows from
        ``rows_r`` (``tma_rows``), into raw stage ``st``, completing ``raw_full[st]`` with
        their bytes.  Rows past the entry's keys (or before its left padding) are read too,
        and zeroed by ``widen_mine``."""
        for t in T.unroll(block_n // box):
            T.tma_copy(K[rows_r[t]:rows_r[t] + box, tile.hk, :], k_ring[st, t * box:(t + 1) * box, :],
                       barrier=raw_full[st])
            T.tma_copy(V[rows_r[t]:rows_r[t] + box, tile.hk, :], v_ring[st, t * box:(t + 1) * box, :],
                       barrier=raw_full[st])
        T.barrier_arrive(raw_full[st])

    @T.macro
    def fetch(K, V, k_ring, v_ring, rows_s, BlockTable, tile, u, st, kb, pt, page_size, page_shift):
        """A 16-bit cache's ``u``-th stream block (key block ``kb``): its rows looked up into
        ``rows_s``, then (one producer barrier between: the table is written by threads
        0 .. block_n - 1) copied warp-coalesced (by-row copies ran this schedule at 82% of the
        bandwidth, coalesced 95%)."""
        lookup(rows_s, BlockTable, tile, u, kb, pt, page_size, page_shift)
        T.sync_threads(PRODUCER_SYNC, 128)
        issue(K, k_ring, rows_s, tile, u, st, pt, k_copies)
        issue(V, v_ring, rows_s, tile, u, st, pt, v_copies)

    @T.macro
    def widen_rows(k_s, v_s, k_ring, v_ring, tile, st, n0, ct, wg, masked: bool):
        """``widen_mine``'s copies, rows checked against the entry's keys or not (``masked``)."""
        for X_s, X_ring, width in ((k_s, k_ring, dim), (v_s, v_ring, dim_v)):
            pieces = block_n * width // 8  # 8-value pieces of the block
            # Unrolled: every shared-memory load of the block in flight before its conversions.
            for it in T.unroll(T.ceildiv(pieces, 128)):
                if pieces % 128 == 0 or it * 128 + ct < pieces:
                    r = (it * 128 + ct) // (width // 8)
                    c0 = (it * 128 + ct) % (width // 8) * 8
                    for e in T.vectorized(8):
                        x = T.cast(X_ring[st, r, c0 + e], WIDE)
                        X_s[wg, r, c0 + e] = T.if_then_else(tile.holds(n0 + r), x, T.cast(0, WIDE)) if masked else x

    @T.macro
    def widen_mine(k_s, v_s, k_ring, v_ring, tile, st, kb, ct, wg):
        """Consumer warpgroup ``wg`` (thread ``ct`` of 128) widens raw stage ``st``, which holds
        key block ``kb``, into its own fp16 tile, 8 values
        per copy.  Rows outside the entry's keys ``[lp, seqlen_k)`` become 0: TMA reads whole
        blocks, whose rows there may hold stale or NaN bytes (by-row copies load the nearest
        valid key instead); the mask gives those keys zero weight, and 0 * a finite V row is 0.
        Only a part's boundary blocks check their rows: the check was ~6 integer instructions
        per 8 values in the consumers' step, the FP8 decode's limit (H100, B=8 32k: 204 ->
        202 us, 4 query tokens 212 -> 209, B=1 131k 112 -> 111: NOTES, fourteenth session)."""
        n0 = T.alloc_var(T.int32, init=kb * block_n)
        if tile.holds(n0, block_n):
            widen_rows(k_s, v_s, k_ring, v_ring, tile, st, n0, ct, wg, False)
        else:
            widen_rows(k_s, v_s, k_ring, v_ring, tile, st, n0, ct, wg, True)

    q_pieces = BLOCK_M * dim // 8 // 128  # 8-value pieces of a 64-row Q tile per thread of 128

    def q_piece(it, t):
        """(tile row, first column) of thread ``t``'s ``it``-th 8-value piece of a Q tile."""
        return (it * 128 + t) // (dim // 8), (it * 128 + t) % (dim // 8) * 8

    def q_row(tile, j, H, Sq):
        """Row in Q, ``(b Sq + t) H + h``, of the part's ``j``-th row among its kv head's rows
        (token ``j // group``, head ``hk group + j % group``)."""
        return (tile.b * Sq + j // tile.group) * H + tile.hk * tile.group + j % tile.group

    def producer(serves: tuple, threads: int):
        """``produce`` for the consumers ``serves`` by ``threads`` producer threads: all
        consumers by the warpgroup (128), or one consumer by one warp (32: ``own_workers``,
        ``split_producer``)."""
        issue_by_row = by_row_copies(threads)

        @T.macro
        def produce(K, V, k_ring, v_ring, rows_s, full, empty, BlockTable, parts, pt, page_size, page_shift):
            """The producer's stream, part by part of the CTA's share (``part_tile``): round ``i``
            takes block ``i`` of every consumer that has one (consumer order, so the part's blocks
            in key order), each into its consumer's next stage (``stage``, counted over all
            parts: ``issued``) once that consumer has released the stage's previous block, so each
            consumer runs up to ``per`` blocks ahead.

            FP8: only copies, one TMA box per block when every block sits on one page (a contiguous
            cache, or pages of a multiple of ``block_n`` keys), boxes of ``box`` rows when the pages
            are multiples of ``box`` (vLLM's 16), else by-row cp.async, each thread's arrival on the
            stage's full barrier when its copies land; the consumer widens the stage.  (16-row
            boxes for every page size cost contiguous caches 2-3% on the H100: NOTES.)  A 16-bit
            cache: rows looked up, then warp-coalesced cp.async (``fetch``)."""
            u = T.alloc_var(T.int32, init=0)  # blocks issued so far (``fetch``'s row-table buffer)
            issued = T.alloc_local([len(serves)], T.int32)  # per consumer: blocks of earlier parts
            for w in T.unroll(len(serves)):
                issued[w] = 0
            rows_r = T.alloc_local([block_n // box], T.int32)  # the next block's TMA box rows (``tma_rows``)
            for part in T.serial(part_count(parts)):
                build, live = part_tile(parts, part)
                if live:
                    tile = build()
                    counts = consumer_counts(tile, serves)
                    for i in T.serial(counts[0]):
                        for k, (w, count) in enumerate(zip(serves, counts)):  # unrolled in Python (TileLang turns ``range`` into a loop)
                            if i < count:
                                st = stage(w, issued[k] + i)
                                kb = T.alloc_var(T.int32, init=key_block(tile, w, i))
                                if tma:  # the table lookups before the wait
                                    if whole_block_box(page_size, page_shift):
                                        tma_rows(rows_r, BlockTable, tile, kb, page_size, page_shift, block_n)
                                    elif page_boxes(page_size):
                                        tma_rows(rows_r, BlockTable, tile, kb, page_size, page_shift, box)
                                T.barrier_wait(empty[st], phase(issued[k] + i) ^ 1)  # a fresh barrier passes parity 1
                                if not tma:
                                    fetch(K, V, k_ring, v_ring, rows_s, BlockTable, tile, u, st, kb, pt, page_size, page_shift)
                                    T.cp_async_barrier_noinc(full[st])  # arrives once this thread's copies land
                                elif whole_block_box(page_size, page_shift):
                                    tma_issue(K, V, k_ring, v_ring, full, rows_r, tile, st, block_n)
                                elif page_boxes(page_size):
                                    tma_issue(K, V, k_ring, v_ring, full, rows_r, tile, st, box)
                                else:
                                    issue_by_row(K, V, k_ring, v_ring, BlockTable, tile, st, kb, pt, page_size, page_shift)
                                    T.cp_async_barrier_noinc(full[st])
                                u += 1
                    for k, count in enumerate(counts):
                        issued[k] = issued[k] + count

        return produce

    produce = producer(tuple(range(consumers)), 128)
    warp_produce = [producer((w,), 32) for w in range(consumers)] if per_warp else []

    @T.macro
    def clear_my_queries(q_s, wg, ct):
        """Consumer ``wg``'s 64 rows of ``q_s`` as 0, once before its first part: rows past a
        part's real rows are never loaded (``load_my_queries``), so they hold 0 or an earlier
        part's finite queries, whose scores only reach rows that are never stored."""
        for it in T.unroll(q_pieces):
            r, c0 = q_piece(it, ct)
            for e in T.vectorized(8):
                q_s[wg * BLOCK_M + r, c0 + e] = T.cast(0, wide)

    @T.macro
    def load_my_queries(Q, q_s, tok_s, tile, wg, ct, H, Sq):
        """Consumer ``wg``'s 64 tile rows of the part's segment: their query tokens into
        ``tok_s`` (the mask's rows) and the real rows' Q rows into its own rows of ``q_s`` as
        fp16, between two barriers of its 128 threads (the previous part's GEMMs and softmax
        are done with both; the WGMMAs read the new rows).  Only real rows: GQA decode has
        group x Sq of 64 (4 at 32/8 heads), and persistent CTAs load them once per part.
        (Tried and measured slower, then removed: the producer staging each part's Q rows in
        shared memory a part ahead, the consumers taking them from there; H100, B=128 2k
        224.4 -> 229.8 us, B=64 4k 213.4 -> 217.9, the large cases equal: NOTES, seventeenth
        session.)"""
        T.sync_threads(CONSUMER_SYNC + wg, 128)
        if ct < BLOCK_M:
            tok_s[wg * BLOCK_M + ct] = (tile.r0 + ct) // tile.group
        for it in T.unroll(q_pieces):
            r, c0 = q_piece(it, ct)
            if tile.r0 + r < tile.rows:
                j = T.alloc_var(T.int32, init=tile.r0 + r)
                qrow = T.alloc_var(T.int32, init=q_row(tile, j, H, Sq))
                for e in T.vectorized(8):
                    q_s[wg * BLOCK_M + r, c0 + e] = T.cast(Q[qrow, c0 + e], wide)
        T.fence_proxy_async()  # generic-proxy stores, read by the WGMMAs (async proxy)
        T.sync_threads(CONSUMER_SYNC + wg, 128)

    @T.macro
    def kernel(Q, K, V, BlockTable, SeqlensK, Leftpad, O, LSE, Opart, LSEpart, Sinks, KDescale, VDescale, score_scale,
               cap_in, left, right, num_splits, page_size, page_shift, Sq):
        H, Hkv = Sinks.shape[0], K.shape[1]
        with T.Kernel(num_splits, threads=consumer_threads + 128) as c:
            if warp_mma:
                T.import_source(wm.CVT_SOURCE)
                k_ring = T.alloc_shared([num_stages, block_n, dim], cache_dtype)
                v_ring = T.alloc_shared([num_stages, block_n, dim_v], cache_dtype)
                # 16-byte loads of 8 key rows at one column (``warp_mma``) stay off each other's banks.
                T.annotate_layout({k_ring: make_swizzled_layout(k_ring), v_ring: make_swizzled_layout(v_ring)})
                rows_s = T.alloc_shared([2, block_n], T.int32)  # cache rows of the next blocks' keys (producer)
                regs = wm_state()
            else:
                q_s = T.alloc_shared([rows, dim], wide)
                k_ring = T.alloc_shared([num_stages, block_n, dim], cache_dtype)
                v_ring = T.alloc_shared([num_stages, block_n, dim_v], cache_dtype)
                # The consumers' K/V tiles: one widened fp16 tile per consumer, or the ring itself.
                k_s = T.alloc_shared([consumers, block_n, dim], WIDE) if widen else k_ring
                v_s = T.alloc_shared([consumers, block_n, dim_v], WIDE) if widen else v_ring
                rows_s = T.alloc_shared([2, block_n], T.int32)  # cache rows of the next blocks' keys (producer)
                tok_s, head_s, _ = row_tables(rows)  # tok_s: the mask's rows (head_s: sinks, read by the direct store only)
                s, p, o, m, m_prev, m_safe, alpha, row_sum, l, lse = tile_fragments(rows, block_n, dim_v, wide)
            # Ring stage ``stage(w, i)`` holds consumer w's block i: full after the producer's
            # 128 arrivals (its warp's 32 with ``own_workers``) and its TMA bytes, empty once the
            # block's consumer has widened it (FP8) or its GEMMs have read it (a 16-bit cache).
            full = T.alloc_barrier(arrive_count=[32 if per_warp else 128] * num_stages)
            empty = T.alloc_barrier(arrive_count=[128] * num_stages)

            tx = T.get_thread_binding()
            wg = T.alloc_var(T.int32, init=T.min(tx // 128, consumers))  # consumers: the producer
            T.pdl_trigger()  # the combine may launch early (decode.decode_kernel)
            parts = (c, num_splits, H, Hkv, Sq, SeqlensK, Leftpad, left, right, KDescale, score_scale, cap_in)
            T.sync_threads()  # the barriers' initialisation, for every thread (no sync pass here)
            if tx >= consumer_threads:  # producer (a condition on the thread index: TileLang lays the fragments out over the consumers)
                T.set_max_nreg(producer_regs, 0)
                if per_warp:  # warp w streams consumer w's blocks (an exact 32-thread range: TMA's elected lane is the warp's)
                    for w in wm.unrolled(consumers):
                        if T.And(tx >= consumer_threads + 32 * w, tx < consumer_threads + 32 * (w + 1)):
                            warp_produce[w](K, V, k_ring, v_ring, rows_s, full, empty, BlockTable,
                                            worker_args(parts, w), tx % 32, page_size, page_shift)
                else:
                    produce(K, V, k_ring, v_ring, rows_s, full, empty, BlockTable, parts, tx - consumer_threads,
                            page_size, page_shift)
            elif warp_mma:  # consumer warpgroups of four mma.sync warps (``warp_mma``)
                T.set_max_nreg(consumer_regs, 1)
                done = T.alloc_var(T.int32, init=0)  # blocks of earlier parts (ring position)
                parts = worker_args(parts, wg)
                for part in T.serial(part_count(parts)):
                    build, live = part_tile(parts, part)
                    if live:
                        tile = build()
                        out_scale = T.alloc_var(T.float32, init=VDescale[tile.b, tile.hk] if widen else 1.0)
                        wm_queries(Q, regs, tile, tx % 128, H, Sq)
                        two_halves = T.alloc_var(T.int32, init=tile.rows - tile.r0 > 8)
                        mine = T.alloc_var(T.int32, init=consumer_blocks(tile, wg))
                        for i in T.serial(mine):
                            st = T.alloc_var(T.int32, init=stage(wg, done + i))
                            T.barrier_wait(full[st], phase(done + i))
                            wm_step(regs, k_ring, v_ring, empty, tile, st, key_block(tile, wg, i), tx % 128, two_halves)
                        wm_merge(regs, Opart, LSEpart, tile, wg, tx % 128, out_scale, CONSUMER_SYNC + wg, O, LSE, Sinks)
                        done += mine
            else:  # consumer warpgroups: every C-th block of each part, from the wg-th
                T.set_max_nreg(consumer_regs, 1)
                done = T.alloc_var(T.int32, init=0)  # blocks of earlier parts (ring position)
                clear_my_queries(q_s, wg, tx % 128)
                for part in T.serial(part_count(parts)):
                    build, live = part_tile(parts, part)
                    if live:
                        tile = build()
                        # The output descale now, so its load's round trip overlaps the part
                        # rather than delaying the store (persistent CTAs: one per part).
                        out_scale = T.alloc_var(T.float32, init=VDescale[tile.b, tile.hk] if widen else 1.0)
                        load_my_queries(Q, q_s, tok_s, tile, wg, tx % 128, H, Sq)
                        T.clear(o)
                        T.clear(l)
                        T.fill(m, neg_inf)
                        mine = T.alloc_var(T.int32, init=consumer_blocks(tile, wg))
                        # Warp k of a consumer holds tile rows 16k .. 16k + 15 (WGMMA's m64 layout).
                        padding_warp = T.alloc_var(T.int32, init=tx % 128 // 32 * 16 >= tile.rows - tile.r0)
                        for i in T.serial(mine):
                            st = T.alloc_var(T.int32, init=stage(wg, done + i))
                            kb = T.alloc_var(T.int32, init=key_block(tile, wg, i))
                            T.barrier_wait(full[st], phase(done + i))
                            if widen:
                                # Widen this block into our own tile (our previous GEMMs have
                                # finished reading it), release the raw stage, then one barrier
                                # of our 128 threads before the WGMMAs read the whole tile.
                                widen_mine(k_s, v_s, k_ring, v_ring, tile, st, kb, tx % 128, wg)
                                T.fence_proxy_async()  # generic-proxy stores, read by the WGMMAs (async proxy)
                                T.barrier_arrive(empty[st])
                                T.sync_threads(CONSUMER_SYNC + wg, 128)
                            else:
                                T.fence_proxy_async()  # cp.async's stores, read by the WGMMAs (async proxy)
                            T.gemm(q_s, k_s[wg if widen else st, :, :], s, transpose_B=True, clear_accum=True,
                                   policy=FULL_ROW)
                            if padding_warp == 0:
                                update(s, m, m_prev, m_safe, alpha, row_sum, l, kb * block_n, tile.t_first,
                                       tile.t_last, tile.mask, tile.sc, tile.cap, GroupRows(tok_s, head_s))
                                T.copy(s, p)
                                for r, cc in T.Parallel(rows, dim_v):
                                    o[r, cc] *= alpha[r]
                            T.gemm(p, v_s[wg if widen else st, :, :], o, policy=FULL_ROW)
                            if not widen:
                                T.barrier_arrive(empty[st])
                        store(o, m, m_safe, alpha, row_sum, l, lse, O, LSE, Opart, LSEpart, Sinks, tok_s, head_s, tile, 0,
                              out_scale if widen else None)
                        done += mine

    return decode_prim_func(dim, dim_v, dtype, cache_dtype, kernel)
