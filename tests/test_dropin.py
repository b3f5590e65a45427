"""flash-attn call sites work unchanged (issue 23): flash-attn 2's positional order, its keyword
names, refusals of what flashtile does not implement, strict flag types; and the kernel cache
says when it builds (issue 19)."""

from __future__ import annotations

import inspect
import io
import logging
import math

import numpy as np
import pytest
import torch

import flashtile
from flashtile import flash_attn_func, reference
from flashtile.kernels import cache


def inputs(b=2, sq=5, sk=7, h=4, hkv=2, d=8, dv=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, sq, h, d, generator=g, dtype=dtype),
        torch.randn(b, sk, hkv, d, generator=g, dtype=dtype),
        torch.randn(b, sk, hkv, dv, generator=g, dtype=dtype),
    )


def ref(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, sinks=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    left, right = window
    if causal:
        right = 0
    return reference.attention_forward(q, k, v, scale, (left, right), sinks, softcap)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# --- flash-attn 2 signature ------------------------------------------------------------------

FA2_ORDER = [
    "q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
    "alibi_slopes", "deterministic", "return_attn_probs",
]


def test_positional_order_is_flash_attn_2s_and_extras_are_keyword_only():
    params = inspect.signature(flash_attn_func).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == FA2_ORDER
    fp8 = {"q_descale", "k_descale", "v_descale", "out_dtype"}  # flash-attn 3's FP8 keywords (tests/test_fp8.py)
    chunk = {"attention_chunk"}  # flash-attn 3's chunked attention (tests/test_chunked.py)
    assert {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} == {"sinks", "return_lse"} | fp8 | chunk
    assert params["dropout_p"].default == 0.0 and params["window_size"].default == (-1, -1)


def test_flash_attn_2_positional_call_site():
    q, k, v = inputs()
    # flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap)
    out = flash_attn_func(q, k, v, 0.0, 0.3, True, (3, -1), 2.0)
    close(out, ref(q, k, v, 0.3, True, (3, -1), 2.0)[0])
    # ..., alibi_slopes, deterministic, return_attn_probs
    out2, lse, s_dmask = flash_attn_func(q, k, v, 0.0, 0.3, True, (3, -1), 2.0, None, False, True)
    close(out2, out)
    close(lse, ref(q, k, v, 0.3, True, (3, -1), 2.0)[1])
    assert s_dmask is None


def test_flash_attn_2_keyword_call_site():
    q, k, v = inputs(sq=9, sk=9)
    out = flash_attn_func(
        q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1),
        softcap=0.0, alibi_slopes=None, deterministic=True, return_attn_probs=False,
    )
    close(out, ref(q, k, v, causal=True)[0])


def test_dropout_none_means_no_dropout_and_scale_keyword_works_as_in_flash_attn_3():
    q, k, v = inputs()
    close(flash_attn_func(q, k, v, None, causal=True), ref(q, k, v, causal=True)[0])
    close(flash_attn_func(q, k, v, softmax_scale=0.5, causal=True), ref(q, k, v, 0.5, True)[0])


def test_return_attn_probs_and_return_lse():
    q, k, v = inputs()
    s = torch.randn(4, dtype=torch.float64)
    want_out, want_lse = ref(q, k, v, sinks=s)
    out, lse = flash_attn_func(q, k, v, sinks=s, return_lse=True)
    close(out, want_out)
    close(lse, want_lse)
    res = flash_attn_func(q, k, v, return_attn_probs=True, sinks=s)
    assert isinstance(res, tuple) and len(res) == 3 and res[2] is None
    close(res[1], want_lse)


def test_gradients_flow_through_the_flash_attn_2_call():
    q, k, v = (t.requires_grad_() for t in inputs())
    out, lse, _ = flash_attn_func(q, k, v, 0.0, None, True, return_attn_probs=True)
    (out.sum() + lse.sum()).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_sinks_is_keyword_only():
    q, k, v = inputs()
    with pytest.raises(TypeError):
        flash_attn_func(q, k, v, 0.0, None, False, (-1, -1), 0.0, None, False, False, torch.zeros(4))


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.1, 1e-3, 1])
def test_nonzero_dropout_is_refused_naming_dropout_p(p):
    q, k, v = inputs()
    with pytest.raises(NotImplementedError, match=r"dropout_p"):
        flash_attn_func(q, k, v, p)
    with pytest.raises(NotImplementedError, match=r"dropout_p"):
        flash_attn_func(q, k, v, dropout_p=p)


