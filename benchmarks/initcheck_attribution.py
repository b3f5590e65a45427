"""Attribute compute-sanitizer initcheck reports to the sanitize driver's cases.

    python3 benchmarks/initcheck_attribution.py <dir>/initcheck.log

Reads the log of ``compute-sanitizer --tool initcheck --show-backtrace no python3
benchmarks/sanitize_cases.py ...`` (reports and the driver's ``case NAME sq=.. sk=..: N
launches`` lines, in the order they happened) and prints, per case, how many uninitialized-read
reports came from flashtile kernels (TileLang names them ``main_kernel``) and from PyTorch
kernels, with the access sizes.  A case whose flashtile reports are all reads of tensors that
an earlier flashtile kernel stored through TMA (the backward reading the forward's O and lse)
is initcheck's TMA blind spot (benchmarks/initcheck_probe.py); a forward-only or decode case
with flashtile reports is a real read of unwritten memory.
"""

from __future__ import annotations

import collections
import re
import sys


def main(path: str) -> int:
    per_case = collections.OrderedDict()
    bucket = collections.Counter()
    pending_size = None
    for line in open(path, errors="replace"):
        m = re.search(r"Uninitialized __global__ memory read of size (\d+) bytes", line)
        if m:
            pending_size = m.group(1)
            continue
        m = re.match(r"=+\s+at (.+)$", line.strip())  # "at main_kernel+0x1a0", "at void at::native::...+0x830"
        if m and pending_size is not None:
            who = "flashtile" if m.group(1).startswith("main_kernel") else "pytorch"
            bucket[f"{who}:{pending_size}B"] += 1
            pending_size = None
            continue
        m = re.match(r"case (.+?): \d+ launches", line)
        if m:
            per_case[m.group(1)] = bucket
            bucket = collections.Counter()
    if bucket:
        per_case["(after the last case)"] = bucket
    flagged = {c: b for c, b in per_case.items() if b}
    print(f"initcheck attribution: {len(per_case)} cases, {len(flagged)} with reports")
    kinds = collections.Counter()
    for c, b in flagged.items():
        kinds.update(b)
        print(f"  {c}: " + ", ".join(f"{k} x{v}" for k, v in sorted(b.items())))
    print("  total: " + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())))
    own = sum(v for k, v in kinds.items() if k.startswith("flashtile"))
    # last line, read by sanitize.sh
    print(f"reports read by flashtile kernels: {own}, by PyTorch kernels: {sum(kinds.values()) - own}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
