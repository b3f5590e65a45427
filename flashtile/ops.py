"""torch.library custom ops ``flashtile::fwd`` / ``flashtile::bwd`` / ``flashtile::bwd_bwd``,
their fake (meta) implementations and the autograd registration.

Going through custom ops lets ``torch.compile(fullgraph=True)`` and ``torch.export`` see one
opaque node per pass instead of tracing into TileLang.  CPU tensors run ``reference``; CUDA
tensors run the TileLang kernels of ``flashtile.kernels`` (which raise ``NotImplementedError``
for a case no kernel covers, never a silent slow path).

FP8 inputs (float8_e4m3fn q, k, v with the ``*_descale`` options; ``flashtile.fp8``) are forward
only: on CPU they are dequantized to float32 and run the reference; on CUDA they run the FP8
forward kernels (``kernels.operands``); ``bwd`` refuses them.

Autograd: ``fwd``'s backward is the ``bwd`` op; ``bwd``'s backward (double backward, e.g. for a
gradient penalty) is the ``bwd_bwd`` op (PyTorch math; CPU, or CUDA on request).

Layout contract shared by the real and the fake implementations (inductor plans buffers from
the fake ones, so they must agree): every output is a fresh contiguous tensor, whatever the
strides of the inputs.
"""

from __future__ import annotations

import functools
import os
from collections import namedtuple

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

from . import fp8, reference
from .lazy import lazy_module
from .validation import FP8_DTYPE


def _lse_dtype(q: Tensor) -> torch.dtype:
    return reference.accum_dtype(q.dtype)


_kernels = lazy_module("flashtile.kernels")  # a CPU-only user never imports TileLang


def _no_device(device: torch.device):
    return NotImplementedError(f"flashtile: no implementation for device type {device.type!r}")


def _fresh(x: Tensor) -> Tensor:
    return x.contiguous()


def _empty_like_contiguous(x: Tensor) -> Tensor:
    return x.new_empty(x.shape)


def _fp8_reference(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q=None, cu_seqlens_k=None):
    """FP8 on CPU: float32 copies holding the real values (stored x descale per group)."""
    return (fp8.dequantize(q, q_descale, cu_seqlens_q), fp8.dequantize(k, k_descale, cu_seqlens_k),
            fp8.dequantize(v, v_descale, cu_seqlens_k))


def _fp8_no_backward():
    return NotImplementedError(
        "flashtile: FP8 (float8_e4m3fn) attention is forward-only, as in flash-attn 3: no backward pass"
    )


# The implementations branch on ``is_cuda`` / ``is_cpu``: flags read without making a
# ``torch.device`` and its type string (``q.device.type``), a few tenths of a microsecond each.


def _fwd_impl(q, k, v, sinks, softmax_scale, window_left, window_right, softcap,
              q_descale=None, k_descale=None, v_descale=None, out_dtype=None, share_sms=False):
    window = (window_left, window_right)
    if q.dtype == FP8_DTYPE:
        if q.is_cuda:
            out, lse = _kernels().forward(q, k, v, sinks, softmax_scale, window, softcap,
                                          fp8=(q_descale, k_descale, v_descale, out_dtype))
            return _fresh(out), _fresh(lse)
        if not q.is_cpu:
            raise _no_device(q.device)
        with torch.no_grad():
            qf, kf, vf = _fp8_reference(q, k, v, q_descale, k_descale, v_descale)
            out, lse = reference.attention_forward(qf, kf, vf, softmax_scale, window, sinks, softcap)
        return out.to(out_dtype or torch.bfloat16).contiguous(), _fresh(lse)
    if q.is_cuda:
        out, lse = _kernels().forward(q, k, v, sinks, softmax_scale, window, softcap, share_sms=share_sms)
    elif q.is_cpu:
        with torch.no_grad():
            out, lse = reference.attention_forward(q, k, v, softmax_scale, window, sinks, softcap)
    else:
        raise _no_device(q.device)
    return _fresh(out), _fresh(lse)


