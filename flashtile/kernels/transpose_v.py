"""The FP8 forward's V pre-pass on the GPU: V (keys, Hkv, Dv) -> V^T (Hkv, Dv, keys), each 16-key
group in ``operands.key_of_column`` order (why: ``operands``).

One CTA per (64-key block, kv head, batch entry): the block's rows are loaded with 16-byte
loads into shared memory, transposed and permuted four by four bytes in registers
(``transpose4``), and stored a word at a time to V^T, guarded:
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
from .operands import GROUP, key_of_column, packed_v_columns, padded_keys
from .target import PASS_CONFIGS, TARGET

BLOCK = 64  # keys per CTA (4 permutation groups)
PAD_WORDS = 4  # words (16 bytes) of padding per shared V row: the transposing reads are conflict-free
# A V^T word holds columns 4q .. 4q + 3 of a 16-key group: keys 2q, 2q + 1, 2q + 8, 2q + 9
# (``operands.key_of_column``), these key offsets from 2q in byte order.
WORD_KEYS = (0, 1, 8, 9)
assert [key_of_column(t) for t in range(4)] == list(WORD_KEYS)


def byte_perm(a, b, selector: int):
    """CUDA's ``__byte_perm``: four bytes picked from the eight of ``a`` (0-3) and ``b`` (4-7)."""
    return T.call_extern("int32", "__byte_perm", a, b, selector)


# The 4 x 4 byte transpose's selectors: round 1 interleaves two words' bytes 0, 1 (or 2, 3):
# a0 b0 a1 b1 (a2 b2 a3 b3); round 2 takes the even (odd) byte pairs of two such words.
ROUND1 = (0x5140, 0x7362)
ROUND2 = (0x5410, 0x7632)


