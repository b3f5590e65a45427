"""FP8 (``torch.float8_e4m3fn``) inputs: quantization helpers and the descale convention.

Convention (flash-attn 3's): an FP8 tensor ``x8`` comes with a float32 ``descale`` of shape
``(batch, nheads_kv)``, and the real value it stands for is ``x8.float() * descale[b, j]`` for
every element of batch entry ``b`` in kv-head group ``j``.  For k and v the group is the one kv
head ``j``; for q it is the ``nheads // nheads_kv`` query heads that read kv head ``j``
(query heads ``j * g .. j * g + g - 1``).

``quantize_fp8`` produces such pairs with per-(batch, head group) amax scaling::

    descale = amax / 448        (448 = largest finite e4m3fn value; descale = 1 where amax = 0)
    x8      = float8_e4m3fn(x / descale)     (round to nearest even; |x / descale| <= 448)

so ``dequantize(x8, descale)`` returns x up to e4m3's rounding: for every element
``|x8 * descale - x| <= max(2**-4 * |x|, 2**-10 * descale)`` (3 mantissa bits: half an ulp is at
most 1/16 of a normal value; subnormals are spaced 2**-9 apart), plus float32 rounding.

``quantize_qkv(..., rotate=True)`` multiplies q and k by one shared random orthogonal matrix R
before quantizing (FlashAttention-3's incoherent processing): ``(q R)(k R)^T = q k^T``, so the
attention is unchanged, while an outlier channel is spread over every channel, which lowers the
amax and the error the outlier's rounding puts into the scores.  R is a randomized
Walsh-Hadamard transform (``diag(random signs) @ H / sqrt(d)``) for power-of-two head dims and
the Q factor of a random Gaussian matrix otherwise.  README ("FP8") has measured errors.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

DTYPE = torch.float8_e4m3fn
MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
LAYOUTS = ("bshd", "thd")


def saturate(x: Tensor) -> Tensor:
    """float32 values already divided by their descale -> float8_e4m3fn, rounded to nearest even
    and saturated at +-448 (a plain cast would turn out-of-range values into NaN)."""
    return x.clamp(-MAX, MAX).to(DTYPE)


def _fail(fn: str, kind, arg: str, expected: str, given) -> None:
    raise kind(f"{fn}: {arg} must be {expected}, got {given}")


def _token_batch(cu_seqlens: Tensor, total: int) -> Tensor:
    """(total,) int64: the batch entry each packed token belongs to (``cu_seqlens`` covers all)."""
    cu = cu_seqlens.to(torch.int64)
    return torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1], output_size=total)


def _check_cu(fn: str, name: str, cu_seqlens, total: int) -> None:
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        _fail(fn, TypeError, name, "a 1-D integer tensor (batch + 1,) for layout 'thd'", repr(cu_seqlens)[:60])
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        _fail(fn, TypeError, f"{name}.dtype", "an integer dtype", cu_seqlens.dtype)
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] != total:
        _fail(fn, ValueError, name, f"nondecreasing from 0 to the number of tokens {total}", cu)


def quantize_fp8(
    x: Tensor,
    layout: str = "bshd",
    cu_seqlens: Optional[Tensor] = None,
    heads_per_scale: int = 1,
) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` to float8_e4m3fn with one scale per (batch entry, group of heads).

    Args:
        x: floating tensor, (batch, seqlen, nheads, headdim) for ``layout="bshd"`` or
            (total, nheads, headdim) packed tokens for ``layout="thd"``.  Must be finite.
        cu_seqlens: ``layout="thd"`` only: (batch + 1,) integer offsets of the sequences.
        heads_per_scale: heads that share one scale: 1 for k and v, ``nheads // nheads_kv``
            for q (its descale is then ``(batch, nheads_kv)``, as the attention functions take).

    Returns:
        ``(x8, descale)``: x8 in float8_e4m3fn, x's shape; descale float32
        ``(batch, nheads // heads_per_scale)``; ``x ~= x8.float() * descale`` (module docstring
        for the exact bound).
    """
    fn = "quantize_fp8"
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dtype in _FP8_DTYPES:
        _fail(fn, TypeError, "x", "a floating (non-FP8) torch.Tensor", x.dtype if isinstance(x, Tensor) else type(x).__name__)
    if layout not in LAYOUTS:
        _fail(fn, ValueError, "layout", "'bshd' or 'thd'", repr(layout))
    rank = 4 if layout == "bshd" else 3
    if x.dim() != rank:
        _fail(fn, ValueError, "x", f"a {rank}-D tensor for layout {layout!r}", f"shape {tuple(x.shape)}")
    if isinstance(heads_per_scale, bool) or not isinstance(heads_per_scale, int) or heads_per_scale < 1:
        _fail(fn, TypeError, "heads_per_scale", "an int >= 1", repr(heads_per_scale))
    h, d = x.shape[-2], x.shape[-1]
    if h % heads_per_scale:
        _fail(fn, ValueError, "heads_per_scale", f"a divisor of nheads={h}", heads_per_scale)
    if layout == "bshd" and cu_seqlens is not None:
        _fail(fn, ValueError, "cu_seqlens", "None for layout 'bshd'", "a tensor")
    hs = h // heads_per_scale
    xf = x.to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        _fail(fn, ValueError, "x", "finite (no inf or NaN)", "non-finite values")
    if layout == "bshd":
        b = x.shape[0]
        amax = xf.abs().reshape(b, -1, hs, heads_per_scale * d).amax(dim=(1, 3)) if xf.numel() else xf.new_zeros(b, hs)
    else:
        _check_cu(fn, "cu_seqlens", cu_seqlens, x.shape[0])
        b = cu_seqlens.numel() - 1
        tok = xf.abs().reshape(x.shape[0], hs, heads_per_scale * d).amax(dim=-1) if xf.numel() else xf.new_zeros(x.shape[0], hs)
        idx = _token_batch(cu_seqlens.to(x.device), x.shape[0])[:, None].expand(-1, hs)
        amax = xf.new_zeros(b, hs).scatter_reduce(0, idx, tok, "amax", include_self=True)
    descale = torch.where(amax > 0, amax / MAX, torch.ones_like(amax))
    x8 = saturate(_scale(xf, descale, cu_seqlens, divide=True))
    return x8, descale.contiguous()