def _bwd_impl(dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window_left, window_right, softcap, deterministic,
              q_descale=None, k_descale=None, v_descale=None, out_dtype=None, share_sms=False):
    window = (window_left, window_right)
    if q.dtype == FP8_DTYPE:
        raise _fp8_no_backward()
    if q.is_cuda:
        dq, dk, dv, dsinks = _kernels().backward(
            dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window, softcap, deterministic, share_sms=share_sms
        )
    elif q.is_cpu:
        with torch.no_grad():
            dq, dk, dv, dsinks = reference.attention_backward(
                dout, q, k, v, out, lse, softmax_scale, window, sinks, softcap, dlse
            )
    else:
        raise _no_device(q.device)
    dsinks = q.new_empty(0) if dsinks is None else _fresh(dsinks)
    return _fresh(dq), _fresh(dk), _fresh(dv), dsinks


# --- the ops ----------------------------------------------------------------------------------

# The ops' non-data arguments, in schema order: the one place they are listed.  Schemas, the
# implementations' unpacking (``Options``) and the autograd glue are generated from it, so a new
# option (a mask feature, a score modifier) is one line here plus its use in the impls.
# Entries are (name, schema type) or (name, schema type, default); options with a default come
# last, and calls that leave them out (older callers, ``opcheck`` argument lists) still work.
_OPTIONS = (
    ("sinks", "Tensor?"),
    ("softmax_scale", "float"),
    ("window_left", "int"),
    ("window_right", "int"),
    ("softcap", "float"),
    ("deterministic", "bool"),
    # FP8 (float8_e4m3fn q, k, v; forward only): (batch, nheads_kv) float32 descales and the
    # output dtype (None: q's dtype).  None for other inputs.
    ("q_descale", "Tensor?", None),
    ("k_descale", "Tensor?", None),
    ("v_descale", "Tensor?", None),
    ("out_dtype", "ScalarType?", None),
)


def options_type(options) -> type:
    """The namedtuple of an options list (``_OPTIONS`` here, ``varlen._OPTIONS``); options with a
    default (the FP8 ones: None) may be left out, so callers that predate them still work."""
    return namedtuple("Options", [o[0] for o in options], defaults=[o[2] for o in options if len(o) > 2])


def options_schema(options, data: str, returns: str) -> str:
    """The custom-op schema ``(<data>, <options>) -> <returns>``; an option with a default gets
    ``=<default>`` (Python None -> None)."""
    listed = ", ".join(f"{o[1]} {o[0]}" + (f"={o[2]}" if len(o) > 2 else "") for o in options)
    return f"({data}, {listed}) -> {returns}"


Options = options_type(_OPTIONS)
_N_OPTIONS = len(_OPTIONS)


def _schema(data: str, returns: str) -> str:
    return options_schema(_OPTIONS, data, returns)


_FWD_DATA = "Tensor q, Tensor k, Tensor v"
_BWD_DATA = "Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse"
_BWD_BWD_DATA = "Tensor grad_dq, Tensor grad_dk, Tensor grad_dv, Tensor grad_dsinks, " + _BWD_DATA
torch.library.define("flashtile::fwd", _schema(_FWD_DATA, "(Tensor, Tensor)"))
torch.library.define("flashtile::bwd", _schema(_BWD_DATA, "(Tensor, Tensor, Tensor, Tensor)"))
torch.library.define("flashtile::bwd_bwd", _schema(_BWD_BWD_DATA, "(" + ", ".join(["Tensor"] * 8) + ")"))


def _fwd_op(q, k, v, *options):
    """(out, lse) for BSHD q/k/v; see ``flashtile.flash_attn_func`` for the meaning."""
    o = Options(*options)
    return _fwd_impl(q, k, v, o.sinks, o.softmax_scale, o.window_left, o.window_right, o.softcap,
                     o.q_descale, o.k_descale, o.v_descale, o.out_dtype)


def _out_dtype(q: Tensor, out_dtype) -> torch.dtype:
    """The forward output's dtype: ``out_dtype`` for FP8 inputs (bfloat16 if None), else q's."""
    if q.dtype == FP8_DTYPE:
        return out_dtype or torch.bfloat16
    return q.dtype


@torch.library.register_fake("flashtile::fwd")
def _(q, k, v, *options):
    b, sq, h, _ = q.shape
    out_dtype = _out_dtype(q, Options(*options).out_dtype)
    return q.new_empty(b, sq, h, v.shape[-1], dtype=out_dtype), q.new_empty(b, h, sq, dtype=_lse_dtype(q))


def _bwd_op(dout, dlse, q, k, v, out, lse, *options):
    """(dq, dk, dv, dsinks); dsinks is an empty tensor when there are no sinks."""
    return _bwd_impl(dout, dlse, q, k, v, out, lse, *options)


