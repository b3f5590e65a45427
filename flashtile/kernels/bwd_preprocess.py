"""The backward's preprocess kernel: per query row, Delta and the base-2 log-sum-exp.

Row-wise over every (batch, row, head) of the tensors, blind to sequences: a packed (varlen)
batch runs it over its (1, total_q, H, D) tensors like a batch of one, so it needs no
``seqinfo`` (the one kernel that indexes its tensors directly).

(No `from __future__ import annotations` here: TileLang evaluates the PrimFunc annotations.)
"""

import tilelang
import tilelang.language as T

from .softmax import LOG2E
from .target import PASS_CONFIGS, TARGET


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def attention_bwd_preprocess(dim_v: int, dtype: str, has_dlse: bool, block: int = 64, threads: int = 128):
    """Delta (B, H, Sqp) = rowsum(dO * O) [- dLSE]; LSE2 (B, H, Sqp) = lse * log2(e), -inf -> +inf.

    ``Sqp`` is Sq rounded up to a multiple of 4 so that rows of the fp32 buffers are 16-byte
    aligned, which the main kernels' TMA loads of lse/Delta tiles require.  Padding rows get
    Delta = 0, LSE2 = 0: their Q and dO tiles are zero-filled, so they contribute nothing.
    """
    B, Sq, Sqp, H = T.dynamic("B, Sq, Sqp, H")
    acc = T.float32
    cols = 32 if dim_v % 32 == 0 else 16

    @T.prim_func
    def main(
        O: T.Tensor([B, Sq, H, dim_v], dtype),
        dO: T.Tensor([B, Sq, H, dim_v], dtype),
        LSE: T.Tensor([B, H, Sq], acc),
        dLSE: T.Tensor([B, H, Sq], acc),
        Delta: T.Tensor([B, H, Sqp], acc),
        LSE2: T.Tensor([B, H, Sqp], acc),
    ):
        with T.Kernel(T.ceildiv(Sq, block), H, B, threads=threads) as (bx, h, b):
            o = T.alloc_fragment([block, cols], dtype)
            do = T.alloc_fragment([block, cols], dtype)
            prod = T.alloc_fragment([block, cols], acc)
            delta = T.alloc_fragment([block], acc)
            lse = T.alloc_fragment([block], acc)
            m0 = bx * block
            T.clear(prod)
            # Column chunks: layout inference finds no thread mapping for e.g. [64, 96] tiles.
            for c in T.serial(dim_v // cols):
                T.copy(O[b, m0 : m0 + block, h, c * cols : (c + 1) * cols], o)
                T.copy(dO[b, m0 : m0 + block, h, c * cols : (c + 1) * cols], do)
                for i, j in T.Parallel(block, cols):
                    prod[i, j] += T.cast(o[i, j], acc) * T.cast(do[i, j], acc)
            T.reduce_sum(prod, delta, dim=1)
            if has_dlse:
                for i in T.Parallel(block):
                    delta[i] -= T.if_then_else(m0 + i < Sq, dLSE[b, h, T.min(m0 + i, Sq - 1)], 0)
            for i in T.Parallel(block):
                lse[i] = T.if_then_else(m0 + i < Sq, LSE[b, h, T.min(m0 + i, Sq - 1)], 0)
                lse[i] = T.if_then_else(lse[i] == -T.infinity(acc), T.infinity(acc), lse[i] * LOG2E)
            T.copy(delta, Delta[b, h, m0 : m0 + block])
            T.copy(lse, LSE2[b, h, m0 : m0 + block])

    return main
