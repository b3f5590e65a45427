"""flash-attn 2's padding helpers (``flash_attn.bert_padding``): between padded batches and the
packed layout of ``flash_attn_varlen_func``.

    from flashtile.bert_padding import pad_input, unpad_input     # flash_attn.bert_padding's names

    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out = flashtile.flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out = pad_input(out, indices, batch, seqlen)                   # pad rows are 0

Same signatures and returns as flash-attn 2.8's module, written with plain differentiable torch
ops (``index_select`` / ``index_copy``; flash-attn's hand-written autograd Functions only save
memory in the backward).  ``unpad_input`` and ``unpad_input_for_concatenated_sequences`` read
the mask's lengths on the host (``max_seqlen`` is a Python int), as flash-attn's do.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input", "unpad_input_for_concatenated_sequences",
           "pad_input", "cu_seqlens_of"]


def index_first_axis(x: Tensor, indices: Tensor) -> Tensor:
    """``x[indices]`` along the first axis: x (n, ...), indices (m,) -> (m, ...)."""
    return x.index_select(0, indices)


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """Zeros (first_axis_dim, ...) with ``values`` (m, ...) at rows ``indices`` (m,)."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_copy(0, indices, values)


def cu_seqlens_of(lengths: Tensor) -> Tensor:
    """Lengths (any shape, flattened in order) -> int32 (n + 1,) running sums from 0: the
    ``cu_seqlens`` of sequences of those lengths."""
    return torch.nn.functional.pad(lengths.flatten().cumsum(0, dtype=torch.int32), (1, 0))


def unpad_input(hidden_states: Tensor, attention_mask: Tensor, unused_mask: Optional[Tensor] = None):
    """The tokens a padding mask keeps, packed.

    hidden_states (batch, seqlen, ...); attention_mask (batch, seqlen), nonzero = a real token;
    unused_mask (batch, seqlen) or None: tokens kept in the packed layout but not attended to
    (they become each sequence's tail past ``seqused``).  Returns (tokens (total, ...),
    indices (total,) into the flattened batch, cu_seqlens int32 (batch + 1,), max_seqlen (a
    Python int), seqused int32 (batch,): the real tokens per sequence)."""
    kept = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    tokens = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return tokens, indices, cu_seqlens_of(seqlens), max_seqlen, seqused


def unpad_input_for_concatenated_sequences(hidden_states: Tensor, attention_mask_in_length: Tensor):
    """Several short sequences concatenated in each row: ``attention_mask_in_length`` (batch,
    seqlen) holds each row's sequence lengths first, then zeros (e.g. ``[2, 3, 0, 0, 0, 0]``:
    a row of 2 + 3 tokens and 1 pad).  Returns (tokens (total, ...), indices (total,),
    cu_seqlens int32 (number of sequences + 1,), max_seqlen): every sequence its own."""
    lengths = attention_mask_in_length.sum(dim=-1)
    seqlen = attention_mask_in_length.shape[-1]
    real = torch.arange(seqlen, device=lengths.device)[None, :] < lengths[:, None]
    flat = attention_mask_in_length.flatten()
    seqlens = flat[flat.nonzero(as_tuple=False).flatten()]
    indices = torch.nonzero(real.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    tokens = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return tokens, indices, cu_seqlens_of(seqlens), max_seqlen


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """The inverse of ``unpad_input``: hidden_states (total, ...) at ``indices`` of a (batch,
    seqlen, ...) tensor of zeros."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
