"""Ring attention (``flashtile.distributed``) on CPU with gloo, against single-process attention.

Eight gloo processes are spawned once; world sizes 2 and 4 run on subgroups of them (each
subgroup a share of the cases), 8 on all of them.  Each rank writes its errors to a file that
the parametrised tests read.  The
oracle is ``flashtile.flash_attn_func`` on the gathered (full) sequence, float64, and every
output, lse and gradient (q, k, v, sinks) must match to 1e-10.
"""

from __future__ import annotations

import json
import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from flashtile.distributed import plan, positions, segments, shard, unshard
from flashtile.reference import visible_mask

TOL = 1e-10

# name -> (batch, seqlen_total, nheads, nheads_kv, d, d_v, causal, window, sinks, softcap, layout, return_lse)
CASES = {
    "causal_zigzag": (1, 64, 2, 2, 16, 16, True, (-1, -1), False, 0.0, "zigzag", False),
    "causal_zigzag_batch2_lse": (2, 64, 2, 2, 8, 8, True, (-1, -1), False, 0.0, "zigzag", True),
    "causal_contiguous": (1, 64, 2, 2, 16, 16, True, (-1, -1), False, 0.0, "contiguous", False),
    "full_zigzag": (1, 64, 2, 2, 16, 16, False, (-1, -1), False, 0.0, "zigzag", False),
    "full_contiguous": (2, 64, 2, 2, 16, 16, False, (-1, -1), False, 0.0, "contiguous", True),
    "gqa_causal_zigzag": (1, 64, 4, 2, 16, 16, True, (-1, -1), False, 0.0, "zigzag", False),
    "mqa_full_contiguous": (1, 64, 4, 1, 16, 16, False, (-1, -1), False, 0.0, "contiguous", False),
    "sinks_causal_zigzag_lse": (1, 64, 4, 2, 16, 16, True, (-1, -1), True, 0.0, "zigzag", True),
    "sinks_full_contiguous": (1, 64, 2, 2, 16, 16, False, (-1, -1), True, 0.0, "contiguous", False),
    "softcap_causal_zigzag": (1, 64, 2, 2, 16, 16, True, (-1, -1), False, 5.0, "zigzag", False),
    "dv_ne_d_causal": (1, 64, 2, 1, 24, 8, True, (-1, -1), False, 0.0, "zigzag", True),
    "uneven_headdims": (1, 64, 3, 1, 10, 6, True, (-1, -1), True, 2.0, "zigzag", False),
    "window_causal_zigzag_skips": (1, 64, 2, 2, 8, 8, True, (5, -1), False, 0.0, "zigzag", False),
    "window_causal_contiguous_skips": (1, 64, 2, 2, 8, 8, True, (5, -1), False, 0.0, "contiguous", False),
    "window_sym_zigzag": (1, 64, 2, 1, 8, 8, False, (3, 2), True, 0.0, "zigzag", True),
    "window_right_only_contiguous": (1, 64, 2, 2, 8, 8, False, (-1, 3), False, 0.0, "contiguous", False),
    "window_left_only_zigzag": (1, 64, 2, 2, 8, 8, False, (9, -1), False, 0.0, "zigzag", False),
    "window_wide_causal_zigzag": (1, 64, 2, 2, 8, 8, True, (40, -1), True, 1.5, "zigzag", True),
    "window_zero_zigzag": (1, 64, 2, 2, 8, 8, False, (0, 0), False, 0.0, "zigzag", False),
}
# Packed sequences: name -> (global lengths, nheads, nheads_kv, d, d_v, causal, sinks, softcap, layout, return_lse)
VARLEN_CASES = {
    "varlen_causal_zigzag_gqa_sinks_lse": ([16, 48, 32], 4, 2, 8, 8, True, True, 0.0, "zigzag", True),
    "varlen_full_contiguous_softcap_dv": ([32, 16, 48], 2, 1, 8, 12, False, False, 2.0, "contiguous", False),
    "varlen_causal_contiguous": ([48, 16], 2, 2, 8, 8, True, False, 0.0, "contiguous", True),
    "varlen_full_zigzag": ([16, 64], 2, 2, 8, 8, False, True, 0.0, "zigzag", False),
}
CASES_8 = ["causal_zigzag", "sinks_causal_zigzag_lse", "window_causal_zigzag_skips", "full_contiguous",
           "varlen_causal_zigzag_gqa_sinks_lse"]
