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
