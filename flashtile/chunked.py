"""Chunked local attention (``attention_chunk``; Llama 4's ``attention_chunk_size``) as packed sequences.

The keys are cut into chunks of ``C`` positions from key 0.  Query row ``i`` sits at key
position ``p = i + seqlen_k - seqlen_q`` (bottom-right alignment, as every mask here) and sees
only keys of its own chunk, ``[C * floor(p / C), C * floor(p / C) + C)``, intersected with the
causal / window rule around ``p``.  Chunks never exchange information, so each (batch entry,
chunk) is a sequence of its own, and the whole call is one ``flash_attn_varlen_func`` over
them: no new kernel, no mask in the kernels.  C = 4, seqlen_q = seqlen_k = 10, causal::

         k0 k1 k2 k3 | k4 k5 k6 k7 | k8 k9        sequences (per batch entry):
    q0   x  .  .  .  |             |              chunk 0: q0..q3 over k0..k3
    q1   x  x  .  .  |             |              chunk 1: q4..q7 over k4..k7
    q2   x  x  x  .  |             |              chunk 2: q8..q9 over k8..k9
    q3   x  x  x  x  |             |
    q4               | x  .  .  .  |
    q5               | x  x  .  .  |
    q6               | x  x  x  .  |
    q7               | x  x  x  x  |
    q8               |             | x  .
    q9               |             | x  x

Within a chunk the last query row and the last key share a position (both end where the chunk
or the sequence ends), so the packed call's per-sequence bottom-right alignment puts every row
at its own ``p``: the window and causal rules mean the same inside the chunk.  Rows before key 0
(``seqlen_q > seqlen_k``) fall in negative chunks, which hold no key: zeros and lse -inf (or
the sink), as rows that see no key always do.  Query and key tokens stay where they are (the
packed layout is a view of the dense one), and the sequence offsets depend only on the shapes,
so they are host integers: no device sync, CUDA-graph safe, and new chunk layouts only cost
the offsets' host-to-device copy once per shape (memoised).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .bert_padding import cu_seqlens_of


def _chunk_slots(used_q: Tensor, used_k: Tensor, chunk: int, slots: int) -> tuple[Tensor, Tensor]:
    """(query counts, key counts), each (sequences, slots) int64: sequence b's chunks in token
    order, from its first query row's chunk (negative ones hold no key) or key 0's on; slots
    past its last key's chunk are empty.  The one formula of the decomposition (host and
    device)."""
    off = (used_k - used_q).long()[:, None]  # key position of each sequence's query row 0
    first = torch.minimum(torch.div(off, chunk, rounding_mode="floor"), torch.zeros_like(off))
    lo = (first + torch.arange(slots, device=off.device)[None, :]) * chunk
    hi = torch.minimum(lo + chunk, used_k.long()[:, None])
    return (hi - torch.maximum(lo, off)).clamp(min=0), (hi - lo.clamp(min=0)).clamp(min=0)


def chunk_lengths(seqlen_q: int, seqlen_k: int, chunk: int) -> tuple[list[int], list[int]]:
    """Query and key counts of each chunk of one batch entry, in token order (they sum to
    ``seqlen_q`` and ``seqlen_k``).  ``seqlen_q >= 1``, ``chunk >= 1``."""
    off = seqlen_k - seqlen_q
    first = min(off // chunk, 0)
    count = max((seqlen_k - 1) // chunk, first) - first + 1
    lens_q, lens_k = _chunk_slots(torch.tensor([seqlen_q]), torch.tensor([seqlen_k]), chunk, count)
    return lens_q[0].tolist(), lens_k[0].tolist()


def within_one_chunk(seqlen_q: int, seqlen_k: int, chunk: int) -> bool:
    """Every query row and every key in chunk 0: the chunk changes nothing."""
    return seqlen_k <= chunk and seqlen_q <= seqlen_k


@functools.lru_cache(maxsize=256)
def packed_offsets(batch: int, seqlen_q: int, seqlen_k: int, chunk: int, device: torch.device):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, chunks per entry) of the
    packed call: int32 offsets on ``device`` over ``batch`` entries' chunks in order."""
    lens_q, lens_k = chunk_lengths(seqlen_q, seqlen_k, chunk)
    cu = torch.zeros(2, batch * len(lens_q) + 1, dtype=torch.int32)
    cu[0, 1:] = torch.tensor(lens_q * batch).cumsum(0)
    cu[1, 1:] = torch.tensor(lens_k * batch).cumsum(0)
    cu = cu.to(device)
    return cu[0], cu[1], max(lens_q), max(lens_k), len(lens_q)


