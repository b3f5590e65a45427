"""Split-KV decode kernel (Hopper): attention of a few query tokens over a (paged) KV cache.

Decode reads the whole cache once per step and does almost no arithmetic, so the kernel is
built to keep HBM busy, not the tensor cores:

- one CTA per (split, row tile, kv head, batch); a CTA's query rows are every query head of
  one GQA group times every query token (``row = token * group + head_in_group``), padded to
  the 64 rows of one warpgroup's WGMMA.  GQA therefore reads each K/V tile once for the
  whole group;
- the key range of a batch entry (``[leftpad, seqlen_k)`` narrowed by the causal/window
  bounds of the tile's tokens) is cut into ``num_splits`` slices of key blocks, one per CTA,
  so a batch of one sequence still fills every SM;
- K and V tiles of ``block_n`` keys stream through a ``num_stages`` shared-memory pipeline of
  cp.async copies (16-byte vectors).  Each row of a tile is looked up through the block table
  (``page = block_table[b, j // page_size]``, row ``j % page_size``), so any page size works,
  and a contiguous cache is the special case of one page per cache row (``page_size =
  seqlen_cache``, table = ``cache_batch_idx``).  The lookup runs once per key row, for a
  chunk of ``ROW_CHUNK_BLOCKS`` key blocks at a time (into ``row_s``; each thread's page-table
  loads of a chunk are issued together, one round trip), and the caches are flat
  ``(pages * page_size, Hkv, d)`` rows, so the copies' addresses are a multiply-add.  (Done
  inside the copy loop, the lookup was ~8 64-bit divisions per 16-byte copy -- TileLang widens
  dynamic-shape index arithmetic to 64 bits -- ~13k cycles of integer work per 64 KB step and
  a third of the HBM bandwidth on the H100: h100-2026-11-23b/decode-first.)  A power-of-two
  page size takes a shift instead of a division.  A tile row outside the entry's keys
  ``[leftpad, seqlen_k)`` loads the nearest valid key instead (clamped position), so stale or
  NaN cache contents past the end or before the left padding are never read; the mask gives
  those rows zero weight.  K and V rows are copied in one loop, so each step is one cp.async
  group (two groups per step make TileLang 0.1.15's pipeline epilogue emit a non-constant
  ``wait_group`` that fails in codegen).  With ``dim != dim_v`` (e.g. 192/128) that loop
  needs a guard on the shorter tile, which TileLang does not turn into cp.async: those head
  dims load synchronously (correct, slower);
- online softmax in exp2 with fp32 statistics; the mask is masks.py's (``TileMask`` with the cache's left padding as ``key_lo``) per query token
  (bottom-right causal on the entry's own length, window) plus ``j >= leftpad``; only blocks
  at a boundary pay for the elementwise select;
- ``num_splits == 1``: the epilogue folds in the sink and writes the output and lse directly.
  Otherwise each split writes its normalised partial output (fp32) and natural-log lse, and
  ``combine.py`` merges them (and folds in the sink, once).

Static structure (one compile each): dtype, head dims, sinks on/off, softcap on/off, tiles.
Batch, heads, GQA ratio, query tokens, cache sizes, page size, lengths and splits are runtime.
TileLang computes global addresses of dynamically shaped buffers in 64 bits, so caches of 2^31
or more elements index correctly as written (an explicit int64 cast in the copy loop would make
TileLang 0.1.15's vectorize planner fall back to 4-byte copies: a loop with two stores takes
the GCD of every node's width, and an int32 -> int64 cast counts 2 lanes).  The scalars of
the key range are ``T.alloc_var`` registers, which keeps TileLang's simplifier (Z3) from
spending minutes on their nested min/max/div.
"""


import functools
import math
import os
from typing import NamedTuple

import tilelang
import tilelang.language as T
import torch

from . import debug, launch, target
from .masks import TileMask, host_window
from .schedule import max_parts, share_blocks, split_part, spread_segment
from .seqinfo import Sequence
from .softmax import LOG2E, online_softmax, tile_fragments
from .target import PASS_CONFIGS, TARGET

DECODE_PASS_CONFIGS = PASS_CONFIGS
FULL_ROW = T.GemmWarpPolicy.FullRow
BLOCK_M = 64  # query rows (group heads x tokens) per CTA: one warpgroup's WGMMA M


