"""torch.library custom ops ``flashtile::fwd`` / ``flashtile::bwd`` / ``flashtile::bwd_bwd``,
their fake (meta) implementations and the autograd registration.

Going through custom ops lets ``torch.compile(fullgraph=True)`` and ``torch.export`` see one
opaque node per pass instead of tracing into TileLang.  CPU tensors run ``reference``; CUDA
tensors run the TileLang kernels of ``flashtile.kernels`` (which raise ``NotImplementedError``
for a case no kernel covers, never a silent slow path).

Autograd: ``fwd``'s backward is the ``bwd`` op; ``bwd``'s backward (double backward, e.g. for a
gradient penalty) is the ``bwd_bwd`` op, which differentiates the reference backward and runs
on CPU only.

Layout contract shared by the real and the fake implementations (inductor plans buffers from
the fake ones, so they must agree): every output is a fresh contiguous tensor, whatever the
strides of the inputs.
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


def _no_device(device: torch.device):
    return NotImplementedError(f"flashtile: no implementation for device type {device.type!r}")


def _fresh(x: Tensor) -> Tensor:
    return x.contiguous()


def _empty_like_contiguous(x: Tensor) -> Tensor:
    return x.new_empty(x.shape)


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
        out, lse = _kernels().forward(q, k, v, sinks, softmax_scale, (window_left, window_right), softcap)
    elif q.device.type == "cpu":
        with torch.no_grad():
            out, lse = reference.attention_forward(q, k, v, softmax_scale, (window_left, window_right), sinks, softcap)
    else:
        raise _no_device(q.device)
    return _fresh(out), _fresh(lse)


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
        with torch.no_grad():
            dq, dk, dv, dsinks = reference.attention_backward(
                dout, q, k, v, out, lse, softmax_scale, window, sinks, softcap, dlse
            )
    else:
        raise _no_device(q.device)
    dsinks = q.new_empty(0) if dsinks is None else _fresh(dsinks)
    return _fresh(dq), _fresh(dk), _fresh(dv), dsinks


@attention_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window_left, window_right, softcap, deterministic):
    dsinks = q.new_empty(0) if sinks is None else _empty_like_contiguous(sinks)
    return _empty_like_contiguous(q), _empty_like_contiguous(k), _empty_like_contiguous(v), dsinks


@torch.library.custom_op("flashtile::bwd_bwd", mutates_args=())
def attention_bwd_bwd(
    grad_dq: Tensor,
    grad_dk: Tensor,
    grad_dv: Tensor,
    grad_dsinks: Tensor,
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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``bwd``'s outputs w.r.t. its tensor inputs (double backward).

    Returns (d_dout, d_dlse, d_q, d_k, d_v, d_out, d_lse, d_sinks); d_dlse / d_sinks are empty
    when dlse / sinks are None.  Differentiates the reference backward, so it is exact; the
    TileLang kernels have no double backward, hence CPU only.
    """
    if q.device.type != "cpu":
        raise NotImplementedError(
            "flashtile: double backward (differentiating the attention backward pass) runs on CPU "
            f"tensors only; no {q.device.type} kernel implements it"
        )
    window = (window_left, window_right)
    names = ("dout", "dlse", "q", "k", "v", "out", "lse", "sinks")
    given = dict(zip(names, (dout, dlse, q, k, v, out, lse, sinks)))
    present = [n for n in names if given[n] is not None]

    def backward_of(*tensors):
        t = dict(zip(present, tensors))
        dq, dk, dv, dsinks = reference.attention_backward(
            t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], softmax_scale, window, t.get("sinks"), softcap, t.get("dlse")
        )
        return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)

    # torch.func.vjp, not torch.autograd: a custom op's implementation runs below the autograd
    # dispatch key, where autograd records nothing; functorch's transforms work there.
    primals = tuple(given[n] for n in present)
    outputs, vjp_fn = torch.func.vjp(backward_of, *primals)
    cotangents = (grad_dq, grad_dk, grad_dv, grad_dsinks)[: len(outputs)]
    got = vjp_fn(tuple(c.to(o.dtype) for c, o in zip(cotangents, outputs)))
    by_name = dict(zip(present, got))
    result = []
    for n in names:
        t = given[n]
        if t is None:
            result.append(q.new_empty(0))
        else:
            g = by_name[n]
            result.append(torch.zeros_like(t, memory_format=torch.contiguous_format) if g is None else _fresh(g))
    return tuple(result)


@attention_bwd_bwd.register_fake
def _(grad_dq, grad_dk, grad_dv, grad_dsinks, dout, dlse, q, k, v, out, lse, sinks, *scalars):
    def like(t):
        return q.new_empty(0) if t is None else _empty_like_contiguous(t)

    return tuple(like(t) for t in (dout, dlse, q, k, v, out, lse, sinks))


# --- autograd -------------------------------------------------------------------------------


def _setup_fwd(ctx, inputs, output):
    q, k, v, sinks, scale, left, right, softcap, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.args = (scale, left, right, softcap, deterministic)
    ctx.set_materialize_grads(False)


def _backward_fwd(ctx, dout, dlse):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    if dout is None:  # only lse was used downstream
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = attention_bwd(dout, dlse, q, k, v, out, lse, sinks, *ctx.args)
    return dq, dk, dv, (dsinks if sinks is not None else None), None, None, None, None, None


attention_fwd.register_autograd(_backward_fwd, setup_context=_setup_fwd)


def _setup_bwd(ctx, inputs, output):
    dout, dlse, q, k, v, out, lse, sinks, scale, left, right, softcap, deterministic = inputs
    ctx.save_for_backward(dout, dlse, q, k, v, out, lse, sinks)
    ctx.args = (scale, left, right, softcap)


def _backward_bwd(ctx, grad_dq, grad_dk, grad_dv, grad_dsinks):
    dout, dlse, q, k, v, out, lse, sinks = ctx.saved_tensors
    grads = attention_bwd_bwd(grad_dq, grad_dk, grad_dv, grad_dsinks, dout, dlse, q, k, v, out, lse, sinks, *ctx.args)
    g_dout, g_dlse, g_q, g_k, g_v, g_out, g_lse, g_sinks = grads
    return (
        g_dout,
        g_dlse if dlse is not None else None,
        g_q,
        g_k,
        g_v,
        g_out,
        g_lse,
        g_sinks if sinks is not None else None,
        None,
        None,
        None,
        None,
        None,
    )


attention_bwd.register_autograd(_backward_bwd, setup_context=_setup_bwd)


def attention(q, k, v, sinks, softmax_scale, window_left, window_right, softcap, deterministic):
    """Differentiable (out, lse) through the custom op."""
    return attention_fwd(q, k, v, sinks, softmax_scale, window_left, window_right, softcap, deterministic)
