"""Where a packed (varlen) batch's per-row backward statistics sit: the layout the host
allocates (``launch.launch_backward``) and the kernels index (``seqinfo``, the preprocess and
main backward kernels), in one module without TileLang, so that a packed batch's launch, like a
dense one's, runs in a process that loads its kernels by id and never imports TileLang
(``kernels/cache.py``)."""

from __future__ import annotations

# Every packed sequence's statistics are followed by at least this many padding entries
# (Delta = 0, LSE2 = +inf): a backward step's query block (at most STAT_PAD rows) that runs past
# its sequence's end reads them, and its extra rows get P = exp2(s - inf) = 0 without a mask.
STAT_PAD = 128


def stat_start(q0, b):
    """Entry where packed sequence ``b`` (first query row ``q0``) starts in the backward's
    per-row statistics (LSE2, Delta): the first multiple of 4 at or past q0, plus
    ``(STAT_PAD + 4) * b``.  TMA loads them with the row innermost, whose start must be 16-byte
    aligned; the gaps (at least STAT_PAD entries past each sequence's rows, 4 more make up the
    rounding) hold Delta = 0 and LSE2 = +inf (``launch.launch_backward`` fills them), so the
    rows a query block reads past its sequence's end, the next sequence's queries, add nothing
    to this sequence's dK/dV.  Ints, torch tensors or TileLang expressions: the preprocess
    kernel writes and the main kernels read through this one formula."""
    return (q0 + 3) // 4 * 4 + (STAT_PAD + 4) * b


def stat_rows(total_q: int, batch: int) -> int:
    """Length of a packed batch's statistics rows: past the last ``stat_start``, its rows and
    their padding, rounded to 4 (host ints)."""
    return (total_q + (STAT_PAD + 4) * (batch + 1) + 3) // 4 * 4
