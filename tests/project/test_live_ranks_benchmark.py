"""benchmarks/live_ranks.py starts real ipykernels on unix sockets in a temporary folder of its own;
closing one leaves nothing there (seven empty folders stayed in /tmp after every run)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "live_ranks.py"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))      # the benchmark puts its folder first: undone after
    spec = importlib.util.spec_from_file_location("live_ranks_bench", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_a_closed_kernel_leaves_no_folder_behind(bench):
    kernel = bench._Kernel().ready()
    folder = kernel.folder
    try:
        assert kernel.run("x = 1 + 1") == "ok"
        assert os.listdir(folder)                   # the kernel's sockets
    finally:
        kernel.close()
    assert not os.path.exists(folder)
