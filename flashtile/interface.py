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

from . import chunked, eager_plans, ops
from . import validation as V

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SUPPORTED_DTYPES_FP8 = SUPPORTED_DTYPES + (V.FP8_DTYPE,)
MAX_HEADDIM = 256


FN = "flash_attn_func"
QKV_LAYOUT = "(batch, seqlen, nheads, headdim)"
_QKV_LAYOUTS = dict.fromkeys("qkv", QKV_LAYOUT)


def check_qkv_types(fn: str, q, k, v, rank: int, layouts: dict, fp8) -> None:
    """Types, ranks, dtypes and devices of q, k, v (every entry point's first checks).
    ``layouts``: name -> the shape the message shows; ``fp8`` as in ``validate``."""
    dtypes = SUPPORTED_DTYPES if fp8 is None else _SUPPORTED_DTYPES_FP8
    # Good input passes in one test (host time: ~0.7 us less than the loop below, which runs only
    # for input that fails it, to name what is wrong in the same order as before).
    tensor = torch.Tensor
    if (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)
            and q.dim() == rank and k.dim() == rank and v.dim() == rank and q.dtype in dtypes
            and q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        return
    for name, x in (("q", q), ("k", k), ("v", v)):
        # A supported dtype is never one of the refused FP8 formats, so the detailed checks
        # (and their order of messages) run only for a tensor that fails this one.
        if not (isinstance(x, torch.Tensor) and x.dim() == rank and x.dtype in dtypes):
            if fp8 is not None:
                V.check_fp8_dtype(fn, name, x)
            V.check_tensor(fn, name, x, rank, layouts[name], dtypes)
    if not (q.dtype == k.dtype == v.dtype):  # equal dtypes are never an FP8 / non-FP8 mix
        if fp8 is not None:
            V.check_fp8_mix(fn, q, k, v)
        V.fail(fn, TypeError, "q, k, v dtypes", "equal", f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        V.fail(fn, ValueError, "q, k, v devices", "the same", f"{q.device}, {k.device}, {v.device}")


def check_qkv_heads(fn: str, q, k, v) -> tuple[int, int]:
    """Head counts and head dims (the last two dims of every layout): (nheads, nheads_kv)."""
    qs, ks, vs = q.shape, k.shape, v.shape
    h, hkv = qs[-2], ks[-2]
    # Good input passes in one test (~1 us less host time); the checks below name what is wrong.
    if vs[-2] == hkv and hkv > 0 and h % hkv == 0 and ks[-1] == qs[-1] and 1 <= qs[-1] <= MAX_HEADDIM \
            and 1 <= vs[-1] <= MAX_HEADDIM:
        return h, hkv
    hd = q.dim() - 2  # the heads' dim
    h, d, hkv = q.shape[hd], q.shape[hd + 1], k.shape[hd]
    if v.shape[hd] != hkv:
        V.fail(fn, ValueError, f"v.shape[{hd}] (nheads_kv)", f"k's nheads_kv {hkv}", v.shape[hd])
    if hkv == 0:
        V.fail(fn, ValueError, f"nheads_kv (k.shape[{hd}])", "at least 1", 0)
    if h % hkv != 0:
        V.fail(fn, ValueError, f"nheads (q.shape[{hd}])", f"a multiple of nheads_kv={hkv}", h)
    if k.shape[hd + 1] != d:
        V.fail(fn, ValueError, f"k.shape[{hd + 1}] (headdim)", f"q's headdim {d}", k.shape[hd + 1])
    for name, dim in (("headdim", d), ("headdim_v", v.shape[hd + 1])):
        if not 1 <= dim <= MAX_HEADDIM:
            V.fail(fn, ValueError, name, f"between 1 and {MAX_HEADDIM}", dim)
    return h, hkv


def check_options(fn: str, q, k, v, softmax_scale, window_size, softcap, sinks, nheads: int, fp8, batch: int, nheads_kv: int) -> None:
    """The attention options every entry point shares: scale, window, softcap, sinks, FP8."""
    V.check_scale(fn, "softmax_scale", softmax_scale)
    V.check_window(fn, window_size)
    V.check_softcap(fn, softcap)
    V.check_sinks(fn, sinks, nheads, q.device)
    if fp8 is not None:
        V.check_fp8_options(fn, q, k, v, sinks, *fp8, batch=batch, nheads_kv=nheads_kv)


def validate(q, k, v, softmax_scale, window_size, sinks, softcap, fn: str = FN, fp8=None) -> None:
    """Refuse bad input before any work, naming the argument, the expectation and the value.

    ``fp8``: None (FP8 inputs refused as an unsupported dtype), or the FP8 options
    ``(q_descale, k_descale, v_descale, out_dtype)`` of an entry point that takes float8_e4m3fn.
    """
    check_qkv_types(fn, q, k, v, 4, _QKV_LAYOUTS, fp8)
    b = q.shape[0]
    if k.shape[0] != b or v.shape[0] != b:
        V.fail(fn, ValueError, "batch size of k and v", f"q's batch {b}", f"{k.shape[0]} and {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        V.fail(fn, ValueError, "v.shape[1] (seqlen_k)", f"k's seqlen_k {k.shape[1]}", v.shape[1])
    h, hkv = check_qkv_heads(fn, q, k, v)
    check_options(fn, q, k, v, softmax_scale, window_size, softcap, sinks, h, fp8, b, hkv)


def fp8_options(q, q_descale, k_descale, v_descale, out_dtype) -> tuple:
    """The ops' FP8 options ``(q_descale, k_descale, v_descale, out_dtype)``: out_dtype resolved
    to bfloat16 for FP8 inputs, None (q's dtype) otherwise."""
    if q.dtype != V.FP8_DTYPE:
        return (None, None, None, None)
    return (q_descale, k_descale, v_descale, torch.bfloat16 if out_dtype is None else out_dtype)


def normalize_window(causal: bool, window_size) -> tuple[int, int]:
    """Fold ``causal`` into the window: causal is ``right = 0`` (flash-attn's convention).
    The window as Python ints (numpy or symbolic ints are converted)."""
    left, right = window_size
    if type(left) is not int or type(right) is not int:
        left, right = int(left), int(right)
    if causal:
        right = 0
    return left, right


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    attention_chunk: int = 0,
):
    """Exact attention, drop-in for ``flash_attn.flash_attn_func`` (flash-attn 2).

    The positional order is flash-attn 2's: ``(q, k, v, dropout_p, softmax_scale, causal,
    window_size, softcap, alibi_slopes, deterministic, return_attn_probs)``.  flash-attn 3
    puts ``softmax_scale`` fourth; pass it by keyword (``softmax_scale=...``) and the call
    means the same under both.

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k: (batch, seqlen_k, nheads_kv, headdim); nheads % nheads_kv == 0, query head h reads
            kv head ``h // (nheads // nheads_kv)``.
        v: (batch, seqlen_k, nheads_kv, headdim_v); headdim_v may differ from headdim.
        dropout_p: must be 0.0 (or None): flashtile has no attention dropout, and any other
            value raises NotImplementedError rather than being ignored.
        softmax_scale: scores are ``q . k * softmax_scale``; default ``1 / sqrt(headdim)``.
            A Python or numpy real number; a tensor is refused (pass ``float(t)``).
        causal: bool; mask keys after the query, aligned bottom-right (see the module diagram).
        window_size: (left, right) keys visible around the diagonal, -1 = unbounded.
            With ``causal`` right is forced to 0.
        softcap: > 0 replaces scores by ``softcap * tanh(scores / softcap)``; 0 = off.
        alibi_slopes: must be None (ALiBi is not supported: NotImplementedError).
        deterministic: bool; the backward pass is bitwise reproducible.
        return_attn_probs: bool; return ``(out, lse, None)`` as flash-attn does with
            dropout 0 (its third value, ``S_dmask``, is the dropout mask: always None here).
        sinks: keyword only; (nheads,) per-head logits that take softmax mass and
            contribute no value.
        return_lse: keyword only, bool; return ``(out, lse)``.  lse is (batch, nheads,
            seqlen_q), float32, natural log, sink included; -inf for rows that see no key and
            have no sink.
        q_descale, k_descale, v_descale: keyword only; FP8 inputs (q, k, v all
            ``torch.float8_e4m3fn``) need all three: float32 (batch, nheads_kv), flash-attn 3's
            convention (real value = stored value x descale; q's scale is shared by the query
            heads of a kv head's group).  None for other dtypes.  ``flashtile.fp8.quantize_qkv``
            makes them.  FP8 is forward-only (inputs requiring grad are refused, as flash-attn 3
            has no FP8 backward).  CUDA (Hopper) runs the FP8 kernels: both GEMMs in FP8, P
            quantized in registers (README "FP8" has the accuracy); CPU is exact (dequantize,
            then the reference).
        out_dtype: keyword only; FP8 inputs: torch.bfloat16 (default, None) or torch.float16.
            Other inputs: None (out is in q's dtype).
        attention_chunk: keyword only, int >= 0 (flash-attn 3's name; Llama 4's
            ``attention_chunk_size``): > 0 cuts the keys into chunks of this many positions
            from key 0, and each query row sees only keys of its own chunk (its position
            ``i + seqlen_k - seqlen_q`` decides the chunk), within the causal / window rule.
            0 = off.  Runs as packed sequences, one per (entry, chunk): ``flashtile.chunked``.

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype (FP8: ``out_dtype``); ``(out, lse)`` with
        ``return_lse``; ``(out, lse, None)`` with ``return_attn_probs``.  Rows that see no key
        output zeros.  q, k, v and sinks receive gradients (also through lse).

    Flags must be Python bools (``causal="yes"`` is a TypeError, not True).
    """
    # A repeated eager inference call runs its recorded plan (``eager_plans``: validated and
    # decided when its key was first seen); any other call takes the general path below.
    key = plan = None
    if (alibi_slopes is None and q_descale is None and k_descale is None and v_descale is None and out_dtype is None
            and type(attention_chunk) is int and attention_chunk == 0):
        key = eager_plans.forward_key(q, k, v, sinks, dropout_p, softmax_scale, causal, window_size, softcap,
                                      deterministic, return_attn_probs, return_lse)
        if key is not None:
            plan = eager_plans.PLANS.get(key)
    result = eager_plans.run_forward(plan, q, k, v, sinks) if plan else None
    if result is None:
        V.reject_unsupported(FN, dropout_p, alibi_slopes)
        V.check_flags(FN, causal=causal, deterministic=deterministic, return_attn_probs=return_attn_probs,
                      return_lse=return_lse)
        validate(q, k, v, softmax_scale, window_size, sinks, softcap, fp8=(q_descale, k_descale, v_descale, out_dtype))
        V.check_chunk(FN, attention_chunk)
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(q.shape[-1])
        left, right = normalize_window(causal, window_size)
        args = (q, k, v, sinks, float(softmax_scale), left, right, float(softcap), bool(deterministic),
                *fp8_options(q, q_descale, k_descale, v_descale, out_dtype))
        if attention_chunk and q.numel() and not chunked.within_one_chunk(q.shape[1], k.shape[1], attention_chunk):
            result = chunked.attention(q, k, v, int(attention_chunk), *args[3:])
        else:
            result = ops.attention(*args)
        if key is not None and (plan is None or plan is eager_plans.SEEN):
            eager_plans.record_forward(key, q, k, v, sinks, float(softmax_scale), (left, right), float(softcap))
    out, lse = result
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out