def test_flash_attn_3_positional_scale_is_refused_not_misread():
    """flash-attn 3 code ``flash_attn_func(q, k, v, scale, causal)``: the 4th positional is
    dropout_p here, so a scale there must fail loudly and say how to pass it."""
    q, k, v = inputs()
    with pytest.raises(NotImplementedError, match=r"softmax_scale=") as info:
        flash_attn_func(q, k, v, 0.125, True)
    assert "flash-attn 3" in str(info.value)
    # FA3 order with the default scale: (q, k, v, None, True) lands True in softmax_scale.
    with pytest.raises(TypeError, match=r"softmax_scale.*got bool"):
        flash_attn_func(q, k, v, None, True)


def test_dropout_of_the_wrong_type_is_a_type_error():
    q, k, v = inputs()
    with pytest.raises(TypeError, match=r"dropout_p.*got a Tensor"):
        flash_attn_func(q, k, v, torch.tensor(0.0))


def test_alibi_slopes_refused():
    q, k, v = inputs()
    with pytest.raises(NotImplementedError, match=r"alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(4))
    with pytest.raises(NotImplementedError, match=r"alibi_slopes"):
        flash_attn_func(q, k, v, 0.0, None, False, (-1, -1), 0.0, torch.ones(2, 4))


# --- strict flag and number types --------------------------------------------------------------


@pytest.mark.parametrize("flag", ["causal", "deterministic", "return_attn_probs", "return_lse"])
@pytest.mark.parametrize("value", ["no", "yes", 1, 0, None, np.bool_(True), torch.tensor(True)])
def test_flags_must_be_bool(flag, value):
    q, k, v = inputs()
    with pytest.raises(TypeError) as info:
        flash_attn_func(q, k, v, **{flag: value})
    msg = str(info.value)
    given = "None" if value is None else type(value).__name__
    assert f"{flag} must be a bool" in msg and given in msg.split(", got ")[1], msg


def test_tensor_scale_refused_naming_its_type_not_its_data():
    q, k, v = inputs()
    with pytest.raises(TypeError, match=r"softmax_scale.*got a Tensor of shape \(\) and dtype torch.float32"):
        flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.5))


def test_numpy_numbers_accepted():
    q, k, v = inputs()
    out = flash_attn_func(q, k, v, softmax_scale=np.float32(0.5), window_size=(np.int64(2), -1), softcap=np.float64(3.0))
    close(out, ref(q, k, v, float(np.float32(0.5)), False, (2, -1), 3.0)[0])


def test_compile_dynamic_traces_the_flash_attn_2_call_without_graph_break():
    q, k, v = inputs(dtype=torch.float32)
    fn = lambda q, k, v: flash_attn_func(q, k, v, 0.0, None, True, (4, -1), 0.0, None, False, True)  # noqa: E731
    compiled = torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)
    got, want = compiled(q, k, v), fn(q, k, v)
    assert got[2] is None
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)


# --- kernel build notice (issue 19) ------------------------------------------------------------


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(cache, "_kernels", {})
    monkeypatch.setattr(cache, "builds", type(cache.builds)())
    monkeypatch.delenv("FLASHTILE_QUIET", raising=False)


class _TTY(io.StringIO):
    def isatty(self):
        return True


def fake_fwd_kernel(**kw):
    return ("kernel", tuple(sorted(kw.items())))


def test_build_is_logged_once_and_announced(fresh_cache, monkeypatch, caplog):
    """A build still running after ANNOUNCE_AFTER_S prints one line (terminal or not: a log file
    shows why a job paused) saying what is built, how long it usually takes and how to build
    ahead; it ends with the seconds taken.  Both steps are logged; the second call hits memory."""
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(cache, "ANNOUNCE_AFTER_S", 0)
    with caplog.at_level(logging.INFO, logger="flashtile"):
        k1 = cache.get(fake_fwd_kernel, None, dtype=torch.bfloat16, headdim=128)
        k2 = cache.get(fake_fwd_kernel, None, dtype=torch.bfloat16, headdim=128)
    assert k1 is k2 and cache.total_builds() == 1
    text = err.getvalue()
    assert text.count("\n") == 1 and text.startswith("flashtile: compiling fake_fwd_kernel for dtype=bfloat16, headdim=128")
    assert "usually" in text and "python -m flashtile.kernels.precompile" in text and text.rstrip().endswith(" s")
    messages = [r.getMessage() for r in caplog.records if r.name == "flashtile"]
    assert len(messages) == 2 and "building fake_fwd_kernel" in messages[0] and "built" in messages[1]


