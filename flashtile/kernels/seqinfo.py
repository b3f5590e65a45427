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
  key masks and the backward's statistics padding hide (``stat_start``), and never writes them:
  stores go through ``store_q_tile`` / ``store_k_tile``, which store a tile whose rows are all
  its sequence's by TMA, as dense, and guard each row of a sequence's tail tile against its
  length.

``Sequences`` is the grid-level view (``grid``: launch extents; ``tile``: which batch entry,
head and block a CTA stands for); ``Sequences.of(b)`` builds the per-tile ``Sequence``.  Both
are plain Python objects used at trace time; TileLang macros accept them as arguments.

Packed grids hold real tiles only (``packed_slots``): a grid sized by the longest sequence
left ~45% of its CTAs without work on 64 sequences of 64..1024 tokens.
"""

from __future__ import annotations

import tilelang.language as T

from .packed_stats import stat_start
from .schedule import grouped_tile


class Sequence:
    """Batch entry ``b`` of a tile, built once per tile and read-only.

    ``len_q`` / ``len_k``: its query and key lengths; ``off = len_k - len_q`` aligns masks
    bottom-right; ``varlen``: packed, so rows past ``len_q`` / ``len_k`` may hold another
    sequence's data (``masks`` hides the keys, ``stat_start``'s padding the queries).
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
        # First visible key (a KV cache's left padding), or None: every key from 0.
        self.key_lo = key_lo

    # Tile regions (TMA / T.copy sources and destinations).
    def q_rows(self, X, m0, rows, h, cols=None):
        """Rows [m0, m0 + rows) of head ``h`` of a query-side tensor (Q, O, dO, dQ); with
        ``cols`` = (first, count) only those columns of the head dim (``bwd_wide``'s halves)."""
        return X[self.b, self.q0 + m0 : self.q0 + m0 + rows, h, _columns(cols)]

    def k_rows(self, X, n0, rows, hk, cols=None):
        """Rows [n0, n0 + rows) of head ``hk`` of a key-side tensor (K, V, dK, dV); ``cols`` as
        in ``q_rows``."""
        return X[self.b, self.k0 + n0 : self.k0 + n0 + rows, hk, _columns(cols)]

    def v_cols(self, Vt, n0, cols, hk):
        """Keys [n0, n0 + cols) of kv head ``hk`` of a transposed V (B, Hkv, Dv, keys): the FP8
        forward's V^T tile (``operands``)."""
        return Vt[self.b, hk, :, self.v0 + n0 : self.v0 + n0 + cols]

    def stat(self, X, h, m0, rows):
        """Entries [m0, m0 + rows) of head ``h`` of the backward's per-query statistics
        (LSE2, Delta; their rows start at ``s0``)."""
        return X[self.b, h, self.s0 + m0 : self.s0 + m0 + rows]



def _columns(cols):
    """The head-dim slice of ``Sequence.q_rows`` / ``k_rows``: all columns, or (first, count)."""
    return slice(None) if cols is None else slice(cols[0], cols[0] + cols[1])


