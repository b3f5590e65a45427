"""Per-instruction warp-stall samples from an Nsight Compute source page (developer tool).

    ncu --set full --import-source yes -o rep python3 benchmarks/ncu_dense.py --backward ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > source.csv
    python3 benchmarks/ncu_stalls.py source.csv            # list the kernels
    python3 benchmarks/ncu_stalls.py source.csv 2 --top 40 # stall reasons + hottest SASS lines
    python3 benchmarks/ncu_stalls.py source.csv 2 --by-count

``--by-count`` groups instructions by how often they executed: in a warp-specialised kernel
that separates per-step consumer code, per-step producer code (one warp) and per-CTA prologue
and epilogue code (the ninth session's d=64 backward analysis in NOTES used it).
``--buckets N`` walks the SASS in address order, N instructions at a time: each bucket's share
of the samples, its instructions executed per warp (``--warps``: the kernel's warp count) and
its top stall reasons, so the prologue before the first copy, the loop and the epilogue read
as phases (the twenty-first session's decode fixed-cost analysis in NOTES).
Samples cover every resident warp, idle producers included, so compare shares within a kernel.
"""

from __future__ import annotations

import argparse
import collections
import csv


def kernels(path: str) -> list[dict]:
    out, cur = [], None
    for row in csv.reader(open(path)):
        if row and row[0] == "Kernel Name":
            cur = {"name": row[1], "rows": []}
            out.append(cur)
        elif row and row[0] == "Address" and cur is not None:
            cur["header"] = {name: i for i, name in enumerate(row)}
        elif row and cur is not None:
            cur["rows"].append(row)
    return out


def num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("kernel", nargs="?", type=int, help="index in the listing (omit to list)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--by-count", action="store_true")
    ap.add_argument("--buckets", type=int, default=0, help="phases: N instructions at a time, in address order")
    ap.add_argument("--warps", type=int, default=1, help="warps of the launch (for --buckets' per-warp counts)")
    args = ap.parse_args(argv)
    ks = kernels(args.csv)
    if args.kernel is None:
        for i, k in enumerate(ks):
            print(i, k["name"][:120], len(k["rows"]), "instructions")
        return 0
    k = ks[args.kernel]
    ix = k["header"]
    samples = "Warp Stall Sampling (All Samples)"
    stalls = [c for c in ix if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(num(r[ix[samples]]) for r in k["rows"]) or 1.0
    print(k["name"][:120], f"{total:.0f} samples")
    reasons = collections.Counter()
    for r in k["rows"]:
        for s in stalls:
            reasons[s] += num(r[ix[s]])
    for s, v in reasons.most_common(10):
        print(f"  {s:28s} {100 * v / total:5.1f}%")
    if args.buckets:
        rows = k["rows"]
        for b in range(0, len(rows), args.buckets):
            seg = rows[b:b + args.buckets]
            v = sum(num(r[ix[samples]]) for r in seg)
            if not v:
                continue
            why = collections.Counter()
            for r in seg:
                for s in stalls:
                    why[s[6:]] += num(r[ix[s]])
            executed = sum(num(r[ix["Instructions Executed"]]) for r in seg) / args.warps
            top = ", ".join(f"{s} {100 * n / v:.0f}%" for s, n in why.most_common(3))
            print(f"  {b:6d} {100 * v / total:5.1f}% {executed:8.1f}/warp  {seg[0][1].strip()[:40]:40s} {top}")
        return 0
    if args.by_count:
        share, count = collections.Counter(), collections.Counter()
        for r in k["rows"]:
            key = int(num(r[ix["Instructions Executed"]]))
            share[key] += num(r[ix[samples]])
            count[key] += 1
        for key, v in share.most_common(args.top):
            print(f"  executed {key:>10}  {count[key]:5d} instructions  {100 * v / total:5.1f}% of samples")
        return 0
    for r in sorted(k["rows"], key=lambda r: -num(r[ix[samples]]))[: args.top]:
        main_reason = max(stalls, key=lambda s: num(r[ix[s]]))[6:]
        print(f"  {r[0][-6:]} {100 * num(r[ix[samples]]) / total:5.2f}% {main_reason:13s} {r[1][:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
