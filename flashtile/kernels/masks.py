"""Mask arithmetic shared by the forward and backward kernels (TileLang expressions).

One mask covers every kind: with ``off = Sk - Sq``, row i sees key j when
``i + off - left <= j <= i + off + right`` and ``j < Sk``.  The host passes ``UNBOUNDED`` for
a side the user left at -1 and ``right = 0`` for causal, so full, causal, sliding-window and
causal+window attention are the same kernel with different runtime numbers.
"""

from __future__ import annotations

import tilelang.language as T

# Larger than any sequence offset we index, small enough that i + off + UNBOUNDED stays in int32.
UNBOUNDED = 1 << 30


def host_window(window: tuple[int, int]) -> tuple[int, int]:
    """User window (-1 = unbounded) -> kernel window bounds."""
    left, right = window
    return (UNBOUNDED if left < 0 else left), (UNBOUNDED if right < 0 else right)


def visible(row, col, off, Sk, left, right):
    """Key ``col`` is visible to query ``row`` (absolute indices)."""
    return T.And(T.And(col < Sk, col <= row + off + right), col >= row + off - left)


def block_fully_visible(last_row, col_lo, col_hi, m0, off, Sk, left, right):
    """Every key in [col_lo, col_hi] is visible to every query row in [m0, last_row].

    Such interior blocks skip the mask; only boundary blocks pay for the elementwise select.
    """
    return T.And(T.And(col_hi < Sk, col_hi <= m0 + off + right), col_lo >= last_row + off - left)


def key_block_range(m0, block_m, block_n, Sq, Sk, left, right):
    """Key blocks that query rows [m0, m0 + block_m) can see: (first block, count, last row).

    Blocks left of the window's start or right of its end hold no visible key and are
    skipped, which is what makes causal and windowed attention proportionally cheaper.
    """
    off = Sk - Sq
    last_row = T.min(m0 + block_m, Sq) - 1
    lo = T.max(0, m0 + off - left) // block_n
    hi = T.min(T.ceildiv(Sk, block_n), T.ceildiv(T.max(0, last_row + off + right + 1), block_n))
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


def query_tile(bx, block_m, block_n, Sq, Sk, left, right):
    """Query block of CTA ``bx`` and the key blocks it visits: (m0, kb_lo, n_blocks, last_row).

    Query blocks run last-first: under a causal mask the last blocks have the most keys, and
    starting the longest CTAs first balances the tail of the grid.
    """
    m0 = (T.ceildiv(Sq, block_m) - 1 - bx) * block_m
    return (m0, *key_block_range(m0, block_m, block_n, Sq, Sk, left, right))


def query_block_range(n0, block_n, block_m, Sq, Sk, left, right):
    """Query blocks whose rows can see keys [n0, n0 + block_n): (first block, count, last key)."""
    off = Sk - Sq
    last_col = T.min(n0 + block_n, Sk) - 1
    lo = T.max(0, n0 - off - right) // block_m
    hi = T.min(T.ceildiv(Sq, block_m), T.ceildiv(T.max(0, last_col - off + left + 1), block_m))
    return lo, T.max(hi - lo, 0), last_col
