"""Shared test setup: GPU markers skip with a printed reason when CUDA (or enough GPUs) is absent."""

import os

import pytest
import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def pytest_collection_modifyitems(config, items):
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (run on an H200 with -m gpu)")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs; this machine has {ngpu}")
    for item in items:
        if "multigpu" in item.keywords and ngpu < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and ngpu < 1:
            item.add_marker(skip_gpu)


@pytest.fixture
def seed():
    """A fresh seed per test run (printed on failure through the test id), so inputs differ run to run."""
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    return s
