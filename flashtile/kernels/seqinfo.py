"""Where a batch entry's rows sit in the tensors: the per-tile sequence description.

Every kernel builder indexes Q/K/V/O/LSE tiles through one of these objects instead of writing
``Q[b, m0 : m0 + block_m, h, :]`` itself (FlashAttention-4's ``seqlen_info.py`` plays the same
role), so dense and packed (variable-length) batches are one kernel family:

* dense: tensors are (B, S, H, D) and LSE (B, H, S); batch entry b is index b of dim 0 and its
  lengths are the symbolic S of the tensor shapes.  Nothing is loaded: a dense build emits
  exactly the indices it always did.
* varlen: tensors are (1, total, H, D) and LSE (1, H, total) (the packed tensors with a leading
  1); batch entry b starts at row ``cu_seqlens[b]`` and is ``seqlens[b]`` rows long (the user's
  ``seqused`` or the difference of ``cu_seqlens``).  The two numbers are loaded once per tile
  into registers.  A tile that runs past its sequence reads the next sequence's rows, which the
  masks hide (``rows_checked``), and never writes them: stores go through ``store_q_tile`` /
  ``store_k_tile``, which guard each row against the sequence's length.

``Sequences`` is the grid-level view (batch count, longest sequence: grid extents);
``Sequences.of(b)`` builds the per-tile ``Sequence``.  Both are plain Python objects used at
trace time; TileLang macros accept them as arguments.
"""

from __future__ import annotations

import tilelang.language as T


class Sequence:
    """Batch entry ``b`` of a tile, built once per tile and read-only.

    ``len_q`` / ``len_k``: its query and key lengths; ``off = len_k - len_q`` aligns masks
    bottom-right; ``varlen`` tells the masks whether rows past ``len_q`` may hold another
    sequence's data (they must then be masked explicitly, ``rows_checked``).
    """

    def __init__(self, varlen: bool, b, len_q, len_k, q0=0, k0=0, s0=None, key_lo=None, off=None, v0=0):
        self.varlen = varlen
        self.b = 0 if varlen else b  # index into dim 0 of the tensors
        self.batch = b  # the batch entry (sinks, scheduling)
        self.len_q, self.len_k = len_q, len_k
        self.q0, self.k0 = q0, k0  # first row of the sequence in the tensors' row dim
        # First entry of the sequence in the backward's per-row statistics (LSE2, Delta): TMA
        # loads them with the row as the innermost dimension, whose start must be 16-byte
        # aligned, so a packed batch gives every sequence a 4-aligned start there.
        self.s0 = q0 if s0 is None else s0
        # First column of the sequence in an FP8 forward's V^T (``operands``: 16-aligned).
        self.v0 = v0
        self.off = len_k - len_q if off is None else off  # a caller may hold it in a register
        self.rows_checked = varlen
        # First visible key (a KV cache's left padding), or None: every key from 0.
        self.key_lo = key_lo

    # Tile regions (TMA / T.copy sources and destinations).
    def q_rows(self, X, m0, rows, h):
        """Rows [m0, m0 + rows) of head ``h`` of a query-side tensor (Q, O, dO, dQ)."""
        return X[self.b, self.q0 + m0 : self.q0 + m0 + rows, h, :]

    def k_rows(self, X, n0, rows, hk):
        """Rows [n0, n0 + rows) of head ``hk`` of a key-side tensor (K, V, dK, dV)."""
        return X[self.b, self.k0 + n0 : self.k0 + n0 + rows, hk, :]

    def v_cols(self, Vt, n0, cols, hk):
        """Keys [n0, n0 + cols) of kv head ``hk`` of a transposed V (B, Hkv, Dv, keys): the FP8
        forward's V^T tile (``operands``)."""
        return Vt[self.b, hk, :, self.v0 + n0 : self.v0 + n0 + cols]

    def stat(self, X, h, m0, rows):
        """Entries [m0, m0 + rows) of head ``h`` of the backward's per-query statistics
        (LSE2, Delta; their rows start at ``s0``)."""
        return X[self.b, h, self.s0 + m0 : self.s0 + m0 + rows]



