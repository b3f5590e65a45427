"""An A/B table from ``tune.py``'s output (developer tool, runs anywhere).

    python3 benchmarks/tune_table.py tune.txt [more.txt ...]

``tune.py`` prints one ``TUNE`` line per (config, head dim, seqlen, mask) and round.  This
groups them by case (pass, GQA, head dim, seqlen, causal) and prints, per config in the order
first seen, the range of its times over the rounds and the change of its best time against the
first config's best (the baseline: list it first on tune.py's command line).  Failed timings
and ``FAIL`` check lines are listed at the end.
"""

from __future__ import annotations

import argparse
import collections
import re

LINE = re.compile(
    r"TUNE (?P<pass>\S+) gqa(?P<gqa>\d+) det(?P<det>\d) rows(?P<rows>\d+) (?P<cfg>\(.*?\)) d(?P<d>\d+) "
    r"s(?P<s>\d+) c(?P<c>\d) (?P<ms>[\d.]+)ms ratio (?P<ratio>[\d.]+)"
)


def parse(lines):
    """{case: {config: [ms, ...]}} (insertion-ordered) and the lines that report a failure."""
    cases = collections.defaultdict(lambda: collections.defaultdict(list))
    failures = []
    for line in lines:
        m = LINE.match(line.strip())
        if m:
            case = (m["pass"], int(m["gqa"]), int(m["det"]), int(m["rows"]), int(m["d"]), int(m["s"]), int(m["c"]))
            cases[case][m["cfg"]].append(float(m["ms"]))
        elif "FAIL" in line:
            failures.append(line.strip())
    return cases, failures


def table(cases) -> list[str]:
    out = ["| pass | gqa | d | seqlen | mask | config | ms (rounds) | best vs first |", "| --- | ---: | ---: | ---: | --- | --- | --- | ---: |"]
    for (pass_, gqa, det, rows, d, s, c), configs in sorted(cases.items()):
        base = None
        for cfg, times in configs.items():
            best = min(times)
            base = best if base is None else base
            name = f"{pass_}{' det' if det else ''}{f' rows{rows}' if rows else ''}"
            span = f"{best:.3f}" if len(times) == 1 else f"{best:.3f}-{max(times):.3f}"
            out.append(f"| {name} | {gqa} | {d} | {s} | {'causal' if c else 'full'} | {cfg} | {span} | {100 * (best / base - 1):+.1f}% |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    lines = [line for path in args.files for line in open(path)]
    cases, failures = parse(lines)
    print("\n".join(table(cases)))
    for line in failures:
        print("FAILED:", line[:200])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
