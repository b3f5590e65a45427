"""Every tile configuration of ``kernels/configs.py`` lowers and compiles for sm_90a with nvcc.

No GPU needed: TileLang lowers for the explicit ``sm_90a`` target and nvcc builds the cubin.
Beyond "it compiles" the generated CUDA must use the Hopper paths the design relies on:
WGMMA for every GEMM (no ``mma.sync`` fallback), TMA loads, and warp specialisation.
"""

import re
import shutil

import pytest
import torch

from flashtile.kernels import configs

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found"),
]

STRUCTURES = sorted({(d, dv, str(dtype).removeprefix("torch.")) for d, dv, dtype, _ in configs.all_structures()})


def _assert_hopper(src: str, what: str) -> None:
    assert "wgmma" in src, f"{what}: no WGMMA in the generated CUDA"
    assert "mma_sync" not in src, f"{what}: a GEMM fell back to mma.sync"
    assert "tma_load" in src, f"{what}: no TMA loads"
    assert "__launch_bounds__(" in src, f"{what}: kernel source looks wrong"


@pytest.mark.parametrize("dim,dim_v,dtype", STRUCTURES, ids=lambda x: str(x))
def test_forward_builds(dim, dim_v, dtype):
    from flashtile.kernels.launch import forward_kernel as get_forward_kernel

    dt = dtype
    kernel = get_forward_kernel(dim, dim_v, dt, has_sinks=False, has_softcap=False)
    src = kernel.get_kernel_source()
    _assert_hopper(src, f"fwd d={dim}/{dim_v} {dt}")
    # The O-rescale skip (a warp vote around O *= alpha, ``fwd_ws.rescaler``) where the table
    # says so, and only there.
    skip = configs.fwd_config(dim, dim_v, dt, "full").skip_rescale
    assert ("__any_sync" in src) == skip, f"fwd d={dim}/{dim_v} {dt}: configs says skip_rescale={skip}, the kernel disagrees"
    # Per-thread partial row sums (``softmax.online_softmax``'s defer_sum): each block scales a
    # thread's parts by its rows' alpha (two parts a row: alpha[part >> 1]) instead of adding
    # an all-reduced row sum.
    defer = configs.fwd_config(dim, dim_v, dt, "full").defer_sum
    parts = re.search(r"\bl\w*\[(\w+)\] = \(l\w*\[\1\] \* alpha\[\(\1 >> 1\)\]\);", src)
    assert bool(parts) == defer, f"fwd d={dim}/{dim_v} {dt}: configs says defer_sum={defer}, the kernel disagrees"


@pytest.mark.parametrize("dim,dim_v,dtype", STRUCTURES, ids=lambda x: str(x))
def test_backward_builds(dim, dim_v, dtype):
    from flashtile.kernels.launch import backward_kernels as get_backward_kernels

    dt = dtype
    _, main, _ = get_backward_kernels(dim, dim_v, dt, has_softcap=False, has_dlse=False, deterministic=False)
    src = main.get_kernel_source()
    _assert_hopper(src, f"bwd d={dim}/{dim_v} {dt}")
    _assert_dq_reduction(src, configs.bwd_config(dim, dim_v, dt, "full"), f"bwd d={dim}/{dim_v} {dt}")


def _assert_dq_reduction(src: str, cfg, what: str) -> None:
    """dQ leaves the default backward by TMA reduce-add from shared memory, or with ``dq_regs``
    by vector atomics from registers: unguarded in a query block that lies inside the sequence
    (``(dq_m0 + 64) <= Sq``), else each behind a test of its row (odd lengths: the last query
    block's rows past ``Sq`` must not be written).  The builder turns TileLang's own guards
    off, so these tests are the only ones."""
    if not cfg.dq_regs:
        assert "tma_store_add" in src, f"{what}: dQ should be reduced with TMA reduce-add"
        return
    assert "tma_store_add" not in src and "dq_s" not in src, f"{what}: dq_regs still stages dQ in shared memory"
    lines = src.splitlines()
    adds = [i for i, line in enumerate(lines) if "AtomicAddx2((&(dQacc[" in line]
    assert len(adds) == 2, f"{what}: expected a whole-block and a row-tested vector atomic into dQacc, found {len(adds)}"
    tests = [next((lines[j].strip() for j in range(i - 1, max(i - 8, 0), -1) if lines[j].lstrip().startswith("if (")), "")
             for i in adds]
    assert f"(dq_m0 + {cfg.block_m}) <= Sq)" in tests[0], f"{what}: the unguarded atomics are not behind the block test: {tests[0]!r}"
    assert tests[1].endswith("+ dq_m0) < Sq) {"), f"{what}: the tail's atomics are not behind a row test: {tests[1]!r}"


