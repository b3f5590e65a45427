"""TileLang backward kernels (Hopper) and their launcher.

(No `from __future__ import annotations` here: TileLang evaluates the PrimFunc annotations
and a postponed annotation cannot see a symbol that only the annotations use.)

Three steps, as in FlashAttention-2/3:

1. ``attention_bwd_preprocess``: per query row, ``Delta = rowsum(dO * O) - dlse`` and the
   base-2 log-sum-exp (fully masked rows get +inf so their P is exactly 0).
2. ``attention_bwd_dkdv``: one CTA per (key block, kv head, batch).  It keeps dK and dV of its
   key block in registers and walks over every (query head of its GQA group, query block)
   pair that can see the block, recomputing P from the saved lse.  GQA therefore sums dK/dV
   over the group inside the CTA: no atomics and no groups-times-larger buffer.  In the
   default mode the same CTA also emits dQ = dS K through TMA reduce-add into an fp32 buffer
   (unordered float atomics, fast, not bitwise reproducible).  With ``overlap`` (the table's
   choice up to d=128) S^T and dP^T are issued as async WGMMA and P is computed while dP^T
   runs.
3. dQ: either that fp32 buffer cast to the input dtype, or, with ``deterministic=True``,
   ``attention_bwd_dq``: one CTA per query block that owns its dQ rows and loops over the key
   blocks (recomputing S and dP), so every sum happens in a fixed order.

dsinks = -sum_{b,i} exp(sink_h - lse_i) * Delta_i is a tiny reduction done by PyTorch.
"""


import functools

import tilelang
import tilelang.language as T

from .fwd import LOG2E, PASS_CONFIGS, TARGET
from .masks import block_fully_visible, pipelined_trips, query_block_range, query_tile, visible


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


def query_step(t, hk, groups, qb_lo, n_qblocks, block_m):
    """Query head and first query row of step ``t`` of a dK/dV CTA's walk: (head, m0).

    Heads of the GQA group outer, query blocks inner, one flat loop so the pipeline stays full.
    """
    return hk * groups + t // n_qblocks, (qb_lo + t % n_qblocks) * block_m


def score_gradients(rows: int, cols: int, queries_on_cols: bool, has_softcap: bool):
    """(probabilities, score_grad, keep_visible) macros for a rows x cols score tile of either
    backward kernel.

    The dK/dV kernel holds S^T (keys x queries: ``queries_on_cols``), the dQ kernel S, so the
    per-query lse and Delta are indexed by column or by row.  ``cap`` (the tanh tile) is only
    read with softcap.

    ``probabilities(s, cap, lse, score_scale, cap_in)``: raw scores -> P = exp2(s - lse)
    (softcap applied first, its tanh kept in ``cap``); masking is left to the caller.
    ``score_grad(ds, p, dp, delta, cap, sm_scale)``: dS = P (dP - Delta) d(score)/d(q.k), with
    softcap's factor 1 - tanh^2.
    ``stat_offset`` (optional, last) is where this tile's queries start in ``lse`` / ``delta``:
    the hand-written kernel keeps both ring stages in one flat buffer.
    ``keep_visible(p, interior, m0, n0, off, Sk, left, right)``: zero P where the key is not
    visible to the query; ``interior`` (the caller's test for a tile that needs no mask) skips it.
    """

    @T.macro
    def probabilities(s, cap, lse, score_scale, cap_in, stat_offset=0):
        if has_softcap:
            for i, j in T.Parallel(rows, cols):
                cap[i, j] = T.tanh(s[i, j] * cap_in)
                s[i, j] = cap[i, j]
        for i, j in T.Parallel(rows, cols):
            s[i, j] = T.exp2(s[i, j] * score_scale - lse[stat_offset + (j if queries_on_cols else i)])

    @T.macro
    def score_grad(ds, p, dp, delta, cap, sm_scale, stat_offset=0):
        if has_softcap:
            for i, j in T.Parallel(rows, cols):
                ds[i, j] = p[i, j] * (dp[i, j] - delta[stat_offset + (j if queries_on_cols else i)]) * sm_scale * (1.0 - cap[i, j] * cap[i, j])
        else:
            for i, j in T.Parallel(rows, cols):
                ds[i, j] = p[i, j] * (dp[i, j] - delta[stat_offset + (j if queries_on_cols else i)]) * sm_scale

    @T.macro
    def keep_visible(p, interior, m0, n0, off, Sk, left, right):
        if not interior:
            for i, j in T.Parallel(rows, cols):
                q, k = (j, i) if queries_on_cols else (i, j)
                p[i, j] = T.if_then_else(visible(m0 + q, n0 + k, off, Sk, left, right), p[i, j], 0)

    return probabilities, score_grad, keep_visible


