"""Make ``attn_implementation="tile_attention"`` work after a plain ``import flashtile``.

transformers has no plug-in mechanism for attention implementations (its Hub-kernel route
needs the ``kernels`` package and an ``org/repo`` name), so flashtile registers itself:

- if ``transformers.modeling_utils`` (where ``AttentionInterface`` lives) is already loaded,
  ``install()`` registers at once;
- otherwise ``install()`` puts a small finder on ``sys.meta_path`` that waits for
  ``transformers.modeling_utils`` to finish loading, registers, and removes itself.

Nothing here imports transformers: ``import flashtile`` costs one ``sys.modules`` lookup and,
until transformers loads, one string comparison per import.  Set ``FLASHTILE_HF_AUTOREGISTER=0``
to turn this off (``flashtile.integrations.transformers.register()`` still works).  A failed
registration warns and never breaks the import of transformers.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import warnings

TARGET = "transformers.modeling_utils"


def _register() -> None:
    try:
        from . import transformers as ft_hf

        ft_hf.register()
    except Exception as e:  # never break the user's import of transformers
        warnings.warn(
            f"flashtile: could not register attn_implementation='tile_attention' with transformers "
            f"({type(e).__name__}: {e}); call flashtile.integrations.transformers.register() to see the error",
            RuntimeWarning,
            stacklevel=2,
        )


class _Loader(importlib.abc.Loader):
    """Wraps the real loader of ``transformers.modeling_utils``: runs it, then registers."""

    def __init__(self, loader, finder: "_Finder"):
        self._loader = loader
        self._finder = finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._finder.remove()
        _register()

    def __getattr__(self, name):  # get_source, get_filename, is_package, ... of the real loader
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def install() -> None:
    """Register now if transformers' model code is loaded, else once it loads."""
    if os.environ.get("FLASHTILE_HF_AUTOREGISTER", "1") == "0":
        return
    if TARGET in sys.modules:
        _register()
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