WORLDS = {2: list(CASES) + list(VARLEN_CASES), 4: list(CASES) + list(VARLEN_CASES), 8: CASES_8}


def _inputs(case: str):
    b, s, h, hkv, d, dv, causal, window, use_sinks, softcap, layout, return_lse = CASES[case]
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hkv, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, h, dv, generator=g, dtype=torch.float64)
    dlse = torch.randn(b, h, s, generator=g, dtype=torch.float64)
    sinks = torch.randn(h, generator=g, dtype=torch.float64) if use_sinks else None
    kw = dict(causal=causal, window_size=window, softcap=softcap, return_lse=True)
    return q, k, v, dout, dlse, sinks, kw, layout, return_lse


def _check_into(errors: list):
    def check(name, got, want):
        if got.shape != want.shape:
            errors.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        err = (got - want).abs().max().item() if got.numel() else 0.0
        if not err <= TOL:
            errors.append(f"{name}: max abs err {err:.3e} > {TOL}")

    return check


def _run_varlen_case(case: str, group, rank: int, world: int) -> list[str]:
    import flashtile
    from flashtile.distributed import ring_flash_attn_varlen_func, shard_varlen

    lens, h, hkv, d, dv, causal, use_sinks, softcap, layout, return_lse = VARLEN_CASES[case]
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    t = sum(lens)
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
    q, k, v = (torch.randn(t, n, e, generator=g, dtype=torch.float64) for n, e in ((h, d), (hkv, d), (hkv, dv)))
    dout = torch.randn(t, h, dv, generator=g, dtype=torch.float64)
    dlse = torch.randn(h, t, generator=g, dtype=torch.float64)
    sinks = torch.randn(h, generator=g, dtype=torch.float64) if use_sinks else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)] + ([sinks.clone().requires_grad_()] if use_sinks else [])
    out, lse = flashtile.flash_attn_varlen_func(
        *leaves[:3], cu, cu, max(lens), max(lens), causal=causal, softcap=softcap, sinks=leaves[3] if use_sinks else None, return_lse=True
    )
    ref_grads = torch.autograd.grad((out * dout).sum() + ((lse * dlse).sum() if return_lse else 0), leaves)

    def sh(x, dim=0):
        return shard_varlen(x, cu, world, rank, dim=dim, layout=layout)

    mine = [sh(x).requires_grad_() for x in (q, k, v)] + ([sinks.clone().requires_grad_()] if use_sinks else [])
    res = ring_flash_attn_varlen_func(
        *mine[:3], cu // world, max(lens) // world, group=group, causal=causal, softcap=softcap,
        sinks=mine[3] if use_sinks else None, return_lse=return_lse, layout=layout,
    )
    out_r, lse_r = res if return_lse else (res, None)
    loss = (out_r * sh(dout)).sum() + ((lse_r * sh(dlse, 1)).sum() if return_lse else 0)
    grads = torch.autograd.grad(loss, mine)
    errors: list = []
    check = _check_into(errors)
    check("out", out_r, sh(out.detach()))
    if return_lse:
        check("lse", lse_r, sh(lse.detach(), 1))
    for name, got, want in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3]):
        check(name, got, sh(want))
    if use_sinks:
        check("dsinks", grads[3], ref_grads[3])
    return errors


def _run_case(case: str, group, rank: int, world: int) -> list[str]:
    if case in VARLEN_CASES:
        return _run_varlen_case(case, group, rank, world)
    import flashtile
    from flashtile.distributed import ring_flash_attn_func, unshard_gather

    q, k, v, dout, dlse, sinks, kw, layout, return_lse = _inputs(case)
    # Oracle: single-process attention on the whole sequence.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks is not None else [])
    out, lse = flashtile.flash_attn_func(*leaves[:3], sinks=leaves[3] if sinks is not None else None, **kw)
    loss = (out * dout).sum() + ((lse * dlse).sum() if return_lse else 0)
    ref_grads = torch.autograd.grad(loss, leaves)

    def sh(x, dim=1):
        return shard(x, world, rank, dim=dim, layout=layout)

    mine = [sh(t).requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks is not None else [])
    kw_ring = dict(kw, return_lse=return_lse)
    res = ring_flash_attn_func(*mine[:3], group=group, sinks=mine[3] if sinks is not None else None, layout=layout, **kw_ring)
    out_r, lse_r = res if return_lse else (res, None)
    loss_r = (out_r * sh(dout)).sum() + ((lse_r * sh(dlse, 2)).sum() if return_lse else 0)
    grads = torch.autograd.grad(loss_r, mine)

    errors: list = []
    check = _check_into(errors)
    check("out", out_r, sh(out.detach()))
    if return_lse:
        check("lse", lse_r, sh(lse.detach(), 2))
    for name, got, want in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3]):
        check(name, got, sh(want))
    if sinks is not None:
        check("dsinks", grads[3], ref_grads[3])
    check("unshard_gather(out)", unshard_gather(out_r.detach(), group=group, layout=layout), out.detach())
    return errors


