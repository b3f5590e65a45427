"""What a forward kernel issues, from its SASS, on the CPU machine (developer tool).

    python3 benchmarks/sass_mix.py [--headdim 128] [--fp8] [--config 128,128,2,256,1,1,0,1]

Builds the forward (``launch.forward_kernel``; ``--config`` as ``tune.py``'s tuples, through
``configs.overrides``), compiles its CUDA with nvcc as ``tests/test_kernel_build.py`` does,
disassembles it with ``cuobjdump -sass`` and prints:

* the ptxas line (registers, spills);
* the order of the events that set the softmax's overlap: WGMMA issues (HGMMA/QGMMA), WGMMA
  waits (``WARPGROUP.DEPBAR``, ``gsb0, 0x1`` = wait(1), ``0x0`` = wait(0)) and runs of
  ``MUFU.EX2``.  The seventeenth session found ptxas placing wait(0) before a block's
  exponentials, which the source puts after them (NOTES);
* the opcode histogram of the steady-state key-block step: the instructions between the last
  two wait(1)s of the kernel (the main loop is unrolled twice, so that is one block of it).
  A static count: it includes the mask code (ISETP / FSEL / VIADD), which only boundary
  blocks run (FP8 d=128: 749 static, ~480 issued in a fully visible block).

cuobjdump is not part of this machine's CUDA: ``pip download --no-deps nvidia-cuda-cuobjdump``
and unzip it; point ``CUOBJDUMP`` at the binary (``nvidia/cu13/bin/cuobjdump``) or put it on
``PATH``.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's flashtile
sys.path.insert(0, str(HERE.parent / "tests"))

from flashtile.kernels import configs  # noqa: E402
from test_kernel_build import _ptxas_report  # noqa: E402  (nvcc with the suite's flags)

INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_of(src: str) -> tuple[str, list[tuple[str, str]]]:
    """(ptxas report, [(opcode, operands)] in address order) of one kernel's CUDA source."""
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if tool is None:
        sys.exit("cuobjdump not found: set CUOBJDUMP (see this script's docstring)")
    with tempfile.TemporaryDirectory() as tmp:
        report = _ptxas_report(src, pathlib.Path(tmp))
        text = subprocess.run([tool, "-sass", str(pathlib.Path(tmp) / "k.cubin")], capture_output=True, text=True, check=True).stdout
    return report, [(m.group(1), m.group(2).strip()) for m in INSTR.finditer(text)]


def events(code: list[tuple[str, str]]) -> list[str]:
    """Runs of the overlap-relevant instructions, in order: 'QGMMA x8', 'wait(1)', 'MUFU.EX2 x64'..."""
    out = []
    for op, args in code:
        if "GMMA" in op:
            name = op.split(".")[0]
        elif op == "WARPGROUP.DEPBAR.LE":
            name = f"wait({args.split(',')[-1].strip()[-1]})"
        elif op == "MUFU.EX2":
            name = op
        else:
            continue
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return [f"{n} x{k}" if k > 1 else n for n, k in out]


def steady_step(code: list[tuple[str, str]]) -> collections.Counter:
    """Opcode counts between the last two wait(1)s: one key block of the unrolled main loop."""
    waits = [i for i, (op, args) in enumerate(code) if op == "WARPGROUP.DEPBAR.LE" and args.endswith("0x1")]
    if len(waits) < 2:
        return collections.Counter()
    return collections.Counter(op.split(".")[0] for op, _ in code[waits[-2]:waits[-1]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--config", default=None, help="tune.py's forward tuple, e.g. 128,128,2,256,1,1,0,1")
    args = ap.parse_args()
    if args.config:
        from tune import make_config  # benchmarks/tune.py's tuple -> FwdConfig

        configs.overrides["fwd"] = make_config("fwd", tuple(int(x) for x in args.config.split(",")))
    from flashtile.kernels.launch import forward_kernel

    d = args.headdim
    dtype = "float8_e4m3fn" if args.fp8 else "bfloat16"
    kernel = forward_kernel(d, d, dtype, False, False, out_dtype="bfloat16" if args.fp8 else None)
    report, code = sass_of(kernel.get_kernel_source())
    print(next((line.strip() for line in report.splitlines() if "registers" in line), "ptxas: ?"))
    print(next((line.strip() for line in report.splitlines() if "spill" in line), ""))
    print("events:", ", ".join(events(code)))
    step = steady_step(code)
    print(f"steady block step: {sum(step.values())} instructions (static; the mask code included)")
    print("  " + "  ".join(f"{op} {n}" for op, n in step.most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