@torch.library.register_fake("flashtile::bwd")
def _(dout, dlse, q, k, v, out, lse, *options):
    sinks = Options(*options).sinks
    dsinks = q.new_empty(0) if sinks is None else _empty_like_contiguous(sinks)
    return _empty_like_contiguous(q), _empty_like_contiguous(k), _empty_like_contiguous(v), dsinks


def _bwd_bwd_op(grad_dq, grad_dk, grad_dv, grad_dsinks, dout, dlse, q, k, v, out, lse, *options):
    """Double backward: the vector-Jacobian product of ``bwd`` w.r.t. its tensor inputs.

    ``grad_*`` are the cotangents of (dq, dk, dv, dsinks) (``grad_dsinks`` empty without
    sinks).  Returns (g_dout, g_dlse, g_q, g_k, g_v, g_out, g_lse, g_sinks); g_dlse / g_sinks
    are empty when dlse / sinks are None.  PyTorch math (``_reference_double_backward``), exact
    and checked by ``gradgradcheck``; no TileLang kernel implements it, so on CUDA it runs only
    when asked for with ``FLASHTILE_ALLOW_REFERENCE_DOUBLE_BACKWARD=1``.  ``deterministic`` is
    accepted and has nothing to choose.
    """
    o = Options(*options)
    if q.device.type != "cpu" and os.environ.get("FLASHTILE_ALLOW_REFERENCE_DOUBLE_BACKWARD") != "1":
        raise NotImplementedError(
            "flashtile: double backward (differentiating the attention backward pass) has no "
            f"{q.device.type} kernel; set FLASHTILE_ALLOW_REFERENCE_DOUBLE_BACKWARD=1 to run the "
            "PyTorch reference for it"
        )
    with torch.no_grad():
        grads = _reference_double_backward(
            grad_dq, grad_dk, grad_dv, grad_dsinks if o.sinks is not None else None,
            dout, dlse, q, k, v, out, lse, o.sinks, o.softmax_scale, (o.window_left, o.window_right), o.softcap,
        )
    return tuple(q.new_empty(0) if g is None else _fresh(g) for g in grads)


@torch.library.register_fake("flashtile::bwd_bwd")
def _(grad_dq, grad_dk, grad_dv, grad_dsinks, dout, dlse, q, k, v, out, lse, *options):
    sinks = Options(*options).sinks
    return tuple(q.new_empty(0) if t is None else _empty_like_contiguous(t) for t in (dout, dlse, q, k, v, out, lse, sinks))


# Registered explicitly: ``torch.library.impl`` as a decorator does not hand the function back.
for _name, _fn in (("fwd", _fwd_op), ("bwd", _bwd_op), ("bwd_bwd", _bwd_bwd_op)):
    torch.library.impl(f"flashtile::{_name}", "default", _fn)

attention_fwd = torch.ops.flashtile.fwd.default
attention_bwd = torch.ops.flashtile.bwd.default
attention_bwd_bwd = torch.ops.flashtile.bwd_bwd.default