def test_dq_regs_backward_builds(monkeypatch):
    """The d = 256 backward with ``dq_regs`` and two Q / dO stages (shared memory freed by the
    dQ tile) lowers with its vector atomics: whole blocks unguarded, the tail block row-tested."""
    from flashtile.kernels.launch import backward_kernels as get_backward_kernels

    cfg = configs.BwdConfig(block_n=64, block_m=64, num_stages=2, threads=256, overlap=True, dq_regs=True)
    monkeypatch.setitem(configs.overrides, "bwd", cfg)
    _, main, _ = get_backward_kernels(256, 256, "bfloat16", has_softcap=False, has_dlse=False, deterministic=False)
    src = main.get_kernel_source()
    _assert_hopper(src, "bwd d=256 dq_regs")
    _assert_dq_reduction(src, cfg, "bwd d=256 dq_regs")
    # Its builder turns TileLang's safe-memory guards off: every other global access must stay
    # TMA (a pointer argument indexed in the CUDA would now go unguarded).
    pointers = set(re.findall(r"__restrict__ (\w+)", src))
    assert pointers == {"dQacc"}, f"bwd d=256 dq_regs: unguarded global pointers {sorted(pointers)}"


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_wide_backward_builds(varlen, monkeypatch):
    """``bwd_wide``'s d = 256 dK/dV kernel (forced by the tuning hook): each consumer warpgroup
    issues the whole S^T and dP^T (m64n64 over both column halves of K / V and Q / dO), its
    dV / dK half from registers (m64n128 RS) and its dQ half in two m64n64 chunks, reduce-added
    by TMA in the default mode; no atomics at all without dQ (deterministic mode)."""
    from flashtile.kernels.launch import backward_kernels

    cfg = configs.BwdConfig(block_n=64, block_m=64, num_stages=1, threads=256, overlap=True, replicate_scores=True)
    monkeypatch.setitem(configs.overrides, "bwd", cfg)
    src = backward_kernels(256, 256, "bfloat16", False, False, False, varlen=varlen)[1].get_kernel_source()
    _assert_hopper(src, "bwd_wide")
    ss64 = "wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32, 64, 64, 16, false, false"
    rs128 = "wgmma_rs<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32, 64, 128, 16"
    dq64 = "wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32, 64, 64, 16, true, true"
    # Per warpgroup (two code paths): S^T and dP^T over two column halves each, dV and dK, two dQ chunks.
    for pattern, want in ((ss64, 8), (rs128, 4), (dq64, 4)):
        assert src.count(pattern) == want, f"bwd_wide: {src.count(pattern)} x {pattern}..., expected {want}"
    assert "tma_store_add" in src, "bwd_wide: dQ should be reduced with TMA reduce-add"
    if not varlen:  # (one build of the variant without dQ is enough: CI time)
        _, main, dq = backward_kernels(256, 256, "bfloat16", False, True, True)
        _assert_no_atomics({"dkdv": main, "dq": dq}, "bwd_wide deterministic")


def _assert_no_atomics(kernels: dict, what: str) -> None:
    """No kernel of a deterministic backward accumulates by atomics."""
    for name, k in kernels.items():
        src = k.get_kernel_source()
        _assert_hopper(src, f"{what} {name}")
        for atomic in ("AtomicAdd", "atomicAdd", "tma_store_add", "atomic_add"):
            assert atomic not in src, f"{what} {name} uses {atomic}"


@pytest.mark.parametrize("dim,dim_v", [(128, 128), (192, 128)])
def test_deterministic_backward_builds_without_atomics(dim, dim_v):
    from flashtile.kernels.launch import backward_kernels as get_backward_kernels

    _, main, dq = get_backward_kernels(dim, dim_v, "bfloat16", has_softcap=False, has_dlse=True, deterministic=True)
    _assert_no_atomics({"dkdv": main, "dq": dq}, "deterministic")


