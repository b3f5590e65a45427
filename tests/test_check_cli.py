"""``flashtile check``: the self-test runs, prints a table, and its exit status means something."""

from __future__ import annotations

import argparse
import importlib.util
import io
import math
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
    assert check.run(_args("--quick", "--mode", "kernels", "-k", "everything")) == 0  # every option at once
    out = capsys.readouterr().out
    assert "bf16" in out and "fp16" in out and "flash-attn rule" in out


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
        [sys.executable, "-m", "flashtile", "check", "--quick", "-k", "mha"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "flashtile check" in proc.stdout and "passed" in proc.stdout
    assert "┃" in proc.stdout or "|" in proc.stdout  # a table was drawn


def test_python_m_flashtile_check_module_quick():
    """The module also runs on its own (independent of cli/bench)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "flashtile.check", "--quick", "-k", "mqa"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "flashtile check" in proc.stdout and "passed" in proc.stdout


# --- first-contact polish (issue 23) ------------------------------------------------------------


def _fake_results():
    """A pass, a failure with an infinite error and an unsupported case, all tensors present."""
    R = check.Result
    errs = {n: (1.234e-6, 1e-5) for n in check.TENSORS}
    bad = dict(errs, dq=(math.inf, 1e-5))
    return [
        R(check.CASES[0], torch.float32, dict(errs)),
        R(check.CASES[-1], torch.bfloat16, bad, status="FAIL"),
        R(check.CASES[1], torch.float16, {}, status="unsupported"),
    ]


def _render(width: int) -> list[str]:
    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(check.results_table(_fake_results(), "reference (CPU) vs naive float64", console))
    return console.file.getvalue().splitlines()


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_table_fits_the_terminal_without_squeezing_cells(width):
    lines = _render(width)
    assert max(len(line) for line in lines) <= width
    body = "\n".join(lines)
    assert "…" not in body, body  # no cell cut short
    for word in ("pass", "FAIL", "unsupported", check.CASES[-1].name, "bf16"):
        assert word in body, body
    if width >= 120:  # every tensor's error is shown
        assert "1.2e-6" in body and "dsinks" in body
    else:  # the worst ratio and where it comes from
        assert "inf dq" in body and "0.12" in body


def _run_in_terminal(argv: list[str], columns: int) -> str:
    """Run ``python -m flashtile ...`` on a pseudo-terminal ``columns`` wide; its screen output."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), TERM="xterm", NO_COLOR="1")
    proc = subprocess.Popen([sys.executable, "-m", "flashtile", *argv], cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=300) == 0
    return b"".join(chunks).decode(errors="replace")


@needs_bench
def test_check_in_an_80_column_terminal():
    import re

    screen = _run_in_terminal(["check", "--quick", "-k", "mha"], 80)
    table = [line for line in re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", screen).splitlines() if line.startswith(("│", "┃"))]
    assert table, screen
    assert all(len(line) <= 80 for line in table)
    assert not any("…" in line for line in table), "\n".join(table)
    assert sum("pass" in line for line in table) == 2


def test_k_matching_nothing_is_an_error(capsys):
    assert check.run(_args("-k", "nosuchcase")) == 2
    err = capsys.readouterr().err
    assert "nosuchcase" in err and "matches no case" in err and "mha" in err


@needs_bench
def test_version(capsys):
    from flashtile import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"flashtile {__import__('flashtile').__version__}"


@needs_bench
@pytest.mark.parametrize("argv", [[], ["check"], ["bench"]])
def test_help_has_no_rst_markup(argv, capsys):
    from flashtile import cli

    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    out = capsys.readouterr().out
    assert "usage: flashtile" in out and "``" not in out and ":func:" not in out


def test_negative_window_values_are_joined_to_their_option():
    from flashtile.cli import join_negative_values as j

    assert j(["bench", "--window", "-2,0"]) == ["bench", "--window=-2,0"]
    assert j(["bench", "--window", "-1,-1", "--seqlen", "1k"]) == ["bench", "--window=-1,-1", "--seqlen", "1k"]
    assert j(["bench", "--window", "128,-1"]) == ["bench", "--window", "128,-1"]
    assert j(["check", "-k", "-1,2"]) == ["check", "-k-1,2"]
    assert j(["bench", "--", "--window", "-1,0"]) == ["bench", "--", "--window", "-1,0"]
    assert j(["check", "-k", "-mha"]) == ["check", "-k", "-mha"]  # not a number list: untouched


@needs_bench
def test_bench_window_with_a_leading_minus_parses(capsys):
    from flashtile import cli

    parser = cli.build_parser()
    for text, want in (("-1,0", (-1, 0)), ("-1,-1", (-1, -1)), ("128,-1", (128, -1))):
        assert parser.parse_args(cli.join_negative_values(["bench", "--window", text])).window == want
    # -2 is out of range: bench's own message, not argparse's "expected one argument"
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--window", "-2,0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert ">= -1" in err and "expected one argument" not in err