NPROCS = 8


def _worker(rank: int, port: int, outdir: str) -> None:
    """One of 8 gloo ranks.  World size 2 runs on the pairs {0,1} {2,3} {4,5} {6,7}, world size
    4 on {0..3} {4..7} (subgroups, so the ``group`` argument and non-zero global ranks are
    exercised; each subgroup takes a share of the cases), world size 8 on the default group."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=NPROCS, init_method=f"tcp://127.0.0.1:{port}")
    groups = {w: [dist.new_group(list(range(i, i + w))) for i in range(0, NPROCS, w)] for w in (2, 4)}
    results = {}
    try:
        for world in sorted(WORLDS):
            index = rank // world
            group = groups[world][index] if world < NPROCS else None
            local = dist.get_rank(group)
            for case in WORLDS[world][index :: NPROCS // world]:
                try:
                    results[f"{world}/{case}"] = _run_case(case, group, local, world)
                except Exception:  # noqa: BLE001 - reported to the parent
                    results[f"{world}/{case}"] = [traceback.format_exc()]
            dist.barrier()
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory) -> dict:
    outdir = str(tmp_path_factory.mktemp("ring"))
    mp.spawn(_worker, args=(_free_port(), outdir), nprocs=NPROCS, join=True)
    merged = {}
    for r in range(NPROCS):
        with open(os.path.join(outdir, f"rank{r}.json")) as f:
            for key, errs in json.load(f).items():
                merged.setdefault(key, []).extend(f"rank {r}: {e}" for e in errs)
    return merged


@pytest.mark.parametrize("world,case", [(w, c) for w, cs in WORLDS.items() for c in cs])
def test_ring_matches_single_process(world, case, ring_results):
    key = f"{world}/{case}"
    assert key in ring_results, f"case {key} did not run"
    assert not ring_results[key], "\n".join(ring_results[key])


# --- in-process: sharding and the per-step plan ------------------------------------------------


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shard_unshard_round_trip(world, layout):
    x = torch.randn(2, 16 * world, 3, 5)
    shards = [shard(x, world, r, layout=layout) for r in range(world)]
    assert torch.equal(unshard(shards, layout=layout), x)
    for r, s in enumerate(shards):
        assert torch.equal(s, x[:, positions(x.shape[1] // world, world, r, layout)])
    y = x.transpose(1, 2)  # another dim
    assert torch.equal(unshard([shard(y, world, r, dim=2, layout=layout) for r in range(world)], dim=2, layout=layout), y)


def test_zigzag_layout_is_the_documented_one():
    x = torch.arange(16)[None]
    assert shard(x, 4, 0)[0].tolist() == [0, 1, 14, 15]
    assert shard(x, 4, 3)[0].tolist() == [6, 7, 8, 9]
    with pytest.raises(ValueError, match="seqlen % 8"):
        shard(torch.zeros(1, 12), 4, 0)
    with pytest.raises(ValueError, match="layout"):
        shard(x, 4, 0, layout="striped")


def _planned_mask(n, world, rank, src, layout, left, right):
    m = torch.zeros(n, n, dtype=torch.int)
    for p in plan(n, world, rank, src, layout, left, right):
        vis = visible_mask(torch.arange(p.q1 - p.q0), p.k1 - p.k0, p.q1 - p.q0, (p.left, p.right))
        m[p.q0 : p.q1, p.k0 : p.k1] += 1 if vis is None else vis.int()
    return m


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_plan_is_exactly_the_global_mask(layout):
    """Every ring step, every window: the kernel calls cover each visible (row, key) once."""
    windows = [(-1, -1), (-1, 0), (0, 0), (1, 0), (3, 0), (5, 0), (6, 0), (13, 0), (3, 2), (-1, 4), (7, -1), (0, 9), (30, 30)]
    for world in (1, 2, 3, 4):
        n = 12
        s = n * world
        full = visible_mask(torch.arange(s), s, s, (-1, -1))
        for left, right in windows:
            truth = visible_mask(torch.arange(s), s, s, (left, right))
            truth = torch.ones(s, s, dtype=torch.bool) if truth is None else truth
            for rank in range(world):
                rows = positions(n, world, rank, layout)
                for src in range(world):
                    cols = positions(n, world, src, layout)
                    want = truth[rows][:, cols].int()
                    got = _planned_mask(n, world, rank, src, layout, left, right)
                    assert torch.equal(got, want), (world, left, right, rank, src, plan(n, world, rank, src, layout, left, right))
        assert full is None


def test_zigzag_causal_is_one_call_per_step_with_only_visible_work():
    """flash-attn's zigzag schedule: step 0 local causal; earlier kv: all q x first half of kv;
    later kv: second half of q x all kv; nothing masked outside step 0."""
    n, world = 16, 4
    for rank in range(world):
        for src in range(world):
            (p,) = plan(n, world, rank, src, "zigzag", -1, 0)
            if src == rank:
                assert (p.q0, p.q1, p.k0, p.k1, p.left, p.right) == (0, n, 0, n, -1, 0)
            elif src < rank:
                assert (p.q0, p.q1, p.k0, p.k1, p.left, p.right) == (0, n, 0, n // 2, -1, -1)
            else:
                assert (p.q0, p.q1, p.k0, p.k1, p.left, p.right) == (n // 2, n, 0, n, -1, -1)


def test_window_skips_invisible_steps():
    # Sliding window of 5 with chunks of 8: rank 0's queries (chunks 0 and 7 of 8) see only
    # keys of chunks 0, 6 and 7, i.e. only ranks 0 and 1 (which holds chunk 6).
    assert plan(16, 4, 0, 2, "zigzag", 5, 0) == ()
    assert plan(16, 4, 0, 3, "zigzag", 5, 0) == ()
    assert plan(16, 4, 0, 1, "zigzag", 5, 0) != ()
    assert segments(16, 4, 1, "zigzag") == ((0, 8, 8), (8, 48, 8))


def test_single_process_without_dist_is_plain_attention():
    import flashtile
    from flashtile.distributed import ring_flash_attn_func

    q, k, v = (torch.randn(1, 32, 2, 8, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        ref = flashtile.flash_attn_func(q, k, v, causal=causal)
        assert (ring_flash_attn_func(q, k, v, causal=causal) - ref).abs().max() < TOL


def test_bad_input_is_refused():
    from flashtile.distributed import ring_flash_attn_func

    q = torch.randn(1, 6, 2, 8)
    with pytest.raises(ValueError, match="same sequence shard"):
        ring_flash_attn_func(q, torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))
    with pytest.raises(ValueError, match="layout"):
        ring_flash_attn_func(q, q, q, layout="striped")
    with pytest.raises(ValueError, match="even"):
        ring_flash_attn_func(q[:, :5], q[:, :5], q[:, :5])
    with pytest.raises(ValueError, match="ring_flash_attn_func: nheads"):
        ring_flash_attn_func(torch.randn(1, 6, 3, 8), q, q)
    with pytest.raises(TypeError, match="causal"):
        ring_flash_attn_func(q, q, q, causal="yes")


def test_bench_cpu_single_process(tmp_path):
    """The benchmark's code path (timing, T1, efficiency, numerics check, JSON + markdown) in a
    group of one on CPU; the GPU numbers come from torchrun on a GPU machine."""
    from flashtile.distributed import bench

    argv = ["--device", "cpu", "--seqlens", "64", "--heads", "2", "--headdim", "8", "--dtype", "fp32",
            "--warmup", "0", "--iters", "1", "--profile", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "cp.json").read_text())
    rec = report["results"][0]
    assert rec["ring"]["status"] == "ok" and rec["single_flashtile"]["status"] == "ok"
    assert rec["torch_cp"]["status"].startswith("unavailable")
    assert report["check"]["pass"]
    assert "flashtile ring" in (tmp_path / "cp.md").read_text()
    assert json.loads((tmp_path / "trace_ring_64_rank0.json").read_text())  # --profile's chrome trace


def test_cli_has_cp_subcommand():
    from flashtile.cli import build_parser

    args = build_parser().parse_args(["cp", "--seqlens", "32k,128k", "--device", "cpu"])
    assert args.seqlens == [32768, 131072] and args.command == "cp"


def test_varlen_plan_is_the_dense_plan_scaled():
    """Packed sequences share one plan per step (causal or full): at every local length the
    dense plan's mask equals the unit plan scaled to that length."""
    from flashtile.distributed.ring_attention import _varlen_plan, _varlen_unit

    for layout in ("zigzag", "contiguous"):
        unit = _varlen_unit(layout)
        for world in (1, 2, 3, 4):
            for left, right in ((-1, -1), (-1, 0)):
                for n in (2, 4, 6, 10, 16):
                    s = n * world
                    truth = visible_mask(torch.arange(s), s, s, (left, right))
                    truth = torch.ones(s, s, dtype=torch.bool) if truth is None else truth
                    for rank in range(world):
                        for src in range(world):
                            m = torch.zeros(n, n, dtype=torch.int)
                            for p in _varlen_plan(world, rank, src, layout, left, right):
                                a, b, c, d = (x * n // unit for x in (p.q0, p.q1, p.k0, p.k1))
                                vis = visible_mask(torch.arange(b - a), d - c, b - a, (p.left, p.right))
                                m[a:b, c:d] += 1 if vis is None else vis.int()
                            want = truth[positions(n, world, rank, layout)][:, positions(n, world, src, layout)]
                            assert torch.equal(m, want.int()), (layout, world, left, right, n, rank, src)


def test_varlen_shard_round_trip_and_refusals():
    from flashtile.distributed import ring_flash_attn_varlen_func, shard_varlen, unshard_varlen

    cu = torch.tensor([0, 16, 16, 48], dtype=torch.int32)
    x = torch.randn(48, 2, 3)
    for layout in ("zigzag", "contiguous"):
        shards = [shard_varlen(x, cu, 4, r, layout=layout) for r in range(4)]
        assert torch.equal(unshard_varlen(shards, cu, layout=layout), x)
    q = torch.randn(12, 2, 8)
    with pytest.raises(NotImplementedError, match="sliding windows"):
        ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 12], dtype=torch.int32), 12, window_size=(4, 0))
    with pytest.raises(ValueError, match="even local"):
        ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 5, 12], dtype=torch.int32), 7)


