"""torch.library custom ops ``flashtile::fwd`` / ``flashtile::bwd``, their fake (meta)
implementations and the autograd registration.

Going through custom ops lets ``torch.compile(fullgraph=True)`` and ``torch.export`` see one
opaque node per pass instead of tracing into TileLang.  CPU tensors run ``reference``; CUDA
tensors run the TileLang kernels of ``flashtile.kernels`` (which raise ``NotImplementedError``
for a case no kernel covers, never a silent slow path).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reference


def _lse_dtype(q: Tensor) -> torch.dtype:
    return reference.accum_dtype(q.dtype)


def _kernels():
    # Imported lazily: a CPU-only user never pays for importing TileLang.
    from . import kernels

    return kernels


@torch.library.custom_op("flashtile::fwd", mutates_args=())
def attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Optional[Tensor],
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """(out, lse) for BSHD q/k/v; see ``flashtile.flash_attn_func`` for the meaning."""
    if q.device.type == "cuda":
        return _kernels().forward(q, k, v, sinks, softmax_scale, (window_left, window_right), softcap)
    if q.device.type != "cpu":
        raise NotImplementedError(f"flashtile: no implementation for device type {q.device.type!r}")
    with torch.no_grad():
        return reference.attention_forward(q, k, v, softmax_scale, (window_left, window_right), sinks, softcap)


@attention_fwd.register_fake
def _(q, k, v, sinks, softmax_scale, window_left, window_right, softcap, deterministic):
    b, sq, h, _ = q.shape
    out = q.new_empty(b, sq, h, v.shape[-1])
    lse = q.new_empty(b, h, sq, dtype=_lse_dtype(q))
    return out, lse


@torch.library.custom_op("flashtile::bwd", mutates_args=())
def attention_bwd(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    sinks: Optional[Tensor],
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks); dsinks is an empty tensor when there are no sinks."""
    window = (window_left, window_right)
    if q.device.type == "cuda":
        dq, dk, dv, dsinks = _kernels().backward(
            dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window, softcap, deterministic
        )
    elif q.device.type == "cpu":
        dq, dk, dv, dsinks = reference.attention_backward(
            dout, q, k, v, out, lse, softmax_scale, window, sinks, softcap, dlse
        )
    else:
        raise NotImplementedError(f"flashtile: no implementation for device type {q.device.type!r}")
    if dsinks is None:
        dsinks = q.new_empty(0)
    return dq, dk, dv, dsinks


@attention_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window_left, window_right, softcap, deterministic):
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, scale, left, right, softcap, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.args = (scale, left, right, softcap, deterministic)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    if dout is None:  # only lse was used downstream
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = attention_bwd(dout, dlse, q, k, v, out, lse, sinks, *ctx.args)
    return dq, dk, dv, (dsinks if sinks is not None else None), None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, sinks, softmax_scale, window_left, window_right, softcap, deterministic):
    """Differentiable (out, lse) through the custom op."""
    return attention_fwd(q, k, v, sinks, softmax_scale, window_left, window_right, softcap, deterministic)
