"""A backward candidate flag on GQA and masked shapes (developer tool, run on the device).

    python3 benchmarks/bwd_flag_check.py producer_regs [...]

``tune.py --check`` runs MHA only, where a dK/dV walk never moves to a group's next head: this
sets the named ``BwdConfig`` flags on the hand-written backward rows (d = 64 and 128, through the
developer switch's hook ``overrides["bwd_flags"]``) and checks 8 query heads over 2 kv heads,
Sq != Sk both ways, causal and a window, against the float32 reference (``quick.check``: PASS /
FAIL per case).  Prediction 13's calls (``h100-2026-12-07g/c``, NOTES) ran it with the since
reverted ``diagonal_start`` flag.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
from quick import check  # noqa: E402

from flashtile.kernels import configs  # noqa: E402

flags = {name: True for name in sys.argv[1:]}
if not flags:
    sys.exit("name at least one BwdConfig flag, e.g. producer_regs")
configs.overrides["bwd_flags"] = flags
for d in (64, 128):
    for causal, window, sq, sk in ((False, (-1, -1), 317, 451), (False, (-1, -1), 451, 1317), (True, (-1, -1), 451, 317),
                                   (True, (-1, -1), 300, 700), (False, (96, 0), 300, 300)):
        check(2, sq, sk, 8, 2, d, d, torch.bfloat16, causal=causal, window=window)