def dkdv_prim_func(shapes, dim: int, dim_v: int, dtype: str, kernel):
    """The dK/dV kernels' PrimFunc, one argument list for both schedules (see
    ``attention_bwd_dkdv``): ``kernel`` is the schedule's T.macro, called with the arguments.
    ``shapes`` = the symbolic (B, Sq, Sqp, Sk, H, Hkv) its grid and indices use."""
    B, Sq, Sqp, Sk, H, Hkv = shapes
    acc = T.float32

    @T.prim_func
    def main(
        Q: T.Tensor([B, Sq, H, dim], dtype),
        K: T.Tensor([B, Sk, Hkv, dim], dtype),
        V: T.Tensor([B, Sk, Hkv, dim_v], dtype),
        dO: T.Tensor([B, Sq, H, dim_v], dtype),
        LSE2: T.Tensor([B, H, Sqp], acc),
        Delta: T.Tensor([B, H, Sqp], acc),
        dQacc: T.Tensor([B, Sq, H, dim], acc),
        dK: T.Tensor([B, Sk, Hkv, dim], dtype),
        dV: T.Tensor([B, Sk, Hkv, dim_v], dtype),
        score_scale: T.float32,
        sm_scale: T.float32,
        cap_in: T.float32,
        left: T.int32,
        right: T.int32,
        rows_per_group: T.int32,
    ):
        kernel(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV, score_scale, sm_scale, cap_in, left, right, rows_per_group)

    return main


