"""Compiled-kernel cache keyed by static structure only.

TileLang already memoises a ``@tilelang.jit`` builder per argument tuple and keeps compiled
artifacts on disk (``$TILELANG_CACHE_DIR``), so a second process starts fast; before the first
build of a process the package's prebuilt kernels are copied there (``prebuilt.install``).  This
layer adds a count of builds per structure, so tests can prove that new batch sizes, sequence
lengths or head counts never trigger a compile, and says when a build happens: every first use
of a structure in a process is logged on the ``flashtile`` logger at INFO, and one that is still
running after ``ANNOUNCE_AFTER_S`` (a compile, not a disk load) prints one line on stderr saying
what is being built, how long it usually takes and how to build ahead of time, finished with
the seconds it took.  ``FLASHTILE_QUIET=1`` silences the line.

Every kernel here takes all its tensors from the caller (no outputs allocated by TileLang), so
a call goes straight to the compiled tvm-ffi executable (``_direct_calls``) instead of through
TileLang's per-call argument stitching: 10.1 instead of 18.7 us per launch on the H200's host
(``benchmarks/launch_overhead.py``, ``h200-2026-11-27b/f``).
"""

from __future__ import annotations

import logging
import os
import sys
import tarfile
import threading
import time
from collections import Counter
from typing import Any, Callable

ANNOUNCE_AFTER_S = 1.0  # disk loads finish well within it; compiles take 5-40 s
_lock = threading.Lock()
_kernels: dict[tuple, Any] = {}
builds: Counter = Counter()
log = logging.getLogger("flashtile")


def _describe(static: dict) -> str:
    def show(v):
        return str(v).removeprefix("torch.") if v is not None else "None"

    return ", ".join(f"{k}={show(v)}" for k, v in static.items()) or "default structure"


def _announce() -> bool:
    """Print build lines to stderr unless FLASHTILE_QUIET=1."""
    return os.environ.get("FLASHTILE_QUIET", "0") in ("", "0") and sys.stderr is not None


def _build(builder: Callable, name: str, kwargs: dict, static: dict) -> Any:
    what = f"{name} for {_describe(static)}"
    log.info("building %s (first use in this process: a compile, or a load from the disk cache)", what)
    said = threading.Event()

    def say():
        said.set()
        print(f"flashtile: compiling {what} (first use on this machine, usually 5-40 s, cached on disk "
              "afterwards; `python -m flashtile.kernels.precompile` builds ahead of time)...", end="",
              file=sys.stderr, flush=True)

    timer = None
    if _announce():
        if ANNOUNCE_AFTER_S <= 0:
            say()
        else:
            timer = threading.Timer(ANNOUNCE_AFTER_S, say)
            timer.daemon = True
            timer.start()
    t0 = time.perf_counter()
    kernel = None
    try:
        kernel = builder(**kwargs)
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()  # a line it started is finished here
        dt = time.perf_counter() - t0
        if said.is_set():
            print(f" {dt:.1f} s" if kernel is not None else " failed", file=sys.stderr, flush=True)
    log.info("built %s in %.1f s", what, dt)
    return kernel


def _direct_calls(kernel: Any) -> Any:
    """Make ``kernel(*args)`` call the compiled executable itself, from its first call on.

    TileLang's tvm-ffi adapter function (``JITKernel.torch_function``) checks the argument count,
    looks for a tensor's device, lays the arguments out in parameter order (allocating the
    outputs it owns, of which these kernels have none: ``out_idx`` is never set) and then calls
    the executable; the executable reads the current CUDA stream itself.  With no outputs the
    layout is the identity, so the direct call is the same call minus ~9 us of Python.  Kernels
    of another adapter or with adapter-allocated outputs keep the adapter.  Resolved lazily: the
    executable is loaded on the first call (a CPU-only machine builds kernels but never calls
    them)."""
    adapter = getattr(kernel, "adapter", None)
    if (kernel is None or adapter is None or getattr(adapter, "result_idx", None)
            or getattr(adapter, "_ffi_callee_allocated_output_abi", False)
            or not callable(getattr(adapter, "_get_executable", None))):
        return kernel

    def first_call(*args):
        executable = adapter._get_executable()
        kernel.torch_function = executable
        return executable(*args)

    kernel.torch_function = first_call
    return kernel


def get(builder: Callable, config: Any = None, **static) -> Any:
    """The compiled kernel for ``builder(**static, **config.as_kwargs())``; builds it on first use.

    This sits on every attention call, so the hit path is one dict lookup on a key of plain
    hashables (``config`` is a frozen dataclass); names and dicts are made only when building.
    """
    return get_static(*structure(builder, config, **static))


def structure(builder: Callable, config: Any = None, **static) -> tuple:
    """``(builder, config, static (name, value) pairs, cache key)``: ``get_static``'s arguments,
    which a launcher may memoise per structure instead of rebuilding the key on every call."""
    pairs = tuple(static.items())
    return builder, config, pairs, (id(builder), config, *pairs)  # builders are module-level: ids are stable


def get_static(builder: Callable, config: Any, static: tuple, key_: tuple) -> Any:
    """``get`` for a ``structure``."""
    kernel = _kernels.get(key_)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key_)
            if kernel is None:
                if not _kernels:  # the first build of the process: the shipped kernels first
                    from . import prebuilt

                    try:
                        prebuilt.install()
                    except (OSError, tarfile.TarError) as e:  # a read-only or full cache: compile instead
                        log.warning("flashtile: prebuilt kernels not installed (%s); kernels compile on first use", e)
                static = dict(static)
                kwargs = {**static, **(config.as_kwargs() if config is not None else {})}
                name = getattr(builder, "__name__", None) or getattr(getattr(builder, "func", None), "__name__", "kernel")
                kernel = _direct_calls(_build(builder, name, kwargs, static))
                _kernels[key_] = kernel
                builds[(name, tuple(sorted(kwargs.items())))] += 1
    return kernel


def total_builds() -> int:
    return sum(builds.values())
