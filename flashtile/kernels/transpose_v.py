"""The FP8 forward's V pre-pass on the GPU: V (keys, Hkv, Dv) -> V^T (Hkv, Dv, keys), each 16-key
group in ``operands.key_of_column`` order (why: ``operands``).

One CTA of ``threads_for(d_v)`` threads per (64-key block, kv head, batch entry): the block's
rows are loaded with 16-byte loads, transposed and permuted through shared memory, and stored
16 keys (one permutation group, 16 bytes) at a time per thread, guarded per group:
dense batches up to the padded key extent (keys past Sk are written as zeros up to the 16-key
padding), packed batches only up to the sequence's last whole group, so one sequence's CTA
never writes another's columns; the launcher zero-fills the gaps between sequences (every
column a forward tile may read must be finite: P is 0 there, and 0 x NaN would not be).

The torch functions ``operands.transpose_v`` / ``transpose_v_packed`` are the reference
(``tests/test_gpu_fp8.py`` compares them with this kernel).
"""


import tilelang
import tilelang.language as T
import torch

from . import cache, debug, seqinfo
from .operands import FP8, GROUP, key_of_column, packed_v_columns, padded_keys
from .target import PASS_CONFIGS, TARGET

BLOCK = 64  # keys per CTA (4 permutation groups)


def threads_for(dim_v: int) -> int:
    """Threads per CTA: 256 where a CTA moves 8 KB or more (d_v >= 128), else 128.  H100, 67 MB
    read + written, graph-replayed, bitwise equal (NOTES, thirtieth and thirty-first sessions):
    d = 256 35.6-35.7 -> 27.2-27.3 us, d = 128 27.4 -> 25.0 us with 256 threads; d = 64 26.7 ->
    27.0 (kept at 128); 128-key CTAs were slower at every d (33-50 us)."""
    return 256 if dim_v >= 128 else 128


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def transpose_v_kernel(dim_v: int, varlen: bool, block: int = BLOCK, threads: int = 128):
    """Dense: V (B, Sk, Hkv, dim_v) -> Vt (B, Hkv, dim_v, Skv), Skv = Sk rounded up to 16.
    Packed: V (1, Tk, Hkv, dim_v), CuK (batch + 1,), LenK (batch,) int32, scalar max_k ->
    Vt (1, Hkv, dim_v, Tv) at ``operands.v_offsets``.  Vt arrives as its view with the keys
    split into (key groups, 16) (``launch_transpose_v``), so each group's 16-byte store is
    provably aligned and TileLang vectorises it."""

    @T.macro
    def body(V, Vt, seqs):
        Hkv = V.shape[2]
        with T.Kernel(T.ceildiv(seqs.max_k, block), Hkv, seqs.batch, threads=threads) as (bx, hk, b):
            rows = T.alloc_shared([block, dim_v], FP8)
            # V^T tile, rows padded by 4 bytes: the transposing loop's lanes walk d_v, so an
            # unpadded 64-byte row stride would put 16 lanes on one bank (a 16-byte pad keeps
            # rows 16-byte aligned but puts 4 lanes on one bank: 16% slower at d = 128, NOTES).
            cols = T.alloc_shared([dim_v, block + 4], FP8)
            group = T.alloc_local([GROUP], FP8)  # one key group, read from cols in 4-byte words
            seq = seqs.of(b)
            n0 = bx * block
            T.copy(seq.k_rows(V, n0, block, hk), rows)
            for i, j in T.Parallel(block, dim_v):  # lanes along d_v: conflict-free reads of rows
                key = key_of_column(i)
                cols[j, i] = T.if_then_else(n0 + key < seq.len_k, rows[key, j], T.cast(0, FP8))
            # Dense: up to the padded key extent (the tensor's edge).  Packed: whole groups of this
            # sequence only, since the next sequence's columns start right after them.
            # Group starts (n0, v0) and ends are multiples of 16: a group is stored whole or not.
            end = (seq.len_k + GROUP - 1) // GROUP * GROUP if varlen else Vt.shape[3] * GROUP
            tx = T.get_thread_binding()
            per_row = block // GROUP
            groups = dim_v * per_row  # not a multiple of the threads at d_v = 48, 80, ...
            for it in T.serial(T.ceildiv(groups, threads)):
                j, g = (it * threads + tx) // per_row, (it * threads + tx) % per_row
                if it * threads + tx < groups and n0 + g * GROUP < end:
                    for e in T.vectorized(GROUP):
                        group[e] = cols[j, g * GROUP + e]
                    for e in T.vectorized(GROUP):
                        Vt[seq.b, hk, j, (seq.v0 + n0) // GROUP + g, e] = group[e]

    if not varlen:
        B, Sk, Hkv, Gkv = T.dynamic("B, Sk, Hkv, Gkv")

        @T.prim_func
        def main(V: T.Tensor([B, Sk, Hkv, dim_v], FP8), Vt: T.Tensor([B, Hkv, dim_v, Gkv, GROUP], FP8)):
            body(V, Vt, seqinfo.dense(B, Sk, Sk))

        return main

    Tk, Gv, Hkv, Bc, Bn = T.dynamic("Tk, Gv, Hkv, Bc, Bn")

    @T.prim_func
    def main_varlen(
        V: T.Tensor([1, Tk, Hkv, dim_v], FP8),
        Vt: T.Tensor([1, Hkv, dim_v, Gv, GROUP], FP8),
        CuK: T.Tensor([Bc], T.int32),
        LenK: T.Tensor([Bn], T.int32),
        max_k: T.int32,
    ):
        body(V, Vt, seqinfo.packed_rows(CuK, LenK, max_k, v_group=GROUP))

    return main_varlen


def get_kernel(dim_v: int, varlen: bool):
    """The compiled pre-pass for one V head dim, dense or packed."""
    return cache.get(transpose_v_kernel, dim_v=dim_v, varlen=varlen, threads=threads_for(dim_v))


def launch_transpose_v(v: torch.Tensor, packed=None) -> torch.Tensor:
    """V^T for the FP8 forward: dense v (B, Sk, Hkv, Dv) -> (B, Hkv, Dv, ceil16(Sk)); packed
    v (total_k, Hkv, Dv) with ``packed`` (``launch.Packed``) -> (1, Hkv, Dv, columns)."""
    dv = v.shape[-1]
    if packed is None:
        b, sk, hkv, _ = v.shape
        vt = debug.new_output((b, hkv, dv, padded_keys(sk)), v.dtype, v.device)
        if vt.numel():
            get_kernel(dv, False)(v, grouped(vt))
        return vt
    total_k, hkv, _ = v.shape
    vt = torch.zeros(1, hkv, dv, packed_v_columns(total_k, packed.batch), dtype=v.dtype, device=v.device)
    if packed.batch and packed.max_k and vt.numel():
        get_kernel(dv, True)(v[None], grouped(vt), packed.cu_k, packed.lens_k, packed.max_k)
    return vt


def grouped(vt: torch.Tensor) -> torch.Tensor:
    """The kernel's view of V^T: keys split into (groups of 16, 16); the key extent is a
    multiple of 16 (``operands.padded_keys``, ``packed_v_columns``)."""
    return vt.view(*vt.shape[:-1], vt.shape[-1] // GROUP, GROUP)