def test_bench_extrapolates_t1_beyond_single_max(tmp_path):
    """--single-max: longer lengths take T1 from the longest measured run scaled by the FLOP
    ratio (marked in JSON and markdown); --t1-from reuses an earlier report's T1 runs."""
    from flashtile.distributed import bench
    from flashtile.flops import attention_flops

    base = ["--device", "cpu", "--heads", "2", "--headdim", "8", "--dtype", "fp32", "--warmup", "0", "--iters", "1",
            "--check-seqlen", "0", "--no-baseline"]
    first = tmp_path / "a"
    assert bench.main(base + ["--seqlens", "32,64", "--single-max", "32", "--out", str(first)]) == 0
    rep = json.loads((first / "cp.json").read_text())
    short, long = rep["results"]
    assert "t1_extrapolated_from" not in short["single_flashtile"]
    t1 = long["single_flashtile"]
    assert t1["t1_extrapolated_from"] == 32, t1
    ratio = attention_flops(1, 2, 64, 64, 8, 8, causal=True, mode="fwdbwd") / attention_flops(1, 2, 32, 32, 8, 8, causal=True, mode="fwdbwd")
    assert t1["fwdbwd_ms"] == pytest.approx(short["single_flashtile"]["fwdbwd_ms"] * ratio)
    assert long["ring"]["scaling_efficiency"] == pytest.approx(t1["fwdbwd_ms"] / long["ring"]["fwdbwd_ms"])
    assert "~ T1 extrapolated" in (first / "cp.md").read_text()
    second = tmp_path / "b"
    assert bench.main(base + ["--seqlens", "128", "--single-max", "0", "--t1-from", str(first / "cp.json"), "--out", str(second)]) == 0
    t1b = json.loads((second / "cp.json").read_text())["results"][0]["single_flashtile"]
    assert t1b["t1_extrapolated_from"] == 32, "extrapolates from measured runs only, never from an extrapolated one"
    with pytest.raises(SystemExit, match="differs"):
        bench.main(base + ["--headdim", "16", "--seqlens", "128", "--single-max", "0", "--t1-from", str(first / "cp.json"),
                           "--out", str(tmp_path / "c")])


