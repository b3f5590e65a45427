"""Variable-length (packed) attention: ``flash_attn_varlen_func``.

One module for the op family, top to bottom: the public function, its validation, the
``flashtile::varlen_fwd`` / ``flashtile::varlen_bwd`` custom ops with their fake impls, and the
autograd registration (plus an eager fast path, as in ``ops.py``).

Packed layout: the sequences of a batch are concatenated along the token axis, and
``cu_seqlens`` (int32, batch + 1 entries, starting at 0) holds where each one starts::

    q (total_q = 9 rows)    | s0: 3 rows | s1: 0 | s2: 6 rows      |   cu_seqlens_q = [0, 3, 3, 9]
    k (total_k = 11 rows)   | s0: 5 rows      | s1: 2 | s2: 4 rows |   cu_seqlens_k = [0, 5, 7, 11]

Each sequence is attended to on its own, with flash_attn_func's rule applied per sequence:
``off = len_k - len_q`` and row i (0-based in its sequence) sees key j when
``i + off - left <= j <= i + off + right`` (causal: right = 0, so bottom-right aligned per
sequence).  s0 above, causal::

        k0 k1 k2 k3 k4
    q0  x  x  x  .  .
    q1  x  x  x  x  .
    q2  x  x  x  x  x

``seqused_q`` / ``seqused_k`` (int32, (batch,)) shorten each sequence to its first tokens
(``len = seqused[b]``) without moving the others; query rows past ``seqused_q[b]`` output 0 with
lse -inf and get zero gradient, keys past ``seqused_k[b]`` get zero gradient.

The custom ops' non-data arguments are listed once, in ``_OPTIONS``; ``Options`` packs them
and the schema strings are generated from the same list.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import Tensor

from . import chunked, ops, reference
from . import validation as V
from .interface import check_options, check_qkv_heads, check_qkv_types, fp8_options, normalize_window

FN = "flash_attn_varlen_func"
CHECK_SEQLENS_ENV = "FLASHTILE_CHECK_SEQLENS"
_LAYOUTS = {"q": "(total_q, nheads, headdim)", "k": "(total_k, nheads_kv, headdim)", "v": "(total_k, nheads_kv, headdim_v)"}


# --- public function ----------------------------------------------------------------------------


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[Tensor] = None,
    *,
    sinks: Optional[Tensor] = None,
    return_lse: bool = False,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    attention_chunk: int = 0,
):
    """Exact attention over packed sequences, drop-in for ``flash_attn.flash_attn_varlen_func``
    (flash-attn 2's positional order).

    Args:
        q: (total_q, nheads, headdim), the batch's query tokens back to back.
        k: (total_k, nheads_kv, headdim); query head h reads kv head ``h // (nheads // nheads_kv)``.
        v: (total_k, nheads_kv, headdim_v).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device: 0, then running sums of
            the sequence lengths (nondecreasing, last entry = total tokens).
        max_seqlen_q, max_seqlen_k: Python ints >= every sequence's (used) length.
        dropout_p: must be 0.0; alibi_slopes: must be None (both NotImplementedError).
        softmax_scale, causal, window_size, softcap, deterministic, sinks: as in
            ``flash_attn_func``, applied per sequence (causal is bottom-right aligned per
            sequence).
        return_attn_probs: return ``(out, lse, None)`` (flash-attn's third value, the dropout
            mask, is always None here).
        block_table: None, or int32 (batch, max_blocks_per_seq): flash-attn 2's paged K/V.  Then
            k and v are caches (num_blocks, page_size, nheads_kv, headdim / headdim_v), key j
            of sequence b lives at ``k[block_table[b, j // page_size], j % page_size]``, and
            ``cu_seqlens_k`` gives each sequence's key count.  The pages are gathered into the
            packed layout first (a copy of every listed page; on the device, no sync), so
            ``flash_attn_with_kvcache`` is the cheaper call for decoding.
        return_lse: return ``(out, lse)``.
        seqused_q, seqused_k: None or int32 (batch,): use only the first ``seqused[b]`` tokens
            of sequence b.
        q_descale, k_descale, v_descale, out_dtype: FP8 inputs (float8_e4m3fn q, k, v), as in
            ``flash_attn_func``: float32 descales (batch, nheads_kv), batch =
            ``len(cu_seqlens_q) - 1``; out in ``out_dtype`` (bfloat16 default, or float16).
            Forward only; CUDA runs the FP8 kernels, CPU the exact reference.
        attention_chunk: int >= 0, as in ``flash_attn_func``, per sequence (chunks from each
            sequence's first key): every (sequence, chunk) becomes a packed sequence of its own,
            with offsets computed on the device (``chunked.varlen_sequences``: no sync).

    Returns:
        out (total_q, nheads, headdim_v) in q's dtype (FP8: ``out_dtype``); lse (nheads, total_q) float32 (float64
        for float64 input), natural log, sink included, -inf for rows that see no key (and
        have no sink) and for rows outside every used range.

    Checks that read the contents of ``cu_seqlens_*`` / ``seqused_*`` (start at 0,
    nondecreasing, totals, ``max_seqlen``) run on CPU tensors always, and on CUDA only with
    the environment variable ``FLASHTILE_CHECK_SEQLENS=1`` (they cost a device sync).

    On CUDA a batch whose sequences all have ``max_seqlen_q`` queries and ``max_seqlen_k`` keys
    (``total == batch * max_seqlen`` on both sides, no ``seqused``: known from host ints under
    the contract above) runs the dense kernels on a (batch, max_seqlen, ...) view: same
    results, dense speed (``kernels.equal_lengths``).
    """
    V.reject_unsupported(FN, dropout_p, alibi_slopes)
    if block_table is not None:
        k, v, cu_seqlens_k, seqused_k = _unpage(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, seqused_k)
    V.check_flags(FN, causal=causal, deterministic=deterministic, return_attn_probs=return_attn_probs,
                  return_lse=return_lse)
    validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_size,
             softcap, sinks, seqused_q, seqused_k, fp8=(q_descale, k_descale, v_descale, out_dtype))
    if content_checks_enabled(q.device):
        check_seqlens(q.shape[0], k.shape[0], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    left, right = normalize_window(causal, window_size)
    V.check_chunk(FN, attention_chunk)
    options = (sinks, float(softmax_scale), left, right, float(softcap), bool(deterministic),
               *fp8_options(q, q_descale, k_descale, v_descale, out_dtype))
    # Chunks change nothing when one holds every key and no row before key 0 sees any.
    if attention_chunk and q.shape[0] and not (max_seqlen_k <= attention_chunk and right == 0):
        out, lse = chunked.varlen_attention(q, k, v, int(attention_chunk), cu_seqlens_q, cu_seqlens_k, seqused_q,
                                            seqused_k, max_seqlen_q, max_seqlen_k, *options)
    else:
        opts = Options(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, *options)
        out, lse = varlen_attention(q, k, v, opts)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


# --- validation ---------------------------------------------------------------------------------


def _fail(kind, arg, expected, given):
    V.fail(FN, kind, arg, expected, given)


def _check_index_tensor(name: str, x, length_name: str, length, device) -> None:
    """An int32 1-D tensor of ``length`` entries on ``device`` (``length`` None: any >= 1)."""
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, name, "an int32 torch.Tensor", V.describe(x))
    if x.dtype != torch.int32:
        _fail(TypeError, f"{name}.dtype", "torch.int32", x.dtype)
    if x.dim() != 1:
        _fail(ValueError, name, f"a 1-D tensor {length_name}", f"shape {tuple(x.shape)}")
    if length is None and x.shape[0] < 1:
        _fail(ValueError, name, f"a 1-D tensor {length_name} with at least 1 entry", f"shape {tuple(x.shape)}")
    if length is not None and x.shape[0] != length:
        _fail(ValueError, name, f"shape {length_name} = ({length},)", f"shape {tuple(x.shape)}")
    if x.device != device:
        _fail(ValueError, f"{name}.device", f"q's device {device}", x.device)


def validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_size,
             softcap, sinks, seqused_q, seqused_k, fp8=None) -> None:
    """Shape / dtype / device checks (no data reads), naming argument, expectation and value.
    ``fp8``: None (FP8 refused), or ``(q_descale, k_descale, v_descale, out_dtype)``."""
    check_qkv_types(FN, q, k, v, 3, _LAYOUTS, fp8)
    if v.shape[0] != k.shape[0]:
        _fail(ValueError, "v.shape[0] (total_k)", f"k's total_k {k.shape[0]}", v.shape[0])
    h, hkv = check_qkv_heads(FN, q, k, v)
    _check_index_tensor("cu_seqlens_q", cu_seqlens_q, "(batch + 1,)", None, q.device)
    batch = cu_seqlens_q.shape[0] - 1
    _check_index_tensor("cu_seqlens_k", cu_seqlens_k, "(batch + 1,) like cu_seqlens_q", batch + 1, q.device)
    for name, x in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if x is not None:
            _check_index_tensor(name, x, "(batch,)", batch, q.device)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not V.is_int(m) or isinstance(m, torch.Tensor):
            _fail(TypeError, name, "a Python int", V.describe(m))
        if m < 0:
            _fail(ValueError, name, "an int >= 0", m)
    check_options(FN, q, k, v, softmax_scale, window_size, softcap, sinks, h, fp8, batch, hkv)


def _unpage(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, seqused_k):
    """flash-attn 2's paged K/V as the packed layout: (k, v, cu_seqlens_k, seqused_k).

    Every sequence gets its ``max_blocks_per_seq * page_size`` gathered positions as its segment
    (so the offsets are known without reading ``cu_seqlens_k``) and uses the first
    ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` of them (or ``seqused_k[b]``); table entries past
    a sequence's pages may hold anything, -1 included (clamped for the gather, never attended)."""
    if not isinstance(block_table, torch.Tensor):
        _fail(TypeError, "block_table", "None or an int32 tensor (batch, max_blocks_per_seq)", V.describe(block_table))
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        _fail(ValueError, "block_table", "an int32 tensor (batch, max_blocks_per_seq)",
              f"{block_table.dtype} of shape {tuple(block_table.shape)}")
    if block_table.device != q.device:
        _fail(ValueError, "block_table.device", f"q's device {q.device}", block_table.device)
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            _fail(ValueError, name, "a paged cache (num_blocks, page_size, nheads_kv, headdim) with block_table",
                  V.describe(x) if not isinstance(x, torch.Tensor) else f"shape {tuple(x.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]) or k.shape[0] == 0:
        _fail(ValueError, "v.shape[:3]", f"k's (num_blocks, page_size, nheads_kv) {tuple(k.shape[:3])}, num_blocks >= 1",
              tuple(v.shape[:3]))
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_index_tensor(name, x, "(batch + 1,)", block_table.shape[0] + 1, q.device)
    batch, blocks = block_table.shape
    segment = blocks * k.shape[1]
    pages = block_table.clamp(0, k.shape[0] - 1).long()
    k, v = (x[pages].reshape(batch * segment, *x.shape[2:]) for x in (k, v))
    used = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    offsets = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * segment
    return k, v, offsets, used


def content_checks_enabled(device: torch.device) -> bool:
    """Checks that read cu_seqlens / seqused: always on CPU; on other devices (a sync each)
    only with ``FLASHTILE_CHECK_SEQLENS=1``."""
    return device.type == "cpu" or os.environ.get(CHECK_SEQLENS_ENV) == "1"


def _require(cond: Tensor, arg: str, expected: str, given, value=None) -> None:
    """A check on tensor contents: a Python check in eager mode, ``torch._assert_async`` when
    traced (no graph break; still fails at run time).  ``value`` (a size) is named in the eager
    message only: formatting a symbolic size while tracing would specialise the graph on it."""
    message = f"{FN}: {arg} must be {expected}"
    if torch.compiler.is_compiling():
        torch._assert_async(cond, message)
    elif not bool(cond):
        value = "" if value is None else f" = {value}"
        raise ValueError(f"{message}{value}, got {given() if callable(given) else given}")


def check_seqlens(total_q, total_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k) -> None:
    """Checks on the contents of cu_seqlens / seqused (they read the data: a sync on CUDA)."""
    for side, cu, total, used, max_len in (
        ("q", cu_seqlens_q, total_q, seqused_q, max_seqlen_q),
        ("k", cu_seqlens_k, total_k, seqused_k, max_seqlen_k),
    ):
        name = f"cu_seqlens_{side}"
        _require(cu[0] == 0, f"{name}[0]", "0", lambda: int(cu[0]))
        seg = cu[1:] - cu[:-1]
        _require((seg >= 0).all(), name, "nondecreasing", lambda: cu.tolist())
        _require(cu[-1] == total, f"{name}[-1]", f"the number of tokens, {side}.shape[0]", lambda: int(cu[-1]), total)
        lengths = seg
        if used is not None:
            uname = f"seqused_{side}"
            _require(((used >= 0) & (used <= seg)).all(), uname, f"between 0 and each segment's length in {name}",
                     lambda: f"{used.tolist()} for segments {seg.tolist()}")
            lengths = used
        if lengths.numel():
            _require(lengths.max() <= max_len, f"max_seqlen_{side}", f">= every sequence length (max {'seqused_' + side if used is not None else 'of ' + name} is larger)",
                     lambda: max_len)


# --- custom ops ---------------------------------------------------------------------------------

# The ops' non-data arguments, in schema order: the one place they are listed.  The sequence
# description first, then the dense ops' options (``ops._OPTIONS``: sinks, scale, window,
# softcap, deterministic, and the defaulted FP8 ones).
_OPTIONS = (
    ("cu_seqlens_q", "Tensor"),
    ("cu_seqlens_k", "Tensor"),
    ("seqused_q", "Tensor?"),
    ("seqused_k", "Tensor?"),
    ("max_seqlen_q", "SymInt"),
    ("max_seqlen_k", "SymInt"),
) + ops._OPTIONS
Options = ops.options_type(_OPTIONS)
_TENSOR_OPTIONS = tuple(o[0] for o in _OPTIONS if o[1].startswith("Tensor"))
_N_OPTIONS = len(_OPTIONS)


def _schema(data: str, returns: str) -> str:
    return ops.options_schema(_OPTIONS, data, returns)


torch.library.define("flashtile::varlen_fwd", _schema("Tensor q, Tensor k, Tensor v", "(Tensor, Tensor)"))
torch.library.define(
    "flashtile::varlen_bwd",
    _schema("Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse", "(Tensor, Tensor, Tensor, Tensor)"),
)


def _kernel(name: str):
    fn = getattr(ops._kernels(), name, None)  # imported lazily: CPU users never import TileLang
    if fn is None:
        raise NotImplementedError(f"flashtile: no CUDA kernel for variable-length attention yet (flashtile.kernels.{name})")
    return fn


def _window(o: Options) -> tuple[int, int]:
    return (o.window_left, o.window_right)


def _fwd_impl(q, k, v, o: Options, share_sms: bool = False):
    """``share_sms``: the call runs beside other kernels (ring attention's steps;
    ``kernels.configs.sharing_sms``)."""
    if q.dtype == V.FP8_DTYPE:
        if q.is_cuda:
            out, lse = _kernel("varlen_forward")(
                q, k, v, o.cu_seqlens_q, o.cu_seqlens_k, o.seqused_q, o.seqused_k, o.max_seqlen_q, o.max_seqlen_k,
                o.sinks, o.softmax_scale, _window(o), o.softcap, fp8=(o.q_descale, o.k_descale, o.v_descale, o.out_dtype),
            )
            return out.contiguous(), lse.contiguous()
        if not q.is_cpu:
            raise ops._no_device(q.device)
        with torch.no_grad():
            qf, kf, vf = ops._fp8_reference(q, k, v, o.q_descale, o.k_descale, o.v_descale, o.cu_seqlens_q, o.cu_seqlens_k)
            out, lse = reference.varlen_attention_forward(
                qf, kf, vf, o.cu_seqlens_q, o.cu_seqlens_k, o.softmax_scale, _window(o), o.sinks, o.softcap,
                o.seqused_q, o.seqused_k,
            )
        return out.to(o.out_dtype or torch.bfloat16).contiguous(), lse.contiguous()
    if q.is_cuda:
        out, lse = _kernel("varlen_forward")(
            q, k, v, o.cu_seqlens_q, o.cu_seqlens_k, o.seqused_q, o.seqused_k, o.max_seqlen_q, o.max_seqlen_k,
            o.sinks, o.softmax_scale, _window(o), o.softcap, share_sms=share_sms,
        )
    elif q.is_cpu:
        with torch.no_grad():
            out, lse = reference.varlen_attention_forward(
                q, k, v, o.cu_seqlens_q, o.cu_seqlens_k, o.softmax_scale, _window(o), o.sinks, o.softcap,
                o.seqused_q, o.seqused_k,
            )
    else:
        raise ops._no_device(q.device)
    return out.contiguous(), lse.contiguous()


def _bwd_impl(dout, dlse, q, k, v, out, lse, o: Options, share_sms: bool = False):
    """``share_sms`` as in ``_fwd_impl``."""
    if q.dtype == V.FP8_DTYPE:
        raise ops._fp8_no_backward()
    if q.is_cuda:
        dq, dk, dv, dsinks = _kernel("varlen_backward")(
            dout, dlse, q, k, v, out, lse, o.cu_seqlens_q, o.cu_seqlens_k, o.seqused_q, o.seqused_k,
            o.max_seqlen_q, o.max_seqlen_k, o.sinks, o.softmax_scale, _window(o), o.softcap, o.deterministic,
            share_sms=share_sms,
        )
    elif q.is_cpu:
        with torch.no_grad():
            dq, dk, dv, dsinks = reference.varlen_attention_backward(
                dout, q, k, v, out, lse, o.cu_seqlens_q, o.cu_seqlens_k, o.softmax_scale, _window(o), o.sinks,
                o.softcap, dlse, o.seqused_q, o.seqused_k,
            )
    else:
        raise ops._no_device(q.device)
    dsinks = q.new_empty(0) if dsinks is None else dsinks.contiguous()
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks


@torch.library.impl("flashtile::varlen_fwd", "default")
def _varlen_fwd(q, k, v, *options):
    return _fwd_impl(q, k, v, Options(*options))


@torch.library.impl("flashtile::varlen_bwd", "default")
def _varlen_bwd(dout, dlse, q, k, v, out, lse, *options):
    return _bwd_impl(dout, dlse, q, k, v, out, lse, Options(*options))


@torch.library.register_fake("flashtile::varlen_fwd")
def _(q, k, v, *options):
    total_q, h, _ = q.shape
    out_dtype = ops._out_dtype(q, Options(*options).out_dtype)
    return q.new_empty(total_q, h, v.shape[-1], dtype=out_dtype), q.new_empty(h, total_q, dtype=ops._lse_dtype(q))


@torch.library.register_fake("flashtile::varlen_bwd")
def _(dout, dlse, q, k, v, out, lse, *options):
    sinks = Options(*options).sinks
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


varlen_fwd = torch.ops.flashtile.varlen_fwd.default
varlen_bwd = torch.ops.flashtile.varlen_bwd.default


# --- autograd -----------------------------------------------------------------------------------


def _save(ctx, q, k, v, out, lse, o: Options) -> None:
    ctx.save_for_backward(q, k, v, out, lse, *(getattr(o, name) for name in _TENSOR_OPTIONS))
    ctx.options = o._replace(**dict.fromkeys(_TENSOR_OPTIONS))  # scalars only; tensors are saved
    ctx.set_materialize_grads(False)


def _saved(ctx):
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    return q, k, v, out, lse, ctx.options._replace(**dict(zip(_TENSOR_OPTIONS, tensors)))


def _grads(ctx, dout, dlse):
    """(dq, dk, dv, Options of gradients: dsinks in ``sinks``, None elsewhere)."""
    q, k, v, out, lse, o = _saved(ctx)
    if dout is None:  # only lse was used downstream
        dout = torch.zeros_like(out)
    if not torch.is_grad_enabled() and ops.fast_eager(q.device, dout, dlse, q, k, v, out, lse, o.sinks):
        dq, dk, dv, dsinks = _bwd_impl(dout, dlse, q, k, v, out, lse, o)
    else:  # traced, or create_graph=True (varlen_bwd has no autograd: double backward raises)
        dq, dk, dv, dsinks = varlen_bwd(dout, dlse, q, k, v, out, lse, *o)
    no_grads = Options(*([None] * _N_OPTIONS))
    return dq, dk, dv, no_grads._replace(sinks=dsinks if o.sinks is not None else None)


def _setup_fwd(ctx, inputs, output):
    q, k, v, *options = inputs
    _save(ctx, q, k, v, *output, Options(*options))


def _backward_fwd(ctx, dout, dlse):
    dq, dk, dv, option_grads = _grads(ctx, dout, dlse)
    return (dq, dk, dv, *option_grads)


torch.library.register_autograd("flashtile::varlen_fwd", _backward_fwd, setup_context=_setup_fwd)


class _EagerVarlen(torch.autograd.Function):
    """Eager fast path: the same implementations and backward as ``flashtile::varlen_fwd``,
    without the custom-op dispatcher's per-call Python overhead.  ``sinks`` is passed on its
    own so that autograd sees it as an input."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, o):
        o = o._replace(sinks=sinks)
        out, lse = _fwd_impl(q, k, v, o)
        _save(ctx, q, k, v, out, lse, o)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        dq, dk, dv, option_grads = _grads(ctx, dout, dlse)
        return dq, dk, dv, option_grads.sinks, None


_eager_apply = super(torch.autograd.Function, _EagerVarlen).apply  # as ``ops._eager_apply``


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, o: Options):
    """Differentiable (out, lse): the custom op when traced; in plain eager the implementation
    itself when autograd has nothing to record, else ``_EagerVarlen``."""
    tensors = (q, k, v, *(getattr(o, n) for n in _TENSOR_OPTIONS))
    route = ops.eager_route(q.device, *tensors)
    if route == "impl":
        return _fwd_impl(q, k, v, o)
    if route == "autograd":
        unwrap = ops._unwrap_if_dead
        return _eager_apply(unwrap(q), unwrap(k), unwrap(v), None if o.sinks is None else unwrap(o.sinks), o)
    return varlen_fwd(q, k, v, *o)
