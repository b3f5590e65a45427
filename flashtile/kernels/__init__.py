"""Kernel registry: what the TileLang kernels cover, and the CUDA entry points.

``forward``/``backward`` are called by ``flashtile.ops`` for CUDA tensors.  A case no kernel
covers raises ``NotImplementedError`` naming it; there is no silent fallback to a slow path.
"""

from __future__ import annotations

import functools

import torch

from . import configs


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)  # a driver query: once per device, not per call


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why no kernel runs this call, or None when one does."""
    if q.dtype not in configs.DTYPES:
        return f"dtype {q.dtype} on CUDA (kernels take float16 and bfloat16; cast, or use CPU tensors)"
    major, minor = _capability(q.device)
    if major != 9:
        return f"GPU {torch.cuda.get_device_name(q.device)} (sm_{major}{minor}); kernels are built for Hopper (sm_90)"
    # Kernels index with 32-bit integers (TileLang's default); larger tensors would overflow.
    out_numel = q.shape[0] * q.shape[1] * q.shape[2] * v.shape[-1]
    for name, numel in (("q", q.numel()), ("k", k.numel()), ("v", v.numel()), ("out", out_numel)):
        if numel >= 2**31:
            return f"{name} with 2^31 or more elements (kernels index with 32 bits; split the batch)"
    for name, dim in (("headdim", q.shape[-1]), ("headdim_v", v.shape[-1])):
        if not 0 < dim <= configs.MAX_HEADDIM:
            return f"{name}={dim} (kernels take head dims up to {configs.MAX_HEADDIM})"
    return None


def _prepare(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Contiguous, 16-byte aligned copies where needed (TMA descriptors require both)."""
    return [
        x.clone(memory_format=torch.contiguous_format) if not x.is_contiguous() or x.data_ptr() % 16 else x
        for x in tensors
    ]


def _pad_headdim(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with zero columns appended up to ``dim`` (``configs.kernel_headdim``)."""
    return x if x.shape[-1] == dim else torch.nn.functional.pad(x, (0, dim - x.shape[-1]))


def _require(q, k, v) -> None:
    reason = unsupported_reason(q, k, v)
    if reason is not None:
        raise NotImplementedError(f"flashtile: no CUDA kernel for {reason}")


def forward(q, k, v, sinks, softmax_scale, window, softcap):
    """(out, lse) on CUDA; see ``fwd.launch_forward``."""
    from .fwd import launch_forward

    _require(q, k, v)
    d, dv = q.shape[-1], v.shape[-1]
    dp, dvp = configs.kernel_headdims(d, dv, "fwd")
    q, k, v = _prepare(_pad_headdim(q, dp), _pad_headdim(k, dp), _pad_headdim(v, dvp))
    out, lse = launch_forward(q, k, v, sinks, softmax_scale, window, softcap)
    return out[..., :dv], lse


def backward(dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window, softcap, deterministic):
    """(dq, dk, dv, dsinks or None) on CUDA; see ``bwd.launch_backward``."""
    from .bwd import launch_backward

    _require(q, k, v)
    d, dv = q.shape[-1], v.shape[-1]
    dp, dvp = configs.kernel_headdims(d, dv, "bwd")
    dout, q, k, v, out = _prepare(
        _pad_headdim(dout, dvp), _pad_headdim(q, dp), _pad_headdim(k, dp), _pad_headdim(v, dvp), _pad_headdim(out, dvp)
    )
    dq, dk, dv_, dsinks = launch_backward(dout, dlse, q, k, v, out, lse, sinks, softmax_scale, window, softcap, deterministic)
    return dq[..., :d], dk[..., :d], dv_[..., :dv], dsinks
