"""The eager fast paths that cut host time per call (issue 19, item 3): which path runs when,
and that every path gives the same results.

Plain eager calls skip the ``torch.library`` dispatch: inference (no grad needed) calls the
implementation directly, training goes through an ``autograd.Function``; traced calls
(``torch.compile(fullgraph=True)``) keep the custom ops.  The launcher memoises its kernel
structures except while ``configs.overrides`` is set.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import flashtile
from flashtile import kvcache, ops, varlen
from flashtile.kernels import configs, launch

FWD = torch.ops.flashtile.fwd.default


def _qkv(grad=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 8, generator=g, dtype=dtype)
    k = torch.randn(2, 7, 2, 8, generator=g, dtype=dtype)
    v = torch.randn(2, 7, 2, 6, generator=g, dtype=dtype)
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def _forbid(monkeypatch, module, name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} called in plain eager")

    monkeypatch.setattr(module, name, refuse)


def _graph_ops(fn, *args):
    """The ``flashtile`` ops in the graph that torch.compile(fullgraph=True) traces for fn."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, [s for s in seen if "flashtile" in s]


def test_inference_calls_the_implementation(monkeypatch):
    q, k, v = _qkv()
    want = FWD(q, k, v, None, 0.3, -1, 0, 0.0, False)
    _forbid(monkeypatch, ops, "attention_fwd")
    _forbid(monkeypatch, ops, "_eager_apply")
    out, lse = flashtile.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, return_lse=True)
    assert out.grad_fn is None and lse.grad_fn is None
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    with torch.no_grad():  # grad mode off: inputs requiring grad need no autograd either
        qg, kg, vg = _qkv(grad=True)
        assert torch.equal(flashtile.flash_attn_func(qg, kg, vg, softmax_scale=0.3, causal=True), want[0])


def test_training_uses_the_eager_function(monkeypatch):
    q, k, v = _qkv(grad=True)
    _forbid(monkeypatch, ops, "attention_fwd")
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    q2, k2, v2 = (x.detach().requires_grad_() for x in (q, k, v))
    monkeypatch.undo()
    ref, _ = FWD(q2, k2, v2, None, 8 ** -0.5, -1, 0, 0.0, False)
    assert torch.equal(out, ref)
    for a, b in zip(grads, torch.autograd.grad(ref.sum(), (q2, k2, v2))):
        assert torch.equal(a, b)


def test_compile_keeps_the_custom_op():
    q, k, v = _qkv()
    eager = flashtile.flash_attn_func(q, k, v, causal=True)
    out, seen = _graph_ops(lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True), q, k, v)
    assert seen == ["flashtile.fwd.default"]
    assert torch.equal(out, eager)


def test_varlen_paths(monkeypatch):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(9, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    args = (cu, cu, 6, 6)
    compiled, seen = _graph_ops(lambda q, k, v: flashtile.flash_attn_varlen_func(q, k, v, *args, causal=True), q, k, v)
    assert seen == ["flashtile.varlen_fwd.default"]
    _forbid(monkeypatch, varlen, "varlen_fwd")
    _forbid(monkeypatch, varlen, "_eager_apply")
    eager = flashtile.flash_attn_varlen_func(q, k, v, *args, causal=True)
    assert eager.grad_fn is None and torch.equal(eager, compiled)
    monkeypatch.undo()
    _forbid(monkeypatch, varlen, "varlen_fwd")
    qg = q.clone().requires_grad_()
    out = flashtile.flash_attn_varlen_func(qg, k, v, *args, causal=True)
    assert type(out.grad_fn).__name__ == "_EagerVarlenBackward" and torch.equal(out, eager)


def _cache():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 1, 4, 8, generator=g)
    kc, vc = (torch.randn(2, 16, 2, 8, generator=g) for _ in range(2))
    kn, vn = (torch.randn(2, 1, 2, 8, generator=g) for _ in range(2))
    lens = torch.tensor([5, 9], dtype=torch.int32)
    return q, kc, vc, kn, vn, lens


def test_kvcache_eager_skips_the_ops_and_matches_them(monkeypatch):
    q, kc, vc, kn, vn, lens = _cache()
    kc2, vc2 = kc.clone(), vc.clone()
    # the ops, as a traced call runs them
    kvcache.kvcache_append(kc2, vc2, kn, vn, lens, None, None, None, None)
    want = kvcache.kvcache_fwd(q, kc2, vc2, lens + 1, None, None, None, None, 8 ** -0.5, -1, 0, 0.0, 0)
    _forbid(monkeypatch, kvcache, "kvcache_append")
    _forbid(monkeypatch, kvcache, "kvcache_fwd")
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True, return_lse=True)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # appended in place
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_kvcache_compile_keeps_the_ops():
    q, kc, vc, kn, vn, lens = _cache()
    kc2, vc2 = kc.clone(), vc.clone()
    eager = flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True)

    def step(q, kc, vc, kn, vn, lens):
        return flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True)

    out, seen = _graph_ops(step, q, kc2, vc2, kn, vn, lens)
    assert "flashtile.kvcache_fwd.default" in seen and any("kvcache_append" in s for s in seen)
    assert torch.equal(out, eager) and torch.equal(kc2, kc) and torch.equal(vc2, vc)