def attention(q: Tensor, k: Tensor, v: Tensor, chunk: int, sinks, softmax_scale: float, left: int, right: int,
              softcap: float, deterministic: bool, q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """Differentiable (out (batch, seqlen_q, nheads, headdim_v), lse (batch, nheads, seqlen_q))
    of dense q, k, v with chunks of ``chunk`` keys (validated arguments; ``left`` / ``right``
    with causal folded in; FP8 descales (batch, nheads_kv) as in ``flash_attn_func``)."""
    b, sq, h, _ = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    # Traced: the offsets are graph constants (dynamo would trace through the memo anyway).
    offsets = packed_offsets.__wrapped__ if torch.compiler.is_compiling() else packed_offsets
    cu_q, cu_k, max_q, max_k, n = offsets(b, sq, sk, chunk, q.device)
    out, lse = _packed_call(q.reshape(b * sq, *q.shape[2:]), k.reshape(b * sk, *k.shape[2:]),
                            v.reshape(b * sk, *v.shape[2:]), (cu_q, cu_k, None, None, max_q, max_k), n, sinks,
                            softmax_scale, left, right, softcap, deterministic, q_descale, k_descale, v_descale,
                            out_dtype)
    return out.reshape(b, sq, h, dv), lse.reshape(h, b, sq).transpose(0, 1).contiguous()


def _packed_call(q, k, v, sequences: tuple, per_entry: int, sinks, softmax_scale, left, right, softcap, deterministic,
                 q_descale, k_descale, v_descale, out_dtype):
    """``varlen_attention`` over the chunk sequences ``(cu_q, cu_k, seqused_q, seqused_k, max_q,
    max_k)``, ``per_entry`` of them per batch entry: FP8 descales (one row per entry) repeated
    for each of its sequences."""
    from . import varlen  # imports interface, which imports this module

    if q_descale is not None:
        q_descale, k_descale, v_descale = (x.repeat_interleave(per_entry, dim=0) for x in (q_descale, k_descale, v_descale))
    o = varlen.Options(*sequences, sinks, softmax_scale, left, right, softcap, deterministic, q_descale, k_descale,
                       v_descale, out_dtype)
    return varlen.varlen_attention(q, k, v, o)


# --- packed batches ---------------------------------------------------------------------------


def varlen_sequences(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_q, seqused_k, max_seqlen_q: int,
                     max_seqlen_k: int, chunk: int):
    """The chunk sequences of a packed batch, computed on the device from its offsets (no sync):
    (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, slots per
    sequence).

    Sequence b gets ``slots`` consecutive chunk sequences, a number the host bounds from the
    max lengths (``ceil(max_q / C) + ceil(max_k / C) + 1``): its chunks from the first query
    row's (negative ones hold no key) to the last key's, then empty ones.  With ``seqused_*``
    one more sequence per b holds the segment's unused tail (seqused 0), so every token keeps
    its place."""
    lens_q_seg, lens_k_seg = cu_seqlens_q[1:] - cu_seqlens_q[:-1], cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    used_q = lens_q_seg if seqused_q is None else seqused_q
    used_k = lens_k_seg if seqused_k is None else seqused_k
    slots = -(-max_seqlen_q // chunk) + -(-max_seqlen_k // chunk) + 1
    len_q, len_k = _chunk_slots(used_q, used_k, chunk, slots)
    tails = seqused_q is not None or seqused_k is not None
    if tails:  # the unused tail of each segment: a sequence that uses none of its tokens
        len_q = torch.cat([len_q, (lens_q_seg - used_q).long()[:, None]], dim=1)
        len_k = torch.cat([len_k, (lens_k_seg - used_k).long()[:, None]], dim=1)

    su_q = su_k = None
    if tails:
        keep = torch.ones_like(len_q)
        keep[:, -1] = 0
        su_q, su_k = (len_q * keep).flatten().to(torch.int32), (len_k * keep).flatten().to(torch.int32)
    return (cu_seqlens_of(len_q), cu_seqlens_of(len_k), su_q, su_k, min(chunk, max_seqlen_q), min(chunk, max_seqlen_k),
            slots + tails)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, chunk: int, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                     max_seqlen_q: int, max_seqlen_k: int, sinks, softmax_scale: float, left: int, right: int,
                     softcap: float, deterministic: bool, q_descale=None, k_descale=None, v_descale=None,
                     out_dtype=None):
    """Differentiable (out (total_q, nheads, headdim_v), lse (nheads, total_q)) of a packed batch
    with chunks of ``chunk`` keys per sequence (validated arguments, as ``attention``)."""
    *sequences, per_seq = varlen_sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                           max_seqlen_k, chunk)
    return _packed_call(q, k, v, tuple(sequences), per_seq, sinks, softmax_scale, left, right, softcap, deterministic,
                        q_descale, k_descale, v_descale, out_dtype)
