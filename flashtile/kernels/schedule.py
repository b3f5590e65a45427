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