def test_kvcache_input_requiring_grad_takes_the_op(monkeypatch):
    """No autograd in the direct path: a call that autograd would see keeps the op."""
    q, kc, vc, _, _, lens = _cache()
    calls = []
    op = kvcache.kvcache_fwd
    monkeypatch.setattr(kvcache, "kvcache_fwd", lambda *a: calls.append(1) or op(*a))
    flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    assert calls == []
    flashtile.flash_attn_with_kvcache(q.clone().requires_grad_(), kc, vc, cache_seqlens=lens)
    assert calls == [1]


def test_launch_structures_are_memoised_except_under_overrides(monkeypatch):
    args = (64, 64, "bfloat16", False, False, "full", False, 132, "bfloat16")
    first = launch._forward_structure(*args)
    assert launch._forward_structure(*args) is first  # memoised
    tuned = configs.FwdConfig(block_m=64, block_n=64, num_stages=1, threads=128)
    monkeypatch.setitem(configs.overrides, "fwd", tuned)
    assert launch._forward_structure(*args)[1] is tuned  # the tuning hook is honoured
    monkeypatch.delitem(configs.overrides, "fwd")
    assert launch._forward_structure(*args) is first
    bwd = launch._backward_structures(64, 64, "bfloat16", False, False, True, "local", False)
    assert bwd[3] == configs.bwd_config(64, 64, "bfloat16", "local", False) and bwd[2] is not None


@pytest.mark.parametrize("bad, match", [
    (dict(causal=1), "causal must be a bool"),
    (dict(window_size=(-2, 0)), "window_size left must be >= -1"),
    (dict(window_size=[1, 2.0]), "window_size must be a pair of ints"),
    (dict(softcap=float("nan")), "softcap must be a finite float"),
    (dict(softcap=-1.0), "softcap must be a finite float"),
    (dict(dropout_p=0.1), "dropout_p=0.1 is not supported"),
    (dict(out_dtype=torch.float16), "out_dtype must be None or q's dtype"),
])
def test_fast_checks_still_refuse(bad, match):
    """The validation's common-case shortcuts fall through to the named errors."""
    q, k, v = _qkv()
    with pytest.raises((TypeError, ValueError, NotImplementedError), match=match):
        flashtile.flash_attn_func(q, k, v, **bad)


def test_forward_ad_keeps_the_recorded_path():
    """Dual tensors need not require grad: under an open forward-AD level the call is not
    'inference', so it takes the autograd.Function as before the direct path (which refuses
    forward mode loudly: no jvp) instead of silently dropping the tangent."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = _qkv()
    with fwAD.dual_level():
        qd = fwAD.make_dual(q, torch.randn_like(q))
        assert ops._needs_grad(qd, k, v)
        with pytest.raises(NotImplementedError, match="jvp"):
            flashtile.flash_attn_func(qd, k, v)


def test_kernels_call_the_executable_directly_from_the_first_call():
    """``cache._direct_calls``: a kernel without adapter-allocated outputs calls its compiled
    executable itself (loaded on the first call); one with outputs keeps TileLang's adapter."""
    from types import SimpleNamespace

    from flashtile.kernels import cache

    calls = []
    exe = lambda *a: calls.append(a) or "ran"  # noqa: E731
    adapter = SimpleNamespace(result_idx=[], _get_executable=lambda: exe, func=lambda *a: "adapter")
    kernel = SimpleNamespace(adapter=adapter, torch_function=adapter.func)
    assert cache._direct_calls(kernel) is kernel
    assert kernel.torch_function(1, 2) == "ran" and kernel.torch_function is exe and calls == [(1, 2)]
    owned = SimpleNamespace(adapter=SimpleNamespace(result_idx=[3], _get_executable=lambda: exe), torch_function="adapter")
    assert cache._direct_calls(owned).torch_function == "adapter"
    assert cache._direct_calls(None) is None


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_built_kernels_take_the_direct_call():
    """The real TileLang kernels qualify (their adapter allocates no outputs); a kernel loaded
    from its tagged cache entry (``cache.IndexedKernel``: a cache an earlier process filled) is
    the executable itself."""
    from flashtile.kernels import cache
    from flashtile.kernels.decode import get_decode_kernels

    for kernel in get_decode_kernels(128, 128, "bfloat16", False, False):
        if isinstance(kernel, cache.IndexedKernel):
            assert callable(kernel.torch_function) and "__global__" in kernel.get_kernel_source()
            continue
        assert kernel.torch_function.__name__ == "first_call", kernel.torch_function
        assert not kernel.adapter.result_idx