def test_transport_choice_on_cpu_and_bad_names(monkeypatch):
    """CPU tensors always take point-to-point sends (gloo); FLASHTILE_RING_TRANSPORT is checked;
    the bench records the transport it ran."""
    from flashtile.distributed import transport

    assert isinstance(transport.ring(None, 0, 2, 0, torch.device("cpu")), transport.NcclRing)
    monkeypatch.setenv("FLASHTILE_RING_TRANSPORT", "copy_engine")
    assert isinstance(transport.ring(None, 0, 2, 0, torch.device("cpu")), transport.NcclRing)
    monkeypatch.setenv("FLASHTILE_RING_TRANSPORT", "shm")
    with pytest.raises(ValueError, match="FLASHTILE_RING_TRANSPORT"):
        transport.requested()


def test_ring_steps_ask_for_kernels_that_share_the_sms(monkeypatch):
    """Every ring step's kernel call asks for no persistent grid (``share_sms=True``, the next
    block's transfer runs beside it): dense and packed, forward and backward."""
    from flashtile import ops, varlen
    from flashtile.distributed import ring_flash_attn_func, ring_flash_attn_varlen_func

    seen = []

    def spy(module, name):
        real = getattr(module, name)

        def call(*args, **kwargs):
            seen.append((module.__name__, name, kwargs.get("share_sms")))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    for module in (ops, varlen):
        spy(module, "_fwd_impl")
        spy(module, "_bwd_impl")
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    ring_flash_attn_func(q, k, v, causal=True).sum().backward()
    cu = torch.tensor([0, 2, 8], dtype=torch.int32)
    qp, kp, vp = (torch.randn(8, 2, 16, requires_grad=True) for _ in range(3))
    ring_flash_attn_varlen_func(qp, kp, vp, cu, 6, causal=True).sum().backward()
    assert {(m, n) for m, n, _ in seen} == {(m.__name__, n) for m in (ops, varlen) for n in ("_fwd_impl", "_bwd_impl")}, seen
    assert all(share for _, _, share in seen), f"a ring step's kernel call without share_sms=True: {seen}"


