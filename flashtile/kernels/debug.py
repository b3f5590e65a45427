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
        x.fill_(float("nan"))
    return x


def dummy_sinks(nheads: int, device) -> torch.Tensor:
    """A placeholder for the kernels' Sinks argument when there are no sinks.

    Never read (sinks off is a compile-time branch), so no fill kernel is launched for it.
    """
    return torch.empty(nheads, dtype=torch.float32, device=device)
