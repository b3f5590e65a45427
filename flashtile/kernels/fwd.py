"""TileLang forward kernel (Hopper): one CTA per (query block, head, batch).

Static structure (one compile each): dtype, head dims, sinks on/off, softcap on/off, dense or
packed (varlen) batch, tiles.  Batch, sequence lengths (and a packed batch's offsets), head
counts, the GQA ratio, softmax scale, softcap value and the window bounds are runtime values,
so variable-length training never recompiles.  Every tile slice goes through the tile's
``seqinfo.Sequence`` (dense or packed) and every mask through its ``masks.TileMask``.

Per CTA: Q tile -> shared; loop over the key blocks that the window can reach (fully masked
blocks are never visited); S = Q K^T by WGMMA; mask only boundary blocks; online softmax in
base 2 with log2(e) folded into the scale (``softmax.py``); O += P V.  The epilogue folds in
the sink, writes O through shared memory (TMA store) and the log-sum-exp in natural log.

Two schedules of that loop: ``attention_fwd_kernel`` here lets TileLang's pipeliner
warp-specialise it (synchronous GEMMs), and ``fwd_ws`` overlaps each softmax with the GEMMs
by hand.  The tile table (``configs.fwd_config``) picks the hand-written one at every head
dim, where it measured faster; the pipelined one stays as the baseline ``benchmarks/tune.py``
measures against (``manual_ws=False``), and the CPU tests keep it building.
"""


import tilelang
import tilelang.language as T

