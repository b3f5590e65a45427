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


def get(builder: Callable, config: Any = None, **static) -> Any:
    """The compiled kernel for ``builder(**static, **config.as_kwargs())``; builds it on first use.

    This sits on every attention call, so the hit path is one dict lookup on a key of plain
    hashables (``config`` is a frozen dataclass); names and dicts are made only when building.
    """
    key = (id(builder), config, *static.items())  # builders are module-level: ids are stable
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kwargs = {**static, **(config.as_kwargs() if config is not None else {})}
                kernel = builder(**kwargs)
                _kernels[key] = kernel
                name = getattr(builder, "__name__", None) or getattr(getattr(builder, "func", None), "__name__", "kernel")
                builds[(name, tuple(sorted(kwargs.items())))] += 1
    return kernel


def total_builds() -> int:
    return sum(builds.values())
