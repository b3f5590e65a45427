"""Memoised plans for repeated eager forwards: the host fast path of ``flash_attn_func``.

A model calls ``flash_attn_func`` with the same shapes, dtypes and options in every layer of
every step.  The general path works everything out again on each call: the validators, the ops
layer's routing, the kernels' coverage checks and preparation, the launcher's tile choice and
scalars (about thirty Python calls, 15 of the 21 us this machine's CPU spends on a no-grad call:
``benchmarks/host_overhead_cpu.py``).  None of it reads tensor contents: it depends on shapes,
dtypes, devices and the options.  So the general path records a *plan* under exactly those
(``forward_key``) when it completes a key's second call (a key's first call only marks it
``SEEN``: shapes that never repeat pay no recording), and later calls with the same key run the
plan: two allocations and the kernel's executable.

Domain (any other call takes the general path, unchanged):

- plain eager CUDA tensors (``ops._plain_eager``: no tracing, no modes, no subclasses) that
  autograd has nothing to record for (no grad mode, or no input requiring grad), checked per
  call since neither is part of the key;
- 16-bit q, k, v whose head dims need no padding, with keys to attend to and a non-empty
  output; no FP8 and no ALiBi;
- options of their common types: Python bool flags, a real (or None) ``softmax_scale`` and
  ``softcap``, ``dropout_p`` 0 or None, a ``window_size`` tuple of two ints.  Exact types keep
  the key faithful to validation: ``causal=1`` is refused by the validators and never meets the
  plan recorded for ``causal=True`` (``1 == True`` as dict keys);
- no tuning override (``configs.overrides``: the launcher's choice may then change per call).

A key is recorded only after the general path accepted its call, so every error the validators
raise is still raised (a refused call records nothing).  Strides are not in the key: the plan
makes q, k, v contiguous and 16-byte aligned per call with ``kernels._prepare``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import ops
from .lazy import lazy_module

_kernels = lazy_module("flashtile.kernels")  # imported once a CUDA call has run the general path

_REAL = (float, int)  # exact types: bool is neither

# key -> ForwardPlan; SEEN for a key met once (a plan is recorded on its second call, so calls
# whose shapes never repeat, e.g. a key length growing by one each decode step, pay only the key
# and this entry: recording on the first call cost them ~9 us each on the CPU machine); or
# NO_PLAN for a key that the general path always takes (shapes or dtypes outside the domain).
# Cleared when full: a model has a handful of keys.
PLANS: dict = {}
SEEN = ()
NO_PLAN = False
MAX_PLANS = 1024


class ForwardPlan(NamedTuple):
    """What the general path decided for one key: the kernel's executable, its scalar arguments,
    the shapes and dtype of out and lse, the device, and the tensor passed for ``sinks=None``."""

    kernel: Any
    scalars: tuple
    out_shape: tuple
    lse_shape: tuple
    dtype: torch.dtype
    device: torch.device
    no_sinks: torch.Tensor


def forward_key(q, k, v, sinks, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                return_attn_probs, return_lse):
    """The plan key of a ``flash_attn_func`` call, or None outside the domain (module docstring).
    The caller has checked that ALiBi and the FP8 options are None."""
    # Plain tensors (or sinks None), nothing tracing, and nothing for autograd to record: per
    # call, since grad mode and requires_grad are not in the key.  A training call (q requires
    # grad) leaves at the first test, so the key costs it a few tenths of a microsecond.
    if torch.is_grad_enabled() and getattr(q, "requires_grad", False):
        return None
    if not ops._plain_eager(q, k, v, sinks) or ops._needs_grad(q, k, v, sinks):
        return None
    if not (type(causal) is bool and type(deterministic) is bool and type(return_attn_probs) is bool
            and type(return_lse) is bool and type(softcap) in _REAL
            and (softmax_scale is None or type(softmax_scale) in _REAL)
            and (dropout_p is None or type(dropout_p) in _REAL)
            and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int):
        return None
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            None if sinks is None else (sinks.shape, sinks.dtype, sinks.device),
            dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, return_lse)


def planned_device(q) -> bool:
    """Plans are recorded for CUDA tensors (``benchmarks/host_overhead_cpu.py`` replaces this
    to time the plan path with CPU tensors and a no-op kernel)."""
    return q.is_cuda


def run_forward(plan: ForwardPlan, q, k, v, sinks):
    """(out, lse) of a call whose key holds ``plan``, or None while an override is set (the
    caller then takes the general path)."""
    kernels = _kernels()
    if kernels.configs.overrides:
        return None
    out = kernels.debug.new_output(plan.out_shape, plan.dtype, plan.device)
    lse = kernels.debug.new_output(plan.lse_shape, torch.float32, plan.device)
    sinks32 = plan.no_sinks if sinks is None else sinks.float().contiguous()
    q, k, v = kernels._prepare(q, k, v)  # contiguous and 16-byte aligned, per call as on the general path
    plan.kernel(q, k, v, out, lse, sinks32, *plan.scalars)
    return out, lse


def record_forward(key, q, k, v, sinks, softmax_scale: float, window: tuple[int, int], softcap: float) -> None:
    """After the general path ran ``key``'s call (``PLANS`` has nothing or SEEN for it): mark the
    key SEEN the first time; the second time keep its plan, or NO_PLAN when the key is outside
    the domain for good.  Nothing is kept while an override is set or a CUDA graph is being
    captured: a later call of that key may be planned."""
    if not planned_device(q):
        return
    if PLANS.get(key) is not SEEN:
        if len(PLANS) >= MAX_PLANS:
            PLANS.clear()
        PLANS[key] = SEEN
        return
    kernels = _kernels()
    launch = kernels._launch()
    # Not while capturing a CUDA graph either: the placeholder the plan keeps must not come
    # from the graph's memory pool (``launch.constant``).
    if kernels.configs.overrides or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    b, sq, h, d = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    plannable = (q.dtype in kernels.configs.DTYPES and b * sq * h > 0 and sk > 0
                 and kernels.configs.kernel_headdims(d, dv, "fwd") == (d, dv))
    plan = NO_PLAN
    if plannable:
        kernel, scalars = launch.forward_launch(q, k, v, sinks is not None, softmax_scale, window, softcap, False,
                                                q.dtype, False, False)
        plan = ForwardPlan(getattr(kernel, "torch_function", kernel),  # a loaded kernel's executable, one frame less
                           scalars, (b, sq, h, dv), (b, h, sq), q.dtype, q.device, launch.placeholder((h,), q.device))
    PLANS[key] = plan
