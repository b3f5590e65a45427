"""Compiled-kernel cache keyed by static structure only.

TileLang already memoises a ``@tilelang.jit`` builder per argument tuple and keeps compiled
artifacts on disk (``$TILELANG_CACHE_DIR``), so a second process starts fast.  This layer
adds one thing: a count of builds per structure, so tests can prove that new batch sizes,
sequence lengths or head counts never trigger a compile.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable

_lock = threading.Lock()
_kernels: dict[tuple, Any] = {}
builds: Counter = Counter()


def get(builder: Callable, **static) -> Any:
    """The compiled kernel for ``builder(**static)``; builds it on first use."""
    name = getattr(builder, "__name__", None) or getattr(getattr(builder, "func", None), "__name__", repr(builder))
    key = (name, tuple(sorted(static.items())))
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kernel = builder(**static)
                _kernels[key] = kernel
                builds[key] += 1
    return kernel


def total_builds() -> int:
    return sum(builds.values())
