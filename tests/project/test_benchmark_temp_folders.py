"""What a benchmark puts in a temporary folder goes when it is done: live_ranks.py's kernels (their
sockets; seven empty folders stayed in /tmp after every run) and overlap.py's profiles (1.7 MB a run)."""

import importlib.util
import os
import sys
import tempfile
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


@pytest.mark.timeout(180)
def test_the_overlap_benchmark_leaves_no_profiles_behind(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.syspath_prepend(str(PATH.parent))
    spec = importlib.util.spec_from_file_location("overlap_bench", PATH.parent / "overlap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    module.main(["--width", "32", "--batch", "4"])              # 4 profiles of 2 ranks (1.7 MB at full size)
    assert "hidden under backward" in capsys.readouterr().out
    assert list(tmp_path.glob("overlap_*")) == []          # (torch may keep its own caches there)
