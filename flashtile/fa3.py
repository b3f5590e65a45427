"""flash-attn 3's Python interface (``flash_attn_interface``, the ``hopper/`` package) on flashtile.

Swap one import::

    from flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flashtile.fa3 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

and keep every call site: the arguments bind as in flash-attn 3 and the returns have its
shapes.  ``flashtile.flash_attn_func`` itself follows flash-attn 2, whose positional order
differs::

    flash-attn 2 / flashtile:  flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, ...)
    flash-attn 3 / this module: flash_attn_func(q, k, v, softmax_scale, causal, qv, q_descale, k_descale,
                                                v_descale, window_size, attention_chunk, softcap, ...)

What each flash-attn 3 argument does here:

==========================================  ===================================================
``softmax_scale, causal, window_size,``     the same meaning (causal and windows bottom-right
``softcap, deterministic``                  aligned); computed by flashtile's kernels
``q_descale, k_descale, v_descale``         FP8 (float8_e4m3fn) inputs: float32 (batch,
                                            nheads_kv); a descale left None counts as 1.0, as in
                                            flash-attn 3.  Output bfloat16.
``return_attn_probs`` /                     ``(out, softmax_lse)`` instead of ``out``
``return_softmax_lse``
``num_splits``                              kvcache: key-range splits (0 = heuristic); dense
                                            and varlen: accepted, flashtile schedules itself
``pack_gqa, sm_margin,``                    scheduling hints of flash-attn 3's kernels:
``scheduler_metadata``                      checked for type, no effect on the result
``page_table``                              flashtile's ``block_table`` (any page size)
``attention_chunk``                         chunked local attention (``flashtile.chunked``)
``qv``,                                     not implemented: anything but None raises
``cu_seqlens_q`` / ``cu_seqlens_k_new`` /   ``NotImplementedError`` naming the argument
``max_seqlen_q`` / ``rotary_seqlens``
(kvcache)
==========================================  ===================================================

Also ``flash_attn_combine`` (merging split results by their lse; torch ops) and
``get_scheduler_metadata`` (returns None).  Extras, keyword-only: ``sinks`` (per-head sink
logits, as in ``flashtile.flash_attn_func``).

FP8 in the KV-cache call: flash-attn 3 takes q and the new k / v in float8_e4m3fn beside an
FP8 cache.  flashtile's FP8 cache takes a 16-bit q and 16-bit new tokens, quantizing them on
append, so here an FP8 q is dequantized to bfloat16 (``q8 * q_descale``) and FP8 new k / v
are dequantized with the cache's descales and re-quantized on append, which stores their
original bytes again (the round trip through bfloat16 is exact for every e4m3 value).

Gradients flow through ``flash_attn_func`` and ``flash_attn_varlen_func`` as through
flashtile's own functions (q, k, v, sinks, and through ``softmax_lse``).  Validation errors
name flashtile's function of the same name (``flash_attn_func: ...``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import fp8, interface, kvcache, varlen
from .fp8 import DTYPE as FP8
from .validation import check_flag, describe, fail, is_int

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine",
           "get_scheduler_metadata"]


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    qv: None = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    *,
    sinks: Optional[Tensor] = None,
):
    """flash-attn 3's ``flash_attn_func``: exact attention of q (batch, seqlen_q, nheads,
    headdim) over k (batch, seqlen_k, nheads_kv, headdim) and v (batch, seqlen_k, nheads_kv,
    headdim_v).

    Returns out (batch, seqlen_q, nheads, headdim_v), or ``(out, softmax_lse)`` with
    ``return_attn_probs`` (lse (batch, nheads, seqlen_q) float32).  Arguments as in the module
    docstring and ``flashtile.flash_attn_func``.
    """
    fn = interface.FN
    _check_fa3_options(fn, qv, num_splits, pack_gqa, sm_margin, return_attn_probs)
    descales = _fp8_descales(q, k, q_descale, k_descale, v_descale, q.shape[0] if _is_tensor(q) else 0)
    return interface.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                     softcap=softcap, deterministic=deterministic, sinks=sinks,
                                     return_lse=return_attn_probs, attention_chunk=attention_chunk, **descales)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    qv: None = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    *,
    sinks: Optional[Tensor] = None,
):
    """flash-attn 3's ``flash_attn_varlen_func``: packed sequences, q (total_q, nheads,
    headdim), k / v (total_k, nheads_kv, headdim / headdim_v), ``cu_seqlens_*`` int32 (batch +
    1,), ``max_seqlen_*`` Python ints, ``seqused_*`` None or int32 (batch,).

    Returns out (total_q, nheads, headdim_v), or ``(out, softmax_lse)`` with
    ``return_attn_probs`` (lse (nheads, total_q) float32).  Semantics as in
    ``flashtile.flash_attn_varlen_func``.
    """
    fn = varlen.FN
    _check_fa3_options(fn, qv, num_splits, pack_gqa, sm_margin, return_attn_probs)
    batch = cu_seqlens_q.shape[0] - 1 if _is_tensor(cu_seqlens_q) and cu_seqlens_q.dim() == 1 else 0
    descales = _fp8_descales(q, k, q_descale, k_descale, v_descale, batch)
    return varlen.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                         softcap=softcap, deterministic=deterministic, sinks=sinks,
                                         return_lse=return_attn_probs, seqused_q=seqused_q, seqused_k=seqused_k,
                                         attention_chunk=attention_chunk, **descales)


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    qv: None = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    cache_seqlens=None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    page_table: Optional[Tensor] = None,
    cu_seqlens_q: None = None,
    cu_seqlens_k_new: None = None,
    max_seqlen_q: None = None,
    rotary_seqlens: None = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: Optional[Tensor] = None,
    num_splits: int = 0,
    pack_gqa: Optional[bool] = None,
    sm_margin: int = 0,
    return_softmax_lse: bool = False,
    *,
    sinks: Optional[Tensor] = None,
):
    """flash-attn 3's ``flash_attn_with_kvcache``: q (batch, seqlen_q, nheads, headdim) over a
    contiguous (batch_cache, seqlen_cache, nheads_kv, headdim) or paged (num_blocks, page_size,
    nheads_kv, headdim) cache addressed through ``page_table`` (batch, max_blocks_per_seq),
    appending new k / v (batch, seqlen_new, nheads_kv, headdim) in place at ``cache_seqlens``.

    Returns out (batch, seqlen_q, nheads, headdim_v), or ``(out, softmax_lse)`` with
    ``return_softmax_lse`` (flash-attn 3 returns two more internal buffers after them, so its
    callers unpack ``out, lse, *rest``, which binds the same here).  Semantics as in
    ``flashtile.flash_attn_with_kvcache``; FP8 as in the module docstring.
    """
    fn = kvcache.FN
    _reject_fa3_only(fn, qv=qv, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k_new=cu_seqlens_k_new, max_seqlen_q=max_seqlen_q, rotary_seqlens=rotary_seqlens)
    _check_hints(fn, pack_gqa=pack_gqa, sm_margin=sm_margin)
    if scheduler_metadata is not None and not _is_tensor(scheduler_metadata):
        fail(fn, TypeError, "scheduler_metadata", "None or a torch.Tensor (a hint; flashtile schedules itself)",
             describe(scheduler_metadata))
    if _is_tensor(k_cache) and k_cache.dtype == FP8 and _is_tensor(q):
        q, k, v, k_descale, v_descale = _fp8_cache_inputs(fn, q, k, v, q_descale, k_descale, v_descale, k_cache)
    elif q_descale is not None:
        fail(fn, ValueError, "q_descale", "None unless q and the caches are float8_e4m3fn", describe(q_descale))
    return kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
        softmax_scale, causal, window_size, sinks, softcap, rotary_interleaved, num_splits, return_softmax_lse,
        k_descale, v_descale, attention_chunk=attention_chunk,
    )


def flash_attn_combine(out_partial: Tensor, lse_partial: Tensor, out: Optional[Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None):
    """flash-attn 3's ``flash_attn_combine``: merge attention results over disjoint key ranges
    (split-KV, cascade or ring attention) by their lse.

    out_partial (num_splits, batch, seqlen, nheads, headdim) float32, lse_partial (num_splits,
    batch, seqlen, nheads) float32 -> (out (batch, seqlen, nheads, headdim) in ``out_dtype``
    (float32 default; bfloat16 / float16), written into ``out`` when given, lse (batch, seqlen,
    nheads) float32): ``lse = logsumexp_i lse_i`` and ``out = sum_i exp(lse_i - lse) out_i``.
    A row whose every split has lse -inf (no key anywhere) gets out 0 and lse -inf.  Plain torch
    ops (differentiable), not a fused kernel; flashtile's own split-KV decode merges in-kernel
    (``kernels/combine.py``)."""
    fn = "flash_attn_combine"
    for name, x, rank in (("out_partial", out_partial, 5), ("lse_partial", lse_partial, 4)):
        if not _is_tensor(x) or x.dtype != torch.float32 or x.dim() != rank:
            fail(fn, TypeError if not _is_tensor(x) else ValueError, name, f"a {rank}-D float32 tensor",
                 describe(x))
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:4]):
        fail(fn, ValueError, "lse_partial", f"shape (num_splits, batch, seqlen, nheads) = {tuple(out_partial.shape[:4])}",
             f"shape {tuple(lse_partial.shape)}")
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else torch.float32
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        fail(fn, TypeError, "out_dtype", "torch.float32, torch.bfloat16 or torch.float16", out_dtype)
    lse = torch.logsumexp(lse_partial, dim=0)
    seen = torch.isfinite(lse)
    weight = torch.where(seen[None], torch.exp(lse_partial - torch.where(seen, lse, 0.0)[None]), 0.0)
    merged = (weight[..., None] * out_partial).sum(dim=0).to(out_dtype)
    if out is not None:
        if not _is_tensor(out) or out.dtype != out_dtype or out.shape != merged.shape:
            fail(fn, ValueError, "out", f"a {out_dtype} tensor of shape {tuple(merged.shape)}", describe(out))
        merged = out.copy_(merged)
    # flash-attn 3 returns lse (batch, seqlen, nheads) as a view of (batch, nheads, seqlen) storage
    return merged, lse.transpose(1, 2).contiguous().transpose(1, 2)


def get_scheduler_metadata(*args, **kwargs) -> None:
    """flash-attn 3 precomputes its kernels' tile schedule for ``scheduler_metadata``; flashtile's
    decode plans its own schedule per call (memoised), so this returns None, which
    ``flash_attn_with_kvcache`` takes as "no hint".  Any arguments are accepted."""
    return None


# --- helpers ----------------------------------------------------------------------------------


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def _check_fa3_options(fn: str, qv, num_splits, pack_gqa, sm_margin, return_attn_probs) -> None:
    """The options the dense and packed calls share: ``qv`` refused, hints and the flag checked."""
    _reject_fa3_only(fn, qv=qv)
    _check_hints(fn, num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin)
    check_flag(fn, "return_attn_probs", return_attn_probs)


def _reject_fa3_only(fn: str, **options) -> None:
    """flash-attn 3 options flashtile does not implement: anything but None raises
    NotImplementedError naming the option."""
    for name, value in options.items():
        if value is None:
            continue
        why = {
            "qv": "the extra q . v score term of flash-attn 3's MLA kernels",
            "rotary_seqlens": "rotary positions other than cache_seqlens",
        }.get(name, "packed (varlen) queries or new tokens in the KV-cache call")
        raise NotImplementedError(f"{fn}: {name} is not supported ({why}); got {describe(value)}")


def _check_hints(fn: str, **hints) -> None:
    """Scheduling hints of flash-attn 3's kernels: type-checked like flash-attn 3 would, then
    left out (they do not change the result)."""
    for name, value in hints.items():
        if name == "pack_gqa":
            if value is not None and not isinstance(value, bool):
                fail(fn, TypeError, name, "None or a bool (a scheduling hint)", describe(value))
        elif not is_int(value) or value < 0:
            fail(fn, TypeError if not is_int(value) else ValueError, name, "an int >= 0", describe(value))


def _fp8_descales(q, k, q_descale, k_descale, v_descale, batch: int) -> dict:
    """The FP8 keyword arguments of flashtile's functions: for float8_e4m3fn q, each descale
    left None becomes ones (batch, nheads_kv), flash-attn 3's 1.0; otherwise the descales pass
    through (flashtile refuses descales with 16-bit inputs, naming them)."""
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if not (_is_tensor(q) and q.dtype == FP8 and _is_tensor(k) and k.dim() >= 2):
        return descales
    return _ones_for_none(descales, batch, k.shape[-2], q.device)


def _ones_for_none(descales: dict, batch: int, nheads_kv: int, device) -> dict:
    """``descales`` with every None replaced by ones (batch, nheads_kv) float32: flash-attn 3's
    descale of 1.0."""
    ones = torch.ones(batch, nheads_kv, dtype=torch.float32, device=device)
    return {name: ones if value is None else value for name, value in descales.items()}


def _fp8_cache_inputs(fn, q, k, v, q_descale, k_descale, v_descale, k_cache):
    """(q, k, v, k_descale, v_descale) for flashtile's FP8-cache decode from flash-attn 3's:
    an FP8 q dequantized to bfloat16 by its descale (per kv head group), FP8 new k / v
    dequantized by the cache's descales (re-quantized on append to their own bytes), None
    descales as ones (batch, nheads_kv)."""
    b, hkv = q.shape[0], k_cache.shape[-2]
    if q.dtype != FP8 and q_descale is not None:
        fail(fn, ValueError, "q_descale", "None unless q is float8_e4m3fn", describe(q_descale))
    d = _ones_for_none({"q": q_descale, "k": k_descale, "v": v_descale}, b, hkv, q.device)
    q_descale, k_descale, v_descale = d["q"], d["k"], d["v"]
    if q.dtype == FP8:
        q = _dequantize_heads(fn, "q", q, q_descale, b, hkv)
    if _is_tensor(k) and k.dtype == FP8:
        k = _dequantize_heads(fn, "k", k, k_descale, b, hkv)
    if _is_tensor(v) and v.dtype == FP8:
        v = _dequantize_heads(fn, "v", v, v_descale, b, hkv)
    return q, k, v, k_descale, v_descale


def _dequantize_heads(fn, name, x, descale, b: int, hkv: int) -> Tensor:
    """``x`` (batch, seqlen, nheads, d) float8_e4m3fn times ``descale`` (batch, nheads_kv) of
    each head's kv group, in bfloat16."""
    if x.dim() != 4 or x.shape[0] != b or hkv == 0 or x.shape[2] % hkv:
        fail(fn, ValueError, name, f"(batch={b}, seqlen, a multiple of nheads_kv={hkv}, headdim)",
             f"shape {tuple(x.shape)}")
    if not _is_tensor(descale) or descale.dtype != torch.float32 or tuple(descale.shape) != (b, hkv):
        fail(fn, ValueError, f"{name}_descale", f"float32 (batch, nheads_kv) = ({b}, {hkv})", describe(descale))
    return fp8.dequantize(x, descale).to(torch.bfloat16)
