"""``flash_attn_with_kvcache``: attention of new query tokens over a (paged) KV cache, with an
in-place append of the new keys/values and optional rotary embedding (flash-attn's semantics).

Inference only: there is no gradient through it (as in flash-attn).  The work is two
``torch.library`` custom ops with fake implementations, so ``torch.compile(fullgraph=True)``
traces a call: ``flashtile::kvcache_append`` (declared to mutate ``k_cache`` and ``v_cache``)
and ``flashtile::kvcache_fwd`` (pure: the attention).

Steps (the same on CPU and CUDA; only the last one differs):
1. rotary (if ``rotary_cos``/``rotary_sin``): new k at positions ``cache_seqlens[b] + i``; q at
   ``cache_seqlens[b] + t`` when causal or windowed, else every token of q at
   ``cache_seqlens[b]`` (flash-attn's convention); fp32 math, rounded to the input dtype;
2. append: new k/v are written into the cache in place at ``cache_seqlens[b] + i`` (through
   ``block_table`` for a paged cache), by torch indexing ops (exact, no sync);
3. attention of q over cache positions ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)``,
   bottom-right aligned on that length (``off = seqlen_k - seqlen_q``): CPU tensors run the
   exact reference (``reference.kvcache_attention``), CUDA tensors the TileLang split-KV decode
   kernel (``kernels/decode.py``) and, with several splits, the combine kernel
   (``kernels/combine.py``).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import Tensor

from . import ops, reference
from .fp8 import DTYPE as FP8
from .fp8 import saturate
from .interface import normalize_window
from .lazy import lazy_module
from .validation import (check_chunk, check_descales, check_flag, check_scale, check_sinks, check_softcap, check_window, describe, fail,
                         is_int, reject_unsupported)

FN = "flash_attn_with_kvcache"
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CACHE_DTYPES = DTYPES + (FP8,)
# (k_cache's, v_cache's) layout in messages, contiguous and paged: built once, not per call.
_CACHE_LAYOUTS = {
    paged: (layout, layout.replace("headdim)", "headdim_v)"))
    for paged, layout in ((False, "(batch_cache, seqlen_cache, nheads_kv, headdim)"),
                          (True, "(num_blocks, page_size, nheads_kv, headdim)"))
}
MAX_HEADDIM = 256


def _fail(kind, arg, expected, given):
    fail(FN, kind, arg, expected, given)


# --- validation -----------------------------------------------------------------------------


def _tensor(name, x, rank, layout, dtypes=DTYPES):
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", describe(x))
    if x.dim() != rank:
        _fail(ValueError, name, f"a {rank}-D tensor {layout}", f"shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        _fail(TypeError, f"{name}.dtype", "one of " + ", ".join(str(d).removeprefix("torch.") for d in dtypes), x.dtype)


def _int_tensor(name, x, shape, layout, device):
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", describe(x))
    if x.dtype != torch.int32:
        _fail(TypeError, f"{name}.dtype", "torch.int32", x.dtype)
    if tuple(x.shape) != tuple(shape):
        _fail(ValueError, name, f"shape {layout} = {tuple(shape)}", f"shape {tuple(x.shape)}")
    if x.device != device:
        _fail(ValueError, f"{name}.device", f"q's device {device}", x.device)


def validate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, sinks, softcap, rotary_interleaved, num_splits, return_lse,
             k_descale=None, v_descale=None):
    """Refuse bad input before any work (ValueError/TypeError naming argument, expectation, value)."""
    _tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    paged = block_table is not None
    k_layout, v_layout = _CACHE_LAYOUTS[paged]
    _tensor("k_cache", k_cache, 4, k_layout, _CACHE_DTYPES)
    _tensor("v_cache", v_cache, 4, v_layout, _CACHE_DTYPES)
    dev = q.device
    fp8 = k_cache.dtype == FP8
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        want = FP8 if fp8 else q.dtype
        if x.dtype != want:
            _fail(TypeError, f"{name}.dtype", f"q's dtype {q.dtype} or float8_e4m3fn for both caches", x.dtype)
        if x.device != dev:
            _fail(ValueError, f"{name}.device", f"q's device {dev}", x.device)
        if x.stride(-1) != 1 and x.numel() > 0:  # an empty cache's strides mean nothing
            _fail(ValueError, f"{name}", "contiguous in its last dim (it is updated in place)", f"strides {x.stride()}")
    b, sq, h, d = q.shape
    nblocks, page, hkv, dk = k_cache.shape
    dv = v_cache.shape[-1]
    if tuple(v_cache.shape[:3]) != (nblocks, page, hkv):
        _fail(ValueError, "v_cache.shape[:3]", f"k_cache's {(nblocks, page, hkv)}", tuple(v_cache.shape[:3]))
    if dk != d:
        _fail(ValueError, "k_cache.shape[3] (headdim)", f"q's headdim {d}", dk)
    if hkv == 0:
        _fail(ValueError, "nheads_kv (k_cache.shape[2])", "at least 1", 0)
    if h % hkv != 0:
        _fail(ValueError, "nheads (q.shape[2])", f"a multiple of nheads_kv={hkv}", h)
    for name, dim in (("headdim", d), ("headdim_v", dv)):
        if not 1 <= dim <= MAX_HEADDIM:
            _fail(ValueError, name, f"between 1 and {MAX_HEADDIM}", dim)
    if page == 0:
        _fail(ValueError, "k_cache.shape[1] (page_size / seqlen_cache)", "at least 1", 0)
    if paged:
        if not isinstance(block_table, torch.Tensor):
            _fail(TypeError, "block_table", "None or a torch.Tensor", describe(block_table))
        if block_table.dtype != torch.int32:
            _fail(TypeError, "block_table.dtype", "torch.int32", block_table.dtype)
        if block_table.dim() != 2 or block_table.shape[0] != b or block_table.shape[1] == 0:
            _fail(ValueError, "block_table", f"shape (batch, max_blocks_per_seq) = ({b}, >=1)", f"shape {tuple(block_table.shape)}")
        if block_table.device != dev:
            _fail(ValueError, "block_table.device", f"q's device {dev}", block_table.device)
        if cache_batch_idx is not None:
            _fail(ValueError, "cache_batch_idx", "None with a paged cache (block_table picks the pages)", describe(cache_batch_idx))
    elif cache_batch_idx is None and nblocks != b:
        _fail(ValueError, "k_cache.shape[0] (batch_cache)", f"q's batch {b} when cache_batch_idx is None", nblocks)
    capacity = cache_capacity(k_cache, block_table)
    if fp8 or k_descale is not None or v_descale is not None:  # nothing to check (or format) otherwise
        check_descales(FN, (("k_descale", k_descale), ("v_descale", v_descale)), fp8, b, hkv, dev, "a float8_e4m3fn cache",
                       f"a {k_cache.dtype} cache (descales go with a float8_e4m3fn cache)")
    if cache_batch_idx is not None:
        _int_tensor("cache_batch_idx", cache_batch_idx, (b,), "(batch,)", dev)
    if cache_leftpad is not None:
        _int_tensor("cache_leftpad", cache_leftpad, (b,), "(batch,)", dev)
    if cache_seqlens is None:  # flash-attn's meaning: every sequence fills the cache (nothing appended)
        if k is not None:
            _fail(ValueError, "cache_seqlens", "given when k and v are appended (it says where they go)", "None")
        cache_seqlens = capacity
    if isinstance(cache_seqlens, torch.Tensor):
        _int_tensor("cache_seqlens", cache_seqlens, (b,), "(batch,)", dev)
    elif is_int(cache_seqlens):
        if not 0 <= cache_seqlens <= capacity:
            _fail(ValueError, "cache_seqlens", f"between 0 and the cache capacity {capacity}", cache_seqlens)
    else:
        _fail(TypeError, "cache_seqlens", "an int or an int32 tensor (batch,)", describe(cache_seqlens))
    snew = 0
    if (k is None) != (v is None):
        _fail(ValueError, "k and v", "both given or both None", f"k {describe(k)}, v {describe(v)}")
    if k is not None:
        _tensor("k", k, 4, "(batch, seqlen_new, nheads_kv, headdim)")
        _tensor("v", v, 4, "(batch, seqlen_new, nheads_kv, headdim_v)")
        snew = k.shape[1]
        if tuple(k.shape) != (b, snew, hkv, d):
            _fail(ValueError, "k", f"shape (batch, seqlen_new, nheads_kv, headdim) = ({b}, {snew}, {hkv}, {d})", f"shape {tuple(k.shape)}")
        if tuple(v.shape) != (b, snew, hkv, dv):
            _fail(ValueError, "v", f"shape (batch, seqlen_new, nheads_kv, headdim_v) = ({b}, {snew}, {hkv}, {dv})", f"shape {tuple(v.shape)}")
        for name, x in (("k", k), ("v", v)):
            if x.dtype != q.dtype:
                _fail(TypeError, f"{name}.dtype", f"q's dtype {q.dtype}", x.dtype)
            if x.device != dev:
                _fail(ValueError, f"{name}.device", f"q's device {dev}", x.device)
        if snew > capacity:
            _fail(ValueError, "k.shape[1] (seqlen_new)", f"at most the cache capacity {capacity}", snew)
    if (rotary_cos is None) != (rotary_sin is None):
        _fail(ValueError, "rotary_cos and rotary_sin", "both given or both None", f"{describe(rotary_cos)}, {describe(rotary_sin)}")
    if rotary_cos is not None:
        if k is None:
            _fail(ValueError, "k and v", "given when rotary_cos/rotary_sin are (rotary applies to the appended keys)", "None")
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _tensor(name, x, 2, "(seqlen_ro, rotary_dim / 2)")
            if x.device != dev:
                _fail(ValueError, f"{name}.device", f"q's device {dev}", x.device)
        if rotary_sin.shape != rotary_cos.shape:
            _fail(ValueError, "rotary_sin", f"rotary_cos's shape {tuple(rotary_cos.shape)}", f"shape {tuple(rotary_sin.shape)}")
        rd = 2 * rotary_cos.shape[1]
        if not 0 < rd <= d:
            _fail(ValueError, "rotary_dim (2 * rotary_cos.shape[1])", f"between 2 and headdim {d}", rd)
    if not isinstance(rotary_interleaved, bool):
        _fail(TypeError, "rotary_interleaved", "a bool", describe(rotary_interleaved))
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            _fail(TypeError, name, "a bool (True or False)", describe(flag))
    check_scale(FN, "softmax_scale", softmax_scale)
    check_window(FN, window_size)
    check_softcap(FN, softcap)
    check_sinks(FN, sinks, h, dev)
    if not is_int(num_splits):
        _fail(TypeError, "num_splits", "an int (0 = heuristic)", describe(num_splits))
    if num_splits < 0:
        _fail(ValueError, "num_splits", ">= 0 (0 = heuristic)", num_splits)
    _check_lengths(q, cache_seqlens, cache_leftpad, rotary_cos, causal or tuple(window_size) != (-1, -1), snew, capacity, sq)
    _check_indices(k_cache, cache_seqlens, cache_batch_idx, block_table, snew)


def cache_capacity(k_cache: Tensor, block_table: Optional[Tensor]) -> int:
    """Keys a sequence's cache holds: seqlen_cache, or max_blocks_per_seq * page_size paged."""
    return k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])


