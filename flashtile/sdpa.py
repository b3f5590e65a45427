"""``scaled_dot_product_attention`` with PyTorch's layout and mask alignment.

Public as ``flashtile.scaled_dot_product_attention``.  A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` where their features
overlap, plus flashtile's extras (``window_size``, ``sinks``, ``softcap``).  Tensors are
(batch, heads, seq, dim) as in PyTorch; the work is done by ``flash_attn_func`` on transposed
views (no copies).

Masks here are aligned **top-left**, as in PyTorch: query row ``i`` and key column ``j`` share
the diagonal ``j == i`` whatever the two lengths.  ``flash_attn_func`` aligns bottom-right
(flash-attn's convention); for ``seqlen_q == seqlen_k`` the two agree.  The translation is
exact in every case:

* keys that no query row can see under the right-hand bound (``j > seqlen_q - 1 + right``)
  are sliced off before the kernel runs (their gradients are exactly zero), which keeps
  flashtile's right bound ``>= 0``;
* query rows that see no key under the left-hand bound (``i > seqlen_k - 1 + left``) are not
  computed; they output zeros (PyTorch's math backend gives NaN for such rows) and receive
  zero gradients.

Example (``is_causal=True``, seqlen_q=2, seqlen_k=5)::

    PyTorch / this function (top-left)      flash_attn_func(causal=True) (bottom-right)
        k0 k1 k2 k3 k4                           k0 k1 k2 k3 k4
    q0  x  .  .  .  .                        q0  x  x  x  x  .
    q1  x  x  .  .  .                        q1  x  x  x  x  x
"""

from __future__ import annotations

from typing import Optional

import torch

from .interface import flash_attn_func

__all__ = ["scaled_dot_product_attention"]


def _top_left_to_kernel(seqlen_q: int, seqlen_k: int, left: int, right: int):
    """Map a top-left window to (rows computed, keys kept, kernel window) for flash_attn_func.

    Returns ``(sq_used, sk_used, (left', right'))``: run the first ``sq_used`` query rows
    against the first ``sk_used`` keys with flashtile's bottom-right window ``(left', right')``;
    every other row outputs zeros and every other key is invisible to all rows.
    """
    sq, sk = seqlen_q, seqlen_k
    if right >= 0:
        sk = min(sk, sq + right)  # key j is visible to some row only if j <= (sq - 1) + right
    if left >= 0:
        sq = min(sq, sk + left)  # row i sees some key only if i - left <= sk - 1
    off = sk - sq  # flashtile's diagonal sits at j = i + off; ours at j = i
    kernel_left = -1 if left < 0 else left + off
    kernel_right = -1 if right < 0 else right - off
    return sq, sk, (kernel_left, kernel_right)


