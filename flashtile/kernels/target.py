"""What the kernels are built for and run on: architecture, compiler pass configs, SM count.

Builders import their target and pass configs from here; launchers ask ``sm_count`` for
persistent grids and launch orders (never a hard-coded 132).
"""

from __future__ import annotations

import functools

from .configs import ARCH

TARGET = {"kind": "cuda", "arch": ARCH}


@functools.cache
def _pass_configs() -> dict:
    import tilelang

    fast_math = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
    # Every shared-memory hand-over in the hand-written kernels is ordered by an mbarrier or by a
    # named consumer barrier.  TileLang's sync insertion is switched off for them: it adds
    # conservative consumer-wide barriers (three per step in the dK/dV kernel), and inside a
    # persistent tile loop it cannot place them at all ("divergent region" error).
    # Kernels whose global accesses are TMA or in bounds by their own tests or construction
    # (``bwd.attention_bwd_dkdv_regs``): TileLang's safe-memory pass would wrap each element of
    # its dQ reduction in a row and a head test, ~20 instructions per vector atomic.
    return {"PASS_CONFIGS": fast_math,
            "WS_PASS_CONFIGS": {**fast_math, tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True},
            "SELF_GUARDED_PASS_CONFIGS": {**fast_math, tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True}}


def __getattr__(name: str):
    """``PASS_CONFIGS`` / ``WS_PASS_CONFIGS`` / ``SELF_GUARDED_PASS_CONFIGS``, made on the first read: their keys are TileLang's,
    and the launcher imports this module (``sm_count``) without importing TileLang."""
    if name in ("PASS_CONFIGS", "WS_PASS_CONFIGS", "SELF_GUARDED_PASS_CONFIGS"):
        return _pass_configs()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H100 SXM / H200)."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def capability(device) -> tuple[int, int]:
    """(major, minor) compute capability: a driver query, once per device."""
    import torch

    return torch.cuda.get_device_capability(device)
