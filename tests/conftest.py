"""Shared test setup: the ``gpu`` marker skips without CUDA; every test starts from a fixed seed."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    """Reproducible inputs: torch's global generator is reseeded before every test."""
    torch.manual_seed(0)
    yield


@pytest.fixture
def gen():
    """A private CPU generator, seeded, for tests that draw many tensors."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="module")
def one_thread():
    """Modules of tiny problems: one intra-op thread (two threads on a busy 2-core CI box wait
    ~10 ms per op); restored afterwards for the other modules.  Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
