"""Mask arithmetic shared by every kernel (TileLang expressions), in one place.

One mask covers every kind: with ``off = len_k - len_q`` of the tile's sequence
(``seqinfo.Sequence``), row i sees key j when ``i + off - left <= j <= i + off + right`` and
``j < len_k`` (and ``j >= key_lo`` where a KV cache has left padding).  The host passes ``UNBOUNDED`` for a side the user left at -1 and ``right = 0``
for causal, so full, causal, sliding-window and causal+window attention are the same kernel
with different runtime numbers.  No mask tests the query row: in a packed (varlen) batch rows
past ``len_q`` hold the next sequence's queries, which the forward computes and never stores,
and which the backward's statistics padding (LSE2 = +inf, ``packed_stats.stat_start``) gives P = 0.
"""

from __future__ import annotations

from ..lazy import LazyAttributes

T = LazyAttributes("tilelang.language")  # imported by the first kernel build, not by the launcher (``lazy``)

# Larger than any sequence offset we index, small enough that i + off + UNBOUNDED stays in int32.
UNBOUNDED = 1 << 30


def host_window(window: tuple[int, int]) -> tuple[int, int]:
    """User window (-1 = unbounded) -> kernel window bounds."""
    left, right = window
    return (UNBOUNDED if left < 0 else left), (UNBOUNDED if right < 0 else right)


class TileMask:
    """A tile's mask, built once per tile and read-only: its sequence (``seqinfo.Sequence``:
    lengths, ``off``) and the kernel window bounds."""

    def __init__(self, seq, left, right):
        self.seq, self.left, self.right = seq, left, right


def visible(row, col, mask):
    """Key ``col`` is visible to query ``row`` (indices within the tile's sequence)."""
    seq, left, right = mask.seq, mask.left, mask.right
    seen = T.And(T.And(col < seq.len_k, col <= row + seq.off + right), col >= row + seq.off - left)
    return seen if seq.key_lo is None else T.And(seen, col >= seq.key_lo)


def in_sequence(col, seq):
    """Key ``col`` lies inside the sequence: the mask of an interior tile's key tail."""
    return col < seq.len_k


def block_fully_visible(last_row, col_lo, col_hi, m0, mask):
    """Every key in [col_lo, col_hi] is visible to every query row in [m0, last_row].

    Such interior blocks skip the mask; only boundary blocks pay for the elementwise select.
    """
    seq, left, right = mask.seq, mask.left, mask.right
    off = seq.off
    inside = T.And(T.And(col_hi < seq.len_k, col_hi <= m0 + off + right), col_lo >= last_row + off - left)
    return inside if seq.key_lo is None else T.And(inside, col_lo >= seq.key_lo)


def key_block_range(m0, block_m, block_n, mask):
    """Key blocks that query rows [m0, m0 + block_m) can see: (first block, count, last row).

    Blocks left of the window's start or right of its end hold no visible key and are
    skipped, which is what makes causal and windowed attention proportionally cheaper.
    """
    seq, left, right = mask.seq, mask.left, mask.right
    off = seq.off
    last_row = T.min(m0 + block_m, seq.len_q) - 1
    lo = T.max(0, m0 + off - left) // block_n
    hi = T.min(T.ceildiv(seq.len_k, block_n), T.ceildiv(T.max(0, last_row + off + right + 1), block_n))
    return lo, T.max(hi - lo, 0), last_row


def pipelined_trips(n_blocks):
    """Trip count of an auto-pipelined (``T.Pipelined``) loop over ``n_blocks`` visible blocks.

    At least one: the pipeliner waits for the tiles loaded before the loop (Q, or K and V)
    only inside it, and its shared-memory planner gives the epilogue's staging tile the same
    memory, so with an empty loop a late load landed on the output (seen on an H100).  The
    extra trip visits a block that no row of the tile can see, so the mask zeroes it.  The
    paired hand-written forward (``fwd_ws``) takes the same trip so that every tile has a first
    and a last block for its cross-tile overlap.
    """
    return T.max(n_blocks, 1)


def query_tile(bx, block_m, block_n, mask, bottom_aligned: bool = False):
    """Query block of CTA ``bx`` and the key blocks it visits: (m0, kb_lo, n_blocks, last_row).

    Query blocks run last-first: under a causal mask the last blocks have the most keys, and
    starting the longest CTAs first balances the tail of the grid.  In a packed batch a CTA
    whose slot is past its sequence's blocks (``seqinfo.packed_slots``: at most one such slot
    per sequence, or a dead slot) gets ``m0 = len_q`` (no row to write) and no key block.

    ``bottom_aligned`` (the forwards): tiles end at ``len_q - bx * block_m`` instead of
    starting at multiples of ``block_m``, so when ``block_m`` does not divide the length the
    short tile is the first one, which under a causal mask sees the fewest keys, not the last
    one, which sees them all.  The first tile starts at row 0 (m0 clamped, never negative: no
    read or write before a sequence's first row) and so overlaps the second; the rows both
    compute get bitwise equal results (the extra key blocks are fully masked for them: they
    add exactly 0 and rescale by exactly 1, ``softmax.online_softmax`` makes sure of the 1),
    so the double store is benign.  Rows x keys for
    S = 1k / 4k / 16k causal at 192 x 128 tiles: 1.14 / 1.055 / 1.015x fewer blocks::

        S = 448, block_m = 192:   top-aligned  [0,192) [192,384) [384,448)+pad  (pad: 128 idle rows x all keys)
                                  bottom       [0,192) [64,256) [256,448)        (overlap: 128 rows x 2 blocks)
    """
    seq = mask.seq
    n_qb = T.ceildiv(seq.len_q, block_m)
    m0 = T.max(seq.len_q - (bx + 1) * block_m, 0) if bottom_aligned else (n_qb - 1 - bx) * block_m
    if seq.varlen:
        live = bx < n_qb
        m0 = T.if_then_else(live, m0, seq.len_q if bottom_aligned else n_qb * block_m)
        kb_lo, n_blocks, last_row = key_block_range(m0, block_m, block_n, mask)
        return m0, kb_lo, T.if_then_else(live, n_blocks, 0), last_row
    return (m0, *key_block_range(m0, block_m, block_n, mask))


def query_block_range(n0, block_n, block_m, mask):
    """Query blocks whose rows can see keys [n0, n0 + block_n): (first block, count, last key
    of the sequence in the block).

    In a packed batch a key block past its sequence's end (an empty slot of the packed grid,
    ``seqinfo.packed_slots``) sees no query.  The block's rows past the last key (a dense
    tensor's zero fill, or a packed batch's next sequence) are the key tail that the dK/dV
    kernels zero row by row (``bwd.score_gradients``' ``keep_visible``)."""
    seq, left, right = mask.seq, mask.left, mask.right
    off = seq.off
    last_col = T.min(n0 + block_n, seq.len_k) - 1
    lo = T.max(0, n0 - off - right) // block_m
    hi = T.min(T.ceildiv(seq.len_q, block_m), T.ceildiv(T.max(0, last_col - off + left + 1), block_m))
    count = T.max(hi - lo, 0)
    if seq.varlen:
        count = T.if_then_else(n0 < seq.len_k, count, 0)
    return lo, count, last_col
