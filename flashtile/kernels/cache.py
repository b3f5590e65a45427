"""Compiled-kernel cache keyed by static structure only.

TileLang already memoises a ``@tilelang.jit`` builder per argument tuple and keeps compiled
artifacts on disk (``$TILELANG_CACHE_DIR``), so a second process starts fast.  This layer
adds a count of builds per structure, so tests can prove that new batch sizes, sequence
lengths or head counts never trigger a compile, and says when a build happens: the first call
of a new structure in a process can take seconds (a compile, or a load from TileLang's disk
cache), so it is logged on the ``flashtile`` logger at INFO and, when stderr is a terminal,
printed there as one line with the seconds it took.  ``FLASHTILE_QUIET=1`` silences the line.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable

_lock = threading.Lock()
_kernels: dict[tuple, Any] = {}
builds: Counter = Counter()
log = logging.getLogger("flashtile")


def _describe(static: dict) -> str:
    def show(v):
        return str(v).removeprefix("torch.") if v is not None else "None"

    return ", ".join(f"{k}={show(v)}" for k, v in static.items()) or "default structure"


def _announce() -> bool:
    """Print build lines to stderr: only on a terminal, and not under FLASHTILE_QUIET=1."""
    if os.environ.get("FLASHTILE_QUIET", "0") not in ("", "0"):
        return False
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _build(builder: Callable, name: str, kwargs: dict, static: dict) -> Any:
    what = f"{name} for {_describe(static)}"
    loud = _announce()
    log.info("compiling %s (first use in this process; cached on disk afterwards)", what)
    if loud:
        print(f"flashtile: compiling {what} (first use; cached on disk afterwards)...", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        kernel = builder(**kwargs)
    except BaseException:
        if loud:
            print(" failed", file=sys.stderr, flush=True)
        raise
    dt = time.perf_counter() - t0
    log.info("compiled %s in %.1f s", what, dt)
    if loud:
        print(f" {dt:.1f} s", file=sys.stderr, flush=True)
    return kernel


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
                name = getattr(builder, "__name__", None) or getattr(getattr(builder, "func", None), "__name__", "kernel")
                kernel = _build(builder, name, kwargs, static)
                _kernels[key] = kernel
                builds[(name, tuple(sorted(kwargs.items())))] += 1
    return kernel


def total_builds() -> int:
    return sum(builds.values())
