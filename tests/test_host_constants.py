"""Per-call host savings that keep results unchanged: the launchers' cached constant kernel
arguments (``launch.constant``), the decode defaults built on them, and the window folding."""

from __future__ import annotations

import numpy as np
import torch

from flashtile.interface import normalize_window
from flashtile.kernels import decode, launch

CPU = torch.device("cpu")


def test_constants_are_made_once_per_structure():
    a = launch.constant("arange", (3, 1), torch.int32, CPU)
    assert a is launch.constant("arange", (3, 1), torch.int32, CPU)
    assert a.shape == (3, 1) and a.dtype == torch.int32 and a.flatten().tolist() == [0, 1, 2]
    z = launch.constant("zeros", (5,), torch.int32, CPU)
    assert z.tolist() == [0] * 5
    assert launch.constant("zeros", (6,), torch.int32, CPU).shape == (6,)  # another shape, another tensor
    p = launch.placeholder((4,), CPU)
    assert p is launch.placeholder((4,), CPU) and p.dtype == torch.float32


def test_decode_defaults():
    assert decode.int32_constant("arange", 4, CPU).tolist() == [0, 1, 2, 3]
    assert decode.int32_constant("arange", (2, 1), CPU).tolist() == [[0], [1]]
    assert decode.int32_constant("zeros", 3, CPU).tolist() == [0, 0, 0]


def test_memo_keeps_the_first_value():
    calls = []
    key = ("test_host_constants", object())
    assert launch.memo(key, lambda: calls.append(1) or "x") == "x"
    assert launch.memo(key, lambda: calls.append(1) or "y") == "x" and calls == [1]


def test_packed_fields_and_defaults():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    lens = torch.tensor([2, 3], dtype=torch.int32)
    p = launch.Packed(cu, cu, lens, lens, 3, 3)
    assert p.all_q_used and p.all_k_used and p.batch == 2 and p.tensors() == (cu, cu, lens, lens)


def test_normalize_window_gives_python_ints():
    for window in ((-1, -1), [3, 2], (np.int64(3), np.int32(2))):
        left, right = normalize_window(False, window)
        assert type(left) is int and type(right) is int and (left, right) == tuple(int(w) for w in window)
    assert normalize_window(True, (np.int64(4), 7)) == (4, 0)