@pytest.mark.parametrize("has_sinks,has_softcap", [(True, False), (False, True), (True, True)])
def test_feature_variants_build(has_sinks, has_softcap):
    from flashtile.kernels.launch import backward_kernels as get_backward_kernels
    from flashtile.kernels.launch import forward_kernel as get_forward_kernel

    src = get_forward_kernel(128, 128, "bfloat16", has_sinks, has_softcap).get_kernel_source()
    _assert_hopper(src, f"fwd sinks={has_sinks} softcap={has_softcap}")
    if has_softcap:
        assert "tanh" in src
        _, main, _ = get_backward_kernels(128, 128, "bfloat16", has_softcap=True, has_dlse=False, deterministic=False)
        _assert_hopper(main.get_kernel_source(), "bwd softcap")


@pytest.mark.parametrize("d,dv", [(72, 72), (200, 100)])
def test_padded_head_dims_build(d, dv):
    """Head dims outside the table run the kernels of ``configs.kernel_headdim``: forward at the
    next multiple of 16 (72 -> 80, 200/100 -> 208/112), backward at the next multiple of 32."""
    from flashtile.kernels.launch import backward_kernels as get_backward_kernels
    from flashtile.kernels.launch import forward_kernel as get_forward_kernel

    fd, fdv = configs.kernel_headdims(d, dv, "fwd")
    _assert_hopper(get_forward_kernel(fd, fdv, "bfloat16", False, False).get_kernel_source(), f"fwd d={fd}/{fdv}")
    bd, bdv = configs.kernel_headdims(d, dv, "bwd")
    _, main, _ = get_backward_kernels(bd, bdv, "bfloat16", has_softcap=False, has_dlse=False, deterministic=False)
    _assert_hopper(main.get_kernel_source(), f"bwd d={bd}/{bdv}")


@pytest.mark.parametrize("dim", [128, 256])
def test_auto_pipelined_forward_builds(dim):
    """The table picks the hand-written forward everywhere; the auto-pipelined schedule stays
    buildable as the baseline that ``benchmarks/tune.py`` measures against."""
    from flashtile.kernels.launch import forward_kernel as get_forward_kernel

    configs.overrides["fwd"] = configs.FwdConfig(block_m=128, block_n=128 if dim <= 128 else 80, num_stages=2, threads=256)
    try:
        src = get_forward_kernel(dim, dim, "bfloat16", has_sinks=True, has_softcap=False).get_kernel_source()
    finally:
        configs.overrides.pop("fwd")
    _assert_hopper(src, f"auto-pipelined fwd d={dim}")
    assert "wait_wgmma<1>" not in src, "the auto-pipelined forward should keep its GEMMs synchronous"


@pytest.mark.parametrize("dim,dim_v,dtype", STRUCTURES, ids=lambda x: str(x))
def test_varlen_kernels_build(dim, dim_v, dtype):
    """Packed (varlen) batches: the same builders with ``varlen=True`` (sequence offsets and
    lengths as kernel arguments; row-guarded stores; a grid of real tiles sized by the packed
    row count, ``seqinfo.packed_slots``), forward and default backward."""
    from flashtile.kernels.launch import backward_kernels, forward_kernel

    src = forward_kernel(dim, dim_v, dtype, has_sinks=True, has_softcap=False, varlen=True).get_kernel_source()
    _assert_hopper(src, f"varlen fwd d={dim}/{dim_v} {dtype}")
    for name in ("CuQ", "LenK", "int Tq"):
        assert name in src, f"varlen fwd: {name} should be a kernel argument"
    _, main, _ = backward_kernels(dim, dim_v, dtype, has_softcap=False, has_dlse=False, deterministic=False, varlen=True)
    src = main.get_kernel_source()
    _assert_hopper(src, f"varlen bwd d={dim}/{dim_v} {dtype}")
    assert "tma_store_add" in src, "varlen backward should reduce dQ with TMA reduce-add"


@pytest.mark.parametrize("dim,dim_v,has_softcap", [(128, 128, False), (128, 128, True), (256, 256, False)])
def test_varlen_deterministic_and_softcap_build(dim, dim_v, has_softcap):
    from flashtile.kernels.launch import backward_kernels, forward_kernel

    if has_softcap:
        _assert_hopper(forward_kernel(dim, dim_v, "bfloat16", False, True, varlen=True).get_kernel_source(), "varlen fwd softcap")
    _, main, dq = backward_kernels(dim, dim_v, "bfloat16", has_softcap, has_dlse=True, deterministic=True, varlen=True)
    for what, k in (("dkdv", main), ("dq", dq)):
        src = k.get_kernel_source()
        _assert_hopper(src, f"varlen deterministic {what}")
        assert "tma_store_add" not in src and "AtomicAdd" not in src, f"varlen deterministic {what} uses atomics"


