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
  chunk of ``ROW_CHUNK_BLOCKS`` key blocks at a time (into ``row_s``), and the caches are flat
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

import tilelang
import tilelang.language as T

from .masks import TileMask, host_window
from .seqinfo import Sequence
from .softmax import LOG2E, online_softmax
from .target import PASS_CONFIGS, TARGET

DECODE_PASS_CONFIGS = PASS_CONFIGS
FULL_ROW = T.GemmWarpPolicy.FullRow
BLOCK_M = 64  # query rows (group heads x tokens) per CTA: one warpgroup's WGMMA M


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
    cache_dtype: str | None = None,
):
    """Build the split-KV decode PrimFunc (``num_stages``: 2, the row lookup and copy one step
    ahead of the compute; kept as a parameter for the cache key and the tile sweeps).

    ``cache_dtype``: None (the cache is in ``dtype``) or ``"float8_e4m3fn"``, an FP8 cache read
    as FP8 (half the bytes: the whole point, decode being bandwidth-bound) and widened in shared
    memory to ``dtype`` for the bf16/fp16 WGMMAs (every e4m3 value is exact in bf16 and fp16);
    the per-(entry, kv head) descales fold into the score scale (K) and the output (V).

    Kernel arguments: Q (RQ, dim), the (B, Sq, H, dim) queries as rows ``(b * Sq + t) * H + h``
    (RQ = B x Sq x H); K (NR, Hkv, dim) and V (NR, Hkv, dim_v) the cache as rows (NR = pages x
    page_size); BlockTable (B, MB) int32 page of each logical block; SeqlensK (B,) int32 keys of
    each entry *after* the append; Leftpad (B,) int32 first visible key; O (RQ, dim_v) rows like
    Q and LSE (RQ,) fp32, the (B, H, Sq) lse flat (both written only when ``num_splits == 1``);
    Opart (P, dim_v) and LSEpart (P,) fp32 partials, row ``split * RQ + (b * Sq + t) * H + h``
    (written only when ``num_splits > 1``); Sinks (H,) fp32 (read only with sinks); scalars ``score_scale``,
    ``cap_in`` (as in ``fwd``), ``left``/``right`` window bounds, ``num_splits``,
    ``page_size`` and its log2 ``page_shift`` (-1 when not a power of two; 31 for a
    contiguous cache, whose visible keys all sit on page 0), ``Sq`` query tokens per entry.
    """
    B, H, Hkv, NR, MB, P, RQ = T.dynamic("B, H, Hkv, NR, MB, P, RQ")
    acc = T.float32
    block_m = BLOCK_M
    kv_width = max(dim, dim_v)
    fp8 = cache_dtype is not None and cache_dtype != dtype
    cdt = cache_dtype if fp8 else dtype
    vec = 16 if fp8 else 8  # cache elements per 16-byte copy
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
    update, finish = online_softmax(block_m, block_n, dim_v, has_sinks, has_softcap)
    chunk = ROW_CHUNK_BLOCKS
    if fp8:
        # The FP8 tiles' widening reads the copied stage like a copy would, and left to
        # itself the planner then emits a non-constant cp.async.wait_group that fails in
        # codegen.  A manual two-stage schedule instead: the K/V copy one step ahead (stage 0),
        # every other statement of the step in order (stage 1).  Statements: the copy, two
        # widenings, the QK GEMM, the online softmax's 7 (8 with softcap), P cast, O rescale,
        # the PV GEMM.
        n_stmts = 1 + 2 + 1 + (8 if has_softcap else 7) + 3
        pipeline_schedule = {"order": list(range(n_stmts)), "stage": [0] + [num_stages - 1] * (n_stmts - 1)}
    else:
        pipeline_schedule = {"num_stages": num_stages}
    _, finish_partial = online_softmax(block_m, block_n, dim_v, False, has_softcap)  # sinks: combine.py

    @T.prim_func
    def main(
        Q: T.Tensor([RQ, dim], dtype),
        K: T.Tensor([NR, Hkv, dim], cdt),
        V: T.Tensor([NR, Hkv, dim_v], cdt),
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
        with T.Kernel(num_splits * T.ceildiv((H // Hkv) * Sq, block_m), Hkv, B, threads=threads) as (bx, hk, b):
            group = T.alloc_var(T.int32, H // Hkv)
            rows = T.alloc_var(T.int32, group * Sq)
            q_s = T.alloc_shared([block_m, dim], dtype)
            k_s = T.alloc_shared([block_n, dim], dtype)
            v_s = T.alloc_shared([block_n, dim_v], dtype)
            # The pipelined K/V stages: the tiles themselves, or their FP8 bytes (widened into
            # k_s / v_s each step).
            k_in = T.alloc_shared([block_n, dim], cdt) if fp8 else k_s
            v_in = T.alloc_shared([block_n, dim_v], cdt) if fp8 else v_s
            row_s = T.alloc_shared([chunk * block_n], T.int32)  # cache row of each key of a chunk
            # Each tile row's query token, head, and its rows in Q/O and in the (B, H, Sq) lse:
            # divided out once here, so no copy or store below divides (TileLang widens index
            # arithmetic to 64 bits; 64-bit divisions inlined in unrolled copy/store loops made
            # the kernel 250 KB of SASS, whose instruction fetch dominated short caches: NOTES).
            tok_s = T.alloc_shared([block_m], T.int32)
            head_s = T.alloc_shared([block_m], T.int32)
            qrow_s = T.alloc_shared([block_m], T.int32)
            lrow_s = T.alloc_shared([block_m], T.int32)
            s = T.alloc_fragment([block_m, block_n], acc)
            p = T.alloc_fragment([block_m, block_n], dtype)
            o = T.alloc_fragment([block_m, dim_v], acc)
            m = T.alloc_fragment([block_m], acc)
            m_prev = T.alloc_fragment([block_m], acc)
            m_safe = T.alloc_fragment([block_m], acc)
            alpha = T.alloc_fragment([block_m], acc)
            row_sum = T.alloc_fragment([block_m], acc)
            l = T.alloc_fragment([block_m], acc)
            lse = T.alloc_fragment([block_m], acc)

            # Scalars live in registers (alloc_var): opaque to the simplifier, which otherwise
            # spends minutes proving facts about the nested min/max/div of the key range.
            split = T.alloc_var(T.int32, bx % num_splits)
            r0 = T.alloc_var(T.int32, (bx // num_splits) * block_m)
            seqlen_k = T.alloc_var(T.int32, SeqlensK[b])
            lp = T.alloc_var(T.int32, Leftpad[b])
            off = T.alloc_var(T.int32, seqlen_k - Sq)
            t_first = T.alloc_var(T.int32, r0 // group)
            t_last = T.alloc_var(T.int32, (T.min(r0 + block_m, rows) - 1) // group)
            # Keys any token of this tile can see: [k_lo, k_hi).
            k_lo = T.alloc_var(T.int32, T.max(T.max(lp, t_first + off - left), 0))
            k_hi = T.alloc_var(T.int32, T.min(seqlen_k, t_last + off + right + 1))
            kb_lo = T.alloc_var(T.int32, k_lo // block_n)
            n_blocks = T.alloc_var(T.int32, T.max(T.ceildiv(T.max(k_hi, 0), block_n) - kb_lo, 0))
            per_split = T.alloc_var(T.int32, T.ceildiv(n_blocks, num_splits))
            kb_first = T.alloc_var(T.int32, kb_lo + split * per_split)
            my_blocks = T.alloc_var(T.int32, T.max(T.min(per_split, n_blocks - split * per_split), 0))
            # The entry as masks.py sees it: Sq query tokens, keys [lp, seqlen_k).
            mask = TileMask(Sequence(False, b, Sq, seqlen_k, key_lo=lp, off=off), left, right)
            tile_rows = GroupRows(tok_s, head_s)
            # An FP8 cache's K descale scales every score: folded into the scale the softmax
            # applies (into the softcap's input scale with softcap).  Its V descale scales the
            # output, applied before the epilogue.
            kd = T.alloc_var(acc, KDescale[b, hk] if fp8 else 1.0)
            sc = T.alloc_var(acc, score_scale * kd if (fp8 and not has_softcap) else score_scale)
            cap = T.alloc_var(acc, cap_in * kd if fp8 else cap_in)

            for i in T.Parallel(block_m):
                tok_s[i] = (r0 + i) // group
                head_s[i] = hk * group + (r0 + i) % group
            for i in T.Parallel(block_m):
                # Rows past the tile's real rows point at row 0; they are never stored.
                qrow_s[i] = T.if_then_else(r0 + i < rows, (b * Sq + tok_s[i]) * H + head_s[i], 0)
                lrow_s[i] = T.if_then_else(r0 + i < rows, (b * H + head_s[i]) * Sq + tok_s[i], 0)
            for i, c in T.Parallel(block_m, dim):
                q_s[i, c] = T.if_then_else(r0 + i < rows, Q[qrow_s[i], c], T.cast(0, dtype))
            T.clear(o)
            T.clear(l)
            T.fill(m, neg_inf)

            # Key blocks in chunks: the cache rows of a chunk's keys are looked up first (all
            # threads, into row_s), then the chunk's blocks stream through the pipeline.  Inside
            # the pipelined loop the lookup would be planned into the compute stage (it is not
            # a plain copy), after the copy that reads it.
            tx = T.get_thread_binding(0)
            # The key and its page as registers (alloc_var), so each is computed once; as plain
            # expressions TileLang inlines them into every use (5 copies, 2 of them in 64 bits).
            j = T.alloc_var(T.int32)
            pg = T.alloc_var(T.int32)
            for ch in T.serial(T.ceildiv(my_blocks, chunk)):
                # A per-thread loop, not T.Parallel: unrolled, the lookup with both page branches
                # was a large share of the kernel's code.
                for it in T.serial(chunk * block_n // threads):
                    # Only the rows of this CTA's blocks (a split may hold a few blocks only).
                    if it * threads + tx < (my_blocks - ch * chunk) * block_n:
                        j = T.min(T.max((kb_first + ch * chunk) * block_n + it * threads + tx, lp), seqlen_k - 1)  # a key of this entry, see above
                        # A power-of-two page size (page_shift >= 0) takes a shift, not a division.
                        pg = T.if_then_else(page_shift >= 0, T.shift_right(j, page_shift), j // page_size)
                        row_s[it * threads + tx] = BlockTable[b, pg] * page_size + (j - pg * page_size)
                for it in T.Pipelined(T.min(chunk, my_blocks - ch * chunk), **pipeline_schedule):
                    n0 = (kb_first + ch * chunk + it) * block_n
                    # K and V rows in one loop: one cp.async group per step (two groups trip a
                    # TileLang 0.1.15 bug in the pipeline epilogue: a non-constant wait_group).
                    for i, c in T.Parallel(block_n, kv_width, loop_layout=kv_layout):
                        row = row_s[it * block_n + i]
                        if dim >= dim_v:
                            k_in[i, c] = K[row, hk, c]
                            if dim_v == dim or c < dim_v:
                                v_in[i, c] = V[row, hk, c]
                        else:
                            v_in[i, c] = V[row, hk, c]
                            if c < dim:
                                k_in[i, c] = K[row, hk, c]
                    if fp8:  # widen the FP8 tiles for the WGMMAs (exact; the manual schedule above)
                        for i, c in T.Parallel(block_n, dim):
                            k_s[i, c] = T.cast(k_in[i, c], dtype)
                        for i, c in T.Parallel(block_n, dim_v):
                            v_s[i, c] = T.cast(v_in[i, c], dtype)
                    T.gemm(q_s, k_s, s, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                    # softmax.py's online softmax; masks.py's rule per query token (row // group).
                    update(s, m, m_prev, m_safe, alpha, row_sum, l, n0, t_first, t_last, mask, sc, cap, tile_rows)
                    T.copy(s, p)
                    for i, c in T.Parallel(block_m, dim_v):
                        o[i, c] *= alpha[i]
                    T.gemm(p, v_s, o, policy=FULL_ROW)

            # Epilogue (softmax.py's): O normalised, lse in natural log; the sink folded in
            # here with one split, by the combine kernel otherwise.
            if fp8:
                for i, c in T.Parallel(block_m, dim_v):
                    o[i, c] *= VDescale[b, hk]
            if num_splits == 1:
                finish(o, m, m_safe, alpha, row_sum, l, lse, GroupRows(tok_s, head_s, Sinks), sc)
                for i, c in T.Parallel(block_m, dim_v):
                    if r0 + i < rows:
                        O[qrow_s[i], c] = T.cast(o[i, c], dtype)
                for i in T.Parallel(block_m):
                    if r0 + i < rows:
                        LSE[lrow_s[i]] = lse[i]
            else:
                finish_partial(o, m, m_safe, alpha, row_sum, l, lse, 0.0, sc)
                for i, c in T.Parallel(block_m, dim_v):
                    if r0 + i < rows:
                        Opart[split * RQ + qrow_s[i], c] = o[i, c]
                for i in T.Parallel(block_m):
                    if r0 + i < rows:
                        LSEpart[split * RQ + qrow_s[i]] = lse[i]

    return main


# --- host side ------------------------------------------------------------------------------

MAX_SPLITS = 128
# Key blocks whose cache rows are looked up at once (row_s: 8 KB at 64-key blocks); each chunk
# restarts the K/V pipeline, so about 1/ROW_CHUNK_BLOCKS of the loads are not overlapped.
ROW_CHUNK_BLOCKS = 32


# (block_n, num_stages) forced for every head dim when set; benchmarks/decode_bench.py --tiles.
TILE_OVERRIDE: tuple[int, int] | None = None


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
    if TILE_OVERRIDE is not None:
        return {"block_n": TILE_OVERRIDE[0], "num_stages": TILE_OVERRIDE[1], "threads": 128}
    if dim != dim_v:  # synchronous loads (see the module docstring): 64 keys spill 1.2 KB, 32 keys 24 B
        return {"block_n": 32, "num_stages": 2, "threads": 128}
    return {"block_n": 64, "num_stages": 2, "threads": 128}


@functools.lru_cache(maxsize=4096)  # on every call's host path; a pure function of three ints
def choose_splits(ctas: int, n_blocks: int, slots: int) -> int:
    """Splits of each sequence's key blocks so that ``ctas * splits`` CTAs fill the GPU.

    ``ctas`` = CTAs without splitting (batch x kv heads x row tiles); ``n_blocks`` = key blocks
    of the longest sequence the cache can hold (a host-side bound, so no sync); ``slots`` =
    CTAs the GPU runs at once (SMs x ``ctas_per_sm``).  Enough CTAs for 80% of the slots
    already: 1.  Otherwise flash-attn's rule: the fewest splits whose wave efficiency (CTAs /
    (waves x slots)) is at least 85% of the best, at most ``MAX_SPLITS`` and at least two key
    blocks per split.
    """
    if ctas >= 0.8 * slots or n_blocks <= 2:
        return 1
    limit = max(1, min(MAX_SPLITS, n_blocks // 2))
    eff = {s: (ctas * s / slots) / math.ceil(ctas * s / slots) for s in range(1, limit + 1)}
    best = max(eff.values())
    return min(s for s in eff if eff[s] >= 0.85 * best)


SMEM_PER_SM = 228 * 1024  # Hopper: shared memory per SM (a CTA may take 227 KB of it)


def ctas_per_sm(cfg: dict, dim: int, dim_v: int, itemsize: int, cache_itemsize: int | None = None) -> int:
    """Decode CTAs resident on one SM at once, bounded by shared memory: the Q tile, the K/V
    stages (in the cache's element size; an FP8 cache adds one widened K/V tile) and the row
    table, plus the 1 KB the driver reserves per CTA.  (Registers allow two 128-thread CTAs
    at every tile here.)  128-key blocks at d = 128: 160 KB, one CTA; 64-key blocks: 88 KB
    (bf16 or FP8 cache), two."""
    cache_itemsize = cache_itemsize or itemsize
    smem = BLOCK_M * dim * itemsize + cfg["num_stages"] * cfg["block_n"] * (dim + dim_v) * cache_itemsize
    if cache_itemsize != itemsize:
        smem += cfg["block_n"] * (dim + dim_v) * itemsize
    smem += ROW_CHUNK_BLOCKS * cfg["block_n"] * 4 + 1024
    return max(1, min(2, SMEM_PER_SM // smem))


def get_decode_kernels(dim: int, dim_v: int, dtype: str, has_sinks: bool, has_softcap: bool,
                       cache_dtype: str | None = None):
    """(decode, combine) compiled for one static structure (``cache_dtype``: None, or
    ``"float8_e4m3fn"`` for an FP8 cache)."""
    from . import cache

    extra = {} if cache_dtype in (None, dtype) else {"cache_dtype": cache_dtype}
    decode = cache.get(decode_kernel, None, dim=dim, dim_v=dim_v, dtype=dtype, has_sinks=has_sinks,
                       has_softcap=has_softcap, **decode_config(dim, dim_v), **extra)
    from .combine import combine_kernel

    combine = cache.get(combine_kernel, None, dim_v=dim_v, dtype=dtype, has_sinks=has_sinks)
    return decode, combine


def launch_decode(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table, sinks,
                  softmax_scale: float, window, softcap: float, num_splits: int = 0, k_descale=None, v_descale=None):
    """Decode on CUDA: q (B, Sq, H, D); caches contiguous (B_cache, S_cache, Hkv, D) or paged
    (NP, page, Hkv, D) with ``block_table``, in q's dtype or float8_e4m3fn with ``k_descale`` /
    ``v_descale`` float32 (B, Hkv); ``seqlens_k`` int32 (B,) keys per entry after the append.
    Returns out (B, Sq, H, Dv) and lse (B, H, Sq) fp32 (natural log)."""
    import torch

    from . import debug, target

    reason = unsupported_reason(q, k_cache, v_cache)
    if reason is not None:
        raise NotImplementedError(f"flash_attn_with_kvcache: no CUDA kernel for {reason}")
    b, sq, h, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    dev = q.device
    out = debug.new_output((b, sq, h, dv), q.dtype, dev)
    lse = debug.new_output((b, h, sq), torch.float32, dev)
    if out.numel() == 0:
        return out, lse
    q = q.contiguous()
    if block_table is None:
        rows = int32_constant("arange", b, dev) if cache_batch_idx is None else cache_batch_idx
        table = rows.reshape(b, 1).to(torch.int32)
    else:
        table = block_table
    table = table.contiguous()
    leftpad = cache_leftpad.contiguous() if cache_leftpad is not None else int32_constant("zeros", b, dev)
    cfg = decode_config(d, dv)
    fp8 = k_cache.dtype != q.dtype
    decode, combine = get_decode_kernels(d, dv, str(q.dtype).removeprefix("torch."), sinks is not None, softcap > 0,
                                         str(k_cache.dtype).removeprefix("torch.") if fp8 else None)
    if num_splits <= 0:
        capacity = k_cache.shape[1] * table.shape[1]
        row_tiles = -(-(h // hkv) * sq // BLOCK_M)
        slots = target.sm_count(dev) * ctas_per_sm(cfg, d, dv, q.element_size(), k_cache.element_size())
        num_splits = choose_splits(b * hkv * row_tiles, -(-capacity // cfg["block_n"]), slots)
    # Partials are indexed with 32 bits: (splits * b * sq * h) rows of dv floats.
    num_splits = max(1, min(num_splits, MAX_SPLITS, (2**31 - 1) // (b * sq * h * dv)))
    sinks32 = sinks.float().contiguous() if sinks is not None else debug.dummy_sinks(h, dev)
    if softcap > 0:
        score_scale, cap_in = softcap * LOG2E, softmax_scale / softcap
    else:
        score_scale, cap_in = softmax_scale * LOG2E, 0.0
    left, right = host_window(window)
    if num_splits == 1:
        opart = torch.empty(1, dv, dtype=torch.float32, device=dev)
        lsepart = torch.empty(1, dtype=torch.float32, device=dev)
    else:
        rows_total = num_splits * b * sq * h
        opart = debug.new_output((rows_total, dv), torch.float32, dev)
        lsepart = debug.new_output((rows_total,), torch.float32, dev)
    page_size = k_cache.shape[1]
    if block_table is None:
        # A contiguous cache is one page per entry: every visible key j < capacity < 2^31 is on
        # page j >> 31 = 0, so the lookup neither divides nor needs a power-of-two capacity
        # (a division in the row lookup cost contiguous caches 7-14% of the bandwidth of page
        # 256: NOTES, 2026-11-23).
        page_shift = 31
    else:
        page_shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
    # Q, O and lse as flat rows (the kernels' layout: no index division per element).
    out_rows, lse_rows = out.view(-1, dv), lse.view(-1)
    if fp8:
        kdesc, vdesc = k_descale.float().contiguous(), v_descale.float().contiguous()
    else:
        kdesc = vdesc = debug.placeholder(b, hkv, device=dev)
    decode(q.view(-1, d), k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, dv), table, seqlens_k.contiguous(), leftpad,
           out_rows, lse_rows, opart, lsepart, sinks32, kdesc, vdesc, score_scale, cap_in, left, right, num_splits,
           page_size, page_shift, sq)
    if num_splits > 1:
        combine(opart, lsepart, out_rows, lse_rows, sinks32, sq, num_splits)
    return out, lse


_CONSTANTS: dict = {}


def int32_constant(kind: str, n: int, device):
    """``arange(n)`` or ``zeros(n)`` (int32) on ``device``, sliced from one tensor per (kind,
    device) that grows as needed, so a decode step launches no fill kernel for its default
    table and left padding (in a CUDA graph each is a ~2 us kernel of its own, a tenth of a
    B = 1 step: NOTES).  During graph capture they are made fresh instead: a tensor filled
    inside a capture holds its values only once the graph replays."""
    import torch

    make = torch.arange if kind == "arange" else torch.zeros
    if torch.cuda.is_current_stream_capturing():
        return make(n, dtype=torch.int32, device=device)
    key = (kind, str(device))
    t = _CONSTANTS.get(key)
    if t is None or t.numel() < n:
        t = _CONSTANTS[key] = make(max(n, 64), dtype=torch.int32, device=device)
    return t[:n]


def unsupported_reason(q, k_cache, v_cache):
    """Why no decode kernel runs this call, or None."""
    import torch

    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (kernels take float16 and bfloat16; use CPU tensors for others)"
    if k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        return f"a {k_cache.dtype} cache with {q.dtype} queries (kernels take q's dtype or float8_e4m3fn)"
    from . import target

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
    if q.shape[0] * q.shape[1] * q.shape[2] * max(d, dv) >= 2**31:
        return "q / out with 2^31 or more elements (32-bit indices; split the batch)"
    return None
