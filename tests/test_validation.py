"""Bad input is refused before any work with a ValueError/TypeError naming the argument
(design.md, "Bad input is refused ...")."""

from __future__ import annotations

import re

import pytest
import torch

import flashtile
from flashtile import flash_attn_func


def t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, device=device).to(dtype) if dtype.is_floating_point else torch.zeros(*shape, dtype=dtype, device=device)


def good():
    """q, k, v of a valid GQA call: batch 2, seqlen_q 3, seqlen_k 5, 4:2 heads, d 8, dv 6."""
    return t(2, 3, 4, 8), t(2, 5, 2, 8), t(2, 5, 2, 6)


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Validation must happen before any work: the op layer must never be reached."""

    def refuse(*args, **kwargs):
        raise AssertionError("flashtile.ops.attention was called for invalid input")

    monkeypatch.setattr(flashtile.interface.ops, "attention", refuse)


def call(q=None, k=None, v=None, **kw):
    gq, gk, gv = good()
    return flash_attn_func(gq if q is None else q, gk if k is None else k, gv if v is None else v, **kw)


# (id, kwargs for call(), exception type, regex the message must contain)
CASES = [
    # rank
    ("q-rank-3", dict(q=t(2, 3, 8)), ValueError, r"\bq\b.*4-D"),
    ("k-rank-5", dict(k=t(2, 5, 2, 8, 1)), ValueError, r"\bk\b.*4-D"),
    ("v-rank-2", dict(v=t(10, 6)), ValueError, r"\bv\b.*4-D"),
    ("q-not-tensor", dict(q=[[1.0]]), TypeError, r"\bq\b.*Tensor"),
    # shapes
    ("batch-k", dict(k=t(3, 5, 2, 8)), ValueError, r"batch"),
    ("batch-v", dict(v=t(1, 5, 2, 6)), ValueError, r"batch"),
    ("seqlen-k-vs-v", dict(v=t(2, 4, 2, 6)), ValueError, r"seqlen_k"),
    ("nheads-kv-k-vs-v", dict(v=t(2, 5, 1, 6)), ValueError, r"nheads_kv"),
    ("headdim-q-vs-k", dict(k=t(2, 5, 2, 16)), ValueError, r"headdim"),
    ("nheads-not-multiple", dict(q=t(2, 3, 3, 8)), ValueError, r"nheads.*multiple.*nheads_kv"),
    ("nheads-kv-zero", dict(k=t(2, 5, 0, 8), v=t(2, 5, 0, 6)), ValueError, r"nheads_kv"),
    ("headdim-zero", dict(q=t(2, 3, 4, 0), k=t(2, 5, 2, 0)), ValueError, r"headdim"),
    ("headdim-257", dict(q=t(2, 3, 4, 257), k=t(2, 5, 2, 257)), ValueError, r"headdim"),
    ("headdim-v-0", dict(v=t(2, 5, 2, 0)), ValueError, r"headdim_v"),
    ("headdim-v-300", dict(v=t(2, 5, 2, 300)), ValueError, r"headdim_v"),
    # dtypes
    ("dtype-int32", dict(q=t(2, 3, 4, 8, dtype=torch.int32)), TypeError, r"q\.dtype"),
    ("dtype-int64-v", dict(v=t(2, 5, 2, 6, dtype=torch.int64)), TypeError, r"v\.dtype"),
    ("dtype-bool-k", dict(k=t(2, 5, 2, 8, dtype=torch.bool)), TypeError, r"k\.dtype"),
    ("dtype-mismatch", dict(k=t(2, 5, 2, 8, dtype=torch.float64)), TypeError, r"dtype"),
    # devices ('meta' stands in for a second device)
    ("device-k", dict(k=t(2, 5, 2, 8, device="meta")), ValueError, r"device"),
    ("device-v", dict(v=t(2, 5, 2, 6, device="meta")), ValueError, r"device"),
    ("device-sinks", dict(sinks=t(4, device="meta")), ValueError, r"sinks.*device|device.*sinks"),
    # window
    ("window-left-minus-2", dict(window_size=(-2, 0)), ValueError, r"window_size.*left"),
    ("window-right-minus-5", dict(window_size=(3, -5)), ValueError, r"window_size.*right"),
    ("window-not-pair", dict(window_size=(1, 2, 3)), TypeError, r"window_size"),
    ("window-float", dict(window_size=(1.5, 2)), TypeError, r"window_size"),
    # softcap
    ("softcap-negative", dict(softcap=-1.0), ValueError, r"softcap"),
    ("softcap-nan", dict(softcap=float("nan")), ValueError, r"softcap"),
    ("softcap-inf", dict(softcap=float("inf")), ValueError, r"softcap"),
    # sinks
    ("sinks-shape-kv-heads", dict(sinks=t(2)), ValueError, r"sinks.*shape"),
    ("sinks-shape-2d", dict(sinks=t(1, 4)), ValueError, r"sinks.*shape"),
    ("sinks-int", dict(sinks=t(4, dtype=torch.int32)), TypeError, r"sinks\.dtype"),
    ("sinks-list", dict(sinks=[0.0] * 4), TypeError, r"sinks"),
    # softmax_scale
    ("scale-str", dict(softmax_scale="0.5"), TypeError, r"softmax_scale"),
    ("scale-tensor", dict(softmax_scale=torch.tensor([0.5, 0.5])), TypeError, r"softmax_scale"),
    ("scale-nan", dict(softmax_scale=float("nan")), ValueError, r"softmax_scale"),
]


@pytest.mark.parametrize("kwargs,exc,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_the_argument(kwargs, exc, pattern):
    with pytest.raises(exc) as info:
        call(**kwargs)
    msg = str(info.value)
    assert re.search(pattern, msg), f"message {msg!r} does not match {pattern!r}"
    # "what was expected and what was given"
    assert "must be" in msg and "got" in msg, f"message {msg!r} lacks expectation or given value"


def test_message_shows_the_given_value():
    with pytest.raises(ValueError, match=r"-3"):
        call(window_size=(-3, 0))
    with pytest.raises(ValueError, match=r"\(2, 4\)|\[2, 4\]"):
        call(sinks=t(2, 4))
    with pytest.raises(ValueError, match=r"257"):
        call(q=t(2, 3, 4, 257), k=t(2, 5, 2, 257))
    with pytest.raises(ValueError, match=r"\b3\b"):
        call(q=t(2, 3, 3, 8))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(causal=True, window_size=(-1, -1)),
        dict(window_size=(0, 0)),
        dict(window_size=[4, 2]),
        dict(softcap=0),
        dict(softcap=30),
        dict(softmax_scale=1),
        dict(softmax_scale=0.125),
        dict(sinks=t(4, dtype=torch.bfloat16)),
        dict(sinks=t(4, dtype=torch.float64)),
    ],
    ids=lambda kw: ",".join(f"{k}={v if not isinstance(v, torch.Tensor) else v.dtype}" for k, v in kw.items()) or "defaults",
)
def test_valid_input_reaches_the_op(kwargs, monkeypatch):
    reached = []
    monkeypatch.setattr(flashtile.interface.ops, "attention", lambda *a: reached.append(a) or (None, None))
    call(**kwargs)
    assert len(reached) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_float_dtypes_accepted(dtype, monkeypatch):
    monkeypatch.setattr(flashtile.interface.ops, "attention", lambda *a: (None, None))
    call(q=t(2, 3, 4, 8, dtype=dtype), k=t(2, 5, 2, 8, dtype=dtype), v=t(2, 5, 2, 6, dtype=dtype))


def test_headdim_bounds_accepted(monkeypatch):
    monkeypatch.setattr(flashtile.interface.ops, "attention", lambda *a: (None, None))
    for d in (1, 256):
        call(q=t(1, 2, 2, d), k=t(1, 2, 1, d), v=t(1, 2, 1, d))