def _check_lengths(q, cache_seqlens, cache_leftpad, rotary_cos, per_token, snew, capacity, sq):
    """Checks on the contents of length tensors: always on CPU; on CUDA (a device sync) only
    with ``FLASHTILE_CHECK_SEQLENS=1``; never while torch.compile traces (data-dependent)."""
    if torch.compiler.is_compiling():
        return
    if not isinstance(cache_seqlens, torch.Tensor):
        seq = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int64)
    elif cache_seqlens.device.type == "cpu" or os.environ.get("FLASHTILE_CHECK_SEQLENS") == "1":
        seq = cache_seqlens.detach().to("cpu", torch.int64)
    else:
        return
    if seq.numel() == 0:
        return
    if int(seq.min()) < 0:
        _fail(ValueError, "cache_seqlens", "non-negative", seq.tolist())
    if int(seq.max()) + snew > capacity:
        _fail(ValueError, "cache_seqlens + seqlen_new", f"at most the cache capacity {capacity} for every sequence", (seq + snew).tolist())
    if cache_leftpad is not None and _readable(cache_leftpad):
        lp = cache_leftpad.detach().to("cpu", torch.int64)
        if int(lp.min()) < 0 or bool((lp > seq).any()):
            _fail(ValueError, "cache_leftpad", "between 0 and cache_seqlens for every sequence", lp.tolist())
    if rotary_cos is not None:
        last = int(seq.max()) + max(snew, sq if per_token else 1)
        if last > rotary_cos.shape[0]:
            _fail(ValueError, "rotary_cos.shape[0] (seqlen_ro)", f"at least cache_seqlens + max(seqlen_new, seqlen_q) = {last}", rotary_cos.shape[0])


