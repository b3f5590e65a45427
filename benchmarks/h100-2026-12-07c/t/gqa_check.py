"""Prediction 10's candidate on GQA shapes (tune.py --check runs MHA only, where the step cursor
never moves to a group's next head): the d = 64 and d = 128 backward rows with
``BwdConfig.producer_regs``, 8 query heads over 2 kv heads, the awkward shapes of tune.py's
check, against the float32 reference (``quick.check``: PASS / FAIL per case)."""

import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from quick import check  # noqa: E402

from flashtile.kernels import configs  # noqa: E402

for d in (64, 128):
    configs.overrides["bwd"] = replace(configs.bwd_config(d, d, torch.bfloat16, "full"), producer_regs=True)
    for causal, window, sq, sk in ((False, (-1, -1), 317, 451), (True, (-1, -1), 451, 317), (False, (96, 0), 300, 300)):
        check(2, sq, sk, 8, 2, d, d, torch.bfloat16, causal=causal, window=window)
