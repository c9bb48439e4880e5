"""The root conftest.py starts an nbval kernel once more when the first dies before running any cell
(and shows why), and retries nothing else."""

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fake_start(deaths, error="Kernel died before replying to kernel_info"):
    calls = []

    def start(*args, stderr=None, **kwargs):
        calls.append(kwargs.get("kernel_name"))
        if len(calls) <= deaths:
            stderr.write(b"zmq.error.ZMQError: Address already in use\n")
            stderr.flush()
            raise RuntimeError(error)
        return "manager", "client"
    return start, calls


def _wrapped(monkeypatch, start):
    from nbval import kernel

    monkeypatch.setattr(kernel, "start_new_kernel", start)     # restored after the test
    runpy.run_path(str(ROOT / "conftest.py"))                  # wraps what it finds there
    return kernel.start_new_kernel


def test_a_kernel_that_dies_at_start_up_is_started_once_more_and_says_why(monkeypatch):
    start, calls = _fake_start(deaths=1)
    with pytest.warns(RuntimeWarning, match="died at start-up.*Address already in use"):
        assert _wrapped(monkeypatch, start)(kernel_name="python3") == ("manager", "client")
    assert calls == ["python3", "python3"]


def test_a_second_death_and_other_errors_are_not_retried(monkeypatch):
    start, calls = _fake_start(deaths=2)
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="died before replying"):
        _wrapped(monkeypatch, start)(kernel_name="python3")
    assert len(calls) == 2
    start, calls = _fake_start(deaths=1, error="Kernel info request timed out")
    with pytest.raises(RuntimeError, match="timed out"):
        _wrapped(monkeypatch, start)(kernel_name="python3")
    assert len(calls) == 1
