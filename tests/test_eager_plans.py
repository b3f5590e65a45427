"""``flashtile.eager_plans``: repeated eager inference calls of ``flash_attn_func`` run a recorded
plan (recorded on a key's second call), and give what the general path gives; every other call
takes the general path.

Plans are recorded for CUDA tensors only.  Here they are recorded for CPU tensors
(``planned_device`` answers True) with a Python kernel in place of the compiled one
(``launch.forward_launch`` returns it): it checks the arguments the plan passes (contiguous,
16-byte aligned, the recorded scalars) and writes the reference's out and lse, so a planned
call must equal the general path's call on the same inputs bitwise.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile import eager_plans, ops, reference
from flashtile.kernels import configs, launch

BF16 = torch.bfloat16


@pytest.fixture
def planned(monkeypatch):
    """Plans recorded for CPU tensors; returns the counts of kernel launches and general-path calls."""
    counts = {"kernel": 0, "general": 0}
    monkeypatch.setattr(eager_plans, "PLANS", {})
    monkeypatch.setattr(eager_plans, "planned_device", lambda q: True)

    def forward_launch(q, k, v, has_sinks, softmax_scale, window, softcap, varlen, out_dtype, fp8, share_sms):
        assert not (varlen or fp8 or share_sms), "the plans cover dense 16-bit forwards only"

        def kernel(q, k, v, out, lse, sinks32, *scalars):
            for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
                assert x.is_contiguous() and x.data_ptr() % 16 == 0, f"{name} reached the kernel unprepared"
            assert scalars == recorded, f"scalars {scalars} differ from the recorded {recorded}"
            counts["kernel"] += 1
            o, l = reference.attention_forward(q, k, v, softmax_scale, window, sinks32 if has_sinks else None, softcap)
            out.copy_(o)
            lse.copy_(l)

        recorded = (softmax_scale, window, softcap)
        return kernel, recorded

    attention = ops.attention

    def general(*args, **kwargs):
        counts["general"] += 1
        return attention(*args, **kwargs)

    monkeypatch.setattr(launch, "forward_launch", forward_launch)
    monkeypatch.setattr(ops, "attention", general)
    return counts


def _qkv(sq=33, sk=17, h=4, hkv=2, d=64, dv=64, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, sq, h, d, generator=g, dtype=dtype), torch.randn(2, sk, hkv, d, generator=g, dtype=dtype),
            torch.randn(2, sk, hkv, dv, generator=g, dtype=dtype))


def _equal(name, got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape}/{got.dtype} vs {want.shape}/{want.dtype}"
    assert torch.equal(got, want), f"{name}: the planned call differs from the general path's"


OPTIONS = [
    dict(),
    dict(causal=True),
    dict(window_size=(5, 3)),
    dict(softcap=30.0, softmax_scale=0.1),
    dict(causal=True, return_lse=True),
    dict(return_attn_probs=True, softmax_scale=1),
    dict(sinks="sinks"),
]


def _record(q, k, v, **options):
    """A key's first two calls: the general path, the second recording the plan."""
    for _ in range(2):
        out = flashtile.flash_attn_func(q, k, v, **options)
    return out


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "defaults")
def test_the_third_call_runs_the_plan_and_matches(planned, options):
    q, k, v = _qkv()
    if options.get("sinks") == "sinks":
        options = dict(options, sinks=torch.randn(q.shape[2]))
    first = flashtile.flash_attn_func(q, k, v, **options)
    assert list(eager_plans.PLANS.values()) == [eager_plans.SEEN], "a key's first call should only mark it"
    flashtile.flash_attn_func(q, k, v, **options)
    assert planned == {"kernel": 0, "general": 2}, f"first two calls: {planned}"
    assert isinstance(next(iter(eager_plans.PLANS.values())), eager_plans.ForwardPlan), "the second call records"
    q2, k2, v2 = _qkv(seed=1)  # fresh inputs with the same key
    got = flashtile.flash_attn_func(q2, k2, v2, **options)
    assert planned == {"kernel": 1, "general": 2}, f"third call should run the plan: {planned}"
    eager_plans.PLANS.clear()
    want = flashtile.flash_attn_func(q2, k2, v2, **options)
    assert planned["general"] == 3, "a cleared plan should send the call to the general path"
    for i, (g, w) in enumerate(zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want)))):
        if w is None:
            assert g is None, "return_attn_probs' third value must be None"
        else:
            _equal(f"output {i}", g, w)
    assert type(first) is type(got)


def test_a_plan_prepares_views_as_the_general_path_does(planned):
    q, k, v = _qkv()
    _record(q, k, v, causal=True)
    # Same key, three kinds of views: transposed storage (SDPA's layout), a 2-byte offset
    # (misaligned for TMA), and a plain contiguous tensor.
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    ks = torch.empty(k.numel() + 1, dtype=BF16)[1:].view(k.shape).copy_(k)
    assert not qt.is_contiguous() and ks.data_ptr() % 16
    got = flashtile.flash_attn_func(qt, ks, v, causal=True)
    assert planned["kernel"] == 1, "views with the same key should run the plan"
    _equal("out", got, flashtile.flash_attn_func(q, k, v, causal=True))


