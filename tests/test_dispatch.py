"""Which CUDA calls the kernel registry accepts, checked without a GPU.

``flashtile.kernels.unsupported_reason`` only reads dtypes, shapes and the device capability, so
the capability query is patched and CPU tensors stand in for CUDA ones.
"""

import pytest
import torch

from flashtile import kernels


@pytest.fixture(autouse=True)
def fresh_capability_cache():
    """The registry caches the capability per device; each test patches its own."""
    kernels._capability.cache_clear()
    yield
    kernels._capability.cache_clear()


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")


def _qkv(d=128, dv=128, dtype=torch.bfloat16, b=1, s=8, h=2):
    # Expanded views: the shapes are what matters, no memory is allocated for big cases.
    q = torch.empty(1, 1, 1, d, dtype=dtype).expand(b, s, h, d)
    k = torch.empty(1, 1, 1, d, dtype=dtype).expand(b, s, h, d)
    v = torch.empty(1, 1, 1, dv, dtype=dtype).expand(b, s, h, dv)
    return q, k, v


@pytest.mark.parametrize(
    "d,dv", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256), (80, 80), (112, 48), (40, 40), (72, 72), (128, 100), (1, 256)]
)
def test_hopper_half_precision_is_supported(hopper, d, dv):
    for dtype in (torch.float16, torch.bfloat16):
        assert kernels.unsupported_reason(*_qkv(d, dv, dtype)) is None


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(dtype=torch.float32), "dtype torch.float32"),
        (dict(dtype=torch.float64), "dtype torch.float64"),
        (dict(d=288, dv=288), "headdim=288"),
        (dict(d=128, dv=264), "headdim_v=264"),
        (dict(b=1 << 12, s=1 << 12, h=1 << 4), "2^31"),
    ],
)
def test_unsupported_cases_name_the_reason(hopper, kwargs, needle):
    reason = kernels.unsupported_reason(*_qkv(**kwargs))
    assert reason is not None and needle in reason, reason


def test_non_hopper_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    reason = kernels.unsupported_reason(*_qkv())
    assert "A100" in reason and "sm_80" in reason, reason


def test_require_raises_not_implemented(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(NotImplementedError, match="no CUDA kernel for dtype torch.float32"):
        kernels._require(*_qkv(dtype=torch.float32))


@pytest.mark.parametrize(
    "dim,fwd,bwd", [(1, 16, 32), (16, 16, 32), (40, 48, 64), (72, 80, 96), (80, 80, 96), (100, 112, 128), (250, 256, 256), (256, 256, 256)]
)
def test_kernel_headdim_is_the_next_multiple_the_pass_builds(dim, fwd, bwd):
    from flashtile.kernels import configs

    assert (configs.kernel_headdim(dim, "fwd"), configs.kernel_headdim(dim, "bwd")) == (fwd, bwd)


@pytest.mark.parametrize("d,dv,causal", [(40, 40, True), (72, 100, False), (24, 8, True)])
def test_zero_padded_head_dims_change_nothing(d, dv, causal):
    """The launcher runs other head dims on zero-padded copies (``kernels._pad_headdim``) and
    cuts the padding off: exact for out, lse and every gradient (checked on the reference)."""
    from flashtile import reference
    from flashtile.kernels import configs

    torch.manual_seed(0)
    q, k = torch.randn(2, 33, 4, d, dtype=torch.float64), torch.randn(2, 47, 2, d, dtype=torch.float64)
    v, dout = torch.randn(2, 47, 2, dv, dtype=torch.float64), torch.randn(2, 33, 4, dv, dtype=torch.float64)
    scale, window = d**-0.5, ((-1, 0) if causal else (-1, -1))
    dp, dvp = configs.kernel_headdims(d, dv, "bwd")
    pad = kernels._pad_headdim
    out, lse = reference.attention_forward(q, k, v, scale, window)
    out_p, lse_p = reference.attention_forward(pad(q, dp), pad(k, dp), pad(v, dvp), scale, window)
    torch.testing.assert_close(out_p[..., :dv], out, msg="padded out differs")
    torch.testing.assert_close(out_p[..., dv:], torch.zeros_like(out_p[..., dv:]), msg="padded out columns not zero")
    torch.testing.assert_close(lse_p, lse, msg="padded lse differs")
    grads = reference.attention_backward(dout, q, k, v, out, lse, scale, window)
    grads_p = reference.attention_backward(pad(dout, dvp), pad(q, dp), pad(k, dp), pad(v, dvp), out_p, lse_p, scale, window)
    for name, g, gp, n in zip(("dq", "dk", "dv"), grads, grads_p, (d, d, dv)):
        torch.testing.assert_close(gp[..., :n], g, msg=f"padded {name} differs")
