"""The FP8-cache decode's consumer step on warp-level ``mma.sync``, no widened tiles (Hopper).

``decode_ws``'s consumer warpgroups otherwise widen each raw FP8 key block into an fp16 tile in
shared memory and run 64-row WGMMAs over it, although a GQA decode tile holds only
``group x Sq`` real query rows (4 at 32 / 8 heads).  That step, not HBM, set the FP8 cache's
pace (H100 88% of the bandwidth, H200 65%: NOTES, seventeenth session).  Here each warp of a
consumer warpgroup takes 16 keys of the block and works from registers:

- the tile's first 16 query rows live in registers as ``m16n8k16`` A fragments (fp16),
  loaded once per part, so at most 16 rows (``MAX_ROWS``; the launcher sends larger groups to
  the widening consumers);
- S = Q K^T as 2 x ``dim / 16`` mma.sync: the warp's 16 K rows are the B operand (key ``g`` of
  n-tile j is row ``8 j + g``), read straight from the raw stage and widened in registers
  (``cvt`` e4m3x2 -> half2, exact).  The k-dimension is permuted: lane ``t`` of a quad owns
  features ``t dim/4 .. t dim/4 + dim/4 - 1``, chunk ``kc`` taking four of them, so a lane's
  K bytes are contiguous (16-byte loads) and Q's A fragments use the same order;
- the online softmax of its 16 keys on the C fragment (rows ``g``, ``g + 8``; row maxima
  over the quad's lanes, sums kept per lane and reduced once per part);
- O += P V as ``dim_v / 8`` mma.sync: P's A fragments are S's C fragments, cast (FA2's
  register reuse); V's B fragments need two keys' bytes of one feature per 16-bit half, so V
  comes through ``ldmatrix.trans`` (8 x 8 two-byte elements: lane ``(g, t)`` gets keys
  ``2t, 2t + 1`` at features ``2g, 2g + 1`` of a 16-byte column) and one ``byte_perm`` per
  register pairs the bytes by feature before the cvt (FA3's FP8 V transpose, here in
  registers); column n of the output's n-tile fn is then feature ``out_feature(fn, n)``,
  put back in order when the warps merge;
- the raw stages carry a 128-byte swizzle (TMA's, and the by-row copies' through TileLang's
  layout), so the 16-byte loads and ldmatrix rows of 8 keys at one column fall on different
  banks (by the swizzle's construction; not profiled).

Each warp keeps its own running max, sums and output; at the end of a part the four warps
merge through shared memory (``merge_store``) into the consumer's fp32 partial, as the
widening consumers write it.  Per 64-key block a warp issues 32 ``HMMA.16816`` and no
shared-memory stores, where a widening warpgroup ran twelve 64-row WGMMAs (16 times the 4
useful rows at GQA 4) over tiles it had stored itself.
"""

import math

import tilelang.language as T

from .decode import BLOCK_M, WARP_MMA_BLOCK_N, WARP_MMA_ROWS as MAX_ROWS
from .masks import block_fully_visible, visible
from .softmax import LOG2E, natural_lse, rescale_factor, scaled_max

assert MAX_ROWS == 16  # query rows of a tile the warp fragments hold: one m16 tile
WARPS = 4  # warps of a consumer warpgroup, each taking a quarter of every key block
SLICE = 16  # keys per warp per block: BLOCK_N = WARPS x SLICE
BLOCK_N = WARPS * SLICE
assert BLOCK_N == WARP_MMA_BLOCK_N  # the launcher's block for ``decode.own_workers_pay`` (it cannot import this module)
HALF = "float16"
CVT = "flashtile_e4m3x2_to_half2"  # ``CVT_SOURCE``: two e4m3 bytes (low half of a word) -> half2, exact
CVT_SOURCE = r"""
__device__ __forceinline__ unsigned flashtile_e4m3x2_to_half2(unsigned w) {
  unsigned h;
  unsigned short lo = (unsigned short)(w & 0xffffu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(lo));
  return h;
}
"""


