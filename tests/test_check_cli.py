"""``flashtile check``: the self-test runs, prints a table, and its exit status means something."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtile import check

ROOT = Path(__file__).resolve().parents[1]
# cli.build_parser imports both subcommand modules; bench.py is written separately.
needs_bench = pytest.mark.skipif(
    importlib.util.find_spec("flashtile.bench") is None, reason="flashtile/bench.py does not exist yet (cli imports it)"
)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    check.add_arguments(p)
    return p.parse_args(list(argv))


def test_docstring_first_line_is_a_summary():
    first = check.__doc__.strip().split("\n")[0]
    assert first and len(first) < 100 and first.endswith((".", ")")), first


def test_run_quick_passes_and_prints_table(capsys):
    assert check.run(_args("--quick")) == 0
    out = capsys.readouterr().out
    assert "flashtile check" in out and "pass" in out and "FAIL" not in out
    expected = "kernels" if torch.cuda.is_available() else "naive float64"
    assert expected in out
    for col in ("out", "lse", "dq", "dk", "dv", "dsinks"):
        assert col in out


def test_main_with_filter(capsys):
    assert check.main(["--quick", "-k", "sinks", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "sinks" in out and "mha " not in out


def test_lowp_harness_on_cpu(capsys):
    """--mode kernels without CUDA runs flash-attn's rule with the CPU reference as the
    implementation under test: exercises the GPU harness's code here."""
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine --mode kernels runs the real kernels (tests/test_gpu_kernels.py)")
    assert check.run(_args("--quick", "--mode", "kernels")) == 0
    out = capsys.readouterr().out
    assert "bfloat16" in out and "float16" in out and "flash-attn rule" in out


def test_a_wrong_result_fails(monkeypatch, capsys):
    """The check is not vacuous: a reference that is off by 1e-4 in the output fails it."""
    from flashtile import reference

    real = reference.attention_forward

    def off(*a, **kw):
        out, lse = real(*a, **kw)
        return out + 1e-4, lse

    monkeypatch.setattr(reference, "attention_forward", off)
    assert check.run(_args("--quick", "--mode", "reference", "-k", "mha")) == 1
    assert "FAIL" in capsys.readouterr().out


def test_a_crash_fails_and_is_reported(monkeypatch, capsys):
    from flashtile import reference

    def boom(*a, **kw):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(reference, "attention_backward", boom)
    assert check.run(_args("--quick", "--mode", "reference", "-k", "mha")) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "kaboom" in out


def test_not_implemented_is_unsupported_not_failure(monkeypatch, capsys):
    import flashtile.interface

    def nope(*a, **kw):
        raise NotImplementedError("flashtile: no CUDA kernel for testing")

    monkeypatch.setattr(flashtile.interface, "flash_attn_func", nope)
    assert check.run(_args("--quick", "--mode", "kernels", "-k", "mqa")) == 0
    out = capsys.readouterr().out
    assert "unsupported" in out and "no CUDA kernel for testing" in out


@needs_bench
def test_cli_main_check_quick(capsys):
    from flashtile import cli

    assert cli.main(["check", "--quick"]) == 0
    assert "flashtile check" in capsys.readouterr().out


@needs_bench
def test_cli_help_lists_check():
    from flashtile import cli

    help_text = cli.build_parser().format_help()
    assert "check" in help_text and check.__doc__.strip().split("\n")[0][:30] in help_text


@needs_bench
def test_python_m_flashtile_check_quick():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "flashtile", "check", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "flashtile check" in proc.stdout and "passed" in proc.stdout
    assert "┃" in proc.stdout or "|" in proc.stdout  # a table was drawn


def test_python_m_flashtile_check_module_quick():
    """The module also runs on its own (independent of cli/bench)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "flashtile.check", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "flashtile check" in proc.stdout and "passed" in proc.stdout