def test_build_notice_only_for_slow_builds_and_silenced_by_env(fresh_cache, monkeypatch):
    import time as _time

    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    cache.get(fake_fwd_kernel, None, headdim=64)  # fast (a disk load): silent
    assert err.getvalue() == ""

    def slow_kernel(**kw):
        _time.sleep(0.3)
        return "slow"

    monkeypatch.setattr(cache, "ANNOUNCE_AFTER_S", 0.05)
    cache.get(slow_kernel, None, headdim=80)  # still building after 0.05 s: announced by the timer
    assert err.getvalue().startswith("flashtile: compiling slow_kernel") and err.getvalue().count("\n") == 1
    monkeypatch.setenv("FLASHTILE_QUIET", "1")
    quiet = io.StringIO()
    monkeypatch.setattr("sys.stderr", quiet)
    cache.get(slow_kernel, None, headdim=96)
    assert quiet.getvalue() == ""
    assert cache.total_builds() == 3


def test_prebuilt_bundle_installs_once_without_overwriting(monkeypatch, tmp_path):
    """The shipped bundle's entries land in TileLang's cache layout; an entry already there is
    kept; a marker makes later processes skip the unpacking."""
    import tarfile

    from flashtile.kernels import prebuilt

    plat = prebuilt._platform()
    src = tmp_path / "src" / plat / "kernels"
    for name, text in (("aaa", "new"), ("bbb", "new")):
        (src / name).mkdir(parents=True)
        (src / name / "manifest.json").write_text(text)
    bundle = tmp_path / "bundle.tar.xz"
    with tarfile.open(bundle, "w:xz") as tar:
        tar.add(src, arcname=f"{plat}/kernels")
    root = tmp_path / "cache" / "0.1.15"
    (root / plat / "kernels" / "aaa").mkdir(parents=True)
    (root / plat / "kernels" / "aaa" / "manifest.json").write_text("old")
    monkeypatch.setattr(prebuilt, "bundle_path", lambda: bundle)
    monkeypatch.setattr(prebuilt, "cache_root", lambda: root)
    monkeypatch.setattr(prebuilt, "_installed", False)
    assert prebuilt.install() == 1
    assert (root / plat / "kernels" / "aaa" / "manifest.json").read_text() == "old"
    assert (root / plat / "kernels" / "bbb" / "manifest.json").read_text() == "new"
    assert [p.name for p in root.iterdir() if p.name.startswith(".flashtile-unpack")] == []
    monkeypatch.setattr(prebuilt, "_installed", False)
    assert prebuilt.install() == 0  # the marker: done by an earlier process


def test_failed_build_is_not_cached(fresh_cache, monkeypatch):
    monkeypatch.setattr("sys.stderr", _TTY())

    def broken_kernel(**kw):
        raise RuntimeError("nvcc failed")

    with pytest.raises(RuntimeError, match="nvcc"):
        cache.get(broken_kernel, None, headdim=64)
    assert cache._kernels == {} and cache.total_builds() == 0


def test_public_names_unchanged():
    assert flashtile.flash_attn_func is flash_attn_func


def test_unusable_prebuilt_bundle_falls_back_to_compiling(fresh_cache, monkeypatch, caplog):
    """A cache directory that cannot take the bundle (read-only, full) or a damaged bundle is a
    warning, not a failed call: the kernel is built as without a bundle."""
    from flashtile.kernels import prebuilt

    def broken():
        raise PermissionError("read-only file system")

    monkeypatch.setattr(prebuilt, "install", broken)
    with caplog.at_level(logging.WARNING, logger="flashtile"):
        assert cache.get(fake_fwd_kernel, None, headdim=32)[0] == "kernel"
    assert any("prebuilt kernels not installed" in r.getMessage() for r in caplog.records)
