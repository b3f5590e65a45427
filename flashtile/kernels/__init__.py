"""Kernel registry: what the TileLang kernels cover, and the CUDA entry points.

``forward``/``backward`` (dense batches) and ``varlen_forward``/``varlen_backward`` (packed
batches) are called by ``flashtile.ops`` and ``flashtile.varlen`` for CUDA tensors: they
check coverage, prepare the tensors (contiguous, aligned, head dims padded to the kernel's)
and hand them to the one launcher, ``launch.py``.  A case no kernel covers raises
``NotImplementedError`` naming it; there is no silent fallback to a slow path.

Module map: ``configs`` (tiles, which builder), ``target`` (arch, pass configs, SM count),
``launch`` (choice, scalars, launch), ``seqinfo`` (where a batch entry's rows sit),
``masks`` (every mask), ``schedule`` (CTA -> tile), ``softmax`` (online softmax),
``pipeline`` (the hand-written kernels' K/V loader), ``operands`` (16-bit or FP8 element
types of the forward), ``transpose_v`` (the FP8 forward's V^T pre-pass), builders ``fwd``/
``fwd_ws``/``bwd``/``bwd_ws``, ``decode``/``combine`` (KV cache), ``cache`` (compile once per
structure), ``prebuilt`` (kernels shipped with the package), ``precompile``, ``debug``.
"""

from __future__ import annotations

import torch

from ..lazy import lazy_module
from . import configs
from .target import capability as _capability


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_only: bool = False) -> str | None:
    """Why no kernel runs this call, or None when one does (``forward_only``: a forward, which
    also takes float8_e4m3fn)."""
    if q.dtype not in configs.DTYPES and not (forward_only and q.dtype == configs.FP8_DTYPE):
        return f"dtype {q.dtype} on CUDA (kernels take float16 and bfloat16; cast, or use CPU tensors)"
    major, minor = _capability(q.device)
    if major != 9:
        return f"GPU {torch.cuda.get_device_name(q.device)} (sm_{major}{minor}); kernels are built for Hopper (sm_90)"
    # Kernels index with 32-bit integers (TileLang's default); larger tensors would overflow.
    d, dv = q.shape[-1], v.shape[-1]
    out_numel = q.numel() // max(d, 1) * dv
    if max(q.numel(), k.numel(), v.numel(), out_numel) >= 2**31:  # the names only on failure
        for name, numel in (("q", q.numel()), ("k", k.numel()), ("v", v.numel()), ("out", out_numel)):
            if numel >= 2**31:
                return f"{name} with 2^31 or more elements (kernels index with 32 bits; split the batch)"
    if not (0 < d <= configs.MAX_HEADDIM and 0 < dv <= configs.MAX_HEADDIM):
        for name, dim in (("headdim", d), ("headdim_v", dv)):
            if not 0 < dim <= configs.MAX_HEADDIM:
                return f"{name}={dim} (kernels take head dims up to {configs.MAX_HEADDIM})"
    return None


