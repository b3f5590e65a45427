"""``flashtile`` / ``python -m flashtile``: the correctness self-test and the benchmark.

    flashtile check     # correctness of whichever path this machine has (CPU or GPU kernels)
    flashtile bench     # timing table against cuDNN / flash / efficient SDPA, FlexAttention
"""

from __future__ import annotations

import argparse
import re
import sys

_RST_LITERAL = re.compile(r"``(.+?)``", re.S)
_RST_ROLE = re.compile(r":(?:func|class|meth|mod|attr|obj|data|exc):`~?(.+?)`")
# A value such as "-2,0" or "-1,-1" (a window); argparse takes any token starting with '-'
# for an option unless it looks like a single negative number.
_NEGATIVE_VALUE = re.compile(r"^-\d+(\.\d+)?(,\s*-?\d+(\.\d+)?)+$")


def plain(text: str) -> str:
    """Docstring text for a terminal: RST literals and roles shown as plain words."""
    return _RST_ROLE.sub(r"\1", _RST_LITERAL.sub(r"\1", text))


class PlainFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the docstring's own paragraphs and examples; strips RST markup everywhere."""

    def format_help(self) -> str:
        return plain(super().format_help())


def join_negative_values(argv: list[str]) -> list[str]:
    """``--window -2,0`` -> ``--window=-2,0`` (and ``-x -2,0`` -> ``-x-2,0``) so that argparse
    reads a comma list starting with a minus sign as the option's value, not as an option."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if nxt is not None and _NEGATIVE_VALUE.match(nxt) and tok.startswith("-") and tok != "--" and "=" not in tok:
            out.append(f"{tok}={nxt}" if tok.startswith("--") else tok + nxt)
            i += 2
            continue
        out.append(tok)
        if tok == "--":
            out.extend(argv[i + 1 :])
            break
        i += 1
    return out


def build_parser() -> argparse.ArgumentParser:
    from . import __version__, bench, check
    from .distributed import bench as cp_bench

    parser = argparse.ArgumentParser(
        prog="flashtile", description=plain(__doc__.split("\n")[0]).strip(": "), formatter_class=PlainFormatter
    )
    parser.add_argument("--version", action="version", version=f"flashtile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in (("check", check), ("bench", bench), ("cp", cp_bench)):
        doc = module.__doc__.strip()
        p = sub.add_parser(name, help=plain(doc.split("\n")[0]), description=doc, formatter_class=PlainFormatter)
        module.add_arguments(p)
        p.formatter_class = PlainFormatter  # after add_arguments, which may set its own
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(join_negative_values(argv))
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
