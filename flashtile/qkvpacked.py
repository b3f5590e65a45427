"""flash-attn 2's packed-tensor entry points: q, k, v (or k, v) stacked in one tensor.

    flash_attn_qkvpacked_func(qkv, ...)              qkv (batch, seqlen, 3, nheads, headdim)
    flash_attn_kvpacked_func(q, kv, ...)             kv  (batch, seqlen_k, 2, nheads_kv, headdim)
    flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, ...)          qkv (total, 3, nheads, headdim)
    flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, ...)     kv  (total_k, 2, nheads_kv, headdim)

Same positional orders as flash-attn 2 (``dropout_p, softmax_scale, causal, window_size,
softcap, alibi_slopes, deterministic, return_attn_probs`` after the tensors and sequence
arguments), same returns, and the keyword-only extras of ``flashtile.flash_attn_func``
(``sinks``, ``return_lse``, ``attention_chunk``).  Each splits the stacked tensor into views
(``unbind``) and calls ``flash_attn_func`` / ``flash_attn_varlen_func``: the gradient of the
stacked tensor is the three (two) gradients stacked, as autograd assembles them.  The views
are strided, so on CUDA the kernels' contiguous copies of q, k, v are made on the way
(``kernels._prepare``), which flash-attn's kernels avoid by reading strided rows.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .interface import flash_attn_func
from .validation import describe, fail
from .varlen import flash_attn_varlen_func

__all__ = ["flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func"]


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: None = None, deterministic: bool = False, return_attn_probs: bool = False,
                              *, sinks: Optional[Tensor] = None, return_lse: bool = False, attention_chunk: int = 0):
    """Self-attention over ``qkv`` (batch, seqlen, 3, nheads, headdim); out (batch, seqlen,
    nheads, headdim).  Options and returns as ``flashtile.flash_attn_func``."""
    q, k, v = _split("flash_attn_qkvpacked_func", "qkv", qkv, 3, "(batch, seqlen, 3, nheads, headdim)", 5)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks=sinks, return_lse=return_lse,
                           attention_chunk=attention_chunk)


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: None = None, deterministic: bool = False, return_attn_probs: bool = False,
                             *, sinks: Optional[Tensor] = None, return_lse: bool = False, attention_chunk: int = 0):
    """q (batch, seqlen_q, nheads, headdim) over ``kv`` (batch, seqlen_k, 2, nheads_kv,
    headdim); options and returns as ``flashtile.flash_attn_func``."""
    k, v = _split("flash_attn_kvpacked_func", "kv", kv, 2, "(batch, seqlen_k, 2, nheads_kv, headdim)", 5)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks=sinks, return_lse=return_lse,
                           attention_chunk=attention_chunk)


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: None = None, deterministic: bool = False,
                                     return_attn_probs: bool = False, *, sinks: Optional[Tensor] = None,
                                     return_lse: bool = False, attention_chunk: int = 0):
    """Self-attention over packed sequences ``qkv`` (total, 3, nheads, headdim) with one
    ``cu_seqlens`` / ``max_seqlen`` for queries and keys; options and returns as
    ``flashtile.flash_attn_varlen_func``."""
    q, k, v = _split("flash_attn_varlen_qkvpacked_func", "qkv", qkv, 3, "(total, 3, nheads, headdim)", 4)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  sinks=sinks, return_lse=return_lse, attention_chunk=attention_chunk)


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: None = None, deterministic: bool = False,
                                    return_attn_probs: bool = False, *, sinks: Optional[Tensor] = None,
                                    return_lse: bool = False, attention_chunk: int = 0):
    """Packed q (total_q, nheads, headdim) over packed ``kv`` (total_k, 2, nheads_kv, headdim);
    options and returns as ``flashtile.flash_attn_varlen_func``."""
    k, v = _split("flash_attn_varlen_kvpacked_func", "kv", kv, 2, "(total_k, 2, nheads_kv, headdim)", 4)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, sinks=sinks, return_lse=return_lse,
                                  attention_chunk=attention_chunk)


def _split(fn: str, name: str, x, parts: int, layout: str, rank: int) -> tuple[Tensor, ...]:
    """The ``parts`` views of a stacked tensor along its stacking dim (``rank - 3``)."""
    if not isinstance(x, torch.Tensor):
        fail(fn, TypeError, name, f"a torch.Tensor {layout}", describe(x))
    if x.dim() != rank or x.shape[rank - 3] != parts:
        fail(fn, ValueError, name, f"a {rank}-D tensor {layout}", f"shape {tuple(x.shape)}")
    return x.unbind(rank - 3)
