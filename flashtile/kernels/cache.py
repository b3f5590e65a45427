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

A kernel's first use in a process normally costs TileLang a trace of the builder into TIR (to
compute its disk-cache key) and, before that, the import of the builder's module, whose
``@tilelang.jit`` decorators rewrite each kernel function's AST: ~0.4 s each on the CPU
machine.  Each cache entry this layer builds or loads is tagged with the structure's id
(``structure_id``: the builder, the static arguments, TileLang's version and a digest of this
package's kernel sources), so later processes find the entry by that id and load its
executable without importing the builder or tracing it (``_load_indexed``; builders named by
``BuilderRef`` are imported only to build).  Any change to the kernel sources changes every id,
so an entry built from older sources is never picked.

Every kernel here takes all its tensors from the caller (no outputs allocated by TileLang), so
a call goes straight to the compiled tvm-ffi executable (``_direct_calls``) instead of through
TileLang's per-call argument stitching: 10.1 instead of 18.7 us per launch on the H200's host
(``benchmarks/launch_overhead.py``, ``h200-2026-11-27b/f``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import tarfile
import threading
import time
from collections import Counter
from functools import lru_cache
from pathlib import Path
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


TAG = "flashtile-structure-"  # + structure id: an empty file in the TileLang cache entry


class BuilderRef:
    """A ``@tilelang.jit`` builder of this package by name (``"fwd_ws.attention_fwd_ws_kernel"``),
    imported only when a kernel must be built (``resolve``)."""

    __slots__ = ("name", "__name__")

    def __init__(self, name: str):
        self.name = name
        self.__name__ = name.rsplit(".", 1)[1]

    def resolve(self) -> Callable:
        import importlib

        module, attr = self.name.rsplit(".", 1)
        return getattr(importlib.import_module(f"{__package__}.{module}"), attr)

    def __eq__(self, other):
        return isinstance(other, BuilderRef) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return f"BuilderRef({self.name!r})"


# Modules of this package that run on the host only: what they do reaches a kernel only through
# a builder's name and static arguments, which the structure id holds, so editing them keeps
# every id (and the carried or shipped kernels) valid.
HOST_ONLY_SOURCES = frozenset({"__init__.py", "cache.py", "debug.py", "launch.py", "precompile.py", "prebuilt.py"})


@lru_cache(maxsize=1)
def _sources_digest() -> str:
    """sha256 over this package's kernel sources (builders, macros, tile tables; not
    ``HOST_ONLY_SOURCES``): part of every structure id, so an edited kernel never loads an
    entry built from the old source."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if path.name not in HOST_ONLY_SOURCES:
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def structure_id(builder: Callable, kwargs: dict) -> str:
    """The id of one compiled kernel: TileLang's version, the builder, the static arguments and
    ``_sources_digest`` (which covers the jit options: targets and pass configs are written in
    these sources).  A ``BuilderRef`` is its name; a builder object its function and jit options
    (two compilations of one function differ in pass configs only)."""
    from . import prebuilt

    if isinstance(builder, BuilderRef):
        who = builder.name
    else:  # jit options in the order the sources write them (the digest covers those)
        func = getattr(getattr(builder, "func", None), "orig_func", builder)
        options = [repr(getattr(builder, k, None)) for k in ("target", "pass_configs", "compile_flags", "out_idx", "execution_backend")]
        who = "|".join([f"{getattr(func, '__module__', '')}.{getattr(func, '__qualname__', repr(func))}", *options])
    text = "|".join([prebuilt._tilelang_version(), who, repr(sorted(kwargs.items())), _sources_digest()])
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def _entries_root() -> Path:
    """TileLang's directory of cache entries (``<cache>/<version>/<platform>/kernels``)."""
    from . import prebuilt

    return prebuilt.cache_root() / prebuilt._platform() / "kernels"


_index: dict[str, Path] | None = None


def _indexed_entry(sid: str) -> Path | None:
    """The cache entry tagged ``sid`` (the tags are listed once per process)."""
    global _index
    if _index is None:
        root = _entries_root()
        _index = {tag.name[len(TAG):]: tag.parent for tag in root.glob(f"*/{TAG}*")} if root.is_dir() else {}
    entry = _index.get(sid)
    return entry if entry is not None and (entry / "executable.so").is_file() else None


class IndexedKernel:
    """A kernel loaded from its tagged cache entry: called like TileLang's kernels (the compiled
    executable, arguments in parameter order), with the device source for inspection."""

    def __init__(self, entry: Path):
        self.entry = entry
        self.torch_function = _load_executable(entry / "executable.so")

    def __call__(self, *args):
        return self.torch_function(*args)

    def get_kernel_source(self) -> str:
        return (self.entry / "device_kernel.cu").read_text()


_runtime_loaded = False


def _load_runtime_libraries() -> bool:
    """Load what TileLang's executables call into without importing TileLang: its TVM runtime
    (the CUDA module holding a kernel's binary) and ``libtilelang.so`` (registers
    ``__tvm_tensormap_create_tiled``, which builds the TMA descriptors at every launch), global
    and lazily bound as TileLang's ``__init__`` loads them, after torch (its CUDA libraries
    first) and Z3 (``libtilelang.so``'s dependency, from its package as TileLang does).  False
    when a library or the registration is missing: the caller imports TileLang instead."""
    global _runtime_loaded
    if _runtime_loaded:
        return True
    import ctypes
    import importlib.util

    import torch  # noqa: F401
    import tvm_ffi

    try:
        z3 = importlib.util.find_spec("z3")
        z3_libs = sorted(Path(z3.submodule_search_locations[0]).glob("lib/libz3.so*")) if z3 else []
        if z3_libs:
            ctypes.CDLL(str(z3_libs[0]), mode=ctypes.RTLD_GLOBAL)
        libs = Path(importlib.util.find_spec("tilelang").submodule_search_locations[0]) / "lib"
        for name in ("libtvm_runtime.so", "libtilelang.so"):
            ctypes.CDLL(str(libs / name), mode=ctypes.RTLD_GLOBAL | os.RTLD_LAZY)
    except (OSError, AttributeError, TypeError, IndexError) as e:
        log.info("flashtile: TileLang's runtime libraries did not load alone (%s); importing TileLang", e)
        return False
    _runtime_loaded = tvm_ffi.get_global_func("__tvm_tensormap_create_tiled", allow_missing=True) is not None
    return _runtime_loaded


def _load_executable(path: Path) -> Any:
    """A compiled kernel's tvm-ffi module, callable with the kernel's arguments.

    Without TileLang imported, only what the executable needs is loaded (tvm-ffi: the calling
    convention, DLPack and the caller's CUDA stream for torch tensors; ``_load_runtime_libraries``):
    TileLang's own import costs a cold process 1-2 s of its first call, and a kernel build
    imports it anyway."""
    if "tilelang" in sys.modules or not _load_runtime_libraries():
        from tilelang import tvm

        return tvm.runtime.load_module(str(path))
    import tvm_ffi

    return tvm_ffi.load_module(str(path))


def _load_indexed(sid: str, what: str) -> Any:
    """The kernel of structure ``sid`` from its tagged entry, or None (no tag, or a load that
    fails: the caller builds through TileLang as before)."""
    entry = _indexed_entry(sid)
    if entry is None:
        return None
    try:
        kernel = IndexedKernel(entry)
    except Exception as e:  # a damaged entry: TileLang rebuilds or reloads it
        log.warning("flashtile: could not load %s from %s (%s); building it", what, entry, e)
        return None
    log.info("loaded %s from %s (no trace)", what, entry)
    return kernel


def _tag(kernel: Any, sid: str) -> None:
    """Tag the TileLang cache entry ``kernel`` came from (a compile's or a disk hit's) with
    ``sid``; a cache that cannot be written is left untagged."""
    entry = getattr(kernel, "_tilelang_cache_path", None)
    if entry is None or not _direct_callable(kernel) or not (Path(entry) / "executable.so").is_file():
        return  # an adapter that allocates outputs must stay in the call: never loaded by id
    try:
        (Path(entry) / f"{TAG}{sid}").touch()
    except OSError:
        return
    if _index is not None:
        _index[sid] = Path(entry)


def _direct_callable(kernel: Any) -> bool:
    """Whether ``kernel``'s executable takes exactly the caller's arguments (no outputs that
    TileLang's adapter allocates): then it may be called directly, and loaded by structure id."""
    adapter = getattr(kernel, "adapter", None)
    return not (kernel is None or adapter is None or getattr(adapter, "result_idx", None)
                or getattr(adapter, "_ffi_callee_allocated_output_abi", False)
                or not callable(getattr(adapter, "_get_executable", None)))


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
    if not _direct_callable(kernel):
        return kernel
    adapter = kernel.adapter

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
    who = builder if isinstance(builder, BuilderRef) else id(builder)  # builders are module-level: ids are stable
    return builder, config, pairs, (who, config, *pairs)


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
                sid = structure_id(builder, kwargs)
                kernel = _load_indexed(sid, f"{name} for {_describe(static)}")
                if kernel is None:
                    jit = builder.resolve() if isinstance(builder, BuilderRef) else builder
                    built = _build(jit, name, kwargs, static)
                    _tag(built, sid)
                    kernel = _direct_calls(built)
                _kernels[key_] = kernel
                builds[(name, tuple(sorted(kwargs.items())))] += 1
    return kernel


def total_builds() -> int:
    return sum(builds.values())
