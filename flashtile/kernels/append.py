"""KV-cache append (Hopper): new keys/values into the cache in place, with rotary and FP8, one launch.

``flash_attn_with_kvcache(..., k=, v=)`` writes the new tokens at ``cache_seqlens[b] + i``
before the decode kernel reads the cache.  Done with PyTorch tensor ops that is a dozen
launches per step (index arithmetic, two ``index_put_``, the length update, and for rotary
~20 elementwise ops on q and k): a dozen CUDA-graph nodes, and in eager mode ~70 us of host
time on an H100's host.  This kernel does the whole step's preparation in one launch (the
eager saving measured smaller than hoped, ~9 us on a fast host: the entry point's own Python
and the tvm-ffi calls dominate; NOTES, thirteenth session):

- each new key/value token goes to ``k_cache[block_table[b, pos // page_size], pos %
  page_size]`` (a contiguous cache is one page per cache row, the table being
  ``cache_batch_idx`` or ``arange``, as in ``decode.py``);
- rotary (optional) on the new keys at ``pos`` and on the queries (at ``cache_seqlens[b] + t``
  when ``per_token``, else ``cache_seqlens[b]``), written to a separate query buffer (the
  caller's q is never modified);
- an FP8 cache gets ``x / descale[b, h]`` rounded to nearest-even and saturated at +-448;
- ``SeqlensK[b] = cache_seqlens[b] + snew`` (the decode kernel's lengths after the append).

Bit-identical to the reference (``kvcache.append_kv`` and ``kvcache.apply_rotary``): every
float operation is one correctly rounded fp32 operation in the reference's order
(``__fmul_rn``/``__fadd_rn``/``__fsub_rn``/``__fdiv_rn`` keep fast-math from contracting them
into FMAs or approximating the division), the rotated key is rounded to q's dtype before it is
quantized, as the reference's is.  The tests compare caches with ``torch.equal``.

Static structure (one compile each): head dims, q's dtype, the cache's dtype, cos/sin's dtype.
Batch, heads, token counts, page size, rotary dimension and style are runtime.  One CTA per
token (``B * (snew + Sq_rot)``); its threads stride over the token's heads x features.  Work
per launch is a few KB: this kernel is about launches, not bandwidth.
"""

import tilelang
import tilelang.language as T
import torch

from . import debug, launch
from .decode import descale_args, page_table
from .target import PASS_CONFIGS, TARGET

THREADS = 128


def _rn(op: str, a, b):
    """One correctly rounded fp32 ``op`` (mul, add, sub, div): never fused or approximated."""
    return T.call_extern(T.float32, f"__f{op}_rn", a, b)


