"""benchmarks/_machine.py: the line `make benchmarks` prints before and after, saying whether this
machine's two CPUs gave steady speed — the reading to compare a missed ratio target with."""

import importlib.util
import os
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "_machine.py"


@pytest.fixture
def probe():
    spec = importlib.util.spec_from_file_location("_machine", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake(alone_s, together_s):
    def timed_on(cpus):
        return [alone_s] if len(cpus) == 1 else [together_s] * len(cpus)
    return timed_on


def test_two_cores_that_halve_each_other_are_called_not_steady(probe, monkeypatch, capsys):
    # what this AMD EPYC VM did on 2026-11-29: 55 ms alone, 1.85x that with both CPUs busy
    monkeypatch.setattr(probe, "timed_on", _fake(0.055, 0.055 * 1.85))
    assert probe.main(["_machine.py", "before"]) == 0          # a reading, never a failed target
    out = capsys.readouterr().out
    assert "machine (before)" in out and "1.85-1.85x the median alone" in out
    assert "NOT steady" in out


def test_two_free_cores_are_called_steady(probe, monkeypatch, capsys):
    monkeypatch.setattr(probe, "timed_on", _fake(0.060, 0.062))
    probe.main(["_machine.py", "after"])
    out = capsys.readouterr().out
    assert "machine (after)" in out and "steady: ratios below" in out and "NOT steady" not in out


def test_the_real_probe_runs_pinned_processes(probe):
    times = probe.timed_on(sorted(os.sched_getaffinity(0))[:1])
    assert len(times) == 1 and 0 < times[0] < 30


def test_a_probe_process_that_dies_is_reported_not_waited_for(probe, monkeypatch):
    monkeypatch.setattr(probe, "spin", lambda n=None: os._exit(3))      # the child dies before sending
    with pytest.raises(EOFError):
        probe.timed_on(sorted(os.sched_getaffinity(0))[:1])


def test_unpinned_cpus_are_measured_apart(probe, monkeypatch, capsys):
    monkeypatch.setattr(probe.os, "sched_getaffinity", None, raising=False)
    monkeypatch.delattr(probe.os, "sched_getaffinity")                  # as on macOS
    monkeypatch.setattr(probe, "timed_on", _fake(0.060, 0.062))
    probe.main(["_machine.py"])
    out = capsys.readouterr().out
    assert "unpinned: 60 ms, unpinned: 60 ms" in out and "steady: ratios below" in out