def _reference_double_backward(A, B, C, e, dout, dlse, q, k, v, out, lse, sinks, scale, window, softcap, chunk=None):
    """VJP of the attention backward, derived by hand; same chunking and layout as ``reference``.

    With s_raw = scale q.k, t = tanh(s_raw / c), s = c t (or s = s_raw), P = exp(s - lse),
    Delta = dO.O - dlse, dP = dO.v, dS = P (dP - Delta), u = 1 - t^2 (or 1), the backward is
    dq = scale dS u k, dk = scale (dS u)^T q, dv = P^T dO, dsinks = -sum exp(sink - lse) Delta.
    For cotangents A, B, C, e of (dq, dk, dv, dsinks):
        R = scale (A.k + q.B), W = u R, X = dO.C, Y = W (dP - Delta) + X, sigma = exp(sink - lse)
        gDelta = -sum_j W P - e sigma;      g_s_raw = Y P u - 2 t u dS R / c
        g_q = scale (g_s_raw k + dS u B),   g_k = scale (g_s_raw^T q + (dS u)^T A)
        g_v = (W P)^T dO,                   g_dO = (W P) v + P C + gDelta O
        g_O = gDelta dO,  g_dlse = -gDelta, g_lse = -sum_j Y P + e sigma Delta,
        g_sinks = -e sum sigma Delta.
    """
    acc = reference.accum_dtype(q.dtype)
    chunk = chunk or reference.DEFAULT_CHUNK
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    grp = h // hkv

    def group(x):  # (b, s, h, d) -> (b, s, hkv, g, d)
        return x.to(acc).reshape(x.shape[0], x.shape[1], hkv, grp, x.shape[-1])

    def rows(x):  # (b, h, s) -> (b, hkv, g, s)
        return x.to(acc).reshape(b, hkv, grp, sq)  # explicit sizes: batch or heads may be 0

    kf, vf, Bf, Cf = (x.to(acc) for x in (k, v, B, C))
    lse_g = rows(lse)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # (b, h, sq)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    delta_g = rows(delta)
    sink = None if sinks is None else sinks.to(acc).reshape(1, hkv, grp, 1)
    e_g = None if e is None else e.to(acc).reshape(1, hkv, grp, 1)

    g_q = torch.zeros(b, sq, hkv, grp, d, dtype=acc, device=q.device)
    g_dout = torch.zeros(b, sq, hkv, grp, v.shape[-1], dtype=acc, device=q.device)
    g_delta = torch.zeros(b, hkv, grp, sq, dtype=acc, device=q.device)
    g_lse = torch.zeros(b, hkv, grp, sq, dtype=acc, device=q.device)
    g_k = torch.zeros_like(kf)
    g_v = torch.zeros_like(vf)
    for start in range(0, sq, chunk):
        stop = min(start + chunk, sq)
        qc, doc, Ac = group(q[:, start:stop]), group(dout[:, start:stop]), group(A[:, start:stop])
        s_raw = torch.einsum("bqhgd,bkhd->bhgqk", qc, kf) * scale
        t = u = None
        s = s_raw
        if softcap > 0:
            t = torch.tanh(s_raw / softcap)
            s = softcap * t
            u = 1 - t * t
        vis = reference.visible_mask(torch.arange(start, stop, device=q.device), k.shape[1], sq, window)
        if vis is not None:
            s = s.masked_fill(~vis, float("-inf"))
        lc = lse_g[..., start:stop, None]
        finite = torch.isfinite(lc)
        p = torch.where(finite, torch.exp(s - torch.where(finite, lc, torch.zeros_like(lc))), torch.zeros_like(s))
        dc = delta_g[..., start:stop, None]
        dp = torch.einsum("bqhgd,bkhd->bhgqk", doc, vf)
        ds = p * (dp - dc)
        r = scale * (torch.einsum("bqhgd,bkhd->bhgqk", Ac, kf) + torch.einsum("bqhgd,bkhd->bhgqk", qc, Bf))
        w = r if u is None else u * r
        wp = w * p
        y = w * (dp - dc) + torch.einsum("bqhgd,bkhd->bhgqk", doc, Cf)
        gs = y * p
        g_sraw = gs if u is None else gs * u - (2.0 / softcap) * t * u * ds * r
        ds_raw = ds if u is None else ds * u
        gd = -wp.sum(-1)
        gl = -gs.sum(-1)
        if sink is not None:
            sigma = torch.exp(sink - torch.where(finite[..., 0], lc[..., 0], torch.zeros_like(lc[..., 0])))
            sigma = torch.where(finite[..., 0], sigma, torch.zeros_like(sigma))
            gd = gd - e_g * sigma
            gl = gl + e_g * sigma * dc[..., 0]
        g_delta[..., start:stop] = gd
        g_lse[..., start:stop] = torch.where(finite[..., 0], gl, torch.zeros_like(gl))
        g_q[:, start:stop] = scale * (
            torch.einsum("bhgqk,bkhd->bqhgd", g_sraw, kf) + torch.einsum("bhgqk,bkhd->bqhgd", ds_raw, Bf)
        )
        g_k += scale * (torch.einsum("bhgqk,bqhgd->bkhd", g_sraw, qc) + torch.einsum("bhgqk,bqhgd->bkhd", ds_raw, Ac))
        g_v += torch.einsum("bhgqk,bqhgd->bkhd", wp, doc)
        g_dout[:, start:stop] = torch.einsum("bhgqk,bkhd->bqhgd", wp, vf) + torch.einsum("bhgqk,bkhd->bqhgd", p, Cf)
    # Delta = dO.O - dlse
    g_delta_bsh = g_delta.reshape(b, h, sq).transpose(1, 2)[..., None]  # (b, sq, h, 1)
    g_dout = g_dout.reshape(b, sq, h, v.shape[-1]) + g_delta_bsh * out.to(acc)
    g_out = g_delta_bsh * dout.to(acc)
    g_dlse = None if dlse is None else (-g_delta.reshape(b, h, sq)).to(dlse.dtype)
    g_sinks = None
    if sink is not None:
        sigma_all = torch.exp(sink - torch.where(torch.isfinite(lse_g), lse_g, torch.zeros_like(lse_g)))
        sigma_all = torch.where(torch.isfinite(lse_g), sigma_all, torch.zeros_like(sigma_all))
        g_sinks = (-(e_g * sigma_all * delta_g).sum(dim=(0, 3))).reshape(h).to(sinks.dtype)
    return (
        g_dout.to(dout.dtype),
        g_dlse,
        g_q.reshape(b, sq, h, d).to(q.dtype),
        g_k.to(k.dtype),
        g_v.to(v.dtype),
        g_out.to(out.dtype),
        g_lse.reshape(b, h, sq).to(lse.dtype),
        g_sinks,
    )


