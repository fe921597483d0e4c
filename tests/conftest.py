import os

import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter. Must be set before any kernel module
    # is imported: triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core box torch's OpenMP threads spin-wait under outside load
    (10x slower); tests that check numbers, not speed, pin it. Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