@tilelang.jit(target=TARGET, pass_configs=PASS_CONFIGS)
def append_kernel(dim: int, dim_v: int, dtype: str, cache_dtype: str, rotary_dtype: str):
    """Kernel arguments, the caller's tensors as they are (no views): Knew (B, snew, Hkv, dim) /
    Vnew (B, snew, Hkv, dim_v) the new tokens; KCache (NP, page_size, Hkv, dim) / VCache (NP,
    page_size, Hkv, dim_v) in ``cache_dtype`` (a contiguous cache: one page per cache row);
    BlockTable (B, MB) int32; Seqlens (B,) int32 tokens before the append; SeqlensK (B,) int32
    out; KDescale / VDescale (B, Hkv) fp32 (read for an FP8 cache only); Q (QB, Sq, H, dim) and
    QRot out (both touched only with rotary); Cos / Sin (RO, RH) in ``rotary_dtype`` (read only
    with rotary); scalars ``sq_rot`` (Sq with rotary, else 0), ``rotary_dim`` (0: none),
    ``interleaved`` and ``per_token`` (0/1)."""
    B, SN, MB, Hkv, H, NP, PS, QB, SQ, RO, RH = T.dynamic("B, SN, MB, Hkv, H, NP, PS, QB, SQ, RO, RH")
    acc = T.float32
    fp8 = "float8" in cache_dtype

    @T.macro
    def rotated(X, b, t, h, c, pos, rotary_dim, interleaved, Cos, Sin, out):
        """``out[0]`` = feature ``c`` of ``X[b, t, h]`` after the rotary embedding at position
        ``pos`` (fp32, the reference's operation order), or the feature itself past
        ``rotary_dim``."""
        x = T.cast(X[b, t, h, c], acc)
        if c < rotary_dim:
            half = rotary_dim // 2
            first = T.if_then_else(interleaved == 1, c % 2 == 0, c < half)
            j = T.if_then_else(interleaved == 1, c // 2, T.if_then_else(c < half, c, c - half))
            partner = T.if_then_else(interleaved == 1, c + 1 - 2 * (c % 2), T.if_then_else(c < half, c + half, c - half))
            xp = T.cast(X[b, t, h, partner], acc)
            p = T.min(pos, RO - 1)  # lengths are checked on the host (debug switch on CUDA); never read past the table
            cs, sn = T.cast(Cos[p, j], acc), T.cast(Sin[p, j], acc)
            # first of a pair: x1 c - x2 s; second: x1 s + x2 c (x1 the pair's first)
            out[0] = T.if_then_else(first, _rn("sub", _rn("mul", x, cs), _rn("mul", xp, sn)),
                                    _rn("add", _rn("mul", xp, sn), _rn("mul", x, cs)))
        else:
            out[0] = x

    @T.macro
    def store(Cache, page, off, h, c, x, desc):
        """``x`` (already in q's dtype's values) into the cache: quantized for FP8."""
        if fp8:
            Cache[page, off, h, c] = T.cast(_rn("div", x, desc), cache_dtype)  # cvt.rn.satfinite: +-448
        else:
            Cache[page, off, h, c] = T.cast(x, cache_dtype)

    @T.prim_func
    def main(
        Knew: T.Tensor([B, SN, Hkv, dim], dtype),
        Vnew: T.Tensor([B, SN, Hkv, dim_v], dtype),
        KCache: T.Tensor([NP, PS, Hkv, dim], cache_dtype),
        VCache: T.Tensor([NP, PS, Hkv, dim_v], cache_dtype),
        BlockTable: T.Tensor([B, MB], T.int32),
        Seqlens: T.Tensor([B], T.int32),
        SeqlensK: T.Tensor([B], T.int32),
        KDescale: T.Tensor([B, Hkv], acc),
        VDescale: T.Tensor([B, Hkv], acc),
        Q: T.Tensor([QB, SQ, H, dim], dtype),
        QRot: T.Tensor([QB, SQ, H, dim], dtype),
        Cos: T.Tensor([RO, RH], rotary_dtype),
        Sin: T.Tensor([RO, RH], rotary_dtype),
        sq_rot: T.int32,
        rotary_dim: T.int32,
        interleaved: T.int32,
        per_token: T.int32,
    ):
        snew = SN
        with T.Kernel(B * (snew + sq_rot), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            val = T.alloc_local([1], acc)
            per = snew + sq_rot
            b = bx // per
            t = bx % per
            base = Seqlens[b]
            if t < snew:  # a new key/value token
                pos = base + t
                pg = pos // PS
                page = BlockTable[b, pg]
                off = pos - pg * PS
                for it in T.serial(T.ceildiv(Hkv * dim, THREADS)):
                    e = it * THREADS + tx
                    if e < Hkv * dim:
                        h = e // dim
                        c = e % dim
                        rotated(Knew, b, t, h, c, pos, rotary_dim, interleaved, Cos, Sin, val)
                        # the reference rounds the rotated key to q's dtype, then quantizes it
                        store(KCache, page, off, h, c, T.cast(T.cast(val[0], dtype), acc), KDescale[b, h])
                for it in T.serial(T.ceildiv(Hkv * dim_v, THREADS)):
                    e = it * THREADS + tx
                    if e < Hkv * dim_v:
                        h = e // dim_v
                        c = e % dim_v
                        store(VCache, page, off, h, c, T.cast(Vnew[b, t, h, c], acc), VDescale[b, h])
                if t == 0 and tx == 0:
                    SeqlensK[b] = base + snew
            else:  # a query token (rotary only)
                tq = t - snew
                pos = base + T.if_then_else(per_token == 1, tq, 0)
                for it in T.serial(T.ceildiv(H * dim, THREADS)):
                    e = it * THREADS + tx
                    if e < H * dim:
                        h = e // dim
                        c = e % dim
                        rotated(Q, b, tq, h, c, pos, rotary_dim, interleaved, Cos, Sin, val)
                        QRot[b, tq, h, c] = T.cast(val[0], dtype)

    return main


def launch_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, k_descale, v_descale,
                  q=None, rotary_cos=None, rotary_sin=None, rotary_interleaved: bool = True, per_token: bool = False):
    """Append k/v (B, snew, Hkv, D / Dv) to the cache at ``cache_seqlens`` (int32 (B,)) in place.
    Caches contiguous (B_cache, S_cache, Hkv, D) with ``cache_batch_idx`` or paged (NP, page,
    Hkv, D) with ``block_table``; FP8 caches quantize with ``k_descale``/``v_descale`` (B, Hkv).
    With ``rotary_cos``/``rotary_sin`` (RO, rotary_dim / 2), rotary on the new keys and on ``q``
    (B, Sq, H, D).  Returns (q, seqlens_k): q rotated (a new tensor) or as given, and int32 (B,)
    lengths after the append.  Arguments are validated by the caller (``kvcache.validate``)."""
    b, snew, hkv, d = k.shape
    dv = v.shape[-1]
    dev = k.device
    seqlens_k = torch.empty_like(cache_seqlens)
    if b == 0:
        return q, seqlens_k
    rotary = rotary_cos is not None
    table = page_table(block_table, cache_batch_idx, b, dev)
    fp8 = k_cache.dtype != k.dtype
    dtype, cache_dtype = launch.dtype_name(k.dtype), launch.dtype_name(k_cache.dtype)
    rotary_dtype = launch.dtype_name(rotary_cos.dtype) if rotary else "float32"
    kernel = launch.memo(("append", d, dv, dtype, cache_dtype, rotary_dtype),
                         lambda: _kernel(d, dv, dtype, cache_dtype, rotary_dtype))
    if rotary:
        sq = q.shape[1]
        cos, sin = rotary_cos.contiguous(), rotary_sin.contiguous()
        q = q.contiguous()
        q_in, q_out = q, debug.new_output(q.shape, q.dtype, dev)
    else:  # the kernel touches neither
        sq = 0
        cos = sin = launch.placeholder((1, 1), dev)
        q_in = q_out = launch.constant("empty", (1, 1, 1, d), k.dtype, dev)
    kdesc, vdesc = descale_args(k_descale, v_descale, fp8, b, hkv, dev)
    kernel(k.contiguous(), v.contiguous(), k_cache, v_cache, table, cache_seqlens.contiguous(), seqlens_k, kdesc, vdesc,
           q_in, q_out, cos, sin, sq, 2 * cos.shape[1] if rotary else 0, int(rotary_interleaved), int(per_token))
    return (q_out if rotary else q), seqlens_k


def _kernel(d, dv, dtype, cache_dtype, rotary_dtype):
    from . import cache

    return cache.get(append_kernel, None, dim=d, dim_v=dv, dtype=dtype, cache_dtype=cache_dtype,
                     rotary_dtype=rotary_dtype)


def get_append_kernels(dim: int, dim_v: int, dtype: str, cache_dtype: str | None = None):
    """The append kernels of one decode structure (``precompile``): cos/sin in float32 and in
    q's dtype (flash-attn's callers pass either)."""
    cache_dtype = cache_dtype or dtype
    return [_kernel(dim, dim_v, dtype, cache_dtype, r) for r in ("float32", dtype)]