def _key_padding(name: str, attn_mask, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, is_causal: bool,
                 window) -> torch.Tensor:
    """(batch, seqlen_k) bool: the keys each batch entry attends to, from a key-padding
    ``attn_mask`` (see ``scaled_dot_product_attention``), or NotImplementedError naming why not."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{name}: attn_mask must be None or a torch.Tensor, got {type(attn_mask).__name__}")
    if is_causal:
        raise RuntimeError(f"{name}: attn_mask and is_causal=True cannot both be set (as in PyTorch)")
    if tuple(window) != (-1, -1):
        raise NotImplementedError(f"{name}: attn_mask with window_size={tuple(window)} is not supported")
    shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape) if attn_mask.dim() <= 4 else None
    wanted = (batch, nheads, seqlen_q, seqlen_k)
    if shape is None or any(s not in (1, w) for s, w in zip(shape, wanted)):
        raise RuntimeError(f"{name}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {wanted}")
    if shape[1] != 1 or shape[2] != 1:
        raise NotImplementedError(
            f"{name}: attn_mask of shape {tuple(attn_mask.shape)} masks per head or per query row; only "
            "key-padding masks (size 1 over heads and query rows, e.g. (batch, 1, 1, seqlen_k)) are supported: "
            "express other patterns with is_causal / window_size, or use torch.nn.functional."
            "scaled_dot_product_attention"
        )
    mask = attn_mask.reshape(shape[0], shape[3])
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        keep = mask == 0
        if not bool(((mask == 0) | torch.isneginf(mask)).all()):
            raise NotImplementedError(f"{name}: a float attn_mask must hold only 0 and -inf (no finite biases)")
    else:
        raise TypeError(f"{name}: attn_mask must be bool or floating point, got {mask.dtype}")
    return keep.expand(batch, seqlen_k)


def _attend_kept_keys(q, k, v, keep: torch.Tensor, scale, sinks, softcap) -> torch.Tensor:
    """(batch, seqlen_q, nheads, headdim_v): every query row of entry b over the keys ``keep[b]``
    marks, as packed sequences (all rows of an entry, its kept keys) in ``flash_attn_varlen_func``."""
    from .bert_padding import index_first_axis, unpad_input
    from .varlen import flash_attn_varlen_func

    b, sq = q.shape[:2]
    kk, idx, cu_k, max_k, _ = unpad_input(k, keep)
    vv = index_first_axis(v.reshape(-1, *v.shape[2:]), idx)
    cu_q = torch.arange(b + 1, device=q.device, dtype=torch.int32) * sq
    out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), kk, vv, cu_q, cu_k, sq, max_k, softmax_scale=scale,
                                 sinks=sinks, softcap=softcap)
    return out.reshape(b, sq, *out.shape[1:])


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    sinks: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Exact attention with ``torch.nn.functional.scaled_dot_product_attention``'s interface.

    Args:
        query: (batch, nheads, seqlen_q, headdim).
        key: (batch, nheads_kv, seqlen_k, headdim).
        value: (batch, nheads_kv, seqlen_k, headdim_v); headdim_v may differ from headdim.
        attn_mask: None, or a key-padding mask: a bool mask (True = attend) or an additive float
            mask of 0 / -inf entries whose shape broadcasts to (batch, nheads, seqlen_q, seqlen_k)
            with size 1 over heads and query rows, e.g. (batch, 1, 1, seqlen_k), as encoders
            pass it.  Each batch entry's kept keys are packed and run through
            ``flash_attn_varlen_func`` (reading the mask: one device sync); not with
            ``is_causal`` (PyTorch refuses both) or a window.  Any other mask (per-query rows,
            finite biases) raises ``NotImplementedError``: express the pattern with
            ``is_causal`` / ``window_size``, or call PyTorch's SDPA.
        dropout_p: must be 0.0 (``NotImplementedError`` otherwise); flashtile has no dropout.
        is_causal: PyTorch's causal mask, aligned top-left: row i sees keys ``j <= i``.
        scale: scores are ``q . k * scale``; default ``1 / sqrt(headdim)``.
        enable_gqa: allow nheads_kv < nheads (nheads % nheads_kv == 0); query head h reads kv
            head ``h // (nheads // nheads_kv)``, as PyTorch.  With False, differing head counts
            raise ``RuntimeError`` as PyTorch does.
        window_size: (left, right), flashtile extension, aligned top-left like ``is_causal``:
            row i sees keys ``i - left <= j <= i + right``; -1 = unbounded.  ``is_causal``
            caps right at 0.
        sinks: (nheads,) per-head logits that take softmax mass and contribute no value.
        softcap: > 0 replaces scores by ``softcap * tanh(scores / softcap)``.

    Returns:
        (batch, nheads, seqlen_q, headdim_v) in query's dtype (a transposed view of
        flash_attn_func's (batch, seqlen_q, nheads, headdim_v) output).  Rows that see no key
        (and have no sink) are zeros, where PyTorch's math backend returns NaN.
    """
    name = "flashtile.scaled_dot_product_attention"
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"{name}: dropout_p must be 0.0, got {dropout_p}; flashtile has no attention dropout"
        )
    for arg, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(
                f"{name}: {arg} must be a 4-D tensor (batch, nheads, seqlen, headdim), got shape {tuple(x.shape)}"
            )
    if not enable_gqa and not (query.shape[1] == key.shape[1] == value.shape[1]):
        raise RuntimeError(
            f"{name}: query, key and value must have the same number of heads unless enable_gqa=True, "
            f"got {query.shape[1]}, {key.shape[1]} and {value.shape[1]}"
        )
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise TypeError(f"{name}: window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if not all(isinstance(w, (int, torch.SymInt)) and not isinstance(w, bool) for w in (left, right)):
        raise TypeError(f"{name}: window_size must be a pair of ints (left, right), got {window_size!r}")
    # torch.compile(dynamic=True) makes Python numbers from defaults symbolic; int() pins ints,
    # and the float defaults are passed on as literals (see below).
    left, right = int(left), int(right)
    if left < -1 or right < -1:
        raise ValueError(f"{name}: window_size entries must be ints >= -1 (-1 = unbounded), got {window_size!r}")
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    # None lets flash_attn_func apply the same default (1 / sqrt(headdim)) after validation.
    softcap = softcap if softcap != 0 else 0.0

    # (b, h, s, d) -> (b, s, h, d) views; flash_attn_func validates the rest.
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    if attn_mask is not None:
        keep = _key_padding(name, attn_mask, q.shape[0], key.shape[1], q.shape[1], k.shape[1], is_causal, (left, right))
        out = _attend_kept_keys(q, k, v, keep, scale, sinks, softcap)
        return out.transpose(1, 2)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    sq, sk, window = _top_left_to_kernel(seqlen_q, seqlen_k, left, right)
    if sk != seqlen_k:
        k, v = k[:, :sk], v[:, :sk]
    if sq != seqlen_q:
        out = flash_attn_func(q[:, :sq], k, v, softmax_scale=scale, window_size=window, sinks=sinks, softcap=softcap)
        tail = out.new_zeros(out.shape[0], seqlen_q - sq, *out.shape[2:])
        out = torch.cat([out, tail], dim=1)
    else:
        out = flash_attn_func(q, k, v, softmax_scale=scale, window_size=window, sinks=sinks, softcap=softcap)
    return out.transpose(1, 2)
