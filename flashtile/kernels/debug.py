"""Output allocation with an optional poison fill, so tests can see unwritten elements.

``FLASHTILE_POISON=1`` (or ``poison(True)``) fills every kernel output with NaN before the
launch; a kernel that skips an element then fails the comparison instead of passing on
whatever ``torch.empty`` happened to hold.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

_poison = os.environ.get("FLASHTILE_POISON", "0") == "1"


@contextmanager
def poison(enabled: bool = True):
    """Context manager: poison kernel outputs inside the block."""
    global _poison
    old, _poison = _poison, enabled
    try:
        yield
    finally:
        _poison = old


def new_output(shape, dtype, device) -> torch.Tensor:
    x = torch.empty(shape, dtype=dtype, device=device)
    if _poison:
        if dtype == torch.float8_e4m3fn:
            x.view(torch.int8).fill_(0x7F)  # e4m3fn's NaN (no fill kernel for float8 everywhere)
        else:
            x.fill_(float("nan"))
    return x


def placeholder(*shape: int, device) -> torch.Tensor:
    """A float32 tensor for a kernel argument that this structure never reads (a compile-time
    branch: Sinks without sinks, the FP8 descales of a bf16 cache), so no fill kernel is
    launched for it."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def dummy_sinks(nheads: int, device) -> torch.Tensor:
    """The kernels' Sinks argument when there are no sinks (``placeholder``)."""
    return placeholder(nheads, device=device)
