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
