"""``flashtile.eager_plans`` on the GPU (marker ``gpu``): a planned ``flash_attn_func`` call gives
bitwise what the general path gives on the same inputs (the forward kernels are deterministic),
for the options and views a model passes; keys outside the plans' domain keep the general path.

Each case first clears the plans and calls twice through the general path (the second call
records the plan), then calls again on the same inputs and checks that the plan ran (``ops.attention``, the general
path's entry, not called) and that out and lse are equal.  Head dims and features are those
``benchmarks/kernel_cache.sh fill`` builds, so a carried kernel cache makes this file fast.

One command: ``python -m pytest -q -m gpu tests/test_gpu_eager_plans.py``.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile import eager_plans, ops

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


@pytest.fixture
def general_calls(monkeypatch):
    """The number of calls that took the general path (``ops.attention``)."""
    calls = [0]
    attention = ops.attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return attention(*args, **kwargs)

    monkeypatch.setattr(ops, "attention", counted)
    monkeypatch.setattr(eager_plans, "PLANS", {})
    return calls


def _qkv(b=2, sq=257, sk=300, h=8, hkv=2, d=128, dv=None):
    q = torch.randn(b, sq, h, d, device="cuda", dtype=BF16)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=BF16)
    v = torch.randn(b, sk, hkv, dv or d, device="cuda", dtype=BF16)
    return q, k, v


def _thrice(general_calls, q, k, v, **options):
    """(the general path's result, the plan's result) of one call on the same inputs: the first
    two calls take the general path (the second records the plan), the third runs the plan."""
    want = flashtile.flash_attn_func(q, k, v, return_lse=True, **options)
    flashtile.flash_attn_func(q, k, v, return_lse=True, **options)
    assert general_calls[0] == 2, "a key's first two calls should take the general path"
    got = flashtile.flash_attn_func(q, k, v, return_lse=True, **options)
    assert general_calls[0] == 2, f"the third call should run its plan: {options}"
    return want, got


def _equal(want, got, what):
    for name, w, g in zip(("out", "lse"), want, got):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous(), f"{what}: {name} {g.shape}/{g.dtype}"
        assert torch.equal(g, w), f"{what}: the planned {name} differs from the general path's " \
            f"(max |diff| {(g.float() - w.float()).abs().max().item():.3e})"


CASES = [
    dict(d=128),
    dict(d=128, causal=True),
    dict(d=64, causal=True, sq=1000, sk=1000),  # d = 64's short row (both lengths <= 1024)
    dict(d=64, sq=1500, sk=1300),  # and its long row
    dict(d=128, window_size=(100, 7)),
    dict(d=128, softcap=30.0, softmax_scale=0.05),
    dict(d=64, sinks=True, causal=True),
    dict(d=128, sq=1, sk=700, causal=True),  # a single query row
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_planned_call_equals_the_general_path(general_calls, case):
    case = dict(case)
    shape = {name: case.pop(name) for name in ("d", "sq", "sk") if name in case}
    q, k, v = _qkv(**shape)
    if case.pop("sinks", False):
        case["sinks"] = torch.randn(q.shape[2], device="cuda")
    _equal(*_thrice(general_calls, q, k, v, **case), case)


def test_views_are_prepared_per_call(general_calls):
    """SDPA's layout (transposed storage) and a misaligned view: the plan copies them as the
    general path does."""
    q, k, v = _qkv()
    want = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)  # records the plan
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    kb = torch.empty(k.numel() + 4, device="cuda", dtype=BF16)[4:].view(k.shape).copy_(k)  # 8 bytes off
    assert not qt.is_contiguous() and kb.data_ptr() % 16
    got = flashtile.flash_attn_func(qt, kb, v, causal=True, return_lse=True)
    assert general_calls[0] == 2, "views with the plan's key should run it"
    _equal(want, got, "views")


def test_grad_and_padded_head_dims_keep_the_general_path(general_calls):
    q, k, v = _qkv(d=40)  # padded to the kernels' head dim: never planned
    for _ in range(3):
        flashtile.flash_attn_func(q, k, v)
    assert general_calls[0] == 3, "a padded head dim should keep the general path"
    q, k, v = _qkv()
    for _ in range(2):
        flashtile.flash_attn_func(q, k, v)  # the second call records the plan
    out = flashtile.flash_attn_func(q.requires_grad_(), k, v)
    assert general_calls[0] == 6 and out.grad_fn is not None, "a call requiring grad should be recorded by autograd"