def _stub_decode_gpu(monkeypatch, record):
    """``launch_decode``'s CUDA host path on meta tensors: an H100's SM count and capability,
    kernels that record their arguments (tensors as (shape, dtype)), fresh memo tables."""
    from flashtile.kernels import decode, target

    monkeypatch.setattr(target, "sm_count", lambda device: 132)
    monkeypatch.setattr(target, "capability", lambda device: (9, 0))
    monkeypatch.setattr(launch, "_MEMO", {})
    monkeypatch.setattr(decode, "_PLANS", {})

    def kernels(*structure_and_sched):
        sched = structure_and_sched[-1]

        def kernel(name):
            return lambda *args: record.append(
                (name, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)))

        return (kernel("decode"), *(kernel(f"combine{i}") for i in range(len(sched.combines))))

    monkeypatch.setattr(decode, "get_decode_kernels", kernels)
    return decode


DECODE_CALLS = [  # (batch, q tokens, heads, kv heads, d, dv, cache rows, page, fp8, sinks, softcap, window, splits)
    (1, 1, 32, 8, 128, 128, 8448, 0, False, False, 0.0, (-1, 0), 0),
    (1, 4, 32, 8, 128, 128, 8448, 16, False, True, 0.0, (-1, 0), 0),
    (8, 1, 32, 8, 128, 128, 33024, 256, False, False, 30.0, (-1, -1), 0),
    (128, 1, 32, 8, 128, 128, 2304, 0, False, False, 0.0, (-1, 0), 0),
    (1, 1, 32, 8, 128, 128, 131328, 48, False, False, 0.0, (127, 0), 5),
    (1, 1, 32, 8, 128, 128, 8448, 0, True, False, 0.0, (-1, 0), 0),
    (8, 4, 32, 8, 128, 128, 33024, 16, True, True, 0.0, (-1, 0), 0),
    (128, 1, 32, 8, 128, 128, 2304, 64, True, False, 0.0, (-1, 0), 0),
    (3, 2, 4, 1, 192, 128, 777, 0, True, True, 20.0, (-1, 0), 0),
    (2, 1, 8, 8, 64, 64, 100, 0, False, False, 0.0, (-1, -1), 1),
]