class Sequences:
    """The batch as the grid sees it: ``batch`` entries, at most ``max_q`` / ``max_k`` rows."""

    def __init__(self, varlen: bool, batch, max_q, max_k, cu_q=None, cu_k=None, lens_q=None, lens_k=None, cu_stat=None,
                 v_group=0):
        self.varlen = varlen
        self.batch, self.max_q, self.max_k = batch, max_q, max_k
        self._cu_q, self._cu_k, self._lens_q, self._lens_k = cu_q, cu_k, lens_q, lens_k
        self._cu_stat = cu_stat
        self._v_group = v_group

    def of(self, b) -> Sequence:
        """The ``Sequence`` of batch entry ``b``; call inside the kernel (varlen allocates
        registers for the loaded offsets)."""
        if not self.varlen:
            return Sequence(False, b, self.max_q, self.max_k)
        # Registers, not expressions: a load expression would be re-issued at every use.
        q0 = T.alloc_var(T.int32, init=self._cu_q[b])[0]
        k0 = T.alloc_var(T.int32, init=self._cu_k[b])[0]
        len_q = T.alloc_var(T.int32, init=self._lens_q[b])[0]
        len_k = T.alloc_var(T.int32, init=self._lens_k[b])[0]
        s0 = None if self._cu_stat is None else T.alloc_var(T.int32, init=self._cu_stat[b])[0]
        v0 = v_column_start(k0, b, self._v_group) if self._v_group else 0
        return Sequence(True, b, len_q, len_k, q0, k0, s0, v0=v0)


def v_column_start(k0, b, group: int):
    """Column where packed sequence ``b`` (first key row ``k0``) starts in an FP8 forward's V^T:
    the first multiple of ``group`` at or past k0, plus ``group * b`` so that no two sequences'
    whole groups overlap.  Works on ints, torch tensors (the host pre-pass, ``operands``) and
    TileLang expressions (the kernel), so both sides use one formula."""
    return (k0 + group - 1) // group * group + group * b


def dense(B, Sq, Sk) -> Sequences:
    return Sequences(False, B, Sq, Sk)


def packed(cu_q, cu_k, lens_q, lens_k, max_q, max_k, cu_stat=None, v_group=0) -> Sequences:
    """``cu_*`` (batch + 1,) int32 row offsets, ``lens_*`` (batch,) int32 lengths used,
    ``max_*`` int32 scalars bounding every length (grid extents); ``cu_stat`` (batch + 1,)
    int32: where each sequence starts in the backward's LSE2/Delta (4-aligned); ``v_group``: an
    FP8 forward's V^T starts sequence b at ``ceil(cu_k[b] / g) * g + g * b`` (``operands.v_offsets``)."""
    return Sequences(True, lens_q.shape[0], max_q, max_k, cu_q, cu_k, lens_q, lens_k, cu_stat, v_group)


@T.macro
def store_q_tile(seq, acc, stage, X, m0, rows, h, cols, stat=None, Stat=None):
    """Accumulator fragment ``acc`` (rows x cols, fp32) -> query rows [m0, m0 + rows) of head
    ``h`` of ``X`` (O, dQ) in ``X``'s dtype, and with ``stat`` (a per-row fragment) its entries
    [m0, m0 + rows) of head ``h`` of ``Stat`` (LSE).  Dense: through the shared tile ``stage``
    and one T.copy (a TMA store; the tensor's edge clips it); the caller orders ``stage``
    against its other uses.  Varlen: straight from registers, each row guarded, since rows
    past the sequence's end belong to the next sequence; the per-row statistic is written in
    the same loop (by the thread holding column 0: a separate 1-D loop over the statistic's
    fragment sends TileLang 0.1.15's layout inference into a loop that does not end)."""
    if seq.varlen:
        for i, j in T.Parallel(rows, cols):
            if m0 + i < seq.len_q:
                X[seq.b, seq.q0 + m0 + i, h, j] = T.cast(acc[i, j], X.dtype)
                if stat is not None:
                    if j == 0:
                        Stat[seq.b, h, seq.q0 + m0 + i] = stat[i]
    else:
        T.copy(acc, stage)
        T.copy(stage, seq.q_rows(X, m0, rows, h))
        if stat is not None:
            T.copy(stat, seq.stat(Stat, h, m0, rows))


@T.macro
def store_k_tile(seq, acc, stage, X, n0, rows, hk, cols):
    """As ``store_q_tile`` for key rows [n0, n0 + rows) of head ``hk`` (dK, dV)."""
    if seq.varlen:
        for i, j in T.Parallel(rows, cols):
            if n0 + i < seq.len_k:
                X[seq.b, seq.k0 + n0 + i, hk, j] = T.cast(acc[i, j], X.dtype)
    else:
        T.copy(acc, stage)
        T.copy(stage, seq.k_rows(X, n0, rows, hk))
