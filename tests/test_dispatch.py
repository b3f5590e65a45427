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


@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256), (80, 80), (112, 48)])
def test_hopper_half_precision_is_supported(hopper, d, dv):
    for dtype in (torch.float16, torch.bfloat16):
        assert kernels.unsupported_reason(*_qkv(d, dv, dtype)) is None


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(dtype=torch.float32), "dtype torch.float32"),
        (dict(dtype=torch.float64), "dtype torch.float64"),
        (dict(d=72, dv=72), "headdim=72"),
        (dict(d=128, dv=100), "headdim_v=100"),
        (dict(d=288, dv=288), "headdim=288"),
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