class Sequences:
    """The batch as the grid sees it: ``batch`` entries, at most ``max_q`` / ``max_k`` rows."""

    def __init__(self, varlen: bool, batch, max_q, max_k, cu_q=None, cu_k=None, lens_q=None, lens_k=None, stats=False,
                 v_group=0, rows_q=None, rows_k=None, head_group=None):
        self.varlen = varlen
        self.batch, self.max_q, self.max_k = batch, max_q, max_k
        self._cu_q, self._cu_k, self._lens_q, self._lens_k = cu_q, cu_k, lens_q, lens_k
        self._stats = stats  # the backward's statistics in the packed layout (``stat_start``)
        self._v_group = v_group
        self._rows_q, self._rows_k = rows_q, rows_k  # rows of the packed tensors
        self._found = None  # the shared buffer of ``tile``'s search
        # Heads a grid walks together (a runtime int32, ``configs.head_group``), or None:
        # dense grids keep their (block, head, batch) axes.
        self.head_group = head_group

    def grid(self, block, heads, keys=False):
        """Launch extents, one CTA per tile of ``block`` query rows (``keys``: key rows) per head.

        Dense: (blocks of the longest sequence, heads, batch), or with a ``head_group`` one axis
        of as many CTAs in ``tile``'s order.  Packed: one axis of ``heads * (rows // block
        + batch)`` CTAs, sequence-major (``packed_slots``)."""
        if not self.varlen:
            n_blocks = T.ceildiv(self.max_k if keys else self.max_q, block)
            return (n_blocks * heads * self.batch,) if self.head_group is not None else (n_blocks, heads, self.batch)
        rows = self._rows_k if keys else self._rows_q
        assert rows is not None, "packed grids need the tensors' row count (seqinfo.packed rows_q / rows_k)"
        return (heads * packed_slots(rows, self.batch, block),)

    def tile(self, ids, block, heads, threads, keys=False, head_group=None, found=None, warp=False):
        """(block index, head, batch entry) of the CTA with launch indices ``ids`` (``grid``'s
        extents).  With a ``head_group`` (the argument, else the Sequences'; for a packed grid
        only the argument's or the Sequences' runtime value), a batch entry's CTAs walk its heads
        that many at a time, block-major within a group (``schedule.grouped_tile``).  Dense: the
        indices themselves, or with a head group decoded from the one axis (batch entry, then
        head group, block, head).  Packed: found among the sequences
        by the CTA's ``threads`` threads together (one shared-memory exchange and barrier,
        ``packed_slots``); a CTA whose slot holds no tile gets a block index past every
        sequence's end, so the kernels' own range checks give it no work.  A persistent kernel
        passes ``found`` (its own buffer, ``found_buffer``) and ``warp=True``: one warp
        searches (``ids`` is then the slot it is after) with warp syncs while the other roles
        run on."""
        head_group = self.head_group if head_group is None else head_group
        if not self.varlen:
            if self.head_group is None:  # the grid kept its three axes (``grid``)
                return ids
            n_blocks = T.ceildiv(self.max_k if keys else self.max_q, block)
            block_of, head_of = grouped_tile(ids % (n_blocks * heads), n_blocks, heads, head_group)
            # Registers: as expressions the divisions by runtime sizes recur at every use.
            return tuple(T.alloc_var(T.int32, init=x)[0] for x in (block_of, head_of, ids // (n_blocks * heads)))
        cu = self._cu_k if keys else self._cu_q
        if found is None:
            found = found_buffer()
        find_slot(cu, self.batch, block, ids // heads, found, threads, self._fields(), warp)
        entry = T.alloc_var(T.int32, init=found[0])[0]
        first = T.alloc_var(T.int32, init=found[1])[0]
        slots = T.alloc_var(T.int32, init=found[2])[0]
        live = entry < self.batch
        block_of, head_of = slot_tile(ids, heads, first, slots, 1 if head_group is None else head_group)
        bx = T.alloc_var(T.int32, init=T.if_then_else(live, block_of, DEAD_SLOT))[0]
        # Clamped: offsets that are not monotone may make two threads write one triple.
        h = T.alloc_var(T.int32, init=T.if_then_else(live, T.max(T.min(head_of, heads - 1), 0), 0))[0]
        b = T.max(T.min(entry, self.batch - 1), 0)
        self._found = found  # ``of(b)`` reads the sequence's offsets from here
        return bx, h, b

    def _fields(self):
        """The per-sequence arrays in ``FOUND_FIELDS`` order."""
        return self._cu_q, self._cu_k, self._lens_q, self._lens_k

    def of(self, b) -> Sequence:
        """The ``Sequence`` of batch entry ``b``; call inside the kernel (varlen allocates
        registers for the loaded offsets).  In a packed kernel that called ``tile``, ``b`` must be
        the entry ``tile`` returned."""
        if not self.varlen:
            return Sequence(False, b, self.max_q, self.max_k)
        # After ``tile``, the search already loaded them into shared memory, saving the CTA a
        # dependent global round trip before its first load (``b`` is then tile's entry: the
        # name a kernel binds it to is a new variable, so no check can tell).
        if self._found is not None:
            fields = [self._found[3 + i] for i in range(len(FOUND_FIELDS))]
        else:
            fields = [f[b] for f in self._fields()]
        return self.of_fields(b, fields)

    def of_fields(self, b, fields) -> Sequence:
        """``of`` for packed batch entry ``b`` whose ``FOUND_FIELDS`` values are ``fields``
        (expressions, e.g. a persistent kernel's per-tile hand-over in shared memory)."""
        # Registers, not expressions: a load expression would be re-issued at every use.
        q0, k0, len_q, len_k = (T.alloc_var(T.int32, init=f)[0] for f in fields)
        s0 = T.alloc_var(T.int32, init=stat_start(q0, b))[0] if self._stats else None
        v0 = v_column_start(k0, b, self._v_group) if self._v_group else 0
        return Sequence(True, b, len_q, len_k, q0, k0, s0, v0=v0)


def v_column_start(k0, b, group: int):
    """Column where packed sequence ``b`` (first key row ``k0``) starts in an FP8 forward's V^T:
    the first multiple of ``group`` at or past k0, plus ``group * b`` so that no two sequences'
    whole groups overlap.  Works on ints, torch tensors (the host pre-pass, ``operands``) and
    TileLang expressions (the kernel), so both sides use one formula."""
    return (k0 + group - 1) // group * group + group * b


# Block index of a packed grid's CTA whose slot holds no tile: past any sequence's blocks
# (sequences shorter than 2**22 blocks), small enough that block arithmetic stays in int32.
DEAD_SLOT = 1 << 22


def packed_slots(rows, batch, block):
    """Slots of a packed grid per head: ``rows // block + batch`` for ``rows`` packed rows of
    ``batch`` sequences in tiles of ``block`` (ints or expressions).

    How a packed grid maps CTAs to tiles, without a host-side work list or a device sync.

    Sequence b owns the slots [f(b), f(b + 1)) with f(b) = cu[b] // block + b.  Its
    ceil(len_b / block) tiles fit (a sequence crosses at most one block boundary more than it
    has full blocks), at most one slot per sequence stays empty, and the slots of all
    sequences number f(batch) = total // block + batch, known on the host.  Per head, the
    grid repeats the slots of one sequence before the next: CTA i is slot i // heads of the
    sequence-major order, i.e. sequence b holds CTAs [heads * f(b), heads * f(b + 1)), head
    (i - heads * f(b)) // n_b and block (i - heads * f(b)) % n_b with n_b = f(b + 1) - f(b).

        block 4, lengths 6, 3, 9 (cu 0, 6, 9, 18):  f = 0, 2, 4, 7
        slot   0  1 | 2  3 | 4  5  6
        seq    0  0 | 1  1 | 2  2  2
        block  0  1 | 0  -  0  1  2        (- : empty slot, no work)

    Finding b is a search over the monotone f: each thread of the CTA tests a few entries
    (``find_slot``), one shared-memory exchange per ``threads`` entries."""
    return rows // block + batch


def slot_range(cu, e, block):
    """Slots [lo, hi) of sequence ``e`` (``packed_slots``'s f(e), f(e + 1)); ints or expressions."""
    return cu[e] // block + e, cu[e + 1] // block + e + 1


def slot_tile(ids, heads, first, slots, head_group=1):
    """(block, head) of CTA ``ids`` in the sequence whose slots start at ``first`` and number
    ``slots`` (``packed_slots``); ints or expressions.  The sequence's CTAs walk its heads
    ``head_group`` at a time, block-major within a group (``schedule.grouped_tile``): 1 = head
    by head, every block of a head before the next head."""
    return grouped_tile(ids - heads * first, slots, heads, head_group)


# What ``find_slot`` copies of the sequence it finds, after (b, f(b), n_b): first query row,
# first key row, query length, key length (``Sequences.of``).
FOUND_FIELDS = ("q0", "k0", "len_q", "len_k")


def found_buffer():
    """Shared scratch for ``find_slot``'s answer."""
    return T.alloc_shared([3 + len(FOUND_FIELDS)], T.int32, scope="shared")


@T.macro
def find_slot(cu, batch, block, slot, found, threads, fields, warp=False):
    """``found`` (shared int32 [3 + len(FOUND_FIELDS)]) <- (b, f(b), f(b + 1) - f(b)) for the
    sequence owning ``slot`` (``packed_slots``), then entry b of each array in ``fields``; or
    (batch, slot, 1, 0, ...) for a slot no sequence owns (past the last one, or any slot of
    offsets that are not monotone: then no thread writes).  Each thread loads its entries'
    fields together with their offsets, so the search and the loads cost one round trip.
    ``warp``: the calling warp alone searches (``threads`` = 32, warp syncs)."""
    sync = T.sync_warp if warp else T.sync_threads
    tx = T.get_thread_binding() % 32 if warp else T.get_thread_binding()
    key = T.alloc_var(T.int32, init=slot)
    if tx == 0:
        found[0] = batch
        found[1] = key
        found[2] = 1
        for f in T.unroll(len(FOUND_FIELDS)):
            found[3 + f] = 0
    sync()
    for r in T.serial(T.ceildiv(batch, threads)):
        e = r * threads + tx
        if e < batch:
            first, end = slot_range(cu, e, block)
            lo = T.alloc_var(T.int32, init=first)
            hi = T.alloc_var(T.int32, init=end)
            values = [T.alloc_var(T.int32, init=f[e]) for f in fields]
            if lo <= key and key < hi:
                found[0] = e
                found[1] = lo
                found[2] = hi - lo
                for f, v in enumerate(values):
                    found[3 + f] = v
    sync()


def dense(B, Sq, Sk, head_group=None) -> Sequences:
    """A dense batch (``head_group``: see ``Sequences.tile``)."""
    return Sequences(False, B, Sq, Sk, head_group=head_group)


def packed(cu_q, cu_k, lens_q, lens_k, max_q, max_k, stats=False, v_group=0, rows_q=None, rows_k=None,
           head_group=None) -> Sequences:
    """``cu_*`` (batch + 1,) int32 row offsets, ``lens_*`` (batch,) int32 lengths used,
    ``max_*`` int32 scalars bounding every length; ``stats``: the kernel indexes the
    backward's LSE2/Delta, where sequence b starts at ``stat_start(cu_q[b], b)``; ``v_group``:
    an FP8 forward's V^T starts sequence b at ``ceil(cu_k[b] / g) * g + g * b``
    (``operands.v_offsets``); ``rows_*``: the packed tensors' row counts (grid extents,
    ``packed_slots``); ``head_group``: see ``Sequences.tile``."""
    return Sequences(True, lens_q.shape[0], max_q, max_k, cu_q, cu_k, lens_q, lens_k, stats, v_group, rows_q, rows_k,
                     head_group)


def packed_rows(cu, lens, max_len, rows=None, **kwargs) -> Sequences:
    """``packed`` for a kernel that indexes one side only (the backward's preprocess: queries;
    the FP8 V^T pass: keys): both sides are that one."""
    return packed(cu, cu, lens, lens, max_len, max_len, rows_q=rows, rows_k=rows, **kwargs)


# Packed tiles of this many columns stage whole-tile stores through shared memory: TileLang
# 0.1.15 cannot place the staging sync for a 48-column forward tile ("[ThreadSync] Cannot lower
# a required shared-memory sync inside a divergent region with 66 participating threads").
STAGED_COLS = 64


def whole_tile(seq, r0, rows, cols, keys=False):
    """Whether a tile's rows [r0, r0 + rows) (query rows, or key rows with ``keys``) may be
    stored as one staged TMA tile: True for a dense tile (a tensor's edge clips the store);
    for a packed one False when a width in ``cols`` (ints) is not a multiple of ``STAGED_COLS``,
    else the runtime test that every row belongs to the sequence (the rows past its end are the
    next sequence's).  A Python bool decides at trace time inside a macro's ``if``."""
    if not seq.varlen:
        return True
    if any(c % STAGED_COLS for c in cols):
        return False
    return r0 + rows <= (seq.len_k if keys else seq.len_q)


@T.macro
def store_q_tile(seq, acc, stage, X, m0, rows, h, cols, stat=None, Stat=None):
    """Accumulator fragment ``acc`` (rows x cols, fp32) -> query rows [m0, m0 + rows) of head
    ``h`` of ``X`` (O, dQ) in ``X``'s dtype, and with ``stat`` (a per-row fragment) its entries
    [m0, m0 + rows) of head ``h`` of ``Stat`` (LSE).  A ``whole_tile``: through the shared tile
    ``stage`` and one T.copy (a TMA store); the caller orders ``stage`` against its other uses.
    Other packed tiles: ``store_q_tail``."""
    whole = whole_tile(seq, m0, rows, (cols,))
    if whole:
        _staged_store(acc, stage, seq.q_rows(X, m0, rows, h))
        if stat is not None:
            if seq.varlen:  # the loop shape of store_q_tail's (see there)
                for i, j in T.Parallel(rows, cols):
                    if j == 0:
                        Stat[seq.b, h, seq.q0 + m0 + i] = stat[i]
            else:
                T.copy(stat, seq.stat(Stat, h, m0, rows))
    else:
        store_q_tail(seq, acc, X, m0, rows, h, cols, stat, Stat)


@T.macro
def store_q_tail(seq, acc, X, m0, rows, h, cols, stat=None, Stat=None):
    """``store_q_tile`` for a packed tile that may run past its sequence's end: straight from
    registers, each row guarded (the rows past the end belong to the next sequence); the per-row
    statistic in the same loop (by the thread holding column 0: a separate 1-D loop over the
    statistic's fragment sends TileLang 0.1.15's layout inference into a loop that does not
    end)."""
    for i, j in T.Parallel(rows, cols):
        if m0 + i < seq.len_q:
            X[seq.b, seq.q0 + m0 + i, h, j] = T.cast(acc[i, j], X.dtype)
            if stat is not None:
                if j == 0:
                    Stat[seq.b, h, seq.q0 + m0 + i] = stat[i]


@T.macro
def store_k_tile(seq, acc, stage, X, n0, rows, hk, cols):
    """As ``store_q_tile`` for key rows [n0, n0 + rows) of head ``hk`` (dK, dV)."""
    whole = whole_tile(seq, n0, rows, (cols,), keys=True)
    if whole:
        _staged_store(acc, stage, seq.k_rows(X, n0, rows, hk))
    else:
        store_k_tail(seq, acc, X, n0, rows, hk, cols)


@T.macro
def store_k_tail(seq, acc, X, n0, rows, hk, cols, c0=0):
    """``store_k_tile``'s path for a packed tile that may run past its sequence's end: from
    registers, each row guarded (for kernels that stage whole tiles themselves).  ``c0``: the
    first head-dim column ``acc`` holds (``bwd_wide``'s column halves)."""
    for i, j in T.Parallel(rows, cols):
        if n0 + i < seq.len_k:
            X[seq.b, seq.k0 + n0 + i, hk, c0 + j] = T.cast(acc[i, j], X.dtype)


@T.macro
def _staged_store(acc, stage, region):
    """``acc`` -> ``region`` through the shared tile ``stage`` (a TMA store)."""
    T.copy(acc, stage)
    T.copy(stage, region)