def transpose4(a, b, c, d, i: int, perm=byte_perm):
    """Byte ``i`` of each of four words, as one word (``a``'s in its low byte): a 4 x 4 byte
    transpose in two rounds of ``__byte_perm`` (the compiler shares the first round between
    the four ``i``).  ``perm``: the byte permute (a Python emulation in the CPU test)."""
    ab = perm(a, b, ROUND1[i // 2])
    cd = perm(c, d, ROUND1[i // 2])
    return perm(ab, cd, ROUND2[i % 2])


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def transpose_v_kernel(dim_v: int, varlen: bool, block: int = BLOCK, threads: int = 128):
    """Dense: V (B, Sk, Hkv, dim_v / 4) -> Vt (B, Hkv, dim_v, Skv / 4), Skv = Sk rounded up to
    16.  Packed: V (1, Tk, Hkv, dim_v / 4), CuK (batch + 1,), LenK (batch,) int32, scalar max_k
    -> Vt (1, Hkv, dim_v, Tv / 4) at ``operands.v_offsets``.  Both as int32 words of four FP8
    bytes (the launcher's views), so every load and store moves whole words.

    Each thread builds four V^T words at a time: the four keys of one word position (``WORD_KEYS``)
    times four features, read as four words of V rows from shared memory and transposed in
    registers (``transpose4``).  Lanes take (4 word positions x 8 feature words) of one group,
    so with rows padded by ``PAD_WORDS`` the 32 reads of each load hit 32 banks, and each store
    writes 16 contiguous bytes of 8 V^T rows.  (The first version moved single bytes through a
    transposed shared tile: one 32-byte sector per warp store instruction.)"""
    words = dim_v // 4
    assert dim_v % 4 == 0 and block % 16 == 0

    @T.macro
    def body(V, Vt, seqs):
        Hkv = V.shape[2]
        with T.Kernel(T.ceildiv(seqs.max_k, block), Hkv, seqs.batch, threads=threads) as (bx, hk, b):
            rows = T.alloc_shared([block, words + PAD_WORDS], T.int32)
            seq = seqs.of(b)
            n0 = bx * block
            for r, c in T.Parallel(block, words):  # rows past the tensor's end as zeros
                rows[r, c] = T.if_then_else(seq.k0 + n0 + r < V.shape[1], V[seq.b, seq.k0 + n0 + r, hk, c], 0)
            # Dense: up to the padded key extent (the tensor's edge).  Packed: whole groups of this
            # sequence only, since the next sequence's columns start right after them.
            end = (seq.len_k + GROUP - 1) // GROUP * GROUP if varlen else Vt.shape[3] * 4
            col0 = (seq.v0 + n0) // 4  # first V^T word of the block (v0 and n0: multiples of 16)
            # Tasks (g, m, q), q fastest: a warp holds one group g, 8 feature words m, 4 word
            # positions q.  Written by thread index (registers for the four words; T.Parallel
            # re-read each word from shared memory for every output).
            tx = T.get_thread_binding()
            tasks = block // GROUP * words * 4
            w = T.alloc_local([4], T.int32)
            for it in T.unroll(T.ceildiv(tasks, threads)):
                if tasks % threads == 0 or it * threads + tx < tasks:
                    q = (it * threads + tx) % 4
                    m = (it * threads + tx) // 4 % words
                    g = (it * threads + tx) // (4 * words)
                    if n0 + g * GROUP + q * 4 < end:
                        key = g * GROUP + 2 * q
                        for u, du in enumerate(WORD_KEYS):  # keys past the sequence as zeros
                            w[u] = T.if_then_else(n0 + key + du < seq.len_k, rows[key + du, m], 0)
                        for i, _ in enumerate(WORD_KEYS):  # a Python loop (``range`` would be a TIR one)
                            Vt[seq.b, hk, 4 * m + i, col0 + g * 4 + q] = transpose4(w[0], w[1], w[2], w[3], i)

    if not varlen:
        B, Sk, Hkv, Skw = T.dynamic("B, Sk, Hkv, Skw")

        @T.prim_func
        def main(V: T.Tensor([B, Sk, Hkv, words], T.int32), Vt: T.Tensor([B, Hkv, dim_v, Skw], T.int32)):
            body(V, Vt, seqinfo.dense(B, Sk, Sk))

        return main

    Tk, Tw, Hkv, Bc, Bn = T.dynamic("Tk, Tw, Hkv, Bc, Bn")

    @T.prim_func
    def main_varlen(
        V: T.Tensor([1, Tk, Hkv, words], T.int32),
        Vt: T.Tensor([1, Hkv, dim_v, Tw], T.int32),
        CuK: T.Tensor([Bc], T.int32),
        LenK: T.Tensor([Bn], T.int32),
        max_k: T.int32,
    ):
        body(V, Vt, seqinfo.packed_rows(CuK, LenK, max_k, v_group=GROUP))

    return main_varlen


def get_kernel(dim_v: int, varlen: bool):
    """The compiled pre-pass for one V head dim, dense or packed."""
    return cache.get(transpose_v_kernel, dim_v=dim_v, varlen=varlen)


def launch_transpose_v(v: torch.Tensor, packed=None) -> torch.Tensor:
    """V^T for the FP8 forward: dense v (B, Sk, Hkv, Dv) -> (B, Hkv, Dv, ceil16(Sk)); packed
    v (total_k, Hkv, Dv) with ``packed`` (``launch.Packed``) -> (1, Hkv, Dv, columns)."""
    dv = v.shape[-1]
    if packed is None:
        b, sk, hkv, _ = v.shape
        vt = debug.new_output((b, hkv, dv, padded_keys(sk)), v.dtype, v.device)
        if vt.numel():
            get_kernel(dv, False)(v.view(torch.int32), vt.view(torch.int32))
        return vt
    total_k, hkv, _ = v.shape
    vt = torch.zeros(1, hkv, dv, packed_v_columns(total_k, packed.batch), dtype=v.dtype, device=v.device)
    if packed.batch and packed.max_k and vt.numel():
        get_kernel(dv, True)(v[None].view(torch.int32), vt.view(torch.int32), packed.cu_k, packed.lens_k, packed.max_k)
    return vt
