"""Shared test configuration: GPU-only tests skip cleanly on CPU machines."""

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs; this machine has {n_gpu}")
    for item in items:
        if "cuda" in item.keywords and n_gpu < 1:
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)
