"""Prediction 13's candidate on GQA and masked shapes (tune.py --check runs MHA only, where a
walk never moves to a group's next head): the d = 64 and d = 128 backward rows with
``BwdConfig.diagonal_start``, 8 query heads over 2 kv heads, Sq != Sk both ways (more keys than
queries puts a full-mask tile's start past the block count), causal and a window, against the
float32 reference (``quick.check``: PASS / FAIL per case)."""

import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from quick import check  # noqa: E402

from flashtile.kernels import configs  # noqa: E402

for d in (64, 128):
    configs.overrides["bwd"] = replace(configs.bwd_config(d, d, torch.bfloat16, "full"), diagonal_start=True)
    for causal, window, sq, sk in ((False, (-1, -1), 317, 451), (False, (-1, -1), 451, 1317), (True, (-1, -1), 451, 317),
                                   (True, (-1, -1), 300, 700), (False, (96, 0), 300, 300)):
        check(2, sq, sk, 8, 2, d, d, torch.bfloat16, causal=causal, window=window)
