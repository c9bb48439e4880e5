"""What a benchmark puts in a temporary folder goes when it is done: live_ranks.py's kernels (their
sockets; seven empty folders stayed in /tmp after every run) and overlap.py's profiles (1.7 MB a run)."""

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str, monkeypatch):
    """``benchmarks/<name>.py`` as a module (live_ranks.py puts its folder first on sys.path: undone
    after the test)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_a_closed_kernel_leaves_no_folder_behind(monkeypatch):
    kernel = load("live_ranks", monkeypatch)._Kernel().ready()
    folder = kernel.folder
    try:
        assert kernel.run("x = 1 + 1") == "ok"
        assert os.listdir(folder)                   # the kernel's sockets
    finally:
        kernel.close()
    assert not os.path.exists(folder)


@pytest.mark.timeout(180)
def test_the_overlap_benchmark_leaves_no_profiles_behind(monkeypatch, tmp_path, capsys):
    overlap = load("overlap", monkeypatch)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    overlap.main(["--width", "32", "--batch", "4"])             # 4 profiles of 2 ranks (1.7 MB at full size)
    assert "hidden under backward" in capsys.readouterr().out
    assert list(tmp_path.glob("overlap_*")) == []          # (torch may keep its own caches there)
