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


# --- flashtile.validation, the shared checks (issue 23) -----------------------------------------

from flashtile import validation as V  # noqa: E402


def test_fail_message_format():
    with pytest.raises(ValueError, match=r"^f: x must be big, got 3$"):
        V.fail("f", ValueError, "x", "big", 3)


@pytest.mark.parametrize("value", [True, False])
def test_check_flag_accepts_bools(value):
    V.check_flag("f", "causal", value)


@pytest.mark.parametrize(
    "value,shown",
    [("no", "str 'no'"), (1, "int 1"), (0, "int 0"), (None, "None"), (1.0, "float 1.0"),
     (torch.tensor(True), "a Tensor of shape ()")],
)
def test_check_flag_refuses_everything_else(value, shown):
    with pytest.raises(TypeError) as info:
        V.check_flag("fn", "deterministic", value)
    msg = str(info.value)
    assert msg.startswith("fn: deterministic must be a bool") and f"got {shown}" in msg, msg


def test_check_flag_refuses_numpy_bool():
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"got numpy\.bool"):
        V.check_flag("fn", "causal", np.bool_(True))


@pytest.mark.parametrize("value", [None, 0.5, 1, 1e-3, -2.0])
def test_check_scale_accepts(value):
    V.check_scale("f", "softmax_scale", value)


@pytest.mark.parametrize(
    "value,exc,shown",
    [
        (torch.tensor(0.5), TypeError, "a Tensor of shape () and dtype torch.float32"),
        (torch.ones(1000), TypeError, "a Tensor of shape (1000,)"),
        ("0.5", TypeError, "str '0.5'"),
        (True, TypeError, "bool True"),
        (float("nan"), ValueError, "nan"),
        (float("-inf"), ValueError, "-inf"),
    ],
)
def test_check_scale_refuses(value, exc, shown):
    with pytest.raises(exc) as info:
        V.check_scale("f", "softmax_scale", value)
    assert "softmax_scale must be None or a finite real number" in str(info.value)
    assert f"got {shown}" in str(info.value)
    assert "1., 1., 1." not in str(info.value)  # a tensor's data is never printed


def test_check_softcap():
    V.check_softcap("f", 0.0)
    V.check_softcap("f", 30)
    with pytest.raises(TypeError, match=r"softcap must be a real number.*got a Tensor"):
        V.check_softcap("f", torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"got bool"):
        V.check_softcap("f", True)
    with pytest.raises(ValueError, match=r"softcap must be a finite float >= 0"):
        V.check_softcap("f", -0.5)


def test_check_window():
    for w in [(-1, -1), (0, 0), [3, -1], (128, 0)]:
        V.check_window("f", w)
    for w, exc in [((1,), TypeError), ((1, 2, 3), TypeError), ((True, 0), TypeError), ((1.0, 2), TypeError),
                   ("10", TypeError), (None, TypeError), ((-2, 0), ValueError), ((0, -7), ValueError)]:
        with pytest.raises(exc, match=r"f: window_size"):
            V.check_window("f", w)


def test_check_sinks():
    V.check_sinks("f", None, 4, torch.device("cpu"))
    V.check_sinks("f", torch.zeros(4, dtype=torch.bfloat16), 4, torch.device("cpu"))
    for sinks, exc, pat in [
        ([0.0] * 4, TypeError, r"sinks must be None or a torch.Tensor, got list"),
        (torch.zeros(2), ValueError, r"sinks must be shape \(nheads,\) = \(4,\), got shape \(2,\)"),
        (torch.zeros(4, dtype=torch.int64), TypeError, r"sinks.dtype must be a floating dtype"),
        (torch.zeros(4, device="meta"), ValueError, r"sinks.device"),
    ]:
        with pytest.raises(exc, match=pat):
            V.check_sinks("f", sinks, 4, torch.device("cpu"))


def test_reject_unsupported():
    V.reject_unsupported("f")
    V.reject_unsupported("f", 0.0, None)
    V.reject_unsupported("f", 0, None)
    V.reject_unsupported("f", None, None)
    with pytest.raises(NotImplementedError, match=r"^f: dropout_p=0.1 is not supported"):
        V.reject_unsupported("f", 0.1)
    with pytest.raises(TypeError, match=r"dropout_p"):
        V.reject_unsupported("f", "0.0")
    with pytest.raises(NotImplementedError, match=r"^f: alibi_slopes is not supported \(got a Tensor of shape \(4,\)"):
        V.reject_unsupported("f", 0.0, torch.ones(4))


def test_check_tensor():
    V.check_tensor("f", "q", torch.zeros(1, 1, 1, 1), 4, "(b, s, h, d)", (torch.float32,))
    with pytest.raises(ValueError, match=r"f: q must be a 4-D tensor \(b, s, h, d\), got shape \(1, 1\)"):
        V.check_tensor("f", "q", torch.zeros(1, 1), 4, "(b, s, h, d)", (torch.float32,))
    with pytest.raises(TypeError, match=r"q.dtype must be one of float32, got torch.float16"):
        V.check_tensor("f", "q", torch.zeros(1, 1, 1, 1, dtype=torch.float16), 4, "(b, s, h, d)", (torch.float32,))


def test_interface_names_still_exported():
    from flashtile.interface import normalize_window, validate

    assert normalize_window(True, (3, 5)) == (3, 0) and normalize_window(False, [2, -1]) == (2, -1)
    q, k, v = good()
    validate(q, k, v, None, (-1, -1), None, 0.0)
    with pytest.raises(ValueError, match=r"^my_fn: window_size left"):
        validate(q, k, v, None, (-2, 0), None, 0.0, fn="my_fn")
