"""The tile schedulers (TileLang expressions): which tile a CTA index stands for.

Grids: the one-tile forward launches one axis of (batch entry, head group, query block, head)
with the query blocks longest-first (``masks.query_tile``) and heads walked ``head_group`` at
a time in ``grouped_tile`` order (``configs.head_group``: groups under causal/window masks,
head by head for full attention); the deterministic dQ kernel launches (query block, head,
batch); the dK/dV kernels launch key blocks in ``grouped_tile`` order; the persistent forward
walks ``tile_pair`` items.  Packed (varlen) batches launch a grid of real tiles instead,
sequence-major (``seqinfo.packed_slots``), the forward's heads grouped the same way.


The GPU starts CTAs roughly in index order, so the order decides two things that pull
against each other:

* balance: under a causal mask tiles differ in work by up to the number of blocks in a row;
  when the longest tiles start last, the grid ends on a tail of a few long CTAs;
* L2 reuse: tiles of one row (same batch and head) read the same K/V (forward) or Q/dO
  (backward), so CTAs running at the same time should share few rows.

``grouped_tile`` takes ``rows_per_group`` rows at a time and walks them block-major (every
row's block 0, then every row's block 1, ...): 1 is the plain row-major order (best L2
reuse), all rows is longest-first over the whole grid (best balance).  The launcher picks the
number per call (``configs.dkdv_rows_per_group``), so it costs no recompilation.

    rows_per_group = 2, 3 rows of 4 blocks:   CTA index -> (block, row)
      0 1 2 3 4 5 6 7 | 8 9 10 11
      (0,0) (0,1) (1,0) (1,1) (2,0) (2,1) (3,0) (3,1) | (0,2) (1,2) (2,2) (3,2)
"""

import tilelang.language as T


def grouped_tile(index, n_blocks, n_rows, rows_per_group):
    """CTA ``index`` in [0, n_blocks * n_rows) -> (block, row) in the grouped order above."""
    span = rows_per_group * n_blocks
    group = index // span
    within = index % span
    rows_here = T.min(rows_per_group, n_rows - group * rows_per_group)  # the last group may be short
    return within // rows_here, group * rows_per_group + within % rows_here


def tile_pair(item, half, n_qb, pairs, H):
    """Query tile ``half`` (0 or 1) of work item ``item``: (h, b, bx, real).

    An item is a pair of query blocks of one (batch, head) row: ``bx`` and its mirror
    ``n_qb - 1 - bx`` (``bx`` in ``query_tile``'s longest-first numbering), so under a causal
    mask every item holds about the same number of key blocks and a static round robin over
    items stays balanced.  ``real`` is false for the mirror of the middle block of an odd row.
    """
    pair = item % pairs
    row = item // pairs
    mirror = n_qb - 1 - pair
    return row % H, row // H, T.if_then_else(half == 0, pair, mirror), T.Or(half == 0, mirror != pair)


# --- split-KV decode: CTA shares of key ranges ------------------------------------------------
#
# Decode work is ``S`` segments (one per (batch entry, kv head, row tile)), each a run of key
# blocks, shared by ``G`` workers (CTAs).  Worker ``c`` takes the units ``[c S, (c+1) S)`` of
# ``[0, S G)``, where segment ``g`` spans ``[g G, (g+1) G)``: ``S / G`` segments' worth, so it
# touches at most ``ceil(S / G) + 1`` segments (its "parts"; two when ``G >= S``).  With
# ``G = S x splits`` this is the uniform split of every segment into ``splits`` shares; any
# other ``G`` (e.g. the SM count) fills the GPU without a whole number of CTAs per segment, and
# ``G < S`` makes the workers persistent (several segments each, streamed back to back).  A
# segment's real block count ``n`` (device-side: lengths, masks) is cut at ``floor(u n / G)``,
# so the parts tile it.
#
#      S = 2 segments, G = 3 workers:   units 0 . . | 3 . . | (segment g = 0, 1; G = 3 units each)
#      worker 0: [0, 2)  -> segment 0, units [0, 2)
#      worker 1: [2, 4)  -> segment 0, units [2, 3)   and segment 1, units [0, 1)
#      worker 2: [4, 6)  -> segment 1, units [1, 3)
#
# Partial results: worker ``c``'s part on segment ``g`` owns slot ``c + g`` (unique: a later
# worker's segments start at or after an earlier one's last, so no two pairs share a sum), so segment ``g``'s slots are the contiguous run from
# ``first + g`` over its ``count`` workers (``segment_workers``) and a combine needs no table.
# The helpers take Python ints (host, tests) or TileLang int32 expressions (kernels; products
# in 64 bits, since ``c S`` and ``u n`` outgrow 32).


def _wide(x):
    return x if isinstance(x, int) else T.Cast("int64", x)


def _narrow(x):
    return x if isinstance(x, int) else T.Cast("int32", x)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else T.min(a, b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else T.max(a, b)


def max_parts(workers, segments):
    """Parts a worker may have: ``ceil(segments / workers) + 1``."""
    return (segments + workers - 1) // workers + 1


def split_part(c, part, workers, segments, reg=lambda x: x):
    """Part ``part`` (0 .. ``max_parts`` - 1) of worker ``c``'s share: (segment, u0, u1), its units of that
    segment in ``[0, workers)``; the part is empty unless ``u0 < u1`` (a part past the end of
    the worker's share, or past the last segment).  ``reg``: how a kernel keeps
    an intermediate in a register (else TileLang repeats its 64-bit division at every use)."""
    cs = reg(_wide(c) * segments)
    g = reg(cs // workers + part)
    return _narrow(g), _narrow(_max(cs - g * workers, 0)), _narrow(_min(cs + segments - g * workers, workers))


def share_blocks(u0, u1, n, workers):
    """(first block offset, block count) of units ``[u0, u1)`` of a segment of ``n`` blocks."""
    first = _wide(u0) * n // workers
    return _narrow(first), _narrow(_wide(u1) * n // workers - first)


def segment_workers(g, workers, segments):
    """(first worker, worker count) whose shares touch segment ``g``; their parts on it own
    slots ``first + g .. first + g + count - 1``."""
    gw = _wide(g) * workers
    first = gw // segments
    last = (gw + workers - 1) // segments
    return _narrow(first), _narrow(last - first + 1)


def spread_segment(g, segments, workers, reg=lambda x: x):
    """The segment that worker-share segment ``g`` (``split_part``'s) stands for.

    When the workers divide the segments (every worker k = S / G whole segments: nothing cut,
    no partial, no combine), worker c's part p is segment ``p G + c`` instead of ``k c + p``,
    so the segments that run at the same time are consecutive ones: every kv head of a run of
    entries.  In share order they are every k-th, and with 8 kv heads and k = 4 (B=128 2k) only
    heads 0 and 4, whose 256-byte rows sit at the same offsets of every 2 KB row group of the
    cache; that left part of the memory system idle (H200: 247.3 -> 239.6 us, cuDNN 239.9;
    NOTES, twenty-second session).  Otherwise ``g`` itself.  ``reg`` as in ``split_part``.

        S = 8, G = 4 (k = 2):   share order  worker 0: 0 1 | worker 1: 2 3 | ... part 0 runs 0 2 4 6
                                spread order worker 0: 0 4 | worker 1: 1 5 | ... part 0 runs 0 1 2 3
    """
    k = reg(segments // workers)
    spread = lambda: g % k * workers + g // k  # noqa: E731  (k may be 0 when not taken)
    if isinstance(k, int):
        return spread() if segments % workers == 0 and k > 1 else g
    return T.if_then_else(T.And(segments % workers == 0, k > 1), spread(), g)