def _prepare(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Contiguous, 16-byte aligned copies where needed (TMA descriptors require both)."""
    return [
        x.clone(memory_format=torch.contiguous_format) if not x.is_contiguous() or x.data_ptr() % 16 else x
        for x in tensors
    ]


def _cut(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x[..., :dim]``: the padded head dim cut off; ``x`` itself when there is no padding
    (a view costs a microsecond or two of host time per call)."""
    return x if x.shape[-1] == dim else x[..., :dim]


def _pad_headdim(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with zero columns appended up to ``dim`` (``configs.kernel_headdim``)."""
    if x.shape[-1] == dim:
        return x
    if x.dtype == configs.FP8_DTYPE:  # F.pad has no float8 kernel: pad the bytes (0 is +0.0)
        return torch.nn.functional.pad(x.view(torch.int8), (0, dim - x.shape[-1])).view(x.dtype)
    return torch.nn.functional.pad(x, (0, dim - x.shape[-1]))


_launch = lazy_module("flashtile.kernels.launch")  # imports every kernel builder's dependencies


def _require(q, k, v, forward_only: bool = False) -> None:
    reason = unsupported_reason(q, k, v, forward_only)
    if reason is not None:
        raise NotImplementedError(f"flashtile: no CUDA kernel for {reason}")


def forward(q, k, v, sinks, softmax_scale, window, softcap, packed=None, fp8=None, share_sms=False):
    """(out, lse) on CUDA; see ``launch.launch_forward``.  ``packed``: None for a dense batch,
    else the ``launch.Packed`` of a packed one (``varlen_forward``).  ``fp8``: None, or
    ``(q_descale, k_descale, v_descale, out_dtype)`` for float8_e4m3fn q, k, v.  ``share_sms``:
    the call runs beside other kernels (``configs.sharing_sms``)."""
    _require(q, k, v, forward_only=True)
    d, dv = q.shape[-1], v.shape[-1]
    dp, dvp = configs.kernel_headdims(d, dv, "fwd8" if fp8 is not None else "fwd")
    q, k, v = _prepare(_pad_headdim(q, dp), _pad_headdim(k, dp), _pad_headdim(v, dvp))
    out, lse = _launch().launch_forward(q, k, v, sinks, softmax_scale, window, softcap, packed, fp8, share_sms)
    return _cut(out, dv), lse


def backward(dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window, softcap, deterministic, packed=None,
             share_sms=False):
    """(dq, dk, dv, dsinks or None) on CUDA; see ``launch.launch_backward`` (``packed`` and
    ``share_sms`` as in ``forward``)."""
    _require(q, k, v)
    d, dv = q.shape[-1], v.shape[-1]
    dp, dvp = configs.kernel_headdims(d, dv, "bwd")
    dout, q, k, v, out = _prepare(
        _pad_headdim(dout, dvp), _pad_headdim(q, dp), _pad_headdim(k, dp), _pad_headdim(v, dvp), _pad_headdim(out, dvp)
    )
    dq, dk, dv_, dsinks = _launch().launch_backward(dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window,
                                                    softcap, deterministic, packed, share_sms)
    return _cut(dq, d), _cut(dk, d), _cut(dv_, dv), dsinks


def _packed(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k):
    """The launcher's ``Packed``: int32 offsets and the lengths each sequence uses."""
    def prep(x):
        return x.to(device=q.device, dtype=torch.int32).contiguous()

    cu_q, cu_k = prep(cu_seqlens_q), prep(cu_seqlens_k)
    # torch.diff: cu[1:] - cu[:-1] in one call (fewer Python-level tensor ops per call)
    lens_q = prep(seqused_q) if seqused_q is not None else torch.diff(cu_q)
    lens_k = prep(seqused_k) if seqused_k is not None else torch.diff(cu_k)
    return _launch().Packed(cu_q, cu_k, lens_q, lens_k, int(max_seqlen_q), int(max_seqlen_k), seqused_q is None, seqused_k is None)


# A packed batch whose sequences all have the same lengths runs the dense kernels on views of the
# packed tensors (``equal_lengths``).  ``flashtile bench --varlen``'s flashtile-packed turns it
# off to time the packed kernels themselves on such a batch.
EQUAL_AS_DENSE = True


def equal_lengths(total_q, total_k, cu_seqlens_q, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k):
    """(batch, Sq, Sk) when every sequence of a packed batch has ``max_seqlen_q`` queries and
    ``max_seqlen_k`` keys, else None; host ints only, no device sync.

    Offsets that start at 0, end at the row count and bound every length by ``max_seqlen`` (the
    API's contract, checked on CPU tensors and under the debug switch) sum to batch x max_seqlen
    only when every length equals it.  The packed (total, H, D) tensors are then the dense
    (batch, max_seqlen, H, D) batch, and the dense kernels run it: the same masks (each
    sequence's own bottom-right alignment) and no per-tile sequence search, and the forward's
    persistent schedule, which a packed grid cannot use without its block counts on the host.
    ``seqused`` leaves rows out, so it always takes the packed kernels."""
    if not EQUAL_AS_DENSE or seqused_q is not None or seqused_k is not None:
        return None
    batch, sq, sk = cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k)
    if batch <= 0 or sq <= 0 or sk <= 0 or total_q != batch * sq or total_k != batch * sk:
        return None
    return batch, sq, sk


def _dense_rows(x, batch: int):
    """Packed rows (total, H, D) as the dense (batch, S, H, D) of an equal-length batch (a view)."""
    return x.unflatten(0, (batch, -1))


def _dense_lse(lse, batch: int):
    """A packed lse (H, total) as the dense (batch, H, S) of an equal-length batch (a view)."""
    return None if lse is None else lse.unflatten(1, (batch, -1)).transpose(0, 1)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                   sinks, softmax_scale, window, softcap, fp8=None, share_sms=False):
    """(out (total_q, H, Dv), lse (H, total_q) float32) on CUDA for a packed batch (``fp8`` and
    ``share_sms`` as in ``forward``)."""
    equal = equal_lengths(q.shape[0], k.shape[0], cu_seqlens_q, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    if equal is not None:
        b = equal[0]
        out, lse = forward(*(_dense_rows(x, b) for x in (q, k, v)), sinks, softmax_scale, window, softcap, fp8=fp8,
                           share_sms=share_sms)
        return out.flatten(0, 1), lse.transpose(0, 1).flatten(1)
    packed = _packed(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    return forward(q, k, v, sinks, softmax_scale, window, softcap, packed, fp8, share_sms)


def varlen_backward(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                    max_seqlen_q, max_seqlen_k, sinks, softmax_scale, window, softcap, deterministic, share_sms=False):
    """(dq, dk, dv, dsinks or None) on CUDA for a packed batch (``share_sms`` as in ``forward``)."""
    equal = equal_lengths(q.shape[0], k.shape[0], cu_seqlens_q, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    if equal is not None:
        b = equal[0]
        q, k, v, out, dout = (_dense_rows(x, b) for x in (q, k, v, out, dout))
        dq, dk, dv, dsinks = backward(dout, _dense_lse(dlse, b), q, k, v, out, _dense_lse(lse, b), sinks,
                                      softmax_scale, window, softcap, deterministic, share_sms=share_sms)
        return dq.flatten(0, 1), dk.flatten(0, 1), dv.flatten(0, 1), dsinks
    packed = _packed(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    return backward(dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window, softcap, deterministic, packed,
                    share_sms)
