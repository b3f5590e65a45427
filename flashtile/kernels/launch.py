"""The one launcher: kernel choice by architecture and config, scalar setup, launch.

Builder modules (``fwd``, ``fwd_ws``, ``bwd``, ``bwd_ws``) only build PrimFuncs; this module
picks the builder and tiles from ``configs``, compiles through ``cache``, turns the user's
options into the kernels' scalars and launches.  Dense and packed (varlen) batches go through
the same functions: ``packed`` is None for a dense batch, else a ``Packed`` describing the
sequences (``seqinfo`` is its in-kernel side).

Tensors arrive prepared by ``flashtile.kernels`` (contiguous, 16-byte aligned, head dims
padded to the kernel's): dense q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv); packed
q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch

from . import cache, configs, debug, operands, packed_stats, target
from .masks import host_window
from .softmax import LOG2E


class Packed(NamedTuple):
    """A packed batch on the host: ``cu_q``/``cu_k`` (batch + 1,) int32 row offsets,
    ``lens_q``/``lens_k`` (batch,) int32 lengths used (``seqused`` or the offsets'
    differences), ``max_q``/``max_k`` ints bounding every length.  ``all_q_used`` /
    ``all_k_used``: no ``seqused`` leaves rows out, so the kernels write every output row.
    (A NamedTuple, not a frozen dataclass: made on every packed call, and a frozen dataclass's
    ``__init__`` costs a microsecond or two of host time more.)"""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    lens_q: torch.Tensor
    lens_k: torch.Tensor
    max_q: int
    max_k: int
    all_q_used: bool = True
    all_k_used: bool = True

    @property
    def batch(self) -> int:
        return self.lens_q.shape[0]

    def tensors(self) -> tuple:
        return self.cu_q, self.cu_k, self.lens_q, self.lens_k

    def used_q_rows(self, total_q: int) -> torch.Tensor:
        """(total_q,) bool: the query rows some sequence uses."""
        rows = torch.arange(total_q, device=self.cu_q.device, dtype=torch.int32)
        seq = torch.searchsorted(self.cu_q[1:].contiguous(), rows, right=True).clamp_(max=max(self.batch - 1, 0))
        return (rows - self.cu_q[seq]) < self.lens_q[seq]


# --- per-call host helpers -------------------------------------------------------------------

_CONSTANTS: dict = {}
_MAKE = {
    "empty": lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device=device),
    "zeros": lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device),
    "arange": lambda shape, dtype, device: torch.arange(math.prod(shape), dtype=dtype, device=device).view(shape),
}


def constant(kind: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A kernel argument whose contents never change, made once per (kind, shape, dtype, device)
    instead of on every call (an allocation, and for ``zeros``/``arange`` a fill kernel, each a
    microsecond or two of host time; in a CUDA graph a fill is a ~2 us node of its own).
    ``kind``: ``"empty"`` (a placeholder the kernel never reads or writes: a compile-time
    branch, e.g. Sinks without sinks), ``"zeros"`` or ``"arange"`` (row-major over ``shape``).

    Callers must not write to it.  A cached tensor was made and filled before any capture that
    uses it, so CUDA-graph capture and replay see its values; one first asked for during a
    capture is made fresh and not kept (a fill recorded in a capture holds its values only once
    the graph replays, and its memory belongs to the graph's pool).  Entries are never evicted:
    a captured graph may hold their addresses (a handful of small shapes per model)."""
    key = (kind, shape, dtype, device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _MAKE[kind](shape, dtype, device)
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return t
            if kind != "empty":  # filled before a kernel on any other stream reads it
                torch.cuda.current_stream(device).synchronize()
        _CONSTANTS[key] = t
    return t


def placeholder(shape: tuple, device) -> torch.Tensor:
    """A float32 argument that this structure never reads (``constant("empty", ...)``):
    ``debug.placeholder`` without an allocation per call."""
    return constant("empty", shape, torch.float32, device)


_MEMO: dict = {}


def memo(key: tuple, make):
    """``make()`` once per ``key`` (plain hashables naming a static structure), for a launcher's
    per-call lookups that are not ``_memoised`` functions of their arguments (``launch_decode``'s
    kernels, keyed by its memoised schedule's identity: the value keeps the schedule alive, so
    its id is not reused)."""
    value = _MEMO.get(key)
    if value is None:
        value = _MEMO[key] = make()
    return value


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: the builders' dtype string, made once per dtype."""
    return str(dtype).removeprefix("torch.")


def _memoised(structure):
    """``structure`` (a pure function of ints, strs and bools: which builder, config and static
    arguments) memoised, except while ``configs.overrides`` (the tuning hook) is set: then its
    answer may change between calls, so it is computed afresh.  Spares every call the config
    table, the builder import and the key (a few microseconds of host time each)."""
    cached = functools.lru_cache(maxsize=1024)(structure)

    @functools.wraps(structure)
    def get(*args):
        return structure(*args) if configs.overrides else cached(*args)

    get.cache_clear = cached.cache_clear
    return get


def _scores(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(score_scale, cap_in): log2(e) folded into the scale, or into the softcap."""
    if softcap > 0:
        return softcap * LOG2E, softmax_scale / softcap
    return softmax_scale * LOG2E, 0.0


# --- forward --------------------------------------------------------------------------------


def forward_kernel(dim: int, dim_v: int, dtype: str, has_sinks: bool, has_softcap: bool, window=(-1, -1),
                   varlen: bool = False, num_sms: int = 132, out_dtype: Optional[str] = None, short: bool = False,
                   share_sms: bool = False):
    """The compiled forward for one static structure (tiles and builder from ``configs.fwd_config``;
    ``out_dtype`` for FP8 inputs, ``operands``; ``short`` from ``configs.short_forward``;
    ``share_sms``: ``configs.sharing_sms``)."""
    structure = _forward_structure(dim, dim_v, dtype, has_sinks, has_softcap, configs.mask_kind(window), varlen,
                                   num_sms, out_dtype, short, share_sms)
    return cache.get_static(*structure)


@_memoised
def _forward_structure(dim, dim_v, dtype, has_sinks, has_softcap, kind, varlen, num_sms, out_dtype, short=False,
                       share_sms=False):
    """``cache.structure`` of ``forward_kernel``."""
    cfg = configs.fwd_config(dim, dim_v, dtype, kind, varlen, short)
    if share_sms:
        cfg = configs.sharing_sms(cfg)
    static = dict(dim=dim, dim_v=dim_v, dtype=dtype, has_sinks=has_sinks, has_softcap=has_softcap, varlen=varlen)
    if cfg.manual_ws and cfg.tiles_per_cta != 1:
        static["num_sms"] = num_sms
    if dtype == operands.FP8:
        static["out_dtype"] = out_dtype or "bfloat16"
    return cache.structure(configs.builder(cfg), cfg, **static)


def forward_launch(q, k, v, has_sinks: bool, softmax_scale: float, window: tuple[int, int], softcap: float,
                   varlen: bool, out_dtype: torch.dtype, fp8: bool, share_sms: bool) -> tuple:
    """``launch_forward``'s decisions for prepared q, k, v with keys to attend to: (the compiled
    kernel, its scalar arguments).  They depend only on shapes, dtypes, the device and the
    options, so ``flashtile.eager_plans`` keeps them for repeated calls."""
    d, dv = q.shape[-1], v.shape[-1]
    short = not varlen and configs.short_forward(d, dv, q.shape[1], k.shape[1], fp8)
    kernel = forward_kernel(d, dv, dtype_name(q.dtype), has_sinks, softcap > 0, window, varlen,
                            target.sm_count(q.device), dtype_name(out_dtype), short, share_sms)
    left, right = host_window(window)
    scalars = (*_scores(softmax_scale, softcap), left, right, configs.head_group(max(d, dv), configs.mask_kind(window)))
    return kernel, scalars


def launch_forward(q, k, v, sinks, softmax_scale: float, window: tuple[int, int], softcap: float,
                   packed: Optional[Packed] = None, fp8: Optional[tuple] = None, share_sms: bool = False):
    """(out, lse): dense out (B, Sq, H, Dv), lse (B, H, Sq); packed out (total_q, H, Dv),
    lse (H, total_q); float32 natural-log lse.  ``fp8``: None, or ``(q_descale, k_descale,
    v_descale, out_dtype)`` for float8_e4m3fn q, k, v (descales (batch, Hkv) float32; out in
    ``out_dtype``, bfloat16 if None).  ``share_sms``: the call runs beside other kernels (ring
    attention's transfers), so no persistent schedule (``configs.sharing_sms``)."""
    h, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    out_dtype = q.dtype if fp8 is None else (fp8[3] or torch.bfloat16)
    out = debug.new_output((*q.shape[:-1], dv), out_dtype, q.device)
    lse = debug.new_output((h, q.shape[0]) if packed else (q.shape[0], h, q.shape[1]), torch.float32, q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    sk = k.shape[0] if packed else k.shape[1]
    if packed is not None and not packed.all_q_used:  # rows no sequence uses: 0 and -inf
        out.zero_()
        lse.fill_(float("-inf"))
    if sk == 0:  # nothing to attend to: zeros, and lse = sink (or -inf)
        out.zero_()
        if packed is None:
            lse.copy_(sinks.float()[None, :, None].expand_as(lse) if sinks is not None else torch.full_like(lse, float("-inf")))
        else:
            lse.copy_(sinks.float()[:, None].expand_as(lse) if sinks is not None else torch.full_like(lse, float("-inf")))
            lse.masked_fill_(~packed.used_q_rows(q.shape[0])[None, :], float("-inf"))
        return out, lse
    if packed is not None and (packed.batch == 0 or packed.max_q == 0):
        return out, lse
    kernel, scalars = forward_launch(q, k, v, sinks is not None, softmax_scale, window, softcap, packed is not None,
                                     out_dtype, fp8 is not None, share_sms)
    sinks32 = sinks.float().contiguous() if sinks is not None else placeholder((h,), q.device)
    if fp8 is not None:  # V^T for the FP8 P V GEMM; the descales ride after the sinks
        from .transpose_v import launch_transpose_v  # imported with the first FP8 call (its builder's jit decorator)

        v = launch_transpose_v(v, packed)
        v = v if packed is None else v[0]  # packed tensors take their leading 1 at the launch
        sinks32 = operands.params(sinks32, *fp8[:3])
    if packed is None:
        kernel(q, k, v, out, lse, sinks32, *scalars)
    else:
        kernel(q[None], k[None], v[None], out[None], lse[None], sinks32, *packed.tensors(), *scalars, packed.max_q, packed.max_k)
    return out, lse


# --- backward -------------------------------------------------------------------------------


def backward_kernels(dim: int, dim_v: int, dtype: str, has_softcap: bool, has_dlse: bool, deterministic: bool,
                     window=(-1, -1), varlen: bool = False, num_sms: int = 132, share_sms: bool = False):
    """(preprocess, dK/dV main, deterministic dQ or None) compiled for one static structure
    (``share_sms``: ``configs.sharing_sms``)."""
    structures = _backward_structures(dim, dim_v, dtype, has_softcap, has_dlse, deterministic,
                                      configs.mask_kind(window), varlen, num_sms, share_sms)
    return _backward_kernels_of(structures)


def _backward_kernels_of(structures: tuple) -> tuple:
    """The compiled (preprocess, dK/dV main, dQ or None) of ``_backward_structures``' result."""
    return tuple(None if st is None else cache.get_static(*st) for st in structures[:3])


@_memoised
def _backward_structures(dim, dim_v, dtype, has_softcap, has_dlse, deterministic, kind, varlen, num_sms=132,
                         share_sms=False):
    """``cache.structure`` of (preprocess, dK/dV main, dQ or None), then the main kernel's
    ``BwdConfig``."""
    from .cache import BuilderRef, structure

    attention_bwd_preprocess = BuilderRef("bwd_preprocess.attention_bwd_preprocess")

    prep = structure(attention_bwd_preprocess, None, dim_v=dim_v, dtype=dtype, has_dlse=has_dlse, varlen=varlen)
    static = dict(dim=dim, dim_v=dim_v, dtype=dtype, has_softcap=has_softcap, varlen=varlen)
    cfg = configs.bwd_config(dim, dim_v, dtype, kind, has_softcap, varlen)
    if share_sms:
        cfg = configs.sharing_sms(cfg)
    # A packed step's rows past its sequence get P = 0 from the statistics padding only if
    # the padding covers the whole query block (``packed_stats.STAT_PAD``).
    assert not varlen or cfg.block_m <= packed_stats.STAT_PAD, f"backward query block {cfg.block_m} > packed_stats.STAT_PAD"
    extra = {"num_sms": num_sms} if cfg.persistent else {}
    main = structure(configs.builder(cfg), cfg, with_dq=not deterministic, **static, **extra)
    dq = None
    if deterministic:
        dq_cfg = configs.bwd_dq_config(dim, dim_v, dtype, has_softcap)
        dq = structure(configs.builder(dq_cfg), dq_cfg, **static)
    return prep, main, dq, cfg


def _dq_accumulator(shape, device, zeroed: bool):
    """(dQ's fp32 accumulator, the dK/dV kernel's int32 ticket counter (1,), zero).  Default mode:
    both from one zero fill (the counter in 16 bytes past the accumulator), so the persistent
    schedule's counter costs no launch; deterministic mode never touches the accumulator."""
    if not zeroed:
        return torch.empty(shape, dtype=torch.float32, device=device), torch.zeros(1, dtype=torch.int32, device=device)
    n = math.prod(shape)
    flat = torch.zeros(n + 4, dtype=torch.float32, device=device)
    return flat[:n].view(shape), flat[n : n + 1].view(torch.int32)


def launch_backward(dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window, softcap, deterministic,
                    packed: Optional[Packed] = None, share_sms: bool = False):
    """(dq, dk, dv in the input dtype, dsinks (H,) in sinks' dtype or None).

    Shapes as in ``launch_forward``; ``dlse`` shaped like ``lse`` or None.  A packed batch's
    rows that no sequence uses (``seqused``) get zero gradients.  ``share_sms`` as in
    ``launch_forward``."""
    h, d, dv_ = q.shape[-2], q.shape[-1], v.shape[-1]
    hkv = k.shape[-2]
    dtype = dtype_name(q.dtype)
    # Rows a packed batch's seqused leaves out get no kernel write: zeros for them.
    partial_q = packed is not None and not packed.all_q_used
    partial_k = packed is not None and not packed.all_k_used
    dq = torch.zeros_like(q) if partial_q else debug.new_output(q.shape, q.dtype, q.device)
    dk = torch.zeros_like(k) if partial_k else debug.new_output(k.shape, k.dtype, k.device)
    dv = torch.zeros_like(v) if partial_k else debug.new_output(v.shape, v.dtype, v.device)
    lse = lse.contiguous()
    # As 4-D dense tensors with a leading 1 for a packed batch, as the kernels take them.
    lead = (lambda x: x[None]) if packed is not None else (lambda x: x)
    b = 1 if packed is not None else q.shape[0]
    sq = q.shape[0] if packed is not None else q.shape[1]
    sk = k.shape[0] if packed is not None else k.shape[1]

    empty = sq == 0 or sk == 0 or b == 0 or h == 0 or (packed is not None and (packed.batch == 0 or packed.max_q == 0 or packed.max_k == 0))
    if empty:
        dq.zero_(), dk.zero_(), dv.zero_()
        dsinks = None if sinks is None else torch.zeros_like(sinks)
        no_keys = sk == 0 or (packed is not None and packed.max_k == 0)
        if sinks is not None and dlse is not None and no_keys and dlse.numel():
            # Rows without keys: lse = sink and out = 0, so dL/dsink = sum of dlse over the
            # (used) rows: -sum exp(sink - lse) * (dO.O - dlse).
            g = dlse.float()
            if packed is not None:
                g = g * packed.used_q_rows(sq)[None, :]
            dsinks = g.sum(dim=tuple(d for d in range(g.dim()) if d != g.dim() - 2)).to(sinks.dtype)
        return dq, dk, dv, dsinks

    varlen = packed is not None
    num_sms = target.sm_count(q.device)
    kind = configs.mask_kind(window)
    # One structure lookup per call: the kernels and the main kernel's tile config come from it.
    structures = _backward_structures(d, dv_, dtype, softcap > 0, dlse is not None, deterministic, kind, varlen,
                                      num_sms, share_sms)
    prep, dkdv, dq_kernel = _backward_kernels_of(structures)
    main_cfg = structures[3]
    dlse_arg = lead(dlse.contiguous() if dlse is not None else lse)
    if varlen:  # each sequence's statistics start 16-byte aligned, padding after (packed_stats.stat_start)
        delta = torch.zeros(1, h, packed_stats.stat_rows(sq, packed.batch), dtype=torch.float32, device=q.device)
        lse2 = torch.full_like(delta, float("inf"))  # padding: P = exp2(s - inf) = 0
        prep(lead(out), lead(dout), lead(lse), dlse_arg, delta, lse2, packed.cu_q, packed.lens_q, packed.max_q)
    else:
        delta = torch.empty(b, h, (sq + 3) // 4 * 4, dtype=torch.float32, device=q.device)  # rows 16-byte aligned
        lse2 = torch.empty_like(delta)
        prep(out, dout, lse, dlse_arg, delta, lse2)

    left, right = host_window(window)
    score_scale, cap_in = _scores(softmax_scale, softcap)
    scalars = (score_scale, softmax_scale, cap_in, left, right)
    if varlen:  # kv heads of a sequence walked together (a query head group's worth of K/V)
        rows = max(1, configs.head_group(max(d, dv_), kind) // (h // hkv))
    else:
        rows = configs.dkdv_rows_per_group(kind, h // hkv, b * hkv, -(-sk // main_cfg.block_n), num_sms)
    seq_args = packed.tensors() if varlen else ()
    max_args = (packed.max_q, packed.max_k) if varlen else ()
    tensors = (lead(q), lead(k), lead(v), lead(dout), lse2, delta)
    dq_acc, ticket = _dq_accumulator(lead(q).shape, q.device, zeroed=not deterministic)
    # Ticket follows dV (dense) or the packed sequence tensors (``bwd.dkdv_prim_func``).
    ticket_at = (*seq_args, ticket) if varlen else (ticket,)
    dkdv(*tensors, dq_acc, lead(dk), lead(dv), *ticket_at, *scalars, rows, *max_args)
    if deterministic:
        dq_kernel(*tensors, lead(dq), *seq_args, *scalars, *max_args)
    else:
        lead(dq).copy_(dq_acc)  # postprocess: fp32 accumulator -> input dtype

    dsinks = None
    if sinks is not None:
        # dL/dsink = -sum over rows of exp(sink - lse) * Delta, from the statistics buffers:
        # LSE2 = +inf where lse = -inf (a -inf sink on a row that sees no key) gives weight 0,
        # and padding entries (Delta = 0) are left out before exp could overflow.
        weight = torch.exp2(sinks.float()[None, :, None] * LOG2E - lse2)
        dsinks = (-torch.where(delta == 0, 0.0, weight * delta)).sum(dim=(0, 2)).to(sinks.dtype)
    return dq, dk, dv, dsinks