def dq_prim_func(shapes, dim: int, dim_v: int, dtype: str, kernel):
    """The deterministic dQ kernels' PrimFunc (see ``attention_bwd_dq``), as ``dkdv_prim_func``."""
    B, Sq, Sqp, Sk, H, Hkv = shapes
    acc = T.float32

    @T.prim_func
    def main(
        Q: T.Tensor([B, Sq, H, dim], dtype),
        K: T.Tensor([B, Sk, Hkv, dim], dtype),
        V: T.Tensor([B, Sk, Hkv, dim_v], dtype),
        dO: T.Tensor([B, Sq, H, dim_v], dtype),
        LSE2: T.Tensor([B, H, Sqp], acc),
        Delta: T.Tensor([B, H, Sqp], acc),
        dQ: T.Tensor([B, Sq, H, dim], dtype),
        score_scale: T.float32,
        sm_scale: T.float32,
        cap_in: T.float32,
        left: T.int32,
        right: T.int32,
    ):
        kernel(Q, K, V, dO, LSE2, Delta, dQ, score_scale, sm_scale, cap_in, left, right)

    return main


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def attention_bwd_dkdv(
    dim: int,
    dim_v: int,
    dtype: str,
    has_softcap: bool,
    with_dq: bool,
    block_n: int = 128,
    block_m: int = 64,
    num_stages: int = 2,
    threads: int = 256,
    overlap: bool = False,
):
    """dK, dV (and with ``with_dq`` the fp32 dQ accumulation) for one key block per CTA.

    Arguments: Q, K, V, dO, LSE2, Delta, dQacc (B, Sq, H, dim) fp32 (zeroed by the caller;
    untouched without ``with_dq``), dK, dV outputs, then scalars ``score_scale`` (log2 units,
    as in the forward), ``sm_scale``, ``cap_in``, ``left``, ``right``, ``rows_per_group`` (the
    launch order of key blocks, ``schedule.grouped_tile``; rows are (batch, kv head); only
    the hand-written schedule honours it).
    """
    shapes = B, Sq, Sqp, Sk, H, Hkv = T.dynamic("B, Sq, Sqp, Sk, H, Hkv")
    acc = T.float32
    # A WGMMA warpgroup owns 64 rows of its tile.  When the key block is shorter than the
    # consumer warpgroups stacked (d=256: 64 keys, but dK + dV need two warpgroups' registers)
    # the warpgroups split columns instead, and P^T / dS^T go through shared memory: a
    # column-split fragment cannot be the register A operand of the dV / dK GEMMs.
    split_cols = block_n < 64 * (threads // 128)
    probabilities, score_grad, keep_visible = score_gradients(block_n, block_m, True, has_softcap)
    policy = T.GemmWarpPolicy.FullCol if split_cols else T.GemmWarpPolicy.FullRow

    @T.macro
    def kernel(Q, K, V, dO, LSE2, Delta, dQacc, dK, dV, score_scale, sm_scale, cap_in, left, right, rows_per_group):
        # Row-major launch order whatever rows_per_group says: with the grouped order's
        # computed indices TileLang 0.1.15's ThreadSync pass rejects this schedule at d=256.
        with T.Kernel(T.ceildiv(Sk, block_n), Hkv, B, threads=threads) as (bx, hk, b):
            k_s = T.alloc_shared([block_n, dim], dtype)
            v_s = T.alloc_shared([block_n, dim_v], dtype)
            q_s = T.alloc_shared([block_m, dim], dtype)
            do_s = T.alloc_shared([block_m, dim_v], dtype)
            lse_s = T.alloc_shared([block_m], acc)
            delta_s = T.alloc_shared([block_m], acc)
            ds_s = T.alloc_shared([block_n, block_m], dtype)
            if split_cols:
                p_s = T.alloc_shared([block_n, block_m], dtype)
            dk_s = T.alloc_shared([block_n, dim], dtype)
            dv_s = T.alloc_shared([block_n, dim_v], dtype)
            sT = T.alloc_fragment([block_n, block_m], acc)
            dpT = T.alloc_fragment([block_n, block_m], acc)
            if not split_cols:
                pT = T.alloc_fragment([block_n, block_m], dtype)
            dsT = T.alloc_fragment([block_n, block_m], dtype)
            dk = T.alloc_fragment([block_n, dim], acc)
            dv = T.alloc_fragment([block_n, dim_v], acc)
            capT = T.alloc_fragment([block_n, block_m], acc) if has_softcap else None
            if with_dq:
                dq = T.alloc_fragment([block_m, dim], acc)
                dq_s = T.alloc_shared([block_m, dim], acc)

            n0 = bx * block_n
            groups = H // Hkv
            off = Sk - Sq
            qb_lo, n_qblocks, last_col = query_block_range(n0, block_n, block_m, Sq, Sk, left, right)

            T.copy(K[b, n0 : n0 + block_n, hk, :], k_s)
            T.copy(V[b, n0 : n0 + block_n, hk, :], v_s)
            T.clear(dk)
            T.clear(dv)

            # One flat loop over (query head in the GQA group, query block) keeps the pipeline full.
            # A key block no query sees still takes one trip, over query block qb_lo.
            for t in T.Pipelined(pipelined_trips(groups * n_qblocks), num_stages=num_stages):
                h, m0 = query_step(t, hk, groups, qb_lo, pipelined_trips(n_qblocks), block_m)
                T.copy(Q[b, m0 : m0 + block_m, h, :], q_s)
                T.copy(LSE2[b, h, m0 : m0 + block_m], lse_s)
                if overlap:
                    # S^T and dP^T issued together; P is computed while dP^T is still running.
                    # Safe inside T.Pipelined: q_s and do_s are read again by the synchronous
                    # dK / dV GEMMs below, so their stages are not released at these statements.
                    T.copy(dO[b, m0 : m0 + block_m, h, :], do_s)
                    T.copy(Delta[b, h, m0 : m0 + block_m], delta_s)
                    T.wgmma_gemm(k_s, q_s, sT, transpose_B=True, clear_accum=True, policy=policy)
                    T.wgmma_gemm(v_s, do_s, dpT, transpose_B=True, clear_accum=True, policy=policy)
                    T.wait_wgmma(1)
                else:
                    T.gemm(k_s, q_s, sT, transpose_B=True, clear_accum=True, policy=policy)
                probabilities(sT, capT, lse_s, score_scale, cap_in)
                # Query rows past Sq are masked too (their lse/Delta are padding).
                interior = T.And(m0 + block_m <= Sq, block_fully_visible(m0 + block_m - 1, n0, last_col, m0, off, Sk, left, right))
                keep_visible(sT, interior, m0, n0, off, Sk, left, right)
                if overlap:
                    T.wait_wgmma(0)
                else:
                    T.copy(dO[b, m0 : m0 + block_m, h, :], do_s)
                    T.copy(Delta[b, h, m0 : m0 + block_m], delta_s)
                    T.gemm(v_s, do_s, dpT, transpose_B=True, clear_accum=True, policy=policy)
                if split_cols:
                    T.copy(sT, p_s)
                    T.gemm(p_s, do_s, dv, policy=policy)
                else:
                    T.copy(sT, pT)
                    T.gemm(pT, do_s, dv, policy=policy)
                score_grad(dsT, sT, dpT, delta_s, capT, sm_scale)
                if split_cols or with_dq:
                    T.copy(dsT, ds_s)
                T.gemm(ds_s if split_cols else dsT, q_s, dk, policy=policy)
                if with_dq:
                    T.gemm(ds_s, k_s, dq, transpose_A=True, clear_accum=True)
                    T.copy(dq, dq_s)
                    T.atomic_add(dQacc[b, m0 : m0 + block_m, h, :], dq_s, use_tma=True)

            T.copy(dk, dk_s)
            T.copy(dk_s, dK[b, n0 : n0 + block_n, hk, :])
            T.copy(dv, dv_s)
            T.copy(dv_s, dV[b, n0 : n0 + block_n, hk, :])

    return dkdv_prim_func(shapes, dim, dim_v, dtype, kernel)


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def attention_bwd_dq(
    dim: int,
    dim_v: int,
    dtype: str,
    has_softcap: bool,
    block_m: int = 128,
    block_n: int = 64,
    num_stages: int = 2,
    threads: int = 256,
):
    """Deterministic dQ: one CTA per (query block, head, batch), keys in a fixed order.

    Arguments: Q, K, V, dO, LSE2, Delta, dQ (B, Sq, H, dim) output in the input dtype, then
    the same scalars as ``attention_bwd_dkdv``.
    """
    shapes = B, Sq, Sqp, Sk, H, Hkv = T.dynamic("B, Sq, Sqp, Sk, H, Hkv")
    acc = T.float32
    probabilities, score_grad, keep_visible = score_gradients(block_m, block_n, False, has_softcap)

    @T.macro
    def kernel(Q, K, V, dO, LSE2, Delta, dQ, score_scale, sm_scale, cap_in, left, right):
        with T.Kernel(T.ceildiv(Sq, block_m), H, B, threads=threads) as (bx, h, b):
            q_s = T.alloc_shared([block_m, dim], dtype)
            do_s = T.alloc_shared([block_m, dim_v], dtype)
            k_s = T.alloc_shared([block_n, dim], dtype)
            v_s = T.alloc_shared([block_n, dim_v], dtype)
            ds_s = T.alloc_shared([block_m, block_n], dtype)
            dq_s = T.alloc_shared([block_m, dim], dtype)
            lse = T.alloc_fragment([block_m], acc)
            delta = T.alloc_fragment([block_m], acc)
            s = T.alloc_fragment([block_m, block_n], acc)
            dp = T.alloc_fragment([block_m, block_n], acc)
            ds = T.alloc_fragment([block_m, block_n], dtype)
            dq = T.alloc_fragment([block_m, dim], acc)
            cap = T.alloc_fragment([block_m, block_n], acc) if has_softcap else None

            m0, kb_lo, n_blocks, last_row = query_tile(bx, block_m, block_n, Sq, Sk, left, right)
            hk = h // (H // Hkv)
            off = Sk - Sq

            T.copy(Q[b, m0 : m0 + block_m, h, :], q_s)
            T.copy(dO[b, m0 : m0 + block_m, h, :], do_s)
            T.copy(LSE2[b, h, m0 : m0 + block_m], lse)
            T.copy(Delta[b, h, m0 : m0 + block_m], delta)
            T.clear(dq)

            for t in T.Pipelined(pipelined_trips(n_blocks), num_stages=num_stages):
                n0 = (kb_lo + t) * block_n
                T.copy(K[b, n0 : n0 + block_n, hk, :], k_s)
                T.copy(V[b, n0 : n0 + block_n, hk, :], v_s)
                T.gemm(q_s, k_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(do_s, v_s, dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                probabilities(s, cap, lse, score_scale, cap_in)
                keep_visible(s, block_fully_visible(last_row, n0, n0 + block_n - 1, m0, off, Sk, left, right), m0, n0, off, Sk, left, right)
                score_grad(ds, s, dp, delta, cap, sm_scale)
                T.copy(ds, ds_s)
                T.gemm(ds_s, k_s, dq, policy=T.GemmWarpPolicy.FullRow)

            T.copy(dq, dq_s)
            T.copy(dq_s, dQ[b, m0 : m0 + block_m, h, :])

    return dq_prim_func(shapes, dim, dim_v, dtype, kernel)


def get_backward_kernels(dim: int, dim_v: int, dtype: str, has_softcap: bool, has_dlse: bool, deterministic: bool, window=(-1, -1)):
    """(preprocess, dK/dV main, deterministic dQ or None) compiled for one static structure."""
    from . import cache, configs

    prep = cache.get(attention_bwd_preprocess, dim_v=dim_v, dtype=dtype, has_dlse=has_dlse)
    static = dict(dim=dim, dim_v=dim_v, dtype=dtype, has_softcap=has_softcap)
    cfg = configs.bwd_config(dim, dim_v, dtype, configs.mask_kind(window), has_softcap)
    if cfg.manual_ws:
        from .bwd_ws import attention_bwd_dkdv_ws as builder
    else:
        builder = attention_bwd_dkdv
    main = cache.get(builder, cfg, with_dq=not deterministic, **static)
    dq = None
    if deterministic:
        dq_cfg = configs.bwd_dq_config(dim, dim_v, dtype, has_softcap)
        if dq_cfg.manual_ws:
            from .bwd_ws import attention_bwd_dq_ws as dq_builder
        else:
            dq_builder = attention_bwd_dq
        dq = cache.get(dq_builder, dq_cfg, **static)
    return prep, main, dq


@functools.cache
def sm_count(device) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_backward(dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window, softcap, deterministic):
    """Host side of the backward.

    Shapes as in the forward; ``dlse`` (B, H, Sq) or None.  Returns dq, dk, dv in the input
    dtype and dsinks (H,) in sinks' dtype (or None).
    """
    import torch

    from . import configs, debug
    from .masks import host_window

    b, sq, h, d = q.shape
    sk, hkv, dv_ = k.shape[1], k.shape[2], v.shape[-1]
    dtype = str(q.dtype).removeprefix("torch.")
    dq = debug.new_output(q.shape, q.dtype, q.device)
    dk = debug.new_output(k.shape, k.dtype, k.device)
    dv = debug.new_output(v.shape, v.dtype, v.device)
    lse = lse.contiguous()

    if sq == 0 or sk == 0 or b == 0 or h == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        dsinks = None if sinks is None else torch.zeros_like(sinks)
        return dq, dk, dv, dsinks

    delta = torch.empty(b, h, (sq + 3) // 4 * 4, dtype=torch.float32, device=q.device)  # rows 16-byte aligned
    lse2 = torch.empty_like(delta)
    prep, dkdv, dq_kernel = get_backward_kernels(d, dv_, dtype, softcap > 0, dlse is not None, deterministic, window)
    prep(out, dout, lse, dlse.contiguous() if dlse is not None else lse, delta, lse2)

    left, right = host_window(window)
    if softcap > 0:
        scalars = (softcap * LOG2E, softmax_scale, softmax_scale / softcap, left, right)
    else:
        scalars = (softmax_scale * LOG2E, softmax_scale, 0.0, left, right)
    kind = configs.mask_kind(window)
    key_blocks = -(-sk // configs.bwd_config(d, dv_, dtype, kind, softcap > 0).block_n)
    rows = configs.dkdv_rows_per_group(kind, h // hkv, b * hkv, key_blocks, sm_count(q.device))
    if deterministic:
        dq_acc = torch.empty(b, sq, h, d, dtype=torch.float32, device=q.device)  # not touched
        dkdv(q, k, v, dout, lse2, delta, dq_acc, dk, dv, *scalars, rows)
        dq_kernel(q, k, v, dout, lse2, delta, dq, *scalars)
    else:
        dq_acc = torch.zeros(b, sq, h, d, dtype=torch.float32, device=q.device)
        dkdv(q, k, v, dout, lse2, delta, dq_acc, dk, dv, *scalars, rows)
        dq.copy_(dq_acc)  # postprocess: fp32 accumulator -> input dtype

    dsinks = None
    if sinks is not None:
        dsinks = (-(torch.exp(sinks.float()[None, :, None] - lse) * delta[:, :, :sq])).sum(dim=(0, 2)).to(sinks.dtype)
    return dq, dk, dv, dsinks