def test_symbolic_shapes_are_not_specialised():
    """Batch, lengths and head counts are kernel arguments, not constants baked into the code."""
    from flashtile.kernels.launch import forward_kernel as get_forward_kernel

    src = get_forward_kernel(128, 128, "bfloat16", False, False).get_kernel_source()
    for name in ("int B", "int Sq", "int Sk", "int H", "int Hkv", "int left", "int right"):
        assert name in src, f"{name} should be a runtime kernel argument"


def _ptxas_report(src: str, tmp_path) -> str:
    import os
    import subprocess

    import tilelang

    tl = os.path.dirname(tilelang.__file__)
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    cmd = ["nvcc", "--cubin", "-O3", "-arch=sm_90a", "-std=c++17", "--use_fast_math", f"-I{tl}/src",
           f"-I{tl}/3rdparty/cutlass/include", "-Xptxas", "-v", str(cu), "-o", str(tmp_path / "k.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stderr


def _overlapped_kernel(which: str, has_softcap: bool):
    if which.startswith("fwd"):  # "fwd" at d=128, "fwd256" at d=256
        from flashtile.kernels.launch import forward_kernel as get_forward_kernel

        dim = int(which[3:] or 128)
        return get_forward_kernel(dim, dim, "bfloat16", True, has_softcap)
    from flashtile.kernels.launch import backward_kernels as get_backward_kernels

    if which == "dq":  # the deterministic mode's dQ kernel
        return get_backward_kernels(128, 128, "bfloat16", has_softcap, False, True)[2]
    return get_backward_kernels(128, 128, "bfloat16", has_softcap, False, False)[1]


@pytest.mark.parametrize(
    "which,has_softcap,overlapped",
    [("fwd", False, True), ("fwd", True, True), ("fwd256", True, True), ("bwd", False, True), ("bwd", True, False), ("dq", False, True), ("dq", True, True)],
)
def test_overlapped_kernels_keep_wgmma_async(which, has_softcap, overlapped, tmp_path):
    """The hand-written kernels issue WGMMAs asynchronously and compute under them; that only pays
    off while ptxas keeps them asynchronous.  An accumulator touched while a wgmma may still
    be in flight (e.g. a wait behind a branch) makes ptxas serialise every wgmma in the
    kernel (C7515), silently costing the overlap.  The softcap backward stays synchronous: its
    tanh tile already costs 80 bytes of spills there (124 overlapped), recorded, not hidden."""
    src = _overlapped_kernel(which, has_softcap).get_kernel_source()
    assert ("wait_wgmma<1>" in src) == overlapped, f"{which} softcap={has_softcap}: wrong schedule"
    report = _ptxas_report(src, tmp_path)
    assert "C7515" not in report and "serialized" not in report, report
    if not (which == "bwd" and has_softcap):
        assert " 0 bytes spill stores" in report, report


FP8_STRUCTURES = [  # (dim, dim_v, varlen, sinks, softcap, out_dtype, short): every FP8 tile row, dense and packed
    (64, 64, False, False, False, "bfloat16", False), (64, 64, True, False, False, "bfloat16", False),
    (128, 128, False, False, False, "bfloat16", False), (128, 128, True, False, False, "bfloat16", False),
    (128, 128, False, False, False, "bfloat16", True),  # d=128's short-sequence row (configs.short_forward)
    (192, 128, False, False, False, "bfloat16", False), (192, 128, True, False, False, "bfloat16", False),
    (256, 256, False, False, False, "bfloat16", False), (256, 256, True, False, False, "bfloat16", False),
    (128, 128, False, True, True, "float16", False), (128, 128, True, True, True, "float16", False),
]


@pytest.mark.parametrize("dim,dim_v,varlen,sinks,softcap,out_dtype,short", FP8_STRUCTURES, ids=lambda x: str(x))
def test_fp8_forward_builds(dim, dim_v, varlen, sinks, softcap, out_dtype, short):
    """The FP8 forward: both GEMMs are FP8 WGMMAs, P stays in registers (the S -> P column
    permutation of ``operands`` is register-local, so no shuffle and no shared-memory trip), and P
    is converted two values at a time with saturation."""
    from flashtile.kernels.launch import forward_kernel as get_forward_kernel

    src = get_forward_kernel(dim, dim_v, "float8_e4m3fn", sinks, softcap, varlen=varlen, out_dtype=out_dtype,
                             short=short).get_kernel_source()
    what = f"fp8 fwd d={dim}/{dim_v} varlen={varlen} sinks={sinks} softcap={softcap} short={short}"
    _assert_hopper(src, what)
    assert "wgmma_rs" in src and "wgmma_ss" in src, f"{what}: P V should read P from registers (wgmma_rs)"
    assert "fp8_e4_t" in src and "__nv_cvt_float2_to_fp8x2" in src and "__NV_SATFINITE" in src, f"{what}: P conversion"
    assert "__shfl" not in src, f"{what}: the S -> P permutation should not move data between threads"
    assert "__any_sync" not in src, f"{what}: the FP8 rows rescale O every block (the skip measured slower, NOTES)"


def _fp8_d128_forward_source(monkeypatch, cfg) -> list[str]:
    """Lines of the generated CUDA of the FP8 d = 128 forward (bf16 out) built with ``cfg``."""
    from flashtile.kernels import configs
    from flashtile.kernels.launch import forward_kernel as get_forward_kernel

    monkeypatch.setitem(configs.overrides, "fwd", cfg)
    return get_forward_kernel(128, 128, "float8_e4m3fn", False, False, out_dtype="bfloat16").get_kernel_source().splitlines()


def test_explicit_syncs_one_tile_orders_its_epilogue(monkeypatch):
    """``FwdConfig.explicit_syncs`` builds the one-tile forward without TileLang's sync pass (which
    cannot lower FP8 key blocks of 160-256 keys), so its epilogue must order the output tile
    itself: both consumer barriers (``pipeline.CONSUMERS_SYNC``) come before the TMA store of O,
    else the stmatrix writes and the elected thread's store race."""
    from flashtile.kernels import configs
    from flashtile.kernels.pipeline import CONSUMERS_SYNC

    cfg = configs.FwdConfig(block_m=128, block_n=192, num_stages=2, threads=256, manual_ws=True, pingpong=True,
                            explicit_syncs=True)
    assert cfg.builder == "fwd_ws.attention_fwd_ws_kernel"
    lines = _fp8_d128_forward_source(monkeypatch, cfg)
    store = next(i for i, line in enumerate(lines) if "tma_store(O_desc" in line)
    syncs = [i for i, line in enumerate(lines) if f"__sync_thread_partial({CONSUMERS_SYNC}, 256)" in line]
    assert len([i for i in syncs if i < store]) == 2, f"barriers at lines {syncs}, the O store at {store}"



def _tma_load_lines(src: str, tensor: str) -> list[str]:
    return [line for line in src.splitlines() if f"tl::tma_load({tensor}_desc" in line]


def test_backward_producer_regs_loads_from_registers(monkeypatch, dim=128):
    """``BwdConfig.producer_regs``: the loader's Q / lse / dO / Delta loads and the dQ writer's
    reduce-adds take each step's query head and first row from registers stepped by
    ``bwd_ws.StepCursor``, where the default build re-derives them (``query_step``: a division
    and a remainder by the tile's query block count) for each of them.  d = 128 (the d = 64
    persistent writer's source binds them once per step already; its SASS still shortens:
    NOTES prediction 10)."""
    from dataclasses import replace

    from flashtile.kernels.launch import backward_kernels

    default = configs.bwd_config(dim, dim, torch.bfloat16, "local")
    assert default.manual_ws and not default.producer_regs and "producer_regs" not in default.as_kwargs()

    def step_lines(cfg):
        monkeypatch.setitem(configs.overrides, "bwd", cfg)
        src = backward_kernels(dim, dim, "bfloat16", False, False, False, window=(-1, 0))[1].get_kernel_source()
        lines = _tma_load_lines(src, "Q") + _tma_load_lines(src, "dO") + _tma_load_lines(src, "LSE2")
        return lines + [line for line in src.splitlines() if "tma_store_add(dQacc_desc" in line]

    assert any(re.search(r"/|%", line) for line in step_lines(default)), \
        "the default producer was expected to re-derive each step's coordinates (if not, the option is moot)"
    lines = step_lines(replace(default, producer_regs=True))
    assert len(lines) >= 4, f"expected the Q, dO, lse loads and the dQ reduce-add, found {lines}"
    derived = [line.strip() for line in lines if re.search(r"/|%", line)]
    assert not derived, f"steps still re-derive their coordinates: {derived}"


@pytest.mark.parametrize("dim,short", [(64, True), (256, False)], ids=["d64-pairs", "d256-one-tile"])
def test_producer_regs_loads_from_registers(monkeypatch, dim, short):
    """``FwdConfig.producer_regs`` (on in these rows): every K/V/Q load takes its coordinates
    from registers the producer set once per tile, not from the tile's expressions
    (``tile_pair``'s heads and batch entry, ``query_tile``'s first key block), which a build
    without the option re-derives, integer divisions included, for each load; off, the option is
    left out of the structure (the kernels built before it existed keep their ids)."""
    from dataclasses import replace

    from flashtile.kernels.launch import forward_kernel as get_forward_kernel

    default = configs.fwd_config(dim, dim, torch.bfloat16, "local", short=short)
    assert default.manual_ws and default.producer_regs, default
    off = replace(default, producer_regs=False)
    assert "producer_regs" not in off.as_kwargs()
    monkeypatch.setitem(configs.overrides, "fwd", off)
    src = get_forward_kernel(dim, dim, "bfloat16", False, False, window=(-1, 0), short=short).get_kernel_source()
    assert any(re.search(r"rdiv|rmod|/|%", line) for line in _tma_load_lines(src, "K")), \
        "without producer_regs the K loads were expected to re-derive the tile's coordinates (if not, the option is moot)"
    monkeypatch.delitem(configs.overrides, "fwd")
    src = get_forward_kernel(dim, dim, "bfloat16", False, False, window=(-1, 0), short=short).get_kernel_source()
    loads = _tma_load_lines(src, "K") + _tma_load_lines(src, "V")
    assert loads, "no K/V TMA loads found"
    derived = [line.strip() for line in loads if re.search(r"rdiv|rmod|/|%", line)]
    assert not derived, f"loads still re-derive the tile's coordinates: {derived}"


@pytest.mark.parametrize("mode", [1, 2], ids=["softmax", "exponentials"])
def test_softmax_turns_guard_the_softmax(monkeypatch, mode, dim=64):
    """``FwdConfig.softmax_turns`` (NOTES prediction 11): each pingpong turn (``fwd_ws.gemm_turns``,
    barriers ``TURN_BARRIER + wg``) spans a key block's exponentials and no GEMM issue (mode 2:
    nor the row max's reduction), where the default turns span the GEMM issues and no
    exponential; off, the flag is left out of the structure (the kernels built before it keep
    their ids)."""
    from dataclasses import replace

    from flashtile.kernels.launch import forward_kernel as get_forward_kernel

    default = configs.fwd_config(dim, dim, torch.bfloat16, "local", short=True)
    assert default.pingpong and not default.softmax_turns and "softmax_turns" not in default.as_kwargs(), default

    def turn_spans(cfg):
        monkeypatch.setitem(configs.overrides, "fwd", cfg)
        lines = get_forward_kernel(dim, dim, "bfloat16", False, False, window=(-1, 0), short=True).get_kernel_source().splitlines()
        takes = [i for i, line in enumerate(lines) if re.search(r"__sync_thread_partial\(.*\+ 9\), 256\)", line)]
        spans = []
        for i in takes:
            end = next(j for j in range(i + 1, len(lines)) if "__named_barrier_arrive(" in lines[j])
            spans.append("\n".join(lines[i:end]))
        return spans

    spans = turn_spans(default)
    assert spans and all("wgmma" in span and "exp2f" not in span for span in spans), "default turns: GEMM issues only"
    spans = turn_spans(replace(default, softmax_turns=mode))
    assert len(spans) >= 2 and all("exp2f" in span and "wgmma_" not in span for span in spans), \
        "softmax turns: each turn should hold a block's exponentials and no GEMM issue"
    with_max = [("MaxOp" in span) for span in spans]
    assert all(with_max) if mode == 1 else not any(with_max), f"mode {mode}: the row max inside the turns: {with_max}"