def test_packed_kernel_entry_points_pass_share_sms_on(monkeypatch):
    """``kernels.varlen_forward`` / ``varlen_backward`` hand ``share_sms`` to the dense or packed
    launch they pick (equal lengths run the dense kernels)."""
    from flashtile import kernels

    seen = []

    # forward(q, k, v, sinks, scale, window, softcap, packed=None, fp8=None, share_sms=False) and
    # backward(dout, dlse, q, k, v, out, lse, sinks, scale, window, softcap, deterministic,
    # packed=None, share_sms=False): share_sms by keyword (dense) or last in place (packed)
    def fake_forward(q, k, v, *args, **kwargs):
        seen.append(kwargs["share_sms"] if "share_sms" in kwargs else args[6])
        lead = q.shape[:-1]
        return q.new_zeros(*lead, v.shape[-1]), q.new_zeros(*((lead[0], lead[2], lead[1]) if q.dim() == 4 else (lead[1], lead[0])))

    def fake_backward(dout, dlse, q, k, v, *args, **kwargs):
        seen.append(kwargs["share_sms"] if "share_sms" in kwargs else args[8])
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None

    monkeypatch.setattr(kernels, "forward", fake_forward)
    monkeypatch.setattr(kernels, "backward", fake_backward)
    x = torch.randn(10, 2, 16)
    lse = torch.randn(2, 10)
    for cu, mx in ((torch.tensor([0, 5, 10], dtype=torch.int32), 5), (torch.tensor([0, 4, 10], dtype=torch.int32), 6)):
        kernels.varlen_forward(x, x, x, cu, cu, None, None, mx, mx, None, 0.25, (-1, 0), 0.0, share_sms=True)
        kernels.varlen_backward(x, None, x, x, x, x, lse, cu, cu, None, None, mx, mx, None, 0.25, (-1, 0), 0.0, False,
                                share_sms=True)
    assert seen == [True] * 4, seen
