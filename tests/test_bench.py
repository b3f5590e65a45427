"""CPU tests of ``flashtile bench`` and ``flashtile.flops``: flags, FLOP counts, a tiny run's files."""

from __future__ import annotations

import math
import csv
import itertools
import json

import pytest
import torch

from flashtile import bench
from flashtile.flops import attention_flops, visible_pairs


pytestmark = pytest.mark.usefixtures("one_thread")


def parse(*argv: str):
    return bench.build_parser().parse_args(list(argv))


def plan_for(*argv: str, cuda: bool = False):
    return bench.resolve(parse(*argv), cuda_available=cuda)


# --------------------------------------------------------------------------------------------
# FLOP counting
# --------------------------------------------------------------------------------------------


def brute_pairs(sq: int, sk: int, causal: bool, window) -> int:
    """Visible pairs by walking the dense mask, straight from design.md's rule."""
    left, right = window
    if causal:
        right = 0
    off = sk - sq
    count = 0
    for i in range(sq):
        for j in range(sk):
            if (right < 0 or j <= i + off + right) and (left < 0 or j >= i + off - left):
                count += 1
    return count


def test_full_attention_flops_match_flash_attn():
    assert visible_pairs(100, 300) == 100 * 300
    assert attention_flops(2, 3, 100, 100, 64) == 4 * 2 * 3 * 100 * 100 * 64


def test_causal_square_counts_the_diagonal():
    n = 4096
    assert visible_pairs(n, n, causal=True) == n * (n + 1) // 2
    assert attention_flops(1, 1, n, n, 128, causal=True) == 4 * 128 * n * (n + 1) // 2


@pytest.mark.parametrize("sq, sk", [(3, 8), (8, 3), (1, 17), (17, 1), (127, 128), (128, 127)])
def test_causal_rectangular_is_bottom_right_aligned(sq, sk):
    expected = sum(max(0, min(sk, i + (sk - sq) + 1)) for i in range(sq))
    assert visible_pairs(sq, sk, causal=True) == expected == brute_pairs(sq, sk, True, (-1, -1))


