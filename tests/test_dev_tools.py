"""Developer scripts in ``benchmarks/`` that run anywhere (no GPU): loaded from their files."""

import importlib.util
import pathlib

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tune_table_groups_rounds_per_case_against_the_first_config():
    """``tune_table.py``: rounds of one config collapse to a range, the first config of a case is
    the baseline of the "best vs first" column, cases sort by (pass, ..., seqlen, mask), and
    failed checks are kept."""
    tt = _load("tune_table")
    lines = [
        "TUNE fwd gqa1 det0 rows0 (128, 128, 2, 256, 1, 1, 0) d128 s1024 c0 0.260ms ratio 0.930",
        "TUNE fwd gqa1 det0 rows0 (128, 64, 2, 256, 1, 1, 0) d128 s1024 c0 0.390ms ratio 0.620",
        "TUNE fwd gqa1 det0 rows0 (128, 128, 2, 256, 1, 1, 0) d128 s1024 c0 0.250ms ratio 0.940",
        "TUNE fwd gqa1 det0 rows0 (128, 128, 2, 256, 1, 1, 0) d128 s512 c1 0.120ms ratio 0.850",
        "FAIL b2 sq317 sk451 h4/4 d64/64 bfloat16 c0 dk=6.08e-03/5.69e-03!!",
        "CHECK fwd (128, 128, 2, 256, 1, 1, 0) d128",
    ]
    cases, failures = tt.parse(lines)
    assert failures == [lines[4]]
    rows = tt.table(cases)[2:]
    assert len(rows) == 3, rows
    assert "| 512 | causal |" in rows[0] and "+0.0%" in rows[0]
    assert "(128, 128, 2, 256, 1, 1, 0) | 0.250-0.260 | +0.0% |" in rows[1], rows[1]
    assert "(128, 64, 2, 256, 1, 1, 0) | 0.390 | +56.0% |" in rows[2], rows[2]


def test_host_overhead_cpu_measures_every_row():
    """``host_overhead_cpu.py`` (the CPU estimate of issue 19's host time) runs every entry
    point's CUDA path on stubs; a row that fails (as every kernel row did once kernels tagged in
    the disk cache began to load by id, real kernels given CPU tensors) makes it exit non-zero.
    Its own process: the stubs patch flashtile's modules."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(BENCHMARKS / "host_overhead_cpu.py"), "--n", "5"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "failed" not in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    assert run.stdout.count(" us  ") >= 10, run.stdout
