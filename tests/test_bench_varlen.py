"""CPU tests of ``flashtile bench --varlen`` (flashtile.bench_varlen): batches, FLOPs, a tiny run."""

from __future__ import annotations

import json

import pytest
import torch

from flashtile import bench, bench_varlen
from flashtile.flops import attention_flops


pytestmark = pytest.mark.usefixtures("one_thread")


def test_gpu_batches_are_seeded_and_as_specified():
    a, b = bench_varlen.batches("cuda"), bench_varlen.batches("cuda")
    assert a == b
    sixteen, sixty_four, equal = a
    assert len(sixteen.lengths) == 16 and all(128 <= n <= 4096 for n in sixteen.lengths)
    assert len(sixty_four.lengths) == 64 and all(64 <= n <= 1024 for n in sixty_four.lengths)
    assert equal.lengths == (4096,) * 8


def test_useful_flops_count_real_tokens_per_sequence():
    lengths = (3, 10, 1)
    want = sum(4 * 2 * n * n * 8 for n in lengths)  # full: 4 * Sq * Sk * d per head
    assert bench_varlen.useful_flops(lengths, 2, 8, False, "fwd") == want
    causal = sum(attention_flops(1, 2, n, n, 8, causal=True) for n in lengths)
    assert bench_varlen.useful_flops(lengths, 2, 8, True, "fwd") == causal
    assert bench_varlen.useful_flops(lengths, 2, 8, True, "bwd") * 2 == 5 * causal


def test_gpu_plan_defaults():
    args = bench.build_parser().parse_args(["--varlen"])
    device, dtype, cases, modes = bench_varlen.plan(args, cuda_available=True)
    assert device == "cuda" and dtype == torch.bfloat16 and modes == ("fwd", "bwd")
    assert {(c.headdim, c.nheads) for c in cases} == {(64, 32), (128, 16)}
    assert {c.causal for c in cases} == {True, False} and len(cases) == 3 * 2 * 2


def test_tiny_cpu_run_writes_json_and_markdown(tmp_path, capsys):
    out_json, out_md = tmp_path / "v.json", tmp_path / "v.md"
    rc = bench.main(["--varlen", "--device", "cpu", "--warmup", "0", "--rep", "0", "--causal", "both",
                     "--json", str(out_json), "--markdown", str(out_md)])
    assert rc == 0
    rows = json.loads(out_json.read_text())["rows"]
    status = {(r["backend"], r["causal"], r["mode"]): r["status"] for r in rows}
    for backend in ("flashtile-varlen", "flashtile-padded", "flashtile-equal", "loop"):
        assert all(status[(backend, c, m)] == "ok" for c in (True, False) for m in ("fwd", "bwd")), backend
    assert all(status[("flashtile-packed", c, m)] == "n/a" for c in (True, False) for m in ("fwd", "bwd"))
    assert status[("flash-attn", True, "fwd")] == "unsupported" or "flash_attn" in str(rows)
    assert status[("sdpa-nested", False, "fwd")] in ("ok", "unsupported")
    assert status[("sdpa-nested", True, "fwd")] == "unsupported"  # CPU: no nested causal backend
    assert all(r["tflops"] > 0 for r in rows if r["status"] == "ok")
    text = out_md.read_text()
    assert "| batch | d | mask | pass | flashtile-varlen" in text
    assert "speed relative to flashtile-varlen" in capsys.readouterr().out


def test_mismatch_is_reported_and_not_timed(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_varlen, "check_varlen", lambda *a: "out rel err 1 > 0")
    out_json = tmp_path / "v.json"
    rc = bench.main(["--varlen", "--device", "cpu", "--warmup", "0", "--rep", "0", "--causal", "true",
                     "--mode", "fwd", "--headdim", "8", "--json", str(out_json)])
    assert rc == 1
    rows = json.loads(out_json.read_text())["rows"]
    mine = [r for r in rows if r["backend"] == "flashtile-varlen"]
    assert mine and all(r["status"] == "mismatch" and r["ms"] is None for r in mine)


def test_packed_column_forces_the_packed_kernels_on_equal_batches_only():
    """flashtile-packed: n/a where lengths differ; on an equal batch it runs flash_attn_varlen_func
    with ``kernels.EQUAL_AS_DENSE`` off for its timing only."""
    from flashtile import kernels

    equal = bench_varlen.Case(bench_varlen.Batch("2 x 8", (8, 8)), 8, 2, True)
    ragged = bench_varlen.Case(bench_varlen.Batch("2 x 5..8", (5, 8)), 8, 2, True)
    with pytest.raises(bench_varlen.NotApplicable):
        bench_varlen._packed_kernels(ragged, bench_varlen.Packed(ragged, "cpu", torch.float32), "cuda", torch.float32)
    runner = bench_varlen._packed_kernels(equal, bench_varlen.Packed(equal, "cpu", torch.float32), "cuda", torch.float32)
    with runner.context():
        assert kernels.EQUAL_AS_DENSE is False
        out = runner.fwd()
    assert kernels.EQUAL_AS_DENSE is True and out.shape == (16, 2, 8)