@pytest.mark.parametrize("window", [(0, 0), (4, 0), (-1, 3), (5, -1), (3, 2), (0, 7), (100, 100)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_counts(window, causal):
    for sq, sk in [(16, 16), (9, 23), (23, 9)]:
        assert visible_pairs(sq, sk, causal, window) == brute_pairs(sq, sk, causal, window)


def test_closed_form_matches_dense_mask_everywhere():
    lengths = (0, 1, 2, 5, 13, 32)
    windows = ((-1, -1), (0, 0), (1, -1), (-1, 1), (2, 3), (6, 0), (0, 6), (40, 1))
    for sq, sk, window, causal in itertools.product(lengths, lengths, windows, (False, True)):
        assert visible_pairs(sq, sk, causal, window) == brute_pairs(sq, sk, causal, window), (sq, sk, window, causal)


def brute_chunked_pairs(sq: int, sk: int, causal: bool, window, chunk: int) -> int:
    """Visible pairs of the dense mask with the chunk rule on top (row i at position i + off
    sees key j only when both sit in one chunk)."""
    left, right = window
    if causal:
        right = 0
    off = sk - sq
    return sum(1 for i in range(sq) for j in range(sk)
               if (right < 0 or j <= i + off + right) and (left < 0 or j >= i + off - left)
               and (i + off) // chunk == j // chunk)


def test_chunked_counts_match_the_dense_mask():
    for sq, sk, chunk, window, causal in itertools.product((1, 5, 13), (0, 1, 8, 13), (1, 3, 8),
                                                           ((-1, -1), (2, 1), (4, -1)), (False, True)):
        assert visible_pairs(sq, sk, causal, window, chunk) == brute_chunked_pairs(sq, sk, causal, window, chunk), \
            (sq, sk, chunk, window, causal)
    case = bench.Case(2, 64, 64, 4, 4, 32, 32, True, (-1, -1), "float32", 16)
    assert case.mask == "causal chunk16"
    assert case.flops("fwd") == 4 * 2 * 4 * brute_chunked_pairs(64, 64, True, (-1, -1), 16) * 32


def test_headdim_v_and_modes():
    fwd = attention_flops(2, 4, 64, 96, 192, 128)
    assert fwd == 2 * 2 * 4 * 64 * 96 * (192 + 128)
    assert attention_flops(2, 4, 64, 96, 192, 128, mode="bwd") * 2 == 5 * fwd  # 2.5x
    assert attention_flops(2, 4, 64, 96, 192, 128, mode="fwdbwd") * 2 == 7 * fwd  # 3.5x
    with pytest.raises(ValueError, match="mode"):
        attention_flops(1, 1, 1, 1, 64, mode="forward")


def test_case_flops_use_the_window():
    case = bench.Case(2, 64, 64, 4, 4, 32, 32, True, (8, -1), "float32")
    assert case.flops("fwd") == 4 * 2 * 4 * brute_pairs(64, 64, True, (8, -1)) * 32
    assert case.mask == "causal window(8,0)"


# --------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------


def test_gpu_defaults():
    plan = plan_for(cuda=True)
    assert plan.device == "cuda" and plan.dtype == torch.bfloat16
    assert plan.modes == ("fwd", "bwd", "fwdbwd")
    assert plan.check and plan.time_limit is None
    assert (plan.warmup, plan.rep) == (bench.DEFAULT_WARMUP_MS, bench.DEFAULT_REP_MS)
    assert {"flashtile", "cudnn", "flash", "efficient", "flex"} <= set(plan.backends)
    assert plan.baseline == "cudnn"
    assert {c.headdim for c in plan.cases} == {64, 128, 256}
    assert sorted({c.seqlen_q for c in plan.cases}) == [512, 1024, 2048, 4096, 8192, 16384]
    for c in plan.cases:
        assert c.batch * c.seqlen_q == 16384 and c.seqlen_q == c.seqlen_k
        assert c.nheads * c.headdim == 2048
        assert c.window == (-1, -1) and c.dtype == "bfloat16"
        assert c.nheads_kv == c.nheads or (c.headdim == 128 and c.nheads_kv * 4 == c.nheads)
    assert {c.causal for c in plan.cases} == {False, True}
    # 3 head dims x 6 seqlens x 2 masks MHA + 6 x 2 GQA at d=128.
    assert len(plan.cases) == 48
    assert plan.timings == 48 * 3 * len(plan.backends)


def test_cpu_defaults():
    plan = plan_for()
    assert plan.device == "cpu" and plan.dtype == torch.float32
    assert plan.modes == ("fwd", "fwdbwd")
    assert plan.backends == ("flashtile", "sdpa") and plan.baseline == "sdpa"
    assert {(c.batch, c.nheads, c.nheads_kv, c.headdim) for c in plan.cases} == {(1, 4, 4, 64)}
    assert [c.seqlen_q for c in plan.cases if not c.causal] == list(bench.CPU_SEQLENS)
    assert len(plan.cases) == 2 * len(bench.CPU_SEQLENS)


def test_grid_flags():
    plan = plan_for("--headdim", "64,128", "192/128", "--seqlen", "1k", "2K,4096", "--total-tokens", "8k",
                    "--nheads", "8", "--nheads-kv", "2", "--causal", "true", "--dtype", "fp16")
    assert plan.dtype == torch.float16
    assert sorted({(c.headdim, c.headdim_v) for c in plan.cases}) == [(64, 64), (128, 128), (192, 128)]
    assert sorted({c.seqlen_q for c in plan.cases}) == [1024, 2048, 4096]
    assert all(c.batch * c.seqlen_q == 8192 and c.nheads == 8 and c.nheads_kv == 2 and c.causal for c in plan.cases)
    assert len(plan.cases) == 3 * 3


def test_batch_overrides_total_tokens_and_ratio_heads():
    plan = plan_for("--seqlen", "512", "1k", "--batch", "3", "--total-tokens", "16k", "--nheads", "8",
                    "--nheads-kv", "1:1", "4:1", "--causal", "false", cuda=True)
    assert {c.batch for c in plan.cases} == {3}
    assert sorted({c.nheads_kv for c in plan.cases}) == [2, 8]
    assert not any(c.causal for c in plan.cases)


def test_mode_backend_window_timing_output_flags(tmp_path):
    args = parse("--mode", "fwd,bwd", "--backends", "cudnn,flex", "flash-attn", "flashtile", "--window", "256,0",
                 "--warmup", "5", "--rep", "20", "--no-check", "--time-limit", "60", "--device", "cpu",
                 "--json", str(tmp_path / "a.json"), "--csv", "a.csv", "--plot", "a.png", "--markdown", "a.md")
    plan = bench.resolve(args, cuda_available=False)
    assert plan.modes == ("fwd", "bwd")
    assert plan.backends == ("cudnn", "flex", "flash-attn", "flashtile") and plan.baseline == "cudnn"
    assert all(c.window == (256, 0) for c in plan.cases)
    assert (plan.warmup, plan.rep, plan.check, plan.time_limit) == (5.0, 20.0, False, 60.0)
    assert parse().cpu_threads == 1 and parse("--cpu-threads", "2").cpu_threads == 2
    assert (args.json, args.csv, args.plot, args.markdown) == (str(tmp_path / "a.json"), "a.csv", "a.png", "a.md")
    assert plan_for("--mode", "all").modes == ("fwd", "bwd", "fwdbwd")
    assert plan_for("--mode", "fwd+bwd").modes == ("fwdbwd",)
    assert plan_for("--backends", "all", cuda=True).backends == bench.GPU_BACKENDS
    assert plan_for("--causal", "false").cases[0].causal is False


@pytest.mark.parametrize("argv", [
    ["--mode", "backward"], ["--backends", "xformers"], ["--window", "1"], ["--window", "a,b"],
    ["--window", "-2,0"], ["--seqlen", "0"], ["--headdim", "1/2/3"], ["--nheads-kv", "3:2"],
    ["--causal", "maybe"], ["--dtype", "int8"], ["--batch", "-1"],
])
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)


def test_bad_combinations_are_refused():
    with pytest.raises(ValueError, match="nheads-kv"):
        plan_for("--nheads", "6", "--nheads-kv", "4")
    with pytest.raises(ValueError, match="no CUDA"):
        plan_for("--device", "cuda")
    assert bench.run(parse("--nheads", "6", "--nheads-kv", "4")) == 2


def test_cli_wires_the_bench_subcommand():
    cli = pytest.importorskip("flashtile.cli")
    try:
        parser = cli.build_parser()
    except ImportError as e:  # another subcommand's module is not there yet
        pytest.skip(f"cli cannot be built: {e}")
    args = parser.parse_args(["bench", "--seqlen", "64", "--mode", "fwd"])
    assert args.run is bench.run and args.seqlen == [64] and args.mode == ["fwd"]


# --------------------------------------------------------------------------------------------
# Runs on CPU
# --------------------------------------------------------------------------------------------

TINY = ("--device", "cpu", "--headdim", "16", "--seqlen", "32", "48", "--nheads", "4", "--warmup", "0", "--rep", "1")


def test_tiny_run_writes_every_file(tmp_path, capsys):
    paths = {ext: tmp_path / "out" / f"r.{ext}" for ext in ("json", "csv", "png", "md")}
    torch.set_num_threads(2)  # the run uses --cpu-threads (default 1) and gives this back
    code = bench.run(parse(*TINY, "--seqlen", "32", "--nheads-kv", "1:1", "2:1", "--mode", "all",
                           "--json", str(paths["json"]),
                           "--csv", str(paths["csv"]), "--plot", str(paths["png"]), "--markdown", str(paths["md"])))
    printed = capsys.readouterr().out
    assert code == 0
    assert torch.get_num_threads() == 2
    assert "GPU kernels were NOT run" in printed and "(1 thread)" in printed and "geometric mean" in printed and "flashtile" in printed

    data = json.loads(paths["json"].read_text())
    for key in ("device", "driver", "torch", "tilelang", "triton", "date", "timing", "flops", "check"):
        assert key in data["meta"]
    rows = data["results"]
    assert len(rows) == 2 * 2 * 3 * 2  # kv heads x masks x modes x backends
    assert {r["backend"] for r in rows} == {"flashtile", "sdpa"}
    assert {r["mode"] for r in rows} == {"fwd", "bwd", "fwdbwd"}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["ms"] > 0 and r["tflops"] > 0 and r["vs_baseline"] > 0
        assert r["flops"] == bench.Case(r["batch"], r["seqlen_q"], r["seqlen_k"], r["nheads"], r["nheads_kv"],
                                        r["headdim"], r["headdim_v"], r["causal"], tuple(r["window"]),
                                        r["dtype"]).flops(r["mode"])
    assert {s["backend"] for s in data["summary"]} == {"flashtile"}

    with open(paths["csv"], newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    for key in ("device", "driver", "torch", "tilelang", "triton", "date", "mode", "backend", "ms", "tflops",
                "vs_baseline", "status", "seqlen_q", "headdim", "causal"):
        assert key in table[0]
    assert float(table[0]["ms"]) > 0

    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(str(paths["png"])).ndim == 3

    md = paths["md"].read_text()
    for text in ("# flashtile bench", "## forward", "## backward", "## forward + backward",
                 "| mask | d | seqlen | batch | heads | flashtile | sdpa |", "## Geometric mean"):
        assert text in md


def test_chunked_run_checks_flashtile_and_reports_sdpa_unsupported(tmp_path, capsys):
    """``--chunk``: every case carries the chunk, flashtile is checked against the reference run
    chunk by chunk (forward and backward) and timed; SDPA has no chunked attention."""
    out = tmp_path / "c.json"
    plan = plan_for(*TINY, "--chunk", "8")
    assert {c.chunk for c in plan.cases} == {8} and all("chunk8" in c.mask for c in plan.cases)
    code = bench.run(parse(*TINY, "--chunk", "8", "--mode", "fwd", "bwd", "--json", str(out)))
    assert code == 0, capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    ours = [r for r in rows if r["backend"] == "flashtile"]
    assert ours and all(r["status"] == "ok" and r["chunk"] == 8 for r in ours), ours
    assert all(r["status"] == "unsupported" for r in rows if r["backend"] == "sdpa")


def _patched_flashtile(monkeypatch, fn):
    monkeypatch.setattr(bench, "flash_attn_func", fn)


def test_mismatch_is_reported_and_never_timed(tmp_path, monkeypatch, capsys):
    real = bench.flash_attn_func
    _patched_flashtile(monkeypatch, lambda *a, **k: real(*a, **k) * 1.5)
    out = tmp_path / "r.json"
    code = bench.run(parse(*TINY, "--backends", "flashtile", "--causal", "true", "--json", str(out)))
    assert code == 1
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["status"] == "mismatch" and r["ms"] is None for r in rows)
    assert "rel err" in rows[0]["detail"]
    assert "FAILED" in capsys.readouterr().out


def test_no_check_times_anyway(monkeypatch, tmp_path):
    real = bench.flash_attn_func
    _patched_flashtile(monkeypatch, lambda *a, **k: real(*a, **k) * 1.5)
    out = tmp_path / "r.json"
    assert bench.run(parse(*TINY, "--backends", "flashtile", "--seqlen", "32", "--mode", "fwd", "--no-check",
                           "--json", str(out))) == 0
    assert all(r["status"] == "ok" for r in json.loads(out.read_text())["results"])


def test_not_implemented_is_unsupported_not_a_failure(monkeypatch, tmp_path):
    def missing(*a, **k):
        raise NotImplementedError("flashtile: no CUDA kernel for this")

    _patched_flashtile(monkeypatch, missing)
    out = tmp_path / "r.json"
    assert bench.run(parse(*TINY, "--seqlen", "32", "--causal", "false", "--json", str(out))) == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["status"] for r in rows if r["backend"] == "flashtile"} == {"unsupported"}
    assert {r["status"] for r in rows if r["backend"] == "sdpa"} == {"ok"}


def test_gpu_only_backends_say_unsupported_on_cpu_and_time_limit_skips(tmp_path):
    out = tmp_path / "r.json"
    assert bench.run(parse(*TINY, "--seqlen", "32", "--causal", "false", "--mode", "fwd",
                           "--backends", "cudnn,flash,efficient", "--json", str(out))) == 0
    assert {r["status"] for r in json.loads(out.read_text())["results"]} == {"unsupported"}
    assert bench.run(parse(*TINY, "--time-limit", "0", "--json", str(out))) == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["status"] for r in rows} == {"skipped"} and "time limit" in rows[0]["detail"]


