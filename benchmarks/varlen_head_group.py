"""flashtile bench --varlen with the packed grids' head group overridden (a runtime argument,
``configs.head_group``; no recompile): `python3 benchmarks/varlen_head_group.py G [bench args]`."""
import sys

from flashtile import bench
from flashtile.kernels import configs

configs.overrides["head_group"] = int(sys.argv[1])
sys.exit(bench.main(sys.argv[2:]))
