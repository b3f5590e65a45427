"""Kept for the device scripts: the decode sweep lives in ``flashtile.bench_decode``
(``flashtile bench --decode``)."""

import sys

from flashtile.bench_decode import main

if __name__ == "__main__":
    sys.exit(main())