# (an accepted call, its twin with equal key values that validation refuses or accepts unplanned,
# the twin's error): ``1 == True`` and ``-1.0 == -1`` as dict keys, so only exact types in the key
# keep a twin from meeting the accepted call's plan.
TWINS = [
    (dict(causal=True), dict(causal=1), TypeError),
    (dict(deterministic=False), dict(deterministic=0), TypeError),
    (dict(return_lse=True), dict(return_lse=1), TypeError),
    (dict(window_size=(-1, -1)), dict(window_size=(-1.0, -1.0)), TypeError),
    (dict(window_size=(-1, -1)), dict(window_size=[-1, -1]), None),  # a list is accepted, never planned
    (dict(softmax_scale=1.0), dict(softmax_scale=True), TypeError),
    (dict(softcap=0.0), dict(softcap=False), TypeError),
    (dict(dropout_p=0.0), dict(dropout_p=False), TypeError),
    (dict(), dict(dropout_p=0.1), NotImplementedError),
    (dict(), dict(softmax_scale=float("nan")), ValueError),
]


@pytest.mark.parametrize("good, twin, error", TWINS, ids=lambda x: str(x))
def test_validation_still_runs_for_keys_no_call_was_accepted_with(planned, good, twin, error):
    q, k, v = _qkv()
    _record(q, k, v, **good)
    if error is None:
        flashtile.flash_attn_func(q, k, v, **twin)
        assert planned["kernel"] == 0 and planned["general"] == 3, f"{twin} should take the general path: {planned}"
    else:
        with pytest.raises(error):
            flashtile.flash_attn_func(q, k, v, **twin)
        assert planned["kernel"] == 0, f"{twin} reached the kernel"


def test_calls_autograd_records_take_the_general_path(planned):
    q, k, v = _qkv()
    _record(q, k, v)
    q.requires_grad_(True)
    out = flashtile.flash_attn_func(q, k, v)
    assert out.grad_fn is not None and planned["kernel"] == 0, "a call requiring grad ran the plan"
    with torch.no_grad():
        flashtile.flash_attn_func(q, k, v)
    assert planned["kernel"] == 1, "under no_grad the same key should run the plan"


def test_overrides_send_calls_to_the_general_path(planned, monkeypatch):
    q, k, v = _qkv()
    _record(q, k, v)
    monkeypatch.setitem(configs.overrides, "fwd", object())
    flashtile.flash_attn_func(q, k, v)
    assert planned == {"kernel": 0, "general": 3}, f"an override should bypass the plan: {planned}"


@pytest.mark.parametrize("shape", [
    dict(d=40, dv=40),  # head dims the kernels pad
    dict(sk=0),  # nothing to attend to
    dict(sq=0),  # empty output
], ids=str)
def test_shapes_outside_the_domain_keep_the_general_path(planned, shape):
    q, k, v = _qkv(**shape)
    for _ in range(2):
        flashtile.flash_attn_func(q, k, v)
    assert planned == {"kernel": 0, "general": 2}, f"{shape}: {planned}"
    assert list(eager_plans.PLANS.values()) == [eager_plans.NO_PLAN], "the key should be marked as never planned"


def test_float32_keeps_the_general_path(planned):
    q, k, v = _qkv(dtype=torch.float32)
    for _ in range(2):
        flashtile.flash_attn_func(q, k, v)
    assert planned == {"kernel": 0, "general": 2}, f"float32 has no kernel: {planned}"


def test_compile_traces_past_a_recorded_plan(planned):
    q, k, v = _qkv()
    _record(q, k, v, causal=True)  # the plan exists
    compiled = torch.compile(lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True), fullgraph=True,
                             backend="eager")
    got = compiled(q, k, v)
    assert planned["kernel"] == 0, "a traced call ran the eager plan"
    _equal("out", got, flashtile.flash_attn_func(q, k, v, causal=True))


def test_shapes_that_never_repeat_record_no_plan(planned, monkeypatch):
    """A key length growing by one per call (a decode loop through flash_attn_func): every key
    is met once, so nothing is recorded (``launch.forward_launch`` never asked)."""
    asked = []
    monkeypatch.setattr(launch, "forward_launch", lambda *a: asked.append(a))
    q = _qkv(sq=1)[0]
    for sk in range(1, 6):
        k, v = _qkv(sk=sk)[1:]
        flashtile.flash_attn_func(q, k, v, causal=True)
    assert not asked and planned == {"kernel": 0, "general": 5}, f"{len(asked)} recordings, {planned}"
    assert set(map(id, eager_plans.PLANS.values())) == {id(eager_plans.SEEN)}, "every key should be SEEN only"
