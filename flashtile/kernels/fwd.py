"""TileLang forward kernel (Hopper): one CTA per (query block, head, batch).

Static structure (one compile each): dtype, head dims, sinks on/off, softcap on/off, tiles.
Batch, sequence lengths, head counts, the GQA ratio, softmax scale, softcap value and the
window bounds are runtime values, so variable-length training never recompiles.

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

from .configs import ARCH
from .masks import pipelined_trips, query_tile
from .softmax import LOG2E, online_softmax, tile_fragments

PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
TARGET = {"kind": "cuda", "arch": ARCH}


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def attention_fwd_kernel(
    dim: int,
    dim_v: int,
    dtype: str,
    has_sinks: bool,
    has_softcap: bool,
    block_m: int = 128,
    block_n: int = 128,
    num_stages: int = 2,
    threads: int = 256,
):
    """Build the forward PrimFunc.

    Kernel arguments: Q (B, Sq, H, dim), K (B, Sk, Hkv, dim), V (B, Sk, Hkv, dim_v),
    O (B, Sq, H, dim_v) out, LSE (B, H, Sq) fp32 out, Sinks (H,) fp32 (read only with sinks),
    then scalars: ``score_scale`` (softmax_scale * log2 e, or softcap * log2 e with softcap),
    ``cap_in`` (softmax_scale / softcap, unused without softcap), ``left``/``right`` window
    bounds (huge when unbounded).
    """
    shapes = B, Sq, Sk, H, Hkv = T.dynamic("B, Sq, Sk, H, Hkv")
    acc = T.float32
    update, finish = online_softmax(block_m, block_n, dim_v, has_sinks, has_softcap)

    @T.macro
    def kernel(Q, K, V, O, LSE, Sinks, score_scale, cap_in, left, right):
        with T.Kernel(T.ceildiv(Sq, block_m), H, B, threads=threads) as (bx, h, b):
            q_s = T.alloc_shared([block_m, dim], dtype)
            k_s = T.alloc_shared([block_n, dim], dtype)
            v_s = T.alloc_shared([block_n, dim_v], dtype)
            o_s = T.alloc_shared([block_m, dim_v], dtype)
            s, p, o, m, m_prev, m_safe, alpha, row_sum, l, lse = tile_fragments(block_m, block_n, dim_v, dtype)

            m0, kb_lo, n_blocks, last_row = query_tile(bx, block_m, block_n, Sq, Sk, left, right)
            hk = h // (H // Hkv)
            off = Sk - Sq

            T.copy(Q[b, m0 : m0 + block_m, h, :], q_s)
            T.clear(o)
            T.clear(l)
            T.fill(m, -T.infinity(acc))

            for t in T.Pipelined(pipelined_trips(n_blocks), num_stages=num_stages):
                kb = kb_lo + t
                n0 = kb * block_n
                T.copy(K[b, n0 : n0 + block_n, hk, :], k_s)
                T.gemm(q_s, k_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                update(s, m, m_prev, m_safe, alpha, row_sum, l, n0, m0, last_row, off, Sk, left, right, score_scale, cap_in)
                T.copy(s, p)
                for i, j in T.Parallel(block_m, dim_v):
                    o[i, j] *= alpha[i]
                T.copy(V[b, n0 : n0 + block_n, hk, :], v_s)
                T.gemm(p, v_s, o, policy=T.GemmWarpPolicy.FullRow)

            finish(o, m, m_safe, alpha, row_sum, l, lse, Sinks[h], score_scale)
            T.copy(o, o_s)
            T.copy(o_s, O[b, m0 : m0 + block_m, h, :])
            T.copy(lse, LSE[b, h, m0 : m0 + block_m])

    return forward_prim_func(shapes, dim, dim_v, dtype, kernel)


def forward_prim_func(shapes, dim: int, dim_v: int, dtype: str, kernel):
    """The forward's PrimFunc, one argument list for every schedule (see
    ``attention_fwd_kernel``): ``kernel`` is the schedule's T.macro, called with the arguments.
    ``shapes`` = the symbolic (B, Sq, Sk, H, Hkv) the schedule's grid and indices use."""
    B, Sq, Sk, H, Hkv = shapes
    acc = T.float32

    @T.prim_func
    def main(
        Q: T.Tensor([B, Sq, H, dim], dtype),
        K: T.Tensor([B, Sk, Hkv, dim], dtype),
        V: T.Tensor([B, Sk, Hkv, dim_v], dtype),
        O: T.Tensor([B, Sq, H, dim_v], dtype),
        LSE: T.Tensor([B, H, Sq], acc),
        Sinks: T.Tensor([H], acc),
        score_scale: T.float32,
        cap_in: T.float32,
        left: T.int32,
        right: T.int32,
    ):
        kernel(Q, K, V, O, LSE, Sinks, score_scale, cap_in, left, right)

    return main


def get_forward_kernel(dim: int, dim_v: int, dtype: str, has_sinks: bool, has_softcap: bool, window=(-1, -1)):
    """The compiled forward for one static structure (tiles from ``configs.fwd_config``)."""
    from . import cache, configs

    cfg = configs.fwd_config(dim, dim_v, dtype, configs.mask_kind(window))
    if cfg.manual_ws:  # fwd_ws imports this module: lazy
        from . import fwd_ws

        builder = fwd_ws.attention_fwd_ws_tile_kernel if cfg.tiles_per_cta == 1 else fwd_ws.attention_fwd_ws_kernel
    else:
        builder = attention_fwd_kernel
    return cache.get(builder, cfg, dim=dim, dim_v=dim_v, dtype=dtype, has_sinks=has_sinks, has_softcap=has_softcap)


def launch_forward(q, k, v, sinks, softmax_scale: float, window: tuple[int, int], softcap: float):
    """Host side of the forward: allocate outputs, pick the config, launch.

    q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) contiguous CUDA tensors of one
    half-precision dtype (``flashtile.kernels.prepare`` guarantees it).  Returns
    out (B, Sq, H, Dv) and lse (B, H, Sq) float32, natural log.
    """
    import torch

    from . import debug
    from .masks import host_window

    b, sq, h, d = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    out = debug.new_output((b, sq, h, dv), q.dtype, q.device)
    lse = debug.new_output((b, h, sq), torch.float32, q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    if sk == 0:  # nothing to attend to: zeros, and lse = sink (or -inf)
        out.zero_()
        lse.copy_(sinks.float()[None, :, None].expand(b, h, sq) if sinks is not None else torch.full_like(lse, float("-inf")))
        return out, lse
    kernel = get_forward_kernel(d, dv, str(q.dtype).removeprefix("torch."), sinks is not None, softcap > 0, window)
    sinks32 = sinks.float().contiguous() if sinks is not None else debug.dummy_sinks(h, q.device)
    if softcap > 0:
        score_scale, cap_in = softcap * LOG2E, softmax_scale / softcap
    else:
        score_scale, cap_in = softmax_scale * LOG2E, 0.0
    left, right = host_window(window)
    kernel(q, k, v, out, lse, sinks32, score_scale, cap_in, left, right)
    return out, lse
