"""Test setup: on a machine without CUDA, Triton's interpreter is switched on before Triton is
imported, so CPU tensors run the Triton kernels' code (DESIGN.md). GPU tests carry
``@pytest.mark.cuda`` and skip cleanly without a GPU."""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where kernel tests run: the GPU when there is one, else the CPU under Triton's interpreter."""
    return "cuda" if HAS_CUDA else "cpu"
