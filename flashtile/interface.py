"""Public entry points: defaults, validation, layout; the work happens in ``flashtile.ops``.

Mask alignment (``off = seqlen_k - seqlen_q``; row i sees key j when
``i + off - left <= j <= i + off + right``)::

    causal, seqlen_q == seqlen_k      causal, seqlen_q=2 < seqlen_k=5     window (1, 0), sq == sk
        k0 k1 k2 k3                        k0 k1 k2 k3 k4                      k0 k1 k2 k3
    q0  x  .  .  .                     q0  x  x  x  x  .                   q0  x  .  .  .
    q1  x  x  .  .                     q1  x  x  x  x  x                   q1  x  x  .  .
    q2  x  x  x  .                                                         q2  .  x  x  .
    q3  x  x  x  x                    (bottom-right aligned, as in         q3  .  .  x  x
                                       flash-attn >= 2.1)
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import ops

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEADDIM = 256


def _fail(kind, arg: str, expected: str, given) -> None:
    raise kind(f"flash_attn_func: {arg} must be {expected}, got {given!r}" if isinstance(given, str) else f"flash_attn_func: {arg} must be {expected}, got {given}")


def _is_real(x) -> bool:
    """A Python or symbolic (torch.compile dynamic=True) number, not a bool."""
    return isinstance(x, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(x, bool)


def _finite(x) -> bool:
    # Comparisons instead of math.isfinite: they also work on SymFloat without a graph break.
    return x == x and -math.inf < x < math.inf


def _check_tensor(name: str, x, rank: int) -> None:
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(x).__name__)
    if x.dim() != rank:
        _fail(ValueError, name, f"a {rank}-D tensor (batch, seqlen, nheads, headdim)", f"shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        _fail(TypeError, f"{name}.dtype", "one of float16, bfloat16, float32, float64", x.dtype)


def validate(q, k, v, softmax_scale, window_size, sinks, softcap) -> None:
    """Refuse bad input before any work, naming the argument, the expectation and the value."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, 4)
    if not (q.dtype == k.dtype == v.dtype):
        _fail(TypeError, "q, k, v dtypes", "equal", f"{q.dtype}, {k.dtype}, {v.dtype}")
    if len({q.device, k.device, v.device}) != 1:
        _fail(ValueError, "q, k, v devices", "the same", f"{q.device}, {k.device}, {v.device}")
    b, _, h, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        _fail(ValueError, "batch size of k and v", f"q's batch {b}", f"{k.shape[0]} and {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        _fail(ValueError, "v.shape[1] (seqlen_k)", f"k's seqlen_k {k.shape[1]}", v.shape[1])
    hkv = k.shape[2]
    if v.shape[2] != hkv:
        _fail(ValueError, "v.shape[2] (nheads_kv)", f"k's nheads_kv {hkv}", v.shape[2])
    if hkv == 0:
        _fail(ValueError, "nheads_kv (k.shape[2])", "at least 1", 0)
    if h % hkv != 0:
        _fail(ValueError, "nheads (q.shape[2])", f"a multiple of nheads_kv={hkv}", h)
    if k.shape[3] != d:
        _fail(ValueError, "k.shape[3] (headdim)", f"q's headdim {d}", k.shape[3])
    for name, dim in (("headdim", d), ("headdim_v", v.shape[3])):
        if not 1 <= dim <= MAX_HEADDIM:
            _fail(ValueError, name, f"between 1 and {MAX_HEADDIM}", dim)
    if softmax_scale is not None and not (_is_real(softmax_scale) and _finite(softmax_scale)):
        _fail(TypeError, "softmax_scale", "None or a finite float", softmax_scale)
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(isinstance(w, (int, torch.SymInt)) and not isinstance(w, bool) for w in window_size)):
        _fail(TypeError, "window_size", "a pair of ints (left, right)", window_size)
    for side, w in zip(("left", "right"), window_size):
        if w < -1:
            _fail(ValueError, f"window_size {side}", ">= -1 (-1 = unbounded)", w)
    if not _is_real(softcap):
        _fail(TypeError, "softcap", "a float", type(softcap).__name__)
    if not _finite(softcap) or softcap < 0:
        _fail(ValueError, "softcap", "a finite float >= 0 (0 = off)", softcap)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            _fail(TypeError, "sinks", "None or a torch.Tensor", type(sinks).__name__)
        if sinks.shape != (h,):
            _fail(ValueError, "sinks", f"shape (nheads,) = ({h},)", f"shape {tuple(sinks.shape)}")
        if not sinks.is_floating_point():
            _fail(TypeError, "sinks.dtype", "a floating dtype", sinks.dtype)
        if sinks.device != q.device:
            _fail(ValueError, "sinks.device", f"q's device {q.device}", sinks.device)


def normalize_window(causal: bool, window_size) -> tuple[int, int]:
    """Fold ``causal`` into the window: causal is ``right = 0`` (flash-attn's convention)."""
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    return left, right


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    sinks: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Exact attention, drop-in for ``flash_attn.flash_attn_func``.

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k: (batch, seqlen_k, nheads_kv, headdim); nheads % nheads_kv == 0, query head h reads
            kv head ``h // (nheads // nheads_kv)``.
        v: (batch, seqlen_k, nheads_kv, headdim_v); headdim_v may differ from headdim.
        softmax_scale: scores are ``q . k * softmax_scale``; default ``1 / sqrt(headdim)``.
        causal: mask keys after the query, aligned bottom-right (see the module diagram).
        window_size: (left, right) keys visible around the diagonal, -1 = unbounded.
            With ``causal`` right is forced to 0.
        sinks: (nheads,) per-head logits that take softmax mass and contribute no value.
        softcap: > 0 replaces scores by ``softcap * tanh(scores / softcap)``.
        deterministic: the backward pass is bitwise reproducible.
        return_lse: also return the log-sum-exp (batch, nheads, seqlen_q), float32, natural
            log, sink included; -inf for rows that see no key and have no sink.

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype, or ``(out, lse)``.
        Rows that see no key output zeros.  q, k, v and sinks receive gradients (also
        through lse).
    """
    validate(q, k, v, softmax_scale, window_size, sinks, softcap)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    left, right = normalize_window(causal, window_size)
    out, lse = ops.attention(
        q, k, v, sinks, float(softmax_scale), left, right, float(softcap), bool(deterministic)
    )
    return (out, lse) if return_lse else out