def _readable(t) -> bool:
    """Contents of ``t`` may be checked: a CPU tensor, or any with FLASHTILE_CHECK_SEQLENS=1."""
    return t.device.type == "cpu" or os.environ.get("FLASHTILE_CHECK_SEQLENS") == "1"


def _check_indices(k_cache, cache_seqlens, cache_batch_idx, block_table, snew):
    """cache_batch_idx within the cache's rows; the pages a sequence uses within the cache
    (entries past a sequence's end are never read and may hold anything, e.g. -1).  Same
    conditions as ``_check_lengths``."""
    if torch.compiler.is_compiling():
        return
    if cache_batch_idx is not None and cache_batch_idx.numel() and _readable(cache_batch_idx):
        idx = cache_batch_idx.detach().to("cpu", torch.int64)
        if int(idx.min()) < 0 or int(idx.max()) >= k_cache.shape[0]:
            _fail(ValueError, "cache_batch_idx", f"indices into the cache's {k_cache.shape[0]} rows", idx.tolist())
    if block_table is not None and block_table.numel() and _readable(block_table):
        seq = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else torch.full((block_table.shape[0],), int(cache_seqlens))
        if not _readable(seq):
            return
        used = (seq.detach().to("cpu", torch.int64) + snew + k_cache.shape[1] - 1) // k_cache.shape[1]  # pages per sequence
        table = block_table.detach().to("cpu", torch.int64)
        live = torch.arange(table.shape[1])[None, :] < used[:, None]
        bad = live & ((table < 0) | (table >= k_cache.shape[0]))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            _fail(ValueError, f"block_table[{b}, {j}]", f"a page index in [0, {k_cache.shape[0]}) (the sequence uses that page)", int(table[b, j]))