# --- autograd -------------------------------------------------------------------------------


def _plain_eager(*tensors) -> bool:
    """True when nothing is tracing or intercepting this call: plain eager tensors, no modes.

    Then the custom-op dispatcher (tens of microseconds of Python per call) can be skipped in
    favour of calling the same implementations through ``torch.autograd.Function``.  Any
    compile / export / fake-tensor / functorch / subclass context takes the custom op.
    """
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    for t in tensors:  # a loop, not all(generator): the generator costs more than the tests
        if t is not None and type(t) not in _PLAIN:
            return False
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FAST_DEVICES = ("cpu", "cuda")  # others (meta, ...) go through the op and its fake impl


def fast_eager(device: torch.device, *tensors) -> bool:
    """The implementations may be called directly: ``device`` is one they run on and the call
    is plain eager (``_plain_eager``)."""
    # Plain eager first: while tracing it is False at once, and the device memo is not touched.
    return _plain_eager(*tensors) and _fast_device(device)


@functools.cache  # once per device: ``device.type`` makes a string on every call
def _fast_device(device: torch.device) -> bool:
    return device.type in _FAST_DEVICES


def eager_route(device: torch.device, *tensors) -> str:
    """How a forward entry point runs (every entry point's one rule): ``"op"`` when traced or
    on another device (the custom op), ``"impl"`` in plain eager with nothing for autograd to
    record (the implementation itself), ``"autograd"`` in plain eager with gradients (the entry
    point's eager ``autograd.Function``)."""
    if not fast_eager(device, *tensors):
        return "op"
    return "autograd" if _needs_grad(*tensors) else "impl"


def _bwd(dout, dlse, q, k, v, out, lse, sinks, *args):
    # Grad mode is on in a backward only for create_graph=True: then the op, whose own
    # autograd (bwd_bwd) makes double backward work.
    if not torch.is_grad_enabled() and fast_eager(q.device, dout, dlse, q, k, v, out, lse, sinks):
        return _bwd_impl(dout, dlse, q, k, v, out, lse, sinks, *args)
    return attention_bwd(dout, dlse, q, k, v, out, lse, sinks, *args)