from . import seqinfo
from .masks import TileMask, pipelined_trips, query_tile
from .operands import GROUP, Operands, tile_scales
from .softmax import online_softmax, tile_fragments
from .target import PASS_CONFIGS, TARGET


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def attention_fwd_kernel(
    dim: int,
    dim_v: int,
    dtype: str,
    has_sinks: bool,
    has_softcap: bool,
    varlen: bool = False,
    block_m: int = 128,
    block_n: int = 128,
    num_stages: int = 2,
    threads: int = 256,
    out_dtype: str = None,
):
    """Build the forward PrimFunc (arguments: ``forward_prim_func``; ``out_dtype`` with FP8
    inputs, ``operands``)."""
    acc = T.float32
    ops = Operands(dtype, out_dtype)
    update, finish = online_softmax(block_m, block_n, dim_v, has_sinks, has_softcap, ops.p_offset)
    cast_p = ops.p_caster(block_m, block_n)

    @T.macro
    def kernel(Q, K, V, O, LSE, Sinks, score_scale, cap_in, left, right, seqs):
        H, Hkv = Q.shape[2], K.shape[2]
        with T.Kernel(*seqs.grid(block_m, H), threads=threads) as ids:
            bx, h, b = seqs.tile(ids, block_m, H, threads)
            q_s = T.alloc_shared([block_m, dim], dtype)
            k_s = T.alloc_shared([block_n, dim], dtype)
            v_s = T.alloc_shared(ops.v_tile(block_n, dim_v), dtype)
            o_s = T.alloc_shared([block_m, dim_v], ops.out_dtype)
            s, p, o, m, m_prev, m_safe, alpha, row_sum, l, lse = tile_fragments(block_m, block_n, dim_v, dtype)

            # A packed tile's rows past its sequence's end (the next sequence's queries) get
            # their own softmax rows and are never stored (``masks``: no row test).
            seq = seqs.of(b)
            mask = TileMask(seq, left, right)
            m0, kb_lo, n_blocks, last_row = query_tile(bx, block_m, block_n, mask, bottom_aligned=block_m != block_n)  # as fwd_ws's
            hk = h // (H // Hkv)
            score_scale, cap_in, out_scale = tile_scales(ops, Sinks, H, Hkv, seqs.batch, seq.batch, hk, score_scale, cap_in, has_softcap)

            T.copy(seq.q_rows(Q, m0, block_m, h), q_s)
            T.clear(o)
            T.clear(l)
            T.fill(m, -T.infinity(acc))

            for t in T.Pipelined(pipelined_trips(n_blocks), num_stages=num_stages):
                n0 = (kb_lo + t) * block_n
                T.copy(seq.k_rows(K, n0, block_n, hk), k_s)
                T.gemm(q_s, k_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                update(s, m, m_prev, m_safe, alpha, row_sum, l, n0, m0, last_row, mask, score_scale, cap_in)
                cast_p(s, p)
                for i, j in T.Parallel(block_m, dim_v):
                    o[i, j] *= alpha[i]
                T.copy(ops.v_rows(seq, V, n0, block_n, hk), v_s)
                T.gemm(p, v_s, o, transpose_B=ops.fp8, policy=T.GemmWarpPolicy.FullRow)

            finish(o, m, m_safe, alpha, row_sum, l, lse, Sinks[h], score_scale, out_scale)
            seqinfo.store_q_tile(seq, o, o_s, O, m0, block_m, h, dim_v, lse, LSE)

    return forward_prim_func(dim, dim_v, dtype, varlen, kernel, out_dtype)


def forward_prim_func(dim: int, dim_v: int, dtype: str, varlen: bool, kernel, out_dtype: str = None):
    """The forward's PrimFunc, one argument list for every schedule; ``kernel`` is the
    schedule's T.macro ``kernel(Q, K, V, O, LSE, Sinks, score_scale, cap_in, left, right, seqs)``
    with ``seqs`` a ``seqinfo.Sequences``.

    Dense arguments: Q (B, Sq, H, dim), K (B, Sk, Hkv, dim), V (B, Sk, Hkv, dim_v),
    O (B, Sq, H, dim_v) out, LSE (B, H, Sq) fp32 out, Sinks (H,) fp32 (read only with sinks),
    then scalars ``score_scale`` (softmax_scale * log2 e, or softcap * log2 e with softcap),
    ``cap_in`` (softmax_scale / softcap, unused without softcap), ``left``/``right`` window
    bounds (huge when unbounded), ``head_group`` (the one-tile grids' launch order,
    ``configs.head_group``; the persistent schedule ignores it).
    Packed (varlen): Q/K/V/O (1, total, heads, dim), LSE (1, H, total_q); after Sinks come
    CuQ, CuK (batch + 1,) int32 row offsets and LenQ, LenK (batch,) int32 lengths, and after
    the scalars ``max_q``, ``max_k`` (int32, at least every length; the packed grid sizes itself
    by the tensors' row counts, ``seqinfo.packed_slots``, so the forward does not read them).

    FP8 (``dtype`` float8_e4m3fn, ``operands``): V is V^T, dense (B, Hkv, dim_v, keys padded to
    16) and packed (1, Hkv, dim_v, columns); O is ``out_dtype``; Sinks carries the descales
    after the sinks (``operands.params``).
    """
    acc = T.float32
    ops = Operands(dtype, out_dtype)
    if not varlen:
        B, Sq, Sk, H, Hkv = T.dynamic("B, Sq, Sk, H, Hkv")
        v_shape = ops.v_tensor(B, T.dynamic("Skv") if ops.fp8 else Sk, Hkv, dim_v)
        n_params = T.dynamic("NP") if ops.fp8 else H

        @T.prim_func
        def main(
            Q: T.Tensor([B, Sq, H, dim], dtype),
            K: T.Tensor([B, Sk, Hkv, dim], dtype),
            V: T.Tensor(v_shape, dtype),
            O: T.Tensor([B, Sq, H, dim_v], ops.out_dtype),
            LSE: T.Tensor([B, H, Sq], acc),
            Sinks: T.Tensor([n_params], acc),
            score_scale: T.float32,
            cap_in: T.float32,
            left: T.int32,
            right: T.int32,
            head_group: T.int32,
        ):
            kernel(Q, K, V, O, LSE, Sinks, score_scale, cap_in, left, right, seqinfo.dense(B, Sq, Sk, head_group))

        return main

    Tq, Tk, H, Hkv, Bc, Bn = T.dynamic("Tq, Tk, H, Hkv, Bc, Bn")
    v_shape = ops.v_tensor(1, T.dynamic("Tv") if ops.fp8 else Tk, Hkv, dim_v)
    n_params = T.dynamic("NP") if ops.fp8 else H

    @T.prim_func
    def main_varlen(
        Q: T.Tensor([1, Tq, H, dim], dtype),
        K: T.Tensor([1, Tk, Hkv, dim], dtype),
        V: T.Tensor(v_shape, dtype),
        O: T.Tensor([1, Tq, H, dim_v], ops.out_dtype),
        LSE: T.Tensor([1, H, Tq], acc),
        Sinks: T.Tensor([n_params], acc),
        CuQ: T.Tensor([Bc], T.int32),
        CuK: T.Tensor([Bc], T.int32),
        LenQ: T.Tensor([Bn], T.int32),
        LenK: T.Tensor([Bn], T.int32),
        score_scale: T.float32,
        cap_in: T.float32,
        left: T.int32,
        right: T.int32,
        head_group: T.int32,
        max_q: T.int32,
        max_k: T.int32,
    ):
        seqs = seqinfo.packed(CuQ, CuK, LenQ, LenK, max_q, max_k, v_group=GROUP if ops.fp8 else 0, rows_q=Tq, rows_k=Tk,
                              head_group=head_group)
        kernel(Q, K, V, O, LSE, Sinks, score_scale, cap_in, left, right, seqs)

    return main_varlen