def row_tile_count(H, Hkv, Sq):
    """Row tiles of one kv head: its ``group x Sq`` query rows, ``BLOCK_M`` per tile."""
    return T.ceildiv((H // Hkv) * Sq, BLOCK_M)


def segment_count(B, Hkv, row_tiles):
    """Segments of a decode step, one per (entry, kv head, row tile): ``schedule``'s units of work."""
    return B * Hkv * row_tiles


def segment_index(b, hk, row_tile, Hkv, row_tiles):
    """Segment of (entry ``b``, kv head ``hk``, ``row_tile``): entry-major, row tile fastest, the
    order the decode kernels and the combine share (``segment_coords`` inverts it)."""
    return (b * Hkv + hk) * row_tiles + row_tile


def segment_coords(g, Hkv, row_tiles):
    """(entry, kv head, row tile) of segment ``g`` (``segment_index``'s inverse)."""
    return g // row_tiles // Hkv, g // row_tiles % Hkv, g % row_tiles


class GroupRows:
    """A decode tile's rows as the shared online softmax sees them: tile row i is query token
    ``tok_s[i] = (r0 + i) // group`` of head ``head_s[i] = hk * group + (r0 + i) % group`` (GQA
    packing), both looked up once per CTA into shared memory.  With ``sinks`` (the (H,) tensor)
    it hands ``softmax.finish`` each row's sink logit."""

    def __init__(self, tok_s, head_s, sinks=None):
        self.tok_s, self.head_s, self.sinks = tok_s, head_s, sinks

    def query(self, i):
        return self.tok_s[i]

    def at(self, i):
        return self.sinks[self.head_s[i]]


class SplitTile:
    """One decode worker's part of one segment, as registers (``T.alloc_var``: opaque to
    TileLang's simplifier, which otherwise spends minutes proving facts about the nested
    min/max/div of the key range).  Built inside the kernel by every decode schedule.

    The segment is row tile ``row_tile`` of kv head ``hk`` of entry ``b``: rows ``r0 .. r0 +
    63`` of the ``rows = group x Sq`` rows, query tokens ``t_first .. t_last``, which see keys
    ``[k_lo, k_hi)``, i.e. ``n_blocks`` key blocks from ``kb_lo``.  ``share = (u0, u1, units)``
    is the part's fraction of the segment (``schedule.split_part``: units ``[u0, u1)`` of
    ``units``), i.e. ``my_blocks`` blocks from ``kb_first``.  ``slot``: the partial slot of
    the part (``schedule``; consumer ``w`` of a warp-specialised CTA writes ``slot + w``).
    ``mask`` is masks.py's view of the entry (Sq query tokens, keys ``[lp, seqlen_k)``); ``sc``
    / ``cap`` the score and softcap input scales with an FP8 cache's K descale folded in."""

    def __init__(self, row_tile, hk, b, H, Hkv, Sq, SeqlensK, Leftpad, left, right, share, block_n,
                 KDescale, score_scale, cap_in, fp8: bool, has_softcap: bool, slot=0):
        acc = T.float32

        def reg(dtype, value):
            return T.alloc_var(dtype, init=value)[0]

        self.b, self.hk, self.H, self.Sq = b, hk, H, Sq
        self.group = reg(T.int32, H // Hkv)
        self.rows = reg(T.int32, self.group * Sq)
        self.tile_rows = reg(T.int32, T.min(self.rows, BLOCK_M))  # rows of a partial slot
        self.slot = reg(T.int32, slot)
        self.r0 = reg(T.int32, row_tile * BLOCK_M)
        self.seqlen_k = reg(T.int32, SeqlensK[b])
        self.lp = reg(T.int32, Leftpad[b])
        self.off = reg(T.int32, self.seqlen_k - Sq)
        self.t_first = reg(T.int32, self.r0 // self.group)
        self.t_last = reg(T.int32, (T.min(self.r0 + BLOCK_M, self.rows) - 1) // self.group)
        k_lo = reg(T.int32, T.max(T.max(self.lp, self.t_first + self.off - left), 0))
        k_hi = reg(T.int32, T.min(self.seqlen_k, self.t_last + self.off + right + 1))
        self.kb_lo = reg(T.int32, k_lo // block_n)
        self.n_blocks = reg(T.int32, T.max(T.ceildiv(T.max(k_hi, 0), block_n) - self.kb_lo, 0))
        u0, u1, units = share
        first, count = share_blocks(u0, u1, self.n_blocks, units)
        self.kb_first = reg(T.int32, self.kb_lo + first)
        self.my_blocks = reg(T.int32, count)
        self.mask = TileMask(Sequence(False, b, Sq, self.seqlen_k, key_lo=self.lp, off=self.off), left, right)
        # An FP8 cache's K descale scales every score: folded into the scale the softmax
        # applies (into the softcap's input scale with softcap); V's scales the output.
        kd = reg(acc, KDescale[b, hk] if fp8 else 1.0)
        self.sc = reg(acc, score_scale * kd if (fp8 and not has_softcap) else score_scale)
        self.cap = reg(acc, cap_in * kd if fp8 else cap_in)

    def out_row(self, i):
        """Row of tile row ``i`` (a real one) in Q/O, ``(b Sq + t) H + h``: with ``x = r0 + i``
        the row's index among the kv head's rows (token ``x // group``, head ``hk group + x %
        group``), that is ``b Sq H + hk group + x + (x // group)(H - group)``."""
        x = self.r0 + i % BLOCK_M
        return self.b * self.Sq * self.H + self.hk * self.group + x + x // self.group * (self.H - self.group)

    def lse_row(self, i):
        """Row of tile row ``i`` (a real one) in the (B, H, Sq) lse: ``(b H + h) Sq + t``."""
        x = self.r0 + i % BLOCK_M
        return (self.b * self.H + self.hk * self.group + x % self.group) * self.Sq + x // self.group

    def partial_row(self, i):
        """Row of tile row ``i`` in the partials (``Opart``/``LSEpart``): slot ``slot + i //
        64`` (a warp-specialised CTA's consumer ``i // 64``), ``tile_rows`` rows per slot."""
        return (self.slot + i // BLOCK_M) * self.tile_rows + i % BLOCK_M

    def holds(self, j, n=1):
        """Whether keys ``j .. j + n - 1`` are all among the entry's keys ``[lp, seqlen_k)``."""
        return T.And(j >= self.lp, j + n <= self.seqlen_k)

    def key(self, j):
        """Key ``j`` clamped into the entry's keys ``[lp, seqlen_k)``: a tile row outside them
        loads the nearest valid key (masked to zero weight), so stale or NaN cache contents
        past the end or before the left padding are never read."""
        return T.min(T.max(j, self.lp), self.seqlen_k - 1)


def part_count(args):
    """How many parts each CTA of a decode grid loops over (``schedule.max_parts`` of the
    CTA count and the segments); ``args`` as ``part_tile``'s."""
    c, num_splits, H, Hkv, Sq, SeqlensK = args[:6]
    return max_parts(num_splits, segment_count(SeqlensK.shape[0], Hkv, row_tile_count(H, Hkv, Sq)))


def part_tile(args, part, block_n: int, fp8: bool, has_softcap: bool, consumers: int = 1, whole: bool = False,
              spread: bool = False):
    """(build, live) of CTA ``c``'s part ``part`` of a decode grid of ``num_splits`` CTAs:
    ``schedule.split_part`` over the segments (entry, kv head, row tile; row tile fastest).
    ``args = (c, num_splits, H, Hkv, Sq, SeqlensK, Leftpad, left, right, KDescale,
    score_scale, cap_in)``, one tuple the macros pass on.  ``live`` is false for an empty part
    (its segment index is clamped, so nothing past the tensors is read).  The part's partials
    go to slots ``(c + g) x consumers + w``.  ``spread``: whole segments per worker run in
    ``schedule.spread_segment`` order.  ``whole``: the tile also gets ``whole``, 1 when
    the part is its whole segment (no other worker touches it: O and lse may be stored
    directly, ``combine.py`` skips the segment's rows).  ``build()`` makes the part's SplitTile;
    callers make it under ``if live``, so an empty part skips its key range (a SeqlensK load
    and a dozen divisions: H200, FP8 B=1 8k 12.3 -> 11.5 us, NOTES twenty-first session)."""
    c, num_splits, H, Hkv, Sq, SeqlensK, Leftpad, left, right, KDescale, score_scale, cap_in = args
    row_tiles = T.alloc_var(T.int32, init=row_tile_count(H, Hkv, Sq))[0]
    segments = T.alloc_var(T.int32, init=segment_count(SeqlensK.shape[0], Hkv, row_tiles))[0]
    g, u0, u1 = split_part(c, part, num_splits, segments, lambda x: T.alloc_var(x.dtype, init=x)[0])
    seg = T.alloc_var(T.int32, init=g)[0]
    u0 = T.alloc_var(T.int32, init=u0)[0]
    u1 = T.alloc_var(T.int32, init=u1)[0]

    def build():
        gc = T.alloc_var(T.int32, init=T.min(seg, segments - 1))[0]
        if spread:
            gc = T.alloc_var(T.int32, init=spread_segment(gc, segments, num_splits,
                                                         lambda x: T.alloc_var(T.int32, init=x)[0]))[0]
        b, hk, row_tile = segment_coords(gc, Hkv, row_tiles)
        hk = T.alloc_var(T.int32, init=hk)[0]
        b = T.alloc_var(T.int32, init=b)[0]
        tile = SplitTile(row_tile, hk, b, H, Hkv, Sq, SeqlensK, Leftpad, left, right, (u0, u1, num_splits), block_n,
                         KDescale, score_scale, cap_in, fp8, has_softcap, slot=(c + seg) * consumers)
        if whole:
            tile.whole = T.alloc_var(T.int32, init=T.Cast(T.int32, T.And(u0 == 0, u1 == num_splits)))[0]
        return tile

    return build, T.And(seg < segments, u0 < u1)


def cache_page(j, page_size, page_shift):
    """Logical page of key ``j``: a shift for a power-of-two page size (``page_shift >= 0``;
    31 for a contiguous cache, whose visible keys all sit on page 0), else a division."""
    return T.if_then_else(page_shift >= 0, T.shift_right(j, page_shift), j // page_size)


def cache_row(BlockTable, b, j, pg, page_size):
    """Flat cache row of key ``j`` of entry ``b``, whose logical page is ``pg`` (``cache_page``):
    the page the block table maps it to, times the page size, plus its row within the page."""
    return BlockTable[b, pg] * page_size + (j - pg * page_size)


def split_tile_io(dim: int, dim_v: int, dtype: str, q_dtype: str, has_sinks: bool, has_softcap: bool, block_n: int,
                  tile_rows: int = BLOCK_M, synced: bool = True):
    """Macros ``load_queries`` and ``store`` shared by the decode schedules (``block_n`` only
    shapes the softmax macros' tiles).  ``tile_rows``: 64, or 128 where two warpgroups each
    hold the same 64 query rows (row i is query row ``i % 64`` of the tile) for two splits.
    ``synced``: False for a kernel built without TileLang's sync pass (the macro then places
    its own barrier).

    ``load_queries(Q, q_s, tok_s, head_s, qrow_s, tile, H, Sq)``: each tile row's query
    token, head, and its row in Q, divided out once into shared tables, so the copy below does
    not divide (TileLang widens index arithmetic to 64 bits;
    64-bit divisions inlined in unrolled copy/store loops made the kernel 250 KB of SASS, whose
    instruction fetch dominated short caches: NOTES); then Q's rows into ``q_s`` as
    ``q_dtype`` (rows past the tile's real rows as 0).

    ``store(o, m, m_safe, alpha, row_sum, l, lse, O, LSE, Opart, LSEpart, Sinks, tok_s, head_s,
    tile, direct, out_scale)``: softmax.py's epilogue (O normalised,
    lse in natural log; the sink folded in here with one split, by the combine kernel
    otherwise), then O/lse or the part's fp32 partials (``tile.partial_row``), real rows only.
    ``direct``: the kernel argument that says whether this CTA writes O/lse itself (1) or
    partials; the FP8 schedule always writes partials (``direct = 0``).  The rows of O, lse
    and the partials are register arithmetic (``SplitTile.out_row`` ...), not table loads: a
    shared-memory row table is re-read for every element of a ``T.Parallel`` store (64 loads
    per thread, 64-bit addresses), in the epilogue that B=1 decode's short splits pay once
    per CTA (NOTES, fifteenth session).
    """
    _, finish = online_softmax(tile_rows, block_n, dim_v, has_sinks, has_softcap)
    _, finish_partial = online_softmax(tile_rows, block_n, dim_v, False, has_softcap)  # sinks: combine.py

    def real(tile, i):
        return tile.r0 + i % BLOCK_M < tile.rows

    @T.macro
    def load_queries(Q, q_s, tok_s, head_s, qrow_s, tile, H, Sq):
        b, r0, group = tile.b, tile.r0, tile.group
        for i in T.Parallel(tile_rows):
            tok_s[i] = (r0 + i % BLOCK_M) // group
            head_s[i] = tile.hk * group + (r0 + i % BLOCK_M) % group
        for i in T.Parallel(tile_rows):
            # Rows past the tile's real rows point at row 0; they are never stored.
            qrow_s[i] = T.if_then_else(real(tile, i), (b * Sq + tok_s[i]) * H + head_s[i], 0)
        if not synced:
            T.sync_threads()
        for i, c in T.Parallel(tile_rows, dim):
            q_s[i, c] = T.if_then_else(real(tile, i), T.cast(Q[qrow_s[i], c], q_dtype), T.cast(0, q_dtype))

    @T.macro
    def store(o, m, m_safe, alpha, row_sum, l, lse, O, LSE, Opart, LSEpart, Sinks, tok_s, head_s, tile, direct,
              out_scale):
        # Each thread's rows as registers (a fragment laid out like o's rows): one division per
        # row, not one per stored element.
        row_f = T.alloc_fragment([tile_rows], T.int32)
        if direct == 1:
            finish(o, m, m_safe, alpha, row_sum, l, lse, GroupRows(tok_s, head_s, Sinks), tile.sc, out_scale)
            for i in T.Parallel(tile_rows):
                row_f[i] = tile.out_row(i)
            for i, c in T.Parallel(tile_rows, dim_v):
                if real(tile, i):
                    O[row_f[i], c] = T.cast(o[i, c], dtype)
            for i in T.Parallel(tile_rows):
                if real(tile, i):
                    LSE[tile.lse_row(i)] = lse[i]
        else:
            finish_partial(o, m, m_safe, alpha, row_sum, l, lse, 0.0, tile.sc, out_scale)
            for i in T.Parallel(tile_rows):
                row_f[i] = tile.partial_row(i)
            for i, c in T.Parallel(tile_rows, dim_v):
                if real(tile, i):
                    Opart[row_f[i], c] = o[i, c]
            for i in T.Parallel(tile_rows):
                if real(tile, i):
                    LSEpart[row_f[i]] = lse[i]

    return load_queries, store


def row_tables(rows: int):
    """``split_tile_io``'s per-row shared tables (tok_s, head_s, qrow_s) for ``rows`` tile rows."""
    return tuple(T.alloc_shared([rows], T.int32) for _ in range(3))


def decode_prim_func(dim: int, dim_v: int, dtype: str, cache_dtype: str, kernel):
    """The decode PrimFunc, one argument list for both schedules (``decode_kernel``,
    ``decode_ws.decode_ws_kernel``); ``kernel`` is the schedule's T.macro taking the arguments
    below in order.

    Arguments: Q (RQ, dim), the (B, Sq, H, dim) queries as rows ``(b * Sq + t) * H + h``
    (RQ = B x Sq x H); K (NR, Hkv, dim) and V (NR, Hkv, dim_v) the cache as rows, in ``cache_dtype`` (NR = pages x
    page_size); BlockTable (B, MB) int32 page of each logical block; SeqlensK (B,) int32 keys of
    each entry *after* the append; Leftpad (B,) int32 first visible key; O (RQ, dim_v) rows like
    Q and LSE (RQ,) fp32, the (B, H, Sq) lse flat (written by ``decode_kernel`` with
    ``num_splits == 1``); Opart (P, dim_v) and LSEpart (P,) fp32 partials, row ``slot x
    tile_rows + tile row`` (``SplitTile.partial_row``; ``schedule``'s slots); Sinks (H,) fp32
    (read only with sinks); KDescale / VDescale (B, Hkv) fp32 (read by the FP8 schedule only);
    scalars ``score_scale``, ``cap_in`` (as in ``fwd``), ``left``/``right`` window bounds,
    ``num_splits`` (``decode_kernel``: uniform splits per segment; ``decode_ws``: the number of
    CTAs, ``schedule``'s workers), ``page_size`` and its log2 ``page_shift`` (-1 when not a power of two; 31 for a
    contiguous cache, whose visible keys all sit on page 0), ``Sq`` query tokens per entry.
    """
    B, H, Hkv, NR, MB, P, RQ = T.dynamic("B, H, Hkv, NR, MB, P, RQ")
    acc = T.float32

    @T.prim_func
    def main(
        Q: T.Tensor([RQ, dim], dtype),
        K: T.Tensor([NR, Hkv, dim], cache_dtype),
        V: T.Tensor([NR, Hkv, dim_v], cache_dtype),
        BlockTable: T.Tensor([B, MB], T.int32),
        SeqlensK: T.Tensor([B], T.int32),
        Leftpad: T.Tensor([B], T.int32),
        O: T.Tensor([RQ, dim_v], dtype),
        LSE: T.Tensor([RQ], acc),
        Opart: T.Tensor([P, dim_v], acc),
        LSEpart: T.Tensor([P], acc),
        Sinks: T.Tensor([H], acc),
        KDescale: T.Tensor([B, Hkv], acc),
        VDescale: T.Tensor([B, Hkv], acc),
        score_scale: T.float32,
        cap_in: T.float32,
        left: T.int32,
        right: T.int32,
        num_splits: T.int32,
        page_size: T.int32,
        page_shift: T.int32,
        Sq: T.int32,
    ):
        kernel(Q, K, V, BlockTable, SeqlensK, Leftpad, O, LSE, Opart, LSEpart, Sinks, KDescale, VDescale, score_scale,
               cap_in, left, right, num_splits, page_size, page_shift, Sq)

    return main


@tilelang.jit(target=TARGET, pass_configs=DECODE_PASS_CONFIGS)
def decode_kernel(
    dim: int,
    dim_v: int,
    dtype: str,
    has_sinks: bool,
    has_softcap: bool,
    block_n: int = 128,
    num_stages: int = 2,
    threads: int = 128,
    chunk_blocks: int = 32,
    key_groups: int = 4,
):
    """Build the split-KV decode PrimFunc for a cache in ``dtype`` (``num_stages``: 2, the row
    lookup and copy one step ahead of the compute; kept as a parameter for the cache key and
    the tile sweeps).  An FP8 cache takes ``decode_ws.decode_ws_kernel``, same arguments.
    ``chunk_blocks``: key blocks whose cache rows are looked up at once (``row_s``; 64
    measured 1% slower than 32 on the H100).  The splits are uniform: ``num_splits`` per
    segment.  (``decode_ws``'s CTA shares, fractional or persistent, measured slower here:
    B=12 32k -0.8%, B=1 131k -1.5%, B=1 8k -12%; NOTES, sixteenth session.)

    ``key_groups``: each thread's keys of a chunk's row lookup (16 at 64-key blocks) in that
    many groups, each behind a test of its first key, so a split of a few blocks skips the
    rest a group at a time instead of testing every key (B=1 8k: 4 blocks a split, 2 keys a
    thread; H200 12.0 -> 11.6 us, 4 query tokens 14.3 -> 13.7: NOTES, twenty-first session).

    Kernel arguments: ``decode_prim_func``'s.
    """
    acc = T.float32
    block_m = BLOCK_M
    kv_width = max(dim, dim_v)
    vec = 8  # cache elements per 16-byte copy
    # The K/V copy loop's thread map: each thread copies ``vec`` consecutive features (16 bytes)
    # of a key row per step.  Without it, layout inference for a loop writing both K and V
    # tiles (two different swizzles) settles on 4-byte copies.
    kv_layout = T.Fragment(
        [block_n, kv_width],
        forward_fn=lambda i, c: (
            ((i * kv_width + c) // vec) % threads,
            ((i * kv_width + c) // vec) // threads * vec + c % vec,
        ),
    )
    neg_inf = -T.infinity(acc)
    update, _ = online_softmax(block_m, block_n, dim_v, has_sinks, has_softcap)
    load_queries, store = split_tile_io(dim, dim_v, dtype, dtype, has_sinks, has_softcap, block_n)
    chunk = chunk_blocks
    per = chunk * block_n // threads  # keys each thread looks up per chunk
    assert per % key_groups == 0, (per, key_groups)
    keys = per // key_groups  # a thread's keys per group (``key_groups``)

    def chunk_keys(tile, tx, ch, u):
        """Whether thread key ``u`` of chunk ``ch`` is one of this CTA's keys (a split may hold
        a few blocks only; past the last chunk, none)."""
        return u * threads + tx < (tile.my_blocks - ch * chunk) * block_n

    @T.macro
    def fetch(tile, tx, ch, tab, off, BlockTable, page_size, page_shift):
        """Issue the page-table loads of chunk ``ch``'s keys (this thread's ``per``) into
        ``tab``, and their rows within the page into ``off``."""
        # The key and its page as registers (alloc_var), so each is computed once; as plain
        # expressions TileLang inlines them into every use (in 32 and 64 bits).
        j = T.alloc_var(T.int32)
        pg = T.alloc_var(T.int32)
        for g in T.unroll(key_groups):
            if chunk_keys(tile, tx, ch, g * keys):
                for v in T.unroll(keys):
                    if chunk_keys(tile, tx, ch, g * keys + v):
                        j = tile.key((tile.kb_first + ch * chunk) * block_n + (g * keys + v) * threads + tx)
                        pg = cache_page(j, page_size, page_shift)
                        tab[g * keys + v] = BlockTable[tile.b, pg]
                        off[g * keys + v] = j - pg * page_size

    @T.macro
    def place(tile, tx, ch, tab, off, row_s, page_size):
        """Chunk ``ch``'s cache rows into ``row_s`` (the copies' table) from ``fetch``'s loads."""
        for g in T.unroll(key_groups):
            if chunk_keys(tile, tx, ch, g * keys):
                for v in T.unroll(keys):
                    if chunk_keys(tile, tx, ch, g * keys + v):
                        row_s[(g * keys + v) * threads + tx] = tab[g * keys + v] * page_size + off[g * keys + v]

    def tiles():
        """The CTA's shared tiles and register fragments."""
        q_s = T.alloc_shared([block_m, dim], dtype)
        k_s = T.alloc_shared([block_n, dim], dtype)
        v_s = T.alloc_shared([block_n, dim_v], dtype)
        # The cache row of each key of a chunk, in static shared memory: in the merged dynamic
        # allocation TileLang's sync pass cannot tell its reads from the K/V tiles' cp.async
        # writes and put two __syncthreads around every row read of the copy loop (16 a
        # block at d = 128); on its own, one a block remains (H200, B=1 8k 12.2 -> 12.0 us:
        # NOTES, twentieth session).
        row_s = T.alloc_shared([chunk * block_n], T.int32, scope="shared")
        return (q_s, k_s, v_s, row_s, *row_tables(block_m), *tile_fragments(block_m, block_n, dim_v, dtype))

    @T.macro
    def attend(Q, K, V, BlockTable, O, LSE, Opart, LSEpart, Sinks, q_s, k_s, v_s, row_s, tok_s, head_s, qrow_s, s, p, o,
               m, m_prev, m_safe, alpha, row_sum, l, lse, tile, H, Sq, page_size, page_shift, direct):
        """One tile's attention over its part of the keys, then its store (O/lse when ``direct``
        is 1, else partials)."""
        load_queries(Q, q_s, tok_s, head_s, qrow_s, tile, H, Sq)
        T.clear(o)
        T.clear(l)
        T.fill(m, neg_inf)

        # Key blocks in chunks: the cache rows of a chunk's keys are looked up first (all
        # threads, into row_s), then the chunk's blocks stream through the pipeline.  Inside
        # the pipelined loop the lookup would be planned into the compute stage (it is not
        # a plain copy), after the copy that reads it.
        tx = T.get_thread_binding(0)
        # Each thread's page-table entries of one chunk (``per`` keys) and its keys' rows
        # within their pages: all ``per`` loads are issued before the first store, so a
        # chunk waits for one round trip, not ``per`` dependent ones (~5 us per chunk from
        # L2 at page 16: 91 -> 95% of the bandwidth, NOTES sixth session).  Issuing the next
        # chunk's loads before this chunk streams measured the same: not kept.
        tab = T.alloc_local([per], T.int32)
        off = T.alloc_local([per], T.int32)

        for ch in T.serial(T.ceildiv(tile.my_blocks, chunk)):
            fetch(tile, tx, ch, tab, off, BlockTable, page_size, page_shift)
            place(tile, tx, ch, tab, off, row_s, page_size)
            for it in T.Pipelined(T.min(chunk, tile.my_blocks - ch * chunk), num_stages=num_stages):
                n0 = (tile.kb_first + ch * chunk + it) * block_n
                # K and V rows in one loop: one cp.async group per step (two groups trip a
                # TileLang 0.1.15 bug in the pipeline epilogue: a non-constant wait_group).
                for i, c in T.Parallel(block_n, kv_width, loop_layout=kv_layout):
                    row = row_s[it * block_n + i]
                    if dim >= dim_v:
                        k_s[i, c] = K[row, tile.hk, c]
                        if dim_v == dim or c < dim_v:
                            v_s[i, c] = V[row, tile.hk, c]
                    else:
                        v_s[i, c] = V[row, tile.hk, c]
                        if c < dim:
                            k_s[i, c] = K[row, tile.hk, c]
                T.gemm(q_s, k_s, s, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                # softmax.py's online softmax; masks.py's rule per query token (row // group).
                update(s, m, m_prev, m_safe, alpha, row_sum, l, n0, tile.t_first, tile.t_last, tile.mask, tile.sc,
                       tile.cap, GroupRows(tok_s, head_s))
                T.copy(s, p)
                for i, c in T.Parallel(block_m, dim_v):
                    o[i, c] *= alpha[i]
                T.gemm(p, v_s, o, policy=FULL_ROW)

        store(o, m, m_safe, alpha, row_sum, l, lse, O, LSE, Opart, LSEpart, Sinks, tok_s, head_s, tile, direct, None)

    @T.macro
    def kernel(Q, K, V, BlockTable, SeqlensK, Leftpad, O, LSE, Opart, LSEpart, Sinks, KDescale, VDescale, score_scale,
               cap_in, left, right, num_splits, page_size, page_shift, Sq):
        H, Hkv = Sinks.shape[0], K.shape[1]
        with T.Kernel(num_splits * row_tile_count(H, Hkv, Sq), Hkv, BlockTable.shape[0],
                      threads=threads) as (bx, hk, b):
            q_s, k_s, v_s, row_s, tok_s, head_s, qrow_s, s, p, o, m, m_prev, m_safe, alpha, row_sum, l, lse = tiles()
            # Programmatic dependent launch: the combine kernel may launch (and wait,
            # resident, in its griddepcontrol.wait) once every decode CTA has started,
            # instead of after the last one ends.  A no-op when nothing depends on this launch.
            T.pdl_trigger()
            # Segment g = (entry, kv head, row tile) in ``schedule``'s order, split ``split``
            # of ``num_splits`` (uniform shares): worker ``g * num_splits + split``, slot
            # that + g.
            row_tile, split = bx // num_splits, bx % num_splits
            g = segment_index(b, hk, row_tile, Hkv, row_tile_count(H, Hkv, Sq))
            tile = SplitTile(row_tile, hk, b, H, Hkv, Sq, SeqlensK, Leftpad, left, right,
                             (split, split + 1, num_splits), block_n, KDescale, score_scale, cap_in, False,
                             has_softcap, slot=g * (num_splits + 1) + split)
            attend(Q, K, V, BlockTable, O, LSE, Opart, LSEpart, Sinks, q_s, k_s, v_s, row_s, tok_s, head_s, qrow_s,
                   s, p, o, m, m_prev, m_safe, alpha, row_sum, l, lse, tile, H, Sq, page_size, page_shift, num_splits)

    return decode_prim_func(dim, dim_v, dtype, dtype, kernel)


# --- host side ------------------------------------------------------------------------------

MAX_SPLITS = 128
# Key blocks whose cache rows are looked up at once (row_s: 8 KB at 64-key blocks); each chunk
# restarts the K/V pipeline, so about 1/ROW_CHUNK_BLOCKS of the loads are not overlapped.
ROW_CHUNK_BLOCKS = 32
# Groups of each thread's keys in a chunk's row lookup (``decode_kernel``'s ``key_groups``): 4
# measured as fast as 4-block chunks on short splits and as 32-block chunks on long streams.
KEY_GROUPS = 4

# Developer switches, part of the schedule's memo key (the bench and the sweeps set them
# between calls): FLASHTILE_DECODE_WS16 sends 16-bit caches through decode_ws's schedule for
# every call ("1": the WGMMA consumers; "mma": the mma.sync ones where they apply), for none
# ("0": ``decode_kernel`` always), or, unset, the long streams and many-segment calls (``ws16_pays``);
# CFG_OVERRIDE forces tile parameters of whichever schedule runs (benchmarks/decode_sweep.py,
# ``flashtile bench --decode --tiles``).
WS_16BIT: bool | None = {"1": True, "mma": True, "0": False}.get(os.environ.get("FLASHTILE_DECODE_WS16", ""))
WS16_MMA = os.environ.get("FLASHTILE_DECODE_WS16") == "mma"
CFG_OVERRIDE: dict | None = None
FRACTIONAL: bool | None = None  # decode_ws: force fractional CTA shares (True) or whole ones (``worker_count``)
PERSISTENT_BLOCKS = 96  # decode_ws: segments of at most this many key blocks stream back to back
OWN_WORKER_BLOCKS = 256  # FP8 cache, many segments: own workers for segments of at most this many blocks
LONG_STREAM_BLOCKS = 256  # 16-bit cache: segments of more key blocks (of 64) take decode_ws's mma.sync consumers
WARP_MMA_BLOCK_N = 64  # ``warp_mma.BLOCK_N`` (that module imports this one): the block of ``own_workers_pay``
# ``decode_ws``'s FP8 cache rows per TMA box (that module imports it): any page size that is a
# multiple of 16 takes TMA (``split_producer_pays`` reads it on every FP8 call's host path)
TMA_BOX = 16
WARP_MMA_ROWS = 16  # FP8 caches: a kv head's query rows (group x Sq) up to this take ``warp_mma`` consumers
# ``warp_mma`` consumers as workers of their own (``decode_ws``'s ``own_workers``) for calls with
# at least as many segments as SMs ("auto"; measured in NOTES, nineteenth session); "1" for every
# call, "0" for none (the environment switch lets the GPU suite run either schedule everywhere).
OWN_WORKERS = os.environ.get("FLASHTILE_DECODE_OWN", "auto")


def decode_config(dim: int, dim_v: int) -> dict:
    """Tiles for one head-dim pair: 64-key blocks, 32 when ``dim != dim_v`` (registers).

    64 keys, not 128: at d <= 128 a CTA then takes 88 KB of shared memory, so two CTAs share an
    SM and one's prologue and epilogue overlap the other's streaming.  Measured on an H100
    (`h100-2026-11-23c/`, d = 128, graph-replayed): B=128 2k 62% -> 88% of the read bandwidth,
    B=64 4k 78% -> 93%, B=32 8k 86% -> 96%, B=64 32k 97% -> 100%.  Two stages only: with
    more, TileLang 0.1.15's pipeline epilogue emits a non-constant ``cp.async.wait_group``
    that fails in codegen (and explicit unrolling, the way around it, did not finish
    compiling in 10 minutes).
    """
    # synchronous loads at dim != dim_v (see the module docstring): 64 keys spill 1.2 KB, 32 keys 24 B
    block_n = 32 if dim != dim_v else 64
    return {"block_n": block_n, "num_stages": 2, "threads": 128, "chunk_blocks": ROW_CHUNK_BLOCKS,
            "key_groups": KEY_GROUPS}


@functools.lru_cache(maxsize=4096)  # on every call's host path; a pure function of three ints
def choose_splits(ctas: int, n_blocks: int, slots: int) -> int:
    """Splits of each sequence's key blocks so that ``ctas * splits`` CTAs fill the GPU.

    ``ctas`` = CTAs without splitting (batch x kv heads x row tiles); ``n_blocks`` = key blocks
    of the longest sequence the cache can hold (a host-side bound, so no sync); ``slots`` =
    CTAs the GPU runs at once (SMs x ``ctas_per_sm``).  Enough CTAs for 80% of the slots
    already: 1.  Otherwise the fewest splits whose wave efficiency (CTAs / (waves x slots)) is
    at least 95% of the best, at most ``MAX_SPLITS`` and at least two key blocks per split.
    (flash-attn takes 85%; measured on an H100, bf16, 8 kv heads, 264 slots: 29 splits
    (232 CTAs, 88%) against 33 (264, 100%) cost B=1 8k 18.8 vs 17.6 us and B=1 131k 89.3 vs
    93.1% of the bandwidth: a bandwidth-bound step wants every slot: NOTES, seventh session.)
    """
    if ctas >= 0.8 * slots or n_blocks <= 2:
        return 1
    limit = max(1, min(MAX_SPLITS, n_blocks // 2))
    eff = {s: (ctas * s / slots) / math.ceil(ctas * s / slots) for s in range(1, limit + 1)}
    best = max(eff.values())
    return min(s for s in eff if eff[s] >= 0.95 * best)


SMEM_PER_SM = 228 * 1024  # Hopper: shared memory per SM (a CTA may take 227 KB of it)


def ctas_per_sm(cfg: dict, dim: int, dim_v: int, itemsize: int) -> int:
    """``decode_kernel`` CTAs resident on one SM at once, bounded by shared memory: the Q tile,
    the K/V stages and the row table, plus the 1 KB the driver reserves per CTA.  (Registers
    allow two 128-thread CTAs at every tile here.)  128-key blocks at d = 128: 160 KB, one CTA;
    64-key blocks: 88 KB, two.  (The FP8 schedule, ``decode_ws``, runs one CTA per SM.)"""
    smem = BLOCK_M * dim * itemsize + cfg["num_stages"] * cfg["block_n"] * (dim + dim_v) * itemsize
    smem += cfg["chunk_blocks"] * cfg["block_n"] * 4 + 1024
    return max(1, min(2, SMEM_PER_SM // smem))



class Schedule(NamedTuple):
    """How one cache is decoded: the kernel builder and its tiles, CTAs resident per SM,
    consumer warpgroups per CTA, each writing its own partials (``decode_ws``: two or three;
    ``decode_kernel``: 1), and the combine kernels it compiles (``CombineBuild``s: ``COMBINES``)."""

    kernel: object
    cfg: dict
    ctas_per_sm: int
    consumers: int
    combines: tuple


def decode_schedule(dim: int, dim_v: int, dtype: str, cache_dtype: str | None = None, rows: int = 1,
                    many_segments: bool = False, small_pages: bool = False, ws16: bool = False) -> Schedule:
    """``decode_kernel`` for a cache in q's dtype; ``decode_ws.decode_ws_kernel``
    (warp-specialised: a producer and two or three consumer warpgroups, one CTA per SM) for an
    FP8 cache, its consumers on warp-level mma.sync (``warp_mma``) when a kv head's query rows
    (``rows`` = group x Sq) fit one 16-row fragment and the head dims are 64 or 128, each of
    them a worker of its own (``own_workers``) when the call has at least as many segments as
    SMs (``many_segments``), else each fed by a producer warp of its own (``split_producer``)
    when the call's pages are smaller than a key block (``small_pages``: ``split_producer_pays``).
    A 16-bit cache takes ``decode_ws``'s mma.sync consumers too for long streams or many
    segments (``ws16``: ``ws16_pays``) at up to 16 rows.  All take the same kernel arguments.  On
    every call's host path: memoised."""
    if cache_dtype == dtype:
        cache_dtype = None
    own = OWN_WORKERS == "1" or (OWN_WORKERS == "auto" and many_segments)
    # The developer switches are part of the key (the bench and the sweep set them between calls).
    return _schedule(dim, dim_v, dtype, cache_dtype, WS_16BIT, tuple(sorted((CFG_OVERRIDE or {}).items())),
                     rows <= WARP_MMA_ROWS, own, small_pages, ws16)


class CombineBuild(NamedTuple):
    """One combine kernel a decode schedule compiles (``combine_kernel``'s build arguments):
    loads per thread per round, query rows per CTA (0: chosen per call, ``rows_per_cta``),
    and the CTAs per SM its launch bounds promise (a register cap)."""

    per_round: int
    rows: int
    min_ctas: int
    single_stored: bool = False  # rows of one-split segments skipped (``decode_ws``'s ``own_workers`` stored them)


# The combines after each decode kernel; a call takes the first whose one round holds its
# rows' splits (``combine_round``).  Measured on the H100 (NOTES, sixteenth session):
# - After ``decode_kernel`` (16-bit caches): the kernel of the fifteenth session, one row per
#   CTA, its indices uniform over the CTA.  Under programmatic dependent launch its CTAs wait
#   resident beside the two decode CTAs per SM (2 x 128 threads x 208 registers leave 12K),
#   which its 80 registers fit; several rows per call (94 registers, 78 capped) or 16 loads a
#   round (162) took bf16 B=1 8k from 12.5 to 12.8-13.7 us.
# - After ``decode_ws`` (FP8 caches; its 512-thread CTAs leave no registers, so nothing waits
#   resident): 8 loads a round on several rows per CTA for rows of few splits (B=128 2k's
#   4096 rows of 3-6 splits took 17.4 us under ncu one row per CTA), capped at 78 registers so
#   six CTAs fit an SM; 16 loads, one round for B=1's 48 splits (15.4 against 16.7 us).
COMBINES = {"decode": (CombineBuild(8, 1, 1),),
            "decode_ws": (CombineBuild(8, 0, 6), CombineBuild(16, 0, 1))}


def combine_groups(dim_v: int) -> int:
    """Chunk groups of a 128-thread combine CTA (``combine_kernel``'s ``groups``): its threads
    take a row's columns 4 at a time."""
    return 128 // (dim_v // 4)


def combine_round(builds: tuple, dim_v: int, most: int) -> int:
    """Index into ``builds`` (``CombineBuild``) of the combine for rows of at most ``most``
    splits: the first whose one round at one row per CTA holds them all, else the last."""
    groups = combine_groups(dim_v)
    return next((i for i, b in enumerate(builds) if groups * b.per_round >= most), len(builds) - 1)


def rows_per_cta(dim_v: int, max_splits: int, per_round: int) -> int:
    """``combine_kernel``'s R for rows of at most ``max_splits`` splits: the most rows per CTA
    whose groups still merge every split in one round (R dividing the group count), else 1."""
    groups = combine_groups(dim_v)
    fits = [r for r in range(groups, 0, -1) if groups % r == 0 and groups // r * per_round >= max_splits]
    return fits[0] if fits else 1


@functools.lru_cache(maxsize=256)
def _schedule(dim, dim_v, dtype, cache_dtype, ws_16bit, override, few_rows: bool = True, own: bool = False,
              small_pages: bool = False, ws16: bool = False) -> Schedule:
    from .warp_mma import supports

    override = dict(override)
    forced = override.pop("combine_round", 0)  # developer switch: one combine, this round, rows per call
    mma_fits = few_rows and supports(dim, dim_v)
    # A 16-bit cache: decode_ws's mma.sync consumers where ``ws16_pays`` (unless a switch says otherwise)
    mma16 = cache_dtype is None and mma_fits and (ws16 if ws_16bit is None else ws_16bit and WS16_MMA)
    if cache_dtype is None and not (ws_16bit or mma16):
        combines = (CombineBuild(forced, 0, 1),) if forced else COMBINES["decode"]
        cfg = {**decode_config(dim, dim_v), **override}
        return Schedule(decode_kernel, cfg, ctas_per_sm(cfg, dim, dim_v, 2), 1, combines)
    from .decode_ws import decode_ws_kernel, ws_config

    cache_dtype = cache_dtype or dtype
    fp8 = "float8" in cache_dtype
    # developer switch ``warp_mma`` (0: the widening consumers for every FP8 cache; 1 with ``WS_16BIT``:
    # the mma.sync consumers for a 16-bit cache)
    want = override.pop("warp_mma", None)
    warp_mma = (bool(want) if want is not None else fp8 or mma16) and mma_fits
    # developer switch ``own_workers`` (1: each mma.sync consumer a worker of its own; 0: they share their CTA's parts)
    own = bool(override.pop("own_workers", own)) and warp_mma
    combines = (CombineBuild(forced, 0, 1),) if forced else COMBINES["decode_ws"]
    cfg = {**ws_config(dim, dim_v, 1 if fp8 else 2, override.get("consumers", 0), warp_mma),
           "cache_dtype": cache_dtype, **override}
    if own:
        cfg["own_workers"] = True
        combines = tuple(b._replace(single_stored=True) for b in combines)
    elif warp_mma and small_pages and "split_producer" not in override:
        cfg["split_producer"] = True
    return Schedule(decode_ws_kernel, cfg, 1, cfg["consumers"], combines)


def get_decode_kernels(dim: int, dim_v: int, dtype: str, has_sinks: bool, has_softcap: bool,
                       cache_dtype: str | None = None, sched: Schedule | None = None, rows: int = 1,
                       many_segments: bool = False, small_pages: bool = False, ws16: bool = False):
    """(decode, combine, ...) compiled for one static structure (``cache_dtype``: None, or
    ``"float8_e4m3fn"`` for an FP8 cache; ``rows``: a kv head's query rows, and
    ``many_segments``, ``small_pages``, ``ws16``, which pick the schedule:
    ``decode_schedule``; ``sched``: that schedule when the caller has it): the decode kernel,
    then one combine kernel per ``sched.combines``."""
    from . import cache

    sched = sched or decode_schedule(dim, dim_v, dtype, cache_dtype, rows, many_segments, small_pages, ws16)
    decode = cache.get(sched.kernel, None, dim=dim, dim_v=dim_v, dtype=dtype, has_sinks=has_sinks,
                       has_softcap=has_softcap, **sched.cfg)
    from .combine import combine_kernel

    return (decode, *(cache.get(combine_kernel, None, dim_v=dim_v, dtype=dtype, has_sinks=has_sinks, **b._asdict())
                      for b in sched.combines))


def split_count(requested: int, ctas: int, n_blocks: int, sms: int, sched: Schedule, partial_rows: int) -> int:
    """``decode_kernel``: splits of each row tile's keys: ``requested`` if > 0, else
    ``choose_splits`` for the GPU's ``sms`` (``ctas`` CTAs without splitting, ``n_blocks`` key
    blocks at most); at most ``MAX_SPLITS`` and what keeps the partials' ``(splits + 1) x
    partial_rows`` elements (``schedule``'s slots) indexable in 32 bits."""
    if requested <= 0:
        requested = choose_splits(ctas, n_blocks, sms * sched.ctas_per_sm)
    return max(1, min(requested, MAX_SPLITS, (2**31 - 1) // partial_rows - 1))


def worker_count(requested: int, segments: int, n_blocks: int, sms: int, sched: Schedule) -> int:
    """``decode_ws``: CTAs (``schedule``'s workers) over ``segments`` (entry, kv head, row
    tile) segments of at most ``n_blocks`` key blocks, each CTA's C consumers sharing its part.

    ``requested`` > 0 splits per segment: a multiple of C of them (at least C), so a whole
    number of CTAs per segment.  Otherwise, with fewer segments than SMs: the most whole CTAs
    per segment that fit one wave when they fill 95% of the SMs (B=8 and B=1 with 8 kv heads:
    128 of 132), else one CTA per SM, the shares then fractions of a segment (two parts for
    most CTAs: 1-5% slower than 128 whole shares at B=8 and B=1, 12-15% faster than 96 at B=6
    and B=12; NOTES, fifteenth session), each consumer with at least two blocks.  With as many
    segments as SMs or more: one CTA per segment, unless the segments are short (at most
    ``PERSISTENT_BLOCKS`` blocks), then one CTA per SM, each streaming its segments back to
    back (persistent), the producer running ahead across their boundaries (H100: B=128 2k
    -7%, B=64 4k -1%, B=32 8k and B=64 32k +0.5-1%).  ``FRACTIONAL``
    (developer switch, the sweeps' ``fractional=0/1``) forces whole shares (one CTA per
    segment at most) or fractional ones."""
    per = sched.consumers
    if requested > 0:
        return segments * max(1, requested // per)
    slots = sms * sched.ctas_per_sm
    if sched.cfg.get("own_workers") and segments >= slots:
        return whole_segment_ctas(segments, slots, per)
    if segments >= slots:
        persistent = n_blocks <= PERSISTENT_BLOCKS if FRACTIONAL is None else FRACTIONAL
        return slots if persistent else segments
    most = max(1, min(slots // segments, n_blocks // (2 * per)))  # whole CTAs per segment in one wave
    whole = segments * most >= 0.95 * slots  # (blocks bounding ``most``: the fraction below is ``most`` too)
    if FRACTIONAL is not None:
        whole = not FRACTIONAL
    return segments * most if whole else max(segments, min(slots, segments * (n_blocks // (2 * per))))


def own_workers_pay(segments: int, n_blocks: int, sms: int) -> bool:
    """Whether a call's ``warp_mma`` consumers run as workers of their own (``decode_schedule``'s
    ``many_segments``): at least as many segments as SMs, and either short ones (at most
    ``OWN_WORKER_BLOCKS`` key blocks: the shared schedule's CTAs pay a merge, a partial and the
    combine per part, which whole segments per worker avoid) or a count the shared schedule's
    one CTA per segment runs in badly filled waves (under 90%).  Measured on an H100, FP8 cache
    (NOTES, nineteenth session), shared -> own: B=128 2k 209.6 -> 194.4 us, B=64 4k 200.5 ->
    192.3, B=32 8k 188.9 -> 179.6, B=20 32k (160 segments in 1.2 waves) 540.6 -> 471.5; but B=64
    32k (3.9 waves) 1407.5 -> 1466.7, B=8 32k 182.0 -> 185.0 and B=1 8k 12.0 -> 12.8, which keep
    the shared schedule.  (The 256-block bound lies between the gain at 132 blocks and the loss
    at 516; nothing in between was measured.)"""
    if segments < sms:
        return False
    return n_blocks <= OWN_WORKER_BLOCKS or segments / (-(-segments // sms) * sms) < 0.9


def split_producer_pays(paged: bool, page_size: int) -> bool:
    """Whether an FP8 call's shared-part ``warp_mma`` consumers each take a producer warp of
    their own (``decode_schedule``'s ``small_pages``): pages smaller than a 64-key block that
    TMA copies in boxes of 16 rows, where one producer thread's four lookups and eight box
    issues per block paced both consumers.  Measured on an H200 (NOTES, twentieth session,
    shared producer -> split): B=8 32k pages of 16 139.3 -> 134.3 us (88.1 -> 91.4% of the
    bandwidth), 4 query tokens 141.3 -> 136.9, B=1 131k 72.8 -> 71.8; contiguous 125.9 ->
    126.5 (one box per block: no gain, so it keeps the shared producer).  Pages that are no
    multiple of 16 (by-row copies) were not measured and keep it too."""
    return paged and page_size < WARP_MMA_BLOCK_N and page_size % TMA_BOX == 0


def ws16_pays(paged: bool, page_size: int, n_blocks: int, many_segments: bool) -> bool:
    """Whether a 16-bit call takes ``decode_ws``'s mma.sync consumers with TMA instead of
    ``decode_kernel`` (``decode_schedule``'s ``ws16``; with ``many_segments``,
    ``own_workers_pay``, as workers of their own): segments of more than ``LONG_STREAM_BLOCKS``
    64-key blocks (``n_blocks``), or many segments, whose blocks each lie on one page
    (contiguous, or pages of a multiple of 64 rows; smaller pages would take by-row copies).
    Measured on an H200 (NOTES, twentieth session, ``decode_kernel`` -> these, us): B=8 32k
    243.7 -> 241.8, 4 query tokens 249.7 -> 243.5, pages of 256 245.8 -> 243.5, B=12 32k 366.9
    -> 360.5, B=16 16k 244.3 -> 241.0, B=64 32k 1910 -> 1894, B=1 131k 125.4 -> 125.5; own
    workers: B=32 8k 242.6 -> 237.2, B=64 4k 246.5 -> 238.3, B=128 2k 251.7 -> 247.8 (shared
    ones lost B=32 8k: 245.8).  B=1 8k (12.1 -> 13.1: latency) keeps ``decode_kernel``."""
    return (n_blocks > LONG_STREAM_BLOCKS or many_segments) and (not paged or page_size % WARP_MMA_BLOCK_N == 0)


def whole_segment_ctas(segments: int, slots: int, per: int) -> int:
    """``own_workers`` with at least as many segments as CTA slots: the most CTAs, at least 90%
    of the slots, whose ``per`` workers each take a whole number of whole segments (B=32 8k,
    B=64 4k and B=128 2k with 8 kv heads on 132 SMs: 128 CTAs, 256 workers of 1, 2 and 4
    segments), so no segment is cut and no partial or combine runs; else every slot
    (fractional shares, the cut segments combined)."""
    for ctas in range(slots, -(-9 * slots // 10) - 1, -1):
        if segments % (ctas * per) == 0:
            return ctas
    return slots


class DecodePlan(NamedTuple):
    """What ``launch_decode`` decides from a call's static description (``decode_plan``): the
    kernels, the grid's split / worker counts, the partials' size and the scalar arguments."""

    decode: object
    combine: object  # None when every worker writes O / lse itself
    num_splits: int
    workers: int
    consumers: int
    rows_total: int  # partial rows (0: no partials)
    combine_rows: int  # the combine's rows per CTA
    score_scale: float
    cap_in: float
    left: int
    right: int
    page_size: int
    page_shift: int


_PLANS: dict = {}
# Plans kept at most (then all dropped): a cache that grows every step (a dynamic cache handed
# over whole) is a new description each call.
MAX_PLANS = 1024


def _switches() -> tuple:
    """The module's developer switches and tunables that a plan depends on (tests and sweeps set
    them between calls), so a plan made under others is not reused."""
    return (WS_16BIT, WS16_MMA, OWN_WORKERS, FRACTIONAL, PERSISTENT_BLOCKS, OWN_WORKER_BLOCKS, LONG_STREAM_BLOCKS,
            TMA_BOX, WARP_MMA_ROWS, MAX_SPLITS, ROW_CHUNK_BLOCKS, KEY_GROUPS)


def decode_plan(q, k_cache, v_cache, block_table, has_sinks: bool, softmax_scale: float, window, softcap: float,
                num_splits: int) -> DecodePlan:
    """``launch_decode``'s decisions for one call, memoised per static description (shapes,
    dtypes, device, the caches' contiguity, the table's width, sinks, scales, window, requested
    splits and the module's switches), so a decode step's host path repeats none of the
    schedule arithmetic: its Python on the CPU machine, old and new interleaved, 21-35 -> 15-25
    us a call (NOTES, twenty-first session).  Not memoised while ``CFG_OVERRIDE`` is set (the
    sweeps change its contents in place)."""
    # The caches' contiguity too: ``require_kernel`` refuses non-contiguous caches, and the plan
    # carries its verdict.
    key = (q.shape, q.dtype, k_cache.shape, k_cache.dtype, v_cache.shape, v_cache.dtype, q.device,
           k_cache.is_contiguous(), v_cache.is_contiguous(), None if block_table is None else block_table.shape[1],
           has_sinks, softmax_scale, window, softcap, num_splits, _switches())
    plan = _PLANS.get(key) if CFG_OVERRIDE is None else None
    if plan is None:
        plan = _make_plan(q, k_cache, v_cache, block_table, has_sinks, softmax_scale, window, softcap, num_splits)
        if CFG_OVERRIDE is None:
            if len(_PLANS) >= MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def _make_plan(q, k_cache, v_cache, block_table, has_sinks, softmax_scale, window, softcap, num_splits) -> DecodePlan:
    require_kernel(q, k_cache, v_cache)
    b, sq, h, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    dev = q.device
    fp8 = k_cache.dtype != q.dtype
    dtype, cache_dtype = launch.dtype_name(q.dtype), launch.dtype_name(k_cache.dtype)
    row_tiles = -(-(h // hkv) * sq // BLOCK_M)
    segments, tile_rows = segment_count(b, hkv, row_tiles), min(BLOCK_M, (h // hkv) * sq)
    paged, page_size = block_table is not None, k_cache.shape[1]
    capacity = page_size * (block_table.shape[1] if paged else 1)  # a contiguous cache: one page per entry
    blocks64 = -(-capacity // WARP_MMA_BLOCK_N)
    many = own_workers_pay(segments, blocks64, target.sm_count(dev))
    small = fp8 and split_producer_pays(paged, page_size)
    ws16 = not fp8 and ws16_pays(paged, page_size, blocks64, many)
    sched = decode_schedule(d, dv, dtype, cache_dtype, (h // hkv) * sq, many, small, ws16)
    structure = (d, dv, dtype, has_sinks, softcap > 0, cache_dtype if fp8 else None)
    _, decode, *combines = launch.memo(("decode", *structure, id(sched)),
                                       lambda: (sched, *get_decode_kernels(*structure, sched)))
    n_blocks = -(-capacity // sched.cfg["block_n"])
    if sched.cfg.get("own_workers"):  # decode_ws, each consumer its own worker: C workers per CTA
        num_splits = worker_count(num_splits, segments, n_blocks, target.sm_count(dev), sched)
        consumers, workers = 1, num_splits * sched.consumers
    elif sched.consumers > 1:  # decode_ws: num_splits is the CTA count (``worker_count``)
        consumers = sched.consumers
        workers = num_splits = worker_count(num_splits, segments, n_blocks, target.sm_count(dev), sched)
    else:  # decode_kernel: num_splits uniform splits per segment
        consumers = 1
        num_splits = split_count(num_splits, segments, n_blocks, target.sm_count(dev), sched, segments * tile_rows * dv)
        workers = segments * num_splits
    if softcap > 0:
        score_scale, cap_in = softcap * LOG2E, softmax_scale / softcap
    else:
        score_scale, cap_in = softmax_scale * LOG2E, 0.0
    left, right = host_window(window)
    # A segment is cut between workers unless they hold whole ones (``decode_kernel``: one split
    # each; own workers: ``whole_segment_ctas``); else each worker writes O/lse itself, and
    # there are no partials and no combine.
    combine, rows_total, combine_rows = None, 0, 0
    if consumers > 1 or workers > segments or segments % workers != 0:
        rows_total = (workers + segments) * consumers * tile_rows  # slots c + g of the workers' parts, C each
        # Each segment's splits: C slots for each worker touching it (``schedule.segment_workers``).
        most = (-(-workers // segments) + 1) * consumers
        i = combine_round(sched.combines, dv, most)
        combine = combines[i]
        combine_rows = sched.combines[i].rows or rows_per_cta(dv, most, per_round=sched.combines[i].per_round)
    if not paged:
        # A contiguous cache is one page per entry: every visible key j < capacity < 2^31 is on
        # page j >> 31 = 0, so the lookup neither divides nor needs a power-of-two capacity
        # (a division in the row lookup cost contiguous caches 7-14% of the bandwidth of page
        # 256: NOTES, 2026-11-23).
        page_shift = 31
    else:
        page_shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
    return DecodePlan(decode, combine, num_splits, workers, consumers, rows_total, combine_rows, score_scale, cap_in,
                      left, right, page_size, page_shift)


def launch_decode(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table, sinks,
                  softmax_scale: float, window, softcap: float, num_splits: int = 0, k_descale=None, v_descale=None):
    """Decode on CUDA: q (B, Sq, H, D); caches contiguous (B_cache, S_cache, Hkv, D) or paged
    (NP, page, Hkv, D) with ``block_table``, in q's dtype or float8_e4m3fn with ``k_descale`` /
    ``v_descale`` float32 (B, Hkv); ``seqlens_k`` int32 (B,) keys per entry after the append.
    Returns out (B, Sq, H, Dv) and lse (B, H, Sq) fp32 (natural log).  The decisions come from
    ``decode_plan``; per call only the allocations, the arguments' views and the launches."""
    b, sq, h, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    dev = q.device
    out = debug.new_output((b, sq, h, dv), q.dtype, dev)
    lse = debug.new_output((b, h, sq), torch.float32, dev)
    if out.numel() == 0:
        require_kernel(q, k_cache, v_cache)
        return out, lse
    plan = decode_plan(q, k_cache, v_cache, block_table, sinks is not None, softmax_scale, window, softcap, num_splits)
    table = page_table(block_table, cache_batch_idx, b, dev)
    leftpad = cache_leftpad.contiguous() if cache_leftpad is not None else int32_constant("zeros", b, dev)
    sinks32 = sinks.float().contiguous() if sinks is not None else launch.placeholder((h,), dev)
    if plan.rows_total:
        opart = debug.new_output((plan.rows_total, dv), torch.float32, dev)
        lsepart = debug.new_output((plan.rows_total,), torch.float32, dev)
    else:  # the partials are neither written nor read
        opart, lsepart = launch.placeholder((1, dv), dev), launch.placeholder((1,), dev)
    # Q, O and lse as flat rows (the kernels' layout: no index division per element).
    out_rows, lse_rows = out.view(-1, dv), lse.view(-1)
    kdesc, vdesc = descale_args(k_descale, v_descale, k_cache.dtype != q.dtype, b, hkv, dev)
    plan.decode(q.contiguous().view(-1, d), k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, dv), table,
                seqlens_k.contiguous(), leftpad, out_rows, lse_rows, opart, lsepart, sinks32, kdesc, vdesc,
                plan.score_scale, plan.cap_in, plan.left, plan.right, plan.num_splits, plan.page_size,
                plan.page_shift, sq)
    if plan.combine is not None:
        plan.combine(opart, lsepart, out_rows, lse_rows, sinks32, sq, hkv, plan.workers, plan.consumers,
                     plan.combine_rows)
    return out, lse


def require_kernel(q, k_cache, v_cache) -> None:
    """NotImplementedError naming why no decode kernel runs this call (``unsupported_reason``)."""
    reason = unsupported_reason(q, k_cache, v_cache)
    if reason is not None:
        raise NotImplementedError(f"flash_attn_with_kvcache: no CUDA kernel for {reason}")


def page_table(block_table, cache_batch_idx, b: int, device):
    """The kernels' block table: ``block_table`` itself for a paged cache; for a contiguous
    cache one page per entry, its cache row (``cache_batch_idx``, default ``arange(b)``)."""
    if block_table is not None:
        return block_table.contiguous()
    if cache_batch_idx is None:
        return int32_constant("arange", (b, 1), device)
    return cache_batch_idx.reshape(b, 1).to(torch.int32).contiguous()


def descale_args(k_descale, v_descale, fp8: bool, b: int, hkv: int, device):
    """(KDescale, VDescale) kernel arguments: the float32 descales of an FP8 cache, else a
    placeholder the kernels never read."""
    if fp8:
        return k_descale.float().contiguous(), v_descale.float().contiguous()
    kdesc = launch.placeholder((b, hkv), device)
    return kdesc, kdesc


def int32_constant(kind: str, n, device):
    """``arange`` or ``zeros`` (int32) of ``n`` entries (an int, or a shape tuple) on ``device``,
    made once per shape (``launch.constant``), so a decode step launches no fill kernel for its
    default table and left padding (in a CUDA graph each is a ~2 us kernel of its own, a tenth
    of a B = 1 step: NOTES) and pays no allocation or slice on the host.  One first asked for
    during graph capture is made fresh: a tensor filled inside a capture holds its values only
    once the graph replays."""
    return launch.constant(kind, n if type(n) is tuple else (n,), torch.int32, device)


def unsupported_reason(q, k_cache, v_cache):
    """Why no decode kernel runs this call, or None."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (kernels take float16 and bfloat16; use CPU tensors for others)"
    if k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        return f"a {k_cache.dtype} cache with {q.dtype} queries (kernels take q's dtype or float8_e4m3fn)"
    major, minor = target.capability(q.device)
    if major != 9:
        return f"GPU sm_{major}{minor} (the decode kernel is built for Hopper, sm_90)"
    d, dv = q.shape[-1], v_cache.shape[-1]
    if d % 16 or dv % 16 or d > 256 or dv > 256:
        return f"headdim {d} / headdim_v {dv} (the decode kernel takes multiples of 16 up to 256)"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "non-contiguous k_cache / v_cache"
    if k_cache.shape[0] * k_cache.shape[1] >= 2**31:
        return "a cache of 2^31 or more token rows (32-bit row indices)"
    # An FP8 cache always writes fp32 partials (decode_ws): up to 2 x 3 slots of up to 64 rows
    # per segment (worker_count, schedule: (workers + segments) x 3 slots, workers at most
    # max(segments, SMs); a partly used second row tile doubles a segment's rows), indexed in
    # 32 bits.
    limit = 2**27 if k_cache.dtype != q.dtype else 2**31
    if q.shape[0] * q.shape[1] * q.shape[2] * max(d, dv) >= limit:
        return f"q / out with 2^{limit.bit_length() - 1} or more elements (32-bit indices; split the batch)"
    return None