def _setup_fwd(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    o = Options(*options)
    ctx.save_for_backward(q, k, v, out, lse, o.sinks)
    ctx.options = options  # sinks is also in saved_tensors, which is what backward reads
    ctx.set_materialize_grads(False)


def _backward_fwd(ctx, dout, dlse):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    if dout is None:  # only lse was used downstream
        dout = torch.zeros_like(out)
    options = Options(*ctx.options)._replace(sinks=sinks)
    dq, dk, dv, dsinks = _bwd(dout, dlse, q, k, v, out, lse, *options)
    return dq, dk, dv, *_option_grads(dsinks if sinks is not None else None)


def _option_grads(dsinks):
    """Gradients of the options in schema order: sinks gets ``dsinks``, the rest None."""
    return (dsinks,) + (None,) * (_N_OPTIONS - 1)


torch.library.register_autograd("flashtile::fwd", _backward_fwd, setup_context=_setup_fwd)


def _setup_bwd(ctx, inputs, output):
    dout, dlse, q, k, v, out, lse, *options = inputs
    o = Options(*options)
    ctx.save_for_backward(dout, dlse, q, k, v, out, lse, o.sinks)
    ctx.options = options


def _backward_bwd(ctx, grad_dq, grad_dk, grad_dv, grad_dsinks):
    dout, dlse, q, k, v, out, lse, sinks = ctx.saved_tensors
    if grad_dsinks is None or sinks is None:
        grad_dsinks = q.new_empty(0)
    options = Options(*ctx.options)._replace(sinks=sinks)
    grads = attention_bwd_bwd(grad_dq, grad_dk, grad_dv, grad_dsinks, dout, dlse, q, k, v, out, lse, *options)
    g_dout, g_dlse, g_q, g_k, g_v, g_out, g_lse, g_sinks = grads
    return (
        g_dout,
        g_dlse if dlse is not None else None,
        g_q,
        g_k,
        g_v,
        g_out,
        g_lse,
        *_option_grads(g_sinks if sinks is not None else None),
    )


torch.library.register_autograd("flashtile::bwd", _backward_bwd, setup_context=_setup_bwd)


class _EagerAttention(torch.autograd.Function):
    """Eager fast path: the same implementations, context and backward as ``flashtile::fwd``
    (``_fwd_op``, ``_setup_fwd``, ``_backward_fwd``).

    Old-style ``forward(ctx, ...)`` on purpose: with a separate ``setup_context``,
    ``Function.apply`` binds arguments through ``inspect.signature`` on every call (~70 us).
    The options travel as one tuple in schema order, with their tensors (sinks, descales) also
    passed on their own so that autograd sees them as inputs: ``apply`` walks 8 arguments, not 13.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, q_descale, k_descale, v_descale, options):
        output = _fwd_op(q, k, v, *options)
        _setup_fwd(ctx, (q, k, v, *options), output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        dq, dk, dv, dsinks, *_ = _backward_fwd(ctx, dout, dlse)
        return dq, dk, dv, dsinks, None, None, None, None


# ``Function.apply`` without its Python wrapper (which re-checks for functorch transforms and
# setup_context on every call): ``attention`` calls it only after ``_plain_eager`` has ruled
# functorch out, and unwraps dead functorch wrappers itself, as the wrapper would.
_eager_apply = super(torch.autograd.Function, _EagerAttention).apply
# (Private torch names: if a release renames them, the fast path degrades to no unwrapping /
# no forward-AD check rather than failing at import.)
_unwrap_if_dead = getattr(torch._C._functorch, "unwrap_if_dead", lambda t: t)


def _needs_grad(*tensors) -> bool:
    """Autograd must record this call: grad mode on and some input requires grad, or a
    forward-mode AD level is open (dual tensors need not require grad; the recorded paths
    keep their behaviour there)."""
    if getattr(_forward_ad, "_current_level", -1) >= 0:
        return True
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def attention(q, k, v, sinks, softmax_scale, window_left, window_right, softcap, deterministic,
              q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """Differentiable (out, lse) (FP8 inputs: forward only).

    Traced (torch.compile, export, fake tensors, functorch, subclasses): the ``flashtile::fwd``
    custom op, one opaque node.  Plain eager: the implementation itself when autograd has
    nothing to record (no grad mode, or no input requiring grad: inference), else
    ``_EagerAttention``, which runs the same implementation and backward; both skip the
    custom-op dispatcher's per-call Python overhead.
    """
    tensors = (q, k, v, sinks, q_descale, k_descale, v_descale)
    route = eager_route(q.device, *tensors)
    if route == "impl":
        return _fwd_impl(q, k, v, sinks, softmax_scale, window_left, window_right, softcap,
                         q_descale, k_descale, v_descale, out_dtype)
    if route == "autograd":
        q, k, v, sinks, q_descale, k_descale, v_descale = (None if t is None else _unwrap_if_dead(t) for t in tensors)
        options = (sinks, softmax_scale, window_left, window_right, softcap, deterministic, q_descale, k_descale,
                   v_descale, out_dtype)  # schema order (_OPTIONS)
        return _eager_apply(q, k, v, sinks, q_descale, k_descale, v_descale, options)
    return attention_fwd(q, k, v, sinks, softmax_scale, window_left, window_right, softcap, deterministic,
                         q_descale, k_descale, v_descale, out_dtype)