def _scale(xf: Tensor, descale: Tensor, cu_seqlens: Optional[Tensor], divide: bool) -> Tensor:
    """``xf`` (float32, bshd or thd) times (or divided by) its group's descale."""
    hs = descale.shape[1]
    g = xf.shape[-2] // hs
    if xf.dim() == 4:
        s = descale[:, None, :, None, None]
    else:
        s = descale[_token_batch(cu_seqlens.to(xf.device), xf.shape[0])][:, :, None, None]
    grouped = xf.reshape(*xf.shape[:-2], hs, g, xf.shape[-1])
    out = grouped / s if divide else grouped * s
    return out.reshape(xf.shape)


def dequantize(x8: Tensor, descale: Tensor, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """float32 ``x8.float() * descale`` broadcast over each scale's batch entry and head group
    (the group size is ``nheads // descale.shape[1]``).  ``x8`` is (batch, seqlen, nheads, d), or
    (total, nheads, d) packed tokens with ``cu_seqlens`` (batch + 1,)."""
    return _scale(x8.to(torch.float32), descale.to(device=x8.device, dtype=torch.float32), cu_seqlens, divide=False)


def random_rotation(headdim: int, seed: int = 0, device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """A random orthogonal (headdim, headdim) matrix R (R @ R.T = I), reproducible from ``seed``.

    Power-of-two head dims: a randomized Walsh-Hadamard transform ``diag(s) @ H / sqrt(d)`` with
    random signs s and Sylvester's Hadamard matrix H.  Other head dims: Q of the QR
    decomposition of a Gaussian matrix (signs fixed so that the result is Haar-distributed).
    """
    gen = torch.Generator().manual_seed(int(seed))
    d = int(headdim)
    if d >= 1 and d & (d - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (d,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
        r = signs[:, None] * h / d**0.5
    else:
        qm, rm = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
        r = qm * torch.sign(torch.diagonal(rm))[None, :]
    return r.to(device=device, dtype=dtype)


def quantize_qkv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rotate: bool = False,
    seed: int = 0,
    *,
    layout: str = "bshd",
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
):
    """Quantize q, k, v for ``flash_attn_func`` / ``flash_attn_varlen_func``'s FP8 path.

    Returns ``(q8, k8, v8, q_descale, k_descale, v_descale)``, each descale float32
    ``(batch, nheads_kv)``.  With ``rotate=True`` q and k are first multiplied by
    ``random_rotation(headdim, seed)`` (the same matrix for both: q k^T is unchanged up to
    float32 rounding), which spreads outlier channels before quantization.  ``layout="thd"``
    takes packed (total, nheads, headdim) tensors with ``cu_seqlens_q`` / ``cu_seqlens_k``.
    """
    fn = "quantize_qkv"
    if not isinstance(rotate, bool):
        _fail(fn, TypeError, "rotate", "a bool", repr(rotate))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() < 3:
            _fail(fn, TypeError, name, "a 3-D or 4-D floating torch.Tensor", repr(getattr(x, "shape", x))[:60])
    h, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or h == 0 or h % hkv:
        _fail(fn, ValueError, "nheads (q.shape[-2])", f"a nonzero multiple of nheads_kv={hkv}", h)
    if rotate:
        if k.shape[-1] != q.shape[-1]:
            _fail(fn, ValueError, "k.shape[-1] (headdim)", f"q's headdim {q.shape[-1]}", k.shape[-1])
        r = random_rotation(q.shape[-1], seed, device=q.device)
        q = q.to(torch.float32) @ r
        k = k.to(torch.float32) @ r
    q8, qd = quantize_fp8(q, layout, cu_seqlens_q, heads_per_scale=h // hkv)
    k8, kd = quantize_fp8(k, layout, cu_seqlens_k)
    v8, vd = quantize_fp8(v, layout, cu_seqlens_k)
    return q8, k8, v8, qd, kd, vd


_FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)