def unrolled(n: int) -> list:
    """Indices of a loop unrolled in Python (compile-time register indices; TileLang turns
    ``range`` into a TIR loop)."""
    return list(range(n))


def supports(dim: int, dim_v: int) -> bool:
    """Head dims the warp fragments take: 16-byte K pieces per lane (``dim / 4`` a multiple
    of 16) and at most 128 (registers: O alone is ``dim_v / 2`` per lane)."""
    return dim in (64, 128) and dim_v in (64, 128)


def merge_shapes(dim_v: int, consumers: int) -> tuple:
    """Shapes of the merge buffers (fp32): each warp's O fragments (n-tile, lane x 4), and its
    running max and sum per row."""
    return [consumers, WARPS, dim_v // 8, 128], [consumers, WARPS, 2, MAX_ROWS]


def merge_bytes(dim_v: int, consumers: int) -> int:
    """Shared memory of the merge buffers (``merge_shapes``)."""
    return sum(4 * math.prod(shape) for shape in merge_shapes(dim_v, consumers))


def mma(a, a_off, b, b_off, c, c_off, ab: str = "fp16"):
    """``c[c_off:+4] += A (16 x 16) B (16 x 8)``, ``ab`` (fp16 or bf16) operands, fp32
    accumulation."""
    return T.ptx_mma(T.float32, "m16n8k16", "row", "col", ab, ab, "fp32", a.data, a_off, b.data, b_off,
                     c.data, c_off, T.bool(False))


# --- The fragment layouts, as index maps (Python ints, or TIR expressions built in the same
# order as before they were factored out: the kernels' TIR is unchanged).  PTX m16n8k16 fp16:
# lane (g, t) = (lane // 4, lane % 4) holds A halves 0-1 (row g, k 2t, 2t+1), 2-3 (row g+8),
# 4-7 the same at k + 8; B halves 0-1 (k 2t, 2t+1; n g), 2-3 (k + 8); C 0-1 (row g, n 2t,
# 2t+1), 2-3 (row g+8).  tests/test_warp_mma_layout.py simulates one warp with these maps.


def q_slot(kc: int, e: int, hr: int) -> int:
    """Index in the A fragments ``qa`` of query row g + 8 hr, feature ``t dim/4 + 4 kc + e``
    (e < 4): k-chunk kc's logical k ``2t + e % 2 + 8 (e // 2)``, the same order as K's bytes."""
    return kc * 8 + e // 2 * 4 + hr * 2 + e % 2


def k_offset(j: int, kc: int, qw: int) -> int:
    """Offset in ``kb`` of n-tile j's (keys 8 j + g) B fragment of k-chunk kc: its 4 halves are
    features ``t qw + 4 kc .. + 3`` (lane t's bytes ``t qw .. t qw + qw - 1`` of each K row)."""
    return j * qw + kc * 4


def v_reg(h: int, c: int) -> int:
    """Index in ``vraw`` of ldmatrix.trans register (h, c) (keys 8 h + 2t, + 1 of the slice at
    16-byte column c: features 16 c + 2 g, + 1 of an FP8 cache, feature 8 c + g of a 16-bit
    one): call c // 2, matrix 2 (c % 2) + h."""
    return c // 2 * 4 + c % 2 * 2 + h


def vb_slot(fn: int, h: int) -> int:
    """Index in ``vb`` of P V's n-tile fn B register h (keys 8 h + 2t, + 1; feature
    ``out_feature(fn, g)``)."""
    return fn * 2 + h


def out_feature(fn: int, n: int, narrow: bool = True) -> int:
    """V feature (and output column) of column n of P V's n-tile fn: an FP8 cache's
    (``narrow``) byte-permuted order, or a 16-bit cache's plain one (n-tile fn = ldmatrix column
    fn, features 8 fn .. 8 fn + 7)."""
    return 16 * (fn // 2) + 2 * n + fn % 2 if narrow else 8 * fn + n


def merge_runs(fpt: int, narrow: bool = True) -> tuple:
    """(runs, columns per run) of contiguous output columns that ``merge_store`` writes per
    row from a thread's ``fpt`` n-tiles: FP8 pairs n-tiles 2h, 2h + 1 into 4 features, a 16-bit
    n-tile's positions 2t, 2t + 1 are 2."""
    return (fpt // 2, 4) if narrow else (fpt, 2)


def merge_source(h: int, y: int, hr: int, narrow: bool = True) -> tuple:
    """(n-tile offset j, C position e) that ``merge_store`` reads for the y-th column of its
    h-th run (``merge_runs``), row g + 8 hr."""
    return (2 * h + y % 2, 2 * hr + y // 2) if narrow else (h, 2 * hr + y)


def merge_column(fpt: int, w, h: int, t, y: int, narrow: bool = True):
    """Output column of ``merge_source(h, y, hr)`` for thread (warp w, lane t of its quad):
    ``out_feature(fpt w + j, 2 t + e % 2)``."""
    if narrow:
        return 16 * (fpt * w // 2 + h) + 4 * t + y
    return 8 * (fpt * w + h) + 2 * t + y


def warp_mma_macros(dim: int, dim_v: int, dtype: str, has_softcap: bool, consumers: int, direct: bool = False,
                    has_sinks: bool = False, cache_dtype: str = "float8_e4m3fn"):
    """(state, load_queries, step, merge_store) macros of one consumer thread.

    ``state()`` allocates the thread's registers and the merge buffer; ``load_queries`` fills
    Q's fragments for a part and resets the running statistics; ``step`` runs one key block
    from raw stage ``st`` (releasing the stage once its bytes are in registers);
    ``merge_store`` merges the consumer's four warps and writes its partial, or with
    ``direct`` (each consumer its own worker: ``decode_ws``'s ``own_workers``) O and lse
    themselves when the part is its whole segment (``tile.whole``; the sink folded in here).

    ``cache_dtype`` q's 16-bit dtype instead of FP8 (``decode.ws16_pays``: 16-bit long streams
    and many-segment calls, since the twentieth session): the operands stay in that dtype (bf16
    or fp16 mma.sync), K's bytes are the B fragments as loaded, and V's ldmatrix.trans registers
    are P V's B fragments as they are (no byte_perm, no cvt), in the plain feature order."""
    acc = T.float32
    narrow = "float8" in cache_dtype  # an FP8 cache, widened to fp16 in registers
    op = HALF if narrow else dtype  # the mma.sync operands' type
    ab = "fp16" if op == "float16" else "bf16"
    vcols = dim_v // 16 if narrow else dim_v // 8  # 16-byte columns of a V row
    col_elems = 16 if narrow else 8  # elements of a 16-byte column
    neg_inf = -T.infinity(acc)
    kc_n = dim // 16  # k-chunks of Q K^T
    qw = dim // 4  # Q/K features per lane (contiguous; chunk kc takes 4 of them)
    fn_n = dim_v // 8  # n-tiles of P V

    class State:
        """One consumer thread's registers (``T.alloc_local``) and its warpgroup's merge buffer."""

        def __init__(self):
            self.qa = T.alloc_local([kc_n * 8], op)  # Q A fragments, 8 halves per k-chunk
            self.o = T.alloc_local([fn_n * 4], acc)  # O C fragments (rows g, g + 8)
            self.m = T.alloc_local([2], acc)  # running max, rows g and g + 8 (raw scores)
            self.l = T.alloc_local([2], acc)  # this lane's share of the running sums
            self.tok = T.alloc_local([2], T.int32)  # query token of rows g and g + 8
            self.s = T.alloc_local([8], acc)  # S C fragments of the slice's two n-tiles
            self.kraw = T.alloc_local([2 * qw], cache_dtype)
            if narrow:  # widened K, and V's B fragments after the byte_perm and cvt
                self.kb = T.alloc_local([2 * qw], HALF)
            self.vraw = T.alloc_local([2 * vcols], T.uint32)  # ldmatrix.trans: reg (h, c), ``v_reg``
            if narrow:
                self.vb = T.alloc_local([fn_n * 2], T.uint32)  # V B fragments, two half2 per n-tile
            self.pa = T.alloc_local([8], op)
            self.alpha = T.alloc_local([2], acc)
            self.msafe = T.alloc_local([2], acc)
            self.mx = T.alloc_local([2], acc)
            # Merge buffer: per consumer, per warp, its O fragments (fp32), then m and l per row.
            mo_shape, ml_shape = merge_shapes(dim_v, consumers)
            self.mo = T.alloc_shared(mo_shape, acc)  # O fragments: n-tile, lane x 4
            self.ml = T.alloc_shared(ml_shape, acc)

    def lane(ct):
        """(warp, g, t) of consumer thread ``ct`` (0 .. 127) as registers."""
        w = T.alloc_var(T.int32, init=ct // 32)
        g = T.alloc_var(T.int32, init=ct % 32 // 4)
        t = T.alloc_var(T.int32, init=ct % 4)
        return w, g, t

    @T.macro
    def load_queries(Q, st_, tile, ct, H, Sq):
        """Rows g and g + 8 of the tile (``tile.r0 + row`` among the kv head's rows; past the
        real rows: 0) into Q's A fragments in the permuted feature order; statistics reset."""
        _, g, t = lane(ct)
        qraw = T.alloc_local([qw], dtype)
        for hr in unrolled(2):
            j = T.alloc_var(T.int32, init=tile.r0 + g + 8 * hr)
            st_.tok[hr] = j // tile.group
            if j < tile.rows:
                qrow = T.alloc_var(T.int32, init=(tile.b * Sq + j // tile.group) * H + tile.hk * tile.group
                                   + j % tile.group)
                for v in unrolled(qw // 8):
                    for e in T.vectorized(8):
                        qraw[v * 8 + e] = Q[qrow, t * qw + v * 8 + e]
            else:
                for e in unrolled(qw):
                    qraw[e] = T.cast(0, dtype)
            for kc in unrolled(kc_n):
                for e in unrolled(4):
                    st_.qa[q_slot(kc, e, hr)] = T.cast(qraw[kc * 4 + e], op)
            st_.m[hr] = neg_inf
            st_.l[hr] = 0.0
        for e in unrolled(fn_n * 4):
            st_.o[e] = 0.0

    @T.macro
    def step(st_, k_ring, v_ring, empty, tile, st, kb, ct, two_halves):
        """Key block ``kb`` (raw stage ``st``, full): this warp's 16 keys."""
        w, g, t = lane(ct)
        n0 = T.alloc_var(T.int32, init=kb * BLOCK_N)
        key0 = T.alloc_var(T.int32, init=n0 + w * SLICE)  # the slice's first key
        for j in unrolled(2):
            for v in unrolled(qw // 16):
                for e in T.vectorized(16):
                    st_.kraw[j * qw + v * 16 + e] = k_ring[st, w * SLICE + 8 * j + g, t * qw + v * 16 + e]
        # V: ldmatrix.trans of 8 x 8 two-byte elements; matrix (h, c) is keys 8 h .. 8 h + 7
        # of the slice at bytes 16 c .. 16 c + 15 (lanes 8 m .. 8 m + 7 give matrix m's rows).
        lm = T.alloc_var(T.int32, init=ct % 32 // 8)
        for q in unrolled(vcols // 2):
            T.ptx_ldmatrix(T.bool(True), 4,
                           T.access_ptr(v_ring[st, w * SLICE + 8 * (lm % 2) + ct % 8, (2 * q + lm // 2) * col_elems],
                                        "r", extent=col_elems),
                           T.access_ptr(st_.vraw[4 * q], "w", extent=4))
        T.barrier_arrive(empty[st])  # the bytes are in registers: the producer may refill
        # A boundary block: rows outside the entry's keys may hold stale or NaN bytes (TMA
        # reads whole blocks); their scores are masked below, their V bytes zeroed here
        # (0 x NaN would reach O).  Register (h, c) holds key 8 h + 2 t in its low half and
        # 8 h + 2 t + 1 in its high half.
        if T.Not(tile.holds(n0, BLOCK_N)):
            for h in unrolled(2):
                keep = T.alloc_var(T.uint32,
                                   init=T.if_then_else(tile.holds(key0 + 8 * h + 2 * t), T.uint32(0xFFFF), T.uint32(0))
                                   | T.if_then_else(tile.holds(key0 + 8 * h + 2 * t + 1), T.uint32(0xFFFF0000),
                                                    T.uint32(0)))
                for c in unrolled(vcols):
                    st_.vraw[v_reg(h, c)] = st_.vraw[v_reg(h, c)] & keep
        if narrow:
            for e in T.vectorized(2 * qw):
                st_.kb[e] = T.cast(st_.kraw[e], HALF)
        for e in unrolled(8):
            st_.s[e] = 0.0
        for j in unrolled(2):
            for kc in unrolled(kc_n):
                if narrow:
                    mma(st_.qa, kc * 8, st_.kb, k_offset(j, kc, qw), st_.s, j * 4)
                else:  # a 16-bit cache: K's elements are the B fragments as loaded
                    mma(st_.qa, kc * 8, st_.kraw, k_offset(j, kc, qw), st_.s, j * 4, ab)
        # V's B fragments for n-tile fn = 2 c + e (feature 16 c + 2 g + e): keys (2t, 2t + 1)
        # from register (0, c), (2t + 8, 2t + 9) from (1, c); byte_perm 0x3120 puts the two
        # keys' bytes of each feature side by side, the cvt's pair.  (A 16-bit cache's
        # registers are the B fragments: n-tile fn is register pair (0, fn), (1, fn).)
        if narrow:
            for h in unrolled(2):
                for c in unrolled(dim_v // 16):
                    pair = T.alloc_var(T.uint32, init=T.call_extern(T.uint32, "__byte_perm", st_.vraw[v_reg(h, c)],
                                                                    T.uint32(0), T.uint32(0x3120)))
                    st_.vb[vb_slot(2 * c, h)] = T.call_extern(T.uint32, CVT, pair)
                    st_.vb[vb_slot(2 * c + 1, h)] = T.call_extern(T.uint32, CVT, pair >> T.uint32(16))
        # Online softmax (softmax.online_softmax's arithmetic, per lane).
        if has_softcap:
            for e in unrolled(8):
                st_.s[e] = T.tanh(st_.s[e] * tile.cap)
        if not block_fully_visible(tile.t_last, n0, n0 + BLOCK_N - 1, tile.t_first, tile.mask):
            for e in unrolled(8):  # s[4 j + 2 hr + x]: row g + 8 hr, key 8 j + 2 t + x
                st_.s[e] = T.if_then_else(visible(st_.tok[e % 4 // 2], key0 + 8 * (e // 4) + 2 * t + e % 2, tile.mask),
                                          st_.s[e], neg_inf)
        for hr in unrolled(2):
            st_.mx[hr] = T.max(T.max(st_.s[2 * hr], st_.s[2 * hr + 1]), T.max(st_.s[4 + 2 * hr], st_.s[5 + 2 * hr]))
            st_.mx[hr] = T.max(st_.mx[hr], T.shfl_xor(st_.mx[hr], 1))
            st_.mx[hr] = T.max(st_.mx[hr], T.shfl_xor(st_.mx[hr], 2))
            st_.mx[hr] = T.max(st_.mx[hr], st_.m[hr])
            st_.msafe[hr] = scaled_max(st_.mx[hr], tile.sc)
            st_.alpha[hr] = rescale_factor(st_.m[hr], st_.mx[hr], st_.msafe[hr], tile.sc)
            st_.m[hr] = st_.mx[hr]
        if two_halves == 0:  # rows g + 8 are all padding: zero weight, no rescale
            st_.alpha[1] = 1.0
        for e in unrolled(8):
            if e % 4 < 2 or two_halves != 0:
                st_.s[e] = T.exp2(st_.s[e] * tile.sc - st_.msafe[e % 4 // 2])
            else:
                st_.s[e] = 0.0
        for hr in unrolled(2):
            st_.l[hr] = st_.l[hr] * st_.alpha[hr] + (st_.s[2 * hr] + st_.s[2 * hr + 1] + st_.s[4 + 2 * hr]
                                                     + st_.s[5 + 2 * hr])
        # O *= alpha only in warps where some row's max moved (alpha is exactly 1 otherwise:
        # the result is bitwise the same; ``fwd_ws.rescaler``).
        moved = T.alloc_var(T.int32, init=T.Cast(T.int32, st_.alpha[0] != 1.0) | T.Cast(T.int32, st_.alpha[1] != 1.0))
        if T.call_extern(T.int32, "__any_sync", T.uint32(0xFFFFFFFF), moved) != 0:
            for e in unrolled(fn_n * 4):
                st_.o[e] = st_.o[e] * st_.alpha[e % 4 // 2]
        for e in T.vectorized(8):
            st_.pa[e] = T.cast(st_.s[e], op)
        for fn in unrolled(fn_n):
            if narrow:
                mma(st_.pa, 0, st_.vb, vb_slot(fn, 0), st_.o, fn * 4)
            else:
                mma(st_.pa, 0, st_.vraw, v_reg(0, fn), st_.o, fn * 4, ab)

    fpt = fn_n // WARPS  # n-tiles of O each thread merges (``merge_store``)
    runs, run = merge_runs(fpt, narrow)  # ... as runs of contiguous output columns

    def merged(part, f, scale, h, y, hr):
        """``merge_store``'s output value at ``merge_source(h, y, hr)``: the four warps' values
        (``part``) by their weights ``f``, scaled."""
        j, e = merge_source(h, y, hr, narrow)
        return (part[(0 * fpt + j) * 4 + e] * f[hr * WARPS + 0]
                + part[(1 * fpt + j) * 4 + e] * f[hr * WARPS + 1]
                + part[(2 * fpt + j) * 4 + e] * f[hr * WARPS + 2]
                + part[(3 * fpt + j) * 4 + e] * f[hr * WARPS + 3]) * scale[hr]

    def slot_row(wg, g, hr):
        """``SplitTile.partial_row``'s argument for row g + 8 hr of consumer ``wg``: its own
        slot ``slot + wg`` of the CTA's part, or (``direct``: the consumer a worker of its own,
        whose part has a slot of its own) the tile's slot."""
        return g + 8 * hr if direct else wg * BLOCK_M + g + 8 * hr

    def partial_wanted(tile):
        """Whether ``merge_store`` writes the part's partial: always, or with ``direct`` when
        the part is not its whole segment (a TIR condition; a Python bool is a static branch)."""
        return tile.whole == 0 if direct else True

    @T.macro
    def merge_store(st_, Opart, LSEpart, tile, wg, ct, out_scale, bar, O=None, LSE=None, Sinks=None):
        """The four warps' (m, l, O) of the part merged into consumer ``wg``'s partial
        (``softmax.finish`` without sink: O normalised and scaled by ``out_scale``, lse in
        natural log, 0 / -inf for a row that saw no key), real rows only.  ``bar`` is the
        warpgroup's named barrier: once before writing (the previous part's readers are done),
        once before reading.

        In fragment order: each warp stores its O fragments as they sit in its lanes (16-byte
        stores, consecutive lanes on consecutive banks); thread ``ct`` then
        merges the four warps' values at lane ``ct % 32``'s positions of n-tiles ``fpt w ..
        fpt w + fpt - 1`` (the same place in every warp: the same rows g, g + 8 and columns)
        and stores them as runs of 4 columns (column n = 2 t + x of n-tile fn is feature
        16 (fn // 2) + 2 n + fn % 2, so n-tiles 2h, 2h + 1 and x = 0, 1 make features
        16 h + 4 t .. + 3).  (Merged by output rows and columns instead,
        16 rows x ``dim_v`` per warp, the stores and loads hit 8 and 16 lanes per bank: B=1 8k
        with 4 query tokens took 19.3 us against 13.7; NOTES, eighteenth session.)"""
        w, g, t = lane(ct)
        ln = T.alloc_var(T.int32, init=ct % 32)
        for hr in unrolled(2):
            st_.l[hr] = st_.l[hr] + T.shfl_xor(st_.l[hr], 1)
            st_.l[hr] = st_.l[hr] + T.shfl_xor(st_.l[hr], 2)
        T.sync_threads(bar, 128)
        for fn in unrolled(fn_n):
            for e in T.vectorized(4):
                st_.mo[wg, w, fn, ln * 4 + e] = st_.o[fn * 4 + e]
        if t == 0:
            for hr in unrolled(2):
                st_.ml[wg, w, 0, g + 8 * hr] = st_.m[hr]
                st_.ml[wg, w, 1, g + 8 * hr] = st_.l[hr]
        T.sync_threads(bar, 128)
        f = T.alloc_local([2 * WARPS], acc)  # f[hr WARPS + x]: warp x's weight for row g + 8 hr
        scale = T.alloc_local([2], acc)
        total = T.alloc_local([2], acc)
        top_safe = T.alloc_local([2], acc)
        for hr in unrolled(2):
            r = g + 8 * hr
            top = T.alloc_var(acc, init=T.max(T.max(st_.ml[wg, 0, 0, r], st_.ml[wg, 1, 0, r]),
                                              T.max(st_.ml[wg, 2, 0, r], st_.ml[wg, 3, 0, r])))
            top_safe[hr] = scaled_max(top, tile.sc)
            total[hr] = 0.0
            for x in unrolled(WARPS):
                f[hr * WARPS + x] = T.exp2(st_.ml[wg, x, 0, r] * tile.sc - top_safe[hr])
                total[hr] += f[hr * WARPS + x] * st_.ml[wg, x, 1, r]
            if direct and has_sinks:
                if tile.whole == 1:  # the row's sink joins its weights (else the combine adds it)
                    sink2 = T.alloc_var(acc, init=Sinks[tile.hk * tile.group + (tile.r0 + r) % tile.group] * LOG2E)
                    # finite: top_safe is never -inf (``scaled_max`` gives 0 to a row with no key)
                    ref = T.alloc_var(acc, init=T.max(top_safe[hr], sink2))
                    shift = T.alloc_var(acc, init=T.exp2(top_safe[hr] - ref))
                    for x in unrolled(WARPS):
                        f[hr * WARPS + x] = f[hr * WARPS + x] * shift
                    total[hr] = total[hr] * shift + T.exp2(sink2 - ref)
                    top_safe[hr] = ref
            scale[hr] = T.if_then_else(total[hr] > 0, out_scale / total[hr], 0.0)
        part = T.alloc_local([WARPS * fpt * 4], acc)  # warp x's values, n-tile fpt w + j, position e
        for x in unrolled(WARPS):
            for j in unrolled(fpt):
                for e in T.vectorized(4):
                    part[(x * fpt + j) * 4 + e] = st_.mo[wg, x, fpt * w + j, ln * 4 + e]

        for hr in unrolled(2):
            if tile.r0 + g + 8 * hr < tile.rows:
                if direct:
                    if tile.whole == 1:
                        orow = T.alloc_var(T.int32, init=tile.out_row(g + 8 * hr))
                        for h in unrolled(runs):
                            for y in unrolled(run):
                                O[orow, merge_column(fpt, w, h, t, y, narrow)] = T.cast(merged(part, f, scale, h, y, hr),
                                                                                        dtype)
                        if w == 0 and t == 0:
                            LSE[tile.lse_row(g + 8 * hr)] = natural_lse(total[hr], top_safe[hr])
                if partial_wanted(tile):
                    prow = T.alloc_var(T.int32, init=tile.partial_row(slot_row(wg, g, hr)))
                    for h in unrolled(runs):
                        for y in unrolled(run):
                            Opart[prow, merge_column(fpt, w, h, t, y, narrow)] = merged(part, f, scale, h, y, hr)
                    if w == 0 and t == 0:
                        LSEpart[prow] = natural_lse(total[hr], top_safe[hr])

    return State, load_queries, step, merge_store
