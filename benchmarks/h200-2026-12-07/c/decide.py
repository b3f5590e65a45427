"""Prediction 8's keep rule, applied on the device (call c).

    python3 decide.py TUNE_LINES          # KEEP or REVERT, with the eight ratios
    python3 decide.py --stage CONFIGS_PY  # put the staged d = 256 backward default in place

KEEP when the two-stage `dq_regs` kernel is faster than the table kernel in every timing (both
rounds of 4k / 16k, full / causal), as the thirty-fourth session's NOTES wrote it down before
any measurement.  A missing or failed timing counts as a loss.
"""

import re
import sys
from collections import defaultdict

TABLE = "(64, 64, 1, 256, 1)"
STAGED = "(64, 64, 2, 256, 1, 0, 0, 0, 1)"
OLD_LINE = "return BwdConfig(block_n=64, block_m=64, num_stages=1, threads=256, overlap=True)"
NEW_LINE = "return BwdConfig(block_n=64, block_m=64, num_stages=2, threads=256, overlap=True, dq_regs=True)"


def decide(path: str) -> bool:
    times = defaultdict(list)  # (config, case) -> ms per round, in order
    for line in open(path):
        m = re.match(r"TUNE bwd \S+ \S+ \S+ (\(.*?\)) d256 (s\d+ c\d) ([\d.]+)ms", line)
        if m:
            times[m.group(1), m.group(2)].append(float(m.group(3)))
    cases = sorted({case for _, case in times})
    wins = []
    for case in cases:
        for r in range(2):
            base, new = times[TABLE, case], times[STAGED, case]
            ok = len(base) > r and len(new) > r and new[r] < base[r]
            ratio = f"{base[r] / new[r]:.3f}" if len(base) > r and len(new) > r else "missing"
            print(f"  {case} round {r + 1}: table / staged = {ratio}")
            wins.append(ok)
    keep = len(wins) == 8 and all(wins)
    print("KEEP two stages + dq_regs" if keep else f"REVERT (wins {sum(wins)} of 8 timings)")
    return keep


def stage(path: str) -> None:
    text = open(path).read()
    if text.count(OLD_LINE) != 1:
        sys.exit(f"staging failed: the table's d = 256 line is not in {path} exactly once")
    open(path, "w").write(text.replace(OLD_LINE, NEW_LINE))
    print(f"staged: {NEW_LINE}")


if __name__ == "__main__":
    if sys.argv[1] == "--stage":
        stage(sys.argv[2])
    else:
        decide(sys.argv[1])
