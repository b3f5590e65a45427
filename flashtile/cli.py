"""``flashtile`` / ``python -m flashtile``: the correctness self-test and the benchmark.

    flashtile check     # correctness of whichever path this machine has (CPU or GPU kernels)
    flashtile bench     # timing table against cuDNN / flash / efficient SDPA, FlexAttention
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from . import bench, check

    parser = argparse.ArgumentParser(prog="flashtile", description=__doc__.split("\n")[0].strip("`: "))
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in (("check", check), ("bench", bench)):
        p = sub.add_parser(name, help=module.__doc__.strip().split("\n")[0], description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
