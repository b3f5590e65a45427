"""Kernels compiled ahead of time and shipped with the package: the first call on a fresh Hopper
machine loads them instead of compiling (issue 19: first result without a compile).

The bundle ``flashtile/kernels/prebuilt/tilelang-<version>-<platform>.tar.xz`` holds TileLang
disk-cache entries (each an ``executable.so`` embedding its sm_90a cubin) for ``COMMON``: dense
fp16/bf16 forward and backward at head dims 64, 128 and 256, which also serve causal, windowed,
GQA/MQA calls and any lengths (those are runtime values).  TileLang keys its cache by the
lowered kernel, target and TileLang version, never by the GPU, so entries built on a CPU machine
with nvcc are hits on any Hopper GPU.  ``install()`` copies the bundle's entries into TileLang's
cache directory before the first kernel build of a process (``cache.get``), once per (bundle,
cache directory): each entry is unpacked beside the cache and renamed into place, so processes
starting together (one per GPU) never see a half-written entry.  A bundle from another TileLang
version or platform is not used, and a kernel it lacks compiles as before.

Build it (nvcc, no GPU needed; a wheel build runs this before packaging):

    python -m flashtile.kernels.prebuilt build [--jobs N]
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# (head dims, dtypes, features, passes) for ``precompile.structures``: what most calls need.
COMMON = ([(64, 64), (128, 128), (256, 256)], ["bfloat16", "float16"], ["plain"], ["fwd", "bwd"])
_installed = False


@functools.cache
def _tilelang_version() -> str:
    """TileLang's release (its cache's directory name), from the installed distribution's
    metadata: importing TileLang for it would cost a process that only loads cached kernels
    most of its first call (``cache.IndexedKernel``)."""
    tilelang = sys.modules.get("tilelang")
    if tilelang is not None:
        return tilelang.__version__.split("+")[0]
    try:
        return importlib.metadata.version("tilelang").split("+")[0]
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path: ask it
        import tilelang

        return tilelang.__version__.split("+")[0]


def _platform() -> str:
    return f"{platform.system().lower()}-{platform.machine()}"


def bundle_path() -> Path:
    return Path(__file__).with_name("prebuilt") / f"tilelang-{_tilelang_version()}-{_platform()}.tar.xz"


def cache_root() -> Path:
    """TileLang's versioned cache directory (``$TILELANG_CACHE_DIR/<version>``; TileLang's
    default ``~/.tilelang/cache``), found without importing TileLang."""
    tilelang = sys.modules.get("tilelang")
    base = tilelang.env.TILELANG_CACHE_DIR if tilelang is not None else (
        os.environ.get("TILELANG_CACHE_DIR") or os.path.expanduser("~/.tilelang/cache"))
    return Path(base) / _tilelang_version()


def install() -> int:
    """Copy the bundle's kernels into TileLang's cache (once per process; a marker per flashtile
    version, bundle size and cache directory makes later processes skip the unpacking).  Returns
    the number of entries added."""
    global _installed
    if _installed:
        return 0
    _installed = True
    bundle = bundle_path()
    if not bundle.is_file():
        return 0
    root = cache_root()
    kernels = root / _platform() / "kernels"  # TileLang's layout: <version>/<platform>/kernels/<hash>/
    from .. import __version__

    marker = root / f".flashtile-prebuilt-{__version__}-{bundle.stat().st_size}"
    if marker.exists():
        return 0
    kernels.mkdir(parents=True, exist_ok=True)
    added = 0
    with tempfile.TemporaryDirectory(dir=root, prefix=".flashtile-unpack-") as tmp:
        with tarfile.open(bundle, "r:xz") as tar:
            tar.extractall(tmp, filter="data")
        for entry in sorted((Path(tmp) / _platform() / "kernels").iterdir()):
            dest = kernels / entry.name
            if dest.exists():
                continue
            try:
                os.rename(entry, dest)  # atomic: another process either sees all of it or none
                added += 1
            except OSError:  # another process put it there first
                pass
    marker.touch()
    return added


def build(jobs: int = 2) -> Path:
    """Compile ``COMMON`` into a fresh TileLang cache and pack it as the bundle."""
    out = bundle_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flashtile-prebuilt-") as tmp:
        env = dict(os.environ, TILELANG_CACHE_DIR=tmp)
        dims, dtypes, features, passes = COMMON
        cmd = [sys.executable, "-m", "flashtile.kernels.precompile", "--jobs", str(jobs), "--headdim",
               *[f"{d}/{dv}" for d, dv in dims], "--dtype", *dtypes, "--features", *features, "--passes", *passes]
        subprocess.run(cmd, env=env, check=True)
        src = Path(tmp) / _tilelang_version()
        with tarfile.open(out, "w:xz") as tar:
            tar.add(src / _platform() / "kernels", arcname=f"{_platform()}/kernels")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["build", "install", "where"])
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    a = ap.parse_args(argv)
    if a.command == "build":
        path = build(a.jobs)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    elif a.command == "install":
        print(f"added {install()} kernels to {cache_root()}")
    else:
        print(bundle_path(), "(present)" if bundle_path().is_file() else "(absent)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
