"""Modules imported on first use and kept (host time on every call's path).

The kernel modules import TileLang, which a CPU-only user never needs, so the entry points
import them lazily; an import statement inside a function still costs about a microsecond of
host time on every call, so the module is kept after the first one."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable


def lazy_module(name: str) -> Callable[[], ModuleType]:
    """A function returning module ``name`` (absolute), imported on its first call and kept.
    Callers look attributes up on the module at each use, so patching them still works."""
    module = None

    def get() -> ModuleType:
        nonlocal module
        if module is None:
            module = importlib.import_module(name)
        return module

    return get


class LazyAttributes(ModuleType):
    """Module ``name``'s attributes, the module imported on the first attribute read.

    The kernel helper modules (``kernels/masks.py``, ``softmax.py``, ``operands.py``) hold both
    TileLang macros and host constants that the launcher reads on every call.  With ``T =
    LazyAttributes("tilelang.language")`` they import without TileLang, which is then imported
    by the first kernel build (a trace reads ``T.*``); a process whose kernels all load from
    the disk cache by structure id (``kernels/cache.py``) never imports it (issue 19, first use:
    TileLang's import is most of a cold process's first call)."""

    def __init__(self, name: str):
        super().__init__(name)
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr == "_module":  # copy / pickle / introspection probes
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self.__name__)
        return getattr(self._module, attr)