def test_classify_uses_one_word():
    assert bench.classify(NotImplementedError("x"))[0] == "unsupported"
    assert bench.classify(RuntimeError("No available kernel. Aborting execution."))[0] == "unsupported"
    assert bench.classify(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))[0] == "oom"
    word, detail = bench.classify(ValueError("bad\nsecond line"))
    assert word == "error" and detail == "ValueError: bad"


def test_sdpa_gqa_falls_back_to_expanded_kv():
    case = bench.Case(1, 16, 16, 4, 1, 8, 8, False, (-1, -1), "float32")
    runner = bench.FACTORIES["sdpa"](case, bench.Inputs(case, "cpu", torch.float32), "cpu")
    assert runner.fallback is not None and runner.note == ""
    expanded = runner.fallback()
    assert expanded.note == "kv expanded" and expanded.leaves[1].shape[1] == 4
    torch.testing.assert_close(expanded.fwd(), runner.fwd())
    causal_window = bench.Case(1, 16, 16, 4, 4, 8, 8, True, (4, -1), "float32")
    with pytest.raises(bench.Unsupported):
        bench.FACTORIES["sdpa"](causal_window, bench.Inputs(causal_window, "cpu", torch.float32), "cpu")


def test_cpu_timer_is_a_median_of_wall_clock():
    timer, method = bench.make_timer("cpu", 0.0, 1.0)
    assert "wall clock" in method
    calls = []
    assert timer(lambda: calls.append(1), []) >= 0 and len(calls) >= 4