# --- host-side steps shared by every device -------------------------------------------------


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of the first ``2 * cos.shape[1]`` features of ``x`` (b, s, h, d) at
    integer ``positions`` (b, s): interleaved pairs (x0, x1), (x2, x3), ... (GPT-J) or halves
    (GPT-NeoX).  fp32 math (float64 for float64), result in x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = cos.shape[1]
    c = cos.to(acc)[positions][:, :, None, :]
    s = sin.to(acc)[positions][:, :, None, :]
    xr = x[..., : 2 * half].to(acc)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half :]), dim=-1)


def rotate_new_tokens(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, cache_seqlens: Tensor, interleaved: bool,
                      per_token: bool) -> tuple[Tensor, Tensor]:
    """(q, k) after the rotary embedding at flash-attn's positions: query token t at
    ``cache_seqlens + t`` when ``per_token`` (causal or local), else every token at
    ``cache_seqlens``; new key i at ``cache_seqlens + i``.  fp32 math (``apply_rotary``)."""
    base = cache_seqlens.long()[:, None]
    sq, snew = q.shape[1], k.shape[1]
    steps = torch.arange(sq, device=q.device) if per_token else torch.zeros(sq, dtype=torch.long, device=q.device)
    return (apply_rotary(q, cos, sin, base + steps, interleaved),
            apply_rotary(k, cos, sin, base + torch.arange(snew, device=q.device), interleaved))