@pytest.mark.parametrize("call", DECODE_CALLS, ids=lambda c: "-".join(map(str, c)))
def test_decode_plan_is_memoised_and_launches_the_same(monkeypatch, call):
    """``decode.decode_plan`` (the launcher's decisions, memoised per call description): a call
    repeated takes the stored plan and launches exactly what a fresh plan launches; a changed
    switch (own workers off) makes a new plan."""
    record = []
    decode = _stub_decode_gpu(monkeypatch, record)
    b, sq, h, hkv, d, dv, rows, page, fp8, sinks, softcap, window, splits = call
    meta = dict(device="meta")
    q = torch.empty(b, sq, h, d, dtype=torch.bfloat16, **meta)
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if page:
        pages = -(-rows // page)
        kc = torch.empty(b * pages, page, hkv, d, dtype=cache_dtype, **meta)
        vc = torch.empty(b * pages, page, hkv, dv, dtype=cache_dtype, **meta)
        table = torch.empty(b, pages, dtype=torch.int32, **meta)
    else:
        kc = torch.empty(b, rows, hkv, d, dtype=cache_dtype, **meta)
        vc = torch.empty(b, rows, hkv, dv, dtype=cache_dtype, **meta)
        table = None
    descales = (torch.empty(b, hkv, dtype=torch.float32, **meta),) * 2 if fp8 else (None, None)
    args = (q, kc, vc, torch.empty(b, dtype=torch.int32, **meta), None, None, table,
            torch.empty(h, dtype=torch.float32, **meta) if sinks else None, 0.125, window, softcap, splits, *descales)

    def launched():
        record.clear()
        out, lse = decode.launch_decode(*args)
        assert out.shape == (b, sq, h, dv) and lse.shape == (b, h, sq)
        return list(record)

    fresh = launched()
    assert fresh and fresh[0][0] == "decode", "the decode kernel launches first"
    assert len(decode._PLANS) == 1
    plan = next(iter(decode._PLANS.values()))
    assert launched() == fresh, "a repeated call launches what its fresh plan launched"
    assert len(decode._PLANS) == 1 and next(iter(decode._PLANS.values())) is plan, "the plan is reused"
    decode._PLANS.clear()
    assert launched() == fresh, "a plan made again is the same"
    monkeypatch.setattr(decode, "OWN_WORKERS", "0")
    launched()
    assert len(decode._PLANS) == 2, "a changed switch is a new plan"


def test_decode_plan_keeps_refusing_non_contiguous_caches(monkeypatch):
    """A stored plan is not a pass for a cache of the same shape laid out differently: the
    contiguity check (``decode.require_kernel``) still refuses it."""
    decode = _stub_decode_gpu(monkeypatch, [])
    meta = dict(device="meta")
    q = torch.empty(1, 1, 8, 64, dtype=torch.bfloat16, **meta)
    kc = torch.empty(1, 300, 2, 64, dtype=torch.bfloat16, **meta)
    strided = torch.empty(1, 2, 300, 64, dtype=torch.bfloat16, **meta).transpose(1, 2)
    lens = torch.empty(1, dtype=torch.int32, **meta)
    rest = (None, None, None, None, 0.125, (-1, 0), 0.0)
    decode.launch_decode(q, kc, kc, lens, *rest)
    with pytest.raises(NotImplementedError, match="non-contiguous"):
        decode.launch_decode(q, strided, strided, lens, *rest)


def test_structure_ids_name_builder_arguments_and_sources(monkeypatch):
    """``cache.structure_id``: the two compilations of the forward builder, other static
    arguments and edited kernel sources all get other ids (an id picks a cache entry without
    tracing, so nothing that changes the kernel may keep it); equal structures get one id."""
    from flashtile.kernels import cache

    ref, tile_ref = cache.BuilderRef("fwd_ws.attention_fwd_ws_kernel"), cache.BuilderRef("fwd_ws.attention_fwd_ws_tile_kernel")
    kw = {"dim": 128, "dim_v": 128, "dtype": "bfloat16", "block_n": 128}
    sid = cache.structure_id(ref, kw)
    assert sid == cache.structure_id(cache.BuilderRef(ref.name), dict(reversed(list(kw.items()))))
    assert len({sid, cache.structure_id(tile_ref, kw), cache.structure_id(ref, {**kw, "block_n": 96})}) == 3
    monkeypatch.setattr(cache, "_sources_digest", lambda: "edited")
    assert cache.structure_id(ref, kw) != sid
    assert ref.__name__ == "attention_fwd_ws_kernel" and {ref: 1}[cache.BuilderRef(ref.name)] == 1


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_a_tagged_kernel_loads_in_a_new_process_without_its_builder():
    """A kernel built (or loaded by TileLang) here tags its cache entry; a new process then loads
    it by structure id: an ``IndexedKernel`` with the same device source, and neither the
    builder's module (whose jit decorators cost ~0.4 s each) nor TileLang (1-2 s: the launcher
    and its helper modules import without it) imported."""
    import subprocess
    import sys

    from flashtile.kernels import cache

    args = "cache.BuilderRef('bwd_preprocess.attention_bwd_preprocess'), None, dim_v=64, dtype='bfloat16', has_dlse=False, varlen=False"
    kernel = eval(f"cache.get({args})", {"cache": cache})
    probe = (
        "import sys; from flashtile.kernels import cache, launch\n"
        f"k = cache.get({args})\n"
        "print(type(k).__name__, 'flashtile.kernels.bwd_preprocess' in sys.modules, 'tilelang' in sys.modules,"
        " len(k.get_kernel_source()))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["IndexedKernel", "False", "False", str(len(kernel.get_kernel_source()))], out


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_a_packed_launch_needs_no_tilelang():
    """A packed (varlen) batch's host side, like a dense one's, runs without TileLang: its
    kernels load by id and the backward's statistics layout (``packed_stats``) is TileLang-free
    (``seqinfo``, the kernels' side, imports it)."""
    import subprocess
    import sys

    from flashtile.kernels import cache

    args = "cache.BuilderRef('bwd_preprocess.attention_bwd_preprocess'), None, dim_v=64, dtype='bfloat16', has_dlse=False, varlen=True"
    eval(f"cache.get({args})", {"cache": cache})
    probe = (
        "import sys; from flashtile.kernels import cache, launch, packed_stats\n"
        f"k = cache.get({args})\n"
        "st = launch._backward_structures(64, 64, 'bfloat16', False, False, False, 'causal', True)\n"
        "print(type(k).__name__, packed_stats.stat_rows(1000, 3), st[3].block_m <= packed_stats.STAT_PAD,"
        " 'tilelang' in sys.modules, 'flashtile.kernels.seqinfo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["IndexedKernel", str((1000 + 132 * 4 + 3) // 4 * 4), "True", "False", "False"], out