def test_first_call_failure_retries_the_fallback(monkeypatch, tmp_path):
    """A backend without enable_gqa (cuDNN/efficient on some versions) is retried with K/V expanded."""
    real = bench.FACTORIES["sdpa"]

    def no_gqa(case, inp, device):
        runner = real(case, inp, device)
        if runner.fallback is not None:
            def refuse():
                raise RuntimeError("No available kernel. Aborting execution.")

            runner.fwd = refuse
        return runner

    monkeypatch.setitem(bench.FACTORIES, "sdpa", no_gqa)
    out = tmp_path / "r.json"
    assert bench.run(parse(*TINY, "--seqlen", "32", "--causal", "false", "--nheads-kv", "2:1",
                           "--json", str(out))) == 0
    rows = [r for r in json.loads(out.read_text())["results"] if r["backend"] == "sdpa"]
    assert rows and all(r["status"] == "ok" and r["note"] == "kv expanded" for r in rows)


def test_rounds_interleave_backends_and_report_the_median(monkeypatch, tmp_path):
    calls, clock = [], iter(range(1, 1000))

    def timer(fn, grads):  # a fake clock that drifts upward: round r of every backend sees r
        calls.append(fn)
        return float(next(clock))

    monkeypatch.setattr(bench, "make_timer", lambda *a: (timer, "fake"))
    out = tmp_path / "r.json"
    assert bench.run(parse(*TINY, "--seqlen", "32", "--causal", "false", "--mode", "fwd", "--rounds", "3",
                           "--json", str(out))) == 0
    rows = {r["backend"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"flashtile", "sdpa"} and len(calls) == 6
    # In turn: flashtile, sdpa, flashtile, sdpa, ...: samples 1 3 5 and 2 4 6, medians 3 and 4.
    assert rows["flashtile"]["rounds_ms"].split() == ["1.0000", "3.0000", "5.0000"], rows["flashtile"]
    assert rows["flashtile"]["ms"] == 3.0 and rows["sdpa"]["ms"] == 4.0
    assert rows["flashtile"]["vs_baseline"] == 4.0 / 3.0


def test_fp8_speedup_summary_pairs_cases_of_the_same_run():
    """flashtile-fp8 vs flashtile per (mode, mask, d): geometric mean of bf16 ms / FP8 ms over the
    cases both ran; a case where either failed is left out."""
    from flashtile.bench import Case, Result, fp8_speedups

    def case(s, causal=False):
        return Case(1, s, s, 16, 16, 128, 128, causal, (-1, -1), "bfloat16")

    results = [
        Result(case(1024), "fwd", "flashtile", ms=2.0), Result(case(1024), "fwd", "flashtile-fp8", ms=1.0),
        Result(case(4096), "fwd", "flashtile", ms=8.0), Result(case(4096), "fwd", "flashtile-fp8", ms=2.0),
        Result(case(8192), "fwd", "flashtile", ms=8.0), Result(case(8192), "fwd", "flashtile-fp8", status="mismatch"),
        Result(case(1024, True), "fwd", "flashtile", ms=3.0), Result(case(1024, True), "fwd", "flashtile-fp8", ms=2.0),
        Result(case(1024), "bwd", "flashtile", ms=5.0), Result(case(1024), "bwd", "flashtile-fp8", status="unsupported"),
    ]
    got = {(x["mode"], x["mask"]): (round(x["geomean_fp8_speedup"], 6), x["n"]) for x in fp8_speedups(results)}
    assert got == {("fwd", "full"): (round(math.sqrt(2.0 * 4.0), 6), 2), ("fwd", "causal"): (1.5, 1)}


def test_decode_subcommand_is_wired_and_needs_a_gpu(monkeypatch, capsys):
    """``flashtile bench --decode`` parses the decode sweep's flags and, without CUDA, says it
    needs a GPU (exit 2) instead of failing somewhere inside."""
    from flashtile import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli.build_parser().parse_args(["bench", "--decode", "--quick", "--fp8", "--tiles", "64x2", "--out", "/tmp/x"])
    assert args.decode and args.quick and args.fp8 and args.tiles == "64x2" and args.out == "/tmp/x"
    assert cli.main(["bench", "--decode", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_decode_ratio_table():
    """flashtile bench --decode's ratio table: cuDNN's time over ours on the contiguous cache,
    each FP8 layout's speed-up over the bf16 cache, '-' where a peer did not run."""
    from flashtile.bench_decode import ratio_table

    def row(b, layout, graph, cudnn=None, speedup=None):
        return dict(batch=b, seqlen_cache=4096, seqlen_q=1, layout=layout, flashtile_s=graph * 1.5,
                    flashtile_graph_s=graph, cudnn_s=cudnn, cudnn_graph_s=cudnn, speedup_vs_bf16_cache=speedup)

    rows = [row(8, "contig", 100e-6, cudnn=99e-6), row(8, "page16", 101e-6), row(8, "contig-fp8", 56e-6, speedup=1.786),
            row(8, "page16-fp8", 58e-6, speedup=1.741), row(1, "contig", 12e-6)]
    lines = ratio_table(rows)
    assert lines[0] == "| B | cache len | sq | vs cuDNN | FP8 contig vs bf16 | FP8 page16 vs bf16 |", lines[0]
    assert lines[2] == "| 8 | 4096 | 1 | 0.99x | 1.79x | 1.74x |", lines[2]
    assert lines[3] == "| 1 | 4096 | 1 | - | - | - |", lines[3]