def append_kv(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, k_descale=None,
              v_descale=None) -> None:
    """Write k/v (b, s_new, h_kv, d) into the caches in place at ``cache_seqlens[b] + i``; into
    an FP8 cache quantized with the entry's descales (``x / descale[b, j]``, rounded to nearest,
    saturated at +-448: a token outside the scale's range is clipped, so choose descales with
    headroom)."""
    b, snew = k.shape[:2]
    if k_cache.dtype == FP8:
        k = saturate(k.float() / k_descale[:, None, :, None])
        v = saturate(v.float() / v_descale[:, None, :, None])
    # (b, snew) positions; one new token (plain decoding) needs no arange and no add.  Index
    # tensors broadcast, so the rows stay (b, 1): fewer tensor ops, each host time per step.
    pos = cache_seqlens.long()[:, None]
    if snew != 1:
        pos = pos + torch.arange(snew, device=k.device)
    if block_table is None:
        rows = torch.arange(b, device=k.device) if cache_batch_idx is None else cache_batch_idx.long()
        index = (rows[:, None], pos)
    else:
        page = k_cache.shape[1]
        index = (block_table.long().gather(1, pos // page), pos % page)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


_decode = lazy_module("flashtile.kernels.decode")  # imports TileLang: a CPU-only user never does
_append = lazy_module("flashtile.kernels.append")
_target = lazy_module("flashtile.kernels.target")


def _append_kernel_runs(k_cache, k) -> bool:
    """The append runs as one kernel (``kernels/append.py``, built for Hopper): a CUDA cache on
    an sm_90 GPU with 16-bit new tokens.  Anything else (CPU, float32, other GPUs) takes
    ``append_kv``'s tensor ops."""
    return k_cache.is_cuda and k.dtype in (torch.float16, torch.bfloat16) and _target().capability(k_cache.device)[0] == 9


def _attend(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table, sinks, softmax_scale,
            window_left, window_right, softcap, num_splits, k_descale, v_descale):
    window = (window_left, window_right)
    if q.is_cuda:
        out, lse = _decode().launch_decode(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table,
                                    sinks, softmax_scale, window, softcap, num_splits, k_descale, v_descale)
    elif q.is_cpu:
        out, lse = reference.kvcache_attention(q, k_cache, v_cache, seqlens_k, softmax_scale, window, sinks, softcap,
                                               cache_batch_idx, cache_leftpad, block_table, k_descale, v_descale)
    else:
        raise NotImplementedError(f"{FN}: no implementation for device type {q.device.type!r}")
    return out.contiguous(), lse.contiguous()


# Two custom ops, not one: the append is the only mutation, and PyTorch's ADInplaceOrView
# kernel for a mutating custom op rebuilds the schema's argument list once per argument
# (torch._library.utils.fill_defaults), quadratic in the argument count: ~150 us per eager call
# with the 20 arguments of a single op, measured on this CPU.  A decode step without new tokens
# now pays no mutation path at all, and the append op has 9 arguments.


@torch.library.custom_op("flashtile::kvcache_append", mutates_args=("k_cache", "v_cache"))
def kvcache_append(
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor,
    v: Tensor,
    cache_seqlens: Tensor,
    cache_batch_idx: Optional[Tensor],
    block_table: Optional[Tensor],
    k_descale: Optional[Tensor],
    v_descale: Optional[Tensor],
) -> None:
    """Write k/v into the caches in place at ``cache_seqlens`` (``append_kv``; on CUDA its kernel)."""
    with torch.no_grad():
        if _append_kernel_runs(k_cache, k):
            _append().launch_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, k_descale,
                                    v_descale)
        else:
            append_kv(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, k_descale, v_descale)


@kvcache_append.register_fake
def _(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, k_descale, v_descale):
    return None


@torch.library.custom_op("flashtile::kvcache_fwd", mutates_args=())
def kvcache_fwd(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seqlens_k: Tensor,
    cache_batch_idx: Optional[Tensor],
    cache_leftpad: Optional[Tensor],
    block_table: Optional[Tensor],
    sinks: Optional[Tensor],
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of q over cache positions ``[cache_leftpad, seqlens_k)`` (after any append)."""
    with torch.no_grad():
        return _attend(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table, sinks,
                       softmax_scale, window_left, window_right, softcap, num_splits, k_descale, v_descale)


@kvcache_fwd.register_fake
def _(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table, sinks, softmax_scale, window_left,
      window_right, softcap, num_splits, k_descale=None, v_descale=None):
    b, sq, h, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(b, sq, h, v_cache.shape[-1]), q.new_empty(b, h, sq, dtype=acc)


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    cache_seqlens=None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    sinks: Optional[Tensor] = None,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    num_splits: int = 0,
    return_lse: bool = False,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    *,
    alibi_slopes: None = None,
    return_softmax_lse: bool = False,
    attention_chunk: int = 0,
):
    """Attention of ``q`` over a KV cache, appending new keys/values in place (decoding).

    Drop-in for ``flash_attn.flash_attn_with_kvcache``.  Inference only: no gradient flows
    through this function (k_cache / v_cache are modified in place).

    Args:
        q: (batch, seqlen_q, nheads, headdim): the new query tokens (1 for plain decoding,
            a few for speculative decoding, any number for chunked prefill).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_kv, headdim / headdim_v), or with
            ``block_table`` a paged cache (num_blocks, page_size, nheads_kv, headdim / headdim_v)
            with any page_size >= 1.  Same dtype and device as q; last dim contiguous.
        k, v: None, or (batch, seqlen_new, nheads_kv, headdim / headdim_v) written into the
            cache in place at positions ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1``.
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2): rotary embedding applied
            to the new k (positions ``cache_seqlens[b] + i``) and to q (positions
            ``cache_seqlens[b] + t`` when causal or windowed, else ``cache_seqlens[b]`` for every
            token), on the first ``rotary_dim`` features; needs k and v.
        cache_seqlens: int, or int32 (batch,): tokens already in each sequence's cache.  None
            (flash-attn's default): every sequence fills the cache, i.e. its capacity
            ``seqlen_cache`` (paged: ``max_blocks_per_seq * page_size``); not with new k / v.
        cache_batch_idx: None, or int32 (batch,): cache row of each batch entry (contiguous
            caches only; default ``arange(batch)``).
        cache_leftpad: None, or int32 (batch,): first valid cache position; keys before it are
            invisible.
        block_table: None, or int32 (batch, max_blocks_per_seq): page of each logical block;
            cache position j of entry b lives at ``k_cache[block_table[b, j // page_size],
            j % page_size]``.
        softmax_scale: default ``1 / sqrt(headdim)``.
        causal: bottom-right aligned over the keys ``[cache_leftpad, cache_seqlens + seqlen_new)``:
            token t sees keys up to ``cache_seqlens + seqlen_new - seqlen_q + t``.
        window_size, sinks, softcap: as in ``flash_attn_func``.
        rotary_interleaved: GPT-J style pairs (True) or GPT-NeoX halves (False).
        num_splits: key-range splits per sequence on CUDA (0 = heuristic from batch, heads,
            cache length and the SM count; 1 = no split); ignored on CPU.
        return_lse: also return lse (batch, nheads, seqlen_q) float32, natural log.
        k_descale, v_descale: with an FP8 cache (k_cache and v_cache in float8_e4m3fn), float32
            (batch, nheads_kv): entry b's cached keys of kv head j stand for
            ``k8.float() * k_descale[b, j]`` (flash-attn 3's convention; ``flashtile.fp8``).
            New k/v (in q's dtype) are quantized with them when appended (``k / k_descale``,
            saturated at +-448).  q and the output stay in q's dtype; CUDA needs bf16/fp16 q.
            None otherwise.
        alibi_slopes: keyword only, flash-attn 2's name; must be None (NotImplementedError).
        return_softmax_lse: keyword only, flash-attn's name for ``return_lse`` (either returns
            lse).
        attention_chunk: keyword only, int >= 0 (flash-attn 3; Llama 4's chunked layers): > 0
            restricts each query token to the keys of its own chunk of this many positions
            from cache position 0 (``flashtile.chunked``).  With more than one query token it
            needs ``causal=True``; one attention call per chunk the tokens touch.

    flash-attn 2's positional order up to ``window_size``; after it flash-attn 2 has
    ``softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse`` where this
    function has ``sinks, softcap, rotary_interleaved, num_splits, return_lse``: pass those by
    keyword (a softcap given in the sinks position is refused: sinks must be a tensor).

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype, or ``(out, lse)``.
    """
    reject_unsupported(FN, alibi_slopes=alibi_slopes)
    check_flag(FN, "return_softmax_lse", return_softmax_lse)
    check_chunk(FN, attention_chunk)
    if return_softmax_lse and return_lse is False:  # either name asks for lse (a bad return_lse: validate names it)
        return_lse = True
    validate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, sinks, softcap, rotary_interleaved, num_splits, return_lse,
             k_descale, v_descale)
    if attention_chunk and q.shape[1] > 1 and causal is not True:
        raise NotImplementedError(f"{FN}: attention_chunk with more than one query token needs causal=True "
                                  f"(got seqlen_q={q.shape[1]}, causal={causal})")
    if cache_seqlens is None:  # the whole cache (validate refused it with new tokens)
        cache_seqlens = cache_capacity(k_cache, block_table)
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    left, right = normalize_window(causal, window_size)
    snew = 0 if k is None else k.shape[1]
    # Plain eager (nothing traced, no autograd to record): the implementations directly, without
    # the custom ops' dispatch (tens of microseconds of Python per call); traced: the ops.
    tensors = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, sinks,
               k_descale, v_descale)
    direct = ops.eager_route(q.device, *tensors) == "impl"
    per_token = left >= 0 or right >= 0
    with torch.no_grad():
        if direct and snew and _append_kernel_runs(k_cache, k):
            # One launch for rotary, the append and the new lengths (eager CUDA: the tensor ops
            # below are a dozen launches, ~60 us of host time per step on an H100's host).  The
            # decode kernel's unsupported cases are refused first: nothing is appended then.
            _decode().require_kernel(q, k_cache, v_cache)
            q, seqlens_k = _append().launch_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                                                   k_descale, v_descale, q, rotary_cos, rotary_sin, rotary_interleaved,
                                                   per_token)
        else:
            if rotary_cos is not None:
                q, k = rotate_new_tokens(q, k, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved, per_token)
            if snew:
                append = append_kv if direct else kvcache_append
                append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, k_descale, v_descale)
            seqlens_k = cache_seqlens + snew if snew else cache_seqlens

    def attend(q, seqlens_k, leftpad):
        args = (q, k_cache, v_cache, seqlens_k, cache_batch_idx, leftpad, block_table, sinks, float(softmax_scale),
                left, right, float(softcap), int(num_splits), k_descale, v_descale)
        if direct:
            with torch.no_grad():
                return _attend(*args)
        return kvcache_fwd(*args)

    if attention_chunk:
        out, lse = attend_chunked(attend, q, seqlens_k, cache_leftpad, int(attention_chunk))
    else:
        out, lse = attend(q, seqlens_k, cache_leftpad)
    return (out, lse) if return_lse else out


def attend_chunked(attend, q, seqlens_k, cache_leftpad, chunk: int):
    """(out, lse) with chunks of ``chunk`` cache positions: query token t of entry b sits at
    position ``pos = seqlens_k[b] - seqlen_q + t`` and sees the keys of its chunk up to itself,
    ``[max(cache_leftpad, chunk * floor(pos / chunk)), pos]``.

    The seqlen_q consecutive positions of an entry touch at most ``ceil((seqlen_q - 1) / chunk)
    + 1`` chunks (a host bound), so that many ``attend`` calls cover every token: call j runs all
    tokens with each entry's (first chunk + j)-th chunk start as its left pad, over the whole
    sequence (so every row keeps its bottom-right position; causal, validated for several
    tokens, keeps a row inside its chunk), and keeps the rows whose chunk that is.  One call for
    one token or a short run, all on the device (no sync; CUDA-graph safe)."""
    sq = q.shape[1]
    if sq == 0:
        return attend(q, seqlens_k, cache_leftpad)
    first = seqlens_k.long() - sq  # each entry's position of token 0
    chunk0 = torch.div(first, chunk, rounding_mode="floor")
    calls = -(-(sq - 1) // chunk) + 1
    lens = seqlens_k.long()
    out = lse = None
    for j in range(calls):
        start = (chunk0 + j) * chunk
        leftpad = start.clamp(min=0) if cache_leftpad is None else torch.maximum(start, cache_leftpad.long())
        o, l = attend(q, seqlens_k, torch.minimum(leftpad, lens).to(torch.int32))
        if out is None:
            out, lse = o, l
            continue
        pos = first[:, None] + torch.arange(sq, device=q.device)[None, :]
        rows = torch.div(pos, chunk, rounding_mode="floor") == (chunk0 + j)[:, None]  # (batch, seqlen_q)
        out = torch.where(rows[:, :, None, None], o, out)
        lse = torch.where(rows[:, None, :], l, lse)
    return out, lse
